//! Strata's batch placer.
//!
//! [`plan`] ranks and packs requests against the pool index (pure, no I/O),
//! asking `fit` where each one fits,
//! and [`backfill`] keeps a waiting request's start from those behind it;
//! `faults` answers GPU faults (quarantine, drain, or withheld by the
//! pool's policy and circuit breaker); [`service`] runs a placer: pool
//! leases, batches, guarded commits;

pub mod backfill;
mod faults;
mod fit;
mod leases;
pub mod plan;
mod promise;
mod rebase;
mod service;
mod stats;

pub use service::{Placer, PlacerConfig, PlacerError};
pub use stats::{Stats, StatsView};
