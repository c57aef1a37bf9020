//! Process metrics, rendered in the Prometheus text format for
//! `--metrics-listen`. Names follow OpenTelemetry's conventions (unit suffix,
//! `_total` for counters) so the same series can be exported over OTLP.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};

/// A histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.sum_micros.fetch_add((v * 1e6) as u64, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let n = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {n}");
    }
}

/// A gauge holding an f64.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }
}

/// Lag of one subscription.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SubscriptionLag {
    pub events: u64,
    pub seconds: f64,
}

/// Every metric Strata keeps in this process.
#[derive(Debug)]
pub struct Metrics {
    pub append_events: AtomicU64,
    /// Events written by `append_in` inside callers' own transactions,
    /// counted when written (they commit or roll back with the caller's).
    pub append_in_events: AtomicU64,
    pub append_transactions: AtomicU64,
    pub append_conflicts: AtomicU64,
    /// Batches the database did not answer within the appender's
    /// `attempt_timeout`.
    pub append_timeouts: AtomicU64,
    pub append_batch_size: Histogram,
    pub append_duration: Histogram,
    pub replication_events: AtomicU64,
    pub replication_transactions: AtomicU64,
    pub replication_lag_bytes: Gauge,
    pub replication_lag_seconds: Gauge,
    pub subscriptions: Mutex<BTreeMap<String, SubscriptionLag>>,
    /// Restarts of supervised tasks after a failure, by task name.
    task_restarts: Mutex<BTreeMap<&'static str, u64>>,
    /// Renderers added by other parts of the process (the placer's counters).
    extra: Renderers,
}

#[derive(Default)]
struct Renderers(Mutex<Vec<Renderer>>);

impl std::fmt::Debug for Renderers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |v| v.len());
        write!(f, "{n} renderer(s)")
    }
}

/// Appends metrics in the Prometheus text format.
pub type Renderer = std::sync::Arc<dyn Fn(&mut String) + Send + Sync>;

const SIZE_BOUNDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
];
const SECONDS_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
];

/// The process-wide metrics.
pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| Metrics {
        append_events: AtomicU64::new(0),
        append_in_events: AtomicU64::new(0),
        append_transactions: AtomicU64::new(0),
        append_conflicts: AtomicU64::new(0),
        append_timeouts: AtomicU64::new(0),
        append_batch_size: Histogram::new(SIZE_BOUNDS),
        append_duration: Histogram::new(SECONDS_BOUNDS),
        replication_events: AtomicU64::new(0),
        replication_transactions: AtomicU64::new(0),
        replication_lag_bytes: Gauge::default(),
        replication_lag_seconds: Gauge::default(),
        subscriptions: Mutex::new(BTreeMap::new()),
        task_restarts: Mutex::new(BTreeMap::new()),
        extra: Renderers::default(),
    })
}

impl Metrics {
    /// Counts one restart of the supervised task `task`.
    pub fn count_restart(&self, task: &'static str) {
        *self
            .task_restarts
            .lock()
            .expect("metrics lock")
            .entry(task)
            .or_default() += 1;
    }

    /// How often the supervised task `task` was restarted.
    pub fn restarts(&self, task: &str) -> u64 {
        self.task_restarts
            .lock()
            .expect("metrics lock")
            .get(task)
            .copied()
            .unwrap_or(0)
    }

    pub fn set_subscription_lag(&self, name: &str, lag: SubscriptionLag) {
        if let Ok(mut m) = self.subscriptions.lock() {
            match m.get_mut(name) {
                Some(v) => *v = lag,
                None => {
                    m.insert(name.to_string(), lag);
                }
            }
        }
    }

    /// A copy of every subscription's lag.
    pub fn subscription_lags(&self) -> Vec<(String, SubscriptionLag)> {
        self.subscriptions
            .lock()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), *v)).collect())
            .unwrap_or_default()
    }

    /// Adds a renderer whose output follows the built-in metrics.
    pub fn register(&self, renderer: Renderer) {
        if let Ok(mut v) = self.extra.0.lock() {
            v.push(renderer);
        }
    }

    pub fn remove_subscription(&self, name: &str) {
        if let Ok(mut m) = self.subscriptions.lock() {
            m.remove(name);
        }
    }

    /// Renders every metric in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut out,
            "strata_append_events_total",
            "Events appended and committed.",
            self.append_events.load(Relaxed),
        );
        counter(
            &mut out,
            "strata_append_in_events_total",
            "Events written inside callers' own transactions (counted when written; they commit or roll back with the caller's).",
            self.append_in_events.load(Relaxed),
        );
        counter(
            &mut out,
            "strata_append_transactions_total",
            "Group-commit transactions committed.",
            self.append_transactions.load(Relaxed),
        );
        counter(
            &mut out,
            "strata_append_conflicts_total",
            "Appends refused for a version conflict.",
            self.append_conflicts.load(Relaxed),
        );
        counter(
            &mut out,
            "strata_append_timeouts_total",
            "Append batches the database did not answer in time (their connection was dropped).",
            self.append_timeouts.load(Relaxed),
        );
        self.append_batch_size.render(
            "strata_append_batch_size",
            "Events per group-commit transaction.",
            &mut out,
        );
        self.append_duration.render(
            "strata_append_duration_seconds",
            "Time from append call to durable commit.",
            &mut out,
        );
        counter(
            &mut out,
            "strata_replication_events_total",
            "Events decoded from the replication stream.",
            self.replication_events.load(Relaxed),
        );
        counter(
            &mut out,
            "strata_replication_transactions_total",
            "Transactions decoded from the replication stream.",
            self.replication_transactions.load(Relaxed),
        );
        gauge(
            &mut out,
            "strata_replication_lag_bytes",
            "WAL between the server's position and what this process acknowledged.",
            self.replication_lag_bytes.get(),
        );
        gauge(
            &mut out,
            "strata_replication_lag_seconds",
            "Age of the newest transaction received, at receipt.",
            self.replication_lag_seconds.get(),
        );
        let subs = self
            .subscriptions
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default();
        let _ = writeln!(out, "# HELP strata_subscription_lag_events Events committed but not yet acknowledged by the subscription.\n# TYPE strata_subscription_lag_events gauge");
        for (name, lag) in &subs {
            let _ = writeln!(
                out,
                "strata_subscription_lag_events{{subscription=\"{}\"}} {}",
                escape(name),
                lag.events
            );
        }
        let _ = writeln!(out, "# HELP strata_subscription_lag_seconds Age of the oldest event not yet delivered to the subscription.\n# TYPE strata_subscription_lag_seconds gauge");
        for (name, lag) in &subs {
            let _ = writeln!(
                out,
                "strata_subscription_lag_seconds{{subscription=\"{}\"}} {}",
                escape(name),
                lag.seconds
            );
        }
        let restarts = self
            .task_restarts
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default();
        let _ = writeln!(out, "# HELP strata_task_restarts_total Supervised tasks started again after a failure.\n# TYPE strata_task_restarts_total counter");
        for (task, n) in &restarts {
            let _ = writeln!(
                out,
                "strata_task_restarts_total{{task=\"{}\"}} {n}",
                escape(task)
            );
        }
        let extra = self.extra.0.lock().map(|v| v.clone()).unwrap_or_default();
        for render in extra {
            render(&mut out);
        }
        out
    }
}

/// Escapes a label value.
pub fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Serves `GET /metrics` in the Prometheus text format on `listener` until the
/// task is dropped. Deliberately minimal: one request per connection.
pub async fn serve(listener: tokio::net::TcpListener) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        crate::task::spawn("metrics-conn", async move {
            let mut buf = [0u8; 2048];
            let n =
                match tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut buf))
                    .await
                {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
            let req = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if req.starts_with("GET /metrics") || req.starts_with("GET / ") {
                ("200 OK", global().render())
            } else {
                ("404 Not Found", "not found; try /metrics\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(3.0);
        let mut s = String::new();
        h.render("x", "help", &mut s);
        assert!(s.contains("x_bucket{le=\"1\"} 1"), "{s}");
        assert!(s.contains("x_bucket{le=\"2\"} 2"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3"), "{s}");
        assert!(s.contains("x_count 3"), "{s}");
    }

    #[test]
    fn subscription_labels_are_escaped() {
        let m = global();
        m.set_subscription_lag(
            "a\"b",
            SubscriptionLag {
                events: 3,
                seconds: 0.5,
            },
        );
        let text = m.render();
        assert!(
            text.contains("strata_subscription_lag_events{subscription=\"a\\\"b\"} 3"),
            "{text}"
        );
        m.remove_subscription("a\"b");
    }
}
