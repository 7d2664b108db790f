-- Where `taskhub dlq archive --to postgres` keeps dead letters it removes from
-- the dead-letter stream. The (stream, dead_letter_id) key makes a repeated
-- archive of the same entry harmless.
CREATE TABLE IF NOT EXISTS dead_letters_archive (
    stream         text        NOT NULL,
    dead_letter_id text        NOT NULL,
    event_id       text,
    kind           text,
    reason         text,
    fields         jsonb       NOT NULL,
    archived_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, dead_letter_id)
);
