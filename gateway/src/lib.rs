//! The gateway: joins, mutual-TLS node sessions, node events into the log.

mod admission;
mod api;
pub mod ca;
pub mod catalog;
mod codec;
mod damping;
pub mod dcgm_level;
mod dispatch;
pub mod grants;
pub mod identity;
mod inventory;
mod join;
mod latest;
mod listener;
mod liveness;
mod metrics;
mod renewal;
pub mod revocation;
pub mod roles;
pub mod server;
mod session;
mod state;
mod writer;

pub mod proto {
    tonic::include_proto!("strata.node.v1");
}

/// The client API's messages and service.
pub mod api_proto {
    tonic::include_proto!("strata.api.v1");
}
