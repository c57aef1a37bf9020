//! The usage fold (pure): each reservation's life read from its events, and
//! the GPU time it held split into hourly, daily and monthly buckets (UTC).
//!
//! A reservation's GPUs are *held* from its placement to its activation (or
//! to its end, when it never became active: binding, or a bind that never
//! came) and *active* from its activation to its end. Times are the events'
//! `recorded_at` in whole milliseconds; amounts are GPU-milliseconds, whole
//! numbers, so a bucket is the same however the intervals were summed into it.
//! A reservation adds to the buckets when it ends; one still open is kept as
//! an [`Open`] (and reported up to the report's end from it).

use domain::Fact;
use std::collections::{HashMap, HashSet};

pub use domain::calendar::{DAY_MS, HOUR_MS};

/// A rollup's bucket length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Period {
    Hour,
    Day,
    Month,
}

impl Period {
    pub const ALL: [Period; 3] = [Period::Hour, Period::Day, Period::Month];

    /// Its name in the rollup tables.
    pub fn name(self) -> &'static str {
        match self {
            Period::Hour => "hour",
            Period::Day => "day",
            Period::Month => "month",
        }
    }

    pub fn from_name(s: &str) -> Option<Period> {
        Period::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The start of the bucket holding `ms` (UTC).
    pub fn start(self, ms: i64) -> i64 {
        match self {
            Period::Hour => ms.div_euclid(HOUR_MS) * HOUR_MS,
            Period::Day => domain::calendar::day_start(ms),
            Period::Month => domain::calendar::month_start(ms),
        }
    }

    /// The start of the bucket after the one starting at `start`.
    pub fn next(self, start: i64) -> i64 {
        match self {
            Period::Hour => start + HOUR_MS,
            Period::Day => start + DAY_MS,
            Period::Month => domain::calendar::next_month(start),
        }
    }
}

/// A span of time, `[from, to)` in Unix milliseconds.
pub type Span = (i64, i64);

/// GPUs a reservation holds on one node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeGpus {
    pub node: String,
    pub gpus: u32,
}

/// A reservation that has not ended, as far as its usage goes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Open {
    pub reservation: String,
    pub pool: String,
    /// Its queue; empty when it named none.
    pub queue: String,
    /// Who asked: the operator the client API recorded, or the user a
    /// command line with database access ran as; empty when neither.
    pub owner: String,
    pub class: String,
    pub requested_ms: i64,
    pub placed_ms: Option<i64>,
    pub activated_ms: Option<i64>,
    pub allocations: Vec<NodeGpus>,
}

impl Open {
    /// GPUs held in all.
    pub fn gpus(&self) -> i64 {
        self.allocations.iter().map(|a| a.gpus as i64).sum()
    }

    /// Its held and active intervals if it ended (or were cut) at `end_ms`.
    pub fn intervals(&self, end_ms: i64) -> (Option<Span>, Option<Span>) {
        let Some(placed) = self.placed_ms else {
            return (None, None);
        };
        let held_end = self.activated_ms.unwrap_or(end_ms).min(end_ms).max(placed);
        let held = (held_end > placed).then_some((placed, held_end));
        let active = self.activated_ms.and_then(|a| {
            let a = a.max(placed);
            (end_ms > a).then_some((a, end_ms))
        });
        (held, active)
    }
}

/// A rollup row's key without its node: (period, bucket start, pool, queue,
/// owner, class).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AccountKey {
    pub period: Period,
    pub start_ms: i64,
    pub pool: String,
    pub queue: String,
    pub owner: String,
    pub class: String,
}

/// A node rollup row's key: (period, bucket start, pool, node, class).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeKey {
    pub period: Period,
    pub start_ms: i64,
    pub pool: String,
    pub node: String,
    pub class: String,
}

/// What one bucket adds up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Amounts {
    pub active_gpu_ms: i64,
    pub held_gpu_ms: i64,
    /// Reservations that ended in the bucket (account rollups only).
    pub ended: i64,
}

impl Amounts {
    pub fn add(&mut self, o: &Amounts) {
        self.active_gpu_ms += o.active_gpu_ms;
        self.held_gpu_ms += o.held_gpu_ms;
        self.ended += o.ended;
    }
}

/// What a run of events changed: the rollups' increments and which open
/// reservations to write or remove.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Delta {
    pub accounts: HashMap<AccountKey, Amounts>,
    pub nodes: HashMap<NodeKey, Amounts>,
    /// Open reservations whose row changed (write them from the fold).
    pub touched: HashSet<String>,
    /// Reservations that ended (remove their row).
    pub ended: HashSet<String>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.accounts.is_empty()
            && self.nodes.is_empty()
            && self.touched.is_empty()
            && self.ended.is_empty()
    }
}

/// The buckets node rollups are kept in: days and months (hours by node
/// would be a row per node and hour, 7.2 million a month at 10,000 nodes).
pub const NODE_PERIODS: &[Period] = &[Period::Day, Period::Month];

/// Adds `gpus` GPUs over `[from, to)` to every bucket of `periods` it
/// crosses.
fn spread(
    periods: &[Period],
    from: i64,
    to: i64,
    gpus: i64,
    mut add: impl FnMut(Period, i64, i64),
) {
    for &period in periods {
        let mut start = period.start(from);
        while start < to {
            let next = period.next(start);
            let overlap = to.min(next) - from.max(start);
            if overlap > 0 {
                add(period, start, gpus * overlap);
            }
            start = next;
        }
    }
}

/// Adds an ended (or cut) reservation's time to `accounts` and `nodes`.
pub fn add_usage(
    open: &Open,
    end_ms: i64,
    accounts: &mut HashMap<AccountKey, Amounts>,
    nodes: &mut HashMap<NodeKey, Amounts>,
) {
    let (held, active) = open.intervals(end_ms);
    let account = |period: Period, start_ms: i64| AccountKey {
        period,
        start_ms,
        pool: open.pool.clone(),
        queue: open.queue.clone(),
        owner: open.owner.clone(),
        class: open.class.clone(),
    };
    let total = open.gpus();
    for (range, is_active) in [(held, false), (active, true)] {
        let Some((from, to)) = range else { continue };
        spread(&Period::ALL, from, to, total, |period, start, gpu_ms| {
            let a = accounts.entry(account(period, start)).or_default();
            if is_active {
                a.active_gpu_ms += gpu_ms;
            } else {
                a.held_gpu_ms += gpu_ms;
            }
        });
        for alloc in &open.allocations {
            spread(
                NODE_PERIODS,
                from,
                to,
                alloc.gpus as i64,
                |period, start_ms, gpu_ms| {
                    let key = NodeKey {
                        period,
                        start_ms,
                        pool: open.pool.clone(),
                        node: alloc.node.clone(),
                        class: open.class.clone(),
                    };
                    let a = nodes.entry(key).or_default();
                    if is_active {
                        a.active_gpu_ms += gpu_ms;
                    } else {
                        a.held_gpu_ms += gpu_ms;
                    }
                },
            );
        }
    }
}

/// The fold: the open reservations, and what each event changes.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Fold {
    pub open: HashMap<String, Open>,
    /// Owners handed to replacements not requested yet (`replaced_by` of a
    /// reservation that ended before its replacement's request was read).
    inherited: HashMap<String, String>,
}

/// The event types the fold reads, as the log may store them (old names
/// included), for SQL that reads only those.
pub fn event_types() -> Vec<String> {
    READS
        .iter()
        .flat_map(|t| domain::fact::stored_types(t))
        .collect()
}

const READS: [&str; 6] = [
    "reservation.requested",
    "reservation.placed",
    "reservation.activated",
    "reservation.failed",
    "reservation.preempted",
    "reservation.ended",
];

/// Whether the fold reads events of this type (the others are skipped
/// before their payload is parsed).
pub fn reads(event_type: &str) -> bool {
    READS.contains(&domain::fact::canonical_type(event_type))
}

/// Who asked, from a request's metadata.
fn owner_of(metadata: &str) -> String {
    let Ok(serde_json::Value::Object(m)) = serde_json::from_str::<serde_json::Value>(metadata)
    else {
        return String::new();
    };
    ["operator", "cli"]
        .iter()
        .find_map(|k| m.get(*k).and_then(|v| v.as_str()).map(str::to_string))
        .unwrap_or_default()
}

impl Fold {
    /// A fold resuming from these open reservations.
    pub fn from_open(open: impl IntoIterator<Item = Open>) -> Fold {
        Fold {
            open: open
                .into_iter()
                .map(|o| (o.reservation.clone(), o))
                .collect(),
            inherited: HashMap::new(),
        }
    }

    /// Folds one event in, adding what it changed to `delta`. An event of a
    /// type the fold does not read, or one that does not parse (the index's
    /// to report), changes nothing here.
    pub fn apply(
        &mut self,
        event_type: &str,
        payload: &str,
        metadata: &str,
        recorded_ms: i64,
        delta: &mut Delta,
    ) {
        // Skipped before its payload is parsed.
        if !reads(event_type) {
            return;
        }
        let Ok(Some(fact)) = Fact::parse(event_type, payload, metadata) else {
            return;
        };
        match fact {
            Fact::ReservationRequested(r) => {
                let mut owner = owner_of(metadata);
                if let Some(prev) = &r.replaces {
                    if let Some(o) = self.inherited.remove(&r.reservation) {
                        owner = o;
                    } else if let Some(p) = self.open.get(prev) {
                        owner = p.owner.clone();
                    }
                }
                self.open.insert(
                    r.reservation.clone(),
                    Open {
                        reservation: r.reservation.clone(),
                        pool: r.pool,
                        queue: r.queue.unwrap_or_default(),
                        owner,
                        class: r.class,
                        requested_ms: recorded_ms,
                        placed_ms: None,
                        activated_ms: None,
                        allocations: Vec::new(),
                    },
                );
                delta.touched.insert(r.reservation);
            }
            Fact::ReservationPlaced {
                reservation,
                allocations,
            } => {
                if let Some(o) = self.open.get_mut(&reservation) {
                    o.placed_ms = Some(recorded_ms);
                    o.allocations = allocations
                        .into_iter()
                        .map(|a| NodeGpus {
                            node: a.node,
                            gpus: a.devices.len() as u32,
                        })
                        .collect();
                    delta.touched.insert(reservation);
                }
            }
            Fact::ReservationActivated { reservation } => {
                if let Some(o) = self.open.get_mut(&reservation) {
                    if o.activated_ms.is_none() {
                        o.activated_ms = Some(recorded_ms);
                        delta.touched.insert(reservation);
                    }
                }
            }
            Fact::ReservationFailed {
                reservation,
                replaced_by: Some(next),
                ..
            }
            | Fact::ReservationPreempted {
                reservation,
                replaced_by: Some(next),
                ..
            } => {
                let owner = self.open.get(&reservation).map(|o| o.owner.clone());
                match (owner, self.open.get_mut(&next)) {
                    (Some(owner), Some(n)) => {
                        if n.owner != owner {
                            n.owner = owner;
                            delta.touched.insert(next);
                        }
                    }
                    (Some(owner), None) => {
                        self.inherited.insert(next, owner);
                    }
                    (None, _) => {}
                }
            }
            Fact::ReservationEnded { reservation, .. } => {
                if let Some(o) = self.open.remove(&reservation) {
                    add_usage(&o, recorded_ms, &mut delta.accounts, &mut delta.nodes);
                    let key = AccountKey {
                        period: Period::Hour,
                        start_ms: 0,
                        pool: o.pool,
                        queue: o.queue,
                        owner: o.owner,
                        class: o.class,
                    };
                    for period in Period::ALL {
                        let k = AccountKey {
                            period,
                            start_ms: period.start(recorded_ms),
                            ..key.clone()
                        };
                        delta.accounts.entry(k).or_default().ended += 1;
                    }
                    delta.touched.remove(&reservation);
                    delta.ended.insert(reservation);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Unix milliseconds of an RFC 3339 time.
    pub(crate) fn ms(s: &str) -> i64 {
        humantime::parse_rfc3339(s)
            .unwrap()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    }

    #[test]
    fn buckets_follow_the_calendar() {
        let t = ms("2024-02-29T13:45:10Z");
        assert_eq!(Period::Hour.start(t), ms("2024-02-29T13:00:00Z"));
        assert_eq!(Period::Day.start(t), ms("2024-02-29T00:00:00Z"));
        assert_eq!(Period::Month.start(t), ms("2024-02-01T00:00:00Z"));
        assert_eq!(
            Period::Month.next(ms("2024-02-01T00:00:00Z")),
            ms("2024-03-01T00:00:00Z")
        );
        assert_eq!(
            Period::Month.next(ms("2026-12-01T00:00:00Z")),
            ms("2027-01-01T00:00:00Z")
        );
    }

    fn open(placed: &str, active: Option<&str>) -> Open {
        Open {
            reservation: "r".into(),
            pool: "p".into(),
            queue: "q".into(),
            owner: "ana".into(),
            class: "H100".into(),
            requested_ms: ms(placed),
            placed_ms: Some(ms(placed)),
            activated_ms: active.map(ms),
            allocations: vec![
                NodeGpus {
                    node: "n1".into(),
                    gpus: 2,
                },
                NodeGpus {
                    node: "n2".into(),
                    gpus: 1,
                },
            ],
        }
    }

    #[test]
    fn an_interval_is_split_exactly_over_hours_days_and_months() {
        let o = open("2026-11-30T22:30:00Z", Some("2026-11-30T23:00:00Z"));
        let (mut acc, mut nodes) = (HashMap::new(), HashMap::new());
        add_usage(&o, ms("2026-12-01T01:15:00Z"), &mut acc, &mut nodes);
        let get = |p: Period, at: &str| {
            acc.get(&AccountKey {
                period: p,
                start_ms: ms(at),
                pool: "p".into(),
                queue: "q".into(),
                owner: "ana".into(),
                class: "H100".into(),
            })
            .copied()
            .unwrap_or_default()
        };
        // Held 22:30 to 23:00 on 3 GPUs; active 23:00 to 01:15.
        assert_eq!(
            get(Period::Hour, "2026-11-30T22:00:00Z").held_gpu_ms,
            3 * HOUR_MS / 2
        );
        assert_eq!(
            get(Period::Hour, "2026-11-30T23:00:00Z").active_gpu_ms,
            3 * HOUR_MS
        );
        assert_eq!(
            get(Period::Hour, "2026-12-01T01:00:00Z").active_gpu_ms,
            3 * HOUR_MS / 4
        );
        assert_eq!(
            get(Period::Month, "2026-11-01T00:00:00Z").active_gpu_ms,
            3 * HOUR_MS
        );
        assert_eq!(
            get(Period::Month, "2026-12-01T00:00:00Z").active_gpu_ms,
            3 * 5 * HOUR_MS / 4
        );
        let total = |p: Period| -> i64 {
            acc.iter()
                .filter(|(k, _)| k.period == p)
                .map(|(_, a)| a.active_gpu_ms)
                .sum()
        };
        assert_eq!(total(Period::Hour), 3 * 9 * HOUR_MS / 4);
        assert_eq!(total(Period::Hour), total(Period::Day));
        assert_eq!(total(Period::Hour), total(Period::Month));
        let node_total: i64 = nodes
            .iter()
            .filter(|(k, _)| k.period == Period::Day && k.node == "n1")
            .map(|(_, a)| a.active_gpu_ms)
            .sum();
        assert_eq!(node_total, 2 * 9 * HOUR_MS / 4);
        assert!(nodes.keys().all(|k| k.period != Period::Hour));
    }

    #[test]
    fn a_reservation_never_active_is_held_until_its_end() {
        let o = open("2026-12-01T10:00:00Z", None);
        assert_eq!(
            o.intervals(ms("2026-12-01T10:10:00Z")),
            (
                Some((ms("2026-12-01T10:00:00Z"), ms("2026-12-01T10:10:00Z"))),
                None
            )
        );
        let mut queued = o.clone();
        queued.placed_ms = None;
        assert_eq!(queued.intervals(ms("2026-12-01T11:00:00Z")), (None, None));
    }

    #[test]
    fn a_replacement_is_owned_by_whoever_asked_for_the_original() {
        let mut f = Fold::default();
        let mut d = Delta::default();
        let req = |id: &str, replaces: Option<&str>| {
            let r = domain::Request {
                reservation: id.into(),
                pool: "p".into(),
                class: "H100".into(),
                gpus: 1,
                shape: domain::Shape::Any,
                priority: 0,
                ttl_ms: None,
                replace_on_failure: true,
                replaces: replaces.map(str::to_string),
                requeue_on_preemption: false,
                start_ms: None,
                topology: None,
                queue: None,
            };
            Fact::ReservationRequested(r).to_event()
        };
        let e = req("r", None);
        f.apply(
            &e.event_type,
            e.payload.get(),
            r#"{"operator":"ana"}"#,
            0,
            &mut d,
        );
        let failed = Fact::ReservationFailed {
            reservation: "r".into(),
            node: "n".into(),
            reason: "node_lost".into(),
            replaced_by: Some("r~1".into()),
        }
        .to_event();
        f.apply(&failed.event_type, failed.payload.get(), "{}", 5, &mut d);
        let ended = Fact::ReservationEnded {
            reservation: "r".into(),
            outcome: "failed".into(),
        }
        .to_event();
        f.apply(&ended.event_type, ended.payload.get(), "{}", 5, &mut d);
        let e = req("r~1", Some("r"));
        f.apply(&e.event_type, e.payload.get(), "{}", 5, &mut d);
        assert_eq!(f.open["r~1"].owner, "ana");
        assert!(d.ended.contains("r") && d.touched.contains("r~1") && !d.touched.contains("r"));
    }
}
