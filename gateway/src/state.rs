//! What every part of a gateway shares: its configuration, counters, the
//! sessions it holds, the queue of writes, the commands it follows and the
//! API callers waiting for outcomes.

use crate::ca::{self, Ca};
use crate::proto::GatewayMessage;
use domain::commands::{self, Commands};
use events::{AppendError, Appender, ExpectedVersion, NewEvent, Reader};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tonic::Status;

/// How a gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// This gateway's name in the log.
    pub id: String,
    pub listen: SocketAddr,
    /// The region's node CA (`strata ca init`).
    pub ca_dir: PathBuf,
    /// DNS names and IP addresses for the serving certificate.
    pub names: Vec<String>,
    pub max_streams: usize,
    pub handshakes_per_second: f64,
    /// Joins admitted per second (each signs a certificate), counting only
    /// those whose token is one the region issued.
    pub joins_per_second: f64,
    /// Joins with a token the region never issued, per second from one
    /// address (a burst of five times as many is allowed); past it the
    /// address's joins are refused before their token is looked at.
    pub bad_joins_per_source_per_second: f64,
    /// Joins tried per second with one token (a pattern token may admit a
    /// whole fleet; a burst of twice as many is allowed).
    pub joins_per_token_per_second: f64,
    /// Sessions between their admission and their Welcome (waiting for
    /// the Hello, or opening in the log) at once; more are pushed back.
    /// Below this, as many as the gateway welcomes in a few seconds at the
    /// rate it has been welcoming (`welcome_rate`), and never fewer than
    /// `min_pending_hellos`.
    pub max_pending_hellos: usize,
    pub min_pending_hellos: usize,
    /// New sessions are pushed back while more writes than this wait for
    /// the gateway's writer: a Hello admitted then would wait behind them
    /// past the node's patience, and its node would try again, adding
    /// more work where there is already too much.
    pub max_queued_writes: u64,
    /// The heartbeat interval nodes are told; a node is unreachable after
    /// three missed.
    pub heartbeat: Duration,
    /// Largest message accepted, in bytes.
    pub max_message_bytes: usize,
    /// Validity of node certificates signed at join or renewal.
    pub certificate_validity: Duration,
    /// Validity of the gateway's serving certificate; a new one is made and
    /// served when a third of it is left.
    pub serving_validity: Duration,
    /// A connection must finish its TLS handshake and start its first RPC
    /// within this of its accept (a fleet starting at once on one gateway
    /// needs the room: 10,000 handshakes are seconds of CPU).
    pub handshake_timeout: Duration,
    /// A connection with no RPC in progress (no session, join or API call)
    /// for this long is closed.
    pub idle_timeout: Duration,
    /// Most connections without an RPC in progress at once; one more closes
    /// the one idle the longest.
    pub max_idle_connections: usize,
    /// An RPC must receive each request message whole within this of its
    /// start (the first from the RPC's headers); one that does not is
    /// cancelled, and its connection counts as idle again.
    pub request_deadline: Duration,
    /// Most connections without a client certificate (joining nodes, and
    /// anyone) at once: their own share, so that they cannot take every
    /// descriptor from nodes and operators.
    pub max_unauthenticated_connections: usize,
    /// While that share is pressed (it was full within five seconds),
    /// TLS handshakes a second for addresses that never presented a client
    /// certificate; the rest are closed at accept. Nodes' and operators'
    /// addresses are not held back.
    pub unknown_handshakes_per_second: f64,
    /// Durable subscriptions one caller of the client API may hold.
    pub max_subscriptions_per_caller: u64,
    /// Inventory and health messages a session may send per second (a
    /// burst of ten times as many is allowed); a session sending more is
    /// ended.
    pub node_messages_per_second: f64,
    /// The gateway's lease (`gateway/<id>`): renewed every third of it;
    /// once it lapses, other gateways mark this one's nodes lost.
    pub lease_ttl: Duration,
    /// How long a node's ack of a command is held for its outcome: an
    /// outcome within it is written alone, and `command.acked` only for a
    /// command still open after it (see the acks module).
    pub ack_hold: Duration,
}

impl GatewayConfig {
    pub fn new(id: impl Into<String>, listen: SocketAddr, ca_dir: impl Into<PathBuf>) -> Self {
        GatewayConfig {
            id: id.into(),
            listen,
            ca_dir: ca_dir.into(),
            names: vec!["localhost".into(), "127.0.0.1".into()],
            max_streams: 20_000,
            handshakes_per_second: 2_000.0,
            joins_per_second: 200.0,
            bad_joins_per_source_per_second: 2.0,
            joins_per_token_per_second: 100.0,
            max_pending_hellos: 1_000,
            min_pending_hellos: crate::welcome_rate::FLOOR,
            max_queued_writes: 4_096,
            heartbeat: Duration::from_secs(10),
            max_message_bytes: 1 << 20,
            certificate_validity: Duration::from_secs(365 * 24 * 3600),
            serving_validity: Duration::from_secs(30 * 24 * 3600),
            handshake_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_idle_connections: 1_024,
            request_deadline: Duration::from_secs(10),
            max_unauthenticated_connections: 256,
            unknown_handshakes_per_second: 100.0,
            max_subscriptions_per_caller: 16,
            node_messages_per_second: 20.0,
            lease_ttl: Duration::from_secs(6),
            ack_hold: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Ca(#[from] ca::CaError),
    #[error("listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serve: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error("follow commands: {0}")]
    Commands(String),
    #[error("the gateway's lease: {0}")]
    Lease(String),
}

/// Counters of a running gateway.
#[derive(Debug, Default)]
pub struct GatewayStats {
    pub sessions: AtomicU64,
    pub sessions_opened: AtomicU64,
    /// Hellos whose node gave up waiting before its session opened; not
    /// opened (or, where the open was already on its way, closed at once).
    pub hellos_abandoned: AtomicU64,
    /// Writes queued for the writer and not yet taken by it.
    pub writes_queued: AtomicU64,
    /// Writes the writer has taken and not yet answered: the batch being
    /// written (or retried, or asked after), and those split from it.
    pub writes_in_flight: AtomicU64,
    /// Sessions refused: more new ones per second than allowed.
    pub refused_rate: AtomicU64,
    /// Sessions refused: the gateway held its maximum.
    pub refused_full: AtomicU64,
    /// Sessions refused: too many waiting for their Hello.
    pub refused_pending: AtomicU64,
    /// Sessions refused: the gateway's writes are behind.
    pub refused_behind: AtomicU64,
    pub refused_identity: AtomicU64,
    /// Sessions refused: the gateway held no lease.
    pub refused_no_lease: AtomicU64,
    /// Inventories the log refused (a GPU another node reports).
    pub refused_inventory: AtomicU64,
    pub joins: AtomicU64,
    /// Joins refused: a bad token, an id taken or revoked, too many at once.
    pub refused_joins: AtomicU64,
    pub batches: AtomicU64,
    pub events_written: AtomicU64,
    pub fenced: AtomicU64,
    pub write_errors: AtomicU64,
    /// Writes tried again after a transient failure: batches of node
    /// events, command results; and asks, again, whether a batch whose
    /// commit is in doubt committed.
    pub write_retries: AtomicU64,
    pub transitions: AtomicU64,
    /// Health reports not written: repeats, and clears of a flapping
    /// condition held back.
    pub health_coalesced: AtomicU64,
    pub commands_dispatched: AtomicU64,
    pub commands_finished: AtomicU64,
    /// Commands that could not be queued to a live session (sent again on
    /// reconnect).
    pub command_drops: AtomicU64,
    /// Sessions ended for sending inventory and health past their limit.
    pub refused_messages: AtomicU64,
    /// Times this gateway found its own lease lapsed.
    pub lease_lost: AtomicU64,
    /// Times this gateway's lease ran past its end while the database said
    /// it was down, and the gateway kept its sessions (see `liveness`).
    pub database_outages_ridden: AtomicU64,
    /// Nodes of lapsed gateways this gateway marked lost.
    pub orphans_marked: AtomicU64,
}

/// A node's session as this gateway knows it.
pub(crate) struct SessionEntry {
    /// The pool the node's certificate was issued for.
    pub(crate) pool: String,
    pub(crate) epoch: u64,
    /// The node stream's version after this session's last write.
    pub(crate) version: u64,
    /// When the node was last heard: a message read from it, or the
    /// session's loop done handling one and reading again.
    pub(crate) heard: Heard,
    /// The session's loop is handling a message (waiting on a write, say)
    /// and not reading the node's stream: its silence meanwhile is this
    /// gateway's, and does not count against the node.
    pub(crate) handling: bool,
    pub(crate) reachable: bool,
    pub(crate) status: Option<(String, String)>,
    /// When the session's stream ended (the entry stays until the node is
    /// written unreachable, or a new session replaces it).
    pub(crate) closed: bool,
    pub(crate) tx: Outbox,
    /// The session's health reports, coalesced and damped.
    pub(crate) health: crate::damping::Damper,
}

/// When a node was last heard from, on the wall clock and on the
/// gateway's process clock (the time the gateway could run): a gateway
/// short of cores reads heartbeats late, and must not take its own
/// lateness for a silent node.
#[derive(Clone, Copy)]
pub(crate) struct Heard {
    pub(crate) wall: Instant,
    pub(crate) counted: Instant,
}

/// How much longer than its limit a heartbeat may be late on the wall clock
/// while the gateway is short of cores, before the node is marked
/// unreachable anyway (every deadline holds, however starved).
pub(crate) const HEARD_SLACK: std::time::Duration = std::time::Duration::from_secs(30);

impl Heard {
    pub(crate) fn now(clock: &ops::process_clock::ProcessClock) -> Heard {
        Heard {
            wall: Instant::now(),
            counted: clock.now(),
        }
    }

    /// Whether a node unheard since this counts as silent for `limit`:
    /// `older_than`, or, while the gateway is handling one of its messages
    /// rather than listening, only past `limit` and [`HEARD_SLACK`] of wall
    /// time (the gateway's own wait does not count, up to a bound).
    pub(crate) fn silent(
        &self,
        limit: std::time::Duration,
        clock: &ops::process_clock::ProcessClock,
        handling: bool,
    ) -> bool {
        if handling {
            self.wall.elapsed() > limit + HEARD_SLACK
        } else {
            self.older_than(limit, clock)
        }
    }

    /// Whether nothing was heard for `limit` of the gateway's counted time,
    /// or for `limit` and [`HEARD_SLACK`] of wall time.
    pub(crate) fn older_than(
        &self,
        limit: std::time::Duration,
        clock: &ops::process_clock::ProcessClock,
    ) -> bool {
        clock.now().saturating_duration_since(self.counted) > limit
            || self.wall.elapsed() > limit + HEARD_SLACK
    }
}

/// One write for the writer task.
pub(crate) struct Write {
    pub(crate) stream: String,
    /// For writes fenced by a session: (node, epoch). Such a write expects
    /// the version the session last wrote as of when its batch is sent (so
    /// two writes queued at once do not fence each other); `expected` is
    /// used only once the session is gone from this gateway.
    pub(crate) session: Option<(String, u64)>,
    pub(crate) expected: ExpectedVersion,
    pub(crate) events: Vec<NewEvent>,
    /// Events for other streams that commit with this write or not at all
    /// (the pool fact recording the region's contact with the node), with
    /// no version check of their own.
    pub(crate) also: Vec<(String, NewEvent)>,
    pub(crate) done: Option<oneshot::Sender<Result<u64, AppendError>>>,
    /// For the write that opens a session: the session's outgoing queue.
    /// A node that gave up waiting for its Welcome closed it; the write is
    /// then not sent (answered [`abandoned`]), rather than opening a
    /// session for nobody that would only be closed again.
    pub(crate) client: Option<Outbox>,
}

/// The answer to a write whose client went away before it was sent.
pub(crate) fn abandoned() -> AppendError {
    AppendError::Invalid("the node gave up waiting; nothing was written".into())
}

impl Write {
    /// A write with no session fence and nothing else attached.
    pub(crate) fn plain(stream: String, expected: ExpectedVersion, events: Vec<NewEvent>) -> Write {
        Write {
            stream,
            session: None,
            expected,
            events,
            also: Vec::new(),
            done: None,
            client: None,
        }
    }

    /// Whether the write touches `stream`.
    pub(crate) fn touches(&self, stream: &str) -> bool {
        self.stream == stream || self.also.iter().any(|(s, _)| s == stream)
    }
}

pub(crate) struct Shared {
    pub(crate) config: GatewayConfig,
    pub(crate) ca: Ca,
    pub(crate) db: events::db::SharedClient,
    pub(crate) appender: Appender,
    pub(crate) reader: Reader,
    pub(crate) stats: Arc<GatewayStats>,
    pub(crate) streams: Arc<Semaphore>,
    pub(crate) pending_hellos: AtomicUsize,
    /// Welcomes a second, which bound how many may wait for one.
    pub(crate) welcomes: crate::welcome_rate::WelcomeRate,
    pub(crate) bucket: Mutex<crate::bucket::Bucket>,
    pub(crate) join_bucket: Mutex<crate::bucket::Bucket>,
    pub(crate) join_limits: crate::join_limits::JoinLimits,
    /// Who gets a TLS handshake while strangers crowd the gateway; told of
    /// addresses that offer tokens never issued.
    pub(crate) handshakes: Arc<crate::handshakes::HandshakeGate>,
    pub(crate) sessions: Mutex<HashMap<String, SessionEntry>>,
    pub(crate) writes: mpsc::Sender<Write>,
    /// Commands not yet terminal, as the log says.
    pub(crate) commands: Mutex<Commands>,
    /// Nodes' acks held for their commands' outcomes.
    pub(crate) acks: crate::held_acks::HeldAcks,
    /// API callers waiting for a reservation's (`r:<id>`) or a command's
    /// (`c:<id>`) outcome.
    pub(crate) waiters: Mutex<HashMap<String, Vec<oneshot::Sender<Waited>>>>,
    /// Revoked client certificates (operators of the client API).
    pub(crate) revoked: crate::revocation::Revoked,
    /// The pool index ListPools answers from: built from the log on the
    /// first call, then brought up to date from where it stopped.
    pub(crate) pools: tokio::sync::Mutex<projections::Index>,
    /// The connection identity transactions (joins, renewals) run on, one
    /// at a time (each is rare and short); made when first needed or after
    /// it closed ([`Shared::identity_db`]).
    pub(crate) joins: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    /// The epoch of the gateway's lease, written into every session it
    /// opens (see the liveness module).
    pub(crate) lease_epoch: std::sync::atomic::AtomicI64,
    /// Usage reports running now (`GetUsage`), at most `usage::AT_ONCE`.
    pub(crate) reports: Semaphore,
    /// Set once the gateway begins to stop: the client API's streams end
    /// (their callers subscribe again elsewhere).
    pub(crate) stopping: tokio::sync::watch::Sender<bool>,
    /// The time this gateway could run, which heartbeats are timed on.
    pub(crate) clock: ops::process_clock::ProcessClock,
    /// Writes of a command's state tried again: warned about at most once
    /// a second (a database outage retries every result in flight).
    pub(crate) record_retries: ops::warn_every::WarnEvery,
}

/// What an API caller waited for.
pub(crate) enum Waited {
    Reservation {
        state: String,
        reason: String,
        allocations: Vec<domain::Allocation>,
    },
    Command(commands::Tracked),
}

impl Shared {
    /// The connection for identity transactions, connected again if it
    /// was lost.
    pub(crate) async fn identity_db(
        &self,
    ) -> Result<tokio::sync::MappedMutexGuard<'_, tokio_postgres::Client>, Status> {
        let mut conn = self.joins.lock().await;
        if conn.as_ref().is_none_or(|c| c.is_closed()) {
            *conn = Some(
                events::db::connect(&self.db.config, "identity-connection")
                    .await
                    .map_err(|e| Status::unavailable(format!("database: {e}")))?,
            );
        }
        Ok(tokio::sync::MutexGuard::map(conn, |c| {
            c.as_mut().expect("connected above")
        }))
    }
}

impl Shared {
    pub(crate) fn add_waiter(&self, key: &str) -> oneshot::Receiver<Waited> {
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .expect("waiters lock")
            .entry(key.to_string())
            .or_default()
            .push(tx);
        rx
    }

    pub(crate) fn forget_waiter(&self, key: &str) {
        let mut w = self.waiters.lock().expect("waiters lock");
        if let Some(v) = w.get_mut(key) {
            v.retain(|tx| !tx.is_closed());
            if v.is_empty() {
                w.remove(key);
            }
        }
    }

    pub(crate) fn notify(&self, key: &str, make: impl Fn() -> Waited) {
        let waiting = self.waiters.lock().expect("waiters lock").remove(key);
        for tx in waiting.into_iter().flatten() {
            let _ = tx.send(make());
        }
    }

    pub(crate) fn session_nodes(&self) -> std::collections::HashSet<String> {
        self.sessions
            .lock()
            .expect("sessions lock")
            .iter()
            .filter(|(_, s)| !s.closed)
            .map(|(n, _)| n.clone())
            .collect()
    }
}

pub(crate) type Reply = Result<GatewayMessage, Status>;

/// A session's outgoing queue. Items are boxed: a queue block holds 32 slots
/// whatever the capacity, and an unboxed `Status` is about 200 bytes, which
/// at 10,000 sessions is 60 MiB of mostly empty slots.
#[derive(Clone)]
pub(crate) struct Outbox(pub(crate) mpsc::Sender<Box<Reply>>);

impl Outbox {
    pub(crate) async fn send(&self, r: Reply) -> Result<(), ()> {
        self.0.send(Box::new(r)).await.map_err(|_| ())
    }

    pub(crate) fn try_send(&self, r: Reply) -> Result<(), ()> {
        self.0.try_send(Box::new(r)).map_err(|_| ())
    }
}
