//! The read-only role auditors' statements run as.
//!
//! A group role (NOLOGIN) holds the grants: it reads the audit set,
//! `strata.events` and each of its monthly partitions (new ones are granted
//! as they are created), the seal tables, the export records and the views of
//! schema `audit`. Nothing else of Strata's (accounts, join tokens,
//! subscriptions, leases, the auditors' logins) is readable; it is no member
//! of any role and cannot create anything. No role but Strata's own may
//! create temporary tables or execute the large-object or advisory-lock
//! functions. Each auditor logs in as a role of their own, a member of the
//! group only, with a random password ([`login_role`]): auditors cannot see,
//! cancel or terminate each other's sessions, and no one logs in as an audit
//! role without a password.

use events::db::Sql;
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
    #[error("audit role name {0:?}: use lower-case letters, digits and '_' (at most 46: each auditor's role adds 17), starting with a letter")]
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
    let ok = (1..=46).contains(&role.len())
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

/// Creates the group role if it is missing, grants it the audit set (every
/// partition included), takes from every role without Strata's own (PUBLIC)
/// the right to create temporary tables and to execute the large-object and
/// advisory-lock functions, and checks that the group holds nothing more.
/// Revoking from PUBLIC needs the functions' owner (a superuser); where the
/// database user is not one, the check says what to run once.
pub async fn ensure_role(db: &(impl GenericClient + Sync), role: &str) -> Result<(), SetupError> {
    check_role(role)?;
    let err = |source| SetupError::Db {
        role: role.to_string(),
        source,
    };
    // The role name was checked above: plain lower-case identifier characters.
    let sql = format!(
        "DO $$ BEGIN
             CREATE ROLE {role} NOLOGIN NOINHERIT;
         EXCEPTION WHEN duplicate_object THEN NULL;
         END $$;
         ALTER ROLE {role} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT;
         GRANT USAGE ON SCHEMA strata, audit TO {role};
         GRANT SELECT ON {tables} TO {role};
         GRANT SELECT ON ALL TABLES IN SCHEMA audit TO {role};",
        tables = AUDIT_TABLES.join(", ")
    );
    // Two endpoints starting at once on one cluster (roles are cluster-wide)
    // can collide on the role's catalog row; the loser tries again.
    retry_concurrent(db, &sql).await.map_err(err)?;
    retry_concurrent(db, REVOKE_FROM_PUBLIC)
        .await
        .map_err(err)?;
    let parts = db
        .rows(
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

async fn retry_concurrent(
    db: &(impl GenericClient + Sync),
    sql: &str,
) -> Result<(), tokio_postgres::Error> {
    let mut attempt = 0;
    loop {
        match db.batch_execute(sql).await {
            Ok(()) => return Ok(()),
            Err(e) if attempt < 5 && e.to_string().contains("concurrently") => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The functions no audit role may execute: large objects (they persist
/// whatever the transaction's read-only mode) and advisory locks (one held
/// would stop migrations). Strata's own user keeps them.
const REVOKE_FROM_PUBLIC: &str = "DO $$
DECLARE f regprocedure;
BEGIN
    EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
    EXECUTE format('GRANT TEMPORARY ON DATABASE %I TO %I', current_database(), current_user);
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = 'pg_catalog'::regnamespace
                AND p.proname ~ '^(lo_|loread$|lowrite$|pg_advisory_|pg_try_advisory_)'
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, current_user);
    END LOOP;
END $$";

/// The PostgreSQL role and password `auditor`'s statements run as: made at
/// the first login (a LOGIN role with a random password, member of `group`
/// only), then the same every time. Roles belong to the cluster and the
/// record to the database, so a role left by an earlier database of the
/// same name is taken over with a new password.
pub async fn login_role(
    db: &mut tokio_postgres::Client,
    group: &str,
    auditor: &str,
    temp_file_limit_kib: u64,
) -> Result<(String, String), SetupError> {
    let (role, password) = find_or_make_login_role(db, group, auditor).await?;
    limit_temp_files(db, &role, temp_file_limit_kib).await;
    Ok((role, password))
}

/// Sets `temp_file_limit` on an auditor's role: a superuser's setting, so
/// the auditor cannot raise it. Strata's database user needs to be a
/// superuser or to have been granted `SET ON PARAMETER temp_file_limit`;
/// without that the limit is not set, and said so.
async fn limit_temp_files(db: &tokio_postgres::Client, role: &str, kib: u64) {
    let sql = format!("ALTER ROLE {role} SET temp_file_limit = '{kib}kB'");
    if let Err(e) = db.batch_execute(&sql).await {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(error = %e, "audit: could not limit auditors' temporary files (a superuser may run: GRANT SET ON PARAMETER temp_file_limit TO <strata's user>)");
        });
    }
}

async fn find_or_make_login_role(
    db: &mut tokio_postgres::Client,
    group: &str,
    auditor: &str,
) -> Result<(String, String), SetupError> {
    check_role(group)?;
    let err = |source| SetupError::Db {
        role: group.to_string(),
        source,
    };
    let tx = db.transaction().await.map_err(err)?;
    tx.exec(
        "SELECT pg_advisory_xact_lock(hashtextextended('strata.audit_logins:' || $1, 0))",
        &[&auditor],
    )
    .await
    .map_err(err)?;
    if let Some(r) = tx
        .opt(
            "SELECT role, password FROM strata.audit_logins WHERE auditor = $1",
            &[&auditor],
        )
        .await
        .map_err(err)?
    {
        return Ok((r.get(0), r.get(1)));
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, auditor.as_bytes());
    let role = format!("{group}_{}", &events::hex(digest.as_ref())[..16]);
    let mut secret = [0u8; 24];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
        .expect("system randomness");
    let password = events::hex(&secret);
    // Postgres stores only this verifier; the statement carries no password.
    let verifier = postgres_protocol::password::scram_sha_256(password.as_bytes());
    let sql = format!(
        "DO $$ BEGIN
             CREATE ROLE {role} LOGIN INHERIT;
         EXCEPTION WHEN duplicate_object THEN NULL;
         END $$;
         ALTER ROLE {role} LOGIN INHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS PASSWORD '{verifier}';
         ALTER ROLE {role} SET default_transaction_read_only = on;
         GRANT {group} TO {role};"
    );
    tx.batch_execute(&sql).await.map_err(err)?;
    tx.exec(
        "INSERT INTO strata.audit_logins (auditor, role, password) VALUES ($1, $2, $3)",
        &[&auditor, &role, &password],
    )
    .await
    .map_err(err)?;
    tx.commit().await.map_err(err)?;
    Ok((role, password))
}

/// Refuses a role that is a superuser, a member of another role, or holds any
/// privilege on a Strata table outside the audit set.
pub async fn check_unprivileged(
    db: &(impl GenericClient + Sync),
    role: &str,
) -> Result<(), SetupError> {
    let err = |source| SetupError::Db {
        role: role.to_string(),
        source,
    };
    let unsafe_ = |problem: String| SetupError::Unsafe {
        role: role.to_string(),
        problem,
    };
    let r = db
        .one(
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
    let rights = db
        .one(
            "SELECT has_database_privilege($1, current_database(), 'TEMPORARY'),
                    has_function_privilege($1, 'pg_catalog.lo_from_bytea(oid, bytea)', 'EXECUTE'),
                    has_function_privilege($1, 'pg_catalog.lo_create(oid)', 'EXECUTE'),
                    has_function_privilege($1, 'pg_catalog.pg_advisory_lock(bigint)', 'EXECUTE')",
            &[&role],
        )
        .await
        .map_err(err)?;
    if (0..4).any(|i| rights.get::<_, bool>(i)) {
        return Err(unsafe_(format!(
            "may create temporary tables or execute the large-object or advisory-lock functions \
             (granted to PUBLIC); a superuser must run once in this database: {REVOKE_FROM_PUBLIC}"
        )));
    }
    if let Some(groups) = r.get::<_, Option<String>>(1) {
        return Err(unsafe_(format!("is a member of {groups}")));
    }
    let extra = db
        .rows(
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
