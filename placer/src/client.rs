//! The client side of reservations: request, release, and wait for the
//! outcome. `strata reserve` and `strata release` are thin shells over these.

use events::{AppendError, Appender, ExpectedVersion, SubscribeError, Subscription};
use projections::domain::{pool_stream, reservation_stream, valid_name};
use projections::{Allocation, Fact, Request};
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid reservation: {0}")]
    Invalid(String),
    #[error("pool {0:?} does not exist (see `strata pools`)")]
    NoSuchPool(String),
    #[error("reservation {0:?} already exists")]
    Exists(String),
    #[error("reservation {0:?} does not exist")]
    NotFound(String),
    #[error(transparent)]
    Append(#[from] AppendError),
    #[error("read the log: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Subscribe(#[from] SubscribeError),
}

/// A fresh reservation id: time-ordered, with a random tail.
pub fn new_id() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("r-{ms:x}-{:06x}", fastrand::u32(..1 << 24))
}

/// Whether a pool has been created.
pub async fn pool_exists(client: &Client, pool: &str) -> Result<bool, ClientError> {
    let row = client
        .query_opt(
            "SELECT 1 FROM strata.events WHERE stream = $1 AND version = 1 AND type = 'PoolCreated'",
            &[&pool_stream(pool)],
        )
        .await?;
    Ok(row.is_some())
}

/// Requests a reservation. It is durable when this returns; a placer holding
/// the pool places it, queues it or declares it unschedulable.
pub async fn reserve(
    client: &Client,
    appender: &Appender,
    request: &Request,
) -> Result<(), ClientError> {
    request.validate().map_err(ClientError::Invalid)?;
    if !pool_exists(client, &request.pool).await? {
        return Err(ClientError::NoSuchPool(request.pool.clone()));
    }
    let fact = Fact::ReservationRequested(request.clone());
    match appender
        .append(
            &reservation_stream(&request.reservation),
            ExpectedVersion::NoStream,
            vec![fact.to_event()],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(AppendError::VersionConflict { .. }) => {
            Err(ClientError::Exists(request.reservation.clone()))
        }
        Err(e) => Err(e.into()),
    }
}

/// Asks for a reservation to be released (or cancelled, if not placed yet).
/// The pool's placer frees its devices in its next batch.
pub async fn release(appender: &Appender, id: &str, reason: &str) -> Result<(), ClientError> {
    valid_name("reservation id", id).map_err(ClientError::Invalid)?;
    let fact = Fact::ReleaseRequested {
        reservation: id.to_string(),
        reason: reason.to_string(),
    };
    match appender
        .append(
            &reservation_stream(id),
            ExpectedVersion::StreamExists,
            vec![fact.to_event()],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(AppendError::VersionConflict { .. }) => Err(ClientError::NotFound(id.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// How a reservation ended up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Placed(Vec<Allocation>),
    Unschedulable(String),
    Released,
    Expired,
}

/// Waits on a subscription (started before the request was made) for the
/// reservation's placement or refusal; `on_queued` hears why it waits.
pub async fn wait(
    sub: &mut Subscription,
    id: &str,
    mut on_queued: impl FnMut(&str),
) -> Result<Outcome, ClientError> {
    loop {
        let e = sub.next().await?;
        if !e.stream.starts_with("pool/") || !e.payload.contains(id) {
            continue;
        }
        let Ok(Some(fact)) = Fact::parse(&e.event_type, &e.payload) else {
            continue;
        };
        if fact.reservation() != Some(id) {
            continue;
        }
        match fact {
            Fact::ReservationPlaced { allocations, .. } => return Ok(Outcome::Placed(allocations)),
            Fact::ReservationUnschedulable { reason, .. } => {
                return Ok(Outcome::Unschedulable(reason))
            }
            Fact::ReservationQueued { reason, .. } => on_queued(&reason),
            Fact::ReservationReleased { .. } => return Ok(Outcome::Released),
            Fact::ReservationExpired { .. } => return Ok(Outcome::Expired),
            _ => {}
        }
    }
}
