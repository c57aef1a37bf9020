//! Projections: state folded from the event stream.
//!
//! [`index::Index`] is the pool index and reservation view the placer plans
//! against. It applies events strictly in position order, each once (the
//! applied position is part of its state), can be saved as an rkyv
//! [`snapshot`] and resumed from one plus the events after it.
//! [`check`] replays the log and verifies the placement invariants.
//! [`decay`] is the past usage that fair share remembers; [`spent`] the
//! GPU time queues booked in the current day, week and month, which
//! [`budget`] judges requests by.
//! [`usage`] folds the GPU time reservations held into rollup tables. It
//! appends nothing: every write to the log is `domain`'s.

pub mod budget;
pub mod check;
pub mod decay;
pub mod hashing;
pub mod index;
pub mod projector;
pub mod quota;
pub mod snapshot;
pub mod spent;
pub mod tally;
pub mod testing;
mod tiers;
pub mod usage;
pub mod views;
pub mod waiting;

pub use index::{ApplyError, Index, Phase, State, Violation};
pub use projector::Projector;
pub use snapshot::SnapshotStore;
pub use views::{NodesView, Projection, ReservationsView};
