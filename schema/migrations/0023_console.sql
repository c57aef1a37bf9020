-- The web console's sign-in: one-time links (`strata console login`) and the
-- browser sessions they open. Only hashes of the secrets are kept (SHA-256
-- of the link's token and of the session's cookie), so a reader of these
-- tables cannot sign in. Only Strata's own database user reads them; the
-- audit role is never granted them.
CREATE TABLE strata.console_links (
    token_hash bytea       PRIMARY KEY,
    operator   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);

-- A session ends at `expires_at`, when it is signed out (`ended_at`), or
-- when its operator's role or certificate is revoked (checked at every
-- request against `role/<operator>` and `strata.revoked_certificates`).
CREATE TABLE strata.console_sessions (
    id_hash    bytea       PRIMARY KEY,
    operator   text        NOT NULL,
    -- The serial of the client certificate it was opened with, if any.
    serial     text,
    -- The token every form of the session carries (CSRF).
    csrf       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    ended_at   timestamptz
);
CREATE INDEX console_sessions_operator ON strata.console_sessions (operator);
