//! Strata's batch placer.
//!
//! [`plan`] ranks and packs requests against the pool index (pure, no I/O);
//! [`service`] runs a placer: pool leases, batches, guarded commits;
//! [`client`] is the library side of `strata reserve` and `strata release`.

pub mod binder;
pub mod client;
pub mod plan;
pub mod service;

pub use service::{Placer, PlacerConfig, PlacerError, Stats, StatsView};
