//! The rollups checked against the raw log: every reservation event up to
//! the position the usage tables stand at folded again from nothing, and
//! every bucket of every rollup, and every open reservation, compared.
//! `strata replay check` runs it; any difference is a bug (or a table
//! changed by hand).

use super::fold::{Delta, Fold, Open};
use super::store;

/// Why the check could not run.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("read the usage tables: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error("read the log: {0}")]
    Read(#[from] events::replication::ReplicationError),
    #[error("read the log: {0}")]
    Decode(String),
}

/// What the check compared.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
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
    /// Seconds spent reading and folding the log, reading the tables, and
    /// comparing.
    pub fold_s: f64,
    pub tables_s: f64,
    pub compare_s: f64,
}

/// Most differences listed.
pub const MAX_SHOWN: usize = 20;

/// Folds the log up to the tables' position and compares. The log's rows
/// come by COPY over a connection of their own to `db`, folded as they
/// arrive.
pub async fn verify(
    db: &events::db::Database,
    client: &mut tokio_postgres::Client,
    progress: impl FnMut(u64),
) -> Result<Check, VerifyError> {
    let t = std::time::Instant::now();
    let tx = store::snapshot(client).await?;
    let position = store::position(&tx).await?.map(|p| p as i64);
    let tables = store::read_all(&tx).await?;
    tx.commit().await?;
    let tables_s = t.elapsed().as_secs_f64();
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
    let t = std::time::Instant::now();
    let mut fold = Fold::default();
    let mut delta = Delta::default();
    let events = fold_log(db, position, &mut fold, &mut delta, progress).await?;
    let fold_s = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
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
        fold_s,
        tables_s,
        compare_s: t.elapsed().as_secs_f64(),
    })
}

/// Folds every reservation event up to `position` into `fold` and
/// `delta`; returns how many there were.
async fn fold_log(
    db: &events::db::Database,
    position: i64,
    fold: &mut Fold,
    delta: &mut Delta,
    mut progress: impl FnMut(u64),
) -> Result<u64, VerifyError> {
    let types = super::fold::event_types()
        .iter()
        .map(|t| format!("'{}'", t.replace('\'', "''")))
        .collect::<Vec<_>>()
        .join(", ");
    let sql = format!(
        "COPY (SELECT position, type, payload, metadata, {ms}
                 FROM strata.events
                WHERE position <= {position} AND type IN ({types})
                ORDER BY position) TO STDOUT",
        ms = store::ms_of("recorded_at")
    );
    // One statement reads the whole log: no statement timeout.
    let db = db.clone().with_statement_timeout(None);
    let mut conn =
        events::replication::ReplicationConnection::connect_session(db, "strata-usage-check", None)
            .await?;
    conn.copy_out_start(&sql).await?;
    let mut events = 0u64;
    while conn
        .copy_data(|chunk| {
            for line in chunk.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                let row = copy_row(line).ok_or_else(|| {
                    VerifyError::Decode(format!(
                        "a malformed COPY row: {:?}",
                        String::from_utf8_lossy(&line[..line.len().min(200)])
                    ))
                })?;
                fold.apply(
                    &row[1],
                    &row[2],
                    &row[3],
                    row[4].parse().unwrap_or(0),
                    delta,
                );
                events += 1;
                if events.is_multiple_of(100_000) {
                    progress(row[0].parse().unwrap_or(0));
                }
            }
            Ok::<(), VerifyError>(())
        })
        .await?
    {}
    Ok(events)
}

/// One row of COPY's text format: its five fields, unescaped.
fn copy_row(line: &[u8]) -> Option<[std::borrow::Cow<'_, str>; 5]> {
    let mut fields = line.split(|b| *b == b'\t').map(unescape);
    let row = [
        fields.next()??,
        fields.next()??,
        fields.next()??,
        fields.next()??,
        fields.next()??,
    ];
    fields.next().is_none().then_some(row)
}

/// A field of COPY's text format, its backslash escapes undone.
fn unescape(field: &[u8]) -> Option<std::borrow::Cow<'_, str>> {
    if !field.contains(&b'\\') {
        return std::str::from_utf8(field)
            .ok()
            .map(std::borrow::Cow::Borrowed);
    }
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let b = field[i];
        if b != b'\\' {
            out.push(b);
            i += 1;
            continue;
        }
        let next = *field.get(i + 1)?;
        out.push(match next {
            b'n' => b'\n',
            b't' => b'\t',
            b'r' => b'\r',
            b'b' => 8,
            b'f' => 12,
            b'v' => 11,
            other => other,
        });
        i += 2;
    }
    String::from_utf8(out).ok().map(std::borrow::Cow::Owned)
}

fn compare<K: std::fmt::Debug + Eq + std::hash::Hash + Ord>(
    log: &std::collections::HashMap<K, super::fold::Amounts>,
    table: &std::collections::HashMap<K, super::fold::Amounts>,
    name: &str,
    differ: &mut impl FnMut(String),
) {
    // Equal when every key of the log is in the table with the same
    // amounts and the table has no other key; listed in order otherwise.
    let same = log.len() == table.len() && log.iter().all(|(k, a)| table.get(k) == Some(a));
    if same {
        return;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_rows_are_split_and_unescaped() {
        let line = b"7\treservation.placed\t{\"a\": \"x\\\\\"y\\tz\"}\t{}\t1700000000000";
        let row = copy_row(line).unwrap();
        assert_eq!(row[0], "7");
        assert_eq!(row[2], "{\"a\": \"x\\\"y\tz\"}");
        assert_eq!(row[4], "1700000000000");
        assert!(copy_row(b"1\t2").is_none());
        assert!(copy_row(b"1\t2\t3\t4\t5\t6").is_none());
        assert!(copy_row(b"1\t2\t3\t4\t5\\").is_none());
    }

    #[test]
    fn any_bytes_are_a_row_or_none_never_a_panic() {
        let mut rng = fastrand::Rng::with_seed(35);
        let alphabet = b"\\\tnrbfv0x\xff\xc3\xa9a{}\"";
        for _ in 0..20_000 {
            let line: Vec<u8> = (0..rng.usize(0..40))
                .map(|_| alphabet[rng.usize(0..alphabet.len())])
                .collect();
            if let Some(row) = copy_row(&line) {
                assert_eq!(row.len(), 5);
            }
        }
    }
}
