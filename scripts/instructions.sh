#!/usr/bin/env bash
# scripts/instructions.sh — our CPU per event as a count of instructions,
# which does not move with the machine's load the way seconds do.
#
# Usage:  bash scripts/instructions.sh [batch|per-event] [EVENTS]   (batch, 20000)
#
# Runs the release benchmark (examples/bench.rs) under valgrind's callgrind,
# which counts the instructions each thread executes, on EVENTS preloaded
# events, and prints the instructions per event of the worker's threads (the
# readers, the worker threads, the ack, retry and dead-letter threads): all
# but the main thread, which only preloads the events and checks the result.
# The same binary and inputs give the same count within about 1%, with
# the other core busy or not, where the CPU seconds of `scripts/bench.sh`
# vary by 10-40% between runs of the same code (docs/performance-log.md).
# Per event it reads 16 entries at a time (`--count 16`): under valgrind
# the worker runs about 50 times slower, and with the default 64 an entry
# could wait in the queue past the second after which it takes the path of
# an entry held long (BEGIN, the ownership check, COMMIT): the same binary
# counted 31,319 and 48,409 instructions per event in two runs.
# It does not count the kernel's time (system calls, switches) nor cache
# misses: it compares two versions of our own code, not their speed.
#
# The database and Redis are those of the benchmark: DATABASE_URL (a
# scratch database: the run adds its events' rows to it, under a scope of
# its own, and takes nothing away) and REDIS_URL (the benchmark deletes its
# own keys). Under valgrind the worker runs about 50x slower,
# so the timings in the benchmark's own report mean nothing here.
# BENCH_BIN: the absolute path of a benchmark binary already built (the
# tests pass theirs), instead of building the release one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -f $HOME/.cargo/env ]]; then
    # shellcheck source=/dev/null
    source "$HOME/.cargo/env"
fi

mode=${1:-batch}
events=${2:-20000}
case $mode in
batch | per-event) ;;
*)
    echo "instructions: the mode is batch or per-event, not '$mode'" >&2
    exit 2
    ;;
esac
if ! [[ $events =~ ^[1-9][0-9]*$ ]]; then
    echo "instructions: EVENTS must be a whole number of at least 1, not '$events'" >&2
    exit 2
fi
command -v valgrind >/dev/null 2>&1 || {
    echo "instructions: valgrind not found (Debian: apt-get install valgrind)" >&2
    exit 1
}
: "${DATABASE_URL:?set DATABASE_URL to a scratch database (the run adds rows to it)}"
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
export RUST_LOG=${RUST_LOG:-warn}

bench=${BENCH_BIN:-}
if [[ -n $bench && ! ( $bench == /* && -x $bench ) ]]; then
    echo "instructions: BENCH_BIN must be the absolute path of a benchmark binary, not '$bench'" >&2
    exit 2
fi
if [[ -z $bench ]]; then
    cargo build --release --quiet --example bench
    bench=$PWD/target/release/examples/bench
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

count=()
[[ $mode == per-event ]] && count=(--count 16)
(cd "$work" && valgrind --tool=callgrind --separate-threads=yes \
    "$bench" --mode "$mode" --events "$events" "${count[@]}" >report.txt 2>valgrind.txt) || {
    cat "$work/valgrind.txt" "$work/report.txt" >&2
    exit 1
}
grep -Eq "^applied +$events " "$work/report.txt" || {
    echo "instructions: the run did not apply all $events events:" >&2
    cat "$work/report.txt" >&2
    exit 1
}
# One file per thread, callgrind.out.PID-NN; thread 01 is the main thread.
total=0
for f in "$work"/callgrind.out.*-*; do
    [[ $f == *-01 ]] && continue
    n=$(awk '/^summary:/ {print $2; exit}' "$f")
    total=$((total + n))
done
echo "instructions per event: $((total / events)) ($mode, $events events, worker threads)"
