//! The rollups checked against the raw log: every reservation event up to
//! the position the usage tables stand at folded again from nothing, and
//! every bucket of every rollup, and every open reservation, compared.
//! `strata replay check` runs it; any difference is a bug (or a table
//! changed by hand).

use super::fold::{Delta, Fold, Open};
use super::store;
use events::db::Sql;

/// Events read per statement.
const PAGE: i64 = 20_000;

/// What the check compared.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    /// The position the tables stand at (`None`: the usage role never ran).
    pub position: Option<u64>,
    /// Reservation events folded.
    pub events: u64,
    pub account_buckets: usize,
    pub node_buckets: usize,
    pub open: usize,
    /// What differs, at most [`MAX_SHOWN`] lines.
    pub differences: Vec<String>,
}

/// Most differences listed.
pub const MAX_SHOWN: usize = 20;

/// Folds the log up to the tables' position and compares.
pub async fn verify(
    client: &mut tokio_postgres::Client,
    mut progress: impl FnMut(u64),
) -> Result<Check, tokio_postgres::Error> {
    let tx = store::snapshot(client).await?;
    let position = store::position(&tx).await?.map(|p| p as i64);
    let tables = store::read_all(&tx).await?;
    tx.commit().await?;
    let Some(position) = position else {
        return Ok(Check {
            differences: if tables.accounts.is_empty() && tables.open.is_empty() {
                Vec::new()
            } else {
                vec!["the usage tables hold rows but no usage subscription exists".into()]
            },
            ..Check::default()
        });
    };
    let types = super::fold::event_types();
    let mut fold = Fold::default();
    let mut delta = Delta::default();
    let mut after = 0i64;
    let mut events = 0u64;
    let sql = format!(
        "SELECT position, type, payload::text, metadata::text, {}
           FROM strata.events
          WHERE position > $1 AND position <= $2 AND type = ANY($3)
          ORDER BY position LIMIT $4",
        store::ms_of("recorded_at")
    );
    loop {
        let rows = client
            .rows(&sql, &[&after, &position, &types, &PAGE])
            .await?;
        for r in &rows {
            let (t, p, m): (String, String, String) = (r.get(1), r.get(2), r.get(3));
            fold.apply(&t, &p, &m, r.get(4), &mut delta);
        }
        events += rows.len() as u64;
        match rows.last() {
            Some(r) if rows.len() as i64 == PAGE => {
                after = r.get(0);
                progress(after as u64);
            }
            _ => break,
        }
    }
    let mut differences = Vec::new();
    let mut differ = |line: String| {
        if differences.len() < MAX_SHOWN {
            differences.push(line);
        }
    };
    compare(
        &delta.accounts,
        &tables.accounts,
        "usage_rollups",
        &mut differ,
    );
    compare(
        &delta.nodes,
        &tables.nodes,
        "usage_node_rollups",
        &mut differ,
    );
    let mut open: Vec<&Open> = fold.open.values().collect();
    open.sort_by(|a, b| a.reservation.cmp(&b.reservation));
    let mut stored: Vec<&Open> = tables.open.iter().collect();
    stored.sort_by(|a, b| a.reservation.cmp(&b.reservation));
    if open != stored {
        let ids = |v: &[&Open]| v.iter().map(|o| o.reservation.clone()).collect::<Vec<_>>();
        for o in &open {
            if !stored.contains(o) {
                differ(format!(
                    "open reservation {} differs or is missing: the log says {o:?}",
                    o.reservation
                ));
            }
        }
        for s in &stored {
            if !ids(&open).contains(&s.reservation) {
                differ(format!(
                    "reservation {} is open in the table but not in the log",
                    s.reservation
                ));
            }
        }
    }
    Ok(Check {
        position: Some(position as u64),
        events,
        account_buckets: tables.accounts.len(),
        node_buckets: tables.nodes.len(),
        open: tables.open.len(),
        differences,
    })
}

fn compare<K: std::fmt::Debug + Eq + std::hash::Hash + Ord>(
    log: &std::collections::HashMap<K, super::fold::Amounts>,
    table: &std::collections::HashMap<K, super::fold::Amounts>,
    name: &str,
    differ: &mut impl FnMut(String),
) {
    let mut keys: Vec<&K> = log.keys().chain(table.keys()).collect();
    keys.sort();
    keys.dedup();
    for k in keys {
        let (a, b) = (log.get(k), table.get(k));
        if a != b {
            differ(format!(
                "{name} {k:?}: the log gives {a:?}, the table holds {b:?}"
            ));
        }
    }
}
