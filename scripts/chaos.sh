#!/usr/bin/env bash
# scripts/chaos.sh — the chaos run: try hard to make taskhub lose or repeat an
# event, then check per event that it did neither, and print the figures.
#
# Usage:  bash scripts/chaos.sh                       # 20,000 events, batch mode
#         TASKHUB_MODE=per-event bash scripts/chaos.sh
#         EVENTS=2000 KILLS=3 PRODUCE_SECS=15 bash scripts/chaos.sh   # a short run
#
# What it does, all on private servers it starts itself on free ports (the
# shared Redis and PostgreSQL are never touched):
#   1. a Redis with AOF (`appendfsync always`) and a PostgreSQL (initdb +
#      pg_ctl in a temporary directory, as user postgres when run as root);
#   2. three worker processes of one consumer group (consumers c1, c2, c3),
#      each restarted by a supervisor loop whenever it dies;
#   3. EVENTS events produced at a steady rate over PRODUCE_SECS seconds, a mix
#      of: plain; failing transiently k times (k = 1 or 2) then succeeding;
#      failing permanently (a CHECK violation, SQLSTATE 23514); panicking on
#      every call; panicking once; invalid (no / empty / control-character /
#      non-UTF-8 / too long event_id, oversized entry, payload not JSON);
#      sent twice with the same event_id; and ABORTS events that abort their
#      process (the crash loop);
#   4. meanwhile, at random moments: KILLS SIGKILLs of random workers (each
#      restarted after 0.2–2 s), REDIS_RESTARTS Redis restarts (SIGKILL, then
#      a start on the same port and directory), PG_RESTARTS PostgreSQL
#      restarts (`pg_ctl stop -m immediate`, then start), and PERMANENT_KILLS
#      workers killed for good, whose pending entries the others must reclaim;
#   5. once every entry was delivered and nothing is pending, a graceful stop
#      of the workers and the check, per entry and per event_id, in SQL over
#      the manifest of what was produced, `notifications`, `processed_events`
#      and the dead-letter stream: every event that should succeed has
#      exactly one effect row; every permanent, invalid, exhausted (always
#      panicking) or crash-looping entry is in `<stream>:dlq` exactly once,
#      with the expected kind and reason and every original field byte for
#      byte (full payload), and has no effect; nothing is pending; no event is
#      both dead-lettered and applied. A few of these are checked again with
#      redis-cli and psql directly.
# It prints a summary table and exits non-zero on any violation.
#
# Why a chaos driver (tests/chaos/driver.rs, the bin taskhub-chaos) instead of `taskhub run`:
# the workers run the same library (`Worker` with the flags of `taskhub
# run`, `TASKHUB_MODE` honoured), but with a handler written for the chaos.
# `taskhub run --sql` cannot panic, nor abort its process, and a pure-SQL
# "fail k times" needs a call counter that survives the rollback of the
# failing transaction: sequences do (one per transient event, and they may
# jump forward after a crash), dblink is not installed everywhere, and a
# table does not. The driver counts calls with INCR in the private Redis,
# outside the transaction, so the count survives rollbacks, kills and
# restarts (a Redis outage during the INCR is an outage, not an attempt). Its
# panics are real panics in the handler, and its crash-loop events call
# `std::process::abort()`. The same driver produces the events (with
# explicit entry ids, so a write cut by the Redis restart is retried without
# a second copy), waits for the group to drain, and runs the check.
#
# Parameters (environment):
#   EVENTS=20000 KILLS=12 REDIS_RESTARTS=1 PG_RESTARTS=1 PERMANENT_KILLS=1
#   ABORTS=3 PRODUCE_SECS=60 WORKERS=3 (processes) THREADS=4 (per process)
#   MAX_ATTEMPTS=4 SEED=<random> SETTLE_TIMEOUT=300 TASKHUB_MODE=batch
#   (SEED fixes the mix of events and the order and spacing of the faults,
#   not the timing of the processes: a failing seed is worth re-running)
#   CHAOS_BIN=<path of a built taskhub-chaos; default: cargo build --release
#   --features fault-injection --bin taskhub-chaos>
#   CHAOS_KEEP=0 (1: keep the temporary directory with logs and data)
#   TASKHUB_PG_BIN=<directory of initdb and pg_ctl; default: found>
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

EVENTS=${EVENTS:-20000}
KILLS=${KILLS:-12}
REDIS_RESTARTS=${REDIS_RESTARTS:-1}
PG_RESTARTS=${PG_RESTARTS:-1}
PERMANENT_KILLS=${PERMANENT_KILLS:-1}
ABORTS=${ABORTS:-3}
PRODUCE_SECS=${PRODUCE_SECS:-60}
WORKERS=${WORKERS:-3}
THREADS=${THREADS:-4}
MAX_ATTEMPTS=${MAX_ATTEMPTS:-4}
MAX_ENTRY_BYTES=${MAX_ENTRY_BYTES:-65536}
SEED=${SEED:-$((RANDOM * 32768 + RANDOM))}
SETTLE_TIMEOUT=${SETTLE_TIMEOUT:-300}
MODE=${TASKHUB_MODE:-batch}
CHAOS_KEEP=${CHAOS_KEEP:-0}
export TASKHUB_MODE=$MODE
export RUST_LOG=${CHAOS_LOG:-info}
STREAM=chaos:events
GROUP=chaos
RANDOM=$SEED

say() { printf 'chaos: %s\n' "$*" >&2; }
die() {
    printf 'chaos: ERROR: %s\n' "$*" >&2
    exit 1
}
now() { date +%s.%N; }
START=$(now)
elapsed() { awk -v a="$START" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
# A random number of seconds in [lo, hi), with two decimals.
rand_secs() { awk -v lo="$1" -v hi="$2" -v r="$RANDOM" 'BEGIN { printf "%.2f", lo + (hi - lo) * r / 32768 }'; }

((WORKERS >= 2 || PERMANENT_KILLS == 0)) || die "killing a worker for good needs WORKERS >= 2"
((PERMANENT_KILLS < WORKERS)) || die "PERMANENT_KILLS must leave a worker alive"
ulimit -c 0 # the crash-loop events abort(): no core files

# --- the driver ---------------------------------------------------------------
if [[ -z ${CHAOS_BIN:-} ]]; then
    if [[ -f $HOME/.cargo/env ]]; then
        # shellcheck source=/dev/null
        source "$HOME/.cargo/env"
    fi
    # The driver is a test program: only its features bring it into a build.
    say "building the chaos driver (cargo build --release --features fault-injection --bin taskhub-chaos)"
    (cd "$ROOT" && cargo build --quiet --release --features fault-injection --bin taskhub-chaos)
    CHAOS_BIN=$ROOT/target/release/taskhub-chaos
fi
[[ -x $CHAOS_BIN ]] || die "no chaos driver at $CHAOS_BIN"

# --- PostgreSQL tools -----------------------------------------------------------
# shellcheck source=pg_bin_dir.sh
source "$ROOT/scripts/pg_bin_dir.sh"
PG_BIN=$(pg_bin_dir) || die "initdb/pg_ctl not found; set TASKHUB_PG_BIN (scripts/test.sh installs them)"
command -v redis-server >/dev/null 2>&1 || die "redis-server not found (scripts/test.sh installs it)"
command -v redis-cli >/dev/null 2>&1 || die "redis-cli not found"
PSQL=$PG_BIN/psql
[[ -x $PSQL ]] || PSQL=$(command -v psql) || die "psql not found"
# initdb and postgres refuse to run as root: root hands over to `postgres`.
as_pg() {
    if [[ $EUID -eq 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

# --- the temporary directory and the clean-up ---------------------------------
DIR=$(mktemp -d "${TMPDIR:-/tmp}/taskhub-chaos.XXXXXX")
chmod 755 "$DIR"
mkdir -p "$DIR/redis" "$DIR/pg" "$DIR/run"
[[ $EUID -ne 0 ]] || chown postgres "$DIR/pg"
REDIS_PID=""
PG_UP=0
PRODUCER_PID=""
SUPERVISORS=()
OK=0

# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    local pid f
    for ((i = 1; i <= WORKERS; i++)); do touch "$DIR/run/stop.$i"; done
    for f in "$DIR"/run/pid.*; do
        [[ -e $f ]] || continue
        pid=$(cat "$f" 2>/dev/null) || continue
        if [[ -n $pid ]]; then kill -9 "$pid" 2>/dev/null || true; fi
    done
    for pid in "${SUPERVISORS[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [[ -n $PRODUCER_PID ]]; then kill -9 "$PRODUCER_PID" 2>/dev/null || true; fi
    if [[ -n $REDIS_PID ]]; then
        kill -9 "$REDIS_PID" 2>/dev/null || true
        wait "$REDIS_PID" 2>/dev/null || true
    fi
    if ((PG_UP)); then
        as_pg "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -m immediate -w stop >/dev/null 2>&1 || true
    fi
    if ((OK)) && [[ $CHAOS_KEEP != 1 ]]; then
        rm -rf "$DIR"
    else
        say "logs and data kept in $DIR"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A port nothing listens on, outside the ephemeral range (a client socket
# bound to it would make the server's bind fail, at a restart too).
read -r EPHEMERAL_LO EPHEMERAL_HI </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null ||
    EPHEMERAL_LO=32768 EPHEMERAL_HI=60999
free_port() {
    local p
    while :; do
        if ((EPHEMERAL_LO > 12000)); then
            p=$((10000 + RANDOM % (EPHEMERAL_LO - 10000)))
        else
            p=$((EPHEMERAL_HI + 1 + RANDOM % (65535 - EPHEMERAL_HI)))
        fi
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            printf '%s\n' "$p"
            return
        fi
    done
}

# --- Redis ----------------------------------------------------------------------
REDIS_PORT=$(free_port)
redis_cli() { redis-cli -p "$REDIS_PORT" "$@"; }
start_redis() {
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$DIR/redis" \
        --appendonly yes --appendfsync always --save "" --daemonize no \
        >>"$DIR/redis.log" 2>&1 &
    REDIS_PID=$!
    local i
    for ((i = 0; i < 100; i++)); do
        [[ $(redis_cli ping 2>/dev/null) == PONG ]] && return 0
        sleep 0.1
    done
    die "Redis did not start on port $REDIS_PORT (see $DIR/redis.log)"
}
start_redis
export REDIS_URL=redis://127.0.0.1:$REDIS_PORT

# --- PostgreSQL -----------------------------------------------------------------
PG_PORT=$(free_port)
while ((PG_PORT == REDIS_PORT)); do PG_PORT=$(free_port); done
as_pg "$PG_BIN/initdb" -D "$DIR/pg/data" -A trust -U postgres --no-sync -E UTF8 >"$DIR/initdb.log" 2>&1 ||
    die "initdb failed: $(tail -n 5 "$DIR/initdb.log")"
start_pg() {
    as_pg "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -l "$DIR/pg/log" -w -t 60 \
        -o "-p $PG_PORT -k $DIR/pg -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200" \
        start >/dev/null || die "pg_ctl start failed (see $DIR/pg/log)"
    PG_UP=1
}
stop_pg() {
    as_pg "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -m immediate -w stop >/dev/null
    PG_UP=0
}
start_pg
psql_q() { "$PSQL" -h 127.0.0.1 -p "$PG_PORT" -U postgres -X -q -t -A -v ON_ERROR_STOP=1 "$@"; }
psql_q -d postgres -c "CREATE DATABASE chaos"
export DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/chaos
"$CHAOS_BIN" setup

say "mode $MODE, $EVENTS events over ${PRODUCE_SECS}s, $WORKERS workers x $THREADS threads, seed $SEED"
say "redis :$REDIS_PORT, postgres :$PG_PORT, logs in $DIR"

# --- workers under supervisors ------------------------------------------------------
# Each supervisor restarts its worker whenever it exits, until run/stop.<i>
# exists; it records every exit status in run/exits.<i>.
supervise() {
    local i=$1 pid rc delay
    set +e
    while [[ ! -e $DIR/run/stop.$i ]]; do
        "$CHAOS_BIN" work --stream "$STREAM" --group "$GROUP" --consumer "c$i" \
            --workers "$THREADS" --block-ms 200 --max-attempts "$MAX_ATTEMPTS" \
            --backoff-base 50ms --backoff-cap 1s --max-retry-after 1s \
            --reclaim-interval 1s --reclaim-min-idle 5s --shutdown-timeout 20s \
            --max-entry-bytes "$MAX_ENTRY_BYTES" \
            >>"$DIR/w$i.out" 2>>"$DIR/w$i.log" </dev/null &
        pid=$!
        echo "$pid" >"$DIR/run/pid.$i"
        wait "$pid"
        rc=$?
        rm -f "$DIR/run/pid.$i"
        echo "$rc" >>"$DIR/run/exits.$i"
        [[ -e $DIR/run/stop.$i ]] && break
        delay=0.3
        if [[ -e $DIR/run/delay.$i ]]; then
            delay=$(cat "$DIR/run/delay.$i")
            rm -f "$DIR/run/delay.$i"
        fi
        sleep "$delay"
    done
}
START=$(now) # elapsed: from the start of the workers to the drained group
for ((i = 1; i <= WORKERS; i++)); do
    # (bash reports each killed child on the supervisor's stderr: to a file)
    supervise "$i" 2>>"$DIR/supervisors.log" &
    SUPERVISORS+=($!)
done

"$CHAOS_BIN" produce --stream "$STREAM" --events "$EVENTS" --seconds "$PRODUCE_SECS" \
    --aborts "$ABORTS" --seed "$SEED" --max-entry-bytes "$MAX_ENTRY_BYTES" \
    --manifest "$DIR/manifest.jsonl" 2>"$DIR/produce.log" &
PRODUCER_PID=$!

# --- the faults -------------------------------------------------------------------------
KILLS_DONE=0
REDIS_RESTARTS_DONE=0
PG_RESTARTS_DONE=0
RETIRED=()
ORPHANED=0

is_retired() {
    local r
    for r in "${RETIRED[@]}"; do [[ $r == "$1" ]] && return 0; done
    return 1
}
# The pid of a random running, not retired worker (empty if none runs now).
pick_worker() {
    local tries i pid
    for ((tries = 0; tries < 50; tries++)); do
        i=$((1 + RANDOM % WORKERS))
        if ! is_retired "$i" && [[ -e $DIR/run/pid.$i ]]; then
            pid=$(cat "$DIR/run/pid.$i" 2>/dev/null) || pid=""
            if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
                printf '%s %s\n' "$i" "$pid"
                return
            fi
        fi
        sleep 0.1
    done
}
kill_worker() {
    local picked i pid
    picked=$(pick_worker)
    [[ -n $picked ]] || {
        say "no running worker to kill"
        return
    }
    read -r i pid <<<"$picked"
    rand_secs 0.2 2.0 >"$DIR/run/delay.$i"
    if kill -9 "$pid" 2>/dev/null; then
        KILLS_DONE=$((KILLS_DONE + 1))
        say "$(elapsed)s: SIGKILL c$i (pid $pid), kill $KILLS_DONE"
    fi
}
# Pending entries of consumer c<i> (4 lines per entry in redis-cli's output).
held_by() {
    local lines
    lines=$(redis_cli XPENDING "$STREAM" "$GROUP" - + 1000000 "c$1" | wc -l)
    echo $((lines / 4))
}
retire_worker() {
    local picked i pid tries held
    # Wait (a little) for a moment when the victim holds pending entries, so
    # that the others have something to reclaim.
    for ((tries = 0; tries < 50; tries++)); do
        picked=$(pick_worker)
        [[ -n $picked ]] || continue
        read -r i pid <<<"$picked"
        (($(held_by "$i") > 0)) && break
        sleep 0.1
    done
    [[ -n $picked ]] || {
        say "no running worker to retire"
        return
    }
    touch "$DIR/run/stop.$i"
    kill -9 "$pid" 2>/dev/null || true
    RETIRED+=("$i")
    sleep 0.2
    held=$(held_by "$i")
    ORPHANED=$((ORPHANED + held))
    say "$(elapsed)s: SIGKILL c$i (pid $pid) for good; it held $held pending entries"
}
restart_redis() {
    kill -9 "$REDIS_PID"
    wait "$REDIS_PID" 2>/dev/null || true
    say "$(elapsed)s: Redis killed"
    sleep "$(rand_secs 1 3)"
    start_redis
    REDIS_RESTARTS_DONE=$((REDIS_RESTARTS_DONE + 1))
    say "$(elapsed)s: Redis started again"
}
restart_pg() {
    stop_pg
    say "$(elapsed)s: PostgreSQL stopped (immediate)"
    sleep "$(rand_secs 1 3)"
    start_pg
    PG_RESTARTS_DONE=$((PG_RESTARTS_DONE + 1))
    say "$(elapsed)s: PostgreSQL started again"
}

ACTIONS=()
for ((i = 0; i < KILLS; i++)); do ACTIONS+=(kill); done
for ((i = 0; i < REDIS_RESTARTS; i++)); do ACTIONS+=(redis); done
for ((i = 0; i < PG_RESTARTS; i++)); do ACTIONS+=(pg); done
for ((i = 0; i < PERMANENT_KILLS; i++)); do ACTIONS+=(retire); done
# Shuffle (Fisher-Yates with the seeded $RANDOM).
for ((i = ${#ACTIONS[@]} - 1; i > 0; i--)); do
    j=$((RANDOM % (i + 1)))
    t=${ACTIONS[i]}
    ACTIONS[i]=${ACTIONS[j]}
    ACTIONS[j]=$t
done
# Spread over the production time: events flow during every fault.
GAP=$(awk -v w="$PRODUCE_SECS" -v n="${#ACTIONS[@]}" 'BEGIN { printf "%.3f", w / (n + 1) }')
for action in "${ACTIONS[@]}"; do
    sleep "$(awk -v g="$GAP" -v r="$RANDOM" 'BEGIN { printf "%.2f", g * (0.5 + r / 32768) }')"
    case $action in
    kill) kill_worker ;;
    redis) restart_redis ;;
    pg) restart_pg ;;
    retire) retire_worker ;;
    esac
done

wait "$PRODUCER_PID" || die "the producer failed: $(tail -n 5 "$DIR/produce.log")"
PRODUCER_PID=""
say "$(elapsed)s: all $EVENTS events produced; waiting for the group to drain"
"$CHAOS_BIN" settle --stream "$STREAM" --group "$GROUP" --timeout "${SETTLE_TIMEOUT}s" 2>>"$DIR/settle.log" ||
    {
        say "not drained: $(tail -n 3 "$DIR/settle.log")"
        redis_cli XPENDING "$STREAM" "$GROUP" >&2 || true
    }
ELAPSED=$(elapsed)

# --- graceful stop ----------------------------------------------------------------------
for ((i = 1; i <= WORKERS; i++)); do touch "$DIR/run/stop.$i"; done
for ((i = 1; i <= WORKERS; i++)); do
    if [[ -e $DIR/run/pid.$i ]]; then
        kill -TERM "$(cat "$DIR/run/pid.$i")" 2>/dev/null || true
    fi
done
for ((t = 0; t < 300; t++)); do
    alive=0
    for pid in "${SUPERVISORS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
done
((alive == 0)) || say "a worker did not stop within 30 s of SIGTERM"

# --- the figures and the check ----------------------------------------------------------------
ABORT_DEATHS=$(cat "$DIR"/run/exits.* 2>/dev/null | grep -c '^134$' || true)
KILLED_SEEN=$(cat "$DIR"/run/exits.* 2>/dev/null | grep -c '^137$' || true)
START_FAILURES=$(cat "$DIR"/run/exits.* 2>/dev/null | grep -c '^1$' || true)
RECLAIMED=$(cat "$DIR"/w*.log | sed -n 's/.*reclaimed \([0-9]*\) entries.*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
say "worker exits: $KILLED_SEEN SIGKILL, $ABORT_DEATHS abort, $START_FAILURES start failures (a server was down)"

status=0
RUST_LOG=warn "$CHAOS_BIN" check --stream "$STREAM" --group "$GROUP" --manifest "$DIR/manifest.jsonl" \
    --max-attempts "$MAX_ATTEMPTS" --mode "$MODE" --kills "$KILLS_DONE" \
    --abort-deaths "$ABORT_DEATHS" --redis-restarts "$REDIS_RESTARTS_DONE" \
    --pg-restarts "$PG_RESTARTS_DONE" --killed-for-good "${#RETIRED[@]}" \
    --orphaned "$ORPHANED" --reclaimed "$RECLAIMED" --elapsed "$ELAPSED" || status=1

# The same promises once more, straight from redis-cli and psql.
pending=$(redis_cli XPENDING "$STREAM" "$GROUP" | head -n 1)
doubled=$(psql_q -d chaos -c "SELECT count(*) FROM (SELECT event_id FROM notifications GROUP BY event_id HAVING count(*) > 1) d")
both=$(psql_q -d chaos -c "SELECT count(*) FROM chaos_dlq d JOIN notifications n USING (event_id)")
dlq_len=$(redis_cli XLEN "$STREAM:dlq")
dlq_rows=$(psql_q -d chaos -c "SELECT count(DISTINCT original_id) FROM chaos_dlq")
say "redis-cli: pending=$pending, $STREAM:dlq has $dlq_len entries ($dlq_rows distinct originals); psql: $doubled events with 2+ effects, $both both dead-lettered and applied"
[[ $pending == 0 && $doubled == 0 && $both == 0 && $dlq_len == "$dlq_rows" ]] || status=1
((KILLS_DONE >= KILLS)) || {
    say "only $KILLS_DONE of $KILLS kills happened"
    status=1
}

if ((status == 0)); then
    OK=1
    say "PASS ($MODE mode, seed $SEED)"
else
    say "FAIL ($MODE mode, seed $SEED); errors in the worker logs:"
    grep -h -E 'ERROR|error' "$DIR"/w*.log | tail -n 20 >&2 || true
fi
exit "$status"
