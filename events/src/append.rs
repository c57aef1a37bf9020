//! Appending events: optimistic concurrency per stream, batches across
//! streams, and group commit.
//!
//! ```text
//!  append() --validate--> queue --> flusher 1 --BEGIN; bump streams; check; positions+insert; COMMIT--> Postgres
//!  append() --validate--> queue --> flusher 2 (takes the next batch while 1 commits)
//! ```
//!
//! Callers validate their own events (size, JSON shape, names) before they
//! queue, so a bad event never reaches a transaction. A flusher takes whatever
//! is queued (up to `max_batch_events`) and commits it as one transaction; each
//! caller is answered after that commit returned, i.e. after its WAL flush.
//! While another flusher is committing, a flusher with a small batch waits
//! (at most `batch_linger`) until it holds its share of the events in flight:
//! callers answered a moment ago come back within microseconds, and one batch
//! of a hundred events costs far less than many of a few.
//!
//! Progress: a stream's version is the count of its events; `strata.streams`
//! holds it and is bumped under its row lock. Positions come from
//! `strata.log_head`, whose row lock is taken after the stream locks and held
//! to commit: positions are gap-free and commit in order. Lock order is always
//! streams (sorted by name), then the log head, so flushers never deadlock.

use crate::db::Database;
use crate::metrics;
use crate::types::{ExpectedVersion, NewEvent, Position};
use crate::ErrorKind;
use schema::sql::Sql;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_postgres::types::{Json, Type};
use tokio_postgres::{Client, Statement};
use tracing::Instrument;

/// Why an append was refused or failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AppendError {
    /// The stream was not at the expected version. Nothing was written.
    #[error("version conflict on stream {stream:?}: expected {expected}, actual {actual}")]
    VersionConflict {
        stream: String,
        expected: ExpectedVersion,
        actual: u64,
    },
    /// The request is malformed. Nothing was written.
    #[error("invalid append: {0}")]
    Invalid(String),
    /// A payload is larger than the limit. Nothing was written.
    #[error(
        "payload of {size} bytes for event type {event_type:?} exceeds the limit of {limit} bytes"
    )]
    TooLarge {
        event_type: String,
        size: usize,
        limit: usize,
    },
    /// The database refused or could not be reached before commit. Nothing
    /// was written.
    #[error("{context}: {source}")]
    Database {
        context: &'static str,
        #[source]
        source: Arc<tokio_postgres::Error>,
    },
    /// The connection was lost while committing: the append may or may not
    /// have been committed. Read the stream (or retry with the same expected
    /// version, which conflicts if it did commit) to find out.
    #[error("the append may or may not be durable: {0}")]
    OutcomeUnknown(String),
    /// The appender has shut down.
    #[error("the appender has shut down")]
    Closed,
}

impl AppendError {
    /// Whether trying again may succeed. Exhaustive on purpose: a new variant
    /// must be classified here.
    pub fn kind(&self) -> ErrorKind {
        match self {
            AppendError::VersionConflict { .. }
            | AppendError::Invalid(_)
            | AppendError::TooLarge { .. }
            | AppendError::Closed => ErrorKind::Definite,
            AppendError::Database { source, .. } => crate::classify_pg(source),
            AppendError::OutcomeUnknown(_) => ErrorKind::Transient,
        }
    }
}

/// Events for one stream within an append.
#[derive(Debug, Clone)]
pub struct StreamAppend {
    pub stream: String,
    pub expected: ExpectedVersion,
    pub events: Vec<NewEvent>,
}

/// What an append committed for one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    pub stream: String,
    /// The stream's version after the append (= version of its last event).
    pub version: u64,
    pub first_position: Position,
    pub last_position: Position,
}

/// A clock for `recorded_at`; tests use it to cross a month boundary.
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// Limits and tuning of an [`Appender`].
#[derive(Clone)]
pub struct AppenderConfig {
    /// Most events in one group-commit transaction.
    pub max_batch_events: usize,
    /// Largest payload (and metadata) accepted, in bytes of JSON text.
    pub max_payload_bytes: usize,
    /// Most events in one append call.
    pub max_events_per_append: usize,
    /// Connections committing batches; a second one overlaps the next batch
    /// with the commit of the previous one.
    pub connections: usize,
    /// Appends that may wait in the queue before callers are slowed down.
    pub queue_capacity: usize,
    /// Longest a flusher waits for more appends while another flusher is
    /// committing, before it commits a batch smaller than its share of the
    /// appends in flight. Larger batches cost less per event; the wait ends
    /// early as soon as the share is there or the other flusher is done.
    pub batch_linger: Duration,
    /// While appends come closer together than this, the first of a batch
    /// waits this long after its arrival for more to share its
    /// transaction, whether or not another flusher is committing; an append
    /// after a longer quiet goes at once. Zero (the default) never waits
    /// past `batch_linger`'s rule. For a role whose appends are many and
    /// independent (the binder's commands and activations, a gateway's
    /// command outcomes), a few milliseconds turn many transactions of one
    /// event each into a few larger ones: the database's work per event is
    /// less, and each transaction wakes every replication slot's decoder.
    pub group_delay: Duration,
    /// Longest wait for one batch's transaction (connecting included). A
    /// database that does not answer in time (stopped, unreachable without
    /// a reset) has its connection dropped and the batch's callers are
    /// answered `OutcomeUnknown`; the next batch connects afresh.
    pub attempt_timeout: Duration,
    /// Where `recorded_at` comes from; `None` uses the database's `now()`.
    pub clock: Option<Clock>,
}

impl std::fmt::Debug for AppenderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppenderConfig")
            .field("max_batch_events", &self.max_batch_events)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("max_events_per_append", &self.max_events_per_append)
            .field("connections", &self.connections)
            .field("queue_capacity", &self.queue_capacity)
            .field("batch_linger", &self.batch_linger)
            .field("group_delay", &self.group_delay)
            .field("attempt_timeout", &self.attempt_timeout)
            .finish()
    }
}

impl Default for AppenderConfig {
    fn default() -> Self {
        AppenderConfig {
            max_batch_events: 4096,
            max_payload_bytes: 1 << 20,
            max_events_per_append: 10_000,
            connections: 2,
            queue_capacity: 16_384,
            batch_linger: Duration::from_millis(1),
            group_delay: Duration::ZERO,
            attempt_timeout: Duration::from_secs(30),
            clock: None,
        }
    }
}

struct Request {
    appends: Vec<StreamAppend>,
    events: usize,
    started: Instant,
    /// It came within the group delay of the append before it.
    dense: bool,
    reply: oneshot::Sender<Result<Vec<Appended>, AppendError>>,
    _counted: InFlight,
}

/// What the flushers share to size their batches: how many events callers
/// have in flight (queued or being committed), and a signal each time a
/// flusher finishes a batch.
struct Pace {
    in_flight: AtomicUsize,
    busy: AtomicUsize,
    /// When the last append arrived, in nanoseconds since `epoch`.
    last_arrival: std::sync::atomic::AtomicU64,
    epoch: Instant,
    finished: tokio::sync::watch::Sender<u64>,
}

impl Pace {
    /// Notes an append arriving at `at`; whether it came within `delay` of
    /// the one before it (never, with no delay).
    fn arrived(&self, at: Instant, delay: Duration) -> bool {
        let now = at.saturating_duration_since(self.epoch).as_nanos() as u64 + 1;
        let last = self.last_arrival.swap(now, Relaxed);
        !delay.is_zero() && last != 0 && now.saturating_sub(last) < delay.as_nanos() as u64
    }
}

/// Marks a flusher busy committing a batch; when dropped, the flusher is
/// idle again and waiting flushers are told.
struct Busy(Arc<Pace>);

impl Busy {
    fn start(pace: Arc<Pace>) -> Busy {
        pace.busy.fetch_add(1, Relaxed);
        Busy(pace)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Relaxed);
        self.0.finished.send_modify(|n| *n += 1);
    }
}

/// Counts a request's events in flight until it is answered or dropped.
struct InFlight {
    pace: Arc<Pace>,
    events: usize,
}

impl InFlight {
    fn count(pace: Arc<Pace>, events: usize) -> InFlight {
        pace.in_flight.fetch_add(events, Relaxed);
        InFlight { pace, events }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.pace.in_flight.fetch_sub(self.events, Relaxed);
    }
}

/// Appends events with group commit. Cheap to clone; all clones share the
/// queue and the flushers. The flushers stop when every clone is dropped.
#[derive(Clone)]
pub struct Appender {
    tx: mpsc::Sender<Request>,
    config: Arc<AppenderConfig>,
    pace: Arc<Pace>,
}

impl Appender {
    /// Starts the flushers against the database at `db`. Connections are made
    /// lazily and re-made after a failure.
    pub fn start(db: impl Into<Database>, config: AppenderConfig) -> Appender {
        let db = db.into();
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        let rx = Arc::new(Mutex::new(rx));
        let config = Arc::new(config);
        let pace = Arc::new(Pace {
            in_flight: Default::default(),
            busy: Default::default(),
            last_arrival: Default::default(),
            epoch: Instant::now(),
            finished: tokio::sync::watch::channel(0).0,
        });
        for _ in 0..config.connections.max(1) {
            let flusher = Flusher {
                db: db.clone(),
                config: config.clone(),
                conn: None,
                pace: pace.clone(),
            };
            ops::task::spawn("append-flusher", flusher.run(rx.clone()));
        }
        Appender { tx, config, pace }
    }

    /// Appends `events` to `stream` if it is at `expected`.
    pub async fn append(
        &self,
        stream: &str,
        expected: ExpectedVersion,
        events: Vec<NewEvent>,
    ) -> Result<Appended, AppendError> {
        let mut out = self
            .append_batch(vec![StreamAppend {
                stream: stream.to_string(),
                expected,
                events,
            }])
            .await?;
        out.pop().ok_or(AppendError::Closed)
    }

    /// Appends to several streams in one transaction: all or nothing.
    pub async fn append_batch(
        &self,
        appends: Vec<StreamAppend>,
    ) -> Result<Vec<Appended>, AppendError> {
        let events = validate(&appends, &self.config)?;
        let span = tracing::info_span!("append", streams = appends.len(), events);
        let (reply, rx) = oneshot::channel();
        let started = Instant::now();
        let req = Request {
            appends,
            events,
            started,
            dense: self.pace.arrived(started, self.config.group_delay),
            reply,
            _counted: InFlight::count(self.pace.clone(), events),
        };
        async move {
            self.tx.send(req).await.map_err(|_| AppendError::Closed)?;
            rx.await.map_err(|_| AppendError::Closed)?
        }
        .instrument(span)
        .await
    }
}

/// Appends inside the caller's open transaction, so that the events commit or
/// roll back with whatever else the transaction writes: a row and the event
/// recording its change cannot part. Validated like [`Appender::append_batch`]
/// (with `config`'s limits); streams are locked in name order, then the log
/// head, whose row lock is held until the caller's transaction ends, so keep
/// the rest of it short. On a version conflict nothing of this call is kept
/// (it runs under a savepoint) and the transaction stays usable. The events
/// are durable when the caller's commit is (with `synchronous_commit` on).
pub async fn append_in(
    tx: &(impl tokio_postgres::GenericClient + Sync),
    appends: Vec<StreamAppend>,
    config: &AppenderConfig,
) -> Result<Vec<Appended>, AppendError> {
    let total = validate(&appends, config)?;
    let mut order: Vec<&StreamAppend> = appends.iter().collect();
    order.sort_by(|a, b| a.stream.cmp(&b.stream));
    let names: Vec<&str> = order.iter().map(|a| a.stream.as_str()).collect();
    let adds: Vec<i64> = order.iter().map(|a| a.events.len() as i64).collect();
    tx.batch_execute("SAVEPOINT strata_append")
        .await
        .map_err(db_err("begin an append"))?;
    let rows = match tx
        .rows(BUMP_SQL, &[&names, &adds])
        .await
        .map_err(db_err("lock and bump stream versions"))
    {
        Ok(rows) => rows,
        Err(e) => {
            let _ = tx
                .batch_execute("ROLLBACK TO SAVEPOINT strata_append")
                .await;
            return Err(e);
        }
    };
    let mut before: BTreeMap<String, u64> = BTreeMap::new();
    for row in rows {
        let new: i64 = row.get(1);
        before.insert(row.get(0), new.max(0) as u64);
    }
    for a in &appends {
        let after = before.get(&a.stream).copied().unwrap_or(0);
        let actual = after.saturating_sub(a.events.len() as u64);
        if !a.expected.admits(actual) {
            tx.batch_execute("ROLLBACK TO SAVEPOINT strata_append")
                .await
                .map_err(db_err("roll back a conflicting append"))?;
            metrics::global().append_conflicts.inc();
            return Err(AppendError::VersionConflict {
                stream: a.stream.clone(),
                expected: a.expected,
                actual,
            });
        }
    }
    let mut rows = Rows::with_capacity(total);
    for a in &appends {
        rows.push(a, before[&a.stream] - a.events.len() as u64);
    }
    let recorded_at = config.clock.as_ref().map(|c| c());
    let row = tx.one(INSERT_SQL, &rows.params(&recorded_at)).await;
    let row = match row {
        Ok(row) => row,
        Err(e) => {
            let _ = tx
                .batch_execute("ROLLBACK TO SAVEPOINT strata_append")
                .await;
            return Err(db_err("insert events")(e));
        }
    };
    tx.batch_execute("RELEASE SAVEPOINT strata_append")
        .await
        .map_err(db_err("finish an append"))?;
    metrics::global().append_in_events.inc_by(total as u64);
    let base: i64 = row.get(0);
    let mut next = base as u64 + 1;
    Ok(appends
        .iter()
        .map(|a| {
            let first = next;
            next += a.events.len() as u64;
            Appended {
                stream: a.stream.clone(),
                version: before[&a.stream],
                first_position: Position(first),
                last_position: Position(next - 1),
            }
        })
        .collect())
}

/// [`append_in`] for one stream, with the default limits: the in-transaction
/// counterpart of [`Appender::append`].
pub async fn append_one_in(
    tx: &(impl tokio_postgres::GenericClient + Sync),
    stream: String,
    expected: ExpectedVersion,
    events: Vec<NewEvent>,
) -> Result<Appended, AppendError> {
    let append = StreamAppend {
        stream,
        expected,
        events,
    };
    let mut out = append_in(tx, vec![append], &AppenderConfig::default()).await?;
    out.pop().ok_or(AppendError::Closed)
}

const MAX_STREAM_LEN: usize = 256;
const MAX_TYPE_LEN: usize = 128;

/// Checks an append before it is queued; returns its event count.
pub fn validate(appends: &[StreamAppend], config: &AppenderConfig) -> Result<usize, AppendError> {
    if appends.is_empty() {
        return Err(AppendError::Invalid(
            "an append needs at least one stream".into(),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    let mut total = 0usize;
    for a in appends {
        validate_stream(&a.stream)?;
        if !seen.insert(a.stream.as_str()) {
            return Err(AppendError::Invalid(format!(
                "stream {:?} appears twice in one append; put its events in one entry",
                a.stream
            )));
        }
        if a.events.is_empty() {
            return Err(AppendError::Invalid(format!(
                "no events for stream {:?}",
                a.stream
            )));
        }
        for e in &a.events {
            validate_type(&e.event_type)?;
            validate_json(
                &e.event_type,
                "payload",
                &e.payload,
                config.max_payload_bytes,
            )?;
            if let Some(m) = &e.metadata {
                validate_json(&e.event_type, "metadata", m, config.max_payload_bytes)?;
            }
        }
        total += a.events.len();
    }
    if total > config.max_events_per_append {
        return Err(AppendError::Invalid(format!(
            "{total} events in one append; the limit is {}",
            config.max_events_per_append
        )));
    }
    Ok(total)
}

fn validate_stream(s: &str) -> Result<(), AppendError> {
    if s.is_empty() || s.len() > MAX_STREAM_LEN {
        return Err(AppendError::Invalid(format!(
            "stream name must be 1 to {MAX_STREAM_LEN} bytes, got {}",
            s.len()
        )));
    }
    if s.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(AppendError::Invalid(format!(
            "stream name {s:?} contains whitespace or control characters"
        )));
    }
    Ok(())
}

fn validate_type(t: &str) -> Result<(), AppendError> {
    if t.is_empty() || t.len() > MAX_TYPE_LEN {
        return Err(AppendError::Invalid(format!(
            "event type must be 1 to {MAX_TYPE_LEN} bytes, got {}",
            t.len()
        )));
    }
    if !t
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':' | '/'))
    {
        return Err(AppendError::Invalid(format!(
            "event type {t:?} may use only ASCII letters, digits and . _ - : /"
        )));
    }
    Ok(())
}

fn validate_json(
    event_type: &str,
    what: &str,
    v: &RawValue,
    limit: usize,
) -> Result<(), AppendError> {
    let text = v.get();
    if text.len() > limit {
        return Err(AppendError::TooLarge {
            event_type: event_type.to_string(),
            size: text.len(),
            limit,
        });
    }
    if !text.trim_start().starts_with('{') {
        return Err(AppendError::Invalid(format!(
            "{what} of event type {event_type:?} must be a JSON object"
        )));
    }
    // jsonb cannot store the NUL character; find it before Postgres does.
    if text.contains("\\u0000") {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| AppendError::Invalid(format!("{what} is not valid JSON: {e}")))?;
        if has_nul(&value) {
            return Err(AppendError::Invalid(format!(
                "{what} of event type {event_type:?} contains a NUL character (\\u0000), which Postgres cannot store"
            )));
        }
    }
    Ok(())
}

fn has_nul(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(a) => a.iter().any(has_nul),
        serde_json::Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

struct Conn {
    client: Client,
    /// The statements prepared once, on a direct connection; through a
    /// pooler each batch sends them unnamed (a prepared statement would stay
    /// on whichever server connection the pooler lent).
    prepared: Option<(Statement, Statement)>,
    /// The task driving the connection: ended with it, so a connection
    /// dropped because the server stopped answering does not linger.
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Flusher {
    db: Database,
    config: Arc<AppenderConfig>,
    conn: Option<Conn>,
    pace: Arc<Pace>,
}

const BUMP_SQL: &str = "
INSERT INTO strata.streams AS s (stream, version)
SELECT * FROM unnest($1::text[], $2::bigint[])
ON CONFLICT (stream) DO UPDATE SET version = s.version + excluded.version, updated_at = now()
RETURNING s.stream, s.version";

// The insert runs to completion although nothing reads it (a data-modifying
// WITH always does); returning no rows from it spares a tuplestore per event.
//
// The head moves to the next epoch's start on the first append on a new
// timeline (`strata.log_epochs`, migration 15): the insert timeline is the
// first eight hex digits of the current WAL file's name.
const INSERT_SQL: &str = "
WITH tl AS (
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer AS t
), head AS (
    UPDATE strata.log_head h
       SET last_position = CASE WHEN h.timeline < tl.t
                                THEN greatest(h.last_position, (tl.t - 1)::bigint << 40)
                                ELSE h.last_position END + $1,
           epoch_from = CASE WHEN h.timeline < tl.t THEN h.last_position END,
           timeline = tl.t
      FROM tl
    RETURNING h.last_position - $1 AS base, h.epoch_from, h.timeline
), epoch AS (
    INSERT INTO strata.log_epochs (first_position, previous_head, timeline)
    SELECT base + 1, epoch_from, timeline FROM head WHERE epoch_from IS NOT NULL
), ins AS (
    INSERT INTO strata.events (position, stream, version, type, payload, metadata, recorded_at)
    SELECT h.base + e.ord, e.stream, e.version, e.type, e.payload, e.metadata, coalesce($7, now())
      FROM head h,
           unnest($2::text[], $3::bigint[], $4::text[], $5::jsonb[], $6::jsonb[])
             WITH ORDINALITY AS e(stream, version, type, payload, metadata, ord)
)
SELECT h.base FROM head h";

/// The event insert's parameters: one array entry per event.
struct Rows<'a> {
    n: i64,
    streams: Vec<&'a str>,
    versions: Vec<i64>,
    types: Vec<&'a str>,
    payloads: Vec<Json<&'a RawValue>>,
    metas: Vec<Json<&'a RawValue>>,
}

impl<'a> Rows<'a> {
    fn with_capacity(n: usize) -> Self {
        Rows {
            n: 0,
            streams: Vec::with_capacity(n),
            versions: Vec::with_capacity(n),
            types: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            metas: Vec::with_capacity(n),
        }
    }

    /// Adds `a`'s events, numbered on from its stream's version `from`.
    fn push(&mut self, a: &'a StreamAppend, from: u64) {
        let empty = empty_object();
        for (j, e) in a.events.iter().enumerate() {
            self.streams.push(a.stream.as_str());
            self.versions.push((from + 1 + j as u64) as i64);
            self.types.push(e.event_type.as_str());
            self.payloads.push(Json(&*e.payload));
            self.metas
                .push(Json(e.metadata.as_deref().unwrap_or(empty)));
        }
        self.n += a.events.len() as i64;
    }

    /// The parameters of [`INSERT_SQL`].
    fn params<'b>(
        &'b self,
        recorded_at: &'b Option<SystemTime>,
    ) -> [&'b dyn schema::sql::Param; 7] {
        [
            &self.n,
            &self.streams,
            &self.versions,
            &self.types,
            &self.payloads,
            &self.metas,
            recorded_at,
        ]
    }
}

/// Outcome of one attempt at committing a batch.
enum Attempt {
    Committed(Vec<Vec<Appended>>),
    /// These requests (indices) conflict; retry without them.
    Conflicts(Vec<(usize, AppendError)>),
}

impl Flusher {
    async fn run(mut self, rx: Arc<Mutex<mpsc::Receiver<Request>>>) {
        loop {
            let Some((batch, busy)) = self.take_batch(&rx).await else {
                return;
            };
            let events: usize = batch.iter().map(|r| r.events).sum();
            let span = tracing::info_span!("append.batch", requests = batch.len(), events);
            self.flush(batch).instrument(span).await;
            drop(busy);
        }
    }

    /// Takes the next batch: whatever is queued, and, while another flusher
    /// is committing, more as it arrives until this batch holds its share of
    /// the events in flight (so that callers answered a moment ago join it
    /// instead of trickling into many small batches), the other flusher
    /// finishes, or `batch_linger` has passed. `None` once the appender is
    /// gone. The returned guard marks this flusher busy until dropped.
    async fn take_batch(
        &self,
        rx: &Mutex<mpsc::Receiver<Request>>,
    ) -> Option<(Vec<Request>, Busy)> {
        let mut finished = self.pace.finished.subscribe();
        let mut rx = rx.lock().await;
        let first = rx.recv().await?;
        let max = self.config.max_batch_events;
        let share = self.config.connections.max(1);
        let mut n = first.events;
        // Appends coming close together: the first waits for company.
        let group = first
            .dense
            .then(|| tokio::time::Instant::from_std(first.started + self.config.group_delay));
        let mut batch = vec![first];
        let linger = tokio::time::sleep(self.config.batch_linger);
        tokio::pin!(linger);
        loop {
            while n < max {
                match rx.try_recv() {
                    Ok(r) => {
                        n += r.events;
                        batch.push(r);
                    }
                    Err(_) => break,
                }
            }
            let grouping = group.is_some_and(|g| tokio::time::Instant::now() < g);
            if n >= max
                || (!grouping
                    && (self.pace.busy.load(Relaxed) == 0
                        || n * share >= self.pace.in_flight.load(Relaxed)))
            {
                break;
            }
            let grouped = tokio::time::sleep_until(group.unwrap_or_else(tokio::time::Instant::now));
            tokio::select! {
                r = rx.recv() => match r {
                    Some(r) => {
                        n += r.events;
                        batch.push(r);
                    }
                    None => break,
                },
                _ = finished.changed(), if !grouping => {}
                _ = &mut linger, if !grouping => break,
                _ = grouped, if grouping => {}
            }
        }
        // Busy before the queue is released: the next flusher to look sees
        // this batch as one being committed.
        Some((batch, Busy::start(self.pace.clone())))
    }

    async fn connect(&mut self) -> Result<&Conn, AppendError> {
        if self.conn.as_ref().is_some_and(|c| c.client.is_closed()) {
            self.conn = None;
        }
        if self.conn.is_none() {
            let (client, task) = crate::db::open(&self.db, "append-connection")
                .await
                .map_err(db_err("connect to postgres"))?;
            let prepared = if self.db.pooled() {
                None
            } else {
                // The statements' shapes do not depend on their arrays'
                // contents: plan them once instead of per execution.
                client
                    .batch_execute("SET plan_cache_mode = force_generic_plan")
                    .await
                    .map_err(db_err("configure the append connection"))?;
                let bump = client
                    .prepare_typed(BUMP_SQL, &[Type::TEXT_ARRAY, Type::INT8_ARRAY])
                    .await
                    .map_err(prepare_err("prepare the stream version statement"))?;
                let insert = client
                    .prepare_typed(
                        INSERT_SQL,
                        &[
                            Type::INT8,
                            Type::TEXT_ARRAY,
                            Type::INT8_ARRAY,
                            Type::TEXT_ARRAY,
                            Type::JSONB_ARRAY,
                            Type::JSONB_ARRAY,
                            Type::TIMESTAMPTZ,
                        ],
                    )
                    .await
                    .map_err(prepare_err("prepare the event insert"))?;
                Some((bump, insert))
            };
            self.conn = Some(Conn {
                client,
                prepared,
                task,
            });
        }
        Ok(self.conn.as_ref().expect("connected above"))
    }

    async fn flush(&mut self, batch: Vec<Request>) {
        let mut live: Vec<Option<Request>> = batch.into_iter().map(Some).collect();
        let mut partition_retry = true;
        loop {
            let idx: Vec<usize> = (0..live.len()).filter(|i| live[*i].is_some()).collect();
            if idx.is_empty() {
                return;
            }
            let reqs: Vec<&Request> = idx
                .iter()
                .map(|i| live[*i].as_ref().expect("live"))
                .collect();
            let recorded_at = self.config.clock.as_ref().map(|c| c());
            let limit = self.config.attempt_timeout;
            let result = match tokio::time::timeout(limit, self.attempt(&reqs, recorded_at)).await {
                Ok(r) => r,
                Err(_) => {
                    metrics::global().append_timeouts.inc();
                    tracing::warn!(
                        timeout_ms = limit.as_millis() as u64,
                        "the database did not answer an append in time; dropping its connection"
                    );
                    Err(AppendError::OutcomeUnknown(format!(
                        "the database did not answer within {limit:?}; the connection was dropped"
                    )))
                }
            };
            match result {
                Ok(Attempt::Committed(outs)) => {
                    let m = metrics::global();
                    let n: usize = reqs.iter().map(|r| r.events).sum();
                    m.append_events.inc_by(n as u64);
                    m.append_transactions.inc();
                    m.append_batch_size.observe(n as f64);
                    for (i, out) in idx.into_iter().zip(outs) {
                        let req = live[i].take().expect("live");
                        m.append_duration
                            .observe(req.started.elapsed().as_secs_f64());
                        let _ = req.reply.send(Ok(out));
                    }
                    return;
                }
                Ok(Attempt::Conflicts(conflicts)) => {
                    metrics::global()
                        .append_conflicts
                        .inc_by(conflicts.len() as u64);
                    // A conflict is judged against versions that other
                    // batches may have committed a moment ago; answer once
                    // those are durable too.
                    let durable = match &self.conn {
                        Some(c) => crate::read::flush_barrier(&c.client).await.is_ok(),
                        None => false,
                    };
                    for (k, err) in conflicts {
                        if let Some(req) = live[idx[k]].take() {
                            let err = if durable {
                                err
                            } else {
                                AppendError::OutcomeUnknown(format!(
                                    "{err}, but the versions it was judged against could not be confirmed durable"
                                ))
                            };
                            let _ = req.reply.send(Err(err));
                        }
                    }
                }
                Err(AppendError::Database { source, .. })
                    if partition_retry && is_missing_partition(&source) =>
                {
                    // Only reached if partition maintenance fell behind: make
                    // the month and try once more.
                    partition_retry = false;
                    let at = recorded_at.unwrap_or_else(SystemTime::now);
                    tracing::warn!("no partition for the month being written; creating it");
                    if let Some(c) = &self.conn {
                        if let Err(e) = schema::partitions::ensure_for(&c.client, at).await {
                            tracing::error!(error = %e, "could not create the missing partition");
                        }
                    }
                }
                Err(err) => {
                    if err.kind() == ErrorKind::Transient {
                        self.conn = None;
                    }
                    for i in idx {
                        if let Some(req) = live[i].take() {
                            let _ = req.reply.send(Err(err.clone()));
                        }
                    }
                    // Do not spin against a database that is down.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return;
                }
            }
        }
    }

    async fn attempt(
        &mut self,
        reqs: &[&Request],
        recorded_at: Option<SystemTime>,
    ) -> Result<Attempt, AppendError> {
        // How many events each stream gets in this batch (sorted by name,
        // which is also the order rows are locked in).
        let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
        for r in reqs {
            for a in &r.appends {
                *counts.entry(a.stream.as_str()).or_default() += a.events.len() as i64;
            }
        }
        let names: Vec<&str> = counts.keys().copied().collect();
        let adds: Vec<i64> = counts.values().copied().collect();
        let begin = begin_sql(self.config.attempt_timeout);
        let conn = self.connect().await?;
        // The opening and the bump go out together, in one round trip. The
        // bump cannot run outside the transaction: only a failure of the
        // connection stops BEGIN, and then nothing after it runs either; a
        // failed SET LOCAL leaves the transaction aborted, and the bump
        // fails with it.
        let bump = async {
            match &conn.prepared {
                Some((bump, _)) => conn.client.query(bump, &[&names, &adds]).await,
                None => conn.client.rows(BUMP_SQL, &[&names, &adds]).await,
            }
        };
        let (begun, bumped) = tokio::join!(conn.client.batch_execute(&begin), bump);
        if let Err(e) = begun {
            let _ = conn.client.batch_execute("ROLLBACK").await;
            return Err(db_err("begin an append")(e));
        }
        let rows = match bumped {
            Ok(rows) => rows,
            Err(e) => {
                let _ = conn.client.batch_execute("ROLLBACK").await;
                return Err(db_err("lock and bump stream versions")(e));
            }
        };
        // The version each stream had before this batch, then as each
        // request in order would see it.
        let mut running: BTreeMap<&str, u64> = BTreeMap::new();
        for row in rows {
            let stream: &str = row.get(0);
            let new: i64 = row.get(1);
            if let Some((name, add)) = counts.get_key_value(stream) {
                running.insert(name, (new - add).max(0) as u64);
            }
        }
        // Check each request against the versions it would see; a plan is
        // (version before, version after) per stream of the request.
        let mut conflicts = Vec::new();
        let mut planned: Vec<Vec<(u64, u64)>> = Vec::with_capacity(reqs.len());
        for (k, r) in reqs.iter().enumerate() {
            let mut plan = Vec::with_capacity(r.appends.len());
            let mut conflict = None;
            for a in &r.appends {
                let actual = running.get(a.stream.as_str()).copied().unwrap_or(0);
                if !a.expected.admits(actual) {
                    conflict = Some(AppendError::VersionConflict {
                        stream: a.stream.clone(),
                        expected: a.expected,
                        actual,
                    });
                    break;
                }
                plan.push((actual, actual + a.events.len() as u64));
            }
            match conflict {
                Some(e) => conflicts.push((k, e)),
                None => {
                    for (a, (_, to)) in r.appends.iter().zip(&plan) {
                        running.insert(a.stream.as_str(), *to);
                    }
                    planned.push(plan);
                }
            }
        }
        if !conflicts.is_empty() {
            conn.client
                .batch_execute("ROLLBACK")
                .await
                .map_err(db_err("roll back a conflicting batch"))?;
            return Ok(Attempt::Conflicts(conflicts));
        }
        // Every request passes: insert the events with their versions.
        let total: usize = reqs.iter().map(|r| r.events).sum();
        let mut rows = Rows::with_capacity(total);
        for (r, plan) in reqs.iter().zip(&planned) {
            for (a, (from, _)) in r.appends.iter().zip(plan) {
                rows.push(a, *from);
            }
        }
        // The insert and the commit go out together, so no round trip to us
        // happens while the log head is held. If the insert fails, the
        // transaction is aborted and COMMIT only rolls it back.
        //
        // The commit is asynchronous: it releases the log head at once (no
        // WAL flush inside the lock). The flush barrier that follows in the
        // same message runs in a transaction of its own and returns once the
        // commit is durable, while the other flusher already holds the log
        // head. Once COMMIT is sent, a failure leaves the outcome unknown.
        let params = rows.params(&recorded_at);
        let insert = async {
            match &conn.prepared {
                Some((_, insert)) => {
                    let p = params.map(|p| p.as_sql());
                    conn.client.query_one(insert, &p).await
                }
                None => conn.client.one(INSERT_SQL, &params).await,
            }
        };
        let (inserted, committed) =
            tokio::join!(insert, conn.client.batch_execute(&COMMIT_AND_FLUSH));
        let row = match inserted {
            Ok(row) => row,
            Err(e) => return Err(db_err("insert events")(e)),
        };
        if let Err(e) = committed {
            return Err(AppendError::OutcomeUnknown(format!(
                "commit or WAL flush failed: {e}"
            )));
        }
        let base: i64 = row.get(0);
        // Hand out positions in the order the rows were inserted.
        let mut next = base as u64 + 1;
        let mut outs = Vec::with_capacity(reqs.len());
        for (r, plan) in reqs.iter().zip(planned) {
            let mut out = Vec::with_capacity(r.appends.len());
            for (a, (_, to)) in r.appends.iter().zip(plan) {
                let first = next;
                next += a.events.len() as u64;
                out.push(Appended {
                    stream: a.stream.clone(),
                    version: to,
                    first_position: Position(first),
                    last_position: Position(next - 1),
                });
            }
            outs.push(out);
        }
        Ok(Attempt::Committed(outs))
    }
}

/// An append's opening. Its commit is asynchronous (see
/// [`COMMIT_AND_FLUSH`]), and the server ends the transaction, releasing
/// its streams' row locks and the log head, once it has waited for the
/// client's next statement as long as the client waits for the whole batch
/// (`idle_in_transaction_session_timeout`): an appender cut off from the
/// server between two statements (a link gone silent, no reset ever sent)
/// would otherwise hold the rows of every stream in its batch until the
/// server's TCP keepalive gave up on it, hours later, and every other
/// writer of those streams would wait on them.
fn begin_sql(limit: Duration) -> String {
    format!(
        "BEGIN; SET LOCAL synchronous_commit TO off; \
         SET LOCAL idle_in_transaction_session_timeout = {}",
        limit.as_millis().max(1)
    )
}

/// The append's asynchronous commit followed by the flush barrier, sent as
/// one message.
static COMMIT_AND_FLUSH: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("COMMIT; {}", crate::read::FLUSH_BARRIER_SQL));

/// A statement could not be prepared. A duplicate or missing prepared
/// statement is what a connection pooler in transaction mode does to a
/// client that believes it is talking to the server: say so.
fn prepare_err(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> AppendError {
    move |source| {
        use tokio_postgres::error::SqlState;
        let pooler = matches!(
            source.code(),
            Some(c) if *c == SqlState::DUPLICATE_PSTATEMENT || *c == SqlState::INVALID_SQL_STATEMENT_NAME
        );
        let context = if pooler {
            "prepare the append statements (is a connection pooler in transaction mode, such as PgBouncer, in between? then give PostgreSQL itself as the direct URL, --database-direct-url, so that statements go unnamed)"
        } else {
            context
        };
        db_err(context)(source)
    }
}

/// Wraps a database error with what was being done.
fn db_err(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> AppendError {
    move |source| AppendError::Database {
        context,
        source: Arc::new(source),
    }
}

/// `{}`, the metadata of an event that has none.
fn empty_object() -> &'static RawValue {
    static EMPTY: std::sync::OnceLock<Box<RawValue>> = std::sync::OnceLock::new();
    EMPTY.get_or_init(|| RawValue::from_string("{}".into()).expect("{} is JSON"))
}

fn is_missing_partition(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION)
        && e.as_db_error()
            .is_some_and(|d| d.message().contains("no partition"))
}
