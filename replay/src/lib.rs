//! Operator replay: projections rebuilt from history at the speed
//! of `COPY` ([`rebuild`]), partition archives ([`archive`]), seals and
//! running checkpoints of monthly partitions ([`seal`]), and the log's
//! invariants checked against the tables themselves ([`invariants`]). The
//! endpoint auditors query is the `audit` crate.

pub mod archive;
pub mod invariants;
pub mod rebuild;
pub mod seal;
