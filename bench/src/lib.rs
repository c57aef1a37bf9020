//! Strata's benchmarks. Each scenario starts its own private PostgreSQL,
//! measures a baseline in the same run, reports a ratio against it, prints
//! one final JSON line and writes it under `bench/results/`. A library so
//! that the region drill (`region`) can also run, in a small form, as a
//! test of the `strata` package.

pub mod append;
pub mod audit;
pub mod console;
pub mod gateway;
pub mod hostile;
pub mod lifecycle;
pub mod message_db;
pub mod node_path;
pub mod placements;
pub mod region;
pub mod replay;
pub mod sinks;
pub mod stalls;
pub mod usage;
pub mod util;
mod writers;
