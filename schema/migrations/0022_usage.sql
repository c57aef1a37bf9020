-- Usage: the GPU time every reservation held, folded from the log by the
-- `usage` role into hourly, daily and monthly rollups (UTC). A reservation
-- adds to the rollups when it ends; until then it is a row of usage_open,
-- and a report counts it up to the report's end. The rollups, usage_open
-- and the role's subscription cursor commit in one transaction, so they
-- always describe the log up to one position (and a promoted standby holds
-- them as consistently as the log itself).
--
-- Amounts are GPU-milliseconds: *held* from a reservation's placement to its
-- activation (or its end, if it never became active), *active* from its
-- activation to its end.
CREATE TABLE strata.usage_open (
    reservation  text        PRIMARY KEY,
    pool         text        NOT NULL,
    queue        text        NOT NULL DEFAULT '',
    owner        text        NOT NULL DEFAULT '',
    class        text        NOT NULL,
    requested_at timestamptz NOT NULL,
    placed_at    timestamptz,
    activated_at timestamptz,
    -- [{node, gpus}], one per node it was placed on.
    allocations  jsonb       NOT NULL DEFAULT '[]'
);

CREATE TABLE strata.usage_rollups (
    period        text        NOT NULL CHECK (period IN ('hour', 'day', 'month')),
    start         timestamptz NOT NULL,
    pool          text        NOT NULL,
    queue         text        NOT NULL,
    owner         text        NOT NULL,
    class         text        NOT NULL,
    active_gpu_ms bigint      NOT NULL DEFAULT 0,
    held_gpu_ms   bigint      NOT NULL DEFAULT 0,
    -- Reservations that ended in the bucket.
    ended         bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (period, start, pool, queue, owner, class)
);

-- By node, days and months only (hours by node would be a row per node
-- and hour: 7.2 million a month at 10,000 nodes).
CREATE TABLE strata.usage_node_rollups (
    period        text        NOT NULL CHECK (period IN ('day', 'month')),
    start         timestamptz NOT NULL,
    pool          text        NOT NULL,
    node          text        NOT NULL,
    class         text        NOT NULL,
    active_gpu_ms bigint      NOT NULL DEFAULT 0,
    held_gpu_ms   bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (period, start, pool, node, class)
);

-- What auditors and finance read with SQL (the audit role reads the audit
-- schema): GPU-hours by bucket, the reservations still open with their time
-- so far, and where the rollups stand in the log.
CREATE VIEW audit.usage AS
SELECT period, start, pool, queue, owner, class,
       active_gpu_ms / 3600000.0 AS gpu_hours,
       held_gpu_ms / 3600000.0   AS held_gpu_hours,
       ended AS reservations_ended
  FROM strata.usage_rollups;

CREATE VIEW audit.usage_by_node AS
SELECT period, start, pool, node, class,
       active_gpu_ms / 3600000.0 AS gpu_hours,
       held_gpu_ms / 3600000.0   AS held_gpu_hours
  FROM strata.usage_node_rollups;

CREATE VIEW audit.usage_open AS
SELECT reservation, pool, queue, owner, class, requested_at, placed_at, activated_at,
       (SELECT coalesce(sum((a->>'gpus')::int), 0) FROM jsonb_array_elements(allocations) a) AS gpus,
       allocations
  FROM strata.usage_open;
