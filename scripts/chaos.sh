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
#      each restarted by a supervisor loop whenever it dies, and a second
#      deployment (DEPLOYMENTS=2): one more worker process with the same
#      group name on its own stream (chaos2:events, the same entries) and
#      its own database (chaos2) in the same PostgreSQL, sharing the Redis;
#      every worker process reaches each server through its own TCP fault
#      proxy (the driver's `proxy`, tests/support/proxy.rs);
#   3. EVENTS events produced at a steady rate over PRODUCE_SECS seconds, a mix
#      of: plain; failing transiently k times (k = 1 or 2) then succeeding;
#      failing permanently (a CHECK violation, SQLSTATE 23514); panicking on
#      every call; panicking once; invalid (no / empty / control-character /
#      non-UTF-8 / too long event_id, oversized entry, payload not JSON);
#      sent twice with the same event_id; failing slowly (1.5 s) with a
#      Retry-After k times, so that its retries outlast the short
#      --reclaim-min-idle (RECLAIM_MIN_IDLE) and another process claims it;
#      ABORTS events that abort their process (the crash loop); and KILLERS
#      events whose statement terminates their own PostgreSQL backend;
#   4. meanwhile, at random moments: KILLS SIGKILLs of random workers (each
#      restarted after 0.2–2 s), REDIS_RESTARTS Redis restarts (SIGKILL, then
#      a start on the same port and directory), PG_RESTARTS PostgreSQL
#      restarts (`pg_ctl stop -m immediate`, then start), PERMANENT_KILLS
#      workers killed for good, whose pending entries the others must reclaim,
#      NET_FAULTS network faults between one worker process and one server
#      (a delay, a drop with FIN, a reset, a half-open freeze long enough for
#      read timeouts, or a refusal of new connections, for a few seconds),
#      PAUSES pauses of a random worker (SIGSTOP, then SIGCONT 3–6 s later,
#      past --reclaim-min-idle: a stopped VM or a swap storm; its entries are
#      claimed by the others while it holds them, wherever it stopped,
#      between an ownership check and its COMMIT included),
#      READONLY_WINDOWS read-only windows of PostgreSQL (restarted as a hot
#      standby for a few seconds, then promoted: every write fails with
#      25006, as during a failover), PG_GRACEFUL graceful restarts (SIGTERM)
#      of every worker while PostgreSQL is down, GROUP_DESTROYS `XGROUP
#      DESTROY` of the group (the workers create it again at 0 and see
#      everything again), and TRIMS `XTRIM MINID` of the stream just past a
#      pending entry (the driver's `trim`: it deletes only entries already
#      delivered, acked or pending, never one unseen); an entry both trimmed
#      while pending and wiped from the pending list by a destroy before it
#      was settled is gone without a trace: the check counts those on a line
#      of their own and expects no outcome of them;
#   5. once every entry was delivered and nothing is pending, a graceful stop
#      of the workers and the check, per entry and per event_id, in SQL over
#      the manifest of what was produced, `notifications`, `processed_events`
#      and the dead-letter stream: every event that should succeed has
#      exactly one effect row; every permanent, invalid, exhausted (always
#      panicking) or crash-looping entry is in `<stream>:dlq` exactly once,
#      with the expected kind and reason and every original field byte for
#      byte (full payload), and has no effect; nothing is pending; no event is
#      both dead-lettered and applied. An entry deleted by XTRIM has its
#      expected outcome if it was finished before, or else exactly one
#      `trimmed` dead letter, never both. Each deployment is checked on its
#      own (the second one has no trims, destroys or permanent kills). A few
#      of these are checked again with redis-cli and psql directly.
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
#   ABORTS=3 KILLERS=2 NET_FAULTS=12 PAUSES=4 READONLY_WINDOWS=1 PG_GRACEFUL=1
#   GROUP_DESTROYS=1 TRIMS=2 DEPLOYMENTS=2 RECLAIM_MIN_IDLE=2s
#   PRODUCE_SECS=60 WORKERS=3 (processes) THREADS=4 (per process)
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
KILLERS=${KILLERS:-2}
NET_FAULTS=${NET_FAULTS:-12}
PAUSES=${PAUSES:-4}
READONLY_WINDOWS=${READONLY_WINDOWS:-1}
PG_GRACEFUL=${PG_GRACEFUL:-1}
GROUP_DESTROYS=${GROUP_DESTROYS:-1}
TRIMS=${TRIMS:-2}
DEPLOYMENTS=${DEPLOYMENTS:-2}
RECLAIM_MIN_IDLE=${RECLAIM_MIN_IDLE:-2s}
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
STREAM2=chaos2:events # the second deployment's: same group name, own database
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
((DEPLOYMENTS == 1 || DEPLOYMENTS == 2)) || die "DEPLOYMENTS is 1 or 2"
# Worker processes 1..WORKERS are the first deployment's; WORKERS+1 the second's.
ALL_WORKERS=$((WORKERS + DEPLOYMENTS - 1))
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
PROXY_PID=""
SUPERVISORS=()
OK=0

# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    local pid f
    for ((i = 1; i <= ALL_WORKERS; i++)); do touch "$DIR/run/stop.$i"; done
    for f in "$DIR"/run/pid.*; do
        [[ -e $f ]] || continue
        pid=$(cat "$f" 2>/dev/null) || continue
        if [[ -n $pid ]]; then kill -9 "$pid" 2>/dev/null || true; fi
    done
    for pid in "${SUPERVISORS[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [[ -n $PRODUCER_PID ]]; then kill -9 "$PRODUCER_PID" 2>/dev/null || true; fi
    if [[ -n $PROXY_PID ]]; then kill -9 "$PROXY_PID" 2>/dev/null || true; fi
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
# bound to it would make the server's bind fail, at a restart too), and
# below 20000: the test suite's private servers take theirs from 20000 to
# 31999, and one of them could take this port while a restart has it free.
read -r EPHEMERAL_LO EPHEMERAL_HI </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null ||
    EPHEMERAL_LO=32768 EPHEMERAL_HI=60999
free_port() {
    local p top=$((EPHEMERAL_LO < 20000 ? EPHEMERAL_LO : 20000))
    while :; do
        if ((top > 12000)); then
            p=$((10000 + RANDOM % (top - 10000)))
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
DATABASE_URL2=postgres://postgres@127.0.0.1:$PG_PORT/chaos2
"$CHAOS_BIN" setup
if ((DEPLOYMENTS == 2)); then
    psql_q -d postgres -c "CREATE DATABASE chaos2"
    "$CHAOS_BIN" setup --database-url "$DATABASE_URL2"
fi

# --- the fault proxies: one per worker process and server ------------------------
mkdir -p "$DIR/proxy"
ROUTES=()
for ((i = 1; i <= ALL_WORKERS; i++)); do
    ROUTES+=(--route "w$i-redis=127.0.0.1:$REDIS_PORT" --route "w$i-pg=127.0.0.1:$PG_PORT")
done
"$CHAOS_BIN" proxy --dir "$DIR/proxy" "${ROUTES[@]}" 2>>"$DIR/proxy.log" &
PROXY_PID=$!
for ((t = 0; t < 100; t++)); do
    [[ -e $DIR/proxy/w$ALL_WORKERS-pg.port ]] && break
    sleep 0.1
done
[[ -e $DIR/proxy/w$ALL_WORKERS-pg.port ]] || die "the fault proxies did not start (see $DIR/proxy.log)"
proxy_port() { cat "$DIR/proxy/$1.port"; }
# One command to the proxy of worker process $1 and server $2 (redis, pg).
proxy_cmd() {
    printf '%s\n' "$3" >"$DIR/proxy/w$1-$2.cmd.tmp"
    mv "$DIR/proxy/w$1-$2.cmd.tmp" "$DIR/proxy/w$1-$2.cmd"
}
stream_of() { if (($1 > WORKERS)); then echo "$STREAM2"; else echo "$STREAM"; fi; }
db_of() { if (($1 > WORKERS)); then echo chaos2; else echo chaos; fi; }

say "mode $MODE, $EVENTS events over ${PRODUCE_SECS}s, $WORKERS workers x $THREADS threads (+$((DEPLOYMENTS - 1)) of a second deployment), seed $SEED"
say "redis :$REDIS_PORT, postgres :$PG_PORT, logs in $DIR"

# --- workers under supervisors ------------------------------------------------------
# Each supervisor restarts its worker whenever it exits, until run/stop.<i>
# exists; it records every exit status in run/exits.<i>, with the time
# (unix ms): the check proves each crash a dead letter charges with them.
supervise() {
    local i=$1 pid rc delay
    set +e
    local redis_url pg_url
    redis_url=redis://127.0.0.1:$(proxy_port "w$i-redis")
    pg_url=postgres://postgres@127.0.0.1:$(proxy_port "w$i-pg")/$(db_of "$i")
    while [[ ! -e $DIR/run/stop.$i ]]; do
        REDIS_URL=$redis_url DATABASE_URL=$pg_url \
            "$CHAOS_BIN" work --stream "$(stream_of "$i")" --group "$GROUP" --consumer "c$i" \
            --workers "$THREADS" --block-ms 200 --max-attempts "$MAX_ATTEMPTS" \
            --backoff-base 50ms --backoff-cap 1s --max-retry-after 1s \
            --reclaim-interval 1s --reclaim-min-idle "$RECLAIM_MIN_IDLE" --shutdown-timeout 20s \
            --max-entry-bytes "$MAX_ENTRY_BYTES" \
            >>"$DIR/w$i.out" 2>>"$DIR/w$i.log" </dev/null &
        pid=$!
        echo "$pid" >"$DIR/run/pid.$i"
        wait "$pid"
        rc=$?
        rm -f "$DIR/run/pid.$i"
        echo "$rc $(date +%s%3N)" >>"$DIR/run/exits.$i"
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
for ((i = 1; i <= ALL_WORKERS; i++)); do
    # (bash reports each killed child on the supervisor's stderr: to a file)
    supervise "$i" 2>>"$DIR/supervisors.log" &
    SUPERVISORS+=($!)
done

ALSO=()
((DEPLOYMENTS == 1)) || ALSO=(--also-stream "$STREAM2")
"$CHAOS_BIN" produce --stream "$STREAM" "${ALSO[@]}" --events "$EVENTS" --seconds "$PRODUCE_SECS" \
    --aborts "$ABORTS" --killers "$KILLERS" --seed "$SEED" --max-entry-bytes "$MAX_ENTRY_BYTES" \
    --manifest "$DIR/manifest.jsonl" 2>"$DIR/produce.log" &
PRODUCER_PID=$!

# --- the faults -------------------------------------------------------------------------
KILLS_DONE=0
REDIS_RESTARTS_DONE=0
PG_RESTARTS_DONE=0
RETIRED=()
ORPHANED=0
NET_DONE=0
declare -A NET_KINDS=()
READONLY_DONE=0
PAUSES_DONE=0
PAUSERS=()
PG_GRACEFUL_DONE=0
GRACEFUL_STOPS=0
DESTROYS_DONE=0
TRIMS_DONE=0

is_retired() {
    local r
    for r in "${RETIRED[@]}"; do [[ $r == "$1" ]] && return 0; done
    return 1
}
# The pid of a random running, not retired worker among 1..$1 (default:
# all, both deployments), empty if none runs now.
pick_worker() {
    local tries i pid among=${1:-$ALL_WORKERS}
    for ((tries = 0; tries < 50; tries++)); do
        i=$((1 + RANDOM % among))
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
    local picked i pid try
    # A worker picked may exit before the signal (a start that failed while
    # a server was down, a crash-loop abort): pick again (seed 131 lost a
    # kill so, and failed the run for it).
    for ((try = 0; try < 20; try++)); do
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
            return
        fi
    done
}
# SIGSTOP of a random worker, SIGCONT 3–6 s later (in the background: the
# other faults go on meanwhile).
pause_worker() {
    local picked i pid secs
    picked=$(pick_worker)
    [[ -n $picked ]] || {
        say "no running worker to pause"
        return
    }
    read -r i pid <<<"$picked"
    secs=$(rand_secs 3 6)
    if kill -STOP "$pid" 2>/dev/null; then
        PAUSES_DONE=$((PAUSES_DONE + 1))
        say "$(elapsed)s: SIGSTOP c$i (pid $pid) for ${secs}s, pause $PAUSES_DONE"
        (
            sleep "$secs"
            kill -CONT "$pid" 2>/dev/null || true
        ) &
        PAUSERS+=($!)
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
        picked=$(pick_worker "$WORKERS")
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

# A network fault between one worker process and one server, for a few
# seconds (or an instant, for drop and reset).
net_fault() {
    local i=$((1 + RANDOM % ALL_WORKERS)) server kind secs
    server=$( ((RANDOM % 2)) && echo redis || echo pg)
    kind=$(printf '%s\n' delay drop reset freeze refuse | sed -n "$((1 + RANDOM % 5))p")
    case $kind in
    delay)
        secs=$(rand_secs 2 5)
        proxy_cmd "$i" "$server" "delay $((50 + RANDOM % 350))"
        sleep "$secs"
        proxy_cmd "$i" "$server" pass
        ;;
    drop | reset)
        secs=0
        proxy_cmd "$i" "$server" "$kind"
        ;;
    freeze)
        # Longer than the reader's read timeout (block + 5 s), often longer
        # than the other commands' (10 s): a half-open connection, no RST.
        secs=$(rand_secs 6 12)
        proxy_cmd "$i" "$server" freeze
        sleep "$secs"
        proxy_cmd "$i" "$server" pass
        ;;
    refuse)
        secs=$(rand_secs 1 4)
        proxy_cmd "$i" "$server" "refuse on"
        proxy_cmd_wait "$i" "$server"
        proxy_cmd "$i" "$server" reset
        sleep "$secs"
        proxy_cmd "$i" "$server" "refuse off"
        ;;
    esac
    proxy_cmd_wait "$i" "$server"
    NET_DONE=$((NET_DONE + 1))
    NET_KINDS[$kind]=$((${NET_KINDS[$kind]:-0} + 1))
    say "$(elapsed)s: network fault: $kind between c$i and $server (${secs}s)"
}
# Waits until the proxy took the last command.
proxy_cmd_wait() {
    local t
    for ((t = 0; t < 100; t++)); do
        [[ -e $DIR/proxy/w$1-$2.cmd ]] || return 0
        sleep 0.02
    done
}
# PostgreSQL read-only for a few seconds: restarted as a hot standby (every
# write fails with 25006, as on a replica during a failover), then promoted.
# (ALTER SYSTEM SET default_transaction_read_only would not do: taskhub's
# transactions say READ WRITE, which overrides it.)
readonly_window() {
    as_pg "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -m fast -w stop >/dev/null
    PG_UP=0
    as_pg touch "$DIR/pg/data/standby.signal"
    start_pg
    say "$(elapsed)s: PostgreSQL read-only (a hot standby)"
    sleep "$(rand_secs 2 5)"
    as_pg "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -w promote >/dev/null
    READONLY_DONE=$((READONLY_DONE + 1))
    say "$(elapsed)s: PostgreSQL promoted: read-write again"
}
# Every running worker stopped gracefully (SIGTERM; its supervisor starts it
# again) while PostgreSQL is down.
graceful_during_pg_outage() {
    local i pid
    stop_pg
    say "$(elapsed)s: PostgreSQL stopped (immediate); SIGTERM to every worker"
    for ((i = 1; i <= ALL_WORKERS; i++)); do
        pid=$(cat "$DIR/run/pid.$i" 2>/dev/null) || continue
        if ! is_retired "$i" && kill -TERM "$pid" 2>/dev/null; then
            GRACEFUL_STOPS=$((GRACEFUL_STOPS + 1))
        fi
    done
    sleep "$(rand_secs 2 4)"
    start_pg
    PG_GRACEFUL_DONE=$((PG_GRACEFUL_DONE + 1))
    say "$(elapsed)s: PostgreSQL started again"
}
# XGROUP DESTROY, recording what was pending (the driver's `destroy`): an
# entry trimmed while pending and then wiped from the pending list by the
# destroy is gone without a trace, and the check accepts it has no outcome.
destroy_group() {
    local out
    out=$("$CHAOS_BIN" destroy --stream "$STREAM" --group "$GROUP" \
        --record "$DIR/destroyed" 2>>"$DIR/destroy.log") || {
        say "destroy failed: $(tail -n 2 "$DIR/destroy.log")"
        return
    }
    DESTROYS_DONE=$((DESTROYS_DONE + 1))
    say "$(elapsed)s: XGROUP DESTROY $STREAM $GROUP ($out)"
}
TRIMMED=0
trim_stream() {
    local out n tries=0
    # Right after a group destroy or a Redis restart the group may not be
    # there yet (NOGROUP) until a worker creates it again: tried again for
    # up to 10 s, so that the fault happens (CI's run of seed 20261201 met
    # it once and failed on the count alone).
    until out=$("$CHAOS_BIN" trim --stream "$STREAM" --group "$GROUP" --pending 20 \
        --record "$DIR/trims" 2>>"$DIR/trim.log"); do
        tries=$((tries + 1))
        if ((tries >= 20)); then
            say "trim failed: $(tail -n 2 "$DIR/trim.log")"
            return
        fi
        sleep 0.5
    done
    n=${out%% *}
    TRIMMED=$((TRIMMED + n))
    TRIMS_DONE=$((TRIMS_DONE + 1))
    say "$(elapsed)s: XTRIM $STREAM MINID: $out"
}

ACTIONS=()
for ((i = 0; i < KILLS; i++)); do ACTIONS+=(kill); done
for ((i = 0; i < NET_FAULTS; i++)); do ACTIONS+=(net); done
for ((i = 0; i < PAUSES; i++)); do ACTIONS+=(pause); done
for ((i = 0; i < READONLY_WINDOWS; i++)); do ACTIONS+=(readonly); done
for ((i = 0; i < PG_GRACEFUL; i++)); do ACTIONS+=(pggraceful); done
for ((i = 0; i < GROUP_DESTROYS; i++)); do ACTIONS+=(destroy); done
for ((i = 0; i < TRIMS; i++)); do ACTIONS+=(trim); done
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
    net) net_fault ;;
    pause) pause_worker ;;
    readonly) readonly_window ;;
    pggraceful) graceful_during_pg_outage ;;
    destroy) destroy_group ;;
    trim) trim_stream ;;
    esac
done

for p in "${PAUSERS[@]}"; do wait "$p" || true; done
wait "$PRODUCER_PID" || die "the producer failed: $(tail -n 5 "$DIR/produce.log")"
PRODUCER_PID=""
say "$(elapsed)s: all $EVENTS events produced; waiting for the group to drain"
STREAMS=("$STREAM")
((DEPLOYMENTS == 1)) || STREAMS+=("$STREAM2")
for s in "${STREAMS[@]}"; do
    "$CHAOS_BIN" settle --stream "$s" --group "$GROUP" --timeout "${SETTLE_TIMEOUT}s" 2>>"$DIR/settle.log" ||
        {
            say "$s not drained: $(tail -n 3 "$DIR/settle.log")"
            redis_cli XPENDING "$s" "$GROUP" >&2 || true
        }
done
ELAPSED=$(elapsed)

# --- graceful stop ----------------------------------------------------------------------
for ((i = 1; i <= ALL_WORKERS; i++)); do touch "$DIR/run/stop.$i"; done
for ((i = 1; i <= ALL_WORKERS; i++)); do
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
ABORT_DEATHS=$(cat "$DIR"/run/exits.* 2>/dev/null | grep -c '^134 ' || true)
KILLED_SEEN=$(cat "$DIR"/run/exits.* 2>/dev/null | grep -c '^137 ' || true)
START_FAILURES=$(cat "$DIR"/run/exits.* 2>/dev/null | grep -c '^1 ' || true)
RECLAIMED=$(cat "$DIR"/w*.log | sed -n 's/.*reclaimed \([0-9]*\) entries.*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
# The handler's events of backlogs' mixed reads that waited for other reads'
# (batch mode, src/worker/gather.rs), from the summaries of the processes
# that stopped gracefully (a killed one prints none: a lower bound).
GATHERED=$(cat "$DIR"/w*.out 2>/dev/null | sed -n 's/.* gathered=\([0-9]*\).*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
say "worker exits: $KILLED_SEEN SIGKILL, $ABORT_DEATHS abort, $START_FAILURES start failures (a server was down)"

NET_TEXT=""
for k in delay drop reset freeze refuse; do
    [[ -z ${NET_KINDS[$k]:-} ]] || NET_TEXT+="${NET_TEXT:+, }$k ${NET_KINDS[$k]}"
done
status=0
RUST_LOG=warn "$CHAOS_BIN" check --stream "$STREAM" --group "$GROUP" --manifest "$DIR/manifest.jsonl" \
    --max-attempts "$MAX_ATTEMPTS" --mode "$MODE" --kills "$KILLS_DONE" \
    --abort-deaths "$ABORT_DEATHS" --redis-restarts "$REDIS_RESTARTS_DONE" \
    --pg-restarts "$PG_RESTARTS_DONE" --killed-for-good "${#RETIRED[@]}" \
    --orphaned "$ORPHANED" --reclaimed "$RECLAIMED" --elapsed "$ELAPSED" \
    --trims "$DIR/trims" --destroyed "$DIR/destroyed" --run-dir "$DIR" \
    --figure "network faults (worker <-> server)=$NET_DONE${NET_TEXT:+ ($NET_TEXT)}" \
    --figure "worker pauses (SIGSTOP 3-6 s, past --reclaim-min-idle)=$PAUSES_DONE" \
    --figure "PostgreSQL read-only windows (standby, promoted)=$READONLY_DONE" \
    --figure "graceful restarts while PostgreSQL is down=$PG_GRACEFUL_DONE ($GRACEFUL_STOPS SIGTERMs)" \
    --figure "XGROUP DESTROY=$DESTROYS_DONE" \
    --figure "XTRIM MINID (entries deleted)=$TRIMS_DONE ($TRIMMED)" \
    --figure "deployments (same group, own stream and database)=$DEPLOYMENTS" \
    --figure "handler's events gathered across reads (graceful exits' summaries)=$GATHERED" || status=1
if ((DEPLOYMENTS == 2)); then
    # The second deployment: the same entries on its own stream, one worker
    # process, no trims, destroys or permanent kills of its own.
    echo "second deployment ($STREAM2, database chaos2):"
    RUST_LOG=warn "$CHAOS_BIN" check --stream "$STREAM2" --group "$GROUP" \
        --database-url "$DATABASE_URL2" --manifest "$DIR/manifest.jsonl" \
        --max-attempts "$MAX_ATTEMPTS" --mode "$MODE" --kills "$KILLS_DONE" \
        --abort-deaths "$ABORT_DEATHS" --redis-restarts "$REDIS_RESTARTS_DONE" \
        --pg-restarts "$PG_RESTARTS_DONE" --elapsed "$ELAPSED" --run-dir "$DIR" || status=1
fi

# The same promises once more, straight from redis-cli and psql.
for d in $(seq 1 "$DEPLOYMENTS"); do
    s=$STREAM db=chaos
    ((d == 1)) || s=$STREAM2 db=chaos2
    pending=$(redis_cli XPENDING "$s" "$GROUP" | head -n 1)
    doubled=$(psql_q -d $db -c "SELECT count(*) FROM (SELECT event_id FROM notifications GROUP BY event_id HAVING count(*) > 1) d")
    both=$(psql_q -d $db -c "SELECT count(*) FROM chaos_dlq d JOIN notifications n USING (event_id) WHERE d.kind <> 'trimmed'")
    dlq_len=$(redis_cli XLEN "$s:dlq")
    dlq_rows=$(psql_q -d $db -c "SELECT count(DISTINCT original_id) FROM chaos_dlq")
    say "redis-cli: $s pending=$pending, $s:dlq has $dlq_len entries ($dlq_rows distinct originals); psql $db: $doubled events with 2+ effects, $both both dead-lettered and applied"
    [[ $pending == 0 && $doubled == 0 && $both == 0 && $dlq_len == "$dlq_rows" ]] || status=1
done
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
