//! Strata's web console (the `console` role): server-rendered pages over
//! HTTPS with the region's serving certificate, live from one subscription
//! on the log per process, fanned out to every browser by Server-Sent
//! Events. Its assets are compiled in; there is no front-end toolchain.
//!
//! - `server.rs`: TLS, HTTP/1.1 connections and their limits; `router.rs`
//!   which page or action a request is (`reply.rs`: what it answers with),
//!   and who asks (`auth.rs`: one-time
//!   sign-in links, sessions, client certificates, CSRF tokens).
//! - `live.rs`: the subscription folded into an index, the newest events
//!   and a broadcast of each; `mentions.rs` which events name which
//!   reservation and node (their timelines); `samples.rs` queues' usage
//!   over time; `sse.rs` a browser's live stream; `metrics.rs` what it
//!   reports to Prometheus.
//! - `html.rs`: escaping and the page frame; `pages/`: one module per page;
//!   `actions.rs`: what a signed-in operator may do, through the same
//!   functions (and the same checks) as the client API; `form.rs`: the
//!   bodies and query strings they carry.

pub mod actions;
pub mod auth;
pub mod form;
pub mod html;
pub mod live;
pub mod mentions;
pub mod metrics;
pub mod pages;
pub mod reply;
pub mod router;
pub mod samples;
pub mod server;
pub mod sse;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How the console is served.
#[derive(Clone)]
pub struct ConsoleConfig {
    pub listen: SocketAddr,
    /// The serving certificate and key (PEM) and the region's root CA,
    /// whose operator certificates sign in without a link.
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: String,
    /// How long a signed-in browser session lasts.
    pub session_ttl: Duration,
    /// Most connections at once (live streams included).
    pub max_connections: usize,
    /// Most live streams at once.
    pub max_streams: usize,
    /// Pool index snapshots (the placer's) to start from instead of the
    /// log's beginning; timelines then know positions only from there on.
    pub snapshots: Option<projections::SnapshotStore>,
}

impl ConsoleConfig {
    pub fn new(
        listen: SocketAddr,
        cert_pem: String,
        key_pem: String,
        client_ca_pem: String,
    ) -> Self {
        ConsoleConfig {
            listen,
            cert_pem,
            key_pem,
            client_ca_pem,
            session_ttl: Duration::from_secs(8 * 3600),
            max_connections: 2048,
            max_streams: 1024,
            snapshots: None,
        }
    }
}

/// What every request shares.
pub struct Shared {
    pub live: Arc<live::Live>,
    pub db: events::db::SharedClient,
    pub appender: events::Appender,
    pub revoked: gateway::revocation::Revoked,
    pub root_subject: Vec<u8>,
    pub config: ConsoleConfig,
    pub streams: Arc<tokio::sync::Semaphore>,
    /// Usage reports running now (`pages/usage.rs`).
    pub reports: tokio::sync::Semaphore,
    /// A key of this process's, for the CSRF tokens of certificate
    /// sign-ins (which have no session row to keep one in).
    pub csrf_key: ring::hmac::Key,
}

/// A running console.
pub struct Console {
    pub addr: SocketAddr,
    pub renewer: Arc<ops::tls::ServingCert>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Console {
    /// Whether a task of the console stopped (it should not).
    pub fn is_finished(&self) -> bool {
        self.tasks.iter().any(|t| t.is_finished())
    }

    pub fn stop(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("console: listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("console: {0}")]
    Tls(String),
}

/// Starts the console: the follower of the log on `reader` and the HTTPS
/// listener.
pub async fn start(
    config: ConsoleConfig,
    db: events::db::Database,
    reader: events::Reader,
    appender: events::Appender,
) -> Result<Console, ConsoleError> {
    let live = live::Live::new();
    let follower = ops::task::spawn(
        "console-follow",
        live::follow(reader, live.clone(), config.snapshots.clone()),
    );
    {
        let live = live.clone();
        ops::http::ready_when("console", move || match live.caught_up() {
            true => Ok(()),
            false => Err("the console is catching up with the log".into()),
        });
    }
    let cert =
        ops::tls::ServingCert::new(&config.cert_pem, &config.key_pem).map_err(ConsoleError::Tls)?;
    let root_subject = gateway::ca::root_subject(&config.client_ca_pem)
        .map_err(|e| ConsoleError::Tls(e.to_string()))?;
    let tls = server::tls_config(cert.clone(), &config.client_ca_pem).map_err(ConsoleError::Tls)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ConsoleError::Listen {
            addr: config.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| ConsoleError::Listen {
            addr: config.listen,
            source,
        })?;
    let rng = ring::rand::SystemRandom::new();
    let csrf_key = ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng)
        .map_err(|_| ConsoleError::Tls("no randomness for the CSRF key".into()))?;
    let shared = Arc::new(Shared {
        live,
        db: events::db::SharedClient::new(db),
        appender,
        revoked: gateway::revocation::Revoked::default(),
        root_subject,
        streams: Arc::new(tokio::sync::Semaphore::new(config.max_streams)),
        reports: tokio::sync::Semaphore::new(pages::usage::AT_ONCE),
        config,
        csrf_key,
    });
    metrics::register(
        shared.live.clone(),
        shared.streams.clone(),
        shared.config.max_streams,
    );
    let serving = ops::task::spawn("console-listen", server::serve(listener, tls, shared));
    Ok(Console {
        addr,
        renewer: cert,
        tasks: vec![follower, serving],
    })
}
