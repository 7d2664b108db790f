#!/usr/bin/env bash
# scripts/bench.sh — measure taskhub next to the database's own ceiling.
#
# Usage:  bash scripts/bench.sh                 (EVENTS=100000 WORKERS=8 DURATION=15 SSLMODE=disable)
#
# 1. makes sure Redis and PostgreSQL run (scripts/services.sh) and builds the
#    release benchmark (examples/bench.rs);
# 2. measures the ceilings with pgbench on a scratch database, at WORKERS
#    connections: the per-event transaction (BEGIN; insert processed_events;
#    insert notifications; COMMIT) and the 50-per-transaction form (one
#    multi-row insert per table);
# 3. drains EVENTS preloaded events (~200-byte JSON payloads) with taskhub in
#    per-event mode, in batch mode, in batch mode with a custom per-event
#    --sql statement, and the head-of-line case (10% of events fail twice
#    with a 1 s backoff) in both modes;
# 4. prints one table: events/s, latency, CPU per event, peak RSS, and each
#    rate as a ratio of the matching ceiling.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -f $HOME/.cargo/env ]]; then
    # shellcheck source=/dev/null
    source "$HOME/.cargo/env"
fi

EVENTS=${EVENTS:-100000}
WORKERS=${WORKERS:-8}
DURATION=${DURATION:-15}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
DATABASE_URL=${DATABASE_URL:-postgres://postgres:taskhub@127.0.0.1:5432/taskhub}
DATABASE_URL=${DATABASE_URL%%\?*}
# Loopback without TLS by default, like a local socket, for both pgbench and
# taskhub (SSLMODE=prefer measures with TLS on both sides).
SSLMODE=${SSLMODE:-disable}
# A scratch database next to the configured one.
BENCH_URL="${DATABASE_URL%/*}/taskhub_bench?sslmode=$SSLMODE"
ADMIN_URL="${DATABASE_URL%/*}/postgres?sslmode=$SSLMODE"
export RUST_LOG=${RUST_LOG:-warn}

bash scripts/services.sh >/dev/null
cargo build --release --quiet --example bench

psql "$ADMIN_URL" -X -q -v ON_ERROR_STOP=1 \
    -c "DROP DATABASE IF EXISTS taskhub_bench WITH (FORCE)" \
    -c "CREATE DATABASE taskhub_bench"
export DATABASE_URL=$BENCH_URL

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The migrations, through the benchmark binary's first run below; pgbench
# needs the tables first, so apply them now with a tiny run.
target/release/examples/bench --events 10 >/dev/null

cat >"$work/per_event.sql" <<'SQL'
\set n random(1, 2000000000)
BEGIN;
INSERT INTO processed_events (scope, event_id) VALUES ('pgbench', :client_id || '-' || :n) ON CONFLICT DO NOTHING;
INSERT INTO notifications (event_id, payload) VALUES (:client_id || '-' || :n, repeat('x', 200));
COMMIT;
SQL
cat >"$work/batch50.sql" <<'SQL'
BEGIN;
INSERT INTO processed_events (scope, event_id)
  SELECT 'pgbench50', md5(random()::text || g) FROM generate_series(1, 50) g ON CONFLICT DO NOTHING;
INSERT INTO notifications (event_id, payload)
  SELECT md5(random()::text || g), repeat('x', 200) FROM generate_series(1, 50) g;
COMMIT;
SQL

pgbench_tps() { # script
    pgbench -n -c "$WORKERS" -j 2 -T "$DURATION" -f "$1" "$BENCH_URL" 2>/dev/null |
        awk '/^tps = / { printf "%d\n", $3 }'
}
echo "measuring the ceilings with pgbench (${DURATION}s each, $WORKERS connections)..." >&2
ceiling_event=$(pgbench_tps "$work/per_event.sql")
ceiling_batch=$(($(pgbench_tps "$work/batch50.sql") * 50))

# One benchmark run; prints its RESULT line.
bench() { # label args...
    local label=$1
    shift
    echo "running: $label..." >&2
    local line
    line=$(target/release/examples/bench --events "$EVENTS" --workers "$WORKERS" "$@" | grep '^RESULT')
    echo "$label $line"
}

{
    bench per-event --mode per-event
    bench batch --mode batch
    # shellcheck disable=SC2016 # $1 and $2 are SQL parameters, not shell variables
    bench batch-custom-sql --mode batch --sql 'INSERT INTO notifications (event_id, payload) VALUES ($1, $2::text)'
    bench hol-per-event --mode per-event --fail-ratio 0.1 --fail-times 2 --backoff-base 1s
    bench hol-batch --mode batch --fail-ratio 0.1 --fail-times 2 --backoff-base 1s
} >"$work/results"

field() { # line name
    sed -E "s/.* $2=([^ ]+).*/\1/" <<<"$1"
}
printf '\nceilings (pgbench, %d connections): per-event transaction %d tps; 50 per transaction %d events/s\n\n' \
    "$WORKERS" "$ceiling_event" "$ceiling_batch"
printf '%-18s %10s %10s %9s %9s %9s %8s %s\n' run events/s healthy/s p50_ms p99_ms cpu_us rss_MB "vs ceiling"
while read -r label line; do
    rate=$(field "$line" rate)
    ceiling=$ceiling_batch
    [[ $label == *per-event* ]] && ceiling=$ceiling_event
    printf '%-18s %10s %10s %9s %9s %9s %8.1f %.0f%%\n' "$label" "$rate" \
        "$(field "$line" healthy_rate)" "$(field "$line" p50_ms)" "$(field "$line" p99_ms)" \
        "$(field "$line" cpu_us)" "$(awk "BEGIN { print $(field "$line" rss_kb) / 1024 }")" \
        "$(awk "BEGIN { print 100 * $rate / $ceiling }")"
done <"$work/results"
cat <<EOF

hol-*: 10% of events fail twice with a 1 s backoff; healthy/s is the drain
rate of the other 90%, to compare with the clean run of the same mode.
EOF
