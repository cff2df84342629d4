#!/usr/bin/env bash
# A provisioner command for a `type: event` scaler, written against a cloud
# CLI. This one uses the AWS CLI; the shape is the same for gcloud, az,
# hcloud or doctl: create a tagged instance on scale-up, delete what carries
# the tag on scale-down, and make both idempotent.
#
# Configure it as
#
#   x-kici-scaler:
#     provisioner:
#       command: ["/usr/local/lib/kici/cloud-provision.sh"]
#       env:
#         CLOUD_REGION: eu-west-1
#         CLOUD_IMAGE_ID: ami-0123456789abcdef0
#         CLOUD_SUBNET_ID: subnet-0123456789abcdef0
#         CLOUD_SECURITY_GROUP: sg-0123456789abcdef0
#       passEnv: [AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN]
#       timeoutSeconds: 120
#
# The contract (see examples/provisioners/README.md):
#   - the event JSON arrives on stdin; PROVISION_EVENT (scale-up |
#     scale-down), PROVISION_REQUEST_ID and PROVISION_AGENT_ID are set too;
#   - exit 0 = done. Anything else (or running past timeoutSeconds, after
#     which the whole process group is killed) is retried with backoff, so
#     every step must be safe to run twice;
#   - the same event may be delivered more than once (after a retry or a
#     daemon restart): deduplicate on requestId / agentId, as below;
#   - stdout and stderr end up in kici-scaler's log (the first 64 KiB of
#     each): never print the claim code.
#
# Needs: bash, jq, the cloud CLI with credentials in this process's
# environment. The command gets nothing of kici-scaler's environment but
# PATH, HOME, LANG and LC_ALL: the settings below come from the scaler's
# `provisioner.env`, the credentials from the daemon's environment through
# `passEnv` (an instance role or a credentials file under HOME works too).

set -euo pipefail

# --- settings you will change --------------------------------------------
REGION="${CLOUD_REGION:-eu-west-1}"
IMAGE_ID="${CLOUD_IMAGE_ID:-ami-0123456789abcdef0}"   # an image with kici-agent-lite at /usr/local/bin
SUBNET_ID="${CLOUD_SUBNET_ID:-subnet-0123456789abcdef0}"
SECURITY_GROUP="${CLOUD_SECURITY_GROUP:-sg-0123456789abcdef0}"
# --------------------------------------------------------------------------

event_json="$(cat)"
field() { jq -r "$1" <<<"$event_json"; }

agent_id="$(field .agentId)"
request_id="$(field .requestId)"

# Pick an instance size from the agent's resources (requests, cores and
# bytes). Zero means the job asked for nothing in particular.
instance_type() {
    local cpus mem_gib
    cpus="$(field '.resources.requests.cpus')"
    mem_gib="$(field '(.resources.requests.memoryBytes / 1073741824) | ceil')"
    if awk "BEGIN { exit !($cpus > 4 || $mem_gib > 16) }"; then
        echo m7i.2xlarge
    elif awk "BEGIN { exit !($cpus > 2 || $mem_gib > 8) }"; then
        echo m7i.xlarge
    else
        echo m7i.large
    fi
}

# Instances this agent id already has (not terminated).
existing_instances() {
    aws ec2 describe-instances --region "$REGION" \
        --filters "Name=tag:kici-agent-id,Values=$agent_id" \
                  "Name=instance-state-name,Values=pending,running,stopping,stopped" \
        --query 'Reservations[].Instances[].InstanceId' --output text
}

case "$PROVISION_EVENT" in
scale-up)
    # A redelivery of a scale-up we already acted on: nothing to do.
    if [ -n "$(existing_instances)" ]; then
        echo "instance for $agent_id already exists (request $request_id); nothing to do"
        exit 0
    fi

    claim_code="$(field .claimCode)"
    claim_url="$(field .claimUrl)"

    # The instance starts the agent at boot with the claim in its
    # environment (not on its command line: arguments are visible to every
    # user of the instance). The code is single use and expires at
    # .expiresAt, so user data that outlives the boot is harmless.
    user_data="$(cat <<USERDATA
#!/bin/sh
cat > /etc/kici-agent.env <<ENV
KICI_CLAIM_CODE=$claim_code
KICI_CLAIM_URL=$claim_url
ENV
chmod 600 /etc/kici-agent.env
set -a; . /etc/kici-agent.env; set +a
# When the agent leaves (its job done), power off: the scale-down that
# follows deletes the instance either way.
/usr/local/bin/kici-agent-lite; shutdown -h now
USERDATA
)"

    aws ec2 run-instances --region "$REGION" \
        --image-id "$IMAGE_ID" \
        --instance-type "$(instance_type)" \
        --subnet-id "$SUBNET_ID" \
        --security-group-ids "$SECURITY_GROUP" \
        --instance-initiated-shutdown-behavior terminate \
        --user-data "$user_data" \
        --tag-specifications "ResourceType=instance,Tags=[{Key=kici-agent-id,Value=$agent_id},{Key=kici-request-id,Value=$request_id},{Key=kici-scaler,Value=$(field .scaler)}]" \
        --query 'Instances[0].InstanceId' --output text
    ;;

scale-down)
    # Idempotent: a scale-down for an instance that never booted, or one
    # already deleted, finds nothing and succeeds.
    ids="$(existing_instances)"
    if [ -z "$ids" ]; then
        echo "no instance for $agent_id (reason $(field .reason)); nothing to delete"
        exit 0
    fi
    # shellcheck disable=SC2086 # one id per word
    aws ec2 terminate-instances --region "$REGION" --instance-ids $ids --output text
    ;;

*)
    echo "unknown event ${PROVISION_EVENT:-<unset>}; ignoring" >&2
    # Exit 0: a newer kici-scaler's event this script does not know must
    # not be retried forever.
    exit 0
    ;;
esac
