//! A subscription's cursor: what its consumer acknowledged, what is
//! stored, its lease and its lag, shared by the subscription, the task that
//! stores it, the reader that knows which names this process holds, and
//! the scrape.

use crate::lease::Lease;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

/// The state of one open subscription that outlives a call.
pub(crate) struct Cursor {
    pub(crate) acked: AtomicU64,
    pub(crate) durable: Arc<AtomicU64>,
    pub(crate) notify: Notify,
    /// Set when the subscription is dropped: store once more, then stop.
    pub(crate) closed: std::sync::atomic::AtomicBool,
    /// What `/metrics` reads of it.
    pub(crate) lag: crate::lag::Lag,
    /// A named subscription is held by one process at a time.
    pub(crate) lease: Option<Lease>,
    /// Set when the lease could not be renewed.
    pub(crate) lost: std::sync::atomic::AtomicBool,
}

impl crate::lag::Watched for Cursor {
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    fn lag(&self) -> &crate::lag::Lag {
        &self.lag
    }

    fn acked(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }
}
