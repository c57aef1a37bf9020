//! The gateway: joins, mutual-TLS node sessions, node events into the log.

mod acks;
mod admission;
mod api;
mod bucket;
pub mod ca;
pub mod catalog;
mod codec;
mod damping;
pub mod dcgm_level;
mod deadline;
mod dispatch;
mod expiry;
pub mod grants;
mod handshakes;
mod held_acks;
pub mod identity;
pub mod inventory;
mod join;
mod join_limits;
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
mod subscriptions;
pub mod usage;
pub mod welcome_rate;
mod writer;

pub mod proto {
    tonic::include_proto!("strata.node.v1");
}

/// The client API's messages and service.
pub mod api_proto {
    tonic::include_proto!("strata.api.v1");
}
