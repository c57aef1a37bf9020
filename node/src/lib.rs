//! The node daemon.

pub mod cdi;
mod config;
pub mod daemon;
pub mod executor;
pub mod gpu;
mod health;
pub mod identity;

pub mod proto {
    tonic::include_proto!("strata.node.v1");
}
