//! Asking for a reservation and for its release: the events every client
//! writes (the CLI, the client API on the gateways, tests), with the same
//! checks and the same answers.

pub use crate::error::RequestError;
use crate::pools::pool_exists;
use crate::{reservation_stream, valid_name};
use crate::{Allocation, Fact, Request};
use events::db::Sql;
use events::{AppendError, Appender, ExpectedVersion, SubscribeError, Subscription};
use tokio_postgres::Client;

/// Requests a reservation (`reservation.requested` on its own new stream, with
/// `metadata` such as who asked). It is durable when this returns; a placer
/// holding the pool places it, queues it or declares it unschedulable.
pub async fn reserve(
    client: &Client,
    appender: &Appender,
    request: &Request,
    metadata: Option<&serde_json::Value>,
) -> Result<(), RequestError> {
    request.validate().map_err(RequestError::Invalid)?;
    if request.reservation.contains('~') {
        return Err(RequestError::Invalid(format!(
            "reservation id {:?} may not contain '~' (replacements are named <id>~<n>)",
            request.reservation
        )));
    }
    if request.replaces.is_some() {
        return Err(RequestError::Invalid(
            "only the placer requests replacements".into(),
        ));
    }
    if !pool_exists(client, &request.pool).await? {
        return Err(RequestError::NoSuchPool(request.pool.clone()));
    }
    // Told at once rather than by the placer's rejection: the queue it
    // names must exist, and a pool shared by queues takes none without.
    let mut queues: Vec<String> = client
        .rows(
            "SELECT DISTINCT payload->>'queue' FROM strata.events
              WHERE stream = $1 AND type = 'queue.configured'",
            &[&crate::pool_stream(&request.pool)],
        )
        .await?
        .iter()
        .filter_map(|r| r.get::<_, Option<String>>(0))
        .collect();
    queues.sort();
    match &request.queue {
        Some(q) if !queues.contains(q) => {
            return Err(RequestError::NoSuchQueue {
                pool: request.pool.clone(),
                queue: q.clone(),
            })
        }
        None if !queues.is_empty() => {
            return Err(RequestError::Invalid(format!(
                "pool {} is shared by queues ({}): name one with --queue",
                request.pool,
                queues.join(", ")
            )))
        }
        _ => {}
    }
    // The request's span: its context goes into the event's metadata, and
    // the placer and the binder continue the trace from there.
    let span = tracing::info_span!(
        "reservation.request",
        reservation = %request.reservation,
        pool = %request.pool,
        gpus = request.gpus
    );
    let mut event = Fact::ReservationRequested(request.clone()).to_event();
    if let Some(m) = metadata {
        event = event.with_metadata(m);
    }
    let event = span.in_scope(|| events::trace::traced(event));
    use tracing::Instrument as _;
    match appender
        .append(
            &reservation_stream(&request.reservation),
            ExpectedVersion::NoStream,
            vec![event],
        )
        .instrument(span)
        .await
    {
        Ok(_) => Ok(()),
        Err(AppendError::VersionConflict { .. }) => {
            Err(RequestError::Exists(request.reservation.clone()))
        }
        Err(e) => Err(RequestError::Append(e)),
    }
}

/// Asks for a reservation to be released (or cancelled, if not placed yet).
/// The pool's placer frees its devices in its next batch.
/// Who asked for reservation `id` (the `operator` its request recorded; a
/// replacement `<id>~<n>` belongs to whoever asked for `<id>`): `None` when
/// there is no such reservation, `Some(None)` when no operator asked (it was
/// asked for with database access).
pub async fn owner(
    client: &tokio_postgres::Client,
    id: &str,
) -> Result<Option<Option<String>>, RequestError> {
    let root = id.split('~').next().unwrap_or(id);
    let row = client
        .opt(
            "SELECT metadata->>'operator' FROM strata.events
              WHERE stream = $1 ORDER BY version LIMIT 1",
            &[&reservation_stream(root)],
        )
        .await
        .map_err(RequestError::Database)?;
    Ok(row.map(|r| r.get(0)))
}

/// Whether reservation `id`'s stream has any event in the log (what a view
/// that has not caught up yet tells apart from a name nobody used).
pub async fn recorded(client: &tokio_postgres::Client, id: &str) -> Result<bool, RequestError> {
    let row = client
        .one(
            "SELECT EXISTS (SELECT 1 FROM strata.events WHERE stream = $1)",
            &[&reservation_stream(id)],
        )
        .await
        .map_err(RequestError::Database)?;
    Ok(row.get(0))
}

/// How reservation `id` ended (`released`, `expired`, `rejected` or
/// `failed`, from its `reservation.ended`); `None` while it lives, or when
/// there is no such reservation.
pub async fn outcome(
    client: &tokio_postgres::Client,
    id: &str,
) -> Result<Option<String>, RequestError> {
    let row = client
        .opt(
            "SELECT payload->>'outcome' FROM strata.events
              WHERE stream = $1 AND type = 'reservation.ended'
              ORDER BY version DESC LIMIT 1",
            &[&reservation_stream(id)],
        )
        .await
        .map_err(RequestError::Database)?;
    Ok(row.map(|r| r.get(0)))
}

pub async fn release(
    appender: &Appender,
    id: &str,
    reason: &str,
    metadata: Option<&serde_json::Value>,
) -> Result<(), RequestError> {
    valid_name("reservation id", id).map_err(RequestError::Invalid)?;
    let mut event = Fact::ReservationReleaseRequested {
        reservation: id.to_string(),
        reason: reason.to_string(),
    }
    .to_event();
    if let Some(m) = metadata {
        event = event.with_metadata(m);
    }
    match appender
        .append(
            &reservation_stream(id),
            ExpectedVersion::StreamExists,
            vec![event],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(AppendError::VersionConflict { .. }) => Err(RequestError::NotFound(id.to_string())),
        Err(e) => Err(RequestError::Append(e)),
    }
}

/// How a reservation ended up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Placed(Vec<Allocation>),
    /// A reservation in advance, promised these devices from `start_ms`
    /// (Unix ms) on; it is placed then.
    Promised {
        allocations: Vec<Allocation>,
        start_ms: u64,
        end_ms: u64,
    },
    Rejected(String),
    Released,
    Expired,
    /// A node it was on left, was revoked or was lost (the reason).
    Failed(String),
    /// Preempted to make room for another request (why, by whom, and its
    /// replacement if it asked to be requeued).
    Preempted(String),
}

/// Waits on a subscription (started before the request was made) for the
/// reservation's placement or refusal; `on_queued` hears why it waits.
pub async fn wait(
    sub: &mut Subscription,
    id: &str,
    mut on_queued: impl FnMut(&str),
) -> Result<Outcome, SubscribeError> {
    loop {
        let e = sub.next().await?;
        if !e.stream.starts_with("pool/") || !e.payload.contains(id) {
            continue;
        }
        let Ok(Some(fact)) = Fact::parse(&e.event_type, &e.payload, &e.metadata) else {
            continue;
        };
        if fact.reservation() != Some(id) {
            continue;
        }
        match fact {
            Fact::ReservationPlaced { allocations, .. } => return Ok(Outcome::Placed(allocations)),
            Fact::ReservationPromised {
                allocations,
                start_ms,
                end_ms,
                ..
            } => {
                return Ok(Outcome::Promised {
                    allocations,
                    start_ms: start_ms.unwrap_or_default(),
                    end_ms: end_ms.unwrap_or_default(),
                })
            }
            Fact::ReservationRejected { reason, .. } => return Ok(Outcome::Rejected(reason)),
            Fact::ReservationQueued { reason, .. } => on_queued(&reason),
            Fact::ReservationReleased { .. } => return Ok(Outcome::Released),
            Fact::ReservationExpired { .. } => return Ok(Outcome::Expired),
            Fact::ReservationFailed {
                reason,
                replaced_by,
                ..
            } => {
                return Ok(Outcome::Failed(Fact::failure_reason(
                    &reason,
                    replaced_by.as_deref(),
                )))
            }
            Fact::ReservationPreempted {
                by,
                reason,
                replaced_by,
                ..
            } => {
                return Ok(Outcome::Preempted(Fact::failure_reason(
                    &format!("{reason}, by {by}"),
                    replaced_by.as_deref(),
                )))
            }
            _ => {}
        }
    }
}
