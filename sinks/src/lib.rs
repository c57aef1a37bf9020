//! Sinks: consumers outside the region receive its events.
//!
//! [`config`] keeps sink definitions as events; [`runner`] is the `sinks`
//! role; [`webhook`] delivers signed batches; [`parked`] keeps what could not
//! be delivered and delivers it again on request.

pub mod catalog;
pub mod config;
pub mod credentials;
mod metrics;
pub mod nats;
pub mod parked;
mod runner;
pub mod webhook;

pub use config::{Filter, SinkConfig, SinkState, Target};
pub use runner::{Sinks, SinksConfig};
