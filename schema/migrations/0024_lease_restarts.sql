-- A lease's holder cannot renew it while the server is down. So the time
-- the server was away does not count against a lease: one that ran out
-- while the server was down (or before a standby took over) is held until
-- a TTL after the server came back (or after the new timeline's first
-- append), giving its holder one whole TTL to renew it. Without this, every
-- lease ran out in any outage longer than its TTL, and whoever came back
-- first took everything over: a gateway's sweep ended the sessions of every
-- other gateway, and each gateway, unable to renew, ended its own.
--
-- The server is back at the latest of: its postmaster's start, its newest
-- checkpoint (crash recovery ends with one, after replaying the WAL: 7.5 s
-- of the 9.5 s a crash took in the region drill, time the postmaster had
-- already started), and the current timeline's first append. A regular
-- checkpoint moves it too: a lease whose holder died just before one is
-- taken over up to one TTL later than it would be otherwise.
--
-- A lease's TTL is `expires_at - renewed_at` (renewal sets both; a release
-- sets both to its moment, so a released lease gets no grace).
CREATE FUNCTION strata.lease_until(expires_at timestamptz, renewed_at timestamptz)
RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN renewed_at < back THEN greatest(expires_at, back + (expires_at - renewed_at))
        ELSE expires_at
    END
    FROM (SELECT greatest(
                pg_postmaster_start_time(),
                (SELECT checkpoint_time FROM pg_control_checkpoint()),
                (SELECT started_at FROM strata.log_epochs ORDER BY first_position DESC LIMIT 1)
            ) AS back) b
$$;
