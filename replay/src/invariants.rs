//! The log's invariants, checked against the tables themselves with SQL and
//! a pass over the payloads, not through Strata's projections (so a bug in
//! a projection cannot hide one in the log):
//!
//! 1. positions are unique and gap-free;
//! 2. every stream's versions run 1, 2, 3, ... and `strata.streams` agrees;
//! 3. no device is held by two live placements at any point in log order
//!    (a placement holds its devices from `reservation.placed` on its pool's
//!    stream until `reservation.released`, `.expired` or `.failed` there);
//! 4. no reservation is activated after its `reservation.ended`;
//! 5. every command was issued at most once and has at most one terminal
//!    event (`succeeded`, `failed`, `expired`).
//!
//! Every violation names the positions it is about.

use domain::{canonical_type, stored_types};
use events::db::Sql;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use tokio_postgres::Client;

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    /// Which invariant (`positions`, `versions`, `double_booking`,
    /// `active_after_end`, `commands`).
    pub invariant: &'static str,
    /// The log positions it is about.
    pub positions: Vec<i64>,
    pub detail: String,
}

/// What the check read and found.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    pub events: i64,
    pub streams: i64,
    pub placements: u64,
    pub violations: Vec<Violation>,
}

/// At most this many violations of one kind are listed.
const LIMIT: i64 = 20;

fn types(names: &[&str]) -> Vec<String> {
    names.iter().flat_map(|t| stored_types(t)).collect()
}

/// Checks every invariant over the whole log.
pub async fn check(client: &Client) -> Result<Report, tokio_postgres::Error> {
    let mut report = Report::default();
    positions(client, &mut report).await?;
    versions(client, &mut report).await?;
    double_booking(client, &mut report).await?;
    active_after_end(client, &mut report).await?;
    commands(client, &mut report).await?;
    Ok(report)
}

/// 1. Positions are unique and gap-free within each epoch.
async fn positions(client: &Client, report: &mut Report) -> Result<(), tokio_postgres::Error> {
    let v = &mut report.violations;
    let r = client
        .one(
            "SELECT count(*), count(DISTINCT position), coalesce(min(position), 1), coalesce(max(position), 0)
               FROM strata.events",
            &[],
        )
        .await?;
    let (n, distinct, lo, hi): (i64, i64, i64, i64) = (r.get(0), r.get(1), r.get(2), r.get(3));
    report.events = n;
    if n != distinct {
        let dup = client
            .rows(
                "SELECT position FROM strata.events GROUP BY position HAVING count(*) > 1
                  ORDER BY position LIMIT $1",
                &[&LIMIT],
            )
            .await?;
        v.push(Violation {
            invariant: "positions",
            positions: dup.iter().map(|r| r.get(0)).collect(),
            detail: format!("{} positions appear more than once", n - distinct),
        });
    }
    // Gap-free within each epoch; a takeover's jump to the next epoch's
    // first position is no gap (see `events::EPOCH_SIZE`).
    let gaps = if lo != 1 || hi - lo + 1 != distinct {
        client
            .rows(
                "SELECT p FROM (SELECT position AS p, lag(position) OVER (ORDER BY position) AS q
                                  FROM strata.events) x
                  WHERE (q IS NULL AND p <> 1)
                     OR (p - q > 1 AND (p - 1) % $2 <> 0)
                  ORDER BY p LIMIT $1",
                &[&LIMIT, &(events::EPOCH_SIZE as i64)],
            )
            .await?
    } else {
        Vec::new()
    };
    if !gaps.is_empty() {
        v.push(Violation {
            invariant: "positions",
            positions: gaps.iter().map(|r| r.get(0)).collect(),
            detail: format!(
                "positions {lo}..={hi} hold {distinct} events: the listed ones follow a gap"
            ),
        });
    }
    Ok(())
}

/// 2. Every stream's versions run 1, 2, 3, ... and `strata.streams` agrees.
async fn versions(client: &Client, report: &mut Report) -> Result<(), tokio_postgres::Error> {
    let v = &mut report.violations;
    let bad = client
        .rows(
            "SELECT stream, version, position FROM (
                 SELECT stream, version, position,
                        row_number() OVER (PARTITION BY stream ORDER BY version) AS n
                   FROM strata.events) x
              WHERE version <> n ORDER BY position LIMIT $1",
            &[&LIMIT],
        )
        .await?;
    if !bad.is_empty() {
        v.push(Violation {
            invariant: "versions",
            positions: bad.iter().map(|r| r.get(2)).collect(),
            detail: format!(
                "versions out of sequence, first in stream {:?} at version {}",
                bad[0].get::<_, String>(0),
                bad[0].get::<_, i64>(1)
            ),
        });
    }
    let r = client
        .one(
            "SELECT count(*) FROM (SELECT DISTINCT stream FROM strata.events) s",
            &[],
        )
        .await?;
    report.streams = r.get(0);
    let disagree = client
        .rows(
            "SELECT s.stream, s.version, e.v, e.p FROM strata.streams s
               JOIN (SELECT stream, max(version) AS v, max(position) AS p
                       FROM strata.events GROUP BY stream) e USING (stream)
              WHERE s.version <> e.v ORDER BY e.p LIMIT $1",
            &[&LIMIT],
        )
        .await?;
    if !disagree.is_empty() {
        v.push(Violation {
            invariant: "versions",
            positions: disagree.iter().map(|r| r.get(3)).collect(),
            detail: format!(
                "strata.streams says stream {:?} is at version {}, its events end at {}",
                disagree[0].get::<_, String>(0),
                disagree[0].get::<_, i64>(1),
                disagree[0].get::<_, i64>(2)
            ),
        });
    }
    Ok(())
}

/// 3. No device is held by two live placements, in log order.
async fn double_booking(client: &Client, report: &mut Report) -> Result<(), tokio_postgres::Error> {
    let v = &mut report.violations;
    let fold = placements(client).await?;
    report.placements = fold.placements;
    let doubles = fold.doubles;
    if !doubles.is_empty() {
        let detail = doubles[0].2.clone();
        v.push(Violation {
            invariant: "double_booking",
            positions: doubles
                .iter()
                .take(LIMIT as usize)
                .flat_map(|(a, b, _)| [*a, *b])
                .collect(),
            detail: format!("{} device bookings overlap; first: {detail}", doubles.len()),
        });
    }
    Ok(())
}

/// 4. No reservation is activated after its end.
async fn active_after_end(
    client: &Client,
    report: &mut Report,
) -> Result<(), tokio_postgres::Error> {
    let v = &mut report.violations;
    let late = client
        .rows(
            "SELECT a.stream, a.position, e.position FROM strata.events a
               JOIN strata.events e ON e.stream = a.stream AND e.type = 'reservation.ended'
              WHERE a.stream LIKE 'reservation/%' AND a.type = ANY($1) AND a.version > e.version
              ORDER BY a.position LIMIT $2",
            &[&types(&["reservation.activated"]), &LIMIT],
        )
        .await?;
    if !late.is_empty() {
        v.push(Violation {
            invariant: "active_after_end",
            positions: late
                .iter()
                .flat_map(|r| [r.get::<_, i64>(2), r.get::<_, i64>(1)])
                .collect(),
            detail: format!("{} activated after its end", late[0].get::<_, String>(0)),
        });
    }
    Ok(())
}

/// 5. Every command is issued at most once and ends at most once.
async fn commands(client: &Client, report: &mut Report) -> Result<(), tokio_postgres::Error> {
    let v = &mut report.violations;
    let twice = client
        .rows(
            "SELECT stream, array_agg(position ORDER BY position) FROM strata.events
              WHERE stream LIKE 'command/%' AND type = ANY($1)
              GROUP BY stream, type = ANY($2)
             HAVING count(*) > 1 ORDER BY min(position) LIMIT $3",
            &[
                &types(&[
                    domain::commands::ISSUED,
                    domain::commands::SUCCEEDED,
                    domain::commands::FAILED,
                    domain::commands::EXPIRED,
                ]),
                &types(&[domain::commands::ISSUED]),
                &LIMIT,
            ],
        )
        .await?;
    if !twice.is_empty() {
        v.push(Violation {
            invariant: "commands",
            positions: twice.iter().flat_map(|r| r.get::<_, Vec<i64>>(1)).collect(),
            detail: format!(
                "{} commands were issued twice or ended twice; first: {}",
                twice.len(),
                twice[0].get::<_, String>(0)
            ),
        });
    }
    Ok(())
}

/// The placements' devices folded in log order; [`Placements::catch_up`]
/// folds what was appended since it last read, so a caller that looks
/// again and again (a drill waiting for devices to free) reads each row
/// once.
#[derive(Default)]
pub struct Placements {
    placements: u64,
    /// (pool stream, node, device) -> (reservation, position placed).
    held: HashMap<(String, String, String), (String, i64)>,
    /// (position held, position placed again, what).
    doubles: Vec<(i64, i64, String)>,
    /// (pool stream, reservation) -> the (node, device) it was placed on.
    by_reservation: HashMap<(String, String), Vec<(String, String)>>,
    /// The last position folded.
    position: i64,
}

impl Placements {
    /// Folds the placement events appended since the last call.
    ///
    /// Positions become visible in order (the log head is held until each
    /// append commits), so no row at or below the last position folded
    /// appears later.
    pub async fn catch_up(&mut self, client: &Client) -> Result<(), tokio_postgres::Error> {
        let rows = client
            .rows(
                "SELECT position, stream, type, payload::text FROM strata.events
                  WHERE position > $2 AND stream LIKE 'pool/%' AND type = ANY($1)
                  ORDER BY position",
                &[
                    &types(&[
                        "reservation.placed",
                        "reservation.released",
                        "reservation.expired",
                        "reservation.failed",
                        "reservation.preempted",
                    ]),
                    &self.position,
                ],
            )
            .await?;
        for r in &rows {
            self.fold(r.get(0), r.get(1), r.get(2), r.get(3));
        }
        Ok(())
    }

    fn fold(&mut self, position: i64, stream: String, t: String, payload: String) {
        self.position = self.position.max(position);
        let p: serde_json::Value = serde_json::from_str(&payload).unwrap_or_default();
        let reservation = p["reservation"].as_str().unwrap_or_default().to_string();
        let key = (stream.clone(), reservation.clone());
        if canonical_type(&t) == "reservation.placed" {
            self.placements += 1;
            let mut taken = Vec::new();
            for a in p["allocations"].as_array().into_iter().flatten() {
                let node = a["node"].as_str().unwrap_or_default().to_string();
                for d in a["devices"].as_array().into_iter().flatten() {
                    let device = d.as_str().unwrap_or_default().to_string();
                    let slot = (stream.clone(), node.clone(), device.clone());
                    if let Some((other, at)) = self.held.get(&slot) {
                        self.doubles.push((*at, position, format!(
                            "device {device} of node {node} ({stream}) placed for {reservation} while {other} held it"
                        )));
                    } else {
                        self.held.insert(slot, (reservation.clone(), position));
                    }
                    taken.push((node.clone(), device));
                }
            }
            self.by_reservation.insert(key, taken);
        } else if let Some(taken) = self.by_reservation.remove(&key) {
            for (node, device) in taken {
                let slot = (stream.clone(), node, device);
                if self.held.get(&slot).is_some_and(|(r, _)| *r == reservation) {
                    self.held.remove(&slot);
                }
            }
        }
    }

    /// The reservations holding devices on each node, as folded so far.
    pub fn live(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut live: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for ((_, node, _), (reservation, _)) in &self.held {
            live.entry(node.clone())
                .or_default()
                .insert(reservation.clone());
        }
        live
    }
}

async fn placements(client: &Client) -> Result<Placements, tokio_postgres::Error> {
    let mut f = Placements::default();
    f.catch_up(client).await?;
    Ok(f)
}

/// The reservations the log says hold devices on each node now (placed on
/// its pool's stream and not released, expired or failed there), read from
/// the table like [`check`].
pub async fn live_allocations(
    client: &Client,
) -> Result<BTreeMap<String, BTreeSet<String>>, tokio_postgres::Error> {
    Ok(placements(client).await?.live())
}
