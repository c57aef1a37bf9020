//! The placer service: holds pool leases, takes each held pool's waiting
//! reservations in batches, plans them against its live index and commits
//! each batch with the pool stream's expected version.
//!
//! Pool leases are kept by a task of their own (`leases`), which publishes
//! what is held. One task does the rest, in this order of priority: commit
//! results, changes of the leases held, events from the subscription
//! (applied to the index). After each wake it plans every held pool that is
//! ready: no commit of its own in
//! flight, and the index has applied the pool up to the version of its last
//! commit (so a plan never misses the placer's own bookings). While a batch
//! commits, requests pile up for the next one: batches grow with load and
//! stay at one request when idle.
//!
//! Correctness does not rest on the lease: two placers planning the same pool
//! (or one with a stale index) both commit against the pool stream's version,
//! so one of them gets a version conflict, waits for its index to reach the
//! winner's version and plans again against it. The lease only keeps that
//! from happening in the normal case, and spreads pools over placers. A
//! conflict caused only by reports about nodes the batch does not name is
//! committed again on top of them instead (`rebase`).

use crate::leases::{Holdings, Keeper, KeeperConfig};
use crate::plan::{self, Plan};
use crate::stats::{placers, Stats};
use domain::{pool_stream, replacement_id, reservation_stream, Fact, Request};
use events::db::SharedClient;
use events::lease::LeaseError;
use events::{AppendError, Appended, Appender, ExpectedVersion, Reader, StreamAppend};
use futures_util::stream::{FuturesUnordered, StreamExt};
use ops::task::Backoff;
use projections::projector::ProjectError;
use projections::{Index, Projector, SnapshotStore};
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;

/// How a placer runs.
#[derive(Debug, Clone)]
pub struct PlacerConfig {
    /// This placer's name in leases (unique per process).
    pub holder: String,
    /// Most reservations planned in one batch.
    pub max_batch: usize,
    /// Time to live of pool leases; a dead placer's pools move after this.
    pub lease_ttl: Duration,
    /// Only these pools (all pools when `None`).
    pub pools: Option<BTreeSet<String>>,
    /// Plan every pool without taking leases (drills and tests that force two
    /// placers onto one pool).
    pub unleased: bool,
    /// Where index snapshots are kept, if anywhere.
    pub snapshots: Option<SnapshotStore>,
    pub snapshot_every: Duration,
    /// How long a node may stay out of contact (`node.contact_lost`) before
    /// the live reservations on it fail (`reservation.failed`, `node_lost`).
    /// Reservations on a node that left or was revoked fail at once.
    pub node_lost_after: Duration,
    /// How long a reservation being preempted keeps its devices after it
    /// is told (`reservation.preemption_scheduled`), before it ends.
    pub preemption_grace: Duration,
}

impl PlacerConfig {
    pub fn new(holder: impl Into<String>) -> PlacerConfig {
        PlacerConfig {
            holder: holder.into(),
            max_batch: 1024,
            lease_ttl: Duration::from_secs(5),
            pools: None,
            unleased: false,
            snapshots: None,
            snapshot_every: Duration::from_secs(60),
            node_lost_after: Duration::from_secs(120),
            preemption_grace: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PlacerError {
    #[error("connect to postgres: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Project(#[from] ProjectError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("start the pool lease keeper's thread: {0}")]
    Keeper(std::io::Error),
}

/// A running placer.
pub struct Placer {
    stats: Arc<Stats>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), PlacerError>>,
}

impl Placer {
    /// Starts a placer reading the log through `reader` and writing through
    /// `appender`.
    pub fn start(
        db: impl Into<events::db::Database>,
        reader: Reader,
        appender: Appender,
        config: PlacerConfig,
    ) -> Placer {
        let db = db.into();
        let stats = Arc::new(Stats::default());
        placers().add(&stats);
        let (stop, stop_rx) = oneshot::channel();
        let task = ops::task::spawn(
            "placer",
            run(db, reader, appender, config, stats.clone(), stop_rx),
        );
        Placer {
            stats,
            stop: Some(stop),
            task,
        }
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Whether the placer stopped (with an error, or because it was told to).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the placer: lets commits in flight finish and gives up its
    /// leases so another placer takes its pools at once.
    pub async fn stop(mut self) -> Result<(), PlacerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.unwrap_or(Ok(()))
    }

    /// Waits for the placer to end on its own (it runs until stopped or a
    /// fatal error).
    pub async fn join(mut self) -> Result<(), PlacerError> {
        (&mut self.task).await.unwrap_or(Ok(()))
    }
}

struct PoolWork {
    /// The pool may be planned: its lease surely holds for a while yet.
    /// Once not, the entry stays only until its commit in flight lands.
    held: bool,
    inflight: bool,
    /// Plan only once the index has the pool at this version.
    wait_version: u64,
    /// The capacity epoch at which the queued reservations were last tried.
    tried_epoch: u64,
    /// The UTC day they were last tried on (budgets renew at midnight).
    tried_day: u64,
    retry_at: Option<Instant>,
}

impl PoolWork {
    /// Whether what waits is tried again: when capacity moved, and at each
    /// UTC midnight where a queue has a budget (a day, week or month
    /// renews).
    fn retry_queued(
        &mut self,
        p: &projections::index::Pool,
        q: &projections::index::Queues,
        now_ms: u64,
    ) -> bool {
        let day = now_ms / domain::calendar::DAY_MS as u64;
        let renewed = self.tried_day != day && p.queues.values().any(|s| !s.budgets.is_empty());
        let retry = !q.queued.is_empty() && (p.capacity_epoch != self.tried_epoch || renewed);
        if retry {
            self.tried_day = day;
        }
        retry
    }

    fn new() -> PoolWork {
        PoolWork {
            held: true,
            inflight: false,
            wait_version: 0,
            tried_epoch: u64::MAX,
            tried_day: 0,
            retry_at: None,
        }
    }
}

struct Committed {
    pool: String,
    plan_counts: [u64; 8],
    /// GPUs quarantined, nodes drained, faults withheld and GPUs restored.
    fault_counts: [u64; 4],
    retried_queued_at: Option<u64>,
    result: Result<Appended, AppendError>,
}

/// Where batches are committed: the appender, a connection for reading what
/// moved a pool's stream under a batch, and the counters.
#[derive(Clone)]
struct Out {
    appender: Appender,
    reads: Arc<SharedClient>,
    stats: Arc<Stats>,
}

type CommitFuture = Pin<Box<dyn Future<Output = Committed> + Send>>;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn run(
    db: events::db::Database,
    reader: Reader,
    appender: Appender,
    config: PlacerConfig,
    stats: Arc<Stats>,
    mut stop: oneshot::Receiver<()>,
) -> Result<(), PlacerError> {
    // What moved a pool's stream under a batch is read through a
    // connection of its own (`rebase`).
    let out = Out {
        appender,
        reads: Arc::new(SharedClient::new(db.clone())),
        stats: stats.clone(),
    };
    // Leases go through a connection of their own, made again whenever it
    // closed (the database restarted), so upkeep resumes by itself.
    let keeper = Keeper::start(
        db,
        KeeperConfig {
            holder: config.holder.clone(),
            ttl: config.lease_ttl,
            unleased: config.unleased,
        },
        stats.clone(),
    )
    .map_err(PlacerError::Keeper)?;
    let mut holdings = keeper.holdings();
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));
    let Some(mut proj) = start_projector(&reader, &config, &mut stop, &mut backoff).await else {
        keeper.stop().await;
        return Ok(());
    };
    keeper.want(pools_of(&proj.index, &config));
    let mut work: HashMap<String, PoolWork> = HashMap::new();
    let mut commits: FuturesUnordered<CommitFuture> = FuturesUnordered::new();
    let mut clock = tokio::time::interval(Duration::from_millis(100));
    clock.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut snapshots = tokio::time::interval(Duration::from_secs(1));
    snapshots.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The trace context of requests that came with one (see events::trace),
    // until the placer decided them: empty unless spans are exported.
    let mut traces: HashMap<String, String> = HashMap::new();
    tracing::info!(holder = %config.holder, from = proj.started_at, "placer started");
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => break,
            Some(done) = commits.next(), if !commits.is_empty() => {
                on_commit(&mut work, done, &stats);
            }
            r = holdings.changed() => if r.is_err() {
                // The keeper's thread ended (it only does when told to):
                // end too, so the role's supervisor starts the placer again.
                return Err(PlacerError::Keeper(std::io::Error::other("the pool lease keeper stopped")));
            },
            e = proj.step() => {
                match e {
                    Err(e) => {
                        // Supervised: the index is rebuilt (from the newest
                        // snapshot and the log) and placement goes on.
                        let delay = backoff.next_delay();
                        ops::task::restarted("placer-projector", &e, delay);
                        tokio::select! {
                            _ = &mut stop => break,
                            _ = tokio::time::sleep(delay) => {}
                        }
                        match start_projector(&reader, &config, &mut stop, &mut backoff).await {
                            Some(p) => proj = p,
                            None => break,
                        }
                        keeper.want(pools_of(&proj.index, &config));
                    }
                    // A new pool: the keeper looks for its lease at once.
                    Ok(e) if domain::canonical_type(&e.event_type) == "pool.created" => {
                        keeper.want(pools_of(&proj.index, &config));
                    }
                    Ok(e) => remember_trace(&mut traces, &e),
                }
                stats.position.store(proj.index.position(), Ordering::Relaxed);
            }
            _ = snapshots.tick() => {
                if let Err(e) = proj.maybe_snapshot() {
                    tracing::warn!(error = %e, "could not write an index snapshot");
                }
            }
            _ = clock.tick() => {}
        }
        let held = holdings.borrow_and_update().clone();
        follow_holdings(&held, &mut work, config.lease_ttl, &stats);
        plan_ready(
            &mut proj.index,
            &mut work,
            &out,
            &mut commits,
            &config,
            &mut traces,
            &stats,
        );
    }
    // Let commits in flight land, then give the pools back.
    while let Some(done) = commits.next().await {
        on_commit(&mut work, done, &stats);
    }
    keeper.stop().await;
    stats.pools_held.store(0, Ordering::Relaxed);
    Ok(())
}

/// The pools this placer may hold: those created, of its own if it was
/// given some.
fn pools_of(index: &Index, config: &PlacerConfig) -> BTreeSet<String> {
    let wanted = |name: &str| config.pools.as_ref().is_none_or(|p| p.contains(name));
    index
        .state()
        .pools
        .values()
        .filter(|p| p.created && wanted(&p.name))
        .map(|p| p.name.clone())
        .collect()
}

/// Starts the placer's projector, retrying with backoff until it starts;
/// `None` if told to stop first.
async fn start_projector(
    reader: &Reader,
    config: &PlacerConfig,
    stop: &mut oneshot::Receiver<()>,
    backoff: &mut Backoff,
) -> Option<Projector> {
    loop {
        match Projector::start(reader, config.snapshots.clone()).await {
            Ok(p) => return Some(p.snapshot_every(config.snapshot_every)),
            Err(e) => {
                let delay = backoff.next_delay();
                ops::task::restarted("placer-projector", &e, delay);
                tokio::select! {
                    _ = &mut *stop => return None,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// Plans the pools whose leases surely hold for more than a quarter of
/// their time to live yet, and stops planning the others (a lease not
/// renewed that long may run out soon and another placer take the pool;
/// the keeper takes it again once the database answers, or another placer
/// does). A pool given back or lost leaves once its commit in flight has
/// landed. Correctness never rested on the lease (the pool's version fences
/// every batch); this keeps two placers from contending for a pool.
fn follow_holdings(
    held: &Holdings,
    work: &mut HashMap<String, PoolWork>,
    ttl: Duration,
    stats: &Stats,
) {
    let now = Instant::now();
    let placeable = |pool: &str| held.get(pool).is_some_and(|until| *until > now + ttl / 4);
    for pool in held.keys() {
        if placeable(pool) {
            work.entry(pool.clone()).or_insert_with(PoolWork::new).held = true;
        }
    }
    work.retain(|pool, w| {
        if placeable(pool) {
            return true;
        }
        if w.held && held.contains_key(pool) {
            tracing::warn!(%pool, "could not renew the pool's lease in time; stopped placing it");
            stats.leases_lost.fetch_add(1, Ordering::Relaxed);
        }
        w.held = false;
        w.inflight
    });
    let planned = work.values().filter(|w| w.held).count();
    stats.pools_held.store(planned as u64, Ordering::Relaxed);
}

fn on_commit(work: &mut HashMap<String, PoolWork>, done: Committed, stats: &Stats) {
    let Some(w) = work.get_mut(&done.pool) else {
        return;
    };
    w.inflight = false;
    match done.result {
        Ok(appended) => {
            w.wait_version = appended.version;
            if let Some(epoch) = done.retried_queued_at {
                w.tried_epoch = epoch;
            }
            let [placed, queued, rejected, released, expired, failed, preempting, preempted] =
                done.plan_counts;
            stats.preempting.fetch_add(preempting, Ordering::Relaxed);
            stats.preempted.fetch_add(preempted, Ordering::Relaxed);
            stats.batches.fetch_add(1, Ordering::Relaxed);
            stats.placed.fetch_add(placed, Ordering::Relaxed);
            stats.queued.fetch_add(queued, Ordering::Relaxed);
            stats.rejected.fetch_add(rejected, Ordering::Relaxed);
            stats.released.fetch_add(released, Ordering::Relaxed);
            stats.expired.fetch_add(expired, Ordering::Relaxed);
            stats.failed.fetch_add(failed, Ordering::Relaxed);
            let [quarantined, drained, withheld, restored] = done.fault_counts;
            stats.restored.fetch_add(restored, Ordering::Relaxed);
            stats.quarantined.fetch_add(quarantined, Ordering::Relaxed);
            stats
                .drained_for_faults
                .fetch_add(drained, Ordering::Relaxed);
            stats
                .quarantine_withheld
                .fetch_add(withheld, Ordering::Relaxed);
        }
        Err(AppendError::VersionConflict { actual, .. }) => {
            // Someone else wrote to the pool: replan once the index has it.
            w.wait_version = actual;
            stats.conflicts.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(pool = %done.pool, actual, "pool moved under the batch; replanning");
        }
        Err(e) => {
            w.retry_at = Some(Instant::now() + Duration::from_millis(250));
            stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pool = %done.pool, error = %e, "batch commit failed; replanning shortly");
        }
    }
}

/// Keeps the `traceparent` of a request that carries one.
fn remember_trace(traces: &mut HashMap<String, String>, e: &events::Event) {
    if domain::canonical_type(&e.event_type) != "reservation.requested" {
        return;
    }
    if let (Some(id), Some(tp)) = (
        domain::reservation_of(&e.stream),
        events::trace::of_metadata(&e.metadata),
    ) {
        traces.insert(id.to_string(), tp);
    }
}

/// Plans and starts the commit of every pool that is ready.
fn plan_ready(
    index: &mut Index,
    work: &mut HashMap<String, PoolWork>,
    out: &Out,
    commits: &mut FuturesUnordered<CommitFuture>,
    config: &PlacerConfig,
    traces: &mut HashMap<String, String>,
    stats: &Stats,
) {
    let now = Instant::now();
    let now_ms = now_ms();
    let max = config.max_batch.max(1);
    for (pool, w) in work.iter_mut() {
        if !w.held || w.inflight || w.retry_at.is_some_and(|t| now < t) {
            continue;
        }
        let (Some(p), Some(q)) = (index.pool(pool), index.queues(pool)) else {
            continue;
        };
        if !p.created || p.version < w.wait_version {
            continue;
        }
        let retry_queued = w.retry_queued(p, q, now_ms);
        let grace = config.preemption_grace.as_millis() as u64;
        let Due {
            notices,
            starting,
            expiry_due,
        } = due(index, q, now_ms, grace, max);
        let preemption_due = q.preemptions.first().is_some_and(|(at, _)| *at <= now_ms);
        let failures = failures_due(p, q, config.node_lost_after, now_ms, max);
        let answers = crate::faults::decide(p, q);
        if answers.facts.is_empty()
            && q.pending.is_empty()
            && !retry_queued
            && q.releases.is_empty()
            && !expiry_due
            && !preemption_due
            && failures.is_empty()
            && notices.is_empty()
            && starting.is_empty()
        {
            continue;
        }
        let (version, epoch) = (p.version, p.capacity_epoch);
        let releases: Vec<String> = q.releases.iter().take(max).cloned().collect();
        let expiries = expiries_due(index, q, now_ms, max);
        // A reservation ends once: released or expired before it fails.
        let failures: Vec<(String, String, &str)> = failures
            .into_iter()
            .filter(|(id, _, _)| !q.releases.contains(id) && !expiries.contains(id))
            .collect();
        let ids = batch_ids(q, retry_queued, max);
        // Reservations whose grace period is over end now, and the requests
        // they made room for are placed on their devices, in this batch.
        let (mut ending, ended) = preemptions_due(index, q, now_ms, max, &expiries, &failures);
        // Everything the batch ends is planned as gone.
        ending.victims = ended.iter().map(|(v, _, _, _)| v.clone()).collect();
        ending.victims.extend(releases.iter().cloned());
        ending.victims.extend(expiries.iter().cloned());
        ending
            .victims
            .extend(failures.iter().map(|(id, _, _)| id.clone()));
        ending.first.extend(starting);
        // Nothing the batch ends is told it will end.
        let mut notices = notices;
        notices.retain(|(id, _, _)| !ending.victims.contains(id));
        let batch = tracing::info_span!("placement.batch", pool = %pool, requests = ids.len());
        let Plan {
            placed,
            queued,
            rejected,
            preempting,
            promised,
            searches,
            ..
        } = batch.in_scope(|| plan::plan_with(index, pool, &ids, &ending, now_ms));
        stats.planned.fetch_add(1, Ordering::Relaxed);
        let found_victims = !preempting.is_empty();
        let counts = [
            placed.len() as u64,
            queued.len() as u64,
            rejected.len() as u64,
            releases.len() as u64,
            expiries.len() as u64,
            failures.len() as u64,
            preempting.len() as u64,
            ended.len() as u64,
        ];
        let deadline = now_ms + grace;
        let (mut facts, replacements) = batch_facts(
            index,
            Decided {
                releases,
                expiries,
                notices,
                promised,
                failures,
                ended,
                placed,
                preempting,
                queued,
                rejected,
            },
            deadline,
            grace,
        );
        // The answers to faults come first: the plan already kept off the
        // GPUs they are about.
        let fault_counts = [
            answers.quarantined,
            answers.drained,
            answers.withheld,
            answers.restored,
        ];
        facts.splice(0..0, answers.facts);
        // When the batch ran out of searches for victims and found some,
        // what waits is tried again next time even if capacity did not
        // move: those chosen are being preempted then, and the searches go
        // further. One that found none would search the same requests the
        // same way again, every turn of the loop, for nothing.
        let retried_queued_at = (retry_queued
            && (searches < plan::SEARCHES_PER_BATCH || !found_victims))
            .then_some(epoch);
        if facts.is_empty() {
            // Everything tried still waits: remember that until capacity moves.
            if let Some(e) = retried_queued_at {
                w.tried_epoch = e;
            }
            continue;
        }
        w.inflight = true;
        let mut appends =
            batch.in_scope(|| batch_appends(&pool_stream(pool), version, &facts, traces));
        appends.extend(replacements.into_iter().map(|r| StreamAppend {
            stream: reservation_stream(&r.reservation),
            expected: ExpectedVersion::NoStream,
            events: vec![Fact::ReservationRequested(r).to_event()],
        }));
        let outcome = Committed {
            pool: pool.clone(),
            plan_counts: counts,
            fault_counts,
            retried_queued_at,
            result: Err(AppendError::Closed),
        };
        commits.push(commit(out.clone(), appends, batch, outcome));
    }
}

/// Commits a batch's appends; `outcome` gets the result.
fn commit(
    out: Out,
    appends: Vec<StreamAppend>,
    batch: tracing::Span,
    mut outcome: Committed,
) -> CommitFuture {
    use tracing::Instrument as _;
    Box::pin(async move {
        outcome.result =
            crate::rebase::commit(&out.appender, &out.reads, appends, &out.stats.rebased)
                .instrument(batch)
                .await
                .and_then(|mut out| {
                    // The pool's stream is the batch's first.
                    (!out.is_empty())
                        .then(|| out.swap_remove(0))
                        .ok_or(AppendError::Closed)
                });
        outcome
    })
}

/// What time brings a pool now.
struct Due {
    /// Cut short, to be told (see [`notices_due`]).
    notices: Vec<(String, u64, String)>,
    /// Reservations in advance whose start came: placed first.
    starting: Vec<String>,
    /// Some live reservation's time ran out.
    expiry_due: bool,
}

fn due(index: &Index, q: &projections::index::Queues, now_ms: u64, grace: u64, max: usize) -> Due {
    Due {
        notices: notices_due(index, q, now_ms + grace, max),
        starting: q
            .promised
            .iter()
            .take_while(|(at, _)| *at <= now_ms)
            .filter(|(_, id)| !q.releases.contains(id))
            .take(max)
            .map(|(_, id)| id.clone())
            .collect(),
        expiry_due: q.expiries.first().is_some_and(|(at, _)| *at <= now_ms),
    }
}

/// Live reservations whose time ran out by `now_ms`, none being released.
/// Those at their queue's maximum run time end once told (see
/// [`notices_due`]).
fn expiries_due(
    index: &Index,
    q: &projections::index::Queues,
    now_ms: u64,
    max: usize,
) -> Vec<String> {
    q.expiries
        .iter()
        .take_while(|(at, _)| *at <= now_ms)
        .filter(|(_, id)| !q.releases.contains(id))
        .filter(|(_, id)| {
            !index
                .reservation(id)
                .is_some_and(|r| !r.end_reason.is_empty() && !r.noticed)
        })
        .take(max)
        .map(|(_, id)| id.clone())
        .collect()
}

/// Live reservations cut short (their queue's maximum run time, a
/// maintenance window) whose end comes by `by_ms` (now and a preemption
/// grace period) and whose nodes were not told yet: with when, and why.
fn notices_due(
    index: &Index,
    q: &projections::index::Queues,
    by_ms: u64,
    max: usize,
) -> Vec<(String, u64, String)> {
    q.expiries
        .iter()
        .take_while(|(at, _)| *at <= by_ms)
        .filter(|(_, id)| !q.releases.contains(id))
        .filter_map(|(at, id)| {
            let r = index.reservation(id)?;
            (!r.end_reason.is_empty() && !r.noticed)
                .then(|| (id.clone(), *at, r.end_reason.clone()))
        })
        .take(max)
        .collect()
}

/// The request that takes `r`'s place when it fails or is preempted:
/// the same request under its replacement id (`<id>~<n>`).
fn replacement(r: &Request) -> Request {
    Request {
        reservation: replacement_id(&r.reservation),
        replaces: Some(r.reservation.clone()),
        // Placed at once, even when the first was in advance.
        start_ms: None,
        ..r.clone()
    }
}

/// Up to `max` queued requests of a pool shared by queues: one from each
/// queue in turn (each queue's in placement order), then those that name no
/// The requests a batch plans: pending ones first (up to `max`, none being
/// released), and the queued again when capacity moved (`retry_queued`).
fn batch_ids(q: &projections::index::Queues, retry_queued: bool, max: usize) -> Vec<String> {
    let mut keys: Vec<_> = q
        .pending
        .iter()
        .filter(|k| !q.releases.contains(&k.2))
        .take(max)
        .collect();
    if retry_queued && q.queued_by_queue.is_empty() {
        keys.extend(
            q.queued
                .iter()
                .filter(|k| !q.releases.contains(&k.2))
                .take(max),
        );
        keys.sort();
        keys.truncate(max);
    } else if retry_queued {
        // A pool shared by queues: the queued are retried from every
        // queue in turn, so one queue's backlog cannot keep another's
        // out of the batch, and at least half the batch is retries
        // while requests are pending.
        let retries = retry_in_turn(q, max);
        let room = if keys.len() >= max {
            max / 2
        } else {
            max - keys.len()
        };
        let retries = &retries[..retries.len().min(room.max(1))];
        keys.truncate(max - retries.len());
        keys.extend(retries.iter().copied());
    }
    keys.into_iter().map(|k| k.2.clone()).collect()
}

/// A victim of preemption whose grace period is over: (victim, by, why, its
/// replacement if it asked to be requeued).
type Ended = (String, String, String, Option<Request>);

/// The preemptions whose grace period is over by `now_ms` (up to `max`, none
/// of a reservation the batch ends otherwise): who they ended, and the
/// requests they made room for, to be placed first.
fn preemptions_due(
    index: &Index,
    q: &projections::index::Queues,
    now_ms: u64,
    max: usize,
    expiries: &[String],
    failures: &[(String, String, &str)],
) -> (plan::Ending, Vec<Ended>) {
    let mut ending = plan::Ending::default();
    // (victim, by, why, its replacement if it asked to be requeued)
    let mut ended: Vec<Ended> = Vec::new();
    for (_, victim) in q.preemptions.iter().take_while(|(at, _)| *at <= now_ms) {
        if ended.len() >= max {
            break;
        }
        if q.releases.contains(victim)
            || expiries.contains(victim)
            || failures.iter().any(|(f, _, _)| f == victim)
        {
            continue;
        }
        let Some(r) = index.reservation(victim) else {
            continue;
        };
        let Some(by) = r.preempted_by.clone() else {
            continue;
        };
        if !ending.first.contains(&by) {
            ending.first.push(by.clone());
        }
        let again = r
            .request
            .requeue_on_preemption
            .then(|| replacement(&r.request));
        ended.push((victim.clone(), by, r.preempt_reason.clone(), again));
    }
    (ending, ended)
}

/// What a batch decided, before it is written.
struct Decided<'a> {
    releases: Vec<String>,
    expiries: Vec<String>,
    /// Told of their end, cut short: (id, when, why).
    notices: Vec<(String, u64, String)>,
    /// Reservations in advance promised: (id, devices, start, end).
    promised: Vec<(String, Vec<domain::Allocation>, u64, u64)>,
    failures: Vec<(String, String, &'a str)>,
    ended: Vec<Ended>,
    placed: Vec<(String, Vec<domain::Allocation>)>,
    preempting: Vec<(String, String, String)>,
    queued: Vec<(String, String)>,
    rejected: Vec<(String, String)>,
}

/// The facts a batch appends to its pool's stream, in the order they apply,
/// and the replacements it requests (preemptions scheduled get `deadline`,
/// `grace` from now).
fn batch_facts(
    index: &Index,
    d: Decided<'_>,
    deadline: u64,
    grace: u64,
) -> (Vec<Fact>, Vec<Request>) {
    let Decided {
        releases,
        expiries,
        notices,
        promised,
        failures,
        ended,
        placed,
        preempting,
        queued,
        rejected,
    } = d;
    let mut facts: Vec<Fact> = Vec::new();
    facts.extend(
        releases
            .into_iter()
            .map(|reservation| Fact::ReservationReleased { reservation }),
    );
    facts.extend(expiries.into_iter().map(|reservation| {
        Fact::ReservationExpired {
            reason: index
                .reservation(&reservation)
                .map(|r| r.end_reason.clone())
                .unwrap_or_default(),
            reservation,
        }
    }));

    // Reservations that asked to be placed again are requested anew, in
    // the same transaction, under their replacement id.
    let mut replacements = Vec::new();
    for (reservation, node, reason) in failures {
        let again = index
            .reservation(&reservation)
            .filter(|r| r.request.replace_on_failure)
            .map(|r| replacement(&r.request));
        facts.push(Fact::ReservationFailed {
            reservation,
            node,
            reason: reason.to_string(),
            replaced_by: again.as_ref().map(|r| r.reservation.clone()),
        });
        replacements.extend(again);
    }
    for (reservation, by, reason, again) in ended {
        facts.push(Fact::ReservationPreempted {
            reservation,
            by,
            reason,
            replaced_by: again.as_ref().map(|r| r.reservation.clone()),
        });
        replacements.extend(again);
    }
    // Promises before placements: the index judges each placement
    // against them.
    facts.extend(
        promised
            .into_iter()
            .map(
                |(reservation, allocations, start, end)| Fact::ReservationPromised {
                    reservation,
                    allocations,
                    start_ms: Some(start),
                    end_ms: Some(end),
                },
            ),
    );
    facts.extend(
        placed
            .into_iter()
            .map(|(reservation, allocations)| Fact::ReservationPlaced {
                reservation,
                allocations,
            }),
    );
    // Preemptions after the placements: see quota::may_preempt.
    facts.extend(preempting.into_iter().map(|(reservation, by, reason)| {
        Fact::ReservationPreemptionScheduled {
            reservation,
            by,
            reason,
            deadline_ms: Some(deadline),
        }
    }));
    // One grace period before the end, or as soon as the placer can (a
    // limit shorter than the grace period, or a placer away): the end
    // stays where the limit put it, or now if that is past.
    let now_ms = deadline.saturating_sub(grace);
    facts.extend(notices.into_iter().map(|(reservation, at, reason)| {
        Fact::ReservationEndingNoticed {
            reservation,
            reason,
            deadline_ms: Some(at.max(now_ms)),
        }
    }));
    facts.extend(
        queued
            .into_iter()
            .map(|(reservation, reason)| Fact::ReservationQueued {
                reservation,
                reason,
            }),
    );
    facts.extend(
        rejected
            .into_iter()
            .map(|(reservation, reason)| Fact::ReservationRejected {
                reservation,
                reason,
            }),
    );
    (facts, replacements)
}

/// queue (queued before the pool had queues). None whose release is asked.
fn retry_in_turn(q: &projections::index::Queues, max: usize) -> Vec<&Key> {
    let mut out: Vec<&Key> = Vec::new();
    let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut turns: Vec<_> = q
        .queued_by_queue
        .values()
        .map(|set| set.iter().filter(|k| !q.releases.contains(&k.2)))
        .collect();
    let mut rest = q.queued.iter().filter(|k| !q.releases.contains(&k.2));
    while out.len() < max && !turns.is_empty() {
        turns.retain_mut(|it| match it.next() {
            Some(k) if out.len() < max => {
                seen.insert(&k.2);
                out.push(k);
                true
            }
            _ => false,
        });
    }
    while out.len() < max {
        match rest.next() {
            Some(k) if !seen.contains(k.2.as_str()) => out.push(k),
            Some(_) => {}
            None => break,
        }
    }
    out
}

/// A queue entry: priority (highest first), position, reservation.
type Key = (std::cmp::Reverse<i32>, u64, String);

/// Live reservations that must end because a node of theirs is troubled:
/// it left (`node_left`), was revoked (`node_revoked`), has been out of
/// contact for `lost_after` (`node_lost`), or was drained and its wait is
/// over (`node_drained`); or because a GPU of theirs (or the GPU of a MIG
/// instance of theirs) is quarantined (`gpu_fault`). At most `max`, each once, as
/// (reservation, node, reason).
fn failures_due(
    pool: &projections::index::Pool,
    queues: &projections::index::Queues,
    lost_after: Duration,
    now_ms: u64,
    max: usize,
) -> Vec<(String, String, &'static str)> {
    let mut out: Vec<(String, String, &'static str)> = Vec::new();
    let lost_after = lost_after.as_millis() as u64;
    for name in &queues.troubled {
        let Some(node) = pool.nodes.get(name) else {
            continue;
        };
        let lost = node
            .unreachable_since_ms
            .is_some_and(|since| since.saturating_add(lost_after) <= now_ms);
        let drained = node.drained.is_some() && node.drain_deadline_ms.unwrap_or(0) <= now_ms;
        let reason = if node.left && node.left_reason == "revoked" {
            "node_revoked"
        } else if node.left {
            "node_left"
        } else if lost {
            "node_lost"
        } else if drained {
            "node_drained"
        } else {
            // Only the reservations on its quarantined GPUs end.
            for id in node.quarantined_bookings() {
                if out.len() >= max {
                    return out;
                }
                if !out.iter().any(|(r, _, _)| r == id) {
                    out.push((id.to_string(), name.clone(), "gpu_fault"));
                }
            }
            continue;
        };
        for id in node.bookings() {
            if out.len() >= max {
                return out;
            }
            if !out.iter().any(|(r, _, _)| r == id) {
                out.push((id.to_string(), name.clone(), reason));
            }
        }
    }
    out
}

/// The appends of one batch: its facts on the pool's stream at the version
/// the plan saw, then, for every reservation the batch ends, a
/// `reservation.ended` on the reservation's own stream (with no version
/// check: the pool's version already fences the batch). All commit in one
/// transaction, so a reservation's end moves its stream's version, and any
/// writer of its life cycle that appends at a version seen before the end
/// (the binder's activation) conflicts.
///
/// A decision about a request that came with a trace context continues
/// that trace: a `reservation.place` span whose parent is the request's,
/// with its own context in the fact's metadata (where the binder picks it
/// up). The context is forgotten once the request is decided.
fn batch_appends(
    pool_stream: &str,
    version: u64,
    facts: &[Fact],
    traces: &mut HashMap<String, String>,
) -> Vec<StreamAppend> {
    let events = facts
        .iter()
        .map(|fact| {
            let Some(id) = fact.reservation() else {
                return fact.to_event();
            };
            let decided = !matches!(fact, Fact::ReservationQueued { .. });
            let tp = if decided {
                traces.remove(id)
            } else {
                traces.get(id).cloned()
            };
            match tp {
                Some(tp) => {
                    let span = tracing::info_span!(
                        "reservation.place",
                        reservation = %id,
                        outcome = fact.event_type()
                    );
                    events::trace::follow(&span, &tp);
                    span.in_scope(|| events::trace::traced(fact.to_event()))
                }
                None => fact.to_event(),
            }
        })
        .collect();
    let mut appends = vec![StreamAppend {
        stream: pool_stream.to_string(),
        expected: ExpectedVersion::Exact(version),
        events,
    }];
    for fact in facts {
        let Some(outcome) = fact.outcome() else {
            continue;
        };
        let reservation = fact.reservation().expect("a reservation fact").to_string();
        appends.push(StreamAppend {
            stream: reservation_stream(&reservation),
            expected: ExpectedVersion::Any,
            events: vec![Fact::ReservationEnded {
                reservation,
                outcome: outcome.to_string(),
            }
            .to_event()],
        });
    }
    appends
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replacement_is_placed_at_once_even_for_a_reservation_in_advance() {
        let first = Request {
            start_ms: Some(1_800_000_000_000),
            ttl_ms: Some(3_600_000),
            ..domain::demand::request("ahead".into(), "p", "c", 8, domain::Shape::Any)
        };
        first.validate().unwrap();
        let again = replacement(&first);
        assert_eq!(again.reservation, "ahead~1");
        assert_eq!(again.start_ms, None);
        again.validate().unwrap();
    }
}
