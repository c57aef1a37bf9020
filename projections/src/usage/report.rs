//! Usage reports from the rollups: GPU-hours over a period, grouped by pool,
//! queue, owner, class or node, with billed hours at the weights in force.
//!
//! A period runs from whole hour to whole hour (its start rounded down, its
//! end up; by node from whole day to whole day, as node rollups are kept). It is read as the fewest buckets that tile it (whole months,
//! then whole days, then hours), and the reservations still open are added
//! from their rows up to the period's end or the report's time, whichever
//! is first, all in one snapshot of the tables, so the figures are those of
//! the log up to one position (the `usage` subscription's cursor).

use super::fold::{Period, Span, HOUR_MS};
use super::store::{self, at};
use events::db::Sql;
use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;
use tokio_postgres::GenericClient;

/// What a report groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum By {
    Pool,
    Queue,
    Owner,
    Class,
    Node,
}

impl By {
    pub fn name(self) -> &'static str {
        match self {
            By::Pool => "pool",
            By::Queue => "queue",
            By::Owner => "owner",
            By::Class => "class",
            By::Node => "node",
        }
    }

    /// Parses `pool,queue,owner` (any of pool, queue, owner, class, node;
    /// node goes with pool and class only: the node rollups keep no
    /// queue or owner).
    pub fn parse_list(s: &str) -> Result<Vec<By>, String> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let by = [By::Pool, By::Queue, By::Owner, By::Class, By::Node]
                .into_iter()
                .find(|b| b.name() == part)
                .ok_or_else(|| {
                    format!("cannot group by {part:?}: use pool, queue, owner, class or node")
                })?;
            if !out.contains(&by) {
                out.push(by);
            }
        }
        if out.contains(&By::Node) && (out.contains(&By::Queue) || out.contains(&By::Owner)) {
            return Err(
                "node goes with pool and class only (usage by node keeps no queue or owner)".into(),
            );
        }
        Ok(out)
    }
}

/// What to report.
#[derive(Debug, Clone)]
pub struct Query {
    pub since_ms: i64,
    pub until_ms: i64,
    pub by: Vec<By>,
    /// Only these pools (`None`: every pool).
    pub pools: Option<Vec<String>>,
    /// Only this owner's reservations (`None`: everyone's).
    pub owner: Option<String>,
    /// The report's time: open reservations count up to it.
    pub now_ms: i64,
}

/// One group's figures.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Row {
    /// The group's values, in the order of [`Report::by`].
    pub keys: Vec<String>,
    pub gpu_hours: f64,
    /// Hours GPUs were held before their reservation was active (placed,
    /// binding, or never bound).
    pub held_gpu_hours: f64,
    /// `gpu_hours` at each class's billing weight.
    pub billed_hours: f64,
    /// Reservations that ended in the period (not counted by node).
    pub reservations_ended: i64,
    /// Reservations still open that count in it.
    pub reservations_running: i64,
    pub active_gpu_ms: i64,
    pub held_gpu_ms: i64,
}

/// A report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// The period, rounded to whole hours (days by node), as RFC 3339.
    pub since: String,
    pub until: String,
    pub by: Vec<By>,
    /// The position of the log the figures are exact at (`None`: the usage
    /// role has never run, and nothing is counted).
    pub position: Option<u64>,
    /// Events appended after `position` (what the figures do not hold yet).
    pub behind: u64,
    pub weights: BTreeMap<String, f64>,
    pub rows: Vec<Row>,
    pub total: Row,
}

/// A time as a report's `since` and `until` are given: RFC 3339, a day
/// (`2026-12-01`, at 00:00 UTC) or how long ago (`7d`).
pub fn parse_time(s: &str, now: SystemTime) -> Result<SystemTime, String> {
    if let Ok(t) = humantime::parse_rfc3339_weak(s) {
        return Ok(t);
    }
    if let Ok(t) = humantime::parse_rfc3339_weak(&format!("{s} 00:00:00")) {
        return Ok(t);
    }
    if let Ok(d) = humantime::parse_duration(s) {
        return now
            .checked_sub(d)
            .ok_or_else(|| "that is before the start of time".to_string());
    }
    Err(format!(
        "{s:?}: use a time (2026-12-01T09:00:00Z), a day (2026-12-01) or how long ago (7d)"
    ))
}

/// 00:00 UTC on the first of `now`'s month.
pub fn month_start(now: SystemTime) -> SystemTime {
    let ms = crate::usage::Period::Month.start(crate::usage::unix_ms(now));
    SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64)
}

/// The report as CSV (RFC 4180): a header of the groups' names and the
/// figures, then one record per row.
pub fn csv(r: &Report) -> String {
    let mut out = csv_line(
        r.by.iter().map(|b| b.name().to_string()).chain(
            [
                "gpu_hours",
                "held_gpu_hours",
                "billed_hours",
                "reservations_ended",
                "reservations_running",
            ]
            .map(String::from),
        ),
    );
    for row in &r.rows {
        out.push_str(&csv_line(row.keys.iter().cloned().chain(figures(row))));
    }
    out
}

/// A row's figures as a report prints them.
pub fn figures(row: &Row) -> [String; 5] {
    [
        format!("{:.3}", row.gpu_hours),
        format!("{:.3}", row.held_gpu_hours),
        format!("{:.3}", row.billed_hours),
        row.reservations_ended.to_string(),
        row.reservations_running.to_string(),
    ]
}

/// One CSV record (RFC 4180 quoting).
pub fn csv_line(fields: impl Iterator<Item = String>) -> String {
    let mut out = fields
        .map(|f| {
            if f.contains([',', '"', '\n', '\r']) {
                format!("\"{}\"", f.replace('"', "\"\""))
            } else {
                f
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    out.push_str("\r\n");
    out
}

/// The fewest buckets that tile `[since, until)` (both whole hours).
pub fn tiles(since: i64, until: i64) -> Vec<(Period, i64)> {
    let mut out = Vec::new();
    let mut t = since;
    while t < until {
        let p = [Period::Month, Period::Day, Period::Hour]
            .into_iter()
            .find(|p| p.start(t) == t && p.next(t) <= until)
            .unwrap_or(Period::Hour);
        out.push((p, t));
        t = p.next(t);
    }
    out
}

fn rfc3339(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Rows summed per group and class (weights apply per class).
type Groups = HashMap<(Vec<String>, String), Row>;

fn empty_row(keys: Vec<String>) -> Row {
    Row {
        keys,
        ..Row::default()
    }
}

impl Query {
    /// A group's keys, in the order asked.
    fn keys(&self, pool: &str, queue: &str, owner: &str, class: &str, node: &str) -> Vec<String> {
        self.by
            .iter()
            .map(|b| match b {
                By::Pool => pool,
                By::Queue => queue,
                By::Owner => owner,
                By::Class => class,
                By::Node => node,
            })
            .map(str::to_string)
            .collect()
    }

    /// The period in whole buckets: hours, or days by node (node rollups
    /// are kept by day and month); its start rounded down, its end up.
    fn bounds(&self) -> (i64, i64) {
        let unit = if self.by.contains(&By::Node) {
            Period::Day
        } else {
            Period::Hour
        };
        let up = unit.start(self.until_ms);
        let until = if up < self.until_ms {
            unit.next(up)
        } else {
            up
        };
        (unit.start(self.since_ms), until)
    }
}

/// Adds the rollups of the buckets that tile `[since, until)`.
async fn add_rollups<C: GenericClient + Sync>(
    tx: &C,
    q: &Query,
    (since, until): (i64, i64),
    groups: &mut Groups,
) -> Result<(), tokio_postgres::Error> {
    let tiles = tiles(since, until);
    let periods: Vec<&str> = tiles.iter().map(|(p, _)| p.name()).collect();
    let starts: Vec<i64> = tiles.iter().map(|(_, s)| *s).collect();
    let by_node = q.by.contains(&By::Node);
    let (table, cols, ended) = if by_node {
        (
            "strata.usage_node_rollups",
            "pool, '', '', class, node",
            "0::int8",
        )
    } else {
        (
            "strata.usage_rollups",
            "pool, queue, owner, class, ''",
            "sum(ended)::int8",
        )
    };
    let sql = format!(
        "SELECT {cols}, sum(active_gpu_ms)::int8, sum(held_gpu_ms)::int8, {ended}
           FROM {table} r
           JOIN unnest($1::text[], $2::int8[]) AS b(period, start_ms)
             ON r.period = b.period AND r.start = {at}
          WHERE ($3::text[] IS NULL OR r.pool = ANY($3))
            AND ($4::text IS NULL OR {owner_check})
          GROUP BY 1, 2, 3, 4, 5",
        at = at("b.start_ms"),
        owner_check = if by_node { "false" } else { "r.owner = $4" },
    );
    for r in tx
        .rows(&sql, &[&periods, &starts, &q.pools, &q.owner])
        .await?
    {
        let (pool, queue, owner, class, node): (String, String, String, String, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        let keys = q.keys(&pool, &queue, &owner, &class, &node);
        let g = groups
            .entry((keys.clone(), class))
            .or_insert_with(|| empty_row(keys));
        g.active_gpu_ms += r.get::<_, i64>(5);
        g.held_gpu_ms += r.get::<_, i64>(6);
        g.reservations_ended += r.get::<_, i64>(7);
    }
    Ok(())
}

/// Adds the open reservations' time in `[since, until)`, cut at the
/// report's time.
async fn add_open<C: GenericClient + Sync>(
    tx: &C,
    q: &Query,
    (since, until): (i64, i64),
    groups: &mut Groups,
) -> Result<(), tokio_postgres::Error> {
    let cut = until.min(q.now_ms);
    let open = store::open_where(
        tx,
        "placed_at IS NOT NULL AND ($1::text[] IS NULL OR pool = ANY($1))
           AND ($2::text IS NULL OR owner = $2)",
        &[&q.pools, &q.owner],
    )
    .await?;
    for open in open {
        let (held, active) = open.intervals(cut);
        let overlap =
            |range: Option<Span>| range.map_or(0, |(a, b)| (b.min(until) - a.max(since)).max(0));
        let (held, active) = (overlap(held), overlap(active));
        if held == 0 && active == 0 {
            continue;
        }
        let shares: Vec<(String, i64)> = if q.by.contains(&By::Node) {
            open.allocations
                .iter()
                .map(|a| (a.node.clone(), a.gpus as i64))
                .collect()
        } else {
            vec![(String::new(), open.gpus())]
        };
        for (node, gpus) in shares {
            let keys = q.keys(&open.pool, &open.queue, &open.owner, &open.class, &node);
            let g = groups
                .entry((keys.clone(), open.class.clone()))
                .or_insert_with(|| empty_row(keys));
            g.active_gpu_ms += gpus * active;
            g.held_gpu_ms += gpus * held;
            g.reservations_running += 1;
        }
    }
    Ok(())
}

/// The groups weighed per class and summed to the asked keys, largest
/// first, and their total.
fn weigh(groups: Groups, weights: &BTreeMap<String, f64>) -> (Vec<Row>, Row) {
    let mut rows: BTreeMap<Vec<String>, Row> = BTreeMap::new();
    let mut total = empty_row(Vec::new());
    for ((keys, class), g) in groups {
        let w = weights.get(&class).copied().unwrap_or(1.0);
        let billed = g.active_gpu_ms as f64 / HOUR_MS as f64 * w;
        for r in [
            rows.entry(keys.clone()).or_insert_with(|| empty_row(keys)),
            &mut total,
        ] {
            r.active_gpu_ms += g.active_gpu_ms;
            r.held_gpu_ms += g.held_gpu_ms;
            r.reservations_ended += g.reservations_ended;
            r.reservations_running += g.reservations_running;
            r.billed_hours += billed;
        }
    }
    let mut rows: Vec<Row> = rows.into_values().collect();
    for r in rows.iter_mut().chain(std::iter::once(&mut total)) {
        r.gpu_hours = r.active_gpu_ms as f64 / HOUR_MS as f64;
        r.held_gpu_hours = r.held_gpu_ms as f64 / HOUR_MS as f64;
    }
    rows.sort_by(|a, b| {
        b.gpu_hours
            .total_cmp(&a.gpu_hours)
            .then_with(|| a.keys.cmp(&b.keys))
    });
    (rows, total)
}

/// Runs a report in one repeatable-read snapshot of the usage tables.
pub async fn report(
    client: &mut tokio_postgres::Client,
    q: &Query,
) -> Result<Report, tokio_postgres::Error> {
    let (since, until) = q.bounds();
    let tx = store::snapshot(client).await?;
    let weights = domain::usage::weights(&tx).await.unwrap_or_default();
    let cursor = store::position(&tx).await?;
    let head: i64 = tx
        .one("SELECT last_position FROM strata.log_head", &[])
        .await?
        .get(0);
    let mut groups = Groups::new();
    if since < until {
        add_rollups(&tx, q, (since, until), &mut groups).await?;
        add_open(&tx, q, (since, until), &mut groups).await?;
    }
    tx.commit().await?;
    let (rows, total) = weigh(groups, &weights);
    let head = head.max(0) as u64;
    Ok(Report {
        since: rfc3339(since),
        until: rfc3339(until),
        by: q.by.clone(),
        position: cursor,
        behind: cursor.map_or(head, |c| head.saturating_sub(c)),
        weights,
        rows,
        total,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn csv_fields_are_quoted_when_they_must_be() {
        assert_eq!(
            csv_line(["a".to_string(), "b,c".into(), "d\"e".into()].into_iter()),
            "a,\"b,c\",\"d\"\"e\"\r\n"
        );
    }

    use super::super::fold::tests::ms;
    use super::*;

    #[test]
    fn times_are_read_in_three_forms() {
        let now = humantime::parse_rfc3339("2026-12-06T10:00:00Z").unwrap();
        assert_eq!(
            parse_time("2026-12-01", now).unwrap(),
            humantime::parse_rfc3339("2026-12-01T00:00:00Z").unwrap()
        );
        assert_eq!(
            parse_time("2026-12-01T09:30:00Z", now).unwrap(),
            humantime::parse_rfc3339("2026-12-01T09:30:00Z").unwrap()
        );
        assert_eq!(
            parse_time("2d", now).unwrap(),
            humantime::parse_rfc3339("2026-12-04T10:00:00Z").unwrap()
        );
        assert!(parse_time("yesterday", now).is_err());
        assert_eq!(
            month_start(now),
            humantime::parse_rfc3339("2026-12-01T00:00:00Z").unwrap()
        );
    }

    #[test]
    fn a_period_is_tiled_by_the_fewest_buckets() {
        let t = tiles(ms("2026-10-31T22:00:00Z"), ms("2026-12-02T03:00:00Z"));
        let names: Vec<&str> = t.iter().map(|(p, _)| p.name()).collect();
        // 22:00 and 23:00 of Oct 31, November, Dec 1, three hours of Dec 2.
        assert_eq!(
            names,
            ["hour", "hour", "month", "day", "hour", "hour", "hour"]
        );
        assert_eq!(t[2].1, ms("2026-11-01T00:00:00Z"));
        assert!(tiles(5, 5).is_empty());
    }

    #[test]
    fn node_goes_only_with_pool_and_class() {
        assert_eq!(
            By::parse_list("queue, owner,queue").unwrap(),
            [By::Queue, By::Owner]
        );
        assert!(By::parse_list("node,owner").is_err());
        assert!(By::parse_list("team").is_err());
        assert_eq!(By::parse_list("pool,node,class").unwrap().len(), 3);
    }
}
