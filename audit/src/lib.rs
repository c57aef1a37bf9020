//! Strata's audit endpoint (the `audit` role): auditors query the event partitions, the seals and the
//! `audit` views with psql or any Postgres client, read-only, and every query
//! they run is recorded in the log first.
//!
//! ```text
//!  auditor --pgwire (TLS: SCRAM-SHA-256 or client certificate)--> endpoint
//!     endpoint --append audit.query_recorded on auditor/<name>--> log   (before it runs)
//!     endpoint --extended protocol, as the audit role, in a READ ONLY txn--> Postgres
//! ```
//!
//! What keeps auditors from writing is Postgres itself, not the endpoint
//! reading their SQL: each auditor's role is a member of the audit group role
//! (see [`setup`]), which holds SELECT on the audit set and nothing else; no
//! audit role may create temporary tables or execute the large-object or
//! advisory-lock functions; and every statement runs in a `READ ONLY`
//! transaction whose snapshot is already taken (see [`backend`]), one
//! statement at a time. On top of that the endpoint ends every auditor
//! transaction with a rollback, refuses `AND CHAIN` and changes to its limits
//! ([`control`]), and ends a transaction older than its maximum age. Each
//! auditor has a PostgreSQL role of their own, so no auditor can see, cancel
//! or terminate another's session. Where TLS is configured, nothing is
//! served without it.

pub mod accounts;
mod backend;
pub mod catalog;
pub mod control;
mod handler;
mod sessions;
pub mod setup;
pub mod split;
mod sweep;
mod throttle;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_rustls::rustls;

/// How the endpoint runs.
#[derive(Clone)]
pub struct AuditConfig {
    /// Strata's own database connection (accounts; the appender writes through its own).
    pub database: events::db::Database,
    /// Where auditors' statements run: host, port, database and TLS of the
    /// connection. Each auditor logs in as a role of their own (made at
    /// their first login by [`setup::login_role`], with a password only
    /// Strata's database user can read), so user and password here are
    /// replaced.
    pub backend: events::db::Database,
    /// The read-only group role every auditor's role is a member of (created
    /// and granted by [`setup::ensure_role`]).
    pub role: String,
    /// Statements running longer are cancelled by Postgres.
    pub statement_timeout: Duration,
    /// An auditor's transaction left idle this long is ended by Postgres
    /// (and the session with it).
    pub idle_in_transaction: Duration,
    /// An auditor's transaction open this long is ended by the endpoint,
    /// whatever the auditor does: no reader holds its locks and snapshot
    /// (and so partition creation and vacuum) for longer.
    pub max_transaction_age: Duration,
    /// Largest result returned; a bigger one is refused with advice.
    pub max_result_bytes: usize,
    /// Most auditor sessions at once (each holds a PostgreSQL connection).
    pub max_sessions: u64,
    /// Most sessions of one auditor at once, so that one cannot hold them all.
    pub max_sessions_per_auditor: u64,
    /// A session without a statement this long is closed (its PostgreSQL
    /// connection with it).
    pub idle_session_timeout: Duration,
    /// Memory per sort or hash of an auditor's statement, in KiB, fixed
    /// by the endpoint.
    pub work_mem_kib: u64,
    /// Temporary files one auditor's session may write, in KiB (set on each
    /// auditor's role, which cannot change it).
    pub temp_file_limit_kib: u64,
    /// TLS: the serving certificate chain, its key, and the CA whose auditor
    /// certificates are accepted in place of a password.
    pub tls: Option<TlsFiles>,
}

#[derive(Clone)]
pub struct TlsFiles {
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: Option<String>,
}

impl AuditConfig {
    /// Defaults, with auditors' roles reached at the same server as `database`.
    pub fn new(database: impl Into<events::db::Database>) -> AuditConfig {
        let database = database.into();
        let role = setup::DEFAULT_ROLE.to_string();
        AuditConfig {
            backend: database.clone(),
            database,
            role,
            statement_timeout: Duration::from_secs(60),
            idle_in_transaction: Duration::from_secs(60),
            max_transaction_age: Duration::from_secs(600),
            max_result_bytes: 256 << 20,
            max_sessions: 32,
            max_sessions_per_auditor: 4,
            idle_session_timeout: Duration::from_secs(15 * 60),
            work_mem_kib: 16 << 10,
            temp_file_limit_kib: 1 << 20,
            tls: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(String),
    #[error(transparent)]
    Setup(#[from] setup::SetupError),
    #[error("connect as the audit role: {0}")]
    Backend(#[from] backend::BackendError),
}

/// A running endpoint.
pub struct Endpoint {
    pub addr: SocketAddr,
    /// The counters also rendered on `/metrics`.
    pub stats: Arc<handler::Stats>,
    renewer: Option<Renewer>,
    task: tokio::task::JoinHandle<()>,
    sweeper: tokio::task::JoinHandle<()>,
}

/// Serves a renewed certificate from the next TLS handshake on.
#[derive(Clone)]
pub struct Renewer {
    serving: Arc<ops::tls::ServingCert>,
    handlers: Arc<handler::Handlers>,
}

impl Renewer {
    pub fn renew(&self, cert_pem: &str, key_pem: &str) -> Result<(), AuditError> {
        self.serving
            .replace(cert_pem, key_pem)
            .map_err(AuditError::Tls)?;
        self.handlers.renewed(cert_pem)
    }
}

impl Endpoint {
    /// What renews the serving certificate (none without TLS).
    pub fn renewer(&self) -> Option<Renewer> {
        self.renewer.clone()
    }

    pub fn stop(self) {
        self.task.abort();
        self.sweeper.abort();
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished() || self.sweeper.is_finished()
    }
}

/// Checks the audit role, then serves auditors on `listen` until stopped.
pub async fn start(
    listen: SocketAddr,
    config: AuditConfig,
    appender: events::Appender,
) -> Result<Endpoint, AuditError> {
    let tls = config.tls.as_ref().map(tls_acceptor).transpose()?;
    let (acceptor, serving) = match tls {
        Some((a, s)) => (Some(a), Some(s)),
        None => (None, None),
    };
    let shared = handler::Shared::new(&config, appender, acceptor.is_some()).await?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| AuditError::Listen {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| AuditError::Listen {
        addr: listen,
        source,
    })?;
    let stats = shared.stats.clone();
    let conns = shared.conns.clone();
    let sweeper = tokio::spawn(sweep::run(shared.clone()));
    let handlers = Arc::new(handler::Handlers::new(shared, &config)?);
    let renewer = serving.map(|serving| Renewer {
        serving,
        handlers: handlers.clone(),
    });
    let task = tokio::spawn(async move {
        loop {
            let (socket, peer) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "audit endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let handlers = handlers.clone();
            let acceptor = acceptor.clone();
            let conns = conns.clone();
            let conn = conns.register(peer);
            tokio::spawn(async move {
                tokio::select! {
                    r = pgwire::tokio::process_socket(socket, acceptor, handlers) => {
                        if let Err(e) = r {
                            tracing::debug!(%peer, error = %e, "audit connection ended with an error");
                        }
                    }
                    // Dropping the connection's task closes the client's
                    // socket and the auditor's PostgreSQL connection.
                    why = conn.ended() => {
                        let auditor = conn.claim().map(|c| c.auditor.as_str()).unwrap_or("");
                        tracing::info!(%peer, %auditor, reason = why.as_str(), "the audit endpoint ended an auditor's session");
                    }
                }
                conns.remove(peer);
            });
        }
    });
    Ok(Endpoint {
        addr,
        stats,
        renewer,
        task,
        sweeper,
    })
}

fn tls_acceptor(
    files: &TlsFiles,
) -> Result<(pgwire::tokio::TlsAcceptor, Arc<ops::tls::ServingCert>), AuditError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let serving =
        ops::tls::ServingCert::new(&files.cert_pem, &files.key_pem).map_err(AuditError::Tls)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| AuditError::Tls(e.to_string()))?;
    let builder = match &files.client_ca_pem {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
                let c = c.map_err(|e| AuditError::Tls(format!("client CA: {e}")))?;
                roots
                    .add(c)
                    .map_err(|e| AuditError::Tls(format!("client CA: {e}")))?;
            }
            // A certificate is optional (auditors may use a password), but one
            // that is presented must chain to the CA.
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| AuditError::Tls(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder.with_cert_resolver(serving.clone());
    Ok((pgwire::tokio::TlsAcceptor::from(Arc::new(config)), serving))
}
