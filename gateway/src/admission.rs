//! Who may open a session now: a token bucket for new sessions, a cap on
//! open sessions and on sessions waiting for their Hello. Every refusal is
//! `RESOURCE_EXHAUSTED` with a jittered `retry-after-ms` in its metadata,
//! which daemons obey.

use crate::state::Shared;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;
use tonic::Status;

pub(crate) fn pushback(reason: &str, base_ms: u32) -> Status {
    // Full jitter around the base: [base/2, 3*base/2).
    let ms = base_ms / 2 + fastrand::u32(0..base_ms.max(1));
    let mut s = Status::resource_exhausted(format!("{reason}; retry in {ms} ms"));
    if let Ok(v) = ms.to_string().parse() {
        s.metadata_mut().insert("retry-after-ms", v);
    }
    s
}

impl Shared {
    pub(crate) fn admit(&self) -> Result<OwnedSemaphorePermit, Status> {
        let rate = self.config.handshakes_per_second.max(0.001);
        if !self
            .bucket
            .lock()
            .expect("bucket lock")
            .take(rate, rate.max(1.0))
        {
            self.stats.refused_rate.fetch_add(1, Ordering::Relaxed);
            return Err(pushback("too many new sessions per second", 1000));
        }
        let permit = self.streams.clone().try_acquire_owned().map_err(|_| {
            self.stats.refused_full.fetch_add(1, Ordering::Relaxed);
            pushback("this gateway holds its maximum of sessions", 5000)
        })?;
        let pending = self.pending_hellos.fetch_add(1, Ordering::AcqRel);
        if pending >= self.config.max_pending_hellos {
            self.pending_hellos.fetch_sub(1, Ordering::AcqRel);
            self.stats.refused_pending.fetch_add(1, Ordering::Relaxed);
            return Err(pushback("too many sessions waiting for their Hello", 1000));
        }
        Ok(permit)
    }
}

/// Counts a session as waiting for its Hello until dropped.
pub(crate) struct PendingHello(pub(crate) Arc<Shared>);

impl Drop for PendingHello {
    fn drop(&mut self) {
        self.0.pending_hellos.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Shared {
    /// A token from the joins' own bucket (`joins_per_second`), or a
    /// `RESOURCE_EXHAUSTED` pushback the daemon waits out.
    pub(crate) fn admit_join(&self) -> Result<(), Status> {
        let rate = self.config.joins_per_second.max(0.001);
        if !self
            .join_bucket
            .lock()
            .expect("join bucket lock")
            .take(rate, rate.max(1.0))
        {
            self.stats.refused_joins.fetch_add(1, Ordering::Relaxed);
            return Err(pushback("too many joins per second", 1000));
        }
        Ok(())
    }
}

/// Ends every session `shared` holds with `why` and a short pushback: their
/// nodes open new sessions (elsewhere, or here again).
pub(crate) fn end_sessions(shared: &crate::state::Shared, why: &str) {
    let sessions: Vec<_> = shared
        .sessions
        .lock()
        .expect("sessions lock")
        .drain()
        .map(|(_, s)| s.tx)
        .collect();
    for tx in sessions {
        let _ = tx.try_send(Err(pushback(why, 200)));
    }
}
