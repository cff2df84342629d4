#!/usr/bin/env bash
# THE test command (README): every check CI runs, in order.
#
#   services   scripts/dockerd.sh start, scripts/postgres.sh start (idempotent):
#              the real dockerd and PostgreSQL the tests run against
#   fmt        cargo fmt --check (workspace and the fuzz crate)
#   clippy     cargo clippy --workspace --all-targets -- -D warnings
#   doc        cargo doc --workspace --no-deps with RUSTDOCFLAGS=-D warnings
#              (right after clippy: both check the dependencies the same way)
#   nextest    cargo nextest run --workspace --no-fail-fast (profile `ci` when CI=true)
#   doctests   cargo test --workspace --doc
#   loom       kici-admission's loom models (--cfg loom, own target dir;
#              the models take seconds even unoptimised), then the proof that
#              they and the stress test catch the check-then-act race: with
#              --features check-then-act-mutant the loom models and the stress
#              test must fail (their mutant variants expect the panic); each
#              step within $KICI_LOOM_TIMEOUT (default 10m)
#   benches    cargo test --workspace --bench '*' --no-run: compiled in the test
#              profile nextest already built, never run here (a bench-profile
#              build would compile every dependency again, optimised)
#   fuzz       scripts/fuzz.sh $KICI_FUZZ_SECONDS (default 60): nightly cargo fuzz;
#              fails, never skips, when the fuzz tooling cannot be installed
#
# Every stage runs even when an earlier one failed, so one run reports every
# problem; the script exits 1 if any stage failed. The last line counts the
# tests that ran: `tests: N passed, N failed, N skipped` (also written to
# $KICI_TEST_COUNTS_FILE when set: .ci/run ends with it).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"

fuzz_seconds="${KICI_FUZZ_SECONDS:-60}"
loom_timeout="${KICI_LOOM_TIMEOUT:-10m}"
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
nextest_profile=default
if [ "${CI:-}" = "true" ]; then nextest_profile=ci; fi

logs="$(mktemp -d "${TMPDIR:-/tmp}/kici-test.XXXXXX")"
trap 'rm -rf "$logs"' EXIT

passed=0
failed=0
skipped=0
summary=()
failed_stages=0
failed_tests=()

fmt_duration() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

stage() {
    local name="$1" start status rc
    shift
    printf '\n===== test stage: %s\n' "$name"
    start=$(date +%s)
    set +e
    "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 0 ]; then status=ok; else
        status="FAILED (exit $rc)"
        failed_stages=$((failed_stages + 1))
    fi
    local took=$(($(date +%s) - start))
    printf '===== test stage: %s: %s in %s\n' "$name" "$status" "$(fmt_duration "$took")"
    summary+=("$(printf '%-10s %-18s %s' "$name" "$status" "$(fmt_duration "$took")")")
}

# rustfmt colours its diff whenever TERM says it may, even into a CI log.
fmt_color=never
if [ -t 1 ]; then fmt_color=auto; fi

run_services() {
    scripts/dockerd.sh start &&
        scripts/postgres.sh start &&
        KICI_SCALER_TEST_POSTGRES="$(scripts/postgres.sh url)" &&
        export KICI_SCALER_TEST_POSTGRES &&
        printf 'services: dockerd answers; PostgreSQL at %s\n' "$KICI_SCALER_TEST_POSTGRES"
}

run_fmt() {
    cargo fmt --all -- --check --color "$fmt_color" &&
        cargo fmt --manifest-path fuzz/Cargo.toml -- --check --color "$fmt_color"
}

run_clippy() {
    cargo clippy --workspace --all-targets -- -D warnings
}

run_nextest() {
    local rc=0 line
    cargo nextest run --workspace --no-fail-fast --profile "$nextest_profile" 2>&1 |
        tee "$logs/nextest.log" || rc=$?
    # "Summary [ 1.2s] 42 tests run: 41 passed, 1 failed, 3 skipped"
    line="$(grep -E '^ *Summary .* tests? run:' "$logs/nextest.log" | tail -n 1 || true)"
    if [ -n "$line" ]; then
        passed=$((passed + $(count_of passed "$line")))
        failed=$((failed + $(count_of failed "$line") + $(count_of 'timed out' "$line")))
        skipped=$((skipped + $(count_of skipped "$line")))
    elif [ "$rc" -ne 0 ]; then
        failed=$((failed + 1)) # did not even get to run (build error)
    fi
    # "        FAIL [  12.345s] kici-scaler::it fleet::some_test": repeated in
    # the summary, since a long run's log is often read from its end only.
    while IFS= read -r line; do
        failed_tests+=("$line")
    done < <(grep -E '^ *(FAIL|TIMEOUT|SIGKILL|SIGSEGV|SIGABRT|LEAK-FAIL) \[' "$logs/nextest.log" | sed -E 's/^ +//' | sort -u || true)
    return "$rc"
}

run_doc() {
    RUSTDOCFLAGS="${RUSTDOCFLAGS:-} -D warnings" cargo doc --workspace --no-deps
}

run_doctests() {
    cargo_test_counted doctests --workspace --doc
}

# cargo_test_counted LOG ARGS...: `cargo test ARGS` (under the command in
# the array `time_limit` when a caller sets one, e.g. `timeout 10m`), its
# output also in $logs/LOG.log, its "test result:" lines added to the counts.
time_limit=()
cargo_test_counted() {
    local log="$logs/$1.log" rc=0 line
    shift
    "${time_limit[@]}" cargo test "$@" 2>&1 | tee "$log" || rc=$?
    # "test result: ok. 3 passed; 0 failed; 1 ignored; ..." once per binary
    while IFS= read -r line; do
        passed=$((passed + $(count_of passed "$line")))
        failed=$((failed + $(count_of failed "$line")))
        skipped=$((skipped + $(count_of ignored "$line")))
    done < <(grep -E '^test result:' "$log" || true)
    if [ "$rc" -ne 0 ] && ! grep -qE '^test result:' "$log"; then
        failed=$((failed + 1))
    fi
    return "$rc"
}

# The loom models only build under --cfg loom, which changes every crate's
# flags: they get a target dir of their own so that the main build's
# artifacts stay valid. The mutant runs pass when every model and the stress
# test see the race (their mutant variants are should_panic). The filters
# loom:: and stress:: select modules of kici-admission's one test binary.
run_loom() {
    local rc=0 loom=(-p kici-admission --test it --target-dir "$target_dir/loom")
    local time_limit=(timeout "$loom_timeout")
    RUSTFLAGS="${RUSTFLAGS:-} --cfg loom" \
        cargo_test_counted loom "${loom[@]}" -- loom:: || rc=1
    RUSTFLAGS="${RUSTFLAGS:-} --cfg loom" \
        cargo_test_counted loom-mutant "${loom[@]}" --features check-then-act-mutant -- loom:: || rc=1
    cargo_test_counted stress-mutant \
        -p kici-admission --test it --features check-then-act-mutant -- stress:: || rc=1
    return "$rc"
}

# count_of WORD LINE: the number just before WORD in LINE, or 0.
count_of() {
    local n
    n="$(printf '%s\n' "$2" | grep -oE "[0-9]+ $1" | head -n 1 | grep -oE '^[0-9]+' || true)"
    printf '%s' "${n:-0}"
}

run_benches() {
    # Only a compile check, in the test profile: nextest has built every
    # dependency for it already.
    cargo test --workspace --bench '*' --no-run
}

run_fuzz() {
    scripts/fuzz.sh "$fuzz_seconds"
}

stage services run_services
stage fmt run_fmt
stage clippy run_clippy
stage doc run_doc
stage nextest run_nextest
stage doctests run_doctests
stage loom run_loom
stage benches run_benches
stage fuzz run_fuzz

printf '\n===== test summary\n'
printf '%s\n' "${summary[@]}"
if [ "$failed_stages" -gt 0 ]; then
    printf '%d stage(s) failed\n' "$failed_stages"
fi
if [ ${#failed_tests[@]} -gt 0 ]; then
    printf 'failed test: %s\n' "${failed_tests[@]}"
fi
counts="$(printf 'tests: %d passed, %d failed, %d skipped' "$passed" "$failed" "$skipped")"
printf '%s\n' "$counts"
if [ -n "${KICI_TEST_COUNTS_FILE:-}" ]; then printf '%s\n' "$counts" >"$KICI_TEST_COUNTS_FILE"; fi
[ "$failed_stages" -eq 0 ]
