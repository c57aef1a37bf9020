//! One node's session: the Session service checks the node's certificate,
//! then Hello, Welcome, the inventory sections wanted, heartbeats, status
//! and health reports, command acks and results. The sweeper marks nodes
//! unreachable after three missed heartbeats.
//!
//! Ownership: a session is opened by appending `node.session_opened` to the
//! node's stream at the version the gateway read; the resulting version is
//! the session's epoch. Every later write for the node goes to that stream
//! with the exact version this session last wrote, so once another gateway
//! opens a newer session the older owner's writes are refused (and it closes
//! its session). Heartbeats stay in memory; only transitions
//! (`node.marked_unreachable`, `node.marked_reachable`) and statuses that changed are
//! written. A session the node's side ended (it closed the stream, the
//! connection broke) writes `node.disconnected` with the pool's
//! `node.contact_lost` at once, so nothing new is placed on a node that is
//! gone; its next session restores contact.

use crate::admission::PendingHello;
use crate::ca::{self};
use crate::damping::Verdict;
use crate::dispatch::{command_transition, to_message};
use crate::identity::{self, node_stream};
use crate::proto::{
    gateway_message, node_message, session_server, GatewayMessage, NodeMessage, Welcome,
};
use crate::state::{Outbox, Reply, SessionEntry, Shared, Write};
use domain::commands::{self};
use domain::pool_stream;
use domain::Fact;
use events::db::Sql;
use events::{AppendError, ExpectedVersion, NewEvent};
use futures_util::Stream;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tonic::{Request, Response, Status, Streaming};

pub(crate) struct SessionService {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) type Outbound = Pin<Box<dyn Stream<Item = Result<GatewayMessage, Status>> + Send>>;

#[tonic::async_trait]
impl session_server::Session for SessionService {
    type OpenStream = Outbound;

    async fn open(
        &self,
        req: Request<Streaming<NodeMessage>>,
    ) -> Result<Response<Outbound>, Status> {
        let shared = self.shared.clone();
        let refuse = |s: Status| {
            shared
                .stats
                .refused_identity
                .fetch_add(1, Ordering::Relaxed);
            s
        };
        let certs = req.peer_certs().ok_or_else(|| {
            refuse(Status::unauthenticated(
                "a session needs a node certificate",
            ))
        })?;
        let cert = certs.first().ok_or_else(|| {
            refuse(Status::unauthenticated(
                "a session needs a node certificate",
            ))
        })?;
        let id =
            ca::node_identity(cert.as_ref()).map_err(|e| refuse(Status::unauthenticated(e)))?;
        let permit = shared.admit()?;
        let pending = PendingHello(shared.clone());
        let client = shared
            .db
            .get()
            .await
            .map_err(|e| Status::unavailable(format!("database: {e}")))?;
        let record = identity::lookup(&client, &id.serial)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let record = match record {
            None => {
                return Err(refuse(Status::permission_denied(
                    "this certificate was not issued to a node of this region",
                )))
            }
            Some(r) if r.revoked => {
                return Err(refuse(Status::permission_denied(format!(
                    "the certificate of node {} is revoked",
                    r.node
                ))))
            }
            Some(r) if r.expired => {
                return Err(refuse(Status::permission_denied(
                    "the certificate has expired; join again",
                )))
            }
            Some(r) if r.node != id.node => {
                return Err(refuse(Status::permission_denied(
                    "the certificate's node disagrees with its record",
                )))
            }
            Some(r) => r,
        };
        let presented = crate::renewal::Presented::of(cert.as_ref(), &id.serial)
            .map_err(|e| refuse(Status::unauthenticated(e)))?;
        let (tx, rx) = mpsc::channel(64);
        let tx = Outbox(tx);
        ops::task::spawn(
            "gateway-session",
            session(
                shared,
                (id.node, record.pool, presented),
                req.into_inner(),
                tx,
                permit,
                pending,
            ),
        );
        let out =
            futures_util::stream::unfold(rx, |mut rx: mpsc::Receiver<Box<Reply>>| async move {
                rx.recv().await.map(|m| (*m, rx))
            });
        Ok(Response::new(Box::pin(out)))
    }
}

/// What the node is told when its stream broke: a message that did not
/// decode or was too large is the node's fault, and says so.
pub(crate) fn refusal(status: Status) -> Status {
    match status.code() {
        tonic::Code::Internal | tonic::Code::Unknown => {
            Status::invalid_argument(format!("malformed message: {}", status.message()))
        }
        _ => status,
    }
}

pub(crate) async fn session(
    shared: Arc<Shared>,
    (node, pool, presented): (String, String, crate::renewal::Presented),
    mut inbound: Streaming<NodeMessage>,
    tx: Outbox,
    _permit: OwnedSemaphorePermit,
    pending: PendingHello,
) {
    let Some(hello) = Box::pin(await_hello(&shared, &node, &mut inbound, &tx)).await else {
        return;
    };
    // Take ownership: append at the version read; the new version is the epoch.
    // The long-lived session task stays small: futures that run once (or
    // now and then) are boxed instead of living in its state machine.
    let epoch = match Box::pin(opened(&shared, &node, &pool, &hello, &tx)).await {
        Some(Ok(e)) => e,
        None => return,
        Some(Err(e)) => {
            tracing::warn!(%node, error = %e, "could not open the session");
            let _ = tx
                .send(Err(Status::unavailable(format!("open the session: {e}"))))
                .await;
            return;
        }
    };
    let want = match Box::pin(wanted_sections(&shared, &node, &hello.section_hashes)).await {
        Ok(w) => w,
        Err(e) => {
            let _ = tx
                .send(Err(Status::unavailable(format!("database: {e}"))))
                .await;
            return;
        }
    };
    drop(hello);
    let dcgm_level = match Box::pin(pool_dcgm_level(&shared, &pool)).await {
        Ok(l) => l,
        Err(e) => {
            let _ = tx
                .send(Err(Status::unavailable(format!("database: {e}"))))
                .await;
            return;
        }
    };
    // Welcomed from here on: no longer counted as pending.
    drop(pending);
    shared.welcomes.welcomed();
    register(&shared, &node, &pool, epoch, &tx);
    shared.stats.sessions_opened.fetch_add(1, Ordering::Relaxed);
    let welcome = GatewayMessage {
        body: Some(gateway_message::Body::Welcome(Welcome {
            epoch,
            heartbeat_seconds: shared.config.heartbeat.as_secs().max(1) as u32,
            want_sections: want,
            dcgm_level,
        })),
    };
    if tx.send(Ok(welcome)).await.is_err() {
        return;
    }
    // Commands issued while the node was away.
    if !Box::pin(send_open_commands(&shared, &node, &tx)).await {
        return;
    }
    tracing::debug!(%node, epoch, "session open");
    // Inventory and health messages each cost a write; a node sending more
    // than its share is ended rather than let it crowd out the rest.
    let rate = shared.config.node_messages_per_second.max(0.1);
    let mut budget = crate::bucket::Bucket {
        tokens: rate * 10.0,
        last: Instant::now(),
    };
    let mut renewed = false;
    // Whether the node's side ended (it closed the stream, or the
    // connection broke), as opposed to this gateway ending the session.
    let mut node_went = false;
    loop {
        let msg = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => {
                node_went = true;
                break;
            }
            Err(status) => {
                tracing::debug!(%node, %status, "session stream ended with an error");
                let _ = tx.send(Err(refusal(status))).await;
                node_went = true;
                break;
            }
        };
        hearing(&shared, &node, epoch, true);
        if let Some(node_message::Body::Renew(r)) = &msg.body {
            let reply = Box::pin(renewal_reply(
                &shared, &node, &pool, &presented, &r.csr_pem, renewed,
            ))
            .await;
            renewed |= reply.0;
            hearing(&shared, &node, epoch, false);
            if tx.send(Ok(reply.1)).await.is_err() {
                break;
            }
            continue;
        }
        if matches!(
            msg.body,
            Some(node_message::Body::Inventory(_) | node_message::Body::Health(_))
        ) && !budget.take(rate, rate * 10.0)
        {
            shared
                .stats
                .refused_messages
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%node, "a node sent inventory and health faster than its limit; ending its session");
            let _ = tx
                .send(Err(Status::resource_exhausted(format!(
                    "more than {rate} inventory and health messages a second (bursts of {}); send changes only",
                    rate * 10.0
                ))))
                .await;
            break;
        }
        let handled = Box::pin(handle(&shared, &node, &pool, epoch, msg)).await;
        hearing(&shared, &node, epoch, false);
        if let Err(status) = handled {
            let _ = tx.send(Err(status)).await;
            break;
        }
    }
    closed(&shared, &node, &pool, epoch, node_went).await;
}

/// The node was just heard (a message read from it), and the session's
/// loop now handles that message (`handling`) or reads again: either way
/// the node's silence counts from now, and not while the loop is not
/// reading. Before, a result that waited on a backed-up writer kept the
/// loop from reading the node's heartbeats, and the sweeper marked a live
/// node unreachable (hundreds of them while a killed gateway's nodes
/// re-homed in the 10,000-node drill).
fn hearing(shared: &Shared, node: &str, epoch: u64, handling: bool) {
    let mut sessions = shared.sessions.lock().expect("sessions lock");
    if let Some(s) = sessions.get_mut(node) {
        if s.epoch == epoch {
            s.heard = crate::state::Heard::now(&shared.clock);
            s.handling = handling;
        }
    }
}

/// A session ended: forgotten once the sweeper is done with it, and, when
/// the node's side ended it, its pool told at once that contact is lost.
async fn closed(shared: &Shared, node: &str, pool: &str, epoch: u64, node_went: bool) {
    let current = {
        let mut sessions = shared.sessions.lock().expect("sessions lock");
        let current = match sessions.get_mut(node) {
            Some(s) if s.epoch == epoch => {
                s.closed = true;
                // Its pool hears below that contact is lost: the sweeper
                // must not say it again when the heartbeats stay away.
                if node_went {
                    s.reachable = false;
                }
                true
            }
            _ => false,
        };
        shared.stats.sessions.store(
            sessions.values().filter(|s| !s.closed).count() as u64,
            Ordering::Relaxed,
        );
        current
    };
    // A node whose connection is gone takes no new placements until it is
    // back: its pool hears at once that contact is lost (the node itself is
    // marked unreachable only after missed heartbeats). Fenced by the
    // session, like every write of it: if the node has opened a newer
    // session anywhere, this is not written.
    if node_went && current {
        shared
            .session_write(
                node,
                NewEvent::new(
                    crate::catalog::NODE_DISCONNECTED,
                    &serde_json::json!({ "node": node, "gateway": shared.config.id }),
                ),
                vec![(
                    pool_stream(pool),
                    Fact::NodeContactLost {
                        node: node.to_string(),
                    }
                    .to_event(),
                )],
            )
            .await;
    }
}

/// The session's first message, which must be a Hello naming the node its
/// certificate names; `None` (the node told why) otherwise.
async fn await_hello(
    shared: &Shared,
    node: &str,
    inbound: &mut Streaming<NodeMessage>,
    tx: &Outbox,
) -> Option<crate::proto::Hello> {
    let first = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await;
    let hello = match first {
        Ok(Ok(Some(NodeMessage {
            body: Some(node_message::Body::Hello(h)),
        }))) => h,
        Ok(Err(status)) => {
            tracing::debug!(%node, %status, "session ended before its Hello");
            let _ = tx.send(Err(refusal(status))).await;
            return None;
        }
        _ => {
            let _ = tx
                .send(Err(Status::invalid_argument(
                    "the first message of a session must be Hello",
                )))
                .await;
            return None;
        }
    };
    if hello.node_id != node {
        shared
            .stats
            .refused_identity
            .fetch_add(1, Ordering::Relaxed);
        let _ = tx
            .send(Err(Status::permission_denied(format!(
                "this session's certificate names node {node:?}; it may not speak for {:?}",
                hello.node_id
            ))))
            .await;
        return None;
    }
    Some(hello)
}

/// Records the open session as this gateway's for `node`, at `epoch`.
fn register(shared: &Shared, node: &str, pool: &str, epoch: u64, tx: &Outbox) {
    let mut sessions = shared.sessions.lock().expect("sessions lock");
    sessions.insert(
        node.to_string(),
        SessionEntry {
            pool: pool.to_string(),
            epoch,
            version: epoch,
            heard: crate::state::Heard::now(&shared.clock),
            handling: false,
            reachable: true,
            status: None,
            closed: false,
            tx: tx.clone(),
            health: Default::default(),
        },
    );
    shared.stats.sessions.store(
        sessions.values().filter(|s| !s.closed).count() as u64,
        Ordering::Relaxed,
    );
}

/// Sends the node the commands issued while it was away, oldest deadline
/// first; whether the session is still there.
async fn send_open_commands(shared: &Shared, node: &str, tx: &Outbox) -> bool {
    let pending: Vec<GatewayMessage> = {
        let cmds = shared.commands.lock().expect("commands lock");
        cmds.open_for(node)
            .into_iter()
            .map(|t| to_message(&t.command))
            .collect()
    };
    for m in pending {
        if tx.send(Ok(m)).await.is_err() {
            return false;
        }
    }
    true
}

/// The answer to a node's request to renew its certificate (once per
/// session), and whether it was renewed.
async fn renewal_reply(
    shared: &Shared,
    node: &str,
    pool: &str,
    presented: &crate::renewal::Presented,
    csr_pem: &str,
    renewed: bool,
) -> (bool, GatewayMessage) {
    let answer = if renewed {
        Err(Status::failed_precondition(
            "this session renewed its certificate already",
        ))
    } else {
        crate::renewal::renew(shared, node, pool, presented, csr_pem).await
    };
    let ok = answer.is_ok();
    let (certificate_pem, error) = match answer {
        Ok(pem) => (pem, String::new()),
        Err(s) => (String::new(), s.message().to_string()),
    };
    let reply = GatewayMessage {
        body: Some(gateway_message::Body::Renewed(crate::proto::Renewed {
            certificate_pem,
            error,
        })),
    };
    (ok, reply)
}

/// The session opened for `hello` ([`open_session`]), or `None` where the
/// node gave up waiting first: a Hello nobody waits for any more is not
/// finished (on a busy gateway, finishing it would only add the work of
/// closing it again to the queue that made the node give up).
async fn opened(
    shared: &Shared,
    node: &str,
    pool: &str,
    hello: &crate::proto::Hello,
    tx: &Outbox,
) -> Option<Result<u64, AppendError>> {
    let gave_up = || {
        shared
            .stats
            .hellos_abandoned
            .fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%node, "the node gave up waiting for its Welcome; not opening its session");
    };
    if tx.0.is_closed() {
        gave_up();
        return None;
    }
    let mut open = std::pin::pin!(open_session(shared, node, pool, hello, tx));
    tokio::select! {
        r = &mut open => return Some(r),
        _ = tx.0.closed() => gave_up(),
    }
    // The writer leaves the open out unless it was already on its way; one
    // that committed anyway is a session like any other, which the node's
    // closed stream then ends.
    match open.await {
        Ok(epoch) => Some(Ok(epoch)),
        Err(_) => None,
    }
}

pub(crate) async fn open_session(
    shared: &Shared,
    node: &str,
    pool: &str,
    hello: &crate::proto::Hello,
    outbox: &Outbox,
) -> Result<u64, AppendError> {
    let stream = node_stream(node);
    for _ in 0..5 {
        let client = shared
            .db
            .get()
            .await
            .map_err(|e| AppendError::OutcomeUnknown(e.to_string()))?;
        let version: i64 = client
            .opt(
                "SELECT version FROM strata.streams WHERE stream = $1",
                &[&stream],
            )
            .await
            .map_err(|e| AppendError::OutcomeUnknown(e.to_string()))?
            .map_or(0, |r| r.get(0));
        // A node the region lost contact with is back: its pool hears it in
        // the same transaction that opens the session.
        let lost: bool = client
            .opt(
                "SELECT type FROM strata.events WHERE stream = $1
                    AND type IN ('node.marked_unreachable', 'node.disconnected', 'node.marked_reachable',
                                 'node.session_opened', 'node.unreachable', 'node.reachable',
                                 'node.session_expired')
                  ORDER BY version DESC LIMIT 1",
                &[&stream],
            )
            .await
            .map_err(|e| AppendError::OutcomeUnknown(e.to_string()))?
            .is_some_and(|r| {
                matches!(
                    r.get::<_, String>(0).as_str(),
                    crate::catalog::NODE_MARKED_UNREACHABLE
                        | crate::catalog::NODE_DISCONNECTED
                        | crate::catalog::NODE_SESSION_EXPIRED
                        | "node.unreachable"
                )
            });
        let also = if lost {
            vec![(
                pool_stream(pool),
                Fact::NodeContactRestored {
                    node: node.to_string(),
                }
                .to_event(),
            )]
        } else {
            Vec::new()
        };
        let event = NewEvent::new(
            crate::catalog::NODE_SESSION_OPENED,
            &serde_json::json!({
                "node": node,
                "gateway": shared.config.id,
                "generation": hello.generation,
                "agent_version": hello.agent_version,
                "pool": pool,
                "gateway_epoch": shared.lease_epoch.load(Ordering::Relaxed),
            }),
        );
        match shared
            .write(Write {
                also,
                client: Some(outbox.clone()),
                ..Write::plain(
                    stream.clone(),
                    ExpectedVersion::Exact(version as u64),
                    vec![event],
                )
            })
            .await
        {
            Ok(v) => return Ok(v),
            Err(AppendError::VersionConflict { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(AppendError::Invalid(
        "the node's stream kept moving while opening its session".into(),
    ))
}

/// The pool's DCGM level, told in the Welcome.
async fn pool_dcgm_level(shared: &Shared, pool: &str) -> Result<Option<u32>, String> {
    let client = shared.db.get().await.map_err(|e| e.to_string())?;
    crate::dcgm_level::level(&client, pool)
        .await
        .map_err(|e| e.to_string())
}

pub(crate) async fn wanted_sections(
    shared: &Shared,
    node: &str,
    offered: &HashMap<String, String>,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let client = shared.db.get().await?;
    let known: HashMap<String, String> = client
        .rows(
            "SELECT section, hash FROM strata.node_sections WHERE node = $1",
            &[&node],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut want: Vec<String> = offered
        .iter()
        .filter(|(name, hash)| known.get(*name) != Some(*hash))
        .map(|(name, _)| name.clone())
        .collect();
    want.sort();
    Ok(want)
}

pub(crate) async fn handle(
    shared: &Arc<Shared>,
    node: &str,
    pool: &str,
    epoch: u64,
    msg: NodeMessage,
) -> Result<(), Status> {
    let Some(body) = msg.body else {
        return Err(Status::invalid_argument("an empty message"));
    };
    match body {
        node_message::Body::Hello(_) => {
            return Err(Status::invalid_argument("Hello is sent once, first"));
        }
        node_message::Body::Renew(_) => {
            // Answered in the session's loop, which knows the certificate.
        }
        node_message::Body::Heartbeat(_) => heartbeat(shared, node, pool, epoch).await?,
        node_message::Body::Status(s) => status(shared, node, epoch, s).await?,
        node_message::Body::Inventory(section) => inventory(shared, node, pool, section).await?,
        node_message::Body::Health(h) => health(shared, node, pool, epoch, h).await?,
        node_message::Body::Ack(a) => crate::acks::acked(shared, node, &a.command_id)?,
        node_message::Body::Result(r) => {
            let output: serde_json::Value =
                serde_json::from_str(&r.output_json).unwrap_or(serde_json::Value::Null);
            let t = if r.ok {
                commands::SUCCEEDED
            } else {
                commands::FAILED
            };
            let payload = serde_json::json!({
                "id": r.command_id, "node": node, "detail": r.detail, "output": output,
                "gateway": shared.config.id,
            });
            shared.acks.settle(&r.command_id);
            let read = Instant::now();
            command_transition(
                shared,
                node,
                &r.command_id,
                (t, payload),
                crate::dispatch::RECORD_PATIENCE,
            )
            .await?;
            recorded_result(node, &r.command_id, read.elapsed());
        }
    }
    Ok(())
}

/// A node's result was recorded `took` after its session read it:
/// measured, and warned about when it took a second or more (with the
/// command, so a slow command's trip can be followed through the logs).
fn recorded_result(node: &str, command: &str, took: Duration) {
    crate::metrics::command_result_seconds().observe(took.as_secs_f64());
    if took >= Duration::from_secs(1) {
        tracing::warn!(%node, %command, took_ms = took.as_millis() as u64, "a command's result was recorded {:.1} s after its node's session read it", took.as_secs_f64());
    }
}

/// A heartbeat: the session is alive, and its node reachable again if it
/// was marked otherwise.
async fn heartbeat(shared: &Arc<Shared>, node: &str, pool: &str, epoch: u64) -> Result<(), Status> {
    let became_reachable = {
        let mut sessions = shared.sessions.lock().expect("sessions lock");
        match sessions.get_mut(node) {
            // Heard already: the session's loop records every message
            // it reads (`hearing`).
            Some(s) if s.epoch == epoch => !std::mem::replace(&mut s.reachable, true),
            _ => {
                return Err(Status::aborted(
                    "a newer session for this node replaced this one",
                ))
            }
        }
    };
    if became_reachable {
        shared.stats.transitions.fetch_add(1, Ordering::Relaxed);
        shared
            .session_write(
                node,
                NewEvent::new(
                    crate::catalog::NODE_MARKED_REACHABLE,
                    &serde_json::json!({ "node": node }),
                ),
                vec![(
                    pool_stream(pool),
                    Fact::NodeContactRestored {
                        node: node.to_string(),
                    }
                    .to_event(),
                )],
            )
            .await;
    }
    Ok(())
}

/// The node's own status, written when it changed.
async fn status(
    shared: &Arc<Shared>,
    node: &str,
    epoch: u64,
    s: crate::proto::StatusReport,
) -> Result<(), Status> {
    let changed = {
        let mut sessions = shared.sessions.lock().expect("sessions lock");
        match sessions.get_mut(node) {
            Some(e) if e.epoch == epoch => {
                let new = Some((s.state.clone(), s.detail.clone()));
                if e.status != new {
                    e.status = new;
                    true
                } else {
                    false
                }
            }
            _ => false,
        }
    };
    if changed {
        shared
            .session_write(
                node,
                NewEvent::new(
                    crate::catalog::NODE_STATUS_REPORTED,
                    &serde_json::json!({ "node": node, "state": s.state, "detail": s.detail }),
                ),
                Vec::new(),
            )
            .await;
    }
    Ok(())
}

/// A section of the node's inventory, as a fact on its pool's stream.
async fn inventory(
    shared: &Arc<Shared>,
    node: &str,
    pool: &str,
    section: crate::proto::InventorySection,
) -> Result<(), Status> {
    let (name, hash) = (section.name.clone(), section.hash.clone());
    let facts = crate::inventory::section_facts(node, section)?;
    // Queued here, in the order the sections came (the devices
    // before the labels of a node new to the pool); the outcome is
    // waited for apart, so the session goes on. A section's facts (the
    // devices and their acceptance check) commit together.
    let outcome = shared
        .submit(Write::plain(
            pool_stream(pool),
            ExpectedVersion::StreamExists,
            facts.iter().map(Fact::to_event).collect(),
        ))
        .await;
    let (shared, node) = (shared.clone(), node.to_string());
    tokio::spawn(async move {
        match outcome.await {
            Ok(_) if name == crate::inventory::ACCEPTANCE => {}
            Ok(_) => {
                if let Ok(c) = shared.db.get().await {
                    let _ = c
                        .exec(
                            "INSERT INTO strata.node_sections (node, section, hash) VALUES ($1, $2, $3)
                             ON CONFLICT (node, section) DO UPDATE SET hash = $3, updated_at = now()",
                            &[&node, &name, &hash],
                        )
                        .await;
                }
            }
            Err(AppendError::Closed) => {}
            Err(e) => {
                // Not recorded as seen: the node offers the section again
                // on its next session, and it is written once the log
                // takes it (a GPU's other claimant has left the pool).
                shared
                    .stats
                    .refused_inventory
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%node, error = %e, "the log refused the node's inventory")
            }
        }
    });
    Ok(())
}

/// A health condition raised or cleared, coalesced and damped per session.
async fn health(
    shared: &Arc<Shared>,
    node: &str,
    pool: &str,
    epoch: u64,
    h: crate::proto::HealthReport,
) -> Result<(), Status> {
    // Coalesced and damped per session: a flapping node does not
    // move the pool's version (every placement's fence) ten times a
    // second.
    let verdict = {
        let mut sessions = shared.sessions.lock().expect("sessions lock");
        match sessions.get_mut(node) {
            Some(s) if s.epoch == epoch => {
                let key = (h.device.clone(), h.condition.clone());
                if h.cleared {
                    s.health.clear(key, Instant::now())
                } else {
                    s.health.raise(key)
                }
            }
            _ => {
                return Err(Status::aborted(
                    "a newer session for this node replaced this one",
                ))
            }
        }
    };
    if verdict != Verdict::Write {
        shared
            .stats
            .health_coalesced
            .fetch_add(1, Ordering::Relaxed);
        return Ok(());
    }
    let device = (!h.device.is_empty()).then_some(h.device);
    let fact = if h.cleared {
        Fact::HealthCleared {
            node: node.to_string(),
            device,
            condition: h.condition,
        }
    } else {
        // Classified where the control plane reads it, so the fault
        // catalog can change without touching the nodes.
        let class = domain::faults::classify(&h.condition);
        Fact::HealthRaised {
            node: node.to_string(),
            device,
            condition: h.condition,
            detail: h.detail,
            severity: Some(class.severity),
            action: Some(class.action),
        }
    };
    // Waits for room in the write queue: a node that reports faster
    // than the log takes it is held back, never dropped.
    shared
        .queue(Write::plain(
            pool_stream(pool),
            ExpectedVersion::StreamExists,
            vec![fact.to_event()],
        ))
        .await;
    Ok(())
}

/// Marks nodes unreachable after three missed heartbeats and forgets closed
/// sessions once that is written.
pub(crate) async fn sweeper(shared: Arc<Shared>) {
    let period = (shared.config.heartbeat / 2).max(Duration::from_millis(100));
    loop {
        // On the gateway's clock, as the heartbeats it weighs.
        shared.clock.sleep(period).await;
        let limit = shared.config.heartbeat * 3;
        let mut lost = Vec::new();
        let mut clears: Vec<(String, String, crate::damping::Key)> = Vec::new();
        {
            let now = Instant::now();
            let mut sessions = shared.sessions.lock().expect("sessions lock");
            sessions.retain(|node, s| {
                if s.reachable && s.heard.silent(limit, &shared.clock, s.handling) {
                    s.reachable = false;
                    lost.push((node.clone(), s.pool.clone(), s.epoch, s.version));
                }
                let keep = !s.closed || s.reachable;
                // Clears whose hold-down is over, and, for a session going
                // away, every clear it still held back.
                let due = if keep {
                    s.health.due(now)
                } else {
                    s.health.drain_pending()
                };
                clears.extend(due.into_iter().map(|k| (node.clone(), s.pool.clone(), k)));
                keep
            });
        }
        for (node, pool, (device, condition)) in clears {
            let fact = Fact::HealthCleared {
                node,
                device: (!device.is_empty()).then_some(device),
                condition,
            };
            shared
                .queue(Write::plain(
                    pool_stream(&pool),
                    ExpectedVersion::StreamExists,
                    vec![fact.to_event()],
                ))
                .await;
        }
        for (node, pool, epoch, version) in lost {
            shared.stats.transitions.fetch_add(1, Ordering::Relaxed);
            // The pool hears it in the same transaction, fenced by the same
            // session: a gateway whose session was replaced cannot mark the
            // node lost.
            let contact = Fact::NodeContactLost { node: node.clone() }.to_event();
            shared
                .queue(Write {
                    stream: node_stream(&node),
                    session: Some((node.clone(), epoch)),
                    expected: ExpectedVersion::Exact(version),
                    events: vec![NewEvent::new(
                        crate::catalog::NODE_MARKED_UNREACHABLE,
                        &serde_json::json!({ "node": node }),
                    )],
                    also: vec![(pool_stream(&pool), contact)],
                    done: None,
                    client: None,
                })
                .await;
        }
    }
}
