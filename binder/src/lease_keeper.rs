//! The binder's lease, renewed on a thread of its own (with a runtime and a
//! database connection of its own), so that binding work (catching up with
//! the log, issuing commands, waiting for appends) can never delay a
//! renewal. In one loop with that work, a renewal waited behind it: in a
//! 10,000-node power cycle the active binder lost its lease three times,
//! stopping and catching up again each time.
//!
//! Every third of the time to live the keeper renews the lease, each
//! renewal bounded by that third; the first renewal that fails or does not
//! answer in time ends the keeper and tells the binder why, so that it stops
//! acting before the lease can run out. Correctness never rested on the
//! lease (every activation is fenced by its reservation's version); the
//! lease keeps two binders from doing the same work.

use crate::BinderError;
use events::lease::Lease;
use std::time::Duration;
use tokio::sync::oneshot;

/// A running keeper; dropping it stops the renewals.
pub(crate) struct LeaseKeeper {
    lost: oneshot::Receiver<BinderError>,
    _stop: oneshot::Sender<()>,
}

impl LeaseKeeper {
    /// Renews `lease` through `db` every third of its time to live, on a
    /// thread of its own.
    pub(crate) fn start(db: events::db::Database, lease: Lease) -> std::io::Result<LeaseKeeper> {
        let (lost_tx, lost) = oneshot::channel();
        let (stop, stop_rx) = oneshot::channel();
        ops::task::spawn_apart("binder-lease", move || async move {
            if let Err(e) = keep(db, lease, stop_rx).await {
                let _ = lost_tx.send(e);
            }
        })?;
        Ok(LeaseKeeper { lost, _stop: stop })
    }

    /// Why the lease is lost, once it is.
    pub(crate) async fn lost(&mut self) -> BinderError {
        match (&mut self.lost).await {
            Ok(e) => e,
            // The keeper's thread ended without a word (it panicked): the
            // lease is not being renewed.
            Err(_) => BinderError::Keeper("it ended without renewing".into()),
        }
    }
}

/// Renews until told to stop (`Ok`) or the lease is lost (`Err`).
async fn keep(
    db: events::db::Database,
    lease: Lease,
    mut stop: oneshot::Receiver<()>,
) -> Result<(), BinderError> {
    let client = events::db::connect(&db, "binder-lease-keeper").await?;
    let third = (lease.ttl / 3).max(Duration::from_millis(50));
    let mut tick = tokio::time::interval(third);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(()),
            _ = tick.tick() => {}
        }
        match tokio::time::timeout(third, lease.renew(&client)).await {
            Ok(r) => r?,
            Err(_) => return Err(BinderError::Stalled(third)),
        }
    }
}
