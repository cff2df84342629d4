#!/bin/sh
# A provisioner command for a `type: event` scaler that boots each
# "instance" as a Linux network namespace on this host: its own address on
# a veth pair to the host, and `kici-agent-lite` (KICI_CLAIM_CODE,
# KICI_CLAIM_URL) started inside,
# reaching kici-scaler only over that link. Scale-down kills what runs in
# the namespace and deletes it (the veth pair goes with it). It is what the
# integration tests run; it is also a small, complete example of the
# contract (run as root: it creates namespaces and links).
#
# The event JSON arrives on stdin; PROVISION_EVENT, PROVISION_REQUEST_ID
# and PROVISION_AGENT_ID say which one without parsing. Exit 0 = done (the daemon
# retries anything else). Both events may come twice (at-least-once
# delivery), and a scale-down may come for an instance never booted: each
# step below is idempotent.
#
# Settings, in its environment (the command gets nothing else of the
# daemon's: name them in the scaler's `provisioner.env`, or in `passEnv` to
# take them from the daemon's environment):
#   NETNS_PREFIX     first two octets of the instances' /30 links (e.g. 10.213)
#   NETNS_AGENT      path of kici-agent-lite
#   NETNS_LOG_DIR    where each instance's agent log and the events go
set -eu

event=$(cat)
agent=$PROVISION_AGENT_ID
hex=${agent##*-}              # the agent id's 8 hex digits: unique per agent
ns="kici-$hex"
host_if="kh$hex"              # ≤ 15 characters, as link names must be
guest_if="kg$hex"
log_dir=${NETNS_LOG_DIR:-/tmp}
printf '%s\n' "$event" >>"$log_dir/events.jsonl"

# A /30 per instance, from the id: 10.213.<a>.<b>/30.
a=$(printf '%d' "0x$(printf '%s' "$hex" | cut -c1-2)")
b=$(( $(printf '%d' "0x$(printf '%s' "$hex" | cut -c3-4)") & 252 ))
host_ip="$NETNS_PREFIX.$a.$((b + 1))"
guest_ip="$NETNS_PREFIX.$a.$((b + 2))"

case "$PROVISION_EVENT" in
scale-up)
    code=$(printf '%s' "$event" | jq -r .claimCode)
    url=$(printf '%s' "$event" | jq -r .claimUrl)
    if ! ip netns list | grep -qw "$ns"; then
        ip netns add "$ns"
        ip link add "$host_if" type veth peer name "$guest_if"
        ip link set "$guest_if" netns "$ns"
        ip addr add "$host_ip/30" dev "$host_if"
        ip link set "$host_if" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$guest_ip/30" dev "$guest_if"
        ip -n "$ns" link set "$guest_if" up
        # The only way out is the host end of the link.
        ip -n "$ns" route add default via "$host_ip"
    fi
    # Detached (its own session, no pipes back to the daemon): it outlives
    # this command, like an instance outlives its provisioning call. It
    # inherits this command's environment as it is: none of it is a KICI_*
    # name the agent would refuse. The code goes in the environment, never
    # on a command line (which any local user can read).
    KICI_CLAIM_CODE="$code" KICI_CLAIM_URL="$url" \
        ip netns exec "$ns" setsid "$NETNS_AGENT" \
        </dev/null >"$log_dir/$ns.log" 2>&1 &
    ;;
scale-down)
    if ip netns list | grep -qw "$ns"; then
        for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns"
    fi
    ip link del "$host_if" 2>/dev/null || true
    ;;
esac
