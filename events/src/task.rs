//! Named tasks: every background task is spawned through [`spawn`] so that a
//! stuck one can be found by name in logs and traces.

use std::future::Future;
use tracing::Instrument;

/// Spawns `fut` on the current runtime inside a span named after the task.
pub fn spawn<F>(name: &'static str, fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(fut.instrument(tracing::info_span!("task", name)))
}
