-- Durable subscriptions: a named cursor over the log. `position` is the last
-- position the subscriber acknowledged as durable; delivery resumes after it.
CREATE TABLE strata.subscriptions (
    name       text        PRIMARY KEY CHECK (name <> ''),
    position   bigint      NOT NULL CHECK (position >= 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    -- The reader (replication slot) currently serving it, if any.
    reader     text,
    seen_at    timestamptz
);

-- Replication readers: one per process, each owning one logical slot. The
-- owner heartbeats `seen_at`; `strata slots list` flags slots whose owner has
-- not been seen for a while.
CREATE TABLE strata.replication_readers (
    slot_name     text        PRIMARY KEY,
    owner         text        NOT NULL,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    seen_at       timestamptz NOT NULL DEFAULT now(),
    -- Everything at or below this LSN was acknowledged to Postgres as durable,
    -- and acked_position is the last position committed at or below it: on
    -- restart the slot streams every position after acked_position.
    acked_lsn      pg_lsn,
    acked_position bigint,
    -- The last position the slot's exported snapshot could see when it was created.
    base_position bigint
);
