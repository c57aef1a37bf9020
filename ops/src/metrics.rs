//! The process's metrics: one [`prometheus::Registry`] for the whole
//! process, written in the Prometheus text format on `--metrics-listen`
//! (by the `http` module) and read by the OTLP exporter from the same
//! registry ([`gather`]), so both carry the same series.
//!
//! Every crate registers its instruments here; three kinds are offered:
//! - counters, gauges and histograms updated where the work happens;
//! - values computed when scraped ([`gauge_fn`], [`family`]), so a gauge
//!   never freezes at a stale value;
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

/// Builds a family of gauges or counters from samples (for a collector
/// that computes several families from one reading).
pub fn family(
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

/// Restarts of supervised tasks after a failure, by task name
/// (`strata_task_restarts_total{task}`).
pub fn task_restarts() -> &'static IntCounterVec {
    static C: OnceLock<IntCounterVec> = OnceLock::new();
    C.get_or_init(|| {
        counter_vec(
            "strata_task_restarts_total",
            "Supervised tasks started again after a failure.",
            &["task"],
        )
    })
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
