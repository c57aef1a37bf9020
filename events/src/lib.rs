//! Strata's event log.
//!
//! ```text
//!  callers --append--> Appender (group commit) --one txn per batch--> strata.events
//!                                                                        |
//!                                                     pgoutput over a logical slot
//!                                                                        v
//!  Subscription <--Arc<Txn>-- Reader (one per process, decodes once) <-- ReplicationConnection
//!       |  catch-up and gap fill read the table by position
//!       +--ack--> strata.subscriptions (durable cursor) --min--> standby status to Postgres
//! ```
//!
//! Positions are handed out under the log head's row lock, held to commit, so
//! they are gap-free (within an epoch: a new PostgreSQL timeline starts a
//! new one, [`EPOCH_SIZE`]) and commit in position order. That makes one order true
//! everywhere: the replication stream, the table read by position, and every
//! subscription's cursor (a [`Position`]).

pub mod append;
mod assemble;
pub mod catalog;
mod cursor;
pub mod db;
pub mod doctor;
mod lag;
pub mod lease;
pub mod metrics;
pub mod pgoutput;
pub mod pgtls;
pub mod read;
mod reader;
pub mod replication;
mod session_error;
pub mod share;
pub mod slots;
mod standby_gate;
mod subscription;
pub mod trace;
pub mod types;

pub use append::{AppendError, Appended, Appender, AppenderConfig, StreamAppend};
pub use assemble::Assembler;
pub use reader::{Reader, ReaderConfig};
pub use subscription::{stored_cursor, Start, SubscribeError, Subscription};
pub use types::{Event, ExpectedVersion, Lsn, NewEvent, Position, Txn, EPOCH_SIZE};

/// Lowercase hex of `bytes` (digests, serials, tokens).
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Whether an error is worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A retry may succeed: the connection dropped, the server is restarting,
    /// a serialization failure or deadlock.
    Transient,
    /// A retry with the same input fails the same way: a version conflict, an
    /// invalid payload, an invalidated slot.
    Definite,
}

/// Whether the server itself said it is down: it is starting up, shutting
/// down or recovering from a crash (SQLSTATE 57P01, 57P02, 57P03), or its
/// host refused the connection (nothing listens on the port). Such an
/// outage is the same for every client, unlike silence, which may be this
/// client's link alone.
pub fn server_down(err: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    if let Some(code) = err.code() {
        return [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
        ]
        .contains(code);
    }
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::ConnectionRefused;
        }
        source = e.source();
    }
    false
}

/// Classifies a Postgres error by SQLSTATE class.
pub fn classify_pg(err: &tokio_postgres::Error) -> ErrorKind {
    if err.is_closed() {
        return ErrorKind::Transient;
    }
    match err.code() {
        None => ErrorKind::Transient,
        Some(code) if schema::is_transient_code(code) => ErrorKind::Transient,
        Some(_) => ErrorKind::Definite,
    }
}
