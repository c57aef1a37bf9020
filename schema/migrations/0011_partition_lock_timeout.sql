-- Creating a partition locks the event table. Behind a long-running reader
-- (an auditor's open transaction) that lock would wait, and every append
-- would queue behind it. The creation gives up after two seconds instead
-- (lock_not_available): maintenance keeps months ahead and tries again.
CREATE OR REPLACE FUNCTION strata.ensure_partition(at timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    lo   timestamptz := date_trunc('month', at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    hi   timestamptz := (date_trunc('month', at AT TIME ZONE 'UTC') + interval '1 month') AT TIME ZONE 'UTC';
    name text := strata.partition_name(at);
    reader text;
    waited text := current_setting('lock_timeout');
BEGIN
    IF to_regclass(format('strata.%I', name)) IS NOT NULL THEN
        RETURN false;
    END IF;
    -- Serialize creators; a session that still lost the race (its catalog
    -- view predates the winner's commit) finds the table already there.
    PERFORM pg_advisory_xact_lock(hashtext('strata.ensure_partition'));
    PERFORM set_config('lock_timeout', '2s', true);
    BEGIN
        EXECUTE format(
            'CREATE TABLE strata.%I PARTITION OF strata.events FOR VALUES FROM (%L) TO (%L)',
            name, lo, hi);
    EXCEPTION WHEN duplicate_table THEN
        PERFORM set_config('lock_timeout', waited, true);
        RETURN false;
    END;
    PERFORM set_config('lock_timeout', waited, true);
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
