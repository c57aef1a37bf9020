//! Strata's domain: what pools, nodes, reservations, queues and commands
//! are, and how each change to them is written.
//!
//! - [`fact`] declares every fact once (its variant, event type, old names,
//!   stream, payload and reference entry); `payload.rs` holds their payload
//!   versions.
//! - [`types`] holds the value types facts carry (a request, a device, a
//!   queue's spec, an allocation) and the streams and ids they live on.
//! - One module per kind of write, each the one function that the command
//!   line, the client API and Strata's own roles call, with the same checks
//!   and answers: [`requests`] (a reservation asked for and released),
//!   [`standing`] (cordon, drain, leave, clear a condition, topology),
//!   [`queues`] (a queue configured), [`commands`] (a command to a node
//!   and its transitions) and [`usage`] (billing weights).
//!
//! [`calendar`] is where UTC hours, days, weeks and months begin.
//!
//! `error.rs` holds `RequestError`, the one answer every write gives when
//! it is refused or fails. It folds nothing: the state folded from these facts is `projections`'.

pub mod calendar;
pub mod commands;
pub mod demand;
mod error;
pub mod fact;
pub mod faults;
mod payload;
pub mod pools;
pub mod queues;
pub mod requests;
pub mod standing;
pub mod types;
pub mod usage;

pub use fact::{canonical_type, stored_types, Fact, FACT_TYPES, LEGACY_FACT_TYPES};
pub use types::*;
