//! Ordered SQL migrations, recorded in `strata.schema_migrations`.
//!
//! Each migration is a `.sql` file under `schema/migrations/`, compiled in with
//! `include_str!` and applied in its own transaction. A session-level advisory
//! lock serializes migrators, so two processes starting at once apply each
//! migration exactly once; the second waits (saying who holds the lock), then
//! finds nothing to do. Auditors cannot take that lock: the audit roles may
//! not execute the advisory-lock functions (`audit::setup`). A
//! migration's lock waits are bounded (`lock_timeout`), and one that found a
//! table locked by a reader is rolled back and tried again, so it never holds
//! up appends behind a reader.
//!
//! Rolling upgrades: migrations expand, then contract. An expanding
//! migration ([`Change::Expand`]: a table, a nullable column, an index)
//! leaves everything older binaries use in place, so a binary that knows an
//! earlier schema keeps running against it; such a binary finds migrations
//! it does not know, sees that none of them contracts, says so and runs. A
//! contracting migration ([`Change::Contract`]: a drop, a rename, a new
//! constraint older writers would break) names the oldest schema a binary
//! must know to run after it; it is recorded with the migration
//! (`schema_migrations.needs`), a binary that knows less refuses the
//! database, and it is applied only once no live Strata process
//! (`strata.processes`, refreshed by every `strata serve`) knows less.
//! [`plan`] says, without changing anything, what would be applied and
//! whether the running processes stay compatible (`strata migrate --check`).

use crate::ddl::{LockRetries, DDL_LOCK_TIMEOUT};
use crate::sql::Sql;
use crate::{Context, Error};
use tokio_postgres::Client;

/// One migration: its number, a short name, its SQL and what it does to
/// binaries that know less.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
    pub change: Change,
}

/// What a migration does to binaries built before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Adds only: binaries that know an earlier schema keep working.
    Expand,
    /// Removes or changes what older binaries use: after it, only binaries
    /// that know at least schema `needs` may run.
    Contract { needs: i32 },
}

impl Change {
    /// The oldest schema a binary must know once this is applied.
    pub fn needs(&self) -> Option<i32> {
        match self {
            Change::Expand => None,
            Change::Contract { needs } => Some(*needs),
        }
    }
}

/// The newest schema this build knows.
pub fn known() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.version)
}

/// How long a process's row in `strata.processes` counts as live after it
/// was last refreshed (they refresh every [`PROCESS_REFRESH`]).
pub const PROCESS_LIVE: std::time::Duration = std::time::Duration::from_secs(120);
/// How often a running process refreshes its row.
pub const PROCESS_REFRESH: std::time::Duration = std::time::Duration::from_secs(30);

/// Every migration, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "event_log",
        sql: include_str!("../migrations/0001_event_log.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 2,
        name: "subscriptions",
        sql: include_str!("../migrations/0002_subscriptions.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 3,
        name: "leases",
        sql: include_str!("../migrations/0003_leases.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 4,
        name: "node_identity",
        sql: include_str!("../migrations/0004_node_identity.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 5,
        name: "sinks",
        sql: include_str!("../migrations/0005_sinks.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 6,
        name: "seals",
        sql: include_str!("../migrations/0006_seals.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 7,
        name: "exports",
        sql: include_str!("../migrations/0007_exports.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 8,
        name: "audit",
        sql: include_str!("../migrations/0008_audit.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 9,
        name: "certificate_revocations",
        sql: include_str!("../migrations/0009_certificate_revocations.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 10,
        name: "join_token_node",
        sql: include_str!("../migrations/0010_join_token_node.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 11,
        name: "partition_lock_timeout",
        sql: include_str!("../migrations/0011_partition_lock_timeout.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 12,
        name: "audit_logins",
        sql: include_str!("../migrations/0012_audit_logins.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 13,
        name: "certificate_pem",
        sql: include_str!("../migrations/0013_certificate_pem.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 14,
        name: "processes",
        sql: include_str!("../migrations/0014_processes.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 15,
        name: "log_epochs",
        sql: include_str!("../migrations/0015_log_epochs.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 16,
        name: "event_names",
        sql: include_str!("../migrations/0016_event_names.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 17,
        name: "queue_index",
        sql: include_str!("../migrations/0017_queue_index.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 18,
        name: "node_sessions",
        sql: include_str!("../migrations/0018_node_sessions.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 19,
        name: "sink_credentials",
        sql: include_str!("../migrations/0019_sink_credentials.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 20,
        name: "device_owners",
        sql: include_str!("../migrations/0020_device_owners.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 21,
        name: "reader_standbys",
        sql: include_str!("../migrations/0021_reader_standbys.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 22,
        name: "usage",
        sql: include_str!("../migrations/0022_usage.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 23,
        name: "console",
        sql: include_str!("../migrations/0023_console.sql"),
        change: Change::Expand,
    },
    Migration {
        version: 24,
        name: "lease_restarts",
        sql: include_str!("../migrations/0024_lease_restarts.sql"),
        change: Change::Expand,
    },
];

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
    bootstrap(client).await?;
    let applied = applied(client).await?;
    let known = migrations.last().map_or(0, |m| m.version);
    runnable(&applied, known)?;
    if applied.iter().any(|a| a.version > known) {
        tracing::warn!(
            database = applied.last().map_or(0, |a| a.version),
            known,
            "the database's schema is newer than this binary's; the migrations it does not know only expand the schema, so it runs against it (upgrade it soon)"
        );
    }
    let sums: std::collections::HashMap<i32, &str> = applied
        .iter()
        .map(|a| (a.version, a.checksum.as_str()))
        .collect();
    for m in migrations {
        if let Some(sum) = sums.get(&m.version) {
            let current = checksum(m.sql);
            if *sum != current {
                return Err(Error::ChecksumMismatch {
                    version: m.version,
                    name: m.name.to_string(),
                    applied: sum.to_string(),
                    current,
                });
            }
        }
    }
    // The live processes matter only to a contraction.
    let processes = if migrations
        .iter()
        .any(|m| !sums.contains_key(&m.version) && m.change.needs().is_some())
    {
        processes(client).await?
    } else {
        Vec::new()
    };
    let mut done = Vec::new();
    for (m, waits_for) in pending(migrations, &applied, &processes) {
        if !waits_for.is_empty() {
            tracing::warn!(
                version = m.version,
                name = m.name,
                needs = ?m.change.needs(),
                behind = %waits_for.iter().map(Process::to_string).collect::<Vec<_>>().join("; "),
                "not applying a contracting migration (and those after it) while processes that know an older schema run; `strata migrate` applies it once they are upgraded"
            );
            break;
        }
        let current = checksum(m.sql);
        let mut retries = LockRetries::new(LockRetries::DEFAULT_TRIES);
        let what = format!("migration {} ({})", m.version, m.name);
        loop {
            match apply(client, m, &current).await {
                Err(e) if retries.again(e.is_lock_timeout(), &what).await => {}
                other => break other?,
            }
        }
        tracing::info!(version = m.version, name = m.name, "migration applied");
        done.push(m.version);
    }
    Ok(done)
}

/// The migrations table, and its `needs` column (added for rolling
/// upgrades; binaries before it leave it null, which is an expansion).
async fn bootstrap(client: &Client) -> Result<(), Error> {
    client
        .batch_execute(
            "CREATE SCHEMA IF NOT EXISTS strata;
             CREATE TABLE IF NOT EXISTS strata.schema_migrations (
                 version    integer     PRIMARY KEY,
                 name       text        NOT NULL,
                 checksum   text        NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             );
             ALTER TABLE strata.schema_migrations ADD COLUMN IF NOT EXISTS needs integer;",
        )
        .await
        .context("create the migrations table")
}

/// A migration the database has.
#[derive(Debug, Clone)]
pub struct Applied {
    pub version: i32,
    pub name: String,
    pub checksum: String,
    /// Set for a contracting migration: the oldest schema a binary must know.
    pub needs: Option<i32>,
}

async fn applied(client: &Client) -> Result<Vec<Applied>, Error> {
    let has_needs: bool = client
        .one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                             WHERE table_schema = 'strata' AND table_name = 'schema_migrations'
                               AND column_name = 'needs')",
            &[],
        )
        .await
        .context("read the migrations table's columns")?
        .get(0);
    let sql = if has_needs {
        "SELECT version, name, checksum, needs FROM strata.schema_migrations ORDER BY version"
    } else {
        "SELECT version, name, checksum, NULL::integer FROM strata.schema_migrations ORDER BY version"
    };
    let rows = client
        .rows(sql, &[])
        .await
        .context("read applied migrations")?;
    Ok(rows
        .iter()
        .map(|r| Applied {
            version: r.get(0),
            name: r.get(1),
            checksum: r.get(2),
            needs: r.get(3),
        })
        .collect())
}

/// Whether a binary that knows schema `known` may run against a database
/// with these migrations: every contracting one must need no more.
fn runnable(applied: &[Applied], known: i32) -> Result<(), Error> {
    match applied
        .iter()
        .filter(|a| a.needs.is_some_and(|n| n > known))
        .max_by_key(|a| a.needs)
    {
        Some(a) => Err(Error::TooNew {
            version: a.version,
            name: a.name.clone(),
            needs: a.needs.unwrap_or(a.version),
            known,
        }),
        None => Ok(()),
    }
}

/// A Strata process running against the database, from `strata.processes`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Process {
    pub host: String,
    pub pid: i32,
    pub binary_version: String,
    pub schema_known: i32,
    pub roles: String,
    pub seen_secs_ago: f64,
}

impl std::fmt::Display for Process {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} pid {} (strata {}, knows schema {}, roles {}, seen {:.0} s ago)",
            self.host,
            self.pid,
            self.binary_version,
            self.schema_known,
            self.roles,
            self.seen_secs_ago
        )
    }
}

/// Live processes (refreshed within [`PROCESS_LIVE`]); none if the table
/// is not there yet.
pub async fn processes(client: &Client) -> Result<Vec<Process>, Error> {
    let exists: bool = client
        .one("SELECT to_regclass('strata.processes') IS NOT NULL", &[])
        .await
        .context("look for the process table")?
        .get(0);
    if !exists {
        return Ok(Vec::new());
    }
    let live = PROCESS_LIVE.as_secs_f64();
    let rows = client
        .rows(
            "SELECT host, pid, binary_version, schema_known, roles,
                    extract(epoch FROM now() - seen_at)::float8
               FROM strata.processes
              WHERE seen_at > now() - make_interval(secs => $1)
              ORDER BY host, pid",
            &[&live],
        )
        .await
        .context("read the running processes")?;
    Ok(rows
        .iter()
        .map(|r| Process {
            host: r.get(0),
            pid: r.get(1),
            binary_version: r.get(2),
            schema_known: r.get(3),
            roles: r.get(4),
            seen_secs_ago: r.get(5),
        })
        .collect())
}

/// The migrations not applied yet, in order, each with the live processes
/// it waits for: a contraction waits for those that know less than it
/// needs, and every migration after a waiting one waits with it
/// ([`migrate`] stops there).
fn pending<'m>(
    migrations: &'m [Migration],
    applied: &[Applied],
    processes: &[Process],
) -> Vec<(&'m Migration, Vec<Process>)> {
    let have: std::collections::HashSet<i32> = applied.iter().map(|a| a.version).collect();
    let mut waiting: Vec<Process> = Vec::new();
    migrations
        .iter()
        .filter(|m| !have.contains(&m.version))
        .map(|m| {
            if let (Some(n), true) = (m.change.needs(), waiting.is_empty()) {
                waiting = processes
                    .iter()
                    .filter(|p| p.schema_known < n)
                    .cloned()
                    .collect();
            }
            (m, waiting.clone())
        })
        .collect()
}

/// Records this process in `strata.processes` (the row a contracting
/// migration looks at); call again every [`PROCESS_REFRESH`].
pub async fn register(
    client: &Client,
    host: &str,
    started_at: std::time::SystemTime,
    binary_version: &str,
    roles: &str,
) -> Result<(), Error> {
    let pid = std::process::id() as i32;
    client
        .exec(
            "INSERT INTO strata.processes (host, pid, started_at, binary_version, schema_known, roles)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (host, pid, started_at) DO UPDATE SET seen_at = now()",
            &[&host, &pid, &started_at, &binary_version, &known(), &roles],
        )
        .await
        .context("record this process")?;
    Ok(())
}

/// Removes this process's row (on a clean stop); rows of processes that
/// died age out.
pub async fn unregister(
    client: &Client,
    host: &str,
    started_at: std::time::SystemTime,
) -> Result<(), Error> {
    let pid = std::process::id() as i32;
    client
        .exec(
            "DELETE FROM strata.processes WHERE host = $1 AND pid = $2 AND started_at = $3",
            &[&host, &pid, &started_at],
        )
        .await
        .context("remove this process's record")?;
    Ok(())
}

/// What `migrate` would do now, changing nothing.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    /// The newest schema this build knows.
    pub known: i32,
    /// The newest migration the database has (0: none).
    pub database: i32,
    /// Whether this binary may run against the database as it is.
    pub runnable: bool,
    /// Why not, when it may not.
    pub refused: Option<String>,
    /// Migrations the database has that this build does not know.
    pub unknown: Vec<UnknownMigration>,
    /// Migrations this build would apply, in order.
    pub pending: Vec<Pending>,
    /// The live Strata processes and the schema each knows.
    pub processes: Vec<Process>,
}

/// A migration applied by a newer binary.
#[derive(Debug, Clone, serde::Serialize)]
pub struct UnknownMigration {
    pub version: i32,
    pub name: String,
    pub needs: Option<i32>,
}

/// A migration `migrate` would apply.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Pending {
    pub version: i32,
    pub name: String,
    /// `expand` or `contract`.
    pub change: &'static str,
    /// For a contraction: the oldest schema a binary must know after it.
    pub needs: Option<i32>,
    /// The statements it runs (their first lines).
    pub statements: Vec<String>,
    /// Live processes it waits for: those that know too little for it, or
    /// for a contraction before it.
    pub blocked_by: Vec<Process>,
}

/// What [`migrate`] would do against this database, and whether the
/// running processes stay compatible; reads only.
pub async fn plan(client: &Client, migrations: &[Migration]) -> Result<Plan, Error> {
    let exists: bool = client
        .one(
            "SELECT to_regclass('strata.schema_migrations') IS NOT NULL",
            &[],
        )
        .await
        .context("look for the migrations table")?
        .get(0);
    let applied = if exists {
        applied(client).await?
    } else {
        Vec::new()
    };
    let known = migrations.last().map_or(0, |m| m.version);
    let refused = runnable(&applied, known).err().map(|e| e.to_string());
    // A schema this build may not run against may have changed the process
    // table too: do not read it then.
    let processes = match refused {
        None => processes(client).await?,
        Some(_) => Vec::new(),
    };
    let pending = pending(migrations, &applied, &processes)
        .into_iter()
        .map(|(m, blocked_by)| Pending {
            version: m.version,
            name: m.name.to_string(),
            change: if m.change.needs().is_some() {
                "contract"
            } else {
                "expand"
            },
            needs: m.change.needs(),
            statements: statements(m.sql),
            blocked_by,
        })
        .collect();
    Ok(Plan {
        known,
        database: applied.last().map_or(0, |a| a.version),
        runnable: refused.is_none(),
        refused,
        unknown: applied
            .iter()
            .filter(|a| a.version > known)
            .map(|a| UnknownMigration {
                version: a.version,
                name: a.name.clone(),
                needs: a.needs,
            })
            .collect(),
        pending,
        processes,
    })
}

/// The first line of each top-level statement of a migration: the lines
/// that start a statement with a keyword at the left margin.
pub fn statements(sql: &str) -> Vec<String> {
    const STARTS: &[&str] = &[
        "CREATE ", "ALTER ", "DROP ", "INSERT ", "UPDATE ", "DELETE ", "GRANT ", "REVOKE ",
        "COMMENT ", "DO ", "SELECT ",
    ];
    sql.lines()
        .filter(|l| STARTS.iter().any(|k| l.starts_with(k)))
        .map(|l| {
            let l = l.trim_end().trim_end_matches(';');
            if l.len() > 120 {
                let mut cut = 117;
                while !l.is_char_boundary(cut) {
                    cut -= 1;
                }
                format!("{}...", &l[..cut])
            } else {
                l.to_string()
            }
        })
        .collect()
}

/// Applies one migration in its own transaction, its lock waits bounded.
async fn apply(client: &mut Client, m: &Migration, checksum: &str) -> Result<(), Error> {
    let tx = client
        .transaction()
        .await
        .context("begin a migration transaction")?;
    tx.batch_execute(&format!("SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'"))
        .await
        .context("bound a migration's lock waits")?;
    tx.batch_execute(m.sql).await.context("apply a migration")?;
    tx.exec(
        "INSERT INTO strata.schema_migrations (version, name, checksum, needs) VALUES ($1, $2, $3, $4)",
        &[&m.version, &m.name, &checksum, &m.change.needs()],
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
