//! Usage, exact from the log: the GPU time each reservation held, by pool,
//! queue, owner, class and node, in hourly, daily and monthly rollups.
//!
//! - `fold.rs` (pure): reservations' lives from their events, and their time
//!   split into buckets.
//! - `store.rs`: the tables the rollups live in (`strata.usage_*`).
//! - `keeper.rs`: the `usage` role, which keeps the tables from a durable
//!   subscription, the tables and its cursor in one transaction.
//! - `report.rs`: reports over a period, from the rollups and the open
//!   reservations, at the billing weights in force.
//! - `verify.rs`: the rollups checked against a fold of the raw log.

pub mod fold;
pub mod keeper;
pub mod report;
pub mod store;
pub mod verify;

pub use fold::{Fold, Open, Period};
pub use report::{By, Query, Report};

/// Whole Unix milliseconds of a time (before 1970: 0).
pub fn unix_ms(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
