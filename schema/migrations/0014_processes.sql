-- The Strata processes running against this database, each with the schema
-- version its binary knows: a rolling upgrade's contracting migration waits
-- until no live process knows less than it needs (`strata migrate --check`
-- lists them). Rows are refreshed by their process and age out.
CREATE TABLE strata.processes (
    host           text        NOT NULL,
    pid            integer     NOT NULL,
    started_at     timestamptz NOT NULL,
    binary_version text        NOT NULL,
    schema_known   integer     NOT NULL,
    roles          text        NOT NULL,
    seen_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (host, pid, started_at)
);
