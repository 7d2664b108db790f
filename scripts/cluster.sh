#!/usr/bin/env bash
# scripts/cluster.sh — a local Redis Cluster to try taskhub on: 3 masters and
# 3 replicas on 127.0.0.1, ports $BASE..$BASE+5 (default 7000..7005), with
# AOF so a restarted node keeps its data. The same commands as an operator
# would use (redis-server --cluster-enabled yes, redis-cli --cluster create),
# and the same ones tests/support/cluster.rs runs for the tests.
#
# Usage:  bash scripts/cluster.sh start|stop|status
#
# Then:   REDIS_URL=redis://127.0.0.1:7000 taskhub run --stream '{tasks}:events'
# (any node's URL is enough: taskhub detects the cluster and finds the others;
# a stream needs a hash tag, {tasks}, so that it and its dead-letter stream
# share a hash slot).
#
# Environment (optional):
#   TASKHUB_CLUSTER_PORT   first port (default 7000; the cluster bus uses +10000)
#   TASKHUB_CLUSTER_DIR    where the nodes keep their data (default /var/tmp/taskhub-cluster)
set -euo pipefail

BASE=${TASKHUB_CLUSTER_PORT:-7000}
DIR=${TASKHUB_CLUSTER_DIR:-/var/tmp/taskhub-cluster}
PORTS=$(seq "$BASE" $((BASE + 5)))

need() {
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return
    echo "cluster.sh: installing redis-server and redis-tools (Debian packages)" >&2
    apt-get install -y -qq redis-server redis-tools >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null && apt-get install -y -qq redis-server redis-tools >/dev/null; }
}

state() {
    redis-cli -p "$BASE" cluster info 2>/dev/null | tr -d '\r' | grep '^cluster_state:' || echo "cluster_state:down"
}

start() {
    need
    if [ "$(state)" = "cluster_state:ok" ]; then
        echo "cluster already running on 127.0.0.1:$BASE-$((BASE + 5))"
        return
    fi
    mkdir -p "$DIR"
    for p in $PORTS; do
        mkdir -p "$DIR/$p"
        redis-server --daemonize yes --bind 127.0.0.1 --port "$p" \
            --cluster-enabled yes --cluster-config-file nodes.conf \
            --cluster-node-timeout 5000 --dir "$DIR/$p" \
            --appendonly yes --save "" \
            --logfile "$DIR/$p/redis.log" --pidfile "$DIR/$p/redis.pid"
    done
    for p in $PORTS; do
        for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
    done
    if ! redis-cli -p "$BASE" cluster info | grep -q 'cluster_slots_assigned:16384'; then
        # shellcheck disable=SC2046
        redis-cli --cluster create $(for p in $PORTS; do printf '127.0.0.1:%s ' "$p"; done) \
            --cluster-replicas 1 --cluster-yes >"$DIR/create.log"
    fi
    for _ in $(seq 100); do
        [ "$(state)" = "cluster_state:ok" ] && break
        sleep 0.2
    done
    [ "$(state)" = "cluster_state:ok" ] || { echo "cluster did not come up; see $DIR" >&2; exit 1; }
    echo "cluster running: 3 masters + 3 replicas on 127.0.0.1:$BASE-$((BASE + 5)) (data in $DIR)"
}

stop() {
    for p in $PORTS; do
        redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true
    done
    rm -rf "$DIR"
    echo "cluster stopped"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status)
    state
    redis-cli -p "$BASE" cluster nodes 2>/dev/null | awk '{print $2, $3, $9}' || true
    ;;
*)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
