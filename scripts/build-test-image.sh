#!/usr/bin/env bash
# Builds the container test image `FROM scratch`: the static musl
# kici-agent-lite as entrypoint, plus busybox-static (/bin/busybox and its
# common applets) for debugging and for test commands. No registry is
# needed: the image is built locally by dockerd (or Podman) and printed.
#
#   scripts/build-test-image.sh                  tag kici-agent-lite:test, docker
#   scripts/build-test-image.sh TAG              another tag
#   KICI_IMAGE_CLI=podman scripts/build-test-image.sh   build with podman
#
# The agent binary comes from $KICI_AGENT_BIN when set, else from
# scripts/build-agent-musl.sh (honours CARGO_TARGET_DIR).
set -euo pipefail

tag="${1:-kici-agent-lite:test}"
cli="${KICI_IMAGE_CLI:-docker}"

log() { printf 'build-test-image: %s\n' "$*" >&2; }

cd "$(dirname "$0")/.."

agent="${KICI_AGENT_BIN:-}"
if [ -z "$agent" ]; then
    agent="$(scripts/build-agent-musl.sh)"
fi
[ -x "$agent" ] || { log "no agent binary at $agent"; exit 1; }
busybox="$(command -v busybox || true)"
if [ -z "$busybox" ] || ! file -L "$busybox" 2>/dev/null | grep -q 'statically linked'; then
    busybox=/bin/busybox
fi
[ -x "$busybox" ] || { log "busybox-static is required (apt-get install busybox-static)"; exit 1; }

ctx="$(mktemp -d "${TMPDIR:-/tmp}/kici-test-image.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT
cp "$agent" "$ctx/kici-agent-lite"
cp "$busybox" "$ctx/busybox"
{
    echo "FROM scratch"
    echo "COPY busybox /bin/busybox"
    for applet in sh sleep cat ls env nc wget touch; do
        echo "COPY busybox /bin/$applet"
    done
    echo "COPY kici-agent-lite /usr/local/bin/kici-agent-lite"
    echo 'ENV PATH=/usr/local/bin:/bin'
    echo 'ENTRYPOINT ["/usr/local/bin/kici-agent-lite"]'
} >"$ctx/Dockerfile"

if [ "$cli" = docker ]; then
    # dockerd 20.10 without buildx: the classic builder.
    DOCKER_BUILDKIT=0 docker build -q -t "$tag" "$ctx" >/dev/null
else
    "$cli" build -q -t "$tag" "$ctx" >/dev/null
fi
log "built $tag with $cli"
echo "$tag"
