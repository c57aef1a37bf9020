//! The gateway: joins, mutual-TLS node sessions, node events into the log.

pub mod admission;
pub mod api;
pub mod ca;
pub mod catalog;
pub mod codec;
pub mod damping;
pub mod dispatch;
pub mod grants;
pub mod identity;
pub mod inventory;
pub mod join;
pub mod latest;
pub mod listener;
pub mod metrics;
pub mod renewal;
pub mod revocation;
pub mod roles;
pub mod server;
pub mod session;
pub mod state;
pub mod writer;

pub mod proto {
    tonic::include_proto!("strata.node.v1");
}

/// The client API's messages and service.
pub mod api_proto {
    tonic::include_proto!("strata.api.v1");
}
