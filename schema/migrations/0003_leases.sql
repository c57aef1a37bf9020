-- Leases: named, epoch-fenced, time-limited ownership (a pool's placer, a
-- sink's worker, a named subscription's reader). Expiry uses the database's
-- clock, so holders on different machines agree on it. Every acquisition
-- starts a new epoch; a holder's writes are fenced by checking its epoch in
-- the same transaction.
CREATE TABLE strata.leases (
    name        text        PRIMARY KEY CHECK (name <> ''),
    holder      text        NOT NULL,
    epoch       bigint      NOT NULL CHECK (epoch > 0),
    expires_at  timestamptz NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT now(),
    renewed_at  timestamptz NOT NULL DEFAULT now()
);
