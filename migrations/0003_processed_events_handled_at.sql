-- `taskhub prune --older-than D` deletes processed_events rows by age. A
-- BRIN index on handled_at finds them without scanning the table: rows are
-- appended in time order, so the index is a few pages, and keeping it up to
-- date costs the hot path next to nothing (unlike a B-tree).
CREATE INDEX IF NOT EXISTS processed_events_handled_at
    ON processed_events USING brin (handled_at);
