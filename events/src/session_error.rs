//! Why a replication reader's session ended, and the deadline every one of
//! its statements runs under: shared by the reader and its standby gate.

use crate::replication::ReplicationError;
use crate::ErrorKind;
use std::time::Duration;

/// Why a replication session ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionError {
    #[error(transparent)]
    Replication(#[from] ReplicationError),
    #[error("{context}: {source}")]
    Sql {
        context: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error(transparent)]
    Share(#[from] crate::share::FollowError),
    #[error("{context}: no answer from the database within {limit:?}")]
    Timeout {
        context: &'static str,
        limit: Duration,
    },
}

impl SessionError {
    pub(crate) fn kind(&self) -> ErrorKind {
        match self {
            SessionError::Replication(e) => e.kind(),
            SessionError::Sql { source, .. } => crate::classify_pg(source),
            SessionError::Timeout { .. } => ErrorKind::Transient,
            // The sharer restarts, or another takes its socket.
            SessionError::Share(_) => ErrorKind::Transient,
        }
    }

    /// The database did not answer in time (a statement, or the connect of
    /// the replication connection): the shared connection may hang too.
    pub(crate) fn is_timeout(&self) -> bool {
        match self {
            SessionError::Timeout { .. } => true,
            SessionError::Replication(ReplicationError::Io { source, .. }) => {
                source.kind() == std::io::ErrorKind::TimedOut
            }
            _ => false,
        }
    }
}

pub(crate) fn sql(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> SessionError {
    move |source| SessionError::Sql { context, source }
}

/// One of the reader's statements, given at most `limit`.
pub(crate) async fn bounded<T>(
    limit: Duration,
    context: &'static str,
    f: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, SessionError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(sql(context)),
        Err(_) => Err(SessionError::Timeout { context, limit }),
    }
}
