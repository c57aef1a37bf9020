//! Strata's database side: the ordered SQL migrations, monthly partition
//! maintenance of the event table, and private Postgres clusters for
//! `strata dev` (the tests' and benchmarks' helpers around them, PgBouncer
//! among them, are the `testkit` crate's).
//!
//! Everything Strata keeps lives in the `strata` schema. The event table is
//! partitioned by month of `recorded_at`; partitions are created ahead of time
//! by [`partitions::ensure`], which every running service also calls.

pub mod cluster;
pub mod ddl;
pub mod migrate;
pub mod partitions;
pub mod sql;

pub use cluster::{Cluster, ClusterError, ClusterOptions};
pub use migrate::{migrate, Change, Migration, MIGRATIONS};

/// What can go wrong talking to the database about the schema.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database could not be reached or a statement failed.
    #[error("{context}: {source}")]
    Postgres {
        context: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    /// A migration that was already applied has different text now.
    #[error("migration {version} ({name}) was applied with checksum {applied} but the file now has {current}; migrations must never change once applied")]
    ChecksumMismatch {
        version: i32,
        name: String,
        applied: String,
        current: String,
    },
    /// The database has a contracting migration this build knows too
    /// little for.
    #[error("the database has migration {version} ({name}), which contracts the schema: only binaries that know schema {needs} or newer may run against it, and this one knows {known}; upgrade strata")]
    TooNew {
        version: i32,
        name: String,
        needs: i32,
        known: i32,
    },
}

impl Error {
    /// Whether a statement gave up waiting for a lock (`lock_timeout`).
    pub fn is_lock_timeout(&self) -> bool {
        matches!(self, Error::Postgres { source, .. }
            if source.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE))
    }

    /// Whether trying again later may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Postgres { source, .. } => {
                source.is_closed() || source.code().is_none_or(is_transient_code)
            }
            Error::ChecksumMismatch { .. } | Error::TooNew { .. } => false,
        }
    }
}

/// SQLSTATE classes that a retry can cure: connection problems, serialization
/// failures and deadlocks, resource exhaustion, operator intervention.
pub fn is_transient_code(code: &tokio_postgres::error::SqlState) -> bool {
    let c = code.code();
    c.starts_with("08") || c.starts_with("40") || c.starts_with("53") || c.starts_with("57")
}

pub(crate) trait Context<T> {
    fn context(self, context: &'static str) -> Result<T, Error>;
}

impl<T> Context<T> for Result<T, tokio_postgres::Error> {
    fn context(self, context: &'static str) -> Result<T, Error> {
        self.map_err(|source| Error::Postgres { context, source })
    }
}
