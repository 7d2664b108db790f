#!/usr/bin/env bash
# scripts/bench.sh — measure taskhub next to the database's own ceiling.
#
# Usage:  bash scripts/bench.sh    (EVENTS=100000 WORKERS=8 DURATION=15 CAPACITY_SECS=20 STEADY_SECS=30 PAIRS=3 SSLMODE=disable
#                                   DISK_PROBE_DIR=<a temporary directory>)
#
# The database measured: by default a private PostgreSQL (initdb in a
# temporary directory on the disk, a free port, initdb's settings but
# max_wal_size=16GB, so that its checkpoints come from the clock and not
# from the WAL a fast run writes: see "Deploying" in the README), stopped
# and removed at the end; DATABASE_URL is then ignored. fsync and
# synchronous_commit stay on.
#         PG_PRIVATE="max_wal_size=16GB shared_buffers=256MB" bash scripts/bench.sh
#                                  a private PostgreSQL with these settings
#         PG_PRIVATE=off bash scripts/bench.sh    (or PG_PRIVATE="")
#                                  the server DATABASE_URL names, as it is set
#                                  up (scripts/services.sh starts one if none
#                                  runs at 127.0.0.1:5432)
# Where initdb/pg_ctl are missing, or the temporary directory is on tmpfs,
# the default falls back to DATABASE_URL's server and says so; a PG_PRIVATE
# that was asked for stops the run instead.
#
# 1. makes sure Redis and PostgreSQL run (scripts/services.sh) and builds the
#    release benchmark (examples/bench.rs);
# 2. picks one path to the database for the ceilings and for taskhub alike:
#    the server's local socket when it takes our login there (as a worker on
#    the same VM would connect), else TCP;
# 3. measures the ceilings with pgbench on a scratch database, at WORKERS
#    connections: the per-event transaction (BEGIN; insert processed_events;
#    insert notifications; COMMIT) and the 50-per-transaction form (one
#    multi-row insert per table), each before and after the runs of its
#    mode (4.), so a drift of the machine shows; every measurement, these
#    and taskhub's, starts from empty tables and a fresh checkpoint;
# 4. drains EVENTS preloaded events (~200-byte JSON payloads) with taskhub in
#    per-event mode, in batch mode, in batch mode with a custom per-event
#    --sql statement, and the head-of-line case (10% of events fail twice
#    with a 1 s backoff) in both modes and with the custom statement (where
#    every batch with a failing event takes its dedup row back), and in
#    batch mode the same events with no failure, and 1% of events that the
#    database rejects (a CHECK constraint of the scratch notifications);
#    the batch runs clean, with failures and with no failure go side by
#    side PAIRS times, each pair compared on its own;
# 5. steady load, both modes: the mode's capacity with a producer on the
#    machine (a producer at 1.3x its drain rate for CAPACITY_SECS seconds;
#    the rate committed while it ran); then a producer at 50%, 75% and 90%
#    of that capacity, for STEADY_SECS seconds each, with the latency from
#    XADD to commit (p50 / p99 / max), Redis's tables of keys first sized
#    for the run's markers (bench --presize), and the 75% load once more on
#    tables that grow (growing-*); and, as its floor, the database
#    alone at the same rate of events for as long (pgbench -R, prepared:
#    per-event, one statement per event, taskhub's fused form; batch, 50
#    events per transaction), latency from each transaction's scheduled
#    start to its end; and the database alone at 75% of its own ceiling in
#    those forms; beside each steady run, a probe of the disk (an 8 KiB
#    write and fdatasync, then 10 ms asleep, in DISK_PROBE_DIR, which
#    should be on the database's disk: bench --disk-probe) counts its
#    stalls;
# 6. prints two tables: events/s, latency, CPU per event, peak RSS, the
#    host's steal during each run, the passes of autovacuum over the two
#    tables that ended during it (autovac), and each rate as a ratio of the
#    matching ceiling; then the steady runs beside the database alone;
# 7. with valgrind, our instructions per event in a drain of each mode
#    (scripts/instructions.sh), which the machine's load does not move.
set -euo pipefail
# Where the steady runs probe the disk for stalls (bench --disk-probe):
# every commit waits for the database's WAL to reach its disk, so this
# should be on that disk. A relative path is the caller's.
if [[ -n ${DISK_PROBE_DIR:-} ]]; then
    if ! DISK_PROBE_DIR=$(cd -- "$DISK_PROBE_DIR" 2>/dev/null && pwd) ||
        ! [[ -w $DISK_PROBE_DIR && -x $DISK_PROBE_DIR ]]; then
        echo "bench: DISK_PROBE_DIR must be a directory this user may create files in" >&2
        exit 2
    fi
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -f $HOME/.cargo/env ]]; then
    # shellcheck source=/dev/null
    source "$HOME/.cargo/env"
fi

EVENTS=${EVENTS:-100000}
WORKERS=${WORKERS:-8}
DURATION=${DURATION:-15}
STEADY_SECS=${STEADY_SECS:-30}
CAPACITY_SECS=${CAPACITY_SECS:-20}
# Pairs of batch runs, clean and with failures (then with no failure),
# side by side.
PAIRS=${PAIRS:-3}
if ! [[ $PAIRS =~ ^[1-9][0-9]*$ ]]; then
    echo "bench: PAIRS must be a whole number of at least 1, not '$PAIRS'" >&2
    exit 2
fi
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
# A private PostgreSQL, with settings of its own (PG_PRIVATE), by default.
PG_PRIVATE_ASKED=${PG_PRIVATE+yes}
PG_PRIVATE=${PG_PRIVATE-max_wal_size=16GB}
if [[ $PG_PRIVATE == off ]]; then PG_PRIVATE=""; fi
PG_PRIVATE_DIR=""
# No private server after all: stop if one was asked for, else say why and
# measure DATABASE_URL's server.
no_private_pg() {
    if [[ -n $PG_PRIVATE_ASKED ]]; then
        echo "bench: $1" >&2
        exit 2
    fi
    echo "bench: $1; measuring the server of DATABASE_URL instead, as it is set up (PG_PRIVATE=off asks for that without this message)" >&2
    PG_PRIVATE=""
}
stop_private_pg() {
    if [[ -n $PG_PRIVATE_DIR ]]; then
        as_pg "$PG_BIN/pg_ctl" -D "$PG_PRIVATE_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
        rm -rf "$PG_PRIVATE_DIR"
    fi
}
if [[ -n $PG_PRIVATE ]]; then
    # shellcheck source=pg_bin_dir.sh
    source scripts/pg_bin_dir.sh
    PG_BIN=$(pg_bin_dir) || no_private_pg "initdb/pg_ctl not found for a private PostgreSQL (set TASKHUB_PG_BIN)"
fi
if [[ -n $PG_PRIVATE ]]; then
    PG_PRIVATE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/taskhub-bench-pg.XXXXXX")
    if [[ $(stat -f -c %T "$PG_PRIVATE_DIR") == tmpfs ]]; then
        rmdir "$PG_PRIVATE_DIR"
        PG_PRIVATE_DIR=""
        no_private_pg "${TMPDIR:-/tmp} is on tmpfs (memory): a private PostgreSQL's commits there would not wait for a disk (set TMPDIR to a directory on the disk)"
    fi
fi
if [[ -n $PG_PRIVATE ]]; then
    # initdb and postgres refuse to run as root: root hands over to `postgres`.
    as_pg() { if [[ $EUID -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }
    chmod 755 "$PG_PRIVATE_DIR"
    if [[ $EUID -eq 0 ]]; then chown postgres "$PG_PRIVATE_DIR"; fi
    trap stop_private_pg EXIT
    pg_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    as_pg "$PG_BIN/initdb" -D "$PG_PRIVATE_DIR/data" -A trust -U postgres -E UTF8 >/dev/null
    {
        echo "port = $pg_port"
        echo "listen_addresses = '127.0.0.1'"
        echo "unix_socket_directories = '$PG_PRIVATE_DIR'"
        for setting in $PG_PRIVATE; do echo "${setting%%=*} = '${setting#*=}'"; done
    } | as_pg tee -a "$PG_PRIVATE_DIR/data/postgresql.conf" >/dev/null
    as_pg "$PG_BIN/pg_ctl" -D "$PG_PRIVATE_DIR/data" -l "$PG_PRIVATE_DIR/log" -w -t 60 start >/dev/null
    DATABASE_URL=postgres://postgres@127.0.0.1:$pg_port/postgres
    echo "bench: a private PostgreSQL on port $pg_port with $PG_PRIVATE (log: $PG_PRIVATE_DIR/log)"
fi
DATABASE_URL=${DATABASE_URL:-postgres://postgres:taskhub@127.0.0.1:5432/taskhub}
DATABASE_URL=${DATABASE_URL%%\?*}
# Loopback without TLS by default, like a local socket, for both pgbench and
# taskhub (SSLMODE=prefer measures with TLS on both sides).
SSLMODE=${SSLMODE:-disable}
# A scratch database next to the configured one.
BENCH_URL="${DATABASE_URL%/*}/taskhub_bench?sslmode=$SSLMODE"
ADMIN_URL="${DATABASE_URL%/*}/postgres?sslmode=$SSLMODE"
export RUST_LOG=${RUST_LOG:-warn}

# Redis, and the server of DATABASE_URL unless a private one is measured.
if [[ -n $PG_PRIVATE ]]; then
    TASKHUB_SERVICES=redis bash scripts/services.sh >/dev/null
else
    bash scripts/services.sh >/dev/null
fi
cargo build --release --quiet --example bench

psql "$ADMIN_URL" -X -q -v ON_ERROR_STOP=1 \
    -c "DROP DATABASE IF EXISTS taskhub_bench WITH (FORCE)" \
    -c "CREATE DATABASE taskhub_bench"

# The same path for pgbench and taskhub: the local socket if we can log in
# through it, else TCP.
db_path="TCP ${BENCH_URL#*@}"
db_path=${db_path%%/*}
socket_dir=$(psql "$ADMIN_URL" -XAtc "SHOW unix_socket_directories" | cut -d, -f1 | xargs)
port=$(psql "$ADMIN_URL" -XAtc "SHOW port")
userinfo=${DATABASE_URL#*://}
userinfo=${userinfo%%@*}
if [[ -n $socket_dir && -S $socket_dir/.s.PGSQL.$port ]]; then
    socket_url="postgres://$userinfo@${socket_dir//\//%2F}:$port/taskhub_bench"
    if psql "$socket_url" -XAtc "SELECT 1" >/dev/null 2>&1; then
        BENCH_URL=$socket_url
        db_path="local socket $socket_dir"
    fi
fi
export DATABASE_URL=$BENCH_URL

work=$(mktemp -d)
trap 'stop_private_pg; rm -rf "$work"' EXIT
# By default the probe's file goes in the temporary directory, which may
# not be on the database's disk (see DISK_PROBE_DIR above).
probe_where=${DISK_PROBE_DIR:-"this run's temporary directory (DISK_PROBE_DIR not set: it may not be on the database's disk)"}
DISK_PROBE_DIR=${DISK_PROBE_DIR:-$work}

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

# The floors of the steady runs write rows as wide as the benchmark's (a
# 38-byte scope and event ids, a 200-byte JSON payload), so that the
# database alone writes as much WAL as under taskhub and meets the same
# checkpoints: at 27,000 events/s, 1 GB of max_wal_size asks for one about
# 20 s into a 30 s run, and narrower rows ran past it.
# Per-event: the dedup insert and the effect as one statement, its own
# transaction, as taskhub's fused form sends it.
cat >"$work/per_event_one.sql" <<'SQL'
\set n random(1, 2000000000)
WITH done AS (INSERT INTO processed_events (scope, event_id) VALUES ('bench-0123456789abcdef0123456789abcdef', md5(:client_id || '-' || :n) || '-' || :n) ON CONFLICT DO NOTHING RETURNING event_id)
  INSERT INTO notifications (event_id, payload) SELECT event_id, '{"n":' || :n || ',"kind":"bench","pad":"' || repeat('x', 140) || '"}' FROM done;
SQL
# Batch: 50 events per transaction.
cat >"$work/floor50.sql" <<'SQL'
BEGIN;
INSERT INTO processed_events (scope, event_id)
  SELECT 'bench-0123456789abcdef0123456789abcdef', md5(random()::text || g) || '-' || g FROM generate_series(1, 50) g ON CONFLICT DO NOTHING;
INSERT INTO notifications (event_id, payload)
  SELECT md5(random()::text || g) || '-' || g, '{"n":' || g || ',"kind":"bench","pad":"' || repeat('x', 140) || '"}' FROM generate_series(1, 50) g;
COMMIT;
SQL

# Every measurement, ceiling or taskhub, starts from empty tables and a
# fresh checkpoint: the 50-per-transaction ceiling alone adds about a
# million rows, and a run after it would pay for bigger indexes and the
# checkpoint it triggers.
fresh_tables() {
    psql "$BENCH_URL" -X -q -v ON_ERROR_STOP=1 \
        -c "TRUNCATE processed_events, notifications" -c "CHECKPOINT"
}

pgbench_tps() { # script [pgbench flags...]
    local script=$1
    shift
    fresh_tables
    pgbench -n "$@" -c "$WORKERS" -j 2 -T "$DURATION" -f "$script" "$BENCH_URL" 2>/dev/null |
        awk '/^tps = / { printf "%d\n", $3 }'
}
# The database alone at a steady rate: prints "p50_ms=.. p99_ms=.. max_ms=.."
# over every transaction, from its scheduled start (so a stall's queue
# counts, as it does for taskhub's events) to its end. Prepared statements,
# as taskhub sends them: pgbench's default (a simple query, parsed and
# planned each time) gets about 40% fewer transactions per second through
# here (5,711 against 9,844-10,269 tps), and put the floor of the per-event
# runs at its own limit. A pgbench that fails shows as "failed".
# The host's steal is sampled beside it, and the transactions whose flight
# met none of its bursts are counted apart (calm_*: see examples/bench.rs),
# as for taskhub's steady runs.
pgbench_latency() { # script transactions-per-second
    fresh_tables
    rm -f "$work"/pgl.* "$work/steal"
    target/release/examples/bench --watch-steal "$work/steal" --duration "$((STEADY_SECS + 3))s" \
        --disk-probe "$DISK_PROBE_DIR" &
    local watching=$!
    if ! pgbench -n -M prepared -c "$WORKERS" -j 2 -T "$STEADY_SECS" -R "$2" -l --log-prefix="$work/pgl" \
        -f "$1" "$BENCH_URL" >/dev/null 2>&1; then
        kill "$watching" 2>/dev/null || true
        wait "$watching" 2>/dev/null || true
        echo "bench: pgbench -R $2 -f $(basename "$1") failed" >&2
        echo "p50_ms=failed p99_ms=failed max_ms=failed"
        return
    fi
    # No samples (the watcher failed): no calm figures, rather than another
    # run's.
    wait "$watching" || echo "bench: the steal watcher failed; no calm figures for this run" >&2
    cat "$work"/pgl.* | awk '{ print $3 }' | sort -n | awk '{ a[NR] = $1 } END {
        printf "p50_ms=%.2f p99_ms=%.2f max_ms=%.2f ", a[int(NR * 0.5)] / 1000, a[int(NR * 0.99)] / 1000, a[NR] / 1000 }'
    # Each transaction's end (epoch seconds and microseconds) and latency.
    [[ -s $work/steal ]] || { echo; return; }
    cat "$work"/pgl.* | awk '{ printf "%d%06d %d\n", $5, $6, $3 }' |
        target/release/examples/bench --calm-latency "$work/steal"
}

# pgbench_latency, and the passes of autovacuum that ended while it ran
# (its window also holds the tables' TRUNCATE and CHECKPOINT, and the 3 s
# the steal watcher outlives pgbench).
floor_latency() { # script transactions-per-second
    local before line
    before=$(maintenance)
    line=$(pgbench_latency "$@")
    echo "$line autovacuum=$(passes_since "$before")"
}

# A figure of a RESULT line ("rate", "sustained", ...).
field() { # line name
    sed -E "s/.* $2=([^ ]+).*/\1/" <<<"$1"
}
# The passes of autovacuum and autoanalyze over the tables that ended
# during a run ("-" where none were counted).
autovacuum() { # line
    [[ $1 == *autovacuum=* ]] || { printf -- -; return; }
    field "$1" autovacuum
}
# The RESULT line of a run by its label (empty if there is none).
result_of() { # label
    grep "^$1 " "$work/results" || true
}

# The passes of autovacuum and of autoanalyze over the two tables that have
# ended so far ("VACUUMS ANALYZES"; nothing if they cannot be read). A pass
# takes a burst of the machine's CPU: on two cores at 75% of capacity, a
# per-event run that met one visit had a p99 of 12-13 ms where runs with
# autovacuum off had 7-10 ms (docs/performance-log.md, 2026-12-08). The
# launcher visits a database once a minute by default, and tables emptied
# before each run are due again after a thousand inserts, so a 30 s run
# meets one visit or none, by chance: the tables say which.
maintenance() {
    psql "$BENCH_URL" -X -A -t -q -F ' ' -c "SELECT coalesce(sum(autovacuum_count), 0), coalesce(sum(autoanalyze_count), 0)
        FROM pg_stat_user_tables WHERE relid IN ('processed_events'::regclass, 'notifications'::regclass)" 2>/dev/null || true
}
# The passes that ended since `maintenance` printed BEFORE, as
# "VACUUMS+ANALYZES" (a visit that vacuums and analyzes both tables is
# 2+2), or "?" when either count could not be read.
passes_since() { # before
    local now v0 a0 v1 a1
    now=$(maintenance)
    if [[ $1 =~ ^[0-9]+\ [0-9]+$ && $now =~ ^[0-9]+\ [0-9]+$ ]]; then
        read -r v0 a0 <<<"$1"
        read -r v1 a1 <<<"$now"
        echo "$((v1 - v0))+$((a1 - a0))"
    else
        echo "?"
    fi
}

# One benchmark run; prints its RESULT line, and the passes of autovacuum
# that ended while it ran.
bench() { # label args...
    local label=$1
    shift
    echo "running: $label..." >&2
    fresh_tables
    local line before
    before=$(maintenance)
    line=$(target/release/examples/bench --events "$EVENTS" --workers "$WORKERS" "$@" | grep '^RESULT')
    echo "$label $line autovacuum=$(passes_since "$before")"
}

# Each mode's runs sit between two measurements of its ceiling, so a drift
# of the machine shows (the ratio uses their mean).
echo "measuring (pgbench ${DURATION}s, $WORKERS connections, before and after each mode's runs)..." >&2
event_before=$(pgbench_tps "$work/per_event.sql")
{
    bench per-event --mode per-event
    bench hol-per-event --mode per-event --fail-ratio 0.1 --fail-times 2 --backoff-base 1s
} >"$work/results"
event_after=$(pgbench_tps "$work/per_event.sql")
batch_before=$(($(pgbench_tps "$work/batch50.sql") * 50))
{
    # The clean run and the one with failures side by side, PAIRS times:
    # the machine drifts by 10% from one minute to the next, more than
    # what the comparison is after, so each pair is compared on its own
    # and the spread shown. The first pair's clean run is the one the
    # steady load's rate and the other ratios are taken from.
    for pair in $(seq 1 "$PAIRS"); do
        suffix=""
        [[ $pair -gt 1 ]] && suffix="#$pair"
        bench "batch$suffix" --mode batch
        bench "hol-batch$suffix" --mode batch --fail-ratio 0.1 --fail-times 2 --backoff-base 1s
        # The same events with no failure: the failing tenth are the
        # handler's own events (the others are the built-in statement's),
        # so this run shows what failures cost apart from what such events
        # cost.
        bench "nofail-batch$suffix" --mode batch --fail-ratio 0.1 --fail-times 0
    done
    # shellcheck disable=SC2016 # $1 and $2 are SQL parameters, not shell variables
    bench batch-custom-sql --mode batch --sql 'INSERT INTO notifications (event_id, payload) VALUES ($1, $2::text)'
    # 1% of events the database rejects (a CHECK constraint of the scratch
    # database's notifications): the built-in statement fails for a batch
    # without saying which event, and they are dead-lettered.
    psql "$BENCH_URL" -X -q -v ON_ERROR_STOP=1 -c "ALTER TABLE notifications ADD CONSTRAINT \
        bench_poison CHECK (payload NOT LIKE '%\"poison\":true%') NOT VALID"
    # (A warning per dead letter is the worker's normal log: not shown here.)
    RUST_LOG=error bench poison-batch --mode batch --poison-ratio 0.01
    psql "$BENCH_URL" -X -q -v ON_ERROR_STOP=1 -c "ALTER TABLE notifications DROP CONSTRAINT bench_poison"
    # shellcheck disable=SC2016
    bench hol-batch-custom-sql --mode batch --sql 'INSERT INTO notifications (event_id, payload) VALUES ($1, $2::text)' \
        --fail-ratio 0.1 --fail-times 2 --backoff-base 1s
} >>"$work/results"
batch_after=$(($(pgbench_tps "$work/batch50.sql") * 50))
ceiling_event=$(((event_before + event_after) / 2))
ceiling_batch=$(((batch_before + batch_after) / 2))

# Steady load. The capacity is what each mode commits per second with a
# producer on the machine: a producer at 1.3x the mode's drain rate for
# CAPACITY_SECS (the rate sustained while it ran, its first quarter left
# out). A drain of preloaded events overstates it: there the events were
# sent before the clock started, and on two cores the producer's XADDs and
# Redis's work for them take a share of the CPU (in the runs of 2026-12-05
# the capacity was 0.86-0.91x the drain rate). Then a producer at 50%, 75%
# and 90% of that capacity for STEADY_SECS each, with the latency from
# XADD to commit; and, as its floor, the database alone at the same rate
# of events for as long (pgbench -R: per-event, one statement per event,
# taskhub's fused form; batch, 50 events per transaction).
for mode in per-event batch; do
    drain=$(field "$(result_of "$mode")" rate)
    offered=$((drain * 13 / 10))
    # --presize: Redis's tables of keys have room for the run's markers, so
    # that they do not grow during the run, as a deployment's stop growing
    # after its first marker TTL (see presize_redis in examples/bench.rs);
    # the growing-* run below shows the same load on tables that grow.
    bench "capacity-$mode" --mode "$mode" --rate "$offered" --duration "${CAPACITY_SECS}s" --presize \
        >>"$work/results"
    measured=$(result_of "capacity-$mode")
    capacity=$(field "$measured" sustained)
    produced=$(field "$measured" produced)
    if ! [[ $capacity =~ ^[1-9][0-9]*$ && $produced =~ ^[1-9][0-9]*$ ]]; then
        echo "bench: no capacity measured for $mode mode (sustained '$capacity', produced '$produced')" >&2
        exit 1
    fi
    # Measured against what the producer sent, not what it was asked for:
    # on two shared cores it may fall short of 1.3x.
    if ((capacity * 100 > produced * 95)); then
        echo "bench: the producer (${produced} events/s sent, ${offered} asked) did not outrun $mode mode: its capacity is at least $capacity events/s" >&2
    fi
    for share in 50 75 90; do
        rate=$((capacity * share / 100))
        bench "steady-$mode-$share%" --mode "$mode" --rate "$rate" --duration "${STEADY_SECS}s" \
            --presize --disk-probe "$DISK_PROBE_DIR" >>"$work/results"
        echo "running: the database alone at $rate events/s..." >&2
        if [[ $mode == per-event ]]; then
            floor=$(floor_latency "$work/per_event_one.sql" "$rate")
        else
            floor=$(floor_latency "$work/floor50.sql" $(((rate + 49) / 50)))
        fi
        echo "steady-$mode-$share% rate=$rate $floor" >>"$work/floors"
    done
    rate=$((capacity * 75 / 100))
    bench "growing-$mode-75%" --mode "$mode" --rate "$rate" --duration "${STEADY_SECS}s" \
        --disk-probe "$DISK_PROBE_DIR" >>"$work/results"
    echo "growing-$mode-75% rate=$rate -" >>"$work/floors"
done
# The database alone at 75% of its own ceiling, in the forms of the floors
# above (prepared): what 75% of capacity costs in latency on this machine
# with no taskhub at all.
echo "measuring the database alone at 75% of its own ceiling..." >&2
own_event=$(pgbench_tps "$work/per_event_one.sql" -M prepared)
own_batch=$(($(pgbench_tps "$work/floor50.sql" -M prepared) * 50))
rate=$((own_event * 75 / 100))
echo "database-per-event-75% rate=$rate $(floor_latency "$work/per_event_one.sql" "$rate")" >>"$work/floors"
rate=$((own_batch * 75 / 100))
echo "database-batch-75% rate=$rate $(floor_latency "$work/floor50.sql" $(((rate + 49) / 50)))" >>"$work/floors"

printf '\nceilings (pgbench, %d connections, %s; before / after the runs of that mode):\n' "$WORKERS" "$db_path"
printf '  per-event transaction %d / %d tps; 50 per transaction %d / %d events/s\n' \
    "$event_before" "$event_after" "$batch_before" "$batch_after"
printf '  prepared, in the forms of the steady floors: one statement per event %d tps; 50 per transaction %d events/s\n\n' \
    "$own_event" "$own_batch"
printf '%-22s %10s %10s %9s %9s %9s %9s %8s %6s %7s %s\n' run events/s healthy/s p50_ms p99_ms max_ms cpu_us rss_MB steal% autovac \
    "vs ceiling"
while read -r label line; do
    rate=$(field "$line" rate)
    # Under an overloading producer: what was committed while it ran.
    [[ $label == capacity-* ]] && rate=$(field "$line" sustained)
    ceiling=$ceiling_batch
    [[ $label == *per-event* ]] && ceiling=$ceiling_event
    share=$(awk "BEGIN { printf \"%.0f%%\", 100 * $rate / $ceiling }")
    [[ $label == steady-* || $label == growing-* ]] && share=-
    printf '%-22s %10s %10s %9s %9s %9s %9s %8.1f %6s %7s %s\n' "$label" "$rate" \
        "$(field "$line" healthy_rate)" "$(field "$line" p50_ms)" "$(field "$line" p99_ms)" \
        "$(field "$line" max_ms)" \
        "$(field "$line" cpu_us)" "$(awk "BEGIN { print $(field "$line" rss_kb) / 1024 }")" \
        "$(field "$line" steal_pct)" "$(autovacuum "$line")" "$share"
done <"$work/results"
healthy_rate() { # label
    field "$(result_of "$1")" healthy_rate
}
for mode in per-event batch batch-custom-sql; do
    clean=$(healthy_rate "$mode")
    failing=$(healthy_rate "hol-$mode")
    printf 'healthy events under failures, %s: %s/s vs %s/s clean = %.2fx\n' "$mode" "$failing" "$clean" \
        "$(awk "BEGIN { print $failing / $clean }")"
done
# Each pair of batch runs on its own, then their median and spread.
ratios=""
nofail_ratios=""
for pair in $(seq 1 "$PAIRS"); do
    suffix=""
    [[ $pair -gt 1 ]] && suffix="#$pair"
    clean=$(healthy_rate "batch$suffix")
    failing=$(healthy_rate "hol-batch$suffix")
    nofail=$(healthy_rate "nofail-batch$suffix")
    ratios="$ratios $(awk "BEGIN { printf \"%.2f\", $failing / $clean }")"
    nofail_ratios="$nofail_ratios $(awk "BEGIN { printf \"%.2f\", $failing / $nofail }")"
done
spread() { # ratios...
    printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END {
        printf "median %.2fx, %.2f-%.2fx", (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2), a[1], a[NR] }'
}
# shellcheck disable=SC2086 # one word per ratio
printf 'healthy events under failures, batch, in %d pairs run side by side:%s (%s)\n' \
    "$PAIRS" "$ratios" "$(spread $ratios)"
# shellcheck disable=SC2086
printf '  ... vs the same events failing never, run right after each:%s (%s)\n' \
    "$nofail_ratios" "$(spread $nofail_ratios)"
poison=$(healthy_rate poison-batch)
clean=$(healthy_rate batch)
printf 'healthy events with 1%% rejected by the database, batch: %s/s vs %s/s clean = %.2fx\n' \
    "$poison" "$clean" "$(awk "BEGIN { print $poison / $clean }")"
printf '\nsteady load, taskhub next to the database alone at the same rate (pgbench -R, prepared):\n'
printf '%-22s %10s %27s %30s %7s %27s %30s %7s\n' run events/s "taskhub p50 / p99 / max ms" "calm p99 (share, steal, stall)" \
    autovac "database p50 / p99 / max ms" "calm p99 (share, steal, stall)" autovac
# p50 / p99 / max of a RESULT or floor line, and its calm p99 with the
# share of events it counts, and how long the host's steal bursts and the
# disk's stalls lasted.
latencies() { # line
    [[ $1 == *p50_ms=* ]] || { printf -- -; return; }
    printf '%s / %s / %s' "$(field "$1" p50_ms)" "$(field "$1" p99_ms)" "$(field "$1" max_ms)"
}
calm_p99() { # line
    [[ $1 == *calm_p99_ms=* ]] || { printf -- -; return; }
    local stalls=-
    [[ $1 == *stall_s=* ]] && stalls="$(field "$1" stall_s)s"
    printf '%s (%s%%, %ss, %s)' "$(field "$1" calm_p99_ms)" "$(field "$1" calm_share)" "$(field "$1" burst_s)" \
        "$stalls"
}
while read -r label line; do
    ours=$(result_of "$label")
    taskhub=- taskhub_calm=- taskhub_vacuum=-
    [[ -n $ours ]] && taskhub=$(latencies "$ours") && taskhub_calm=$(calm_p99 "$ours") &&
        taskhub_vacuum=$(autovacuum "$ours")
    line=" $line"
    printf '%-22s %10s %27s %30s %7s %27s %30s %7s\n' "$label" "$(field "$line" rate)" "$taskhub" "$taskhub_calm" \
        "$taskhub_vacuum" "$(latencies "$line")" "$(calm_p99 "$line")" "$(autovacuum "$line")"
done <"$work/floors"
cat <<EOF

hol-*: 10% of events fail twice with a 1 s backoff; healthy/s is the drain
rate of the other 90%, to compare with the clean run of the same mode.
nofail-batch: the events of hol-batch with no failure (its tenth marked to
fail are the handler's own events, in every read's transaction).
poison-batch: 1% of events rejected by a CHECK constraint of notifications
(dead-lettered); the built-in statement does not say which event failed.
steal%: the share of the machine's CPU time the host gave to other guests
during the run (from /proc/stat); a run with much of it measured them too.
capacity-*: a producer at 1.3x the mode's drain rate for ${CAPACITY_SECS} s; events/s is
what was committed while it ran (its first quarter left out): the mode's
capacity with a producer on the machine. The peak RSS of the capacity-* and
steady-* runs includes the benchmark's own record of every event (its
latency twice and commit time, 24 bytes an event).
steady-*: a producer at that share of the capacity for ${STEADY_SECS} s; latency
from XADD to commit; cpu_us includes the producer and the disk probe. Redis's tables
of keys are sized for the run's markers first (bench --presize), so that
they do not grow during the run (a deployment at a steady rate stops
growing them after its first marker TTL). growing-*-75%: the 75% run
on tables that grow as the markers come (Redis doubles a full table and
moves its keys: slow for about a second at each power of two). The database
alone: pgbench at the same rate of events (per-event: one statement per
event, the fused form; batch: 50 events per transaction; prepared), latency
from each transaction's scheduled start, so the stalls of the machine and
the database show in both columns. database-*-75%: the database alone at
75% of its own ceiling in that form, with no taskhub. calm p99: the p99 of
the events (transactions) whose whole flight met no burst of the host's
steal and no stall, with their share of all, the bursts' total length
(steal) and the stalled syncs' total time (stall). A burst is a 100 ms
sample with over 5% of the machine's CPU time taken by another guest. A
stall is a sync of the disk probe (8 KiB written and fdatasynced, then
10 ms asleep, in the directory below) that took over 5 ms, counted from
the end of the probe's sync before it: every commit waits for such a sync
of the WAL, on the database's disk (a stall may also be the probe waiting
for a core). An event that queued behind a burst's or a stall's backlog
but was sent after it counts as calm.
autovac: the passes of autovacuum over processed_events and notifications
that ended during the run, as vacuums+analyzes (one visit of the launcher
that vacuums and analyzes both tables is 2+2; ? where they could not be
read). Each takes a burst of CPU from the two cores; the launcher visits
the database every autovacuum_naptime (a minute by default) and the
emptied tables are due again after a thousand inserts, so a ${STEADY_SECS} s run meets
one visit or none, by chance. The calm figures leave out steal bursts and
disk stalls, not passes: a p99 far above the database alone's with a pass
beside it is likely that pass's backlog (docs/performance-log.md,
2026-12-08).
disk probe: ${probe_where}
EOF

# Our CPU per event as instructions (scripts/instructions.sh): the same
# within about 1% from one run to the next, where the seconds above drift by
# 10-40% on a shared host. Skipped without valgrind.
echo
if command -v valgrind >/dev/null 2>&1; then
    echo "our instructions per event (callgrind; scripts/instructions.sh):"
    BENCH_BIN=$PWD/target/release/examples/bench bash scripts/instructions.sh batch 20000
    BENCH_BIN=$PWD/target/release/examples/bench bash scripts/instructions.sh per-event 10000
else
    echo "our instructions per event: skipped (no valgrind; apt-get install valgrind)"
fi
