//! The lag of every open subscription, computed when scraped
//! (`strata_subscription_lag_events` and `_seconds`, by subscription; an
//! ephemeral one under its role, the largest): the head its reader received
//! minus what its consumer acknowledged, so a caught-up subscription reads 0
//! instead of its last delivery's value. Subscriptions and readers register
//! here through two small traits, so this module depends on neither.

use ops::metrics::family;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{MetricFamily, MetricType};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

/// What a subscription shares with the scrape.
#[derive(Debug, Default)]
pub(crate) struct Lag {
    /// The label: a durable subscription's name, an ephemeral one's role.
    pub label: String,
    /// The last position the subscription saw committed (delivered or
    /// announced), beside its reader's head.
    pub seen: AtomicU64,
    /// Milliseconds since the epoch at which the oldest event delivered
    /// and not yet acknowledged was recorded; 0 when none is.
    pub pending_since_ms: AtomicU64,
}

/// An open subscription as the scrape sees it.
pub(crate) trait Watched: Send + Sync {
    /// Whether it was closed (a closed one is pruned).
    fn closed(&self) -> bool;
    /// Its lag's shared fields.
    fn lag(&self) -> &Lag;
    /// The last position its consumer acknowledged.
    fn acked(&self) -> u64;
}

/// The reader a subscription is fed by, as the scrape sees it.
pub(crate) trait Head: Send + Sync {
    /// The last position the reader received.
    fn head(&self) -> u64;
    /// When the transaction ending at the head committed (ms since the
    /// epoch; 0 until one arrived).
    fn head_at_ms(&self) -> u64;
}

/// One open subscription: its cursor (with its lag) and its reader.
pub(crate) struct Entry {
    pub cursor: Weak<dyn Watched>,
    pub reader: Weak<dyn Head>,
}

fn open() -> &'static Mutex<Vec<Entry>> {
    static OPEN: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
    OPEN.get_or_init(Mutex::default)
}

/// An entry whose subscription is still open.
fn live(e: &Entry) -> bool {
    e.cursor.upgrade().is_some_and(|c| !c.closed())
}

pub(crate) fn add(e: Entry) {
    let mut open = open().lock().expect("subscriptions lock");
    // Pruned here too, so a process nobody scrapes keeps only the open.
    open.retain(live);
    open.push(e);
}

pub(crate) fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// (events, seconds) behind, per label: the largest over the
/// subscriptions of a label.
pub(crate) fn lags() -> BTreeMap<String, (u64, f64)> {
    let now = millis(SystemTime::now());
    let mut out: BTreeMap<String, (u64, f64)> = BTreeMap::new();
    let mut open = open().lock().expect("subscriptions lock");
    open.retain(live);
    for e in open.iter() {
        let Some(cursor) = e.cursor.upgrade() else {
            continue;
        };
        let lag = cursor.lag();
        let reader = e.reader.upgrade();
        let head = reader
            .as_ref()
            .map_or(0, |r| r.head())
            .max(lag.seen.load(Relaxed));
        let behind = head.saturating_sub(cursor.acked());
        let since = match lag.pending_since_ms.load(Relaxed) {
            // Nothing delivered awaits an ack: the oldest event behind
            // is at most as old as the newest the reader received.
            0 => reader.as_ref().map_or(0, |r| r.head_at_ms()),
            since => since,
        };
        let seconds = if behind == 0 || since == 0 {
            0.0
        } else {
            now.saturating_sub(since) as f64 / 1000.0
        };
        let entry = out.entry(lag.label.clone()).or_default();
        entry.0 = entry.0.max(behind);
        entry.1 = entry.1.max(seconds);
    }
    out
}

/// Both lag families from one reading of the subscriptions.
struct Lags {
    events: Desc,
    seconds: Desc,
}

impl Collector for Lags {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.events, &self.seconds]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let lags = lags();
        let labels = ["subscription".to_string()];
        let of = |d: &Desc, v: &dyn Fn(&(u64, f64)) -> f64| {
            let samples = lags.iter().map(|(k, l)| (vec![k.clone()], v(l))).collect();
            family(&d.fq_name, &d.help, MetricType::GAUGE, &labels, samples)
        };
        vec![
            of(&self.events, &|l| l.0 as f64),
            of(&self.seconds, &|l| l.1),
        ]
    }
}

pub(crate) fn register() {
    let desc = |name: &str, help: &str| {
        Desc::new(
            name.to_string(),
            help.to_string(),
            vec!["subscription".to_string()],
            Default::default(),
        )
        .expect("valid metric name")
    };
    ops::metrics::register(Box::new(Lags {
        events: desc(
            "strata_subscription_lag_events",
            "Events committed but not yet acknowledged, per subscription (ephemeral ones by role, the largest).",
        ),
        seconds: desc(
            "strata_subscription_lag_seconds",
            "Age of the oldest event delivered and not yet acknowledged, per subscription (ephemeral ones by role, the largest); 0 when caught up.",
        ),
    }));
}
