//! The sinks' metrics on `/metrics`, by sink name (an operator's choice, so
//! stable across restarts): events delivered and parked, delivery retries,
//! batch latency. How far behind each sink is is its subscription's lag,
//! `strata_subscription_lag_events{subscription="sink.<name>"}`.

use ops::metrics::prometheus::{HistogramVec, IntCounterVec};
use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;
use std::time::Duration;

struct Sinks {
    delivered: IntCounterVec,
    parked: IntCounterVec,
    batches: IntCounterVec,
    retries: IntCounterVec,
    seconds: HistogramVec,
}

fn sinks() -> &'static Sinks {
    static S: OnceLock<Sinks> = OnceLock::new();
    S.get_or_init(|| Sinks {
        delivered: ops::metrics::counter_vec(
            "strata_sink_delivered_events_total",
            "Events delivered, by sink.",
            &["sink"],
        ),
        parked: ops::metrics::counter_vec(
            "strata_sink_parked_events_total",
            "Events parked after every attempt at their batch failed, by sink.",
            &["sink"],
        ),
        batches: ops::metrics::counter_vec(
            "strata_sink_batches_total",
            "Batches, by sink and outcome (delivered or parked).",
            &["sink", "outcome"],
        ),
        retries: ops::metrics::counter_vec(
            "strata_sink_retries_total",
            "Delivery attempts after a batch's first, by sink.",
            &["sink"],
        ),
        seconds: ops::metrics::histogram_vec(
            "strata_sink_batch_duration_seconds",
            "Time to deliver or park a batch, retries included, by sink.",
            &["sink"],
            &[
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 120.0,
            ],
        ),
    })
}

/// Counts a batch of `events` that was `delivered` or parked after
/// `attempts` attempts taking `took`.
pub(crate) fn batch(sink: &str, delivered: bool, events: usize, attempts: u32, took: Duration) {
    let s = sinks();
    let (events_total, outcome) = if delivered {
        (&s.delivered, "delivered")
    } else {
        (&s.parked, "parked")
    };
    events_total
        .with_label_values(&[sink])
        .inc_by(events as u64);
    s.batches.with_label_values(&[sink, outcome]).inc();
    s.retries
        .with_label_values(&[sink])
        .inc_by(u64::from(attempts.saturating_sub(1)));
    s.seconds
        .with_label_values(&[sink])
        .observe(took.as_secs_f64());
}

/// A running set of sinks' counters, summed over the live sets when scraped.
#[derive(Debug, Default)]
pub struct SinkStats {
    pub delivered: AtomicU64,
    pub batches: AtomicU64,
    pub parked: AtomicU64,
    pub workers: AtomicU64,
    /// Sinks paused because they kept failing.
    pub alerts: AtomicU64,
}

static FIELDS: &[ops::metrics::Field<SinkStats>] = &[
    ops::stat_field!(
        SinkStats,
        "strata_sink_workers",
        Gauge,
        "Sinks this process delivers now (it holds their subscription's lease).",
        workers
    ),
    ops::stat_field!(
        SinkStats,
        "strata_sink_pauses_total",
        Counter,
        "Sinks paused with an alert after batches kept failing.",
        alerts
    ),
];

/// Counts `stats` into `/metrics` while it lives.
pub(crate) fn count(stats: &std::sync::Arc<SinkStats>) {
    static R: OnceLock<ops::metrics::Instances<SinkStats>> = OnceLock::new();
    R.get_or_init(|| ops::metrics::Instances::new(FIELDS))
        .add(stats);
}
