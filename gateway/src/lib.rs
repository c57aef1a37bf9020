//! The gateway: joins, mutual-TLS node sessions, node events into the log.

pub mod ca;
pub mod identity;
pub mod server;

pub mod proto {
    tonic::include_proto!("strata.node.v1");
}
