//! The process's metrics: one [`prometheus::Registry`] for the whole
//! process, written in the Prometheus text format on `--metrics-listen`
//! (see [`crate::http`]) and read by the OTLP exporter from the same
//! registry ([`gather`]), so both carry the same series.
//!
//! Three kinds of instrument live here:
//! - the log's own counters and histograms ([`global`]), updated where the
//!   work happens;
//! - values computed when scraped ([`gauge_fn`], and the subscriptions'
//!   lag, `head - acknowledged`), so a gauge never freezes at a stale value;
//! - counters kept per instance of a role (a placer, a gateway) and summed
//!   over the live instances when scraped ([`Instances`]): tests run several
//!   instances in one process, each with its own counters, and a scrape sees
//!   the process's total.
//!
//! Label values are stable across restarts: no process-generated names
//! (ephemeral subscriptions are reported under their role, the placer's
//! holder is not a label).

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, MetricFamily, MetricType};
use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

pub use prometheus;

/// The process's registry.
pub fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// Registers a collector. A name already registered (a second instance of
/// something registering process-wide families) is a programming error
/// elsewhere; it is logged and the first registration kept.
pub fn register(c: Box<dyn Collector>) {
    if let Err(e) = registry().register(c) {
        tracing::warn!(error = %e, "metric not registered");
    }
}

/// Every metric family of the process, as of now.
pub fn gather() -> Vec<MetricFamily> {
    registry().gather()
}

/// Renders every metric in the Prometheus text exposition format (0.0.4).
pub fn render() -> String {
    use prometheus::Encoder;
    let mut out = Vec::with_capacity(8192);
    if let Err(e) = prometheus::TextEncoder::new().encode(&gather(), &mut out) {
        tracing::warn!(error = %e, "metrics could not be rendered");
    }
    String::from_utf8(out).unwrap_or_default()
}

/// A counter, registered.
pub fn counter(name: &str, help: &str) -> IntCounter {
    let c = IntCounter::with_opts(Opts::new(name, help)).expect("valid counter name");
    register(Box::new(c.clone()));
    c
}

/// A counter with labels, registered.
pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter name");
    register(Box::new(c.clone()));
    c
}

/// A histogram, registered.
pub fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("valid histogram");
    register(Box::new(h.clone()));
    h
}

/// A histogram with labels, registered.
pub fn histogram_vec(
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> prometheus::HistogramVec {
    let h = prometheus::HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid histogram");
    register(Box::new(h.clone()));
    h
}

/// A gauge set where its value changes, registered.
pub fn gauge(name: &str, help: &str) -> Gauge {
    let g = Gauge::with_opts(Opts::new(name, help)).expect("valid gauge name");
    register(Box::new(g.clone()));
    g
}

/// One series of a family computed when scraped: label values (in the
/// order of the family's label names) and the value.
pub type Sample = (Vec<String>, f64);

/// A family whose series are computed when scraped.
struct Computed {
    desc: Desc,
    kind: MetricType,
    labels: Vec<String>,
    read: Box<dyn Fn() -> Vec<Sample> + Send + Sync>,
}

impl Collector for Computed {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        vec![family(
            &self.desc.fq_name,
            &self.desc.help,
            self.kind,
            &self.labels,
            (self.read)(),
        )]
    }
}

/// Builds a family of gauges or counters from samples.
fn family(
    name: &str,
    help: &str,
    kind: MetricType,
    labels: &[String],
    samples: Vec<Sample>,
) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_string());
    f.set_help(help.to_string());
    f.set_field_type(kind);
    let metrics = samples
        .into_iter()
        .map(|(values, v)| {
            let pairs = labels
                .iter()
                .zip(values)
                .map(|(n, v)| {
                    let mut p = proto::LabelPair::default();
                    p.set_name(n.clone());
                    p.set_value(v);
                    p
                })
                .collect();
            let mut m = proto::Metric::from_label(pairs);
            if kind == MetricType::COUNTER {
                let mut c = proto::Counter::default();
                c.set_value(v);
                m.set_counter(c);
            } else {
                let mut g = proto::Gauge::default();
                g.set_value(v);
                m.set_gauge(g);
            }
            m
        })
        .collect();
    f.set_metric(metrics);
    f
}

/// Registers a family of gauges whose series `read` computes at each scrape.
pub fn gauge_fn(
    name: &str,
    help: &str,
    labels: &[&str],
    read: impl Fn() -> Vec<Sample> + Send + Sync + 'static,
) {
    computed(name, help, MetricType::GAUGE, labels, Box::new(read));
}

fn computed(
    name: &str,
    help: &str,
    kind: MetricType,
    labels: &[&str],
    read: Box<dyn Fn() -> Vec<Sample> + Send + Sync>,
) {
    let labels: Vec<String> = labels.iter().map(|s| s.to_string()).collect();
    let desc = Desc::new(
        name.to_string(),
        help.to_string(),
        labels.clone(),
        Default::default(),
    )
    .expect("valid metric name");
    register(Box::new(Computed {
        desc,
        kind,
        labels,
        read,
    }));
}

/// Whether a field of [`Instances`] counts up or goes up and down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One series of a role's counters: the family it belongs to, its labels
/// (in the family's label order) and how to read it off one instance.
pub struct Field<T> {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub labels: &'static [(&'static str, &'static str)],
    pub read: fn(&T) -> u64,
}

/// A [`Field`] reading the atomic field `$f` of a stats struct `$t`:
/// `stat_field!(Stats, "name_total", Counter, "Help.", placed)`, with an
/// optional label list before the field.
#[macro_export]
macro_rules! stat_field {
    ($t:ty, $name:expr, $kind:ident, $help:expr, $labels:expr, $f:ident) => {
        $crate::metrics::Field {
            name: $name,
            help: $help,
            kind: $crate::metrics::Kind::$kind,
            labels: $labels,
            read: |s: &$t| s.$f.load(::std::sync::atomic::Ordering::Relaxed),
        }
    };
    ($t:ty, $name:expr, $kind:ident, $help:expr, $f:ident) => {
        $crate::stat_field!($t, $name, $kind, $help, &[], $f)
    };
}

/// The live instances of a role's counters, summed when scraped: see the
/// module's documentation. Create one per type, in a `static`.
pub struct Instances<T: Send + Sync + 'static> {
    live: Arc<Mutex<Vec<Weak<T>>>>,
}

impl<T: Send + Sync + 'static> Instances<T> {
    /// Registers the families of `fields` (several fields of one name are one
    /// family, told apart by their labels).
    pub fn new(fields: &'static [Field<T>]) -> Self {
        let live: Arc<Mutex<Vec<Weak<T>>>> = Arc::default();
        let mut names: Vec<&'static str> = Vec::new();
        for f in fields {
            if !names.contains(&f.name) {
                names.push(f.name);
            }
        }
        for name in names {
            let of: Vec<&'static Field<T>> = fields.iter().filter(|f| f.name == name).collect();
            let first = of[0];
            let label_names: Vec<&str> = first.labels.iter().map(|(k, _)| *k).collect();
            let live = live.clone();
            let read = move || -> Vec<Sample> {
                let live: Vec<Arc<T>> = {
                    let mut l = live.lock().expect("instances lock");
                    l.retain(|w| w.strong_count() > 0);
                    l.iter().filter_map(Weak::upgrade).collect()
                };
                of.iter()
                    .map(|f| {
                        let values = f.labels.iter().map(|(_, v)| v.to_string()).collect();
                        let sum: u64 = live.iter().map(|t| (f.read)(t)).sum();
                        (values, sum as f64)
                    })
                    .collect()
            };
            let kind = match first.kind {
                Kind::Counter => MetricType::COUNTER,
                Kind::Gauge => MetricType::GAUGE,
            };
            computed(name, first.help, kind, &label_names, Box::new(read));
        }
        Instances { live }
    }

    /// Counts `instance` in until it is dropped.
    pub fn add(&self, instance: &Arc<T>) {
        self.live
            .lock()
            .expect("instances lock")
            .push(Arc::downgrade(instance));
    }
}

/// Sizes of batches.
pub const SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
];
/// Latencies, in seconds.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
];

/// The log's own metrics.
#[derive(Debug)]
pub struct Metrics {
    pub append_events: IntCounter,
    /// Events written by `append_in` inside callers' own transactions,
    /// counted when written (they commit or roll back with the caller's).
    pub append_in_events: IntCounter,
    pub append_transactions: IntCounter,
    pub append_conflicts: IntCounter,
    /// Batches the database did not answer within the appender's
    /// `attempt_timeout`.
    pub append_timeouts: IntCounter,
    pub append_batch_size: Histogram,
    pub append_duration: Histogram,
    pub replication_events: IntCounter,
    pub replication_transactions: IntCounter,
    pub replication_lag_bytes: Gauge,
    pub replication_lag_seconds: Gauge,
    /// Restarts of supervised tasks after a failure, by task name.
    pub task_restarts: IntCounterVec,
}

/// The process-wide metrics of the log.
pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = Metrics {
            append_events: counter("strata_append_events_total", "Events appended and committed."),
            append_in_events: counter(
                "strata_append_in_events_total",
                "Events written inside callers' own transactions (counted when written; they commit or roll back with the caller's).",
            ),
            append_transactions: counter(
                "strata_append_transactions_total",
                "Group-commit transactions committed.",
            ),
            append_conflicts: counter(
                "strata_append_conflicts_total",
                "Appends refused for a version conflict.",
            ),
            append_timeouts: counter(
                "strata_append_timeouts_total",
                "Append batches the database did not answer in time (their connection was dropped).",
            ),
            append_batch_size: histogram(
                "strata_append_batch_size",
                "Events per group-commit transaction.",
                SIZE_BUCKETS,
            ),
            append_duration: histogram(
                "strata_append_duration_seconds",
                "Time from append call to durable commit.",
                SECONDS_BUCKETS,
            ),
            replication_events: counter(
                "strata_replication_events_total",
                "Events decoded from the replication stream.",
            ),
            replication_transactions: counter(
                "strata_replication_transactions_total",
                "Transactions decoded from the replication stream.",
            ),
            replication_lag_bytes: gauge(
                "strata_replication_lag_bytes",
                "WAL between the server's position and what this process acknowledged.",
            ),
            replication_lag_seconds: gauge(
                "strata_replication_lag_seconds",
                "Age of the newest transaction received, at receipt.",
            ),
            task_restarts: counter_vec(
                "strata_task_restarts_total",
                "Supervised tasks started again after a failure.",
                &["task"],
            ),
        };
        subscriptions::register();
        m
    })
}

impl Metrics {
    /// Counts one restart of the supervised task `task`.
    pub fn count_restart(&self, task: &'static str) {
        self.task_restarts.with_label_values(&[task]).inc();
    }

    /// How often the supervised task `task` was restarted.
    pub fn restarts(&self, task: &str) -> u64 {
        self.task_restarts.with_label_values(&[task]).get()
    }
}

/// The lag of every open subscription, computed when scraped.
pub(crate) mod subscriptions {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
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

    /// One open subscription: its cursor (with its lag) and its reader.
    pub(crate) struct Entry {
        pub cursor: Weak<crate::subscription::Cursor>,
        pub reader: Weak<crate::reader::Inner>,
    }

    fn open() -> &'static Mutex<Vec<Entry>> {
        static OPEN: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
        OPEN.get_or_init(Mutex::default)
    }

    /// An entry whose subscription is still open.
    fn live(e: &Entry) -> bool {
        e.cursor
            .upgrade()
            .is_some_and(|c| !c.closed.load(std::sync::atomic::Ordering::Relaxed))
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
            let lag = &cursor.lag;
            let reader = e.reader.upgrade();
            let head = reader
                .as_ref()
                .map_or(0, |r| r.head.load(Relaxed))
                .max(lag.seen.load(Relaxed));
            let behind = head.saturating_sub(cursor.acked.load(Relaxed));
            let since = match lag.pending_since_ms.load(Relaxed) {
                // Nothing delivered awaits an ack: the oldest event behind
                // is at most as old as the newest the reader received.
                0 => reader.as_ref().map_or(0, |r| r.head_at_ms.load(Relaxed)),
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

    pub(super) fn register() {
        let desc = |name: &str, help: &str| {
            Desc::new(
                name.to_string(),
                help.to_string(),
                vec!["subscription".to_string()],
                Default::default(),
            )
            .expect("valid metric name")
        };
        super::register(Box::new(Lags {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Two {
        a: u64,
        b: u64,
    }

    static FIELDS: &[Field<Two>] = &[
        Field {
            name: "test_things_total",
            help: "Things.",
            kind: Kind::Counter,
            labels: &[("kind", "a")],
            read: |t| t.a,
        },
        Field {
            name: "test_things_total",
            help: "Things.",
            kind: Kind::Counter,
            labels: &[("kind", "b")],
            read: |t| t.b,
        },
    ];

    #[test]
    fn instances_are_summed_while_they_live_and_fields_of_one_name_are_one_family() {
        let set = Instances::new(FIELDS);
        let one = Arc::new(Two { a: 1, b: 10 });
        let two = Arc::new(Two { a: 2, b: 20 });
        set.add(&one);
        set.add(&two);
        let text = render();
        assert!(text.contains("test_things_total{kind=\"a\"} 3"), "{text}");
        assert!(text.contains("test_things_total{kind=\"b\"} 30"), "{text}");
        assert_eq!(text.matches("# TYPE test_things_total counter").count(), 1);
        drop(two);
        let text = render();
        assert!(text.contains("test_things_total{kind=\"a\"} 1"), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        gauge_fn("test_escaped", "Escaped.", &["name"], || {
            vec![(vec!["a\"b".to_string()], 3.0)]
        });
        let text = render();
        assert!(text.contains("test_escaped{name=\"a\\\"b\"} 3"), "{text}");
    }
}
