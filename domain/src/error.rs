//! How a write is refused or fails: the one error every write of the
//! domain answers with, so the command line and the client API tell a
//! caller the same thing (the API maps each to a gRPC status).

use events::AppendError;

/// Why a write was not made.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("invalid reservation: {0}")]
    Invalid(String),
    #[error("pool {0:?} does not exist (see `strata pools`)")]
    NoSuchPool(String),
    #[error("reservation {0:?} already exists")]
    Exists(String),
    #[error("pool {0:?} already exists")]
    PoolExists(String),
    #[error("reservation {0:?} does not exist")]
    NotFound(String),
    #[error("node {0:?} is in no pool (see `strata pool show --nodes`)")]
    NoSuchNode(String),
    #[error("pool {pool:?} has no queue {queue:?} (see `strata queues list --pool {pool}`)")]
    NoSuchQueue { pool: String, queue: String },
    #[error(
        "queue {queue:?} already exists in pool {pool:?} (change it with `strata queues set`)"
    )]
    QueueExists { pool: String, queue: String },
    /// A change refused for what it asks (the message says why).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Append(#[from] AppendError),
    #[error("read the log: {0}")]
    Database(#[from] tokio_postgres::Error),
}
