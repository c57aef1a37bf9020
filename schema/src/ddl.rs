//! DDL on tables in use. A DDL statement that waits for a table's lock
//! behind a reader's open transaction holds up every statement queued
//! behind it, so it waits [`DDL_LOCK_TIMEOUT`] at most (`SET LOCAL
//! lock_timeout`), gives its place in the queue up, and is tried again after
//! a pause ([`LockRetries`]). Migrations and `strata partitions retire`'s
//! detach do so; partition creation bounds its own wait the same way in SQL
//! (migration 11).

use std::time::Duration;

/// The longest one try of a DDL statement waits for a lock.
pub const DDL_LOCK_TIMEOUT: &str = "2s";

/// Tries of a DDL statement that found its table locked, for the caller's
/// retry loop: about a minute and a half at [`LockRetries::DEFAULT_TRIES`].
#[derive(Debug)]
pub struct LockRetries {
    tries: u32,
    limit: u32,
}

impl LockRetries {
    /// Tries before giving up (the pauses grow to 2 s).
    pub const DEFAULT_TRIES: u32 = 30;

    pub fn new(limit: u32) -> LockRetries {
        LockRetries { tries: 0, limit }
    }

    /// After a failed try of `what`: whether to try again (the failure was
    /// a lock timeout and tries are left), having paused and said so.
    pub async fn again(&mut self, lock_timeout: bool, what: &str) -> bool {
        self.tries += 1;
        if !lock_timeout || self.tries >= self.limit {
            return false;
        }
        tracing::warn!(
            tries = self.tries,
            "{what} waited {DDL_LOCK_TIMEOUT} for a lock (a reader's open transaction?); trying again"
        );
        tokio::time::sleep(Duration::from_millis(200 * u64::from(self.tries.min(10)))).await;
        true
    }
}
