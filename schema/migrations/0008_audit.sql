-- The audit endpoint (`strata serve --roles audit`): auditor accounts, the
-- documented views auditors may read, and the open month's running chain
-- checkpoints.

-- Auditors who may connect to the audit endpoint. Only a SCRAM-SHA-256
-- verifier is kept (salt, iterations, StoredKey, ServerKey), never the
-- password or anything that can stand in for it. A certificate-authenticated
-- auditor must still be listed here and not revoked.
CREATE TABLE strata.auditors (
    name             text        PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9_.@-]{1,63}$'),
    scram_salt       bytea,
    scram_iterations integer     CHECK (scram_iterations IS NULL OR scram_iterations >= 4096),
    stored_key       bytea,
    server_key       bytea,
    created_at       timestamptz NOT NULL DEFAULT now(),
    revoked_at       timestamptz
);

-- Running checkpoints of the open month's hash chain: every row of the
-- partition up to last_position, chained as a seal chains them. A later seal
-- of the month must extend every checkpoint, so a row altered after a
-- checkpoint was taken is found even before the month closes.
CREATE TABLE strata.seal_checkpoints (
    partition     text        NOT NULL,
    last_position bigint      NOT NULL,
    rows          bigint      NOT NULL,
    chain         bytea       NOT NULL,
    taken_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (partition, last_position)
);

-- What auditors read besides the event partitions and the seal tables.
CREATE SCHEMA audit;

COMMENT ON SCHEMA audit IS 'Views for auditors: partitions, seals, and the auditors'' own queries';

-- Every event partition with its month, its row count as sealed, and whether
-- it was sealed and exported.
CREATE VIEW audit.partitions AS
SELECT c.relname::text                                    AS partition,
       pg_get_expr(c.relpartbound, c.oid)                 AS bounds,
       s.rows                                             AS sealed_rows,
       s.first_position,
       s.last_position,
       encode(s.chain, 'hex')                             AS chain,
       s.sealed_at,
       (SELECT max(e.exported_at) FROM strata.partition_exports e
         WHERE e.partition = c.relname)                    AS exported_at
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
  LEFT JOIN strata.seals s ON s.partition = c.relname
 WHERE i.inhparent = 'strata.events'::regclass;

-- Every query run through the audit endpoint (it records each one before
-- running it), newest first.
CREATE VIEW audit.queries AS
SELECT position,
       recorded_at,
       payload->>'auditor'   AS auditor,
       payload->>'auth'      AS auth,
       payload->>'client'    AS client,
       payload->>'protocol'  AS protocol,
       payload->>'sql'       AS sql,
       payload->'parameters' AS parameters
  FROM strata.events
 WHERE type = 'audit.query'
 ORDER BY position DESC;

-- The chain checkpoints of open months, readable.
CREATE VIEW audit.checkpoints AS
SELECT partition, last_position, rows, encode(chain, 'hex') AS chain, taken_at
  FROM strata.seal_checkpoints;

-- A new month's partition is readable by every role that may read the event
-- table (the audit role among them).
CREATE OR REPLACE FUNCTION strata.ensure_partition(at timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    lo   timestamptz := date_trunc('month', at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    hi   timestamptz := (date_trunc('month', at AT TIME ZONE 'UTC') + interval '1 month') AT TIME ZONE 'UTC';
    name text := strata.partition_name(at);
    reader text;
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
    FOR reader IN
        SELECT DISTINCT r.rolname
          FROM pg_class t
          CROSS JOIN LATERAL aclexplode(t.relacl) a
          JOIN pg_roles r ON r.oid = a.grantee
         WHERE t.oid = 'strata.events'::regclass
           AND a.privilege_type = 'SELECT'
           AND a.grantee <> t.relowner
    LOOP
        EXECUTE format('GRANT SELECT ON strata.%I TO %I', name, reader);
    END LOOP;
    RETURN true;
END
$$;
