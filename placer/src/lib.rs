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
pub mod plan;
mod service;

pub use service::{Placer, PlacerConfig, PlacerError, Stats, StatsView};
