//! The replication reader: one per process. It owns one logical slot, decodes
//! each transaction once, and fans it out to every attached subscription.
//!
//! ```text
//!  slot --pgoutput--> ReplicationConnection --frames--> Assembler --Txn--> Arc<Txn>
//!                                                                          |  try_send (never blocks)
//!                                 +------------------+---------------------+
//!                                 v                  v
//!                          subscription A      subscription B   (full or gone: detached,
//!                                 |                  |           it reads the table instead)
//!                        durable cursor A    durable cursor B
//!                                 +--------min-------+--> standby status (flush LSN) to Postgres
//! ```
//!
//! Progress: the reader keeps, for each delivered transaction, its last
//! position and the LSN just past its commit. The slot is acknowledged up to
//! the newest transaction whose last position every attached subscription has
//! made durable. A subscription that holds back more than `max_retained_wal`
//! bytes is detached and catches up from the table, so no subscriber can make
//! Postgres keep WAL without bound, and none can stall the others.
//!
//! A slot created here exports a snapshot; the last position visible in it is
//! recorded as the slot's base: everything after it arrives through the slot.
//! An invalidated slot (its WAL removed) is reported loudly, dropped and made
//! again; subscriptions then fill the difference from the table, by position.
//!
//! A reader given a share (`ReaderConfig::share_from`, see `share`) takes
//! its transactions from another process's reader on the host instead
//! (`share_session`); once the share has sent nothing for its silence, it
//! decodes the log itself through a temporary slot until the share answers
//! again. Its subscriptions see the same `Head` and `Txn` either way.

use crate::assemble::Assembler;
use crate::db::Database;
use crate::db::SharedClient;
use crate::metrics;
use crate::pgoutput::ReplicationMessage;
use crate::replication::{self, Frame, ReplicationConnection, ReplicationError};
use crate::session_error::{bounded, sql, SessionError};
use crate::standby_gate::StandbyGate;
use crate::types::{Lsn, Position, Txn};
use crate::ErrorKind;
use schema::sql::Sql;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;
use tokio_postgres::Client;

/// Settings of a [`Reader`].
#[derive(Debug, Clone)]
pub struct ReaderConfig {
    /// The slot's name: lower-case letters, digits and underscores.
    pub slot: String,
    /// A temporary slot disappears with the connection (for ad-hoc tails).
    pub temporary: bool,
    /// The publication to stream.
    pub publication: String,
    /// How often a standby status update is sent unasked.
    pub status_interval: Duration,
    /// How often the reader records that it is alive.
    pub heartbeat_interval: Duration,
    /// Most WAL one subscription may hold back before it is detached.
    pub max_retained_wal: u64,
    /// Transactions buffered per subscription before it counts as too slow.
    pub subscriber_buffer: usize,
    /// Who runs this reader, shown by `strata slots list`.
    pub owner: String,
    /// Time to live of a named subscription's lease (renewed every third of
    /// it): how long a subscription held by a process that died stays
    /// unavailable to others.
    pub subscription_lease_ttl: Duration,
    /// Longest wait for one of the reader's own statements (its heartbeat,
    /// recording what it acknowledged). A server that does not answer in
    /// time (stopped, unreachable without a reset) ends the session: its
    /// connections are dropped and the reader connects again with backoff.
    pub query_timeout: Duration,
    /// Follow the log through the share at this socket (another process's
    /// reader on this host, `share::serve`) instead of a slot of its own.
    pub share_from: Option<std::path::PathBuf>,
    /// With `share_from`: how long the share may send nothing (it sends a
    /// keepalive every second) before it counts as gone and the reader
    /// connects again.
    pub share_silence: Duration,
}

impl ReaderConfig {
    pub fn new(slot: impl Into<String>) -> Self {
        ReaderConfig {
            slot: slot.into(),
            temporary: false,
            publication: "strata_events".into(),
            status_interval: Duration::from_secs(1),
            heartbeat_interval: Duration::from_secs(5),
            query_timeout: Duration::from_secs(30),
            max_retained_wal: 256 << 20,
            subscriber_buffer: 4096,
            owner: "strata".into(),
            subscription_lease_ttl: Duration::from_secs(15),
            share_from: None,
            share_silence: Duration::from_secs(5),
        }
    }
}

/// What the reader sends a subscription.
#[derive(Debug, Clone)]
pub(crate) enum Live {
    /// A committed transaction.
    Txn(Arc<Txn>),
    /// Every position up to this one is committed and readable from the
    /// table; later ones will arrive as `Txn`. Sent when a subscription
    /// attaches and when a replication session starts, so a subscription never
    /// waits on the stream for something that only the table has.
    Head(Position),
}

/// Sends to every attached subscription without blocking; one that is full
/// or gone is detached (it goes back to reading the table).
fn broadcast(attached: &mut Vec<Attached>, msg: Live) {
    attached.retain(|a| match a.tx.try_send(msg.clone()) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            tracing::warn!(subscription = %a.name, "subscription is too slow for the live stream; it continues from the table");
            false
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    });
}

pub(crate) struct Attached {
    pub name: String,
    pub tx: mpsc::Sender<Live>,
    pub durable: Arc<AtomicU64>,
}

enum Cmd {
    Attach(Attached),
}

pub(crate) struct Inner {
    pub db: SharedClient,
    pub config: ReaderConfig,
    cmd: mpsc::UnboundedSender<Cmd>,
    /// The last position delivered by the slot.
    pub head: AtomicU64,
    /// When the transaction ending at `head` committed (ms since the epoch;
    /// 0 until one arrived).
    pub head_at_ms: AtomicU64,
    /// A replication session is streaming now.
    pub streaming: std::sync::atomic::AtomicBool,
    /// The LSN acknowledged to Postgres.
    pub acked: AtomicU64,
    /// Number of (re)connections so far.
    pub sessions: AtomicU64,
    /// Times the slot was found invalidated and made again.
    pub invalidations: AtomicU64,
    /// Times the slot this reader had streamed from was missing (a promoted
    /// standby, a dropped slot) and was made again.
    pub slots_missing: AtomicU64,
    /// Sessions ended because the database did not answer in time.
    pub timeouts: AtomicU64,
    /// Times the slot was found ahead of what this reader acknowledged.
    pub slot_ahead: AtomicU64,
    /// Named subscriptions this process holds, until their lease is let go:
    /// a second open of a name held here is refused at once, and one right
    /// after a drop waits for the lease's release.
    pub(crate) held:
        std::sync::Mutex<std::collections::HashMap<String, Arc<crate::cursor::Cursor>>>,
}

/// A handle on the process's replication reader. Cheap to clone; the reader
/// stops when every handle and subscription is dropped.
#[derive(Clone)]
pub struct Reader {
    pub(crate) inner: Arc<Inner>,
    _life: Arc<Life>,
}

/// Dropped with the last handle: tells the reader task to stop. The task
/// itself holds `Inner`, so `Inner` cannot carry this signal.
struct Life(std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>);

impl Drop for Life {
    fn drop(&mut self) {
        if let Some(tx) = self.0.lock().ok().and_then(|mut g| g.take()) {
            let _ = tx.send(());
        }
    }
}

impl Reader {
    /// Starts the reader for the database at `db`.
    pub fn start(db: impl Into<Database>, config: ReaderConfig) -> Reader {
        let (cmd, rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            db: SharedClient::new(db),
            config,
            cmd,
            head: AtomicU64::new(0),
            head_at_ms: AtomicU64::new(0),
            streaming: std::sync::atomic::AtomicBool::new(false),
            acked: AtomicU64::new(0),
            sessions: AtomicU64::new(0),
            invalidations: AtomicU64::new(0),
            slots_missing: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            slot_ahead: AtomicU64::new(0),
            held: std::sync::Mutex::new(std::collections::HashMap::new()),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        ops::task::spawn("replication-reader", run(inner.clone(), rx, stop_rx));
        Reader {
            inner,
            _life: Arc::new(Life(std::sync::Mutex::new(Some(stop_tx)))),
        }
    }

    /// The last position that arrived through the slot.
    pub fn head(&self) -> Position {
        Position(self.inner.head.load(Ordering::Relaxed))
    }

    /// Whether a replication session is streaming now.
    pub fn streaming(&self) -> bool {
        self.inner.streaming.load(Ordering::Relaxed)
    }

    /// The LSN acknowledged to Postgres so far.
    pub fn acked_lsn(&self) -> Lsn {
        Lsn(self.inner.acked.load(Ordering::Relaxed))
    }

    /// How many replication sessions the reader has started.
    pub fn sessions(&self) -> u64 {
        self.inner.sessions.load(Ordering::Relaxed)
    }

    /// Times the slot was found invalidated (its WAL removed) and re-created.
    pub fn invalidations(&self) -> u64 {
        self.inner.invalidations.load(Ordering::Relaxed)
    }

    /// Times the slot this reader had streamed from was missing on the
    /// server (a promoted standby, a dropped slot) and was made again.
    pub fn slots_missing(&self) -> u64 {
        self.inner.slots_missing.load(Ordering::Relaxed)
    }

    /// Sessions ended because the database did not answer within the
    /// reader's `query_timeout`.
    pub fn timeouts(&self) -> u64 {
        self.inner.timeouts.load(Ordering::Relaxed)
    }

    /// Times the slot was found ahead of the LSN this reader acknowledged.
    pub fn slot_ahead_reports(&self) -> u64 {
        self.inner.slot_ahead.load(Ordering::Relaxed)
    }

    pub(crate) fn attach(&self, name: &str, durable: Arc<AtomicU64>) -> mpsc::Receiver<Live> {
        let (tx, rx) = mpsc::channel(self.inner.config.subscriber_buffer.max(1));
        let _ = self.inner.cmd.send(Cmd::Attach(Attached {
            name: name.to_string(),
            tx,
            durable,
        }));
        rx
    }

    /// The reader's shared SQL connection (made again when it closed), for
    /// reads of the table beside the stream.
    pub async fn client(&self) -> Result<Arc<Client>, tokio_postgres::Error> {
        self.inner.db.get().await
    }
}

async fn run(
    inner: Arc<Inner>,
    mut cmd: mpsc::UnboundedReceiver<Cmd>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut attached: Vec<Attached> = Vec::new();
    let mut backoff = Duration::from_millis(100);
    // With a share: when a frame last came from it (or the reader started).
    let mut share_seen = Instant::now();
    loop {
        let started = Instant::now();
        let result = match inner.config.share_from.clone() {
            None => tokio::select! {
                r = session(&inner, &mut cmd, &mut attached) => r,
                _ = &mut stop => Ok(()),
            },
            Some(path) if share_seen.elapsed() < inner.config.share_silence => tokio::select! {
                r = share_session(&inner, &path, &mut share_seen, &mut cmd, &mut attached) => r,
                _ = &mut stop => Ok(()),
            },
            // The share has not streamed for a whole silence: the reader
            // decodes the log itself, through a temporary slot, until the
            // share answers again.
            Some(path) => {
                tracing::warn!(share = %path.display(), slot = %inner.config.slot, silence = ?inner.config.share_silence,
                    "the log share has not streamed for its silence: following the log through a temporary slot of this process until it answers again");
                metrics::global().log_share_fallback.set(1.0);
                tokio::select! {
                    r = session(&inner, &mut cmd, &mut attached) => r,
                    () = crate::share::answers(&path) => {
                        tracing::info!(share = %path.display(), "the log share answers again: leaving the temporary slot to follow it");
                        inner.streaming.store(false, Ordering::Relaxed);
                        share_seen = Instant::now();
                        continue;
                    }
                    _ = &mut stop => Ok(()),
                }
            }
        };
        inner.streaming.store(false, Ordering::Relaxed);
        match result {
            Ok(()) => {
                tracing::debug!(slot = %inner.config.slot, "replication reader stopped");
                return;
            }
            Err(e) => {
                if e.is_timeout() {
                    // The shared connection may be the one that hangs.
                    inner.timeouts.fetch_add(1, Ordering::Relaxed);
                    inner.db.reset().await;
                }
                match e.kind() {
                    ErrorKind::Transient => {
                        tracing::warn!(error = %e, "replication session ended; reconnecting")
                    }
                    ErrorKind::Definite => {
                        tracing::error!(error = %e, "replication session failed; retrying")
                    }
                }
                if started.elapsed() > Duration::from_secs(10) {
                    backoff = Duration::from_millis(100);
                }
                // Full jitter: sleep a random time up to the current bound.
                let sleep = Duration::from_millis(fastrand::u64(10..=backoff.as_millis() as u64));
                tokio::select! {
                    _ = tokio::time::sleep(sleep) => {}
                    _ = &mut stop => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Follows the share at `path` (`ReaderConfig::share_from`) until it fails
/// or the reader stops (`Ok`): its transactions go to the subscriptions as
/// a slot's would. `heard` is set at every frame after the greeting.
async fn share_session(
    inner: &Inner,
    path: &std::path::Path,
    heard: &mut Instant,
    cmd: &mut mpsc::UnboundedReceiver<Cmd>,
    attached: &mut Vec<Attached>,
) -> Result<(), SessionError> {
    use crate::share::wire::Frame;
    let mut share = crate::share::Follow::connect(path, inner.config.share_silence).await?;
    metrics::global().log_share_fallback.set(0.0);
    inner.sessions.fetch_add(1, Ordering::Relaxed);
    inner.streaming.store(true, Ordering::Relaxed);
    tracing::info!(share = %share.path(), "following the log through the share");
    loop {
        tokio::select! {
            f = share.next() => {
                let f = f?;
                *heard = Instant::now();
                match f {
                    Frame::Head(p) => {
                        inner.head.fetch_max(p.0, Ordering::Relaxed);
                        broadcast(attached, Live::Head(p));
                    }
                    Frame::Txn(txn) => {
                        if received(inner, &txn).is_some() {
                            broadcast(attached, Live::Txn(txn));
                        }
                    }
                    Frame::Keepalive(_) | Frame::Hello { .. } => {}
                }
            }
            c = cmd.recv() => match c {
                Some(Cmd::Attach(a)) => attach(inner, attached, a),
                None => return Ok(()),
            },
        }
    }
}

/// A subscription joins the live stream: told the head first.
fn attach(inner: &Inner, attached: &mut Vec<Attached>, a: Attached) {
    tracing::debug!(subscription = %a.name, "subscription attached to the live stream");
    let mut one = vec![a];
    broadcast(
        &mut one,
        Live::Head(Position(inner.head.load(Ordering::Relaxed))),
    );
    attached.append(&mut one);
}

struct SlotState {
    /// The last position committed at or below `acked`.
    acked_pos: u64,
    /// The acknowledged LSN last written to strata.replication_readers.
    recorded: Lsn,
    /// (last position so far, LSN past the commit) per delivered transaction.
    pending: VecDeque<(u64, Lsn)>,
    received: Lsn,
    acked: Lsn,
    server_end: Lsn,
    delivered: u64,
}

/// Connects, prepares the slot and starts streaming from it; returns the
/// reader's head with the connections.
async fn start(
    inner: &Inner,
) -> Result<
    (
        Arc<Client>,
        ReplicationConnection,
        replication::SystemInfo,
        Position,
    ),
    SessionError,
> {
    let cfg = &inner.config;
    // The replication connection first: its connect tells a server that
    // does not answer apart from one that refuses.
    let app = format!("strata-reader-{}", cfg.slot);
    let mut conn = ReplicationConnection::connect(&inner.db.config, &app).await?;
    let client = inner.db.get().await.map_err(sql("connect to postgres"))?;
    let system = conn.identify_system().await?;
    inner.sessions.fetch_add(1, Ordering::Relaxed);
    let covered = prepare_slot(inner, &client, &mut conn).await?;
    conn.start(&cfg.slot, Lsn(0), &cfg.publication).await?;
    // `head` is the reader's promise to its subscriptions: every position up
    // to it is readable from the table, every later one arrives through the
    // slot. When the slot's coverage is unknown, the log head read after the
    // stream's start point is fixed keeps that promise: later positions
    // commit after the start point.
    let head = match covered {
        Covered::After(p) => p,
        Covered::Unknown => crate::read::head(&client)
            .await
            .map_err(sql("read the log head"))?,
    };
    Ok((client, conn, system, head))
}

async fn session(
    inner: &Inner,
    cmd: &mut mpsc::UnboundedReceiver<Cmd>,
    attached: &mut Vec<Attached>,
) -> Result<(), SessionError> {
    let cfg = &inner.config;
    // Every step of the start has a deadline: a server that stops answering
    // while the reader connects or prepares its slot ends the try.
    let limit = cfg.query_timeout + inner.db.config.connect_timeout();
    let (client, mut conn, system, head) = match tokio::time::timeout(limit, start(inner)).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(SessionError::Timeout {
                context: "start replication",
                limit,
            })
        }
    };
    // Read before the first transaction arrives: with synchronous standbys
    // named, none is delivered before they have it.
    let mut gate = StandbyGate::new(inner.db.config.clone(), &cfg.slot, cfg.query_timeout);
    gate.refresh(&client).await?;
    inner.head.store(head.0, Ordering::Relaxed);
    inner.streaming.store(true, Ordering::Relaxed);
    tracing::info!(slot = %cfg.slot, server_lsn = %system.xlogpos, head = %head, "replication started");
    broadcast(
        attached,
        Live::Head(Position(inner.head.load(Ordering::Relaxed))),
    );

    let mut state = SlotState {
        acked_pos: head.0,
        recorded: Lsn(inner.acked.load(Ordering::Relaxed)),
        pending: VecDeque::new(),
        received: Lsn(0),
        acked: Lsn(inner.acked.load(Ordering::Relaxed)),
        // Raised only by what the server sends: acknowledging the server's
        // current position before receiving up to it would skip transactions.
        server_end: Lsn(0),
        delivered: inner.head.load(Ordering::Relaxed),
    };
    let mut asm = Assembler::new();
    let mut status = tokio::time::interval(cfg.status_interval);
    status.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut heartbeat = tokio::time::interval(cfg.heartbeat_interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut maintenance = tokio::time::interval(Duration::from_secs(100));
    let mut round: Option<StatusRound<'_>> = None;
    let mut beat: Option<Upkeep<'_>> = None;
    let mut partitions: Option<Upkeep<'_>> = None;
    loop {
        tokio::select! {
            frame = conn.recv() => {
                let frame = match frame? {
                    Frame::Data(f) => f,
                    Frame::Done => return Err(ReplicationError::Closed.into()),
                };
                match replication::decode(&frame).map_err(ReplicationError::from)? {
                    ReplicationMessage::XLogData { start, end, data, .. } => {
                        state.received = state.received.max(start);
                        state.server_end = state.server_end.max(end);
                        if let Some(txn) = asm.push(data).map_err(ReplicationError::from)? {
                            if let Some(txn) = gate.admit(txn) {
                                deliver(inner, &mut state, attached, txn);
                            }
                        }
                    }
                    ReplicationMessage::Keepalive { end, reply, .. } => {
                        state.server_end = state.server_end.max(end);
                        if reply {
                            let idle = !asm.in_transaction() && gate.is_empty();
                            let ack = compute_ack(inner, &mut state, attached, idle);
                            report(inner, &client, &mut conn, &mut state, ack).await?;
                        }
                    }
                }
            }
            passed = gate.passed() => {
                for txn in passed? {
                    deliver(inner, &mut state, attached, txn);
                }
            }
            // A status round's statements run beside the stream: a server
            // slow to answer them does not stop frames being received.
            _ = status.tick(), if round.is_none() => {
                let idle = !asm.in_transaction() && gate.is_empty();
                let ack = compute_ack(inner, &mut state, attached, idle);
                let record = (ack > state.recorded).then_some(state.acked_pos);
                round = Some(Box::pin(status_round(inner, &client, ack, record)));
            }
            done = async { round.as_mut().expect("a round in flight").await }, if round.is_some() => {
                round = None;
                let (standbys, ack) = done?;
                gate.apply(&client, standbys).await?;
                // A keepalive's reply may have recorded and sent a later
                // one meanwhile: the slot is never moved back.
                state.recorded = state.recorded.max(ack);
                let ack = state.recorded;
                tracing::trace!(slot = %cfg.slot, ack = %ack, "standby status");
                conn.send_status(state.received.max(ack), ack, false).await?;
                let m = metrics::global();
                m.replication_lag_bytes.set(state.server_end.0.saturating_sub(ack.0) as f64);
            }
            // The reader's own upkeep runs beside the stream too: a row or
            // a partition lock that makes it wait holds no frame back.
            _ = heartbeat.tick(), if beat.is_none() => {
                beat = Some(Box::pin(record_heartbeat(inner, &client)));
            }
            done = async { beat.as_mut().expect("a heartbeat in flight").await }, if beat.is_some() => {
                beat = None;
                done?;
            }
            _ = maintenance.tick(), if partitions.is_none() => {
                partitions = Some(Box::pin(keep_partitions_ahead(inner, &client)));
            }
            done = async { partitions.as_mut().expect("partition upkeep in flight").await }, if partitions.is_some() => {
                partitions = None;
                done?;
            }
            c = cmd.recv() => match c {
                Some(Cmd::Attach(a)) => attach(inner, attached, a),
                None => return Ok(()),
            },
        }
    }
}

/// A status round in flight: what [`status_round`] read and the LSN to
/// acknowledge once it is recorded.
type StatusRound<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<((bool, bool), Lsn), SessionError>> + Send + 'a>,
>;

/// A piece of the reader's upkeep in flight beside the stream.
type Upkeep<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), SessionError>> + Send + 'a>>;

/// Records that the reader is alive (`strata slots list` shows it).
async fn record_heartbeat(inner: &Inner, client: &Client) -> Result<(), SessionError> {
    bounded(
        inner.config.query_timeout,
        "record the reader heartbeat",
        client.exec(
            "UPDATE strata.replication_readers SET seen_at = now() WHERE slot_name = $1",
            &[&inner.config.slot],
        ),
    )
    .await?;
    Ok(())
}

/// Every process that reads the log also keeps months ahead created. A
/// failure is only warned about (the next try is in 100 s); a server that
/// does not answer within the reader's `query_timeout` ends the session.
async fn keep_partitions_ahead(inner: &Inner, client: &Client) -> Result<(), SessionError> {
    let limit = inner.config.query_timeout;
    match tokio::time::timeout(
        limit,
        schema::partitions::ensure(
            client,
            schema::partitions::DEFAULT_MONTHS_AHEAD,
            SystemTime::now(),
        ),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "partition maintenance failed");
            Ok(())
        }
        Err(_) => Err(SessionError::Timeout {
            context: "keep partitions ahead",
            limit,
        }),
    }
}

/// The statements of one status round: whether synchronous standbys are
/// named, and, with `record` (its position), `ack` written as the reader's
/// acknowledged LSN. The caller tells the server `ack` once this returned:
/// the slot is never ahead of the record.
async fn status_round(
    inner: &Inner,
    client: &Client,
    ack: Lsn,
    record: Option<u64>,
) -> Result<((bool, bool), Lsn), SessionError> {
    let cfg = &inner.config;
    let standbys = crate::standby_gate::read(client, &cfg.slot, cfg.query_timeout).await?;
    if let Some(position) = record {
        record_ack(inner, client, ack, position).await?;
    }
    Ok((standbys, ack))
}

/// Writes `ack` (and its position) as this reader's acknowledged LSN; never
/// moves the record back (a keepalive's reply may have recorded a later
/// one while a status round's was in flight).
async fn record_ack(
    inner: &Inner,
    client: &Client,
    ack: Lsn,
    position: u64,
) -> Result<(), SessionError> {
    bounded(
        inner.config.query_timeout,
        "record the acknowledged LSN",
        client.exec(
            "UPDATE strata.replication_readers
                SET acked_lsn = greatest(acked_lsn, $2::text::pg_lsn),
                    acked_position = greatest(acked_position, $3), seen_at = now()
              WHERE slot_name = $1",
            &[&inner.config.slot, &ack.to_string(), &(position as i64)],
        ),
    )
    .await?;
    Ok(())
}

/// Records `ack` as this reader's acknowledged LSN, then tells the server.
/// Recording first means the slot can never be legitimately ahead of the
/// record, so a slot found ahead at start-up is a real anomaly.
async fn report(
    inner: &Inner,
    client: &Client,
    conn: &mut ReplicationConnection,
    state: &mut SlotState,
    ack: Lsn,
) -> Result<(), SessionError> {
    if ack > state.recorded {
        record_ack(inner, client, ack, state.acked_pos).await?;
        state.recorded = ack;
    }
    tracing::trace!(slot = %inner.config.slot, ack = %ack, "standby status");
    conn.send_status(state.received.max(ack), ack, false)
        .await?;
    Ok(())
}

/// Makes sure the slot exists and is usable; reports loudly when it is not.
async fn prepare_slot(
    inner: &Inner,
    client: &Client,
    conn: &mut ReplicationConnection,
) -> Result<Covered, SessionError> {
    let cfg = &inner.config;
    let row = client
        .opt(
            "SELECT confirmed_flush_lsn::text, wal_status FROM pg_replication_slots WHERE slot_name = $1",
            &[&cfg.slot],
        )
        .await
        .map_err(sql("look up the replication slot"))?;
    let record = client
        .opt(
            "SELECT acked_lsn::text, acked_position FROM strata.replication_readers WHERE slot_name = $1",
            &[&cfg.slot],
        )
        .await
        .map_err(sql("read the reader's record"))?;
    let recorded: Option<Lsn> = record
        .as_ref()
        .and_then(|r| r.get::<_, Option<String>>(0))
        .and_then(|s| s.parse().ok());
    let recorded_pos: Option<i64> = record.as_ref().and_then(|r| r.get(1));
    let mut covered = Covered::Unknown;
    let mut create = row.is_none();
    if create && record.is_some() && cfg.share_from.is_none() {
        // The reader streamed from this slot before, and the server does
        // not have it: a standby promoted since (slots are not replicated),
        // or the slot was dropped.
        inner.slots_missing.fetch_add(1, Ordering::Relaxed);
        tracing::error!(slot = %cfg.slot, "replication slot missing on this server though this reader streamed from it (a promoted standby, or the slot was dropped): creating it; subscriptions fill the gap from the table");
    }
    if let Some(row) = row {
        let status: Option<String> = row.get(1);
        if status.as_deref() == Some("lost") {
            let err = ReplicationError::SlotInvalidated {
                slot: cfg.slot.clone(),
            };
            inner.invalidations.fetch_add(1, Ordering::Relaxed);
            tracing::error!(slot = %cfg.slot, error = %err, "slot invalidated: dropping and re-creating it; subscriptions fill the missed events from the table");
            client
                .exec("SELECT pg_drop_replication_slot($1)", &[&cfg.slot])
                .await
                .map_err(sql("drop the invalidated slot"))?;
            create = true;
        } else {
            let confirmed: Option<Lsn> =
                row.get::<_, Option<String>>(0).and_then(|s| s.parse().ok());
            if let (Some(confirmed), Some(recorded)) = (confirmed, recorded) {
                if confirmed > recorded {
                    inner.slot_ahead.fetch_add(1, Ordering::Relaxed);
                    let err = ReplicationError::SlotAhead {
                        slot: cfg.slot.clone(),
                        confirmed,
                        requested: recorded,
                    };
                    tracing::error!(slot = %cfg.slot, error = %err, "slot is ahead of what this reader acknowledged; subscriptions fill the difference from the table");
                } else if let Some(p) = recorded_pos {
                    // The slot resumes right after what was recorded.
                    covered = Covered::After(Position(p as u64));
                }
            }
            if let Some(c) = confirmed {
                inner.acked.fetch_max(c.0, Ordering::Relaxed);
            }
        }
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string();
    let pid = std::process::id() as i32;
    if create {
        // A share's follower decodes the log itself only while its share
        // is gone: its slot goes with that session.
        let temporary = cfg.temporary || cfg.share_from.is_some();
        let slot = conn.create_slot(&cfg.slot, temporary, true).await?;
        let snapshot = slot.snapshot.clone().unwrap_or_default();
        // The last position the exported snapshot sees: everything after it
        // arrives through the slot.
        let base = base_position(&inner.db.config, &snapshot).await?;
        inner
            .acked
            .fetch_max(slot.consistent_point.0, Ordering::Relaxed);
        covered = Covered::After(base);
        tracing::info!(slot = %cfg.slot, consistent_point = %slot.consistent_point, base_position = %base, "replication slot created");
        client
            .exec(
                "INSERT INTO strata.replication_readers (slot_name, owner, host, pid, acked_lsn, acked_position, base_position)
                 VALUES ($1, $2, $3, $4, $5::text::pg_lsn, $6, $6)
                 ON CONFLICT (slot_name) DO UPDATE SET owner = $2, host = $3, pid = $4, started_at = now(),
                     seen_at = now(), acked_lsn = $5::text::pg_lsn, acked_position = $6, base_position = $6",
                &[&cfg.slot, &cfg.owner, &host, &pid, &slot.consistent_point.to_string(), &(base.0 as i64)],
            )
            .await
            .map_err(sql("record the reader"))?;
    } else {
        client
            .exec(
                "INSERT INTO strata.replication_readers (slot_name, owner, host, pid) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (slot_name) DO UPDATE SET owner = $2, host = $3, pid = $4, started_at = now(), seen_at = now()",
                &[&cfg.slot, &cfg.owner, &host, &pid],
            )
            .await
            .map_err(sql("record the reader"))?;
    }
    Ok(covered)
}

/// Which positions the slot's stream will deliver in this session.
enum Covered {
    /// Every position after this one.
    After(Position),
    /// Not known (the slot was found ahead, or nothing was recorded): only
    /// what commits after the stream starts.
    Unknown,
}

async fn base_position(db: &Database, snapshot: &str) -> Result<Position, SessionError> {
    // The snapshot was exported by the replication session on the server
    // itself; it is imported there too.
    let mut client = crate::db::connect(db.direct(), "snapshot-connection")
        .await
        .map_err(sql("connect to read the snapshot"))?;
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(sql("begin the snapshot transaction"))?;
    if !snapshot.is_empty() {
        let quoted = snapshot.replace('\'', "''");
        tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT '{quoted}'"))
            .await
            .map_err(sql("import the slot's snapshot"))?;
    }
    let row = tx
        .one("SELECT last_position FROM strata.log_head", &[])
        .await
        .map_err(sql("read the log head in the slot's snapshot"))?;
    let base: i64 = row.get(0);
    tx.commit()
        .await
        .map_err(sql("end the snapshot transaction"))?;
    // The snapshot may see appends committed a moment before their WAL flush;
    // promise subscriptions only durable positions.
    crate::read::flush_barrier(&client)
        .await
        .map_err(sql("wait for the snapshot's appends to be durable"))?;
    Ok(Position(base as u64))
}

/// Counts a transaction received and, when it holds events, moves the
/// reader's head to its last: the position to hand on, if any.
fn received(inner: &Inner, txn: &Txn) -> Option<Position> {
    let m = metrics::global();
    m.replication_transactions.inc();
    let last = txn.last_position()?;
    m.replication_events.inc_by(txn.events.len() as u64);
    inner
        .head_at_ms
        .store(crate::lag::millis(txn.commit_time), Ordering::Relaxed);
    let lag = SystemTime::now()
        .duration_since(txn.commit_time)
        .unwrap_or_default();
    m.replication_lag_seconds.set(lag.as_secs_f64());
    inner.head.fetch_max(last.0, Ordering::Relaxed);
    Some(last)
}

fn deliver(inner: &Inner, state: &mut SlotState, attached: &mut Vec<Attached>, txn: Txn) {
    if let Some(last) = received(inner, &txn) {
        state.delivered = state.delivered.max(last.0);
        let end = txn.end_lsn;
        let txn = Arc::new(txn);
        broadcast(attached, Live::Txn(txn));
        state.pending.push_back((state.delivered, end));
    } else {
        state.pending.push_back((state.delivered, txn.end_lsn));
    }
    state.received = state.received.max(txn_end(&state.pending));
}

fn txn_end(pending: &VecDeque<(u64, Lsn)>) -> Lsn {
    pending.back().map_or(Lsn(0), |p| p.1)
}

/// The LSN every attached subscription has made durable; detaches any that
/// hold back more than the WAL bound.
fn compute_ack(
    inner: &Inner,
    state: &mut SlotState,
    attached: &mut Vec<Attached>,
    idle: bool,
) -> Lsn {
    attached.retain(|a| !a.tx.is_closed());
    loop {
        let min = attached
            .iter()
            .map(|a| a.durable.load(Ordering::Relaxed))
            .min();
        while let Some(&(last, end)) = state.pending.front() {
            if min.is_none_or(|m| last <= m) {
                state.acked = state.acked.max(end);
                state.acked_pos = state.acked_pos.max(last);
                state.pending.pop_front();
            } else {
                break;
            }
        }
        let retained = state.server_end.0.saturating_sub(state.acked.0);
        match (state.pending.front(), min) {
            (Some(&(last, _)), Some(_)) if retained > inner.config.max_retained_wal => {
                attached.retain(|a| {
                    let keep = a.durable.load(Ordering::Relaxed) >= last;
                    if !keep {
                        tracing::warn!(subscription = %a.name, retained_bytes = retained, bound = inner.config.max_retained_wal,
                            "subscription holds back too much WAL; it falls back to reading the table");
                    }
                    keep
                });
            }
            _ => break,
        }
    }
    if state.pending.is_empty() && idle {
        // Nothing delivered is unacknowledged: everything the server has sent
        // so far (other tables' WAL included) can be released.
        state.acked = state.acked.max(state.server_end);
        state.acked_pos = state.acked_pos.max(state.delivered);
    }
    inner.acked.fetch_max(state.acked.0, Ordering::Relaxed);
    state.acked
}

impl crate::lag::Head for Inner {
    fn head(&self) -> u64 {
        self.head.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn head_at_ms(&self) -> u64 {
        self.head_at_ms.load(std::sync::atomic::Ordering::Relaxed)
    }
}
