//! Strata's batch placer.
//!
//! [`plan`] ranks and packs requests against the pool index (pure, no I/O),
//! asking `fit` where each one fits,
//! and [`backfill`] keeps a waiting request's start from those behind it;
//! [`service`] runs a placer: pool leases, batches, guarded commits;
//! [`client`] is the library side of `strata reserve` and `strata release`.

pub mod backfill;
pub mod client;
mod fit;
pub mod plan;
pub mod service;

pub use service::{Placer, PlacerConfig, PlacerError, Stats, StatsView};
