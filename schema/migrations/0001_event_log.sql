-- The event log: streams with their versions, the partitioned event table (the
-- transactional outbox), and the log head that hands out positions.

-- One row. Appends take its row lock for the rest of their transaction while
-- they hand out positions, so positions are gap-free and commit in position
-- order: the replication stream, a read of the table in position order and a
-- subscription's cursor all agree on one order.
CREATE TABLE strata.log_head (
    id            boolean PRIMARY KEY DEFAULT true CHECK (id),
    last_position bigint  NOT NULL DEFAULT 0 CHECK (last_position >= 0)
);
INSERT INTO strata.log_head (id, last_position) VALUES (true, 0);

-- The version of every stream: the fence for optimistic concurrency.
CREATE TABLE strata.streams (
    stream     text        PRIMARY KEY,
    version    bigint      NOT NULL CHECK (version >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50);
-- Every append updates its streams' rows; free space on each page keeps those
-- updates HOT (no index insert, prunable in place).

-- One row per connection that waits for durability (see flush_barrier in
-- the events crate): updating it writes WAL, so the updating transaction's
-- synchronous commit waits until the WAL is flushed past everything committed
-- before it. A transaction that wrote no WAL of its own would not wait.
CREATE TABLE strata.flush_barriers (
    pid integer PRIMARY KEY,
    n   bigint  NOT NULL DEFAULT 0
) WITH (fillfactor = 50);

-- Every event. Partitioned by month of recorded_at so that retention drops
-- whole months and auditors read one partition. `xid` is the appending
-- transaction's id, kept for readers that reason about transactions in flight.
CREATE TABLE strata.events (
    position    bigint      NOT NULL CHECK (position > 0),
    stream      text        NOT NULL,
    version     bigint      NOT NULL CHECK (version > 0),
    type        text        NOT NULL,
    payload     jsonb       NOT NULL,
    metadata    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    xid         xid8        NOT NULL DEFAULT pg_current_xact_id(),
    PRIMARY KEY (position, recorded_at)
) PARTITION BY RANGE (recorded_at);

CREATE INDEX events_stream_version ON strata.events (stream, version);

-- Names the monthly partition that holds `at`, e.g. events_2026_11.
CREATE FUNCTION strata.partition_name(at timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT 'events_' || to_char(at AT TIME ZONE 'UTC', 'YYYY_MM')
$$;

-- Creates the partition holding `at` if it does not exist. Returns true when
-- it created one. Safe to call from many sessions at once.
CREATE FUNCTION strata.ensure_partition(at timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    lo   timestamptz := date_trunc('month', at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    hi   timestamptz := (date_trunc('month', at AT TIME ZONE 'UTC') + interval '1 month') AT TIME ZONE 'UTC';
    name text := strata.partition_name(at);
BEGIN
    IF to_regclass(format('strata.%I', name)) IS NOT NULL THEN
        RETURN false;
    END IF;
    -- Serialize creators; a session that still lost the race (its catalog
    -- view predates the winner's commit) finds the table already there.
    PERFORM pg_advisory_xact_lock(hashtext('strata.ensure_partition'));
    BEGIN
        EXECUTE format(
            'CREATE TABLE strata.%I PARTITION OF strata.events FOR VALUES FROM (%L) TO (%L)',
            name, lo, hi);
    EXCEPTION WHEN duplicate_table THEN
        RETURN false;
    END;
    RETURN true;
END
$$;

-- Creates the partitions from the month of `at` through `months_ahead` months
-- later. Returns how many it created.
CREATE FUNCTION strata.ensure_partitions(months_ahead integer, at timestamptz DEFAULT now())
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    created integer := 0;
    i integer;
BEGIN
    FOR i IN 0..months_ahead LOOP
        IF strata.ensure_partition(at + make_interval(months => i)) THEN
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END
$$;

SELECT strata.ensure_partitions(3);

-- Inserts only, published through the partition root so that consumers see
-- one relation whatever month a row landed in.
CREATE PUBLICATION strata_events FOR TABLE strata.events
    WITH (publish = 'insert', publish_via_partition_root = true);
