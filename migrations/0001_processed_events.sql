-- The idempotency record and the book's example effect (section 8.2.3).
--
-- processed_events is the arbiter of "exactly once": a worker inserts
-- (scope, event_id) with ON CONFLICT DO NOTHING in the same transaction as the
-- effect. One row inserted means "first time, apply the effect"; zero rows
-- means "already applied, just acknowledge".
CREATE TABLE IF NOT EXISTS processed_events (
    scope      text        NOT NULL,
    event_id   text        NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, event_id)
);

-- The effect of the built-in SQL handler. event_id is deliberately NOT unique
-- here: a duplicate effect must show up as a second row, so that tests can
-- catch it, instead of being hidden by a constraint violation.
CREATE TABLE IF NOT EXISTS notifications (
    id         bigserial   PRIMARY KEY,
    event_id   text        NOT NULL,
    payload    text,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS notifications_event_id ON notifications (event_id);
