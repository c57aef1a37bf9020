//! Strata's binder (the `binder` role): turns placements into node commands
//! and bound placements into active reservations.
//!
//! ```text
//!  reservation.placed --> allocation.bind per node (id bind:<reservation>:<node>, NoStream)
//!  command.succeeded for every node --> reservation.activated at Exact(version seen of reservation/<id>)
//!  reservation.released | .expired | .failed --> allocation.release per node
//! ```
//!
//! Progress: the binder follows the log with its own index (built from the
//! table at start, then an ephemeral subscription), and remembers the
//! version of each live reservation's stream. The activation is appended at
//! exactly that version: a binder that lost its lease, missed an event, or
//! raced the reservation's end (`reservation.ended` moves that stream's
//! version in the same transaction as the terminal fact) conflicts instead
//! of activating twice or after the end. Issuing a command twice is a
//! harmless conflict. Started, it folds the log into its index and follows
//! it, standing by while another binder holds the lease; once it holds it,
//! it re-issues what a previous binder may not have.
//!
//! Commands and activations are appended in the background and tried again
//! while the database answers with a transient error (for up to
//! [`COMMAND_DEADLINE`]); each has a fence, so a try that did land makes its
//! retry a harmless conflict.
//!
//! Supervised: whatever fails, the binder lets go of its lease, waits a
//! backoff and starts again from the log.

use domain::commands::{self, Command};
use domain::Fact;
use domain::{reservation_of, reservation_stream};
use events::db::Sql;
use events::lease::{Lease, LeaseError};
use events::{AppendError, Appender, ErrorKind, ExpectedVersion, Reader, Start};
use ops::task::Backoff;
use projections::{projector, Index, Phase};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;

mod lease_keeper;
use lease_keeper::LeaseKeeper;

/// How long a bind command may wait for its node.
pub const COMMAND_DEADLINE: Duration = Duration::from_secs(120);

/// How long a release may wait for its node: a release is always safe to
/// run late (a reservation is never bound again once it ended), so a node
/// that comes back within a day drops the binding it still holds.
pub const RELEASE_DEADLINE: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Default)]
pub struct BinderStats {
    pub binds_issued: AtomicU64,
    pub releases_issued: AtomicU64,
    pub activated: AtomicU64,
    pub bind_failures: AtomicU64,
    /// Binds issued again after one went unanswered.
    pub bind_retries: AtomicU64,
    /// Times the binder failed and started again.
    pub restarts: AtomicU64,
    /// Events applied to the index while another binder held the lease.
    pub standby_events: AtomicU64,
    /// Times the binder folded the whole log into a new index (at its
    /// start, and after the log was cut by a takeover).
    pub folds: AtomicU64,
}

/// The binders' counters on `/metrics`.
static FIELDS: &[ops::metrics::Field<BinderStats>] = &[
    ops::stat_field!(
        BinderStats,
        "strata_binder_binds_total",
        Counter,
        "allocation.bind commands issued.",
        binds_issued
    ),
    ops::stat_field!(
        BinderStats,
        "strata_binder_releases_total",
        Counter,
        "allocation.release commands issued.",
        releases_issued
    ),
    ops::stat_field!(
        BinderStats,
        "strata_binder_activated_total",
        Counter,
        "Reservations made active once every node bound them.",
        activated
    ),
    ops::stat_field!(
        BinderStats,
        "strata_binder_bind_retries_total",
        Counter,
        "Binds issued again after one went unanswered.",
        bind_retries
    ),
    ops::stat_field!(
        BinderStats,
        "strata_binder_bind_failures_total",
        Counter,
        "Binds that expired unanswered or that a node refused.",
        bind_failures
    ),
    ops::stat_field!(
        BinderStats,
        "strata_binder_restarts_total",
        Counter,
        "Times the binder failed and started again.",
        restarts
    ),
    ops::stat_field!(
        BinderStats,
        "strata_binder_standby_events_total",
        Counter,
        "Events a standby binder applied to its index while another held the lease.",
        standby_events
    ),
    ops::stat_field!(
        BinderStats,
        "strata_binder_folds_total",
        Counter,
        "Times the binder folded the whole log into a new index: at its start, and after a takeover cut the log.",
        folds
    ),
];

fn binders() -> &'static ops::metrics::Instances<BinderStats> {
    static B: std::sync::OnceLock<ops::metrics::Instances<BinderStats>> =
        std::sync::OnceLock::new();
    B.get_or_init(|| ops::metrics::Instances::new(FIELDS))
}

#[derive(Debug, thiserror::Error)]
pub enum BinderError {
    #[error("connect to postgres: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Project(#[from] projections::projector::ProjectError),
    #[error(transparent)]
    Subscribe(#[from] events::SubscribeError),
    #[error(transparent)]
    Apply(#[from] projections::ApplyError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("renew the binder lease: no answer within {0:?}")]
    Stalled(Duration),
    #[error("the binder's lease keeper: {0}")]
    Keeper(String),
}

pub struct Binder {
    pub stats: Arc<BinderStats>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), BinderError>>,
}

impl Binder {
    pub fn start(
        db: impl Into<events::db::Database>,
        reader: Reader,
        appender: Appender,
    ) -> Binder {
        Self::start_as(db, reader, appender, events::lease::default_holder())
    }

    /// The same, holding the binder's lease under `holder` (what `strata
    /// serve --holder` names it; a lease list then says which process binds).
    pub fn start_as(
        db: impl Into<events::db::Database>,
        reader: Reader,
        appender: Appender,
        holder: String,
    ) -> Binder {
        let db = db.into();
        let stats = Arc::new(BinderStats::default());
        binders().add(&stats);
        let (stop, rx) = oneshot::channel();
        let task = ops::task::spawn(
            "binder",
            run(db, reader, appender, stats.clone(), rx, holder),
        );
        Binder {
            stats,
            stop: Some(stop),
            task,
        }
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    pub async fn stop(mut self) -> Result<(), BinderError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.unwrap_or(Ok(()))
    }
}

fn bind_id(reservation: &str, node: &str) -> String {
    format!("bind:{reservation}:{node}")
}

fn release_id(reservation: &str, node: &str) -> String {
    format!("release:{reservation}:{node}")
}

/// Issues command `kind` with `args` to every node reservation `r` is on,
/// in the background, each under the id `id(node)` (counted with the
/// releases issued).
fn to_its_nodes(
    appender: &Appender,
    stats: &Arc<BinderStats>,
    r: &projections::index::Reservation,
    kind: &str,
    args: &serde_json::Value,
    id: impl Fn(&str) -> String,
) {
    for a in &r.allocations {
        issue(
            appender,
            Command {
                id: id(&a.node),
                node: a.node.clone(),
                kind: kind.into(),
                args: args.clone(),
                deadline_ms: release_deadline(),
                issued_by: ISSUER.into(),
            },
            stats.clone(),
            true,
        );
    }
}

/// Tells the nodes of live reservation `reservation` that it ends at
/// `deadline_ms` (`allocation.preempting`), for `reason` and, when it is
/// preempted, for whom; the command's id ends with `suffix`.
#[allow(clippy::too_many_arguments)]
fn tell_ending(
    index: &Index,
    appender: &Appender,
    stats: &Arc<BinderStats>,
    reservation: &str,
    by: Option<&String>,
    reason: &str,
    deadline_ms: Option<u64>,
    suffix: &str,
) {
    let Some(r) = index.reservation(reservation) else {
        return;
    };
    let mut args = serde_json::json!({
        "reservation": reservation,
        "reason": reason,
        "deadline_ms": deadline_ms,
    });
    if let Some(by) = by {
        args["by"] = by.as_str().into();
    }
    to_its_nodes(appender, stats, r, "allocation.preempting", &args, |node| {
        format!("preempting:{reservation}:{node}{suffix}")
    });
}

fn deadline_in(after: Duration) -> u64 {
    (SystemTime::now() + after)
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn deadline() -> u64 {
    deadline_in(COMMAND_DEADLINE)
}

fn release_deadline() -> u64 {
    deadline_in(RELEASE_DEADLINE)
}

/// Issues a command in the background; one issued before is fine. A
/// transient failure (the database restarting) is retried with backoff until
/// the command's deadline; a binder started later issues whatever is still
/// missing from the log.
fn issue(appender: &Appender, command: Command, counter: Arc<BinderStats>, release: bool) {
    let appender = appender.clone();
    ops::task::spawn("binder-issue", async move {
        match retried("issue a command", &command.id, || {
            commands::issue(&appender, &command)
        })
        .await
        {
            Ok(()) => {
                let c = if release {
                    &counter.releases_issued
                } else {
                    &counter.binds_issued
                };
                c.fetch_add(1, Ordering::Relaxed);
            }
            Err(AppendError::VersionConflict { .. }) => {}
            Err(e) => {
                tracing::error!(command = %command.id, error = %e, "could not issue a command; giving up");
            }
        }
    });
}

/// Runs `append` until it lands, is refused for good, or a transient error
/// outlasts [`COMMAND_DEADLINE`]; between tries, a backoff of 0.1 s up to
/// 5 s. An append whose outcome was unknown and which did land is answered
/// by its retry with a version conflict: every append retried here has a
/// fence.
async fn retried<F, Fut>(what: &str, id: &str, mut append: F) -> Result<(), AppendError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), AppendError>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let give_up = Instant::now() + COMMAND_DEADLINE;
    loop {
        match append().await {
            Err(e) if e.kind() == ErrorKind::Transient && Instant::now() < give_up => {
                let delay = backoff.next_delay();
                tracing::warn!(%id, error = %e, delay_ms = delay.as_millis() as u64, "could not {what}; retrying");
                tokio::time::sleep(delay).await;
            }
            done => return done,
        }
    }
}

/// Attempts at binding one reservation on one node before it is given up.
pub const BIND_ATTEMPTS: u32 = 5;

/// How the binder's commands name who issued them.
const ISSUER: &str = "strata:binder";

/// The id of attempt `n` at binding `reservation` on `node`: the first is
/// `bind:<reservation>:<node>`, later ones `rebind:<n>:<reservation>:<node>`.
fn attempt_id(reservation: &str, node: &str, n: u32) -> String {
    if n == 0 {
        bind_id(reservation, node)
    } else {
        format!("rebind:{n}:{reservation}:{node}")
    }
}

struct State {
    /// Bind command id -> (reservation, node, attempt).
    binds: HashMap<String, (String, String, u32)>,
    /// Reservation -> nodes whose bind has not succeeded yet.
    waiting: HashMap<String, BTreeSet<String>>,
    /// Reservation -> the version of its stream as this binder's index has
    /// it: `reservation.activated` is appended at exactly that version, so a
    /// binder that lost its lease (or missed an event) cannot mark a
    /// reservation active twice or after it changed.
    versions: HashMap<String, u64>,
    /// Reservation -> the trace context of its bind span, for its
    /// activation (only placements that carried one).
    traces: HashMap<String, String>,
}

impl State {
    /// Issues attempt `n` at binding `reservation`'s devices on `node`.
    fn issue_bind(
        &mut self,
        index: &Index,
        reservation: &str,
        node: &str,
        n: u32,
        appender: &Appender,
        stats: &Arc<BinderStats>,
    ) {
        let Some(a) = index
            .reservation(reservation)
            .and_then(|r| r.allocations.iter().find(|a| a.node == node))
        else {
            return;
        };
        let cmd = attempt_id(reservation, node, n);
        self.binds
            .insert(cmd.clone(), (reservation.to_string(), node.to_string(), n));
        issue(
            appender,
            Command {
                id: cmd,
                node: node.to_string(),
                kind: "allocation.bind".into(),
                args: serde_json::json!({"reservation": reservation, "devices": a.devices}),
                deadline_ms: deadline(),
                issued_by: ISSUER.into(),
            },
            stats.clone(),
            false,
        );
    }

    /// A placement's binds: the first attempt on each of its nodes.
    fn expect_binds(
        &mut self,
        index: &Index,
        id: &str,
        appender: &Appender,
        stats: &Arc<BinderStats>,
    ) {
        let Some(r) = index.reservation(id) else {
            return;
        };
        let nodes: BTreeSet<String> = r.allocations.iter().map(|a| a.node.clone()).collect();
        for node in &nodes {
            self.issue_bind(index, id, node, 0, appender, stats);
        }
        self.waiting.insert(id.to_string(), nodes);
    }

    /// Attempt `n` at a bind did not succeed. The node never answered
    /// (`command.expired`): try again, and the node gets it when its session
    /// is back (or the placer fails the reservation once the node stays
    /// lost). The node refused it, or every attempt went unanswered: the
    /// binding can never happen, so the reservation is released, with the
    /// reason.
    async fn bind_missed(
        &mut self,
        index: &Index,
        appender: &Appender,
        stats: &Arc<BinderStats>,
        (reservation, node, n): (String, String, u32),
        outcome: &str,
        detail: &str,
    ) {
        stats.bind_failures.fetch_add(1, Ordering::Relaxed);
        if index.reservation(&reservation).map(|r| r.phase) != Some(Phase::Placed) {
            return;
        }
        if outcome == commands::EXPIRED && n + 1 < BIND_ATTEMPTS {
            tracing::warn!(%reservation, %node, attempt = n + 1, "a bind went unanswered; trying again");
            stats.bind_retries.fetch_add(1, Ordering::Relaxed);
            self.issue_bind(index, &reservation, &node, n + 1, appender, stats);
            return;
        }
        let reason = if outcome == commands::EXPIRED {
            format!("node {node} did not answer {BIND_ATTEMPTS} binds")
        } else {
            format!("node {node} could not bind it: {detail}")
        };
        tracing::warn!(%reservation, %node, %reason, "a bind failed; releasing the reservation");
        self.waiting.remove(&reservation);
        let meta = serde_json::json!({ "by": "binder" });
        match domain::requests::release(appender, &reservation, &reason, Some(&meta)).await {
            Ok(()) => {}
            Err(e) => {
                tracing::error!(%reservation, error = %e, "could not ask for the release of a reservation whose bind failed")
            }
        }
    }
}

/// One binder works at a time: it holds this lease.
pub const LEASE: &str = "binder";
const LEASE_TTL: Duration = Duration::from_secs(5);

async fn run(
    db: events::db::Database,
    reader: Reader,
    appender: Appender,
    stats: Arc<BinderStats>,
    mut stop: oneshot::Receiver<()>,
    holder: String,
) -> Result<(), BinderError> {
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));
    // Supervised: whatever fails (the database restarting, the lease lost, a
    // read cut short), the binder lets go, waits and starts again from where
    // its index is. It ends only when told to stop.
    let mut kept: Option<Kept> = None;
    loop {
        let began = Instant::now();
        let error = match attempt(
            &db, &reader, &appender, &stats, &mut stop, &holder, &mut kept,
        )
        .await
        {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if matches!(error, BinderError::Apply(_)) {
            // An event the index could not take: it may hold part of it.
            kept = None;
        }
        if began.elapsed() > Duration::from_secs(30) {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        if matches!(error, BinderError::Lease(LeaseError::Lost { .. })) {
            tracing::warn!(error = %error, "the binder lease was lost; waiting to take it again");
        } else {
            stats.restarts.fetch_add(1, Ordering::Relaxed);
            ops::task::restarted("binder", &error, delay);
        }
        tokio::select! {
            _ = &mut stop => return Ok(()),
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Waits for the binder lease (another binder may hold it), then works
/// while holding it. `Ok` only when stopped.
async fn attempt(
    db: &events::db::Database,
    reader: &Reader,
    appender: &Appender,
    stats: &Arc<BinderStats>,
    stop: &mut oneshot::Receiver<()>,
    holder: &str,
    kept: &mut Option<Kept>,
) -> Result<(), BinderError> {
    let client = events::db::connect(db, "binder-lease").await?;
    // The index is made (or kept from the last attempt) before the lease is
    // asked for, and kept current while another binder holds it: a takeover
    // or a restart after a failure starts from where the index is instead
    // of folding the whole log first (tens of seconds at a region's size,
    // while nothing is bound).
    let work = events::db::connect(db, "binder").await?;
    let made = Kept::resume(&work, kept.take(), stats).await?;
    let index = &mut kept.insert(made).index;
    let mut sub = reader
        .subscribe_ephemeral_as("binder", Start::After(events::Position(index.position())))
        .await?;
    let lease = loop {
        if let Some(l) = Lease::acquire(&client, LEASE, holder, LEASE_TTL).await? {
            break l;
        }
        let retry = tokio::time::sleep(LEASE_TTL / 3);
        tokio::pin!(retry);
        loop {
            tokio::select! {
                _ = &mut *stop => return Ok(()),
                _ = &mut retry => break,
                e = sub.next() => {
                    let e = e?;
                    sub.ack(e.position);
                    if let Some(v) = index.apply(&e)? {
                        tracing::warn!(violation = %v, "the log breaks an invariant");
                    }
                    stats.standby_events.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    };
    tracing::info!(%holder, epoch = lease.epoch, position = index.position(), "binder lease taken");
    let mut keeper = LeaseKeeper::start(db.clone(), lease.clone())
        .map_err(|e| BinderError::Keeper(format!("start its thread: {e}")))?;
    let result = held(&work, sub, index, appender, stats, stop, &mut keeper).await;
    // Renewals end before the lease is given back.
    drop(keeper);
    if result.is_ok() {
        let _ = lease.release(&client).await;
    }
    result
}

/// The binder's index, kept across its attempts.
struct Kept {
    index: Index,
    /// The ranges of positions takeovers had cut from the log when the
    /// index was made (`strata.log_epochs`).
    cuts: Vec<(u64, u64)>,
}

impl Kept {
    /// The index of the last attempt, unless a takeover since cut from the
    /// log positions it holds (a standby promoted without events the index
    /// has); else the log folded anew.
    async fn resume(
        client: &tokio_postgres::Client,
        kept: Option<Kept>,
        stats: &BinderStats,
    ) -> Result<Kept, BinderError> {
        // Read before the fold: a takeover during it is seen next time.
        let cuts = projector::lost_ranges(client).await?;
        if let Some(k) = kept {
            let held = k.index.position();
            let cut = cuts.iter().any(|c| c.0 < held && !k.cuts.contains(c));
            if !cut {
                return Ok(Kept { cuts, ..k });
            }
            tracing::warn!(
                position = held,
                "a takeover cut from the log positions the binder's index holds; folding the log again"
            );
        }
        let index = projector::build(client, Index::new()).await?;
        stats.folds.fetch_add(1, Ordering::Relaxed);
        Ok(Kept { index, cuts })
    }
}

/// Works while holding the lease; returns when stopped or the lease is lost.
async fn held(
    client: &tokio_postgres::Client,
    mut sub: events::Subscription,
    index: &mut Index,
    appender: &Appender,
    stats: &Arc<BinderStats>,
    stop: &mut oneshot::Receiver<()>,
    keeper: &mut LeaseKeeper,
) -> Result<(), BinderError> {
    let (mut state, placed) = resumed(client, index).await?;
    resume_binds(client, &mut state, index, &placed, appender, stats).await?;
    release_ended(client, index, appender, stats).await?;
    tracing::info!(
        position = index.position(),
        placed = placed.len(),
        "binder started"
    );
    loop {
        let e = tokio::select! {
            _ = &mut *stop => return Ok(()),
            // The keeper renews apart; a renewal that failed or did not
            // answer in time ends the binder's work before the lease can
            // run out.
            lost = keeper.lost() => return Err(lost),
            e = sub.next() => e?,
        };
        sub.ack(e.position);
        on_event(&mut state, index, &e, appender, stats).await?;
    }
}

/// The binder's state when it takes the lease: the version of every
/// reservation the index holds, and the placements not active yet (whose
/// binds it issues again and learns which already succeeded).
async fn resumed(
    client: &tokio_postgres::Client,
    index: &Index,
) -> Result<(State, Vec<String>), BinderError> {
    let mut state = State {
        binds: HashMap::new(),
        waiting: HashMap::new(),
        versions: HashMap::new(),
        traces: HashMap::new(),
    };
    // Placements not active yet: (re)issue their binds and learn which
    // already succeeded.
    let placed: Vec<String> = index
        .state()
        .reservations
        .values()
        .filter(|r| r.phase == Phase::Placed)
        .map(|r| r.request.reservation.clone())
        .collect();
    // The version of every reservation the index holds (pending ones too:
    // they are placed later, with no event on their own stream), so that
    // every activation is fenced by it.
    let placed_streams: Vec<String> = index
        .state()
        .reservations
        .keys()
        .map(|id| reservation_stream(id))
        .collect();
    for row in client
        .rows(
            "SELECT stream, max(version) FROM strata.events
              WHERE stream = ANY($1) AND position <= $2 GROUP BY stream",
            &[&placed_streams, &(index.position() as i64)],
        )
        .await?
    {
        let stream: String = row.get(0);
        let version: i64 = row.get(1);
        if let Some(id) = reservation_of(&stream) {
            state.versions.insert(id.to_string(), version as u64);
        }
    }
    Ok((state, placed))
}

/// Follows one event of the log: tells nodes of preemptions and ends,
/// folds it into the index, keeps the life-cycle fences, expects the binds
/// of a placement and hears their results.
async fn on_event(
    state: &mut State,
    index: &mut Index,
    e: &events::Event,
    appender: &Appender,
    stats: &Arc<BinderStats>,
) -> Result<(), BinderError> {
    let fact = Fact::parse(&e.event_type, &e.payload, &e.metadata)
        .ok()
        .flatten();
    match &fact {
        Some(Fact::ReservationPreemptionScheduled {
            reservation,
            by,
            reason,
            deadline_ms,
        }) => {
            // Its nodes are told, so its workload can wind down before
            // the grace period ends.
            let suffix = String::new();
            tell_ending(
                index,
                appender,
                stats,
                reservation,
                Some(by),
                reason,
                *deadline_ms,
                &suffix,
            );
        }
        Some(Fact::ReservationEndingNoticed {
            reservation,
            reason,
            deadline_ms,
        }) => {
            // The notice preemption gives, one grace period before the end.
            let suffix = format!(":{reason}");
            tell_ending(
                index,
                appender,
                stats,
                reservation,
                None,
                reason,
                *deadline_ms,
                &suffix,
            );
        }
        Some(
            Fact::ReservationReleased { reservation }
            | Fact::ReservationExpired { reservation, .. }
            | Fact::ReservationFailed { reservation, .. }
            | Fact::ReservationPreempted { reservation, .. },
        ) => {
            // Before the index forgets the reservation's allocations.
            if let Some(r) = index.reservation(reservation) {
                let args = serde_json::json!({"reservation": reservation});
                to_its_nodes(appender, stats, r, "allocation.release", &args, |node| {
                    release_id(reservation, node)
                });
            }
            state.waiting.remove(reservation);
            state.versions.remove(reservation);
            state.traces.remove(reservation);
        }
        Some(Fact::ReservationRejected { reservation, .. }) => {
            state.versions.remove(reservation);
        }
        _ => {}
    }
    if let Some(v) = index.apply(e)? {
        tracing::warn!(violation = %v, "the log breaks an invariant");
    }
    // A reservation's own stream holds its request, release requests,
    // activation and end (`reservation.ended`, committed with the
    // terminal fact on the pool's stream). Its version is the life
    // cycle's fence: remembered while the reservation lives, forgotten
    // once it ended.
    if let Some(id) = reservation_of(&e.stream) {
        if index.reservation(id).is_some() {
            state.versions.insert(id.to_string(), e.version);
        } else {
            state.versions.remove(id);
        }
    }
    if let Some(Fact::ReservationPlaced { reservation, .. }) = &fact {
        // A placement with a trace context: the binds and the activation
        // continue its trace.
        match events::trace::of_metadata(&e.metadata) {
            Some(tp) => {
                let span = tracing::info_span!("reservation.bind", reservation = %reservation);
                events::trace::follow(&span, &tp);
                span.in_scope(|| state.expect_binds(index, reservation, appender, stats));
                if let Some(tp) = span.in_scope(events::trace::current) {
                    state.traces.insert(reservation.clone(), tp);
                }
            }
            None => state.expect_binds(index, reservation, appender, stats),
        }
    }
    match e.event_type.as_str() {
        commands::SUCCEEDED | commands::FAILED | commands::EXPIRED => {
            let cmd = e.stream.trim_start_matches("command/");
            if let Some((res, node, n)) = state.binds.remove(cmd) {
                if e.event_type == commands::SUCCEEDED {
                    bound(state, index, appender, stats, &res, &node);
                } else {
                    let detail = serde_json::from_str::<serde_json::Value>(&e.payload)
                        .ok()
                        .and_then(|v| v["detail"].as_str().map(str::to_string))
                        .unwrap_or_default();
                    state
                        .bind_missed(
                            index,
                            appender,
                            stats,
                            (res, node, n),
                            &e.event_type,
                            &detail,
                        )
                        .await;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Placements not active yet, as the log has their binds: a node that bound
/// any attempt counts as bound; the latest attempt still open is waited
/// for; one that ended without success is handled as missed (tried again or
/// given up); a node with no attempt yet gets its first.
async fn resume_binds(
    client: &tokio_postgres::Client,
    state: &mut State,
    index: &Index,
    placed: &[String],
    appender: &Appender,
    stats: &Arc<BinderStats>,
) -> Result<(), BinderError> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for id in placed {
        if let Some(r) = index.reservation(id) {
            let nodes: BTreeSet<String> = r.allocations.iter().map(|a| a.node.clone()).collect();
            pairs.extend(nodes.iter().map(|n| (id.clone(), n.clone())));
            state.waiting.insert(id.clone(), nodes);
        }
    }
    let streams: Vec<String> = pairs
        .iter()
        .flat_map(|(r, n)| {
            (0..BIND_ATTEMPTS).map(move |i| commands::command_stream(&attempt_id(r, n, i)))
        })
        .collect();
    // Each attempt's last event and its detail.
    let mut last: HashMap<String, (String, String)> = HashMap::new();
    for row in client
        .rows(
            "SELECT DISTINCT ON (stream) stream, type, coalesce(payload->>'detail', '')
               FROM strata.events WHERE stream = ANY($1) ORDER BY stream, version DESC",
            &[&streams],
        )
        .await?
    {
        let stream: String = row.get(0);
        last.insert(
            stream.trim_start_matches("command/").to_string(),
            (row.get(1), row.get(2)),
        );
    }
    for (res, node) in pairs {
        let attempts: Vec<(u32, &(String, String))> = (0..BIND_ATTEMPTS)
            .filter_map(|i| last.get(&attempt_id(&res, &node, i)).map(|l| (i, l)))
            .collect();
        if attempts.iter().any(|(_, (t, _))| t == commands::SUCCEEDED) {
            bound(state, index, appender, stats, &res, &node);
            continue;
        }
        match attempts.last() {
            None => state.issue_bind(index, &res, &node, 0, appender, stats),
            Some((n, (t, detail))) if t == commands::FAILED || t == commands::EXPIRED => {
                let (t, detail) = (t.clone(), detail.clone());
                state
                    .bind_missed(index, appender, stats, (res, node, *n), &t, &detail)
                    .await
            }
            Some((n, _)) => {
                // Still open: wait for it (issuing it again is a no-op).
                state
                    .binds
                    .insert(attempt_id(&res, &node, *n), (res.clone(), node.clone(), *n));
            }
        }
    }
    Ok(())
}

/// Releases, on their nodes, the bindings of reservations that ended while
/// no binder ran (or before this one saw the end): every bind command in the
/// log without its release, whose reservation is no longer live in the
/// index, gets its release. The log decides, not what a binder happened to
/// see.
async fn release_ended(
    client: &tokio_postgres::Client,
    index: &Index,
    appender: &Appender,
    stats: &Arc<BinderStats>,
) -> Result<(), BinderError> {
    // `bind:<reservation>:<node>` and `release:<reservation>:<node>` share
    // their suffix (13 characters of `command/bind:`).
    let rows = client
        .rows(
            "SELECT i.payload->'args'->>'reservation', i.payload->>'node'
               FROM strata.streams b
               JOIN strata.events i ON i.stream = b.stream AND i.version = 1
              WHERE b.stream LIKE 'command/bind:%'
                AND NOT EXISTS (SELECT 1 FROM strata.streams r
                                 WHERE r.stream = 'command/release:' || substr(b.stream, 14))",
            &[],
        )
        .await?;
    let mut released = 0;
    for row in rows {
        let (Some(reservation), Some(node)) = (
            row.get::<_, Option<String>>(0),
            row.get::<_, Option<String>>(1),
        ) else {
            continue;
        };
        if index.reservation(&reservation).is_some() {
            continue;
        }
        released += 1;
        issue(
            appender,
            Command {
                id: release_id(&reservation, &node),
                node: node.clone(),
                kind: "allocation.release".into(),
                args: serde_json::json!({ "reservation": reservation }),
                deadline_ms: release_deadline(),
                issued_by: ISSUER.into(),
            },
            stats.clone(),
            true,
        );
    }
    if released > 0 {
        tracing::info!(
            released,
            "releasing the bindings of reservations that ended while no binder ran"
        );
    }
    Ok(())
}

/// A node bound its part; when all have, the reservation is active. The
/// activation is appended in the background, as commands are issued: the
/// binder goes on reading the log meanwhile, so the activations and
/// commands of many reservations share a transaction instead of each
/// waiting for the last to commit. Its fence is the version seen, not the
/// moment: a release that lands first makes it conflict.
fn bound(
    state: &mut State,
    index: &Index,
    appender: &Appender,
    stats: &Arc<BinderStats>,
    reservation: &str,
    node: &str,
) {
    let done = match state.waiting.get_mut(reservation) {
        Some(nodes) => {
            nodes.remove(node);
            nodes.is_empty()
        }
        None => false,
    };
    if !done {
        return;
    }
    state.waiting.remove(reservation);
    if index.reservation(reservation).map(|r| r.phase) != Some(Phase::Placed) {
        return;
    }
    let fact = Fact::ReservationActivated {
        reservation: reservation.to_string(),
    };
    // Only at the exact version seen: without it there is no fence, and an
    // activation could land after the reservation's end.
    let Some(seen) = state.versions.get(reservation).copied() else {
        tracing::error!(%reservation, "the version of the reservation's stream is not known; not marking it active");
        return;
    };
    let expected = ExpectedVersion::Exact(seen);
    let span = tracing::info_span!("reservation.activate", reservation = %reservation);
    if let Some(tp) = state.traces.remove(reservation) {
        events::trace::follow(&span, &tp);
    }
    let event = span.in_scope(|| events::trace::traced(fact.to_event()));
    let (appender, stats, reservation) = (appender.clone(), stats.clone(), reservation.to_string());
    use tracing::Instrument as _;
    ops::task::spawn(
        "binder-activate",
        async move {
            let stream = reservation_stream(&reservation);
            let activated = retried("mark the reservation active", &reservation, || async {
                appender
                    .append(&stream, expected, vec![event.clone()])
                    .await
                    .map(|_| ())
            });
            match activated.await {
                Ok(_) => {
                    stats.activated.fetch_add(1, Ordering::Relaxed);
                }
                Err(AppendError::VersionConflict { .. }) => tracing::info!(
                    %reservation,
                    "the reservation changed since this binder saw it (another binder activated it, or it is being released); not marking it active"
                ),
                Err(e) => tracing::error!(%reservation, error = %e, "could not mark the reservation active; giving up until the binder starts again"),
            }
        }
        .instrument(span),
    );
}
