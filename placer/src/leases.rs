//! The placer's pool leases, kept on a thread of their own (with a runtime
//! of its own) and a connection of their own, so that planning, committing
//! or catching up with the log can never delay a renewal: in one task, a
//! busy subscription kept upkeep from running at all, and a loaded placer
//! gave its pools up every few seconds; as a task of the placer's runtime,
//! it could still wait behind a long synchronous stretch of work on the
//! worker that woke it.
//!
//! Every third of the lease's time to live the keeper renews what it holds,
//! keeps its membership lease (`placer/<holder>`, by which placers count each
//! other) and takes or gives back pools until it holds its share of the
//! pools it is told of. It publishes, for each pool held, until when the
//! lease surely holds: the renewal's *send* time plus the time to live, a
//! bound that needs no comparison of clocks, since the database started the
//! time to live after the request was sent. The placer plans a pool only
//! while that bound is more than a quarter of the time to live away.
//!
//! Correctness never rested on the lease (the pool's version fences every
//! batch); the lease keeps two placers from contending for a pool.

use crate::stats::Stats;
use events::db::Sql;
use events::db::{Database, SharedClient};
use events::lease::{Lease, LeaseError};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};

/// Pools held, and until when each lease surely holds.
pub(crate) type Holdings = Arc<HashMap<String, Instant>>;

/// How the keeper runs.
#[derive(Debug, Clone)]
pub(crate) struct KeeperConfig {
    pub(crate) holder: String,
    pub(crate) ttl: Duration,
    /// Hold every pool told of without leases (drills that force two
    /// placers onto one pool).
    pub(crate) unleased: bool,
}

/// The running keeper.
pub(crate) struct Keeper {
    holdings: watch::Receiver<Holdings>,
    pools: watch::Sender<BTreeSet<String>>,
    stop: Option<oneshot::Sender<()>>,
    /// Told when the keeper's thread is done (leases given back).
    done: oneshot::Receiver<()>,
}

impl Keeper {
    /// Starts keeping leases through `db`, on a thread of its own.
    pub(crate) fn start(
        db: Database,
        config: KeeperConfig,
        stats: Arc<Stats>,
    ) -> std::io::Result<Keeper> {
        let (holdings_tx, holdings) = watch::channel(Holdings::default());
        let (pools, pools_rx) = watch::channel(BTreeSet::new());
        let (stop, stop_rx) = oneshot::channel();
        let (done_tx, done) = oneshot::channel();
        ops::task::spawn_apart("placer-leases", move || async move {
            keep(db, config, stats, pools_rx, holdings_tx, stop_rx).await;
            let _ = done_tx.send(());
        })?;
        Ok(Keeper {
            holdings,
            pools,
            stop: Some(stop),
            done,
        })
    }

    /// The pools there are to hold (those created, of this placer's).
    pub(crate) fn want(&self, pools: BTreeSet<String>) {
        self.pools.send_if_modified(|now| {
            let changed = *now != pools;
            *now = pools;
            changed
        });
    }

    /// What is held now; `changed()` on it wakes on every publication.
    pub(crate) fn holdings(&self) -> watch::Receiver<Holdings> {
        self.holdings.clone()
    }

    /// Gives every lease back and ends.
    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.done).await;
    }
}

/// The keeper's loop: upkeep every third of the time to live (and at once
/// when the pools change), each bounded by that third; leases given back
/// when told to stop.
async fn keep(
    db: Database,
    config: KeeperConfig,
    stats: Arc<Stats>,
    mut pools: watch::Receiver<BTreeSet<String>>,
    holdings: watch::Sender<Holdings>,
    mut stop: oneshot::Receiver<()>,
) {
    let client = SharedClient::new(db);
    let member = format!("placer/{}", config.holder);
    let third = (config.ttl / 3).max(Duration::from_millis(50));
    let mut tick = tokio::time::interval(third);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut held: HashMap<String, (Option<Lease>, Instant)> = HashMap::new();
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tick.tick() => {}
            r = pools.changed() => if r.is_err() { break },
        }
        let wanted = pools.borrow_and_update().clone();
        let round = upkeep(&client, &member, &config, &wanted, &mut held, &stats);
        match tokio::time::timeout(third, round).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "lease upkeep failed; retrying"),
            Err(_) => {
                tracing::warn!(
                    limit_ms = third.as_millis() as u64,
                    "lease upkeep got no answer in time; reconnecting"
                );
                client.reset().await;
            }
        }
        // A lease past its bound is gone, whatever the database says later.
        let now = Instant::now();
        held.retain(|_, (_, until)| *until > now);
        let view = held.iter().map(|(p, (_, until))| (p.clone(), *until));
        holdings.send_replace(Arc::new(view.collect()));
    }
    holdings.send_replace(Holdings::default());
    if let Ok(c) = client.get().await {
        for (_, (lease, _)) in held.drain() {
            if let Some(lease) = lease {
                let _ = lease.release(&c).await;
            }
        }
        let _ = c
            .exec(
                "UPDATE strata.leases SET expires_at = now(), renewed_at = now() WHERE name = $1",
                &[&member],
            )
            .await;
    }
}

/// One round: the membership lease, every held lease renewed, then pools
/// taken or given back until this placer holds its share of `wanted`.
async fn upkeep(
    leases: &SharedClient,
    member: &str,
    config: &KeeperConfig,
    wanted: &BTreeSet<String>,
    held: &mut HashMap<String, (Option<Lease>, Instant)>,
    stats: &Stats,
) -> Result<(), LeaseError> {
    if config.unleased {
        let forever = Instant::now() + Duration::from_secs(100 * 365 * 86_400);
        held.retain(|p, _| wanted.contains(p));
        for p in wanted {
            held.entry(p.clone()).or_insert((None, forever));
        }
        return Ok(());
    }
    let client = &*leases.get().await.map_err(db_error)?;
    Lease::acquire(client, member, &config.holder, config.ttl).await?;
    let mut lost = Vec::new();
    for (pool, (lease, until)) in held.iter_mut() {
        let Some(lease) = lease else { continue };
        let sent = Instant::now();
        match lease.renew(client).await {
            Ok(()) => *until = sent + config.ttl,
            Err(LeaseError::Lost { .. }) => lost.push(pool.clone()),
            Err(e) => return Err(e),
        }
    }
    for pool in lost {
        tracing::warn!(pool = %pool, "lost the pool's lease; another placer has it");
        stats.leases_lost.fetch_add(1, Ordering::Relaxed);
        held.remove(&pool);
    }
    // Pools no longer there (or no longer this placer's) are given back.
    let gone: Vec<String> = held
        .keys()
        .filter(|p| !wanted.contains(*p))
        .cloned()
        .collect();
    for pool in gone {
        if let Some((Some(lease), _)) = held.remove(&pool) {
            lease.release(client).await?;
        }
    }
    let live: i64 = client
        .one(
            "SELECT count(*) FROM strata.leases WHERE name LIKE 'placer/%'
                AND strata.lease_until(expires_at, renewed_at) > now()",
            &[],
        )
        .await
        .map_err(db_error)?
        .get(0);
    let share = wanted.len().div_ceil(live.max(1) as usize);
    if held.len() < share {
        let names: Vec<String> = wanted.iter().map(|p| format!("pool/{p}")).collect();
        let taken: BTreeSet<String> = client
            .rows(
                "SELECT name FROM strata.leases WHERE name = ANY($1) AND holder <> $2
                   AND strata.lease_until(expires_at, renewed_at) > now()",
                &[&names, &config.holder],
            )
            .await
            .map_err(db_error)?
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect();
        let mut free: Vec<&String> = wanted
            .iter()
            .filter(|p| !held.contains_key(*p) && !taken.contains(&format!("pool/{p}")))
            .collect();
        fastrand::shuffle(&mut free);
        for pool in free {
            if held.len() >= share {
                break;
            }
            let sent = Instant::now();
            let name = format!("pool/{pool}");
            if let Some(lease) = Lease::acquire(client, &name, &config.holder, config.ttl).await? {
                tracing::info!(pool = %pool, epoch = lease.epoch, "took the pool's lease");
                stats.leases_acquired.fetch_add(1, Ordering::Relaxed);
                held.insert(pool.clone(), (Some(lease), sent + config.ttl));
            }
        }
    } else if held.len() > share {
        let extra: Vec<String> = held.keys().take(held.len() - share).cloned().collect();
        for pool in extra {
            if let Some((Some(lease), _)) = held.remove(&pool) {
                tracing::info!(pool = %pool, "giving the pool's lease back (more placers now)");
                lease.release(client).await?;
            }
        }
    }
    Ok(())
}

fn db_error(e: tokio_postgres::Error) -> LeaseError {
    LeaseError::Database {
        context: "keep pool leases",
        source: e,
    }
}
