//! How late a runtime runs what is due: a task sleeps to a deadline every
//! [`EVERY`] and measures how long after it it ran. A runtime whose threads
//! are all busy (a storm of TLS handshakes, a long poll that does not
//! yield) or whose process waits for a core runs every timer and every
//! ready task that late, so the lateness tells a delay of the process from
//! one of its peers or its database.
//!
//! [`watch`] reports it for a long-running process: the histogram
//! `strata_runtime_lag_seconds`, and a warning when a wake came a second or
//! more late (at most one every [`WARN_EVERY`], with the worst since the
//! last). [`sample`] hands each measurement to the caller instead (the
//! benches keep them).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How often the sampler wakes.
pub const EVERY: Duration = Duration::from_millis(100);

/// A wake this late is warned about.
pub const WARN_AT: Duration = Duration::from_secs(1);

/// Fewest seconds between two warnings.
pub const WARN_EVERY: Duration = Duration::from_secs(10);

/// Samples the lateness of `runtime` every [`EVERY`], for as long as it
/// runs, handing each (when it ran, how late) to `record`. A late wake is
/// not made up for: the next is due a whole period after this one ran.
pub fn sample<F>(runtime: &tokio::runtime::Handle, mut record: F)
where
    F: FnMut(Instant, Duration) + Send + 'static,
{
    runtime.spawn(async move {
        let mut due = Instant::now() + EVERY;
        loop {
            tokio::time::sleep_until(due.into()).await;
            let now = Instant::now();
            record(now, now.saturating_duration_since(due));
            due = now + EVERY;
        }
    });
}

fn histogram() -> &'static prometheus::Histogram {
    static H: OnceLock<prometheus::Histogram> = OnceLock::new();
    H.get_or_init(|| {
        crate::metrics::histogram(
            "strata_runtime_lag_seconds",
            "How late the process's runtime ran a timer that was due (sampled every 100 ms): how long whatever it had to do waited for a thread or a core.",
            &[0.001, 0.005, 0.02, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0],
        )
    })
}

/// Reports the lateness of the current runtime (see the module's doc).
/// Call once per process.
pub fn watch() {
    let h = histogram().clone();
    let warn = crate::warn_every::WarnEvery::new(WARN_EVERY);
    let mut worst = Duration::ZERO;
    sample(&tokio::runtime::Handle::current(), move |at, late| {
        h.observe(late.as_secs_f64());
        if late < WARN_AT {
            return;
        }
        worst = worst.max(late);
        if warn.at(at).is_some() {
            tracing::warn!(
                late_ms = worst.as_millis() as u64,
                "this process ran what was due {:.1} s late: its threads were all busy or it waited for a core",
                worst.as_secs_f64()
            );
            worst = Duration::ZERO;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A runtime whose only thread is held by a task that does not yield
    /// runs the sampler late by as long as it was held.
    #[test]
    fn a_held_thread_shows_as_lateness() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        sample(rt.handle(), move |_, late| {
            s.lock().expect("seen").push(late)
        });
        rt.block_on(async {
            // Let the sampler wake on time a few times, then hold the thread.
            tokio::time::sleep(EVERY * 3).await;
            std::thread::sleep(Duration::from_millis(600));
            tokio::time::sleep(EVERY * 2).await;
        });
        let seen = seen.lock().expect("seen");
        let worst = seen.iter().max().copied().unwrap_or_default();
        assert!(seen.len() >= 3, "{seen:?}");
        assert!(worst >= Duration::from_millis(400), "{seen:?}");
        assert!(seen[0] < Duration::from_millis(100), "{seen:?}");
    }
}
