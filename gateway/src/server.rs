//! The gateway server's wiring: one rustls (ring) listener serving the Join
//! service (no client certificate needed), the Session service (client
//! certificate required) and the client API, and the tasks behind them (the
//! writer, the sweeper, the command dispatcher, the lease and the sweep of
//! lapsed gateways' nodes).
//!
//! The parts: `state` (what they share), `admission`, `join`, `session`,
//! `writer`, `dispatch`.

use crate::ca::Ca;
use crate::proto::{join_server, session_server};
use domain::commands::{self, Commands};
use events::{Appender, Reader};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tonic::transport::Server;

use crate::bucket::Bucket;
use crate::dispatch::dispatcher;
use crate::join::JoinService;
use crate::session::{sweeper, SessionService};
use crate::state::Shared;
pub use crate::state::{GatewayConfig, GatewayError, GatewayStats};
use crate::writer::writer;

/// A running gateway.
pub struct Running {
    pub addr: SocketAddr,
    pub stats: Arc<GatewayStats>,
    pub listener: Arc<crate::listener::ListenerStats>,
    conns: Arc<crate::listener::Conns>,
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

    /// Connections open, and how many of them have no RPC in progress.
    pub fn connections(&self) -> (usize, usize) {
        self.conns.counts()
    }
}

/// How long a stopping gateway waits for its connections to finish.
const DRAIN: Duration = Duration::from_secs(10);

/// Starts a gateway.
pub async fn start(
    db: impl Into<events::db::Database>,
    reader: Reader,
    appender: Appender,
    config: GatewayConfig,
) -> Result<Running, GatewayError> {
    let db = db.into();
    let ca = Ca::load(&config.ca_dir)?;
    let (cert, key) = ca.server_identity_for(&config.names, config.serving_validity)?;
    let serving = crate::listener::ServingCert::new(&cert, &key).map_err(GatewayError::Tls)?;
    let tls = crate::listener::server_config(serving.clone(), ca.cert_pem())
        .map_err(GatewayError::Tls)?;
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
    let listener_stats = Arc::new(crate::listener::ListenerStats::default());
    crate::metrics::count_listener(&listener_stats);
    let (conns, gate) = connection_limits(&config, listener_stats.clone());
    let renewer = ops::task::spawn(
        "gateway-serving-cert",
        crate::ca::keep_renewed(
            config.ca_dir.clone(),
            config.names.clone(),
            config.serving_validity,
            "gateway",
            move |cert, key| serving.replace(cert, key),
        ),
    );
    let (writes, writes_rx) = mpsc::channel(65_536);
    let shared = new_shared(config, db, appender, reader.clone(), ca, writes, gate);
    let stats = shared.stats.clone();
    crate::metrics::count_gateway(&stats);
    // The lease before any session: each session carries its epoch.
    let orphans = crate::liveness::start(&shared)
        .await
        .map_err(GatewayError::Lease)?;
    // Follow commands from now, then load the ones still open (an event seen
    // twice is applied once).
    let sub = async {
        let sub = reader
            .subscribe_ephemeral_as("gateway-commands", events::Start::Now)
            .await
            .map_err(|e| GatewayError::Commands(e.to_string()))?;
        let client = shared.db.get().await?;
        let open = commands::open(&client).await?;
        let mut cmds = shared.commands.lock().expect("commands lock");
        for t in open {
            if cmds.get(&t.command.id).is_none() {
                cmds.insert(t);
            }
        }
        Ok::<_, GatewayError>(sub)
    }
    .await
    .inspect_err(|_| {
        // The lease's thread ends with the gateway.
        shared.stopping.send_replace(true);
        orphans.abort();
    })?;
    let dispatcher = ops::task::spawn("gateway-commands", dispatcher(shared.clone(), sub));
    let expirer = ops::task::spawn("gateway-expiry", crate::expiry::expirer(shared.clone()));
    let acks = ops::task::spawn("gateway-acks", crate::acks::writer(shared.clone()));
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
    let writer = ops::task::spawn("gateway-writer", writer(shared.clone(), writes_rx));
    let sweeper = ops::task::spawn("gateway-sweeper", sweeper(shared.clone()));

    let tokens: crate::listener::TokenCheck = {
        let shared = shared.clone();
        Arc::new(move |hash| {
            let shared = shared.clone();
            Box::pin(async move { shared.token_known(&hash).await.unwrap_or(false) })
        })
    };
    let incoming = crate::listener::serve(listener, tls, conns.clone(), tokens);
    let server = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .layer(crate::listener::ActivityLayer {
            conns: conns.clone(),
        })
        .layer(crate::metrics::RpcLayer)
        .add_service(join)
        .add_service(session)
        .add_service(api)
        .serve_with_incoming_shutdown(incoming, {
            let shared = shared.clone();
            async move {
                let _ = stop_rx.await;
                // End every session with a status that sends its node
                // elsewhere, and every client stream; the server then
                // drains.
                shared.stopping.send_replace(true);
                crate::admission::end_sessions(&shared, "this gateway is shutting down");
            }
        });
    tracing::info!(%addr, id = %shared.config.id, "gateway listening");
    let task = ops::task::spawn("gateway", async move {
        // The drain has a deadline: a client that keeps a stream open past
        // it has its connection closed.
        let mut stopping = shared.stopping.subscribe();
        tokio::pin!(server);
        let r = tokio::select! {
            r = &mut server => r,
            _ = async {
                let _ = stopping.wait_for(|s| *s).await;
                tokio::time::sleep(DRAIN).await;
            } => {
                tracing::warn!(id = %shared.config.id, "streams still open {} s after the gateway began to stop: closing their connections", DRAIN.as_secs());
                Ok(())
            }
        };
        tracing::info!(id = %shared.config.id, "gateway stopped");
        // The lease's thread ends with it.
        shared.stopping.send_replace(true);
        sweeper.abort();
        orphans.abort();
        dispatcher.abort();
        expirer.abort();
        acks.abort();
        renewer.abort();
        // End the sessions' streams so the server can finish.
        shared.sessions.lock().expect("sessions lock").clear();
        writer.abort();
        r.map_err(GatewayError::from)
    });
    Ok(Running {
        addr,
        stats,
        listener: listener_stats,
        conns,
        stop: Some(stop),
        task,
    })
}

/// What every part of the gateway shares, before any task runs.
/// The listener's connection table, with the handshake gate it shares with
/// the join checks.
fn connection_limits(
    config: &GatewayConfig,
    stats: Arc<crate::listener::ListenerStats>,
) -> (
    Arc<crate::listener::Conns>,
    Arc<crate::handshakes::HandshakeGate>,
) {
    let gate = Arc::new(crate::handshakes::HandshakeGate::new(
        config.unknown_handshakes_per_second,
    ));
    let limits = crate::listener::Limits {
        handshake_timeout: config.handshake_timeout,
        idle_timeout: config.idle_timeout,
        max_idle: config.max_idle_connections,
        request_deadline: config.request_deadline,
        max_unauthenticated: config.max_unauthenticated_connections,
    };
    let conns = crate::listener::Conns::new(limits, gate.clone(), stats);
    (conns, gate)
}

fn new_shared(
    config: GatewayConfig,
    db: events::db::Database,
    appender: Appender,
    reader: Reader,
    ca: Ca,
    writes: mpsc::Sender<crate::state::Write>,
    handshakes: Arc<crate::handshakes::HandshakeGate>,
) -> Arc<Shared> {
    Arc::new(Shared {
        handshakes,
        streams: Arc::new(Semaphore::new(config.max_streams)),
        pending_hellos: AtomicUsize::new(0),
        welcomes: Default::default(),
        bucket: Mutex::new(Bucket {
            tokens: config.handshakes_per_second.max(1.0),
            last: Instant::now(),
        }),
        join_bucket: Mutex::new(Bucket {
            tokens: config.joins_per_second.max(1.0),
            last: Instant::now(),
        }),
        join_limits: Default::default(),
        sessions: Mutex::new(HashMap::new()),
        db: events::db::SharedClient::new(db),
        appender,
        stats: Arc::new(GatewayStats::default()),
        ca,
        writes,
        config,
        reader: reader.clone(),
        commands: Mutex::new(Commands::default()),
        acks: Default::default(),
        waiters: Mutex::new(HashMap::new()),
        revoked: Default::default(),
        pools: tokio::sync::Mutex::new(projections::Index::new()),
        joins: tokio::sync::Mutex::new(None),
        lease_epoch: std::sync::atomic::AtomicI64::new(0),
        reports: Semaphore::new(crate::usage::AT_ONCE),
        stopping: tokio::sync::watch::Sender::new(false),
        clock: ops::process_clock::ProcessClock::new(crate::state::HEARD_SLACK),
        record_retries: ops::warn_every::WarnEvery::new(Duration::from_secs(1)),
    })
}
