//! A gateway's own liveness, and what happens to its nodes when it has none.
//!
//! Every gateway holds the lease `gateway/<id>` (judged by the database's
//! clock) and writes the lease's epoch into each session it opens. When
//! the lease lapses (the process died, froze, or lost the database), any
//! other gateway's sweep finds the nodes whose sessions it held
//! (`strata.node_sessions`, kept by the database as node events are
//! appended) and marks each lost: `node.session_expired` on the node's
//! stream at its exact version, with `node.contact_lost` on its pool's, in
//! one transaction. The version fences it both ways: a node that opened a
//! session elsewhere meanwhile is not marked, and the old gateway, should
//! it wake, finds every session it held fenced and writes nothing more for
//! them. A gateway restarted under the same id holds a newer epoch, so the
//! sessions of its previous life are swept too, by itself if need be.
//!
//! A gateway that finds its own lease lost, or cannot renew it for a whole
//! TTL (cut off from the database), ends every session it holds (its nodes
//! move to another gateway, or come back once it holds a lease again),
//! refuses new ones meanwhile, and takes a new epoch.
//!
//! Unless the database itself says it is down (restarting, recovering from
//! a crash, nothing listening): that outage is the same for every gateway,
//! no other could take the nodes over, and ending every session of every
//! gateway at once only made the whole fleet reconnect when the database
//! came back. Time the server is away does not count against a lease
//! (`strata.lease_until`: a lease that ran out meanwhile is held until a
//! TTL after the server is back), so the gateway keeps its sessions,
//! refuses new ones, and renews the same lease once the database answers;
//! for at most [`DOWN_RIDE`] TTLs past the lease's end, and never while the
//! database is silent rather than down (which may be this gateway's link
//! alone).

use crate::state::Shared;
use domain::{pool_stream, Fact};
use events::db::{SharedClient, Sql};
use events::lease::{Lease, LeaseError};
use events::{AppendError, ExpectedVersion, NewEvent, StreamAppend};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::time::Instant;

/// The lease's name for gateway `id`.
pub(crate) fn lease_name(id: &str) -> String {
    format!("gateway/{id}")
}

/// Takes the gateway's lease, starts keeping it (see [`keep_apart`]) and
/// sweeping for the nodes of lapsed gateways; the sweep's task.
pub(crate) async fn start(shared: &Arc<Shared>) -> Result<tokio::task::JoinHandle<()>, String> {
    let asked = Instant::now();
    let lease = acquire(shared, &shared.db).await?;
    keep_apart(shared.clone(), lease, asked)
        .map_err(|e| format!("cannot start the lease's thread: {e}"))?;
    Ok(ops::task::spawn("gateway-orphans", sweep(shared.clone())))
}

/// Keeps the lease on a thread, a runtime and a database connection of its
/// own until the gateway stops: as a task of the gateway's runtime, sharing
/// its connection, a renewal waited behind thousands of TLS handshakes and
/// node events during a ramp, and the lease lapsed while the gateway was
/// merely busy, ending every session it held.
fn keep_apart(shared: Arc<Shared>, lease: Lease, asked: Instant) -> std::io::Result<()> {
    ops::task::spawn_apart("gateway-lease", move || async move {
        let mut stopping = shared.stopping.subscribe();
        tokio::select! {
            _ = keep(shared.clone(), lease, asked) => {}
            _ = stopping.wait_for(|s| *s) => {}
        }
    })?;
    Ok(())
}

/// Takes the gateway's lease through `db`, waiting while another live
/// process holds the same id (at most two TTLs: then that is a
/// configuration error).
pub(crate) async fn acquire(shared: &Shared, db: &SharedClient) -> Result<Lease, String> {
    let ttl = shared.config.lease_ttl;
    let name = lease_name(&shared.config.id);
    let until = Instant::now() + ttl * 2;
    loop {
        let client = db.get().await.map_err(|e| e.to_string())?;
        match Lease::acquire(&client, &name, &shared.config.id, ttl).await {
            Ok(Some(lease)) => {
                shared.lease_epoch.store(lease.epoch, Ordering::Relaxed);
                return Ok(lease);
            }
            Ok(None) if Instant::now() < until => {}
            Ok(None) => {
                return Err(format!(
                "another live gateway holds the id {:?}; give each gateway its own --gateway-id",
                shared.config.id
            ))
            }
            Err(e) => return Err(e.to_string()),
        }
        tokio::time::sleep(ttl / 6).await;
    }
}

/// How many TTLs past its lease's end a gateway keeps its sessions while
/// the database says it is down.
pub(crate) const DOWN_RIDE: u32 = 10;

/// Renews the lease every third of its TTL, each renewal given until the
/// lease's end on this process's clock.
/// When it is found lost, or when no renewal has succeeded for a whole TTL
/// on this process's clock (the database unreachable: a renewal that hangs
/// proves nothing), ends every session this gateway holds, refuses new
/// ones until it holds the lease again, and takes a new epoch; while the
/// database says it is down, it keeps them instead (see the module's doc).
///
/// The lease is held locally until the start of the last renewal that
/// succeeded plus the TTL: the database's expiry is counted from a moment
/// no earlier, so this gateway gives its sessions up no later than any
/// other gateway may mark them lost.
async fn keep(shared: Arc<Shared>, mut lease: Lease, asked: Instant) {
    let db = SharedClient::new(shared.db.config.clone());
    let ttl = shared.config.lease_ttl;
    let every = ttl / 3;
    let mut held_until = asked + ttl;
    // Past the lease's end with the database down: sessions kept, new ones
    // refused.
    let mut riding = false;
    loop {
        tokio::time::sleep(every).await;
        let started = Instant::now();
        // A slow renewal that commits before the lease ends counts: the
        // wait ends only where the lease does (past it, after a third of
        // the TTL).
        let renewed = tokio::time::timeout_at(held_until.max(started + every), renew(&db, &lease))
            .await
            .unwrap_or_else(|_| {
                Err(Renewal::Failed {
                    why: "no answer from the database before the lease's end".to_string(),
                    down: false,
                })
            });
        let why = match renewed {
            Ok(()) => {
                if std::mem::take(&mut riding) {
                    shared.lease_epoch.store(lease.epoch, Ordering::Relaxed);
                    tracing::info!(epoch = lease.epoch, "the database is back and the gateway's lease held over its outage: the sessions carry on");
                }
                held_until = started + ttl;
                continue;
            }
            Err(Renewal::Failed { why, .. }) if Instant::now() < held_until => {
                tracing::warn!(error = %why, "cannot renew the gateway's lease; retrying");
                continue;
            }
            Err(Renewal::Failed { why, down: true })
                if Instant::now() < held_until + ttl * DOWN_RIDE =>
            {
                if !std::mem::replace(&mut riding, true) {
                    shared
                        .stats
                        .database_outages_ridden
                        .fetch_add(1, Ordering::Relaxed);
                    shared.lease_epoch.store(0, Ordering::Relaxed);
                    tracing::warn!(error = %why, "the database is down: keeping this gateway's sessions and refusing new ones until it is back and the lease renewed");
                }
                continue;
            }
            Err(Renewal::Failed { why, .. }) => format!(
                "the gateway's lease lapsed on its own clock: no renewal succeeded for its whole TTL ({why}; frozen, or cut off from the database)"
            ),
            Err(Renewal::Lost) => "the gateway's lease lapsed (frozen, or cut off from the database)".to_string(),
        };
        riding = false;
        shared.stats.lease_lost.fetch_add(1, Ordering::Relaxed);
        shared.lease_epoch.store(0, Ordering::Relaxed);
        tracing::error!(
            id = %shared.config.id,
            epoch = lease.epoch,
            "{why}; its sessions may have been marked lost: ending them all"
        );
        crate::admission::end_sessions(&shared, "this gateway lost its lease; open a new session");
        let asked;
        db.reset().await;
        (lease, asked) = retake(&shared, &db).await;
        held_until = asked + ttl;
    }
}

/// One renewal of `lease` through `db`.
async fn renew(db: &SharedClient, lease: &Lease) -> Result<(), Renewal> {
    let c = db.get().await.map_err(|e| Renewal::Failed {
        down: events::server_down(&e),
        why: format!("no database connection: {e}"),
    })?;
    lease.renew(&c).await.map_err(|e| match e {
        LeaseError::Lost { .. } => Renewal::Lost,
        LeaseError::Database { ref source, .. } => Renewal::Failed {
            down: events::server_down(source),
            why: e.to_string(),
        },
    })
}

/// Why a renewal did not succeed.
enum Renewal {
    Lost,
    /// Not answered, or answered with an error; `down` when the database
    /// said it is down (see [`events::server_down`]).
    Failed {
        why: String,
        down: bool,
    },
}

/// Takes the lease again, as often as it takes; with when the attempt
/// that took it began.
async fn retake(shared: &Shared, db: &SharedClient) -> (Lease, Instant) {
    loop {
        let asked = Instant::now();
        match acquire(shared, db).await {
            Ok(l) => {
                tracing::info!(epoch = l.epoch, "the gateway holds its lease again");
                return (l, asked);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot take the gateway's lease again; retrying");
                tokio::time::sleep(shared.config.lease_ttl / 6).await;
            }
        }
    }
}

/// A node whose session a gateway without a live lease held.
struct Orphan {
    node: String,
    pool: String,
    gateway: String,
    epoch: i64,
    version: i64,
}

/// Nodes in contact whose session's gateway has no live lease of the
/// session's epoch (at most `limit`).
async fn orphans(client: &tokio_postgres::Client, limit: i64) -> Result<Vec<Orphan>, String> {
    let rows = client
        .rows(
            "WITH live AS (
                 -- Judged once per gateway, not once per node.
                 SELECT name, epoch FROM strata.leases
                  WHERE name LIKE 'gateway/%' AND strata.lease_until(expires_at, renewed_at) > now())
             SELECT s.node, s.pool, s.gateway, s.gateway_epoch, st.version
               FROM strata.node_sessions s
               JOIN strata.streams st ON st.stream = 'node/' || s.node
               LEFT JOIN live l ON l.name = 'gateway/' || s.gateway
              WHERE s.in_contact AND (l.name IS NULL OR l.epoch <> s.gateway_epoch)
              LIMIT $1",
            &[&limit],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(rows
        .iter()
        .map(|r| Orphan {
            node: r.get(0),
            pool: r.get(1),
            gateway: r.get(2),
            epoch: r.get(3),
            version: r.get(4),
        })
        .collect())
}

/// Marks one orphan lost, fenced by its node stream's version. `false`
/// when the node moved on first (nothing written).
async fn expire(shared: &Shared, o: &Orphan) -> Result<bool, AppendError> {
    let expired = NewEvent::new(
        crate::catalog::NODE_SESSION_EXPIRED,
        &serde_json::json!({
            "node": o.node,
            "gateway": o.gateway,
            "gateway_epoch": o.epoch,
            "by": shared.config.id,
        }),
    );
    let lost = Fact::NodeContactLost {
        node: o.node.clone(),
    }
    .to_event();
    let appended = shared
        .appender
        .append_batch(vec![
            StreamAppend {
                stream: crate::identity::node_stream(&o.node),
                expected: ExpectedVersion::Exact(o.version as u64),
                events: vec![expired],
            },
            StreamAppend {
                stream: pool_stream(&o.pool),
                expected: ExpectedVersion::StreamExists,
                events: vec![lost],
            },
        ])
        .await;
    match appended {
        Ok(_) => Ok(true),
        Err(AppendError::VersionConflict { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Most orphans marked per round, and at once.
const ROUND: i64 = 5_000;
const AT_ONCE: usize = 256;

/// Every third of the lease's TTL, marks lost the nodes of gateways whose
/// lease lapsed.
pub(crate) async fn sweep(shared: Arc<Shared>) {
    let every = shared.config.lease_ttl / 3;
    loop {
        tokio::time::sleep(every.mul_f64(0.75 + fastrand::f64() / 2.0)).await;
        let found = match shared.db.get().await {
            Ok(c) => orphans(&c, ROUND).await,
            Err(e) => Err(e.to_string()),
        };
        let found = match found {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for the nodes of lapsed gateways; retrying");
                continue;
            }
        };
        for chunk in found.chunks(AT_ONCE) {
            let marked =
                futures_util::future::join_all(chunk.iter().map(|o| expire(&shared, o))).await;
            for (o, r) in chunk.iter().zip(marked) {
                match r {
                    Ok(true) => {
                        shared.stats.orphans_marked.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(node = %o.node, gateway = %o.gateway, "marked a node lost: its gateway's lease lapsed");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(node = %o.node, error = %e, "cannot mark a lapsed gateway's node lost; retrying")
                    }
                }
            }
        }
    }
}
