//! Named tasks: every background task is spawned through [`spawn`] so that a
//! stuck one can be found by name in logs and traces. A task that can fail is
//! supervised by its owner's loop: after a failure it waits [`Backoff`] and
//! starts again, and [`restarted`] makes the failure visible in the log and in
//! `strata_task_restarts_total{task=...}`, so nothing fails silently or stays
//! gone.

use std::future::Future;
use std::time::Duration;
use tracing::Instrument;

/// Spawns `fut` on the current runtime inside a span named after the task.
pub fn spawn<F>(name: &'static str, fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    // A root span: a task outlives whatever request started it (a database
    // connection opened during an RPC), and as a child it would keep that
    // request's span open, and unexported, for as long as it runs.
    tokio::spawn(fut.instrument(tracing::info_span!(parent: None, "task", name)))
}

/// Runs the future `make` builds on a thread named `name` with a runtime
/// of its own (one thread, every driver on), inside a span named after it,
/// so that nothing queued on the caller's runtime can delay it: a lease
/// keeper behind a ramp of TLS handshakes, a bench's receiver behind
/// thousands of simulated daemons. Ends when the future does.
pub fn spawn_apart<M, F>(
    name: &'static str,
    make: M,
) -> std::io::Result<std::thread::JoinHandle<F::Output>>
where
    M: FnOnce() -> F + Send + 'static,
    F: Future,
    F::Output: Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            runtime.block_on(make().instrument(tracing::info_span!(parent: None, "task", name)))
        })
}

/// Delays between attempts: doubling from `min` up to `max`, each drawn at
/// random from its upper half, so a fleet of restarting processes does not
/// come back in lockstep and none waits much less than its step.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    step: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Backoff {
        let min = min.max(Duration::from_millis(1));
        Backoff {
            min,
            max: max.max(min),
            step: min,
        }
    }

    /// The delay before the next attempt; the one after it is longer.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.max);
        let half = step / 2;
        half + half.mul_f64(fastrand::f64())
    }

    /// Starts over from `min` (after an attempt that worked for a while).
    pub fn reset(&mut self) {
        self.step = self.min;
    }
}

/// Records that supervised task `task` failed with `error` and will start
/// again after `delay`: a warning in the log and one more in
/// `strata_task_restarts_total{task}`.
pub fn restarted(task: &'static str, error: &dyn std::fmt::Display, delay: Duration) {
    crate::metrics::task_restarts()
        .with_label_values(&[task])
        .inc();
    tracing::warn!(task, error = %error, delay_ms = delay.as_millis() as u64, "task failed; starting it again");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_starts_over_on_reset() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let steps = [100, 200, 400, 800, 800];
        for ms in steps {
            let d = b.next_delay();
            let step = Duration::from_millis(ms);
            assert!(
                d >= step / 2 && d <= step,
                "{d:?} outside the upper half of {step:?}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn a_restart_is_counted_under_its_task() {
        let before = crate::metrics::task_restarts()
            .with_label_values(&["test-task"])
            .get();
        restarted("test-task", &"boom", Duration::from_millis(1));
        assert_eq!(
            crate::metrics::task_restarts()
                .with_label_values(&["test-task"])
                .get(),
            before + 1
        );
        assert!(crate::metrics::render().contains("strata_task_restarts_total{task=\"test-task\"}"));
    }
}
