//! Monthly partitions of `strata.events`: create ahead, list with sizes.
//!
//! Partitions are created ahead of the current month ([`DEFAULT_MONTHS_AHEAD`])
//! by `strata partitions ensure` and by every running service on a timer, so
//! no insert ever finds its month missing. As a last line of defence the
//! appender creates the missing month itself and retries once.

use crate::sql::Sql;
use crate::{Context, Error};
use std::time::SystemTime;
use tokio_postgres::Client;

/// How many months past the current one are kept created.
pub const DEFAULT_MONTHS_AHEAD: i32 = 3;

/// Creates the partitions from the month of `at` through `months_ahead` months
/// after it. Returns how many were created.
pub async fn ensure(client: &Client, months_ahead: i32, at: SystemTime) -> Result<i32, Error> {
    let row = client
        .one(
            "SELECT strata.ensure_partitions($1, $2)",
            &[&months_ahead, &at],
        )
        .await
        .context("ensure partitions")?;
    Ok(row.get(0))
}

/// Creates the partition that holds `at`, if missing. Returns whether it did.
pub async fn ensure_for(client: &Client, at: SystemTime) -> Result<bool, Error> {
    let row = client
        .one("SELECT strata.ensure_partition($1)", &[&at])
        .await
        .context("ensure a partition")?;
    Ok(row.get(0))
}

/// One partition of the event table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The table name, e.g. `events_2026_11`.
    pub name: String,
    /// The partition bound as Postgres prints it.
    pub bounds: String,
    /// Exact row count.
    pub rows: i64,
    /// Size on disk including indexes and TOAST, in bytes.
    pub bytes: i64,
}

/// Lists the event table's partitions in month order, with exact row counts
/// and their size on disk.
pub async fn list(client: &Client) -> Result<Vec<Partition>, Error> {
    let rows = client
        .rows(
            "SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid),
                    pg_total_relation_size(c.oid)
               FROM pg_inherits i
               JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'strata.events'::regclass
              ORDER BY c.relname",
            &[],
        )
        .await
        .context("list partitions")?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let name: String = row.get(0);
        // The name comes from pg_class and is quoted, so it cannot inject.
        let count = client
            .one(
                &format!("SELECT count(*) FROM strata.{}", quote_ident(&name)),
                &[],
            )
            .await
            .context("count partition rows")?;
        out.push(Partition {
            name,
            bounds: row.get(1),
            rows: count.get(0),
            bytes: row.get(2),
        });
    }
    Ok(out)
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
