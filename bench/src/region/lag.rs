//! How late the simulated fleet's runtime runs a task that is due
//! ([`ops::runtime_lag::sample`], every 100 ms), kept to be reported. Ten thousand daemons
//! share two threads and the machine's two cores with the region; while
//! they reconnect all at once, a daemon's message can wait its turn on
//! those threads for seconds, which a node with a machine of its own would
//! not. A drill reports the lag beside what it measured, so a delay that
//! is the simulation's can be told from the region's.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Samples kept (an hour of them).
const KEEP: usize = 36_000;

/// The lateness of the fleet's runtime, sampled.
#[derive(Default)]
pub struct Lag {
    samples: Mutex<std::collections::VecDeque<(Instant, Duration)>>,
}

impl Lag {
    /// Starts sampling on `runtime`, for as long as it runs.
    pub fn start(runtime: &tokio::runtime::Handle) -> Arc<Lag> {
        let lag = Arc::new(Lag::default());
        let l = lag.clone();
        ops::runtime_lag::sample(runtime, move |at, late| l.record(at, late));
        lag
    }

    fn record(&self, at: Instant, late: Duration) {
        let mut s = self.samples.lock().expect("lag lock");
        if s.len() == KEEP {
            s.pop_front();
        }
        s.push_back((at, late));
    }

    /// The lateness seen since `since`, in milliseconds: p50, p99, the
    /// worst, and how many samples.
    pub fn since(&self, since: Instant) -> serde_json::Value {
        let mut ms: Vec<f64> = self
            .samples
            .lock()
            .expect("lag lock")
            .iter()
            .filter(|(at, _)| *at >= since)
            .map(|(_, late)| late.as_secs_f64() * 1000.0)
            .collect();
        let r = |v: Option<f64>| v.map(|v| crate::util::round(v, 1));
        serde_json::json!({
            "samples": ms.len(),
            "p50_ms": r(crate::util::pct(&mut ms, 0.5)),
            "p99_ms": r(crate::util::pct(&mut ms, 0.99)),
            "max_ms": r(crate::util::pct(&mut ms, 1.0)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_samples_since_count() {
        let lag = Lag::default();
        let t0 = Instant::now();
        lag.record(t0, Duration::from_millis(900));
        let t1 = t0 + Duration::from_secs(1);
        lag.record(t1, Duration::from_millis(2));
        lag.record(t1, Duration::from_millis(4));
        let v = lag.since(t1);
        assert_eq!(v["samples"], 2);
        assert_eq!(v["max_ms"], 4.0);
    }
}
