//! The read-only role auditors' statements run as.
//!
//! It may log in and read the audit set: `strata.events` and each of its
//! monthly partitions (new ones are granted as they are created), the seal
//! tables, the export records and the views of schema `audit`. Nothing else of
//! Strata's (accounts, join tokens, subscriptions, leases) is readable; it is
//! no member of any role, cannot create anything, and its transactions are
//! read-only by default.

use std::time::Duration;
use tokio_postgres::GenericClient;

pub const DEFAULT_ROLE: &str = "strata_audit";

/// The tables of the audit set besides the partitions.
pub const AUDIT_TABLES: &[&str] = &[
    "strata.events",
    "strata.seals",
    "strata.seal_segments",
    "strata.seal_checkpoints",
    "strata.partition_exports",
];

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("audit role name {0:?}: use lower-case letters, digits and '_' (at most 63), starting with a letter")]
    BadRole(String),
    #[error("set up the audit role {role:?}: {source}; the database user needs CREATEROLE (or create the role and its grants as described in ARCHITECTURE.md)")]
    Db {
        role: String,
        source: tokio_postgres::Error,
    },
    #[error("the audit role {role:?} {problem}; it must hold no privileges beyond the audit set")]
    Unsafe { role: String, problem: String },
}

pub fn check_role(role: &str) -> Result<(), SetupError> {
    let ok = (1..=63).contains(&role.len())
        && role.as_bytes()[0].is_ascii_lowercase()
        && role
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(SetupError::BadRole(role.to_string()))
    }
}

/// Creates the role if it is missing, makes it read-only, grants the audit
/// set (every partition included), and checks that it holds nothing more.
pub async fn ensure_role(
    db: &impl GenericClient,
    role: &str,
    statement_timeout: Duration,
) -> Result<(), SetupError> {
    check_role(role)?;
    let err = |source| SetupError::Db {
        role: role.to_string(),
        source,
    };
    let timeout_ms = statement_timeout.as_millis().max(1);
    // The role name was checked above: plain lower-case identifier characters.
    let sql = format!(
        "DO $$ BEGIN
             CREATE ROLE {role} LOGIN NOINHERIT;
         EXCEPTION WHEN duplicate_object THEN NULL;
         END $$;
         ALTER ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT;
         ALTER ROLE {role} SET default_transaction_read_only = on;
         ALTER ROLE {role} SET statement_timeout = {timeout_ms};
         ALTER ROLE {role} SET idle_in_transaction_session_timeout = 600000;
         GRANT USAGE ON SCHEMA strata, audit TO {role};
         GRANT SELECT ON {tables} TO {role};
         GRANT SELECT ON ALL TABLES IN SCHEMA audit TO {role};",
        tables = AUDIT_TABLES.join(", ")
    );
    // Two endpoints starting at once on one cluster (roles are cluster-wide)
    // can collide on the role's catalog row; the loser tries again.
    let mut attempt = 0;
    loop {
        match db.batch_execute(&sql).await {
            Ok(()) => break,
            Err(e) if attempt < 5 && e.to_string().contains("concurrently") => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
            }
            Err(e) => return Err(err(e)),
        }
    }
    let parts = db
        .query(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'strata.events'::regclass",
            &[],
        )
        .await
        .map_err(err)?;
    for p in parts {
        let name: String = p.get(0);
        let q = format!("GRANT SELECT ON strata.{} TO {role}", quote_ident(&name));
        db.batch_execute(&q).await.map_err(err)?;
    }
    check_unprivileged(db, role).await
}

/// Refuses a role that is a superuser, a member of another role, or holds any
/// privilege on a Strata table outside the audit set.
pub async fn check_unprivileged(db: &impl GenericClient, role: &str) -> Result<(), SetupError> {
    let err = |source| SetupError::Db {
        role: role.to_string(),
        source,
    };
    let unsafe_ = |problem: String| SetupError::Unsafe {
        role: role.to_string(),
        problem,
    };
    let r = db
        .query_one(
            "SELECT rolsuper OR rolcreaterole OR rolcreatedb OR rolreplication OR rolbypassrls,
                    (SELECT string_agg(g.rolname, ', ') FROM pg_auth_members m
                       JOIN pg_roles g ON g.oid = m.roleid
                      WHERE m.member = r.oid)
               FROM pg_roles r WHERE r.rolname = $1",
            &[&role],
        )
        .await
        .map_err(err)?;
    if r.get::<_, bool>(0) {
        return Err(unsafe_(
            "has superuser, create or replication rights".into(),
        ));
    }
    if let Some(groups) = r.get::<_, Option<String>>(1) {
        return Err(unsafe_(format!("is a member of {groups}")));
    }
    let extra = db
        .query(
            "SELECT n.nspname || '.' || c.relname, p.privilege_type
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               CROSS JOIN LATERAL aclexplode(c.relacl) p
               JOIN pg_roles g ON g.oid = p.grantee
              WHERE g.rolname = $1
                AND n.nspname IN ('strata', 'audit', 'public')
                AND NOT (p.privilege_type = 'SELECT' AND (
                     n.nspname = 'audit'
                  OR (n.nspname || '.' || c.relname) = ANY($2)
                  OR c.oid IN (SELECT inhrelid FROM pg_inherits
                                WHERE inhparent = 'strata.events'::regclass)))",
            &[&role, &AUDIT_TABLES],
        )
        .await
        .map_err(err)?;
    if let Some(row) = extra.first() {
        let (rel, privilege): (String, String) = (row.get(0), row.get(1));
        return Err(unsafe_(format!("holds {privilege} on {rel}")));
    }
    Ok(())
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}
