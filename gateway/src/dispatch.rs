//! Commands from the log to the sessions holding their nodes: the
//! dispatcher follows command events (and reservation outcomes, for API
//! callers waiting on them), pushes new commands to the node's session and
//! ends revoked nodes' sessions. Overdue commands are expired apart
//! (`expiry.rs`), so that expiring never holds up delivering.

use crate::proto::{gateway_message, GatewayMessage};
use crate::state::{Shared, Waited};
use domain::commands::{self, CommandState};
use domain::Fact;
use events::{AppendError, ErrorKind};
use ops::task::Backoff;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Status;

pub(crate) fn to_message(c: &commands::Command) -> GatewayMessage {
    GatewayMessage {
        body: Some(gateway_message::Body::Command(crate::proto::Command {
            id: c.id.clone(),
            kind: c.kind.clone(),
            args_json: c.args.to_string(),
            deadline_unix_ms: c.deadline_ms as i64,
        })),
    }
}

/// How long a command's next state is tried again after the database
/// failed to record it (restarting, a connection lost), before the
/// session that reported it is ended (its node sends the result again on
/// its next session).
pub(crate) const RECORD_PATIENCE: Duration = Duration::from_secs(60);

/// Moves a command of `node` to its next state, at the version the gateway
/// knows; a command of another node is refused, one that is already
/// terminal (a result sent again after a reconnect) is left alone. A
/// database that fails to record it is tried again, with backoff, for up
/// to `patience` ([`RECORD_PATIENCE`] for a node's result: a restarting
/// database does not end the session of every node that reports a result
/// meanwhile).
pub(crate) async fn command_transition(
    shared: &Shared,
    node: &str,
    id: &str,
    (event_type, payload): (&str, serde_json::Value),
    patience: Duration,
) -> Result<(), Status> {
    let target = CommandState::from_event_type(event_type).expect("a command event");
    let give_up = Instant::now() + patience;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut conflicts = 0;
    loop {
        let version = match reported(shared, node, id)? {
            None => return Ok(()),
            Some((state, _)) if state.is_terminal() || state == target => return Ok(()),
            Some((_, version)) => version,
        };
        match commands::transition(&shared.appender, id, version, event_type, &payload).await {
            Ok(v) => {
                let mut cmds = shared.commands.lock().expect("commands lock");
                cmds.wrote(id, v, target, &payload);
                if target.is_terminal() {
                    shared
                        .stats
                        .commands_finished
                        .fetch_add(1, Ordering::Relaxed);
                }
                return Ok(());
            }
            Err(AppendError::VersionConflict { actual, .. }) => {
                conflicts += 1;
                if conflicts == 3 {
                    return Err(Status::unavailable("the command's state kept moving"));
                }
                // Another write landed first (an expiry, another gateway,
                // this one's own write whose outcome was not known): wait
                // for the subscription to catch up, then look again.
                let deadline = Instant::now() + Duration::from_secs(2);
                while Instant::now() < deadline {
                    let seen = shared
                        .commands
                        .lock()
                        .expect("commands lock")
                        .get(id)
                        .is_none_or(|t| t.version >= actual);
                    if seen {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            Err(e) if e.kind() == ErrorKind::Transient && Instant::now() < give_up => {
                shared.stats.write_retries.fetch_add(1, Ordering::Relaxed);
                let delay = backoff.next_delay();
                match shared.record_retries.now() {
                    Some(held) => {
                        tracing::warn!(%node, command = %id, error = %e, delay_ms = delay.as_millis() as u64, also_retried = held, "could not record a command's state; trying again ({held} more tries since the last warning)")
                    }
                    None => {
                        tracing::debug!(%node, command = %id, error = %e, delay_ms = delay.as_millis() as u64, "could not record a command's state; trying again")
                    }
                }
                tokio::time::sleep(delay).await;
            }
            Err(e) => {
                return Err(Status::unavailable(format!(
                    "record the command's state: {e}"
                )))
            }
        }
    }
}

/// The state and version of command `id` as this gateway knows it, for a
/// report from `node`: none if the gateway does not know the command
/// (finished, or not yet seen), refused if another node runs it.
pub(crate) fn reported(
    shared: &Shared,
    node: &str,
    id: &str,
) -> Result<Option<(CommandState, u64)>, Status> {
    let cmds = shared.commands.lock().expect("commands lock");
    match cmds.get(id) {
        None => {
            tracing::debug!(%node, command = %id, "a report for a command this gateway does not know (finished, or not yet seen)");
            Ok(None)
        }
        Some(t) if t.command.node != node => {
            shared
                .stats
                .refused_identity
                .fetch_add(1, Ordering::Relaxed);
            Err(Status::permission_denied(format!(
                "command {id} is for node {}, not {node}",
                t.command.node
            )))
        }
        Some(t) => Ok(Some((t.state, t.version))),
    }
}

/// Follows command events: tracks their state, pushes new ones to the node's
/// session if this gateway holds it, and expires overdue ones.
///
/// Supervised: when its subscription fails, it subscribes again after a
/// backoff, reloads the open commands from the table and pushes them again
/// to the sessions it holds (a node runs a command id at most once, so a
/// command pushed twice is acked and not run again).
pub(crate) async fn dispatcher(shared: Arc<Shared>, mut sub: events::Subscription) {
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));
    loop {
        let started = Instant::now();
        let mut error = follow(&shared, &mut sub).await;
        if started.elapsed() > Duration::from_secs(30) {
            backoff.reset();
        }
        loop {
            let delay = backoff.next_delay();
            ops::task::restarted("gateway-commands", &error, delay);
            tokio::time::sleep(delay).await;
            match resubscribe(&shared).await {
                Ok(s) => {
                    sub = s;
                    break;
                }
                Err(e) => error = e,
            }
        }
    }
}

/// A new subscription from now, then the open commands from the table (an
/// event seen twice is applied once), pushed again to the sessions held.
async fn resubscribe(shared: &Shared) -> Result<events::Subscription, String> {
    let sub = shared
        .reader
        .subscribe_ephemeral_as("gateway-dispatch", events::Start::Now)
        .await
        .map_err(|e| format!("subscribe to commands: {e}"))?;
    let client = shared
        .db
        .get()
        .await
        .map_err(|e| format!("connect to postgres: {e}"))?;
    let open = commands::open(&client)
        .await
        .map_err(|e| format!("read the open commands: {e}"))?;
    let mut push = Vec::new();
    {
        let mut cmds = shared.commands.lock().expect("commands lock");
        for t in open {
            push.push(t.command.clone());
            // Taken where it is newer than what the subscription brought.
            cmds.insert(t);
        }
    }
    let sessions = shared.sessions.lock().expect("sessions lock");
    for c in push {
        if let Some(s) = sessions.get(&c.node).filter(|s| !s.closed) {
            if s.tx.try_send(Ok(to_message(&c))).is_err() {
                shared.stats.command_drops.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(sub)
}

/// Follows the subscription until it fails; the failure.
async fn follow(shared: &Arc<Shared>, sub: &mut events::Subscription) -> String {
    loop {
        let e = sub.next().await;
        let e = match e {
            Ok(e) => e,
            Err(err) => {
                tracing::error!(error = %err, "the gateway's command subscription failed");
                return format!("follow commands: {err}");
            }
        };
        sub.ack(e.position);
        if e.event_type == crate::catalog::NODE_REVOKED {
            // A revoked node's live session ends now, not at its
            // next reconnect.
            if let Some(node) = e.stream.strip_prefix("node/") {
                let gone = shared.sessions.lock().expect("sessions lock").remove(node);
                if let Some(s) = gone {
                    shared
                        .stats
                        .refused_identity
                        .fetch_add(1, Ordering::Relaxed);
                    let _ = s.tx.try_send(Err(Status::permission_denied(format!(
                        "the certificate of node {node} is revoked"
                    ))));
                    tracing::info!(%node, "ended the session of a revoked node");
                }
            }
            continue;
        }
        // Only reservation facts are parsed: a node's inventory, the
        // bulk of a pool's stream, never answers a waiting client.
        if e.stream.starts_with("pool/")
            && domain::canonical_type(&e.event_type).starts_with("reservation.")
        {
            let fact = Fact::parse(&e.event_type, &e.payload, &e.metadata)
                .ok()
                .flatten();
            // Placed, or how it ended: the states a waiting client hears.
            let state = fact.as_ref().and_then(|f| match f {
                Fact::ReservationPlaced { .. } => Some("placed"),
                Fact::ReservationPromised { .. } => Some("promised"),
                f => f.outcome(),
            });
            if let (Some(state), Some(fact)) = (state, fact) {
                if let Some(id) = fact.reservation() {
                    let (reason, allocations) = match &fact {
                        Fact::ReservationPlaced { allocations, .. } => {
                            (String::new(), allocations.clone())
                        }
                        Fact::ReservationPromised {
                            allocations,
                            start_ms,
                            ..
                        } => (
                            format!(
                                "promised from {}",
                                humantime::format_rfc3339_seconds(
                                    std::time::UNIX_EPOCH
                                        + std::time::Duration::from_millis(
                                            start_ms.unwrap_or_default()
                                        )
                                )
                            ),
                            allocations.clone(),
                        ),
                        Fact::ReservationRejected { reason, .. } => (reason.clone(), Vec::new()),
                        Fact::ReservationFailed {
                            reason,
                            replaced_by,
                            ..
                        } => (
                            Fact::failure_reason(reason, replaced_by.as_deref()),
                            Vec::new(),
                        ),
                        Fact::ReservationPreempted {
                            by,
                            reason,
                            replaced_by,
                            ..
                        } => (
                            Fact::failure_reason(
                                &format!("{reason}, by {by}"),
                                replaced_by.as_deref(),
                            ),
                            Vec::new(),
                        ),
                        _ => (String::new(), Vec::new()),
                    };
                    shared.notify(&format!("r:{id}"), || Waited::Reservation {
                        state: state.to_string(),
                        reason: reason.clone(),
                        allocations: allocations.clone(),
                    });
                }
            }
            continue;
        }
        if !e.stream.starts_with("command/") {
            continue;
        }
        let push = {
            let mut cmds = shared.commands.lock().expect("commands lock");
            let changed = cmds.apply(&e);
            let id = e.stream.trim_start_matches("command/");
            let push = (changed.is_some() && e.event_type == commands::ISSUED)
                .then(|| cmds.get(id).map(|t| t.command.clone()))
                .flatten();
            // Terminal commands are no longer needed here.
            if cmds.get(id).is_some_and(|t| t.state.is_terminal()) {
                if let Some(t) = cmds.remove(id) {
                    shared.notify(&format!("c:{id}"), || Waited::Command(t.clone()));
                }
            }
            push
        };
        if let Some(c) = push {
            let tx = shared
                .sessions
                .lock()
                .expect("sessions lock")
                .get(&c.node)
                .filter(|s| !s.closed)
                .map(|s| s.tx.clone());
            if let Some(tx) = tx {
                if tx.try_send(Ok(to_message(&c))).is_ok() {
                    shared
                        .stats
                        .commands_dispatched
                        .fetch_add(1, Ordering::Relaxed);
                    let took = std::time::SystemTime::now()
                        .duration_since(e.recorded_at)
                        .unwrap_or_default();
                    crate::metrics::command_dispatch_seconds().observe(took.as_secs_f64());
                    if took >= Duration::from_secs(1) {
                        tracing::warn!(node = %c.node, command = %c.id, took_ms = took.as_millis() as u64, "a command was sent to its node's session {:.1} s after it was recorded", took.as_secs_f64());
                    }
                } else {
                    shared.stats.command_drops.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(node = %c.node, command = %c.id, "the session's queue is full; the command is sent again when the node reconnects");
                }
            }
        }
    }
}
