#!/usr/bin/env bash
# scripts/demo.sh — run taskhub end to end and show what happened.
#
# Usage:  bash scripts/demo.sh            (DEMO_COUNT=5000 bash scripts/demo.sh)
#
# 1. makes sure Redis and PostgreSQL run          (scripts/services.sh)
# 2. builds the release binary                    (cargo build --release)
# 3. creates the tables                           (taskhub migrate)
# 4. adds DEMO_COUNT demo events (default 1000) to a fresh stream, so that
#    every run starts clean                       (taskhub produce)
# 5. processes them until the stream is idle      (taskhub run --until-idle)
# 6. counts the effects in PostgreSQL and what is left in Redis.
#
# Exactly once means: no event has two notifications rows, every event either
# has its row or sits in the dead-letter stream, and nothing is left pending.
# REDIS_URL, DATABASE_URL and RUST_LOG are passed through if you set them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -f $HOME/.cargo/env ]]; then
    # shellcheck source=/dev/null
    source "$HOME/.cargo/env"
fi

export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
export DATABASE_URL=${DATABASE_URL:-postgres://postgres:taskhub@127.0.0.1:5432/taskhub}
export RUST_LOG=${RUST_LOG:-info}
STREAM="demo:events:$(date +%s)"
GROUP="demo-$(date +%s)"
COUNT=${DEMO_COUNT:-1000}
taskhub=target/release/taskhub

step() { printf '\n==> %s\n' "$*"; }

step "services"
bash scripts/services.sh

step "build"
cargo build --release --quiet

step "migrate"
"$taskhub" migrate

step "produce $COUNT events to $STREAM"
"$taskhub" produce --stream "$STREAM" --count "$COUNT" --quiet
echo "produced $COUNT events"

step "run until idle (group $GROUP)"
"$taskhub" run --stream "$STREAM" --group "$GROUP" --until-idle

step "result"
# The group is new on every run, and it is the idempotency scope: the events
# of this run are the ones recorded under it in processed_events.
# psql variables (:'scope') are quoted by psql itself; they work on stdin, not -c.
counts=$(psql "$DATABASE_URL" -X -At -F ' ' -v ON_ERROR_STOP=1 -v scope="$GROUP" <<'SQL'
SELECT count(*), count(DISTINCT event_id)
FROM notifications
WHERE event_id IN (SELECT event_id FROM processed_events WHERE scope = :'scope');
SQL
)
read -r rows distinct <<<"$counts"
pending=$(redis-cli -u "$REDIS_URL" --raw XPENDING "$STREAM" "$GROUP" | head -n 1)
dead=$(redis-cli -u "$REDIS_URL" --raw XLEN "$STREAM:dlq")

echo "notifications rows:  $rows (for $distinct distinct events; $COUNT produced)"
echo "pending in $GROUP:   $pending"
echo "dead letters:        $dead ($STREAM:dlq)"
# Exactly once: no event has two rows, and each event either had its effect
# or was dead-lettered; nothing is left pending.
if [[ $pending == 0 ]] && ((rows == distinct && distinct + dead == COUNT)); then
    echo "OK: each event had its effect exactly once, or went to the dead letters."
else
    echo "Something is off: compare the numbers above." >&2
    exit 1
fi
