#!/usr/bin/env bash
# scripts/services.sh — make sure Redis and PostgreSQL answer where taskhub's
# defaults expect them:
#
#   REDIS_URL    = redis://127.0.0.1:6379
#   DATABASE_URL = postgres://postgres:taskhub@127.0.0.1:5432/taskhub
#
# Usage:  bash scripts/services.sh
#
# For each service it tries, in order:
#   a) something already answers on 127.0.0.1 at the port: use it;
#   b) the server is installed: start it (Redis as a daemon with its state in
#      $TASKHUB_STATE_DIR/redis; PostgreSQL through the Debian cluster on port
#      5432 if there is one, else a private cluster in $TASKHUB_STATE_DIR/pg);
#   c) a Docker engine works: `docker compose up -d redis postgres`;
#   d) install the Debian packages with apt-get, then go back to b).
# Then it waits (up to $TASKHUB_SERVICES_TIMEOUT seconds, default 30) for both,
# makes sure the database `taskhub` exists, and prints one line per service
# saying what was used. Running it again is harmless. Exits non-zero with a
# message when a service cannot be made to work.
#
# Environment (all optional):
#   TASKHUB_STATE_DIR          where started servers keep their data
#                              (default /var/tmp/taskhub)
#   TASKHUB_SERVICES_TIMEOUT   seconds to wait for the servers (default 30)
#   TASKHUB_SERVICES           "redis" to see to Redis alone (scripts/bench.sh
#                              on a private PostgreSQL of its own); default both
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOST=127.0.0.1
REDIS_PORT=6379
PG_PORT=5432
PG_USER=postgres
PG_PASSWORD=taskhub # the password in the default DATABASE_URL
DB_NAME=taskhub
STATE_DIR=${TASKHUB_STATE_DIR:-/var/tmp/taskhub}
TIMEOUT=${TASKHUB_SERVICES_TIMEOUT:-30}
case ${TASKHUB_SERVICES:-both} in
redis) WANT_PG=0 ;;
both) WANT_PG=1 ;;
*)
    echo "services: ERROR: TASKHUB_SERVICES must be 'redis' or 'both', not '$TASKHUB_SERVICES'" >&2
    exit 2
    ;;
esac

REDIS_HOW="" # what we used, for the summary lines at the end
PG_HOW=""

say() { printf 'services: %s\n' "$*" >&2; }
die() {
    printf 'services: ERROR: %s\n' "$*" >&2
    exit 1
}

# Run a command as root (directly, or through sudo).
as_root() {
    if [[ $EUID -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

# Run a command as the OS user that owns our private PostgreSQL cluster:
# initdb and postgres refuse to run as root, so root hands over to `postgres`.
as_pg_owner() {
    if [[ $EUID -eq 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

# ---------------------------------------------------------------- probes ----

# Does a Redis server answer PING on 127.0.0.1:6379?
redis_up() {
    if command -v redis-cli >/dev/null 2>&1; then
        # `timeout`: redis-cli waits forever if a non-Redis program holds the port.
        [[ $(timeout 3 redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]]
    else
        # No client: speak the protocol by hand over bash's /dev/tcp.
        local reply
        reply=$(
            exec 2>/dev/null 3<>"/dev/tcp/$HOST/$REDIS_PORT" || exit 1
            printf 'PING\r\n' >&3
            IFS= read -r -t 2 line <&3 && printf '%s' "${line%$'\r'}"
        ) || return 1
        [[ $reply == +PONG ]]
    fi
}

# Does a PostgreSQL server accept connections on 127.0.0.1:5432?
pg_up() {
    if command -v pg_isready >/dev/null 2>&1; then
        pg_isready -q -h "$HOST" -p "$PG_PORT" -t 2
    else
        (exec 3<>"/dev/tcp/$HOST/$PG_PORT") 2>/dev/null
    fi
}

# Is anything at all listening on the port?
port_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# Wait until "$1" (a probe function) succeeds, at most $TIMEOUT seconds.
wait_for() {
    local probe=$1 deadline=$((SECONDS + TIMEOUT))
    until "$probe"; do
        ((SECONDS < deadline)) || return 1
        sleep 1
    done
}

# shellcheck source=pg_bin_dir.sh
source "$ROOT/scripts/pg_bin_dir.sh"

# "<version> <name>" of the Debian cluster configured for port 5432, if any.
debian_cluster() {
    command -v pg_lsclusters >/dev/null 2>&1 || return 1
    pg_lsclusters -h 2>/dev/null | awk -v p="$PG_PORT" '$3 == p { print $1, $2; found = 1; exit } END { exit !found }'
}

docker_ok() {
    command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1
}

compose() {
    if docker compose version >/dev/null 2>&1; then
        docker compose -f "$ROOT/docker-compose.yml" "$@"
    elif command -v docker-compose >/dev/null 2>&1; then
        docker-compose -f "$ROOT/docker-compose.yml" "$@"
    else
        die "docker works but neither 'docker compose' nor 'docker-compose' is installed"
    fi
}

# ---------------------------------------------------------- start servers ----

# Start redis-server as a daemon. Returns 1 if it is not installed.
start_redis() {
    local bin dir
    bin=$(command -v redis-server 2>/dev/null) || return 1
    dir=$STATE_DIR/redis
    mkdir -p "$dir" || die "cannot create $dir (set TASKHUB_STATE_DIR to a writable directory)"
    say "starting $bin (data in $dir)"
    "$bin" --daemonize yes --bind "$HOST" --port "$REDIS_PORT" \
        --appendonly yes --appendfsync everysec --dir "$dir" \
        --logfile "$dir/redis.log" --pidfile "$dir/redis.pid" ||
        die "redis-server failed to start; see $dir/redis.log"
    REDIS_HOW="started redis-server on $HOST:$REDIS_PORT (data and log in $dir)"
}

# Start PostgreSQL: the Debian cluster on port 5432 if there is one, else a
# private cluster under $STATE_DIR/pg. Returns 1 if it is not installed.
start_postgres() {
    local cluster bin data
    if cluster=$(debian_cluster); then
        say "starting Debian cluster $cluster"
        # shellcheck disable=SC2086 # "<version> <name>" is meant to split
        as_root pg_ctlcluster $cluster start ||
            die "pg_ctlcluster $cluster start failed; see /var/log/postgresql/"
        PG_HOW="started Debian cluster ${cluster/ //} on port $PG_PORT"
        return 0
    fi
    bin=$(pg_bin_dir) || return 1
    data=$STATE_DIR/pg
    if [[ $EUID -eq 0 ]] && ! id postgres >/dev/null 2>&1; then
        die "initdb refuses to run as root and there is no user 'postgres' to run it as"
    fi
    mkdir -p "$data" || die "cannot create $data (set TASKHUB_STATE_DIR to a writable directory)"
    if [[ ! -f $data/PG_VERSION ]]; then
        say "creating a PostgreSQL cluster in $data"
        if [[ $EUID -eq 0 ]]; then
            chown postgres: "$data" || die "cannot chown $data to user postgres"
        fi
        chmod 700 "$data" || die "cannot chmod $data"
        # Local socket: trust. TCP: password, the one in the default DATABASE_URL.
        (umask 077 && printf '%s\n' "$PG_PASSWORD" >"$data.pw") || die "cannot write $data.pw"
        [[ $EUID -ne 0 ]] || chown postgres: "$data.pw"
        as_pg_owner "$bin/initdb" -D "$data" -U "$PG_USER" --pwfile="$data.pw" \
            --auth-local=trust --auth-host=scram-sha-256 \
            --encoding=UTF8 --locale=C >"$STATE_DIR/initdb.log" 2>&1 || {
            rm -f "$data.pw"
            die "initdb failed; see $STATE_DIR/initdb.log"
        }
        rm -f "$data.pw"
        # Listen on loopback only, with the socket inside the data directory
        # (/var/run/postgresql may not exist or not be writable).
        printf "listen_addresses = '%s'\nport = %s\nunix_socket_directories = '%s'\n" \
            "$HOST" "$PG_PORT" "$data" | as_pg_owner tee -a "$data/postgresql.conf" >/dev/null ||
            die "cannot write $data/postgresql.conf"
    fi
    say "starting PostgreSQL from $bin (data in $data)"
    as_pg_owner "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -t "$TIMEOUT" start >/dev/null ||
        die "pg_ctl start failed; see $data/server.log"
    PG_HOW="started $bin/postgres on $HOST:$PG_PORT (data and log in $data)"
}

install_packages() {
    command -v apt-get >/dev/null 2>&1 ||
        die "no Redis/PostgreSQL found, no Docker engine, and no apt-get to install them;" \
            "install redis-server and postgresql, or start them on $HOST:$REDIS_PORT and $HOST:$PG_PORT"
    say "installing Debian packages: $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq ||
        die "apt-get update failed"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null ||
        die "apt-get install $* failed"
}

# a) running already, b) installed: start it. Returns 1 if neither.
ensure_redis_local() {
    # Something listening that does not answer yet (still loading, say) is
    # used too: the final wait gives it time, or fails with a clear message.
    if redis_up || port_open "$REDIS_PORT"; then
        REDIS_HOW=${REDIS_HOW:-"using the server already running on $HOST:$REDIS_PORT"}
        return 0
    fi
    start_redis
}

ensure_postgres_local() {
    if pg_up || port_open "$PG_PORT"; then
        PG_HOW=${PG_HOW:-"using the server already running on $HOST:$PG_PORT"}
        return 0
    fi
    start_postgres
}

# ------------------------------------------------------------- database ----

# psql over TCP as the role and password of the default DATABASE_URL.
psql_tcp() {
    PGPASSWORD=$PG_PASSWORD PGCONNECT_TIMEOUT=5 \
        psql -X -q -v ON_ERROR_STOP=1 -h "$HOST" -p "$PG_PORT" -U "$PG_USER" "$@"
}

# psql as OS user postgres over the default local socket (Debian's peer auth).
psql_peer() {
    if [[ $EUID -eq 0 ]]; then
        runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -p "$PG_PORT" "$@"
    else
        sudo -n -u postgres psql -X -q -v ON_ERROR_STOP=1 -p "$PG_PORT" "$@"
    fi
}

# Make sure the default DATABASE_URL can log in and database `taskhub` exists.
ensure_database() {
    if ! command -v psql >/dev/null 2>&1; then
        if [[ $PG_HOW == *docker* ]]; then
            return 0 # the compose file creates the database
        fi
        install_packages postgresql-client
    fi

    if ! psql_tcp -d postgres -Atc 'SELECT 1' >/dev/null 2>&1; then
        # A fresh Debian cluster: role postgres has no password, so the
        # default DATABASE_URL cannot log in over TCP. Give it the default
        # password, but never overwrite one that is set already.
        local has_pw
        has_pw=$(psql_peer -d postgres -Atc \
            "SELECT rolpassword IS NOT NULL FROM pg_authid WHERE rolname = '$PG_USER'" 2>/dev/null) ||
            die "cannot log in to PostgreSQL on $HOST:$PG_PORT as $PG_USER with the default password," \
                "nor as OS user postgres over the local socket"
        if [[ $has_pw == f ]]; then
            say "setting the password of role $PG_USER to the one in the default DATABASE_URL"
            psql_peer -d postgres -c "ALTER ROLE $PG_USER PASSWORD '$PG_PASSWORD'" >/dev/null
        fi
        psql_tcp -d postgres -Atc 'SELECT 1' >/dev/null 2>&1 ||
            die "cannot log in to PostgreSQL on $HOST:$PG_PORT as $PG_USER with password '$PG_PASSWORD';" \
                "set DATABASE_URL to something that works, or allow that login"
    fi

    local exists
    exists=$(psql_tcp -d postgres -Atc "SELECT 1 FROM pg_database WHERE datname = '$DB_NAME'")
    if [[ $exists != 1 ]]; then
        say "creating database $DB_NAME"
        # Tolerate a concurrent creation: what matters is that it exists after.
        psql_tcp -d postgres -c "CREATE DATABASE $DB_NAME" >/dev/null 2>&1 ||
            [[ $(psql_tcp -d postgres -Atc "SELECT 1 FROM pg_database WHERE datname = '$DB_NAME'") == 1 ]] ||
            die "could not create database $DB_NAME"
        PG_HOW+=", created database $DB_NAME"
    else
        PG_HOW+=", database $DB_NAME exists"
    fi
}

# ----------------------------------------------------------------- main ----

redis_ok=0 pg_ok=$((!WANT_PG))
ensure_redis_local && redis_ok=1
if ((WANT_PG)); then
    ensure_postgres_local && pg_ok=1
fi

if ((!redis_ok || !pg_ok)) && docker_ok; then
    say "starting Docker services from $ROOT/docker-compose.yml"
    services=()
    ((redis_ok)) || services+=(redis)
    ((pg_ok)) || services+=(postgres)
    compose up -d "${services[@]}" || die "docker compose up -d ${services[*]} failed"
    ((redis_ok)) || REDIS_HOW="docker compose service redis on $HOST:$REDIS_PORT"
    ((pg_ok)) || PG_HOW="docker compose service postgres on $HOST:$PG_PORT"
    redis_ok=1 pg_ok=1
fi

if ((!redis_ok || !pg_ok)); then
    packages=()
    ((redis_ok)) || packages+=(redis-server)
    ((pg_ok)) || packages+=(postgresql postgresql-client)
    install_packages "${packages[@]}"
    # The packages' install scripts may have started the servers already.
    ((redis_ok)) || ensure_redis_local || die "redis-server is still missing after apt-get install"
    ((pg_ok)) || ensure_postgres_local || die "PostgreSQL is still missing after apt-get install"
fi

wait_for redis_up ||
    die "Redis does not answer PING on $HOST:$REDIS_PORT after ${TIMEOUT}s ($REDIS_HOW); a password, or another program on that port?"
printf 'redis:    %s\n' "$REDIS_HOW"
((WANT_PG)) || exit 0
wait_for pg_up || die "PostgreSQL does not answer on $HOST:$PG_PORT after ${TIMEOUT}s ($PG_HOW)"
ensure_database
printf 'postgres: %s\n' "$PG_HOW"
