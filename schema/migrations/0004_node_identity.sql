-- Node identity: one-time join tokens (only their SHA-256 is stored) and the
-- certificates the region's node CA signed, with their revocation. Issuing
-- and revoking are also written to the log (node/<id> streams) for audit;
-- these tables are what gateways check on every session.
CREATE TABLE strata.join_tokens (
    hash        bytea       PRIMARY KEY CHECK (length(hash) = 32),
    pool        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    used_at     timestamptz,
    used_by     text
);

CREATE TABLE strata.node_certificates (
    serial      text        PRIMARY KEY,
    node        text        NOT NULL,
    pool        text        NOT NULL,
    issued_at   timestamptz NOT NULL DEFAULT now(),
    not_after   timestamptz NOT NULL,
    revoked_at  timestamptz
);
CREATE INDEX ON strata.node_certificates (node);

-- The inventory section hashes gateways last wrote to the log for each node,
-- so a reconnecting node sends only sections that changed. A cache: losing
-- a row only means the section is sent again.
CREATE TABLE strata.node_sections (
    node        text        NOT NULL,
    section     text        NOT NULL,
    hash        text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, section)
);
