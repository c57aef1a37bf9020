//! The node daemon.

pub mod acceptance;
pub mod allocation;
pub mod cdi;
mod config;
pub mod daemon;
mod durable;
pub mod executor;
pub mod faults;
pub mod gpu;
mod health;
pub mod identity;
pub mod link;
pub mod mig;
mod outcome;
mod rechecks;
pub mod repartition;

pub mod proto {
    tonic::include_proto!("strata.node.v1");
}
