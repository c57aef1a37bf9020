//! The client side of reservations: request, release, and wait for the
//! outcome. `strata reserve` and `strata release` are thin shells over these.

use events::{AppendError, Appender, ExpectedVersion, SubscribeError, Subscription};
use projections::domain::{pool_stream, valid_name};
use projections::requests::{self, RequestError};
use projections::{Allocation, DeviceSpec, Fact, Request};
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("pool {0:?} already exists")]
    PoolExists(String),
    /// Refused or failed as any client's request would be
    /// (`projections::requests`).
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Subscribe(#[from] SubscribeError),
}

impl From<AppendError> for ClientError {
    fn from(e: AppendError) -> Self {
        ClientError::Request(e.into())
    }
}

impl From<tokio_postgres::Error> for ClientError {
    fn from(e: tokio_postgres::Error) -> Self {
        ClientError::Request(e.into())
    }
}

/// A fresh reservation id: time-ordered, with a random tail.
pub fn new_id() -> String {
    projections::domain::new_id("r")
}

/// Whether a pool has been created.
pub async fn pool_exists(client: &Client, pool: &str) -> Result<bool, ClientError> {
    Ok(projections::domain::pool_exists(client, pool).await?)
}

/// Requests a reservation. It is durable when this returns; a placer holding
/// the pool places it, queues it or declares it unschedulable.
pub async fn reserve(
    client: &Client,
    appender: &Appender,
    request: &Request,
) -> Result<(), ClientError> {
    Ok(requests::reserve(client, appender, request, None).await?)
}

/// [`reserve`], recording who asked (`metadata`, such as `{"cli": user}`).
pub async fn reserve_as(
    client: &Client,
    appender: &Appender,
    request: &Request,
    who: &serde_json::Value,
) -> Result<(), ClientError> {
    Ok(requests::reserve(client, appender, request, Some(who)).await?)
}

/// Asks for a reservation to be released (or cancelled, if not placed yet).
/// The pool's placer frees its devices in its next batch.
pub async fn release(appender: &Appender, id: &str, reason: &str) -> Result<(), ClientError> {
    Ok(requests::release(appender, id, reason, None).await?)
}

/// [`release`], recording who asked.
pub async fn release_as(
    appender: &Appender,
    id: &str,
    reason: &str,
    who: &serde_json::Value,
) -> Result<(), ClientError> {
    Ok(requests::release(appender, id, reason, Some(who)).await?)
}

/// How a reservation ended up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Placed(Vec<Allocation>),
    Unschedulable(String),
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
) -> Result<Outcome, ClientError> {
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
            Fact::ReservationUnschedulable { reason, .. } => {
                return Ok(Outcome::Unschedulable(reason))
            }
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

/// Labels nodes of a pool with their rack and block
/// (`node.topology_set`), in chunks.
pub async fn label_nodes(
    appender: &Appender,
    pool: &str,
    labels: Vec<(String, Option<String>, Option<String>)>,
) -> Result<usize, ClientError> {
    let mut done = 0;
    for chunk in labels.chunks(500) {
        let events = chunk
            .iter()
            .map(|(node, rack, block)| {
                Fact::NodeTopologySet {
                    node: node.clone(),
                    rack: rack.clone(),
                    block: block.clone(),
                    rail: None,
                }
                .to_event()
            })
            .collect();
        appender
            .append(&pool_stream(pool), ExpectedVersion::StreamExists, events)
            .await
            .map_err(|e| match e {
                AppendError::VersionConflict { .. } => RequestError::NoSuchPool(pool.to_string()),
                e => RequestError::Append(e),
            })?;
        done += chunk.len();
    }
    Ok(done)
}

/// Creates a pool.
pub async fn create_pool(
    appender: &Appender,
    pool: &str,
    description: &str,
) -> Result<(), ClientError> {
    valid_name("pool", pool).map_err(RequestError::Invalid)?;
    let fact = Fact::PoolCreated {
        description: description.to_string(),
    };
    match appender
        .append(
            &pool_stream(pool),
            ExpectedVersion::NoStream,
            vec![fact.to_event()],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(AppendError::VersionConflict { .. }) => Err(ClientError::PoolExists(pool.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// Nodes joining a pool with their inventory, appended in chunks (each chunk
/// one transaction); `progress` hears the count so far.
pub async fn join_nodes(
    appender: &Appender,
    pool: &str,
    nodes: Vec<(String, Vec<DeviceSpec>)>,
    mut progress: impl FnMut(usize),
) -> Result<usize, ClientError> {
    let mut done = 0;
    for chunk in nodes.chunks(500) {
        let mut events = Vec::with_capacity(chunk.len());
        for (node, devices) in chunk {
            valid_name("node", node).map_err(RequestError::Invalid)?;
            events.push(
                Fact::NodeJoined {
                    node: node.clone(),
                    devices: devices.clone(),
                }
                .to_event(),
            );
        }
        appender
            .append(&pool_stream(pool), ExpectedVersion::StreamExists, events)
            .await
            .map_err(|e| match e {
                AppendError::VersionConflict { .. } => RequestError::NoSuchPool(pool.to_string()),
                e => RequestError::Append(e),
            })?;
        done += chunk.len();
        progress(done);
    }
    Ok(done)
}

/// A uniform fleet for demos, tests and benchmarks: `nodes` nodes named
/// `{prefix}{i}` with `gpus` GPUs of `class`, `per_island` to an NVLink
/// island.
pub fn uniform_fleet(
    prefix: &str,
    nodes: u32,
    class: &str,
    gpus: u32,
    per_island: u32,
) -> Vec<(String, Vec<DeviceSpec>)> {
    (0..nodes)
        .map(|i| {
            let node = format!("{prefix}{i:05}");
            let devices = projections::testing::devices(&node, class, gpus, per_island);
            (node, devices)
        })
        .collect()
}
