-- Credentials of a sink's URL (`user:password@` of a webhook or NATS URL),
-- kept apart from its `sink.created` event, which every auditor can read:
-- the event says only that the URL has credentials here. Only Strata's own
-- database user reads this table; the audit role is never granted it.
CREATE TABLE strata.sink_credentials (
    sink       text        PRIMARY KEY,
    userinfo   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
