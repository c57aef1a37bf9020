-- Each auditor's statements run as a PostgreSQL role of their own, a member
-- of the audit group role that holds the grants, so one auditor cannot see,
-- cancel or terminate another's session. The endpoint makes the role at the
-- auditor's first login with a random password, kept here: only Strata's own
-- database user reads this table (the audit roles are granted nothing on it).
CREATE TABLE strata.audit_logins (
    auditor    text        PRIMARY KEY REFERENCES strata.auditors (name),
    role       text        NOT NULL UNIQUE,
    password   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
