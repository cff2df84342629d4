#!/usr/bin/env bash
# Bounded fuzzing of the config loader: `scripts/fuzz.sh SECONDS` (default 60).
#
# Seeds fuzz/corpus/load_config (git-ignored) from every YAML file under
# crates/config/tests/fixtures and examples/, then runs
# `cargo +nightly fuzz run load_config` for SECONDS. Needs the nightly
# toolchain and cargo-fuzz; installs them when missing and FAILS (never
# skips) when they cannot be installed. A crash leaves its input under
# fuzz/artifacts/load_config/ and makes this script exit non-zero.
set -euo pipefail

seconds="${1:-60}"
case "$seconds" in
    '' | *[!0-9]*) echo "usage: $0 [SECONDS]" >&2; exit 64 ;;
esac

repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
target=load_config
corpus="fuzz/corpus/$target"

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: nightly toolchain or cargo-fuzz missing; installing" >&2
    scripts/install-deps.sh --fuzz-only
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: FAILED: cargo +nightly fuzz is still unavailable after install-deps" >&2
    exit 1
fi

# Seed corpus. The fuzz target splits its input on NUL bytes into a main
# document and up to 3 drop-ins, so each YAML file is a one-document seed and
# each scalers.yaml beside a scalers.d/ becomes a joined multi-document seed.
mkdir -p "$corpus"
seeds=0
while IFS= read -r -d '' file; do
    # Flatten the path into a unique seed name.
    name="seed-$(printf '%s' "$file" | tr '/' '_')"
    cp "$file" "$corpus/$name"
    seeds=$((seeds + 1))
done < <(find crates/config/tests/fixtures examples \( -name '*.yaml' -o -name '*.yml' \) -type f -print0 2>/dev/null | sort -z)
while IFS= read -r -d '' dropdir; do
    main="$(dirname "$dropdir")/scalers.yaml"
    [ -f "$main" ] || continue
    name="seed-joined-$(printf '%s' "$dropdir" | tr '/' '_')"
    {
        cat "$main"
        find "$dropdir" -maxdepth 1 \( -name '*.yaml' -o -name '*.yml' \) -type f -print0 | sort -z |
            head -z -n 3 | while IFS= read -r -d '' dropin; do
                printf '\0'
                cat "$dropin"
            done
    } >"$corpus/$name"
    seeds=$((seeds + 1))
done < <(find crates/config/tests/fixtures examples -type d -name scalers.d -print0 2>/dev/null | sort -z)
echo "fuzz: $seeds seed files copied into $corpus ($(find "$corpus" -type f | wc -l) inputs in the corpus)" >&2

# Keep nightly/sanitizer artifacts apart from the stable build's.
target_dir_args=()
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
    target_dir_args=(--target-dir "$CARGO_TARGET_DIR/fuzz")
fi

# libFuzzer prints a line per corpus change (tens of thousands in a minute):
# that goes to a log, and only the closing statistics are shown, or the log's
# last 200 lines when the run fails (the crash report and its input's path).
log="$(mktemp "${TMPDIR:-/tmp}/kici-fuzz.XXXXXX")"
trap 'rm -f "$log"' EXIT
echo "fuzz: running $target for ${seconds}s" >&2
rc=0
cargo +nightly fuzz run --debug-assertions "${target_dir_args[@]}" "$target" "$corpus" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1 || rc=$?
if [ "$rc" -eq 0 ]; then
    grep -E '^(#[0-9]+[[:space:]]+DONE|Done |stat::)' "$log" || true
else
    tail -n 200 "$log"
    echo "fuzz: FAILED (exit $rc)" >&2
fi
exit "$rc"
