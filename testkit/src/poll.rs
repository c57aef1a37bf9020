//! Waiting for a condition in a test, with a deadline: the one poll helper
//! of the workspace. A test waits for what it can observe (a row, a
//! counter, a file), never for a fixed time; a condition not met by the
//! deadline fails the test, saying what was awaited.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is tried again.
const EVERY: Duration = Duration::from_millis(50);

/// Waits up to `secs` seconds for `f` to become true; panics naming `what`
/// when it does not.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(EVERY).await;
    }
    panic!("timed out after {secs}s waiting for: {what}");
}

/// Waits up to `secs` seconds for `f` to give a value, blocking the thread
/// between tries (for tests without a runtime); `None` when it never did.
pub fn wait_for<T>(secs: u64, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(EVERY);
    }
}

/// [`eventually`] for tests without a runtime (the command line's, which
/// drive processes): blocks the thread between tries, and runs `on_timeout`
/// (print the processes' logs, say) before it panics.
pub fn wait_until(secs: u64, what: &str, mut f: impl FnMut() -> bool, on_timeout: impl FnOnce()) {
    if wait_for(secs, || f().then_some(())).is_none() {
        on_timeout();
        panic!("timed out after {secs}s waiting for: {what}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn a_condition_met_later_is_waited_for_and_one_never_met_fails() {
        let tries = AtomicU32::new(0);
        eventually(5, "the third try", || async {
            tries.fetch_add(1, Ordering::Relaxed) >= 2
        })
        .await;
        assert_eq!(tries.load(Ordering::Relaxed), 3);
        let failed = std::panic::catch_unwind(|| wait_until(0, "never", || false, || {}));
        let message = *failed.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("waiting for: never"), "{message}");
    }
}
