//! Ordered SQL migrations, recorded in `strata.schema_migrations`.
//!
//! Each migration is a `.sql` file under `schema/migrations/`, compiled in with
//! `include_str!` and applied in its own transaction. A session-level advisory
//! lock serializes migrators, so two processes starting at once apply each
//! migration exactly once; the second waits (saying who holds the lock), then
//! finds nothing to do. Auditors cannot take that lock: the audit roles may
//! not execute the advisory-lock functions (`replay::audit::setup`). A
//! migration's lock waits are bounded (`lock_timeout`), and one that found a
//! table locked by a reader is rolled back and tried again, so it never holds
//! up appends behind a reader.

use crate::sql::Sql;
use crate::{Context, Error};
use tokio_postgres::Client;

/// One migration: its number, a short name and its SQL.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every migration, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "event_log",
        sql: include_str!("../migrations/0001_event_log.sql"),
    },
    Migration {
        version: 2,
        name: "subscriptions",
        sql: include_str!("../migrations/0002_subscriptions.sql"),
    },
    Migration {
        version: 3,
        name: "leases",
        sql: include_str!("../migrations/0003_leases.sql"),
    },
    Migration {
        version: 4,
        name: "node_identity",
        sql: include_str!("../migrations/0004_node_identity.sql"),
    },
    Migration {
        version: 5,
        name: "sinks",
        sql: include_str!("../migrations/0005_sinks.sql"),
    },
    Migration {
        version: 6,
        name: "seals",
        sql: include_str!("../migrations/0006_seals.sql"),
    },
    Migration {
        version: 7,
        name: "exports",
        sql: include_str!("../migrations/0007_exports.sql"),
    },
    Migration {
        version: 8,
        name: "audit",
        sql: include_str!("../migrations/0008_audit.sql"),
    },
    Migration {
        version: 9,
        name: "certificate_revocations",
        sql: include_str!("../migrations/0009_certificate_revocations.sql"),
    },
    Migration {
        version: 10,
        name: "join_token_node",
        sql: include_str!("../migrations/0010_join_token_node.sql"),
    },
    Migration {
        version: 11,
        name: "partition_lock_timeout",
        sql: include_str!("../migrations/0011_partition_lock_timeout.sql"),
    },
    Migration {
        version: 12,
        name: "audit_logins",
        sql: include_str!("../migrations/0012_audit_logins.sql"),
    },
    Migration {
        version: 13,
        name: "certificate_pem",
        sql: include_str!("../migrations/0013_certificate_pem.sql"),
    },
];

/// How long one migration's statements wait for a lock before the migration
/// is rolled back and tried again: a migration queued behind a reader's lock
/// on the event table would hold up every append queued behind it.
const MIGRATION_LOCK_TIMEOUT: &str = "2s";
/// Tries of one migration that found its tables locked.
const MIGRATION_TRIES: u32 = 30;

/// The advisory lock key that serializes migrators (an arbitrary constant).
const MIGRATE_LOCK: i64 = 0x5374_7261_7461_4d31;

/// A stable checksum of a migration's text (FNV-1a, 64 bits), so an edited
/// migration is caught instead of silently diverging between databases.
pub fn checksum(sql: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in sql.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Applies every migration the database does not have yet. Returns the
/// versions it applied (empty when the database was up to date).
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>, Error> {
    migrate_with(client, MIGRATIONS).await
}

/// [`migrate`] with these migrations (tests give one more of their own).
pub async fn migrate_with(
    client: &mut Client,
    migrations: &[Migration],
) -> Result<Vec<i32>, Error> {
    // Wait for the lock in the open, saying who holds it, rather than
    // blocking without a word.
    let mut waited = std::time::Duration::ZERO;
    loop {
        let got: bool = client
            .one("SELECT pg_try_advisory_lock($1)", &[&MIGRATE_LOCK])
            .await
            .context("take the migration lock")?
            .get(0);
        if got {
            break;
        }
        if waited.as_millis().is_multiple_of(10_000) {
            let holder = client
                .opt(
                    "SELECT a.pid, a.usename::text, a.application_name
                       FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                      WHERE l.locktype = 'advisory' AND l.granted
                        AND (l.classid::bigint << 32 | l.objid::bigint) = $1",
                    &[&MIGRATE_LOCK],
                )
                .await
                .ok()
                .flatten()
                .map(|r| {
                    format!(
                        "pid {} ({}, {})",
                        r.get::<_, i32>(0),
                        r.get::<_, Option<String>>(1).unwrap_or_default(),
                        r.get::<_, String>(2)
                    )
                })
                .unwrap_or_else(|| "another migrator".into());
            tracing::warn!(%holder, waited_s = waited.as_secs(), "waiting for the migration lock");
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        waited += std::time::Duration::from_millis(500);
    }
    let result = migrate_locked(client, migrations).await;
    // The lock is session-level; release it whatever happened. If the
    // connection is gone, so is the lock.
    let _ = client
        .exec("SELECT pg_advisory_unlock($1)", &[&MIGRATE_LOCK])
        .await;
    result
}

async fn migrate_locked(client: &mut Client, migrations: &[Migration]) -> Result<Vec<i32>, Error> {
    client
        .batch_execute(
            "CREATE SCHEMA IF NOT EXISTS strata;
             CREATE TABLE IF NOT EXISTS strata.schema_migrations (
                 version    integer     PRIMARY KEY,
                 name       text        NOT NULL,
                 checksum   text        NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             );",
        )
        .await
        .context("create the migrations table")?;
    let rows = client
        .rows(
            "SELECT version, name, checksum FROM strata.schema_migrations ORDER BY version",
            &[],
        )
        .await
        .context("read applied migrations")?;
    let known = migrations.last().map_or(0, |m| m.version);
    let mut applied = std::collections::HashMap::new();
    for row in &rows {
        let version: i32 = row.get(0);
        let sum: String = row.get(2);
        if version > known {
            return Err(Error::TooNew {
                database: version,
                known,
            });
        }
        applied.insert(version, sum);
    }
    let mut done = Vec::new();
    for m in migrations {
        let current = checksum(m.sql);
        if let Some(sum) = applied.get(&m.version) {
            if *sum != current {
                return Err(Error::ChecksumMismatch {
                    version: m.version,
                    name: m.name.to_string(),
                    applied: sum.clone(),
                    current,
                });
            }
            continue;
        }
        let mut tries = 0;
        loop {
            tries += 1;
            match apply(client, m, &current).await {
                Err(e) if tries < MIGRATION_TRIES && e.is_lock_timeout() => {
                    tracing::warn!(
                        version = m.version,
                        name = m.name,
                        tries,
                        "a migration waited {MIGRATION_LOCK_TIMEOUT} for a lock (a reader's open transaction?); trying again"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(
                        200 * u64::from(tries.min(10)),
                    ))
                    .await;
                }
                other => break other?,
            }
        }
        tracing::info!(version = m.version, name = m.name, "migration applied");
        done.push(m.version);
    }
    Ok(done)
}

/// Applies one migration in its own transaction, its lock waits bounded.
async fn apply(client: &mut Client, m: &Migration, checksum: &str) -> Result<(), Error> {
    let tx = client
        .transaction()
        .await
        .context("begin a migration transaction")?;
    tx.batch_execute(&format!(
        "SET LOCAL lock_timeout = '{MIGRATION_LOCK_TIMEOUT}'"
    ))
    .await
    .context("bound a migration's lock waits")?;
    tx.batch_execute(m.sql).await.context("apply a migration")?;
    tx.exec(
        "INSERT INTO strata.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
        &[&m.version, &m.name, &checksum],
    )
    .await
    .context("record a migration")?;
    tx.commit().await.context("commit a migration")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_ordered_and_unique() {
        for w in MIGRATIONS.windows(2) {
            assert!(
                w[0].version < w[1].version,
                "{} then {}",
                w[0].version,
                w[1].version
            );
        }
        assert_eq!(MIGRATIONS[0].version, 1);
    }

    #[test]
    fn checksum_changes_with_text() {
        assert_ne!(checksum("select 1"), checksum("select 2"));
        assert_eq!(checksum("x"), checksum("x"));
    }
}
