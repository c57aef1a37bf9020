//! One module per command group: its clap types beside the code that runs
//! it. `main.rs` only parses and dispatches; shared flags and helpers are in
//! `cli`.

pub(crate) mod audit;
pub(crate) mod ca;
pub(crate) mod commands;
pub(crate) mod console;
pub(crate) mod dev;
pub(crate) mod doctor;
pub(crate) mod events;
pub(crate) mod grants;
pub(crate) mod mig;
pub(crate) mod migrate;
pub(crate) mod node;
pub(crate) mod nodes;
pub(crate) mod partitions;
pub(crate) mod pools;
pub(crate) mod queues;
pub(crate) mod replay;
pub(crate) mod reservations;
pub(crate) mod reserve;
pub(crate) mod roles;
pub(crate) mod serve;
pub(crate) mod sinks;
pub(crate) mod slots;
pub(crate) mod tokens;
pub(crate) mod usage;
