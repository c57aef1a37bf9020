//! The gateway server: the Join service (no client certificate needed) and
//! the Session service (client certificate required), over one rustls (ring)
//! listener.
//!
//! Admission: a token bucket for new sessions (`handshakes_per_second`), a
//! cap on open sessions (`max_streams`) and on sessions that have not sent
//! their Hello yet (`max_pending_hellos`). Every refusal is
//! `RESOURCE_EXHAUSTED` with a jittered `retry-after-ms` in its metadata.
//!
//! Ownership: a session is opened by appending `node.session_opened` to the
//! node's stream at the version the gateway read; the resulting version is
//! the session's epoch. Every later write for the node goes to that stream
//! with the exact version this session last wrote, so once another gateway
//! opens a newer session the older owner's writes are refused (and it closes
//! its session).
//!
//! Writes: sessions hand their events to one writer task, which appends
//! everything queued in one I/O turn as one transaction (`append_batch`).
//! Heartbeats stay in memory; only transitions (`node.unreachable`,
//! `node.reachable`) and statuses that changed are written.

use crate::ca::{self, Ca};
use crate::identity::{self, node_stream};
use crate::proto::{
    gateway_message, join_server, node_message, session_server, GatewayMessage, JoinRequest,
    JoinResponse, NodeMessage, Welcome,
};
use events::{AppendError, Appender, ExpectedVersion, NewEvent, Reader, StreamAppend};
use futures_util::Stream;
use projections::commands::{self, CommandState, Commands};
use projections::domain::pool_stream;
use projections::{DeviceSpec, Fact};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

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
    pub max_pending_hellos: usize,
    /// The heartbeat interval nodes are told; a node is unreachable after
    /// three missed.
    pub heartbeat: Duration,
    /// Largest message accepted, in bytes.
    pub max_message_bytes: usize,
    /// Validity of node certificates signed at join, in days.
    pub certificate_days: i64,
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
            max_pending_hellos: 1_000,
            heartbeat: Duration::from_secs(10),
            max_message_bytes: 1 << 20,
            certificate_days: 365,
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
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error("follow commands: {0}")]
    Commands(String),
}

/// Counters of a running gateway.
#[derive(Debug, Default)]
pub struct GatewayStats {
    pub sessions: AtomicU64,
    pub sessions_opened: AtomicU64,
    pub refused_admission: AtomicU64,
    pub refused_identity: AtomicU64,
    pub joins: AtomicU64,
    pub batches: AtomicU64,
    pub events_written: AtomicU64,
    pub fenced: AtomicU64,
    pub write_errors: AtomicU64,
    pub transitions: AtomicU64,
    pub commands_dispatched: AtomicU64,
    pub commands_finished: AtomicU64,
    /// Commands that could not be queued to a live session (sent again on
    /// reconnect).
    pub command_drops: AtomicU64,
}

struct Bucket {
    tokens: f64,
    last: Instant,
}

/// A node's session as this gateway knows it.
struct SessionEntry {
    epoch: u64,
    /// The node stream's version after this session's last write.
    version: u64,
    last_heartbeat: Instant,
    reachable: bool,
    status: Option<(String, String)>,
    /// When the session's stream ended (the entry stays until the node is
    /// written unreachable, or a new session replaces it).
    closed: bool,
    tx: Outbox,
}

/// One write for the writer task.
struct Write {
    stream: String,
    /// For writes fenced by a session: (node, epoch).
    session: Option<(String, u64)>,
    expected: ExpectedVersion,
    events: Vec<NewEvent>,
    done: Option<oneshot::Sender<Result<u64, AppendError>>>,
}

pub(crate) struct Shared {
    config: GatewayConfig,
    ca: Ca,
    pub(crate) db: events::db::Db,
    pub(crate) appender: Appender,
    pub(crate) reader: Reader,
    stats: Arc<GatewayStats>,
    streams: Arc<Semaphore>,
    pending_hellos: AtomicUsize,
    bucket: Mutex<Bucket>,
    sessions: Mutex<HashMap<String, SessionEntry>>,
    writes: mpsc::Sender<Write>,
    /// Commands not yet terminal, as the log says.
    commands: Mutex<Commands>,
    /// API callers waiting for a reservation's (`r:<id>`) or a command's
    /// (`c:<id>`) outcome.
    waiters: Mutex<HashMap<String, Vec<oneshot::Sender<Waited>>>>,
    /// Revoked client certificates (operators of the client API).
    pub(crate) revoked: crate::revocation::Revoked,
    /// The pool index ListPools answers from: built from the log on the
    /// first call, then brought up to date from where it stopped.
    pub(crate) pools: tokio::sync::Mutex<projections::Index>,
    /// The connection joins run their transactions on (one at a time: a
    /// join is rare and short), made when first needed or after it closed.
    joins: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
}

/// What an API caller waited for.
pub(crate) enum Waited {
    Reservation {
        state: String,
        reason: String,
        allocations: Vec<projections::Allocation>,
    },
    Command(commands::Tracked),
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

    fn notify(&self, key: &str, make: impl Fn() -> Waited) {
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

fn pushback(reason: &str, base_ms: u32) -> Status {
    // Full jitter around the base: [base/2, 3*base/2).
    let ms = base_ms / 2 + fastrand::u32(0..base_ms.max(1));
    let mut s = Status::resource_exhausted(format!("{reason}; retry in {ms} ms"));
    if let Ok(v) = ms.to_string().parse() {
        s.metadata_mut().insert("retry-after-ms", v);
    }
    s
}

impl Shared {
    fn admit(&self) -> Result<OwnedSemaphorePermit, Status> {
        {
            let mut b = self.bucket.lock().expect("bucket lock");
            let now = Instant::now();
            let rate = self.config.handshakes_per_second.max(0.001);
            b.tokens =
                (b.tokens + now.duration_since(b.last).as_secs_f64() * rate).min(rate.max(1.0));
            b.last = now;
            if b.tokens < 1.0 {
                self.stats.refused_admission.fetch_add(1, Ordering::Relaxed);
                return Err(pushback("too many new sessions per second", 1000));
            }
            b.tokens -= 1.0;
        }
        let permit = self.streams.clone().try_acquire_owned().map_err(|_| {
            self.stats.refused_admission.fetch_add(1, Ordering::Relaxed);
            pushback("this gateway holds its maximum of sessions", 5000)
        })?;
        let pending = self.pending_hellos.fetch_add(1, Ordering::AcqRel);
        if pending >= self.config.max_pending_hellos {
            self.pending_hellos.fetch_sub(1, Ordering::AcqRel);
            self.stats.refused_admission.fetch_add(1, Ordering::Relaxed);
            return Err(pushback("too many sessions waiting for their Hello", 1000));
        }
        Ok(permit)
    }

    async fn write(&self, w: Write) -> Result<u64, AppendError> {
        let (tx, rx) = oneshot::channel();
        let w = Write {
            done: Some(tx),
            ..w
        };
        if self.writes.send(w).await.is_err() {
            return Err(AppendError::Closed);
        }
        rx.await.unwrap_or(Err(AppendError::Closed))
    }

    /// Queues a write without waiting for it.
    fn write_later(&self, w: Write) {
        if self.writes.try_send(w).is_err() {
            self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("the gateway's write queue is full; an event was dropped");
        }
    }

    /// A write fenced by the node's current session, if this gateway holds it.
    fn session_write(&self, node: &str, event: NewEvent) {
        let (expected, epoch) = {
            let sessions = self.sessions.lock().expect("sessions lock");
            match sessions.get(node) {
                Some(s) => (ExpectedVersion::Exact(s.version), s.epoch),
                None => return,
            }
        };
        self.write_later(Write {
            stream: node_stream(node),
            session: Some((node.to_string(), epoch)),
            expected,
            events: vec![event],
            done: None,
        });
    }
}

/// A running gateway.
pub struct Running {
    pub addr: SocketAddr,
    pub stats: Arc<GatewayStats>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), GatewayError>>,
}

impl Running {
    /// Stops accepting, ends the sessions and waits for the server to stop.
    pub async fn stop(mut self) -> Result<(), GatewayError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.unwrap_or(Ok(()))
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// Starts a gateway.
pub async fn start(
    db: tokio_postgres::Config,
    reader: Reader,
    appender: Appender,
    config: GatewayConfig,
) -> Result<Running, GatewayError> {
    let ca = Ca::load(&config.ca_dir)?;
    let (cert, key) = ca.server_identity(&config.names)?;
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(cert, key))
        .client_ca_root(Certificate::from_pem(ca.cert_pem()))
        .client_auth_optional(true);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| GatewayError::Listen {
            addr: config.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| GatewayError::Listen {
            addr: config.listen,
            source,
        })?;
    let stats = Arc::new(GatewayStats::default());
    let (writes, writes_rx) = mpsc::channel(65_536);
    let shared = Arc::new(Shared {
        streams: Arc::new(Semaphore::new(config.max_streams)),
        pending_hellos: AtomicUsize::new(0),
        bucket: Mutex::new(Bucket {
            tokens: config.handshakes_per_second.max(1.0),
            last: Instant::now(),
        }),
        sessions: Mutex::new(HashMap::new()),
        db: events::db::Db::new(db),
        appender,
        stats: stats.clone(),
        ca,
        writes,
        config,
        reader: reader.clone(),
        commands: Mutex::new(Commands::default()),
        waiters: Mutex::new(HashMap::new()),
        revoked: Default::default(),
        pools: tokio::sync::Mutex::new(projections::Index::new()),
        joins: tokio::sync::Mutex::new(None),
    });
    // Follow commands from now, then load the ones still open (an event seen
    // twice is applied once).
    let sub = reader
        .subscribe_ephemeral(events::Start::Now)
        .await
        .map_err(|e| GatewayError::Commands(e.to_string()))?;
    {
        let client = shared.db.get().await?;
        let open = commands::open(&client).await?;
        let mut cmds = shared.commands.lock().expect("commands lock");
        for t in open {
            cmds.by_id.entry(t.command.id.clone()).or_insert(t);
        }
    }
    let dispatcher = events::task::spawn("gateway-commands", dispatcher(shared.clone(), sub));
    let max = shared.config.max_message_bytes;
    let join = join_server::JoinServer::new(JoinService {
        shared: shared.clone(),
    })
    .max_decoding_message_size(max);
    let session = session_server::SessionServer::new(SessionService {
        shared: shared.clone(),
    })
    .max_decoding_message_size(max);
    let api = crate::api_proto::api_server::ApiServer::new(crate::api::ApiService {
        shared: shared.clone(),
    })
    .max_decoding_message_size(max);
    let (stop, stop_rx) = oneshot::channel::<()>();
    let writer = events::task::spawn("gateway-writer", writer(shared.clone(), writes_rx));
    let sweeper = events::task::spawn("gateway-sweeper", sweeper(shared.clone()));
    let server = Server::builder()
        .tls_config(tls)?
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(join)
        .add_service(session)
        .add_service(api)
        .serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), {
            let shared = shared.clone();
            async move {
                let _ = stop_rx.await;
                // End every session with a status that sends its node
                // elsewhere; the server then drains.
                let sessions: Vec<_> = shared
                    .sessions
                    .lock()
                    .expect("sessions lock")
                    .drain()
                    .map(|(_, s)| s.tx)
                    .collect();
                for tx in sessions {
                    let _ = tx.try_send(Err(pushback("this gateway is shutting down", 200)));
                }
            }
        });
    tracing::info!(%addr, id = %shared.config.id, "gateway listening");
    let task = events::task::spawn("gateway", async move {
        let r = server.await;
        tracing::info!(id = %shared.config.id, "gateway stopped");
        sweeper.abort();
        dispatcher.abort();
        // End the sessions' streams so the server can finish.
        shared.sessions.lock().expect("sessions lock").clear();
        writer.abort();
        r.map_err(GatewayError::from)
    });
    Ok(Running {
        addr,
        stats,
        stop: Some(stop),
        task,
    })
}

struct JoinService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl join_server::Join for JoinService {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinResponse>, Status> {
        let req = req.into_inner();
        projections::domain::valid_name("node id", &req.node_id)
            .map_err(Status::invalid_argument)?;
        let signed = self
            .shared
            .ca
            .sign_node(
                &req.node_id,
                &req.csr_pem,
                self.shared.config.certificate_days,
            )
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let mut conn = self.shared.joins.lock().await;
        if conn.as_ref().is_none_or(|c| c.is_closed()) {
            *conn = Some(
                events::db::connect(&self.shared.db.config, "join-connection")
                    .await
                    .map_err(|e| Status::unavailable(format!("database: {e}")))?,
            );
        }
        let client = conn.as_mut().expect("connected above");
        let pool = identity::redeem(client, &req.token, &req.node_id, &signed)
            .await
            .map_err(|e| match e {
                identity::IdentityError::BadToken => Status::permission_denied(e.to_string()),
                e => Status::unavailable(e.to_string()),
            })?;
        self.shared.stats.joins.fetch_add(1, Ordering::Relaxed);
        tracing::info!(node = %req.node_id, %pool, serial = %signed.serial, "node joined");
        Ok(Response::new(JoinResponse {
            certificate_pem: signed.certificate_pem,
            ca_pem: self.shared.ca.cert_pem().to_string(),
            pool,
        }))
    }
}

struct SessionService {
    shared: Arc<Shared>,
}

type Outbound = Pin<Box<dyn Stream<Item = Result<GatewayMessage, Status>> + Send>>;

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
        let (tx, rx) = mpsc::channel(64);
        let tx = Outbox(tx);
        events::task::spawn(
            "gateway-session",
            session(
                shared,
                id.node,
                record.pool,
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
fn refusal(status: Status) -> Status {
    match status.code() {
        tonic::Code::Internal | tonic::Code::Unknown => {
            Status::invalid_argument(format!("malformed message: {}", status.message()))
        }
        _ => status,
    }
}

type Reply = Result<GatewayMessage, Status>;

/// A session's outgoing queue. Items are boxed: a queue block holds 32 slots
/// whatever the capacity, and an unboxed `Status` is about 200 bytes, which
/// at 10,000 sessions is 60 MiB of mostly empty slots.
#[derive(Clone)]
pub(crate) struct Outbox(mpsc::Sender<Box<Reply>>);

impl Outbox {
    async fn send(&self, r: Reply) -> Result<(), ()> {
        self.0.send(Box::new(r)).await.map_err(|_| ())
    }

    fn try_send(&self, r: Reply) -> Result<(), ()> {
        self.0.try_send(Box::new(r)).map_err(|_| ())
    }
}

/// Counts a session as waiting for its Hello until dropped.
struct PendingHello(Arc<Shared>);

impl Drop for PendingHello {
    fn drop(&mut self) {
        self.0.pending_hellos.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn session(
    shared: Arc<Shared>,
    node: String,
    pool: String,
    mut inbound: Streaming<NodeMessage>,
    tx: Outbox,
    _permit: OwnedSemaphorePermit,
    pending: PendingHello,
) {
    let first = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await;
    let hello = match first {
        Ok(Ok(Some(NodeMessage {
            body: Some(node_message::Body::Hello(h)),
        }))) => h,
        Ok(Err(status)) => {
            tracing::debug!(%node, %status, "session ended before its Hello");
            let _ = tx.send(Err(refusal(status))).await;
            return;
        }
        _ => {
            let _ = tx
                .send(Err(Status::invalid_argument(
                    "the first message of a session must be Hello",
                )))
                .await;
            return;
        }
    };
    drop(pending);
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
        return;
    }
    // Take ownership: append at the version read; the new version is the epoch.
    // The long-lived session task stays small: futures that run once (or
    // now and then) are boxed instead of living in its state machine.
    let epoch = match Box::pin(open_session(&shared, &node, &hello)).await {
        Ok(e) => e,
        Err(e) => {
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
    {
        let mut sessions = shared.sessions.lock().expect("sessions lock");
        sessions.insert(
            node.clone(),
            SessionEntry {
                epoch,
                version: epoch,
                last_heartbeat: Instant::now(),
                reachable: true,
                status: None,
                closed: false,
                tx: tx.clone(),
            },
        );
        shared.stats.sessions.store(
            sessions.values().filter(|s| !s.closed).count() as u64,
            Ordering::Relaxed,
        );
    }
    shared.stats.sessions_opened.fetch_add(1, Ordering::Relaxed);
    let welcome = GatewayMessage {
        body: Some(gateway_message::Body::Welcome(Welcome {
            epoch,
            heartbeat_seconds: shared.config.heartbeat.as_secs().max(1) as u32,
            want_sections: want,
        })),
    };
    if tx.send(Ok(welcome)).await.is_err() {
        return;
    }
    // Commands issued while the node was away.
    let pending: Vec<GatewayMessage> = {
        let cmds = shared.commands.lock().expect("commands lock");
        let mut open: Vec<_> = cmds
            .by_id
            .values()
            .filter(|t| t.command.node == node && !t.state.is_terminal())
            .collect();
        open.sort_by_key(|t| t.command.deadline_ms);
        open.into_iter().map(|t| to_message(&t.command)).collect()
    };
    for m in pending {
        if tx.send(Ok(m)).await.is_err() {
            return;
        }
    }
    tracing::debug!(%node, epoch, "session open");
    loop {
        let msg = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(status) => {
                tracing::debug!(%node, %status, "session stream ended with an error");
                let _ = tx.send(Err(refusal(status))).await;
                break;
            }
        };
        if let Err(status) = Box::pin(handle(&shared, &node, &pool, epoch, msg)).await {
            let _ = tx.send(Err(status)).await;
            break;
        }
    }
    let mut sessions = shared.sessions.lock().expect("sessions lock");
    if let Some(s) = sessions.get_mut(&node) {
        if s.epoch == epoch {
            s.closed = true;
        }
    }
    shared.stats.sessions.store(
        sessions.values().filter(|s| !s.closed).count() as u64,
        Ordering::Relaxed,
    );
}

async fn open_session(
    shared: &Shared,
    node: &str,
    hello: &crate::proto::Hello,
) -> Result<u64, AppendError> {
    let stream = node_stream(node);
    for _ in 0..5 {
        let client = shared
            .db
            .get()
            .await
            .map_err(|e| AppendError::OutcomeUnknown(e.to_string()))?;
        let version: i64 = client
            .query_opt(
                "SELECT version FROM strata.streams WHERE stream = $1",
                &[&stream],
            )
            .await
            .map_err(|e| AppendError::OutcomeUnknown(e.to_string()))?
            .map_or(0, |r| r.get(0));
        let event = NewEvent::new(
            "node.session_opened",
            &serde_json::json!({
                "node": node,
                "gateway": shared.config.id,
                "generation": hello.generation,
                "agent_version": hello.agent_version,
            }),
        );
        match shared
            .write(Write {
                stream: stream.clone(),
                session: None,
                expected: ExpectedVersion::Exact(version as u64),
                events: vec![event],
                done: None,
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

async fn wanted_sections(
    shared: &Shared,
    node: &str,
    offered: &HashMap<String, String>,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let client = shared.db.get().await?;
    let known: HashMap<String, String> = client
        .query(
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

async fn handle(
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
        node_message::Body::Heartbeat(_) => {
            let became_reachable = {
                let mut sessions = shared.sessions.lock().expect("sessions lock");
                match sessions.get_mut(node) {
                    Some(s) if s.epoch == epoch => {
                        s.last_heartbeat = Instant::now();
                        !std::mem::replace(&mut s.reachable, true)
                    }
                    _ => {
                        return Err(Status::aborted(
                            "a newer session for this node replaced this one",
                        ))
                    }
                }
            };
            if became_reachable {
                shared.stats.transitions.fetch_add(1, Ordering::Relaxed);
                shared.session_write(
                    node,
                    NewEvent::new("node.reachable", &serde_json::json!({ "node": node })),
                );
            }
        }
        node_message::Body::Status(s) => {
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
                shared.session_write(
                    node,
                    NewEvent::new(
                        "node.status",
                        &serde_json::json!({ "node": node, "state": s.state, "detail": s.detail }),
                    ),
                );
            }
        }
        node_message::Body::Inventory(section) => {
            let mut devices = Vec::with_capacity(section.devices.len());
            for d in section.devices {
                if d.id.is_empty() || d.class.is_empty() {
                    return Err(Status::invalid_argument("a device needs an id and a class"));
                }
                devices.push(DeviceSpec {
                    id: d.id,
                    class: d.class,
                    memory_mb: d.memory_mb,
                    island: (!d.island.is_empty()).then_some(d.island),
                    pci: (!d.pci.is_empty()).then_some(d.pci),
                    numa: Some(d.numa),
                });
            }
            let fact = Fact::NodeJoined {
                node: node.to_string(),
                devices,
            };
            let (shared, node, name, hash) =
                (shared.clone(), node.to_string(), section.name, section.hash);
            let stream = pool_stream(pool);
            tokio::spawn(async move {
                let r = shared
                    .write(Write {
                        stream,
                        session: None,
                        expected: ExpectedVersion::StreamExists,
                        events: vec![fact.to_event()],
                        done: None,
                    })
                    .await;
                match r {
                    Ok(_) => {
                        if let Ok(c) = shared.db.get().await {
                            let _ = c
                                .execute(
                                    "INSERT INTO strata.node_sections (node, section, hash) VALUES ($1, $2, $3)
                                     ON CONFLICT (node, section) DO UPDATE SET hash = $3, updated_at = now()",
                                    &[&node, &name, &hash],
                                )
                                .await;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%node, error = %e, "could not write the node's inventory")
                    }
                }
            });
        }
        node_message::Body::Health(h) => {
            let device = (!h.device.is_empty()).then_some(h.device);
            let fact = if h.cleared {
                Fact::HealthCleared {
                    node: node.to_string(),
                    device,
                    condition: h.condition,
                }
            } else {
                Fact::HealthRaised {
                    node: node.to_string(),
                    device,
                    condition: h.condition,
                    detail: h.detail,
                }
            };
            shared.write_later(Write {
                stream: pool_stream(pool),
                session: None,
                expected: ExpectedVersion::StreamExists,
                events: vec![fact.to_event()],
                done: None,
            });
        }
        node_message::Body::Ack(a) => {
            let payload = serde_json::json!({
                "id": a.command_id, "node": node, "gateway": shared.config.id,
            });
            command_transition(shared, node, &a.command_id, commands::ACKED, payload).await?;
        }
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
            });
            command_transition(shared, node, &r.command_id, t, payload).await?;
        }
    }
    Ok(())
}

/// Appends everything queued in one I/O turn as one transaction.
async fn writer(shared: Arc<Shared>, mut rx: mpsc::Receiver<Write>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < 4096 {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        while !batch.is_empty() {
            // One StreamAppend per stream, in first-seen order.
            let mut order: Vec<String> = Vec::new();
            let mut by_stream: HashMap<String, StreamAppend> = HashMap::new();
            for w in &batch {
                let a = by_stream.entry(w.stream.clone()).or_insert_with(|| {
                    order.push(w.stream.clone());
                    StreamAppend {
                        stream: w.stream.clone(),
                        expected: w.expected,
                        events: Vec::new(),
                    }
                });
                a.events.extend(w.events.iter().cloned());
            }
            let appends: Vec<StreamAppend> =
                order.iter().filter_map(|s| by_stream.remove(s)).collect();
            let events: u64 = appends.iter().map(|a| a.events.len() as u64).sum();
            match shared.appender.append_batch(appends).await {
                Ok(done) => {
                    shared.stats.batches.fetch_add(1, Ordering::Relaxed);
                    shared
                        .stats
                        .events_written
                        .fetch_add(events, Ordering::Relaxed);
                    let versions: HashMap<&str, u64> = done
                        .iter()
                        .map(|a| (a.stream.as_str(), a.version))
                        .collect();
                    {
                        let mut sessions = shared.sessions.lock().expect("sessions lock");
                        for w in &batch {
                            if let Some((node, epoch)) = &w.session {
                                if let (Some(s), Some(v)) =
                                    (sessions.get_mut(node), versions.get(w.stream.as_str()))
                                {
                                    if s.epoch == *epoch {
                                        s.version = *v;
                                    }
                                }
                            }
                        }
                    }
                    for w in batch.drain(..) {
                        if let Some(done) = w.done {
                            let _ = done
                                .send(Ok(versions.get(w.stream.as_str()).copied().unwrap_or(0)));
                        }
                    }
                }
                Err(AppendError::VersionConflict {
                    stream,
                    expected,
                    actual,
                }) => {
                    // That stream moved: its writer is fenced. Drop its
                    // writes and commit the rest.
                    let (fenced, rest): (Vec<Write>, Vec<Write>) =
                        batch.drain(..).partition(|w| w.stream == stream);
                    batch = rest;
                    for w in fenced {
                        if let Some((node, epoch)) = &w.session {
                            shared.stats.fenced.fetch_add(1, Ordering::Relaxed);
                            let mut sessions = shared.sessions.lock().expect("sessions lock");
                            if sessions.get(node).is_some_and(|s| s.epoch == *epoch) {
                                if let Some(s) = sessions.remove(node) {
                                    tracing::info!(%node, epoch, "fenced: a newer session for the node exists elsewhere");
                                    let _ = s.tx.try_send(Err(Status::aborted(
                                        "a newer session for this node was opened on another gateway",
                                    )));
                                }
                            }
                        }
                        if let Some(done) = w.done {
                            let _ = done.send(Err(AppendError::VersionConflict {
                                stream: stream.clone(),
                                expected,
                                actual,
                            }));
                        }
                    }
                }
                Err(e) => {
                    shared.stats.write_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, writes = batch.len(), "a batch of node events failed");
                    for w in batch.drain(..) {
                        if let Some(done) = w.done {
                            let _ = done.send(Err(e.clone()));
                        }
                    }
                }
            }
        }
    }
}

/// Marks nodes unreachable after three missed heartbeats and forgets closed
/// sessions once that is written.
async fn sweeper(shared: Arc<Shared>) {
    let period = (shared.config.heartbeat / 2).max(Duration::from_millis(100));
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        let limit = shared.config.heartbeat * 3;
        let mut lost = Vec::new();
        {
            let mut sessions = shared.sessions.lock().expect("sessions lock");
            sessions.retain(|node, s| {
                if s.reachable && s.last_heartbeat.elapsed() > limit {
                    s.reachable = false;
                    lost.push((node.clone(), s.epoch, s.version));
                }
                !s.closed || s.reachable
            });
        }
        for (node, epoch, version) in lost {
            shared.stats.transitions.fetch_add(1, Ordering::Relaxed);
            shared.write_later(Write {
                stream: node_stream(&node),
                session: Some((node.clone(), epoch)),
                expected: ExpectedVersion::Exact(version),
                events: vec![NewEvent::new(
                    "node.unreachable",
                    &serde_json::json!({ "node": node }),
                )],
                done: None,
            });
        }
    }
}

fn to_message(c: &commands::Command) -> GatewayMessage {
    GatewayMessage {
        body: Some(gateway_message::Body::Command(crate::proto::Command {
            id: c.id.clone(),
            kind: c.kind.clone(),
            args_json: c.args.to_string(),
            deadline_unix_ms: c.deadline_ms as i64,
        })),
    }
}

/// Moves a command of `node` to its next state, at the version the gateway
/// knows; a command of another node is refused, one that is already
/// terminal (a result sent again after a reconnect) is left alone.
async fn command_transition(
    shared: &Shared,
    node: &str,
    id: &str,
    event_type: &str,
    payload: serde_json::Value,
) -> Result<(), Status> {
    let target = CommandState::from_event_type(event_type).expect("a command event");
    for _ in 0..3 {
        let version = {
            let cmds = shared.commands.lock().expect("commands lock");
            match cmds.by_id.get(id) {
                None => {
                    tracing::debug!(%node, command = %id, "a report for a command this gateway does not know (finished, or not yet seen)");
                    return Ok(());
                }
                Some(t) if t.command.node != node => {
                    shared
                        .stats
                        .refused_identity
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(Status::permission_denied(format!(
                        "command {id} is for node {}, not {node}",
                        t.command.node
                    )));
                }
                Some(t) if t.state.is_terminal() || t.state == target => return Ok(()),
                Some(t) => t.version,
            }
        };
        match commands::transition(&shared.appender, id, version, event_type, &payload).await {
            Ok(v) => {
                let mut cmds = shared.commands.lock().expect("commands lock");
                if let Some(t) = cmds.by_id.get_mut(id) {
                    if v > t.version {
                        t.version = v;
                        t.state = target;
                    }
                }
                if target.is_terminal() {
                    shared
                        .stats
                        .commands_finished
                        .fetch_add(1, Ordering::Relaxed);
                }
                return Ok(());
            }
            Err(AppendError::VersionConflict { actual, .. }) => {
                // Another write landed first (an expiry, another gateway):
                // wait for the subscription to catch up, then look again.
                let deadline = Instant::now() + Duration::from_secs(2);
                while Instant::now() < deadline {
                    let seen = shared
                        .commands
                        .lock()
                        .expect("commands lock")
                        .by_id
                        .get(id)
                        .is_none_or(|t| t.version >= actual);
                    if seen {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            Err(e) => {
                return Err(Status::unavailable(format!(
                    "record the command's state: {e}"
                )))
            }
        }
    }
    Err(Status::unavailable("the command's state kept moving"))
}

/// Follows command events: tracks their state, pushes new ones to the node's
/// session if this gateway holds it, and expires overdue ones.
async fn dispatcher(shared: Arc<Shared>, mut sub: events::Subscription) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            e = sub.next() => {
                let e = match e {
                    Ok(e) => e,
                    Err(err) => {
                        tracing::error!(error = %err, "the gateway's command subscription failed");
                        return;
                    }
                };
                sub.ack(e.position);
                if e.event_type == "node.revoked" {
                    // A revoked node's live session ends now, not at its
                    // next reconnect.
                    if let Some(node) = e.stream.strip_prefix("node/") {
                        let gone = shared.sessions.lock().expect("sessions lock").remove(node);
                        if let Some(s) = gone {
                            shared.stats.refused_identity.fetch_add(1, Ordering::Relaxed);
                            let _ = s.tx.try_send(Err(Status::permission_denied(format!(
                                "the certificate of node {node} is revoked"
                            ))));
                            tracing::info!(%node, "ended the session of a revoked node");
                        }
                    }
                    continue;
                }
                if e.stream.starts_with("pool/") {
                    let outcome = match projections::domain::canonical_type(&e.event_type) {
                        "reservation.placed" => Some("placed"),
                        "reservation.rejected" => Some("unschedulable"),
                        "reservation.released" => Some("released"),
                        "reservation.expired" => Some("expired"),
                        _ => None,
                    };
                    if let (Some(state), Ok(Some(fact))) = (outcome, Fact::parse(&e.event_type, &e.payload)) {
                        if let Some(id) = fact.reservation() {
                            let (reason, allocations) = match &fact {
                                Fact::ReservationPlaced { allocations, .. } => (String::new(), allocations.clone()),
                                Fact::ReservationUnschedulable { reason, .. } => (reason.clone(), Vec::new()),
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
                        .then(|| cmds.by_id.get(id).map(|t| t.command.clone()))
                        .flatten();
                    // Terminal commands are no longer needed here.
                    if cmds.by_id.get(id).is_some_and(|t| t.state.is_terminal()) {
                        if let Some(t) = cmds.by_id.remove(id) {
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
                            shared.stats.commands_dispatched.fetch_add(1, Ordering::Relaxed);
                        } else {
                            shared.stats.command_drops.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(node = %c.node, command = %c.id, "the session's queue is full; the command is sent again when the node reconnects");
                        }
                    }
                }
            }
            _ = tick.tick() => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                let overdue: Vec<(String, u64)> = shared
                    .commands
                    .lock()
                    .expect("commands lock")
                    .by_id
                    .values()
                    .filter(|t| !t.state.is_terminal() && t.command.deadline_ms + 1000 < now)
                    .map(|t| (t.command.id.clone(), t.version))
                    .collect();
                for (id, version) in overdue {
                    let payload = serde_json::json!({ "id": id, "gateway": shared.config.id });
                    if commands::transition(&shared.appender, &id, version, commands::EXPIRED, &payload).await.is_ok() {
                        shared.stats.commands_finished.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}
