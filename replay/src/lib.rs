//! Operator replay and audit: projections rebuilt from history at the speed
//! of `COPY` ([`rebuild`]), partition archives ([`archive`]), seals and
//! running checkpoints of monthly partitions ([`seal`]), and the read-only
//! PostgreSQL-protocol endpoint for auditors ([`audit`]), and the log's
//! invariants checked against the tables themselves ([`invariants`]).

pub mod archive;
pub mod audit;
pub mod catalog;
pub mod invariants;
pub mod rebuild;
pub mod seal;
