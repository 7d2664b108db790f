#!/usr/bin/env bash
# scripts/demo.sh — taskhub end to end, showing the point: duplicates skipped,
# transient failures retried, poison events dead-lettered, fixed and replayed.
#
# Usage:  bash scripts/demo.sh          (DEMO_COUNT=2000 bash scripts/demo.sh)
#
# 1. makes sure Redis and PostgreSQL run          (scripts/services.sh)
# 2. builds the release binary                    (cargo build --release)
# 3. creates the tables, and a demo handler function, demo_apply(), which
#    inserts a notification for a numeric payload, fails twice with a
#    serialization error (retryable) for "flaky" events before it succeeds,
#    and fails for good on a payload that is not a number (22P02, permanent)
# 4. produces a mix to a fresh stream: DEMO_COUNT plain events (default
#    1000), 50 of them sent a second time, 25 flaky events, 10 poison ones
# 5. runs the worker until idle, with the web page on DEMO_PORT (9090)
# 6. says what happened: effects, duplicates, retries, dead letters by reason
# 7. "fixes the bug" (demo_apply now keeps non-numeric payloads as text),
#    replays the dead letters, runs again, and ends with a one-line verdict.
#
# REDIS_URL, DATABASE_URL, RUST_LOG, DEMO_COUNT, DEMO_PORT and DEMO_BIN are
# passed through if you set them. Step 1 does not read the URLs:
# scripts/services.sh always checks Redis on 127.0.0.1:6379, PostgreSQL on
# 127.0.0.1:5432 and the database `taskhub` there (starting or installing the
# servers when nothing answers), even when REDIS_URL and DATABASE_URL point
# elsewhere; the demo itself then uses the URLs, whose database must exist.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -f $HOME/.cargo/env ]]; then
    # shellcheck source=/dev/null
    source "$HOME/.cargo/env"
fi

export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
export DATABASE_URL=${DATABASE_URL:-postgres://postgres:taskhub@127.0.0.1:5432/taskhub}
export RUST_LOG=${RUST_LOG:-error}
RUN=$(date +%s)
STREAM="demo:events:$RUN"
GROUP="demo-$RUN"
COUNT=${DEMO_COUNT:-1000}
DUPLICATES=50
FLAKY=25
POISON=10
PORT=${DEMO_PORT:-9090}
# DEMO_BIN: a taskhub binary built already (the test suite runs the demo
# with its own); otherwise the release build.
taskhub=${DEMO_BIN:-target/release/taskhub}

step() { printf '\n==> %s\n' "$*"; }
sql() { psql "$DATABASE_URL" -X -At -v ON_ERROR_STOP=1 -q "$@"; }
summary_field() { sed -n "s/.*\b$1=\([0-9]*\).*/\1/p" <<<"$2" | tail -n 1; }

step "services"
bash scripts/services.sh

if [[ -z ${DEMO_BIN:-} ]]; then
    step "build"
    cargo build --release --quiet
fi

step "migrate, and the demo handler"
"$taskhub" migrate
# A sequence per flaky event counts its attempts: nextval() is not rolled
# back with the failed transaction (a table row would be).
sql -v run="$RUN" -v flaky="$FLAKY" <<'SQL'
SELECT format('CREATE SEQUENCE %I', 'demo_attempts_' || md5('flaky-' || :'run' || '-' || i))
FROM generate_series(0, :flaky - 1) i
\gexec
CREATE OR REPLACE FUNCTION demo_apply(id text, p text) RETURNS void AS $$
BEGIN
  IF p = 'flaky' THEN
    IF nextval(quote_ident('demo_attempts_' || md5(id))) <= 2 THEN
      RAISE EXCEPTION 'downstream busy, try again' USING ERRCODE = '40001';
    END IF;
    p := '0';
  END IF;
  INSERT INTO notifications (event_id, payload) VALUES (id, p::int::text);
END $$ LANGUAGE plpgsql;
SQL
echo "demo_apply(): numbers applied, 'flaky' fails twice first, anything else fails for good"

step "produce a mix to $STREAM"
{
    for ((i = 0; i < COUNT; i++)); do printf '{"event_id":"order-%s-%d","payload":"%d"}\n' "$RUN" "$i" "$i"; done
    for ((i = 0; i < DUPLICATES; i++)); do printf '{"event_id":"order-%s-%d","payload":"%d"}\n' "$RUN" "$i" "$i"; done
    for ((i = 0; i < FLAKY; i++)); do printf '{"event_id":"flaky-%s-%d","payload":"flaky"}\n' "$RUN" "$i"; done
    for ((i = 0; i < POISON; i++)); do printf '{"event_id":"poison-%s-%d","payload":"n/a #%d"}\n' "$RUN" "$i" "$i"; done
} | "$taskhub" produce --stream "$STREAM" --quiet
echo "$COUNT plain events, $DUPLICATES of them sent twice, $FLAKY flaky, $POISON poison"

step "run until idle (group $GROUP; the page is at http://127.0.0.1:$PORT/ while it runs)"
run() {
    "$taskhub" run --stream "$STREAM" --group "$GROUP" --until-idle --block-ms 200 \
        --sql 'SELECT demo_apply($1, $2)' --backoff-base 100ms --backoff-cap 1s \
        --http "$PORT"
}
first=$(run)
echo "$first"

step "what happened"
applied=$(summary_field applied "$first")
duplicates=$(summary_field duplicates "$first")
retries=$(summary_field retries "$first")
dead=$(summary_field dead_lettered "$first")
echo "applied once each:       $applied events"
echo "duplicates skipped:      $duplicates (the same event_id delivered again)"
echo "retries:                 $retries (each flaky event failed twice, then succeeded)"
echo "dead-lettered:           $dead (permanent failures, not retried)"
"$taskhub" dlq --stream "$STREAM" stats

step "fix the cause (demo_apply keeps a payload that is not a number as text), then replay"
sql <<'SQL'
CREATE OR REPLACE FUNCTION demo_apply(id text, p text) RETURNS void AS $$
BEGIN
  INSERT INTO notifications (event_id, payload)
  VALUES (id, CASE WHEN p ~ '^[0-9]+$' THEN p::int::text ELSE p END);
END $$ LANGUAGE plpgsql;
SQL
"$taskhub" dlq --stream "$STREAM" replay --all
second=$(run)
echo "$second"

step "result"
counts=$(sql -F ' ' -v scope="$GROUP" <<'SQL'
SELECT count(*), count(DISTINCT event_id)
FROM notifications
WHERE event_id IN (SELECT event_id FROM processed_events WHERE scope = :'scope');
SQL
)
read -r rows distinct <<<"$counts"
pending=$(redis-cli -u "$REDIS_URL" --raw XPENDING "$STREAM" "$GROUP" | head -n 1)
left=$(redis-cli -u "$REDIS_URL" --raw XLEN "$STREAM:dlq")
expected=$((COUNT + FLAKY + POISON))
replayed=$(summary_field applied "$second")
echo "effects: $rows rows for $distinct distinct events ($expected distinct produced); pending: $pending; dead letters left: $left"
echo "look again: $taskhub run --stream '$STREAM' --group '$GROUP' --http $PORT, then http://127.0.0.1:$PORT/ and /dlq"
sql <<'SQL'
DROP FUNCTION demo_apply(text, text);
DO $$ DECLARE s text; BEGIN
  FOR s IN SELECT relname FROM pg_class WHERE relkind = 'S' AND relname LIKE 'demo\_attempts\_%' LOOP
    EXECUTE format('DROP SEQUENCE %I', s);
  END LOOP;
END $$;
SQL
if [[ $pending == 0 && $left == 0 ]] && ((rows == distinct && distinct == expected && duplicates == DUPLICATES && dead == POISON && replayed == POISON && retries == 2 * FLAKY)); then
    echo "VERDICT: OK — $expected events applied exactly once: $DUPLICATES duplicates skipped, $retries retries, $POISON dead letters replayed after the fix, nothing left pending."
else
    echo "VERDICT: FAILED — compare the numbers above." >&2
    exit 1
fi
