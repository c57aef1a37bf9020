-- Events a sink gave up on after its attempts, kept in order until
-- `strata sinks parked replay` delivers them.
CREATE TABLE strata.sink_parked (
    sink       text        NOT NULL,
    position   bigint      NOT NULL,
    event      jsonb       NOT NULL,
    error      text        NOT NULL,
    attempts   integer     NOT NULL,
    parked_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sink, position)
);
