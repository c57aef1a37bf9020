-- Every event type is `noun.verb_past`: the audit endpoint now records a
-- statement as `audit.query_recorded` (it wrote `audit.query` before). The
-- view reads both names, so an endpoint of either release shows in it.
-- CREATE OR REPLACE keeps the view's grants.
CREATE OR REPLACE VIEW audit.queries AS
SELECT position,
       recorded_at,
       payload->>'auditor'   AS auditor,
       payload->>'auth'      AS auth,
       payload->>'client'    AS client,
       payload->>'protocol'  AS protocol,
       payload->>'sql'       AS sql,
       payload->'parameters' AS parameters
  FROM strata.events
 WHERE type IN ('audit.query_recorded', 'audit.query')
 ORDER BY position DESC;
