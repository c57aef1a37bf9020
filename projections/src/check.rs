//! The placement invariants, verified by replaying the log:
//!
//! 1. no device is booked by two live allocations;
//! 2. every placement used devices that existed, were of the requested
//!    class, in service (not quarantined, no fault waiting), on a schedulable
//!    node and free when it was placed, in the requested shape;
//! 3. every reservation follows its life: requested once, then queued,
//!    placed or unschedulable, then active, released or expired, and is now
//!    either pending or live or has reached a terminal state.

use crate::index::{Index, Phase, Violation};
use crate::projector::{catch_up, ProjectError};
use tokio_postgres::Client;

/// What the check saw.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    /// The last position checked.
    pub position: u64,
    pub events: u64,
    pub pools: usize,
    pub nodes: usize,
    pub devices: usize,
    pub booked_devices: usize,
    pub pending: usize,
    pub live: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("invariant violated at {0}")]
    Violation(Violation),
    #[error("inconsistent bookings after position {position}: {message}")]
    Bookings { position: u64, message: String },
    #[error(transparent)]
    Read(#[from] ProjectError),
}

/// Replays the whole durable log and stops at the first violation.
pub async fn check(client: &Client, progress: impl FnMut(u64)) -> Result<Report, CheckError> {
    let mut index = Index::new();
    let mut first = None;
    let events = catch_up(
        client,
        &mut index,
        |v| {
            first = Some(v.clone());
            false
        },
        progress,
    )
    .await?;
    if let Some(v) = first {
        return Err(CheckError::Violation(v));
    }
    verify(&index).map(|mut r| {
        r.events = events;
        r
    })
}

/// Checks the end state of an index and summarizes it.
pub fn verify(index: &Index) -> Result<Report, CheckError> {
    index
        .check_bookings()
        .map_err(|message| CheckError::Bookings {
            position: index.position(),
            message,
        })?;
    let s = index.state();
    let mut r = Report {
        position: index.position(),
        pools: s.pools.len(),
        ..Report::default()
    };
    for p in s.pools.values() {
        r.nodes += p.nodes.len();
        for n in p.nodes.values() {
            r.devices += n.devices.len();
            r.booked_devices += n.devices.iter().filter(|d| d.booked_by.is_some()).count();
        }
    }
    for res in s.reservations.values() {
        match res.phase {
            Phase::Pending | Phase::Queued => r.pending += 1,
            Phase::Placed | Phase::Active => r.live += 1,
        }
    }
    Ok(r)
}
