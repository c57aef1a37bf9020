//! pgwire's side: start-up and authentication, then simple and extended
//! queries, each recorded as an `audit.query_recorded` event before it runs.

use crate::accounts;
use crate::backend::{Backend, BackendError, Column, Limits, Outcome, TxChange};
use crate::split;
use crate::{AuditConfig, AuditError};
use async_trait::async_trait;
use events::db::Sql;
use events::{Appender, ExpectedVersion, NewEvent};
use futures_util::Sink;
use pgwire::api::auth::driver::AuthOutcome;
use pgwire::api::auth::mechanism::AuthMechanismFactory;
use pgwire::api::auth::sasl::scram::{ScramAuth, ScramSecret};
use pgwire::api::auth::{
    protocol_negotiation, save_startup_parameters_to_metadata, AuthDriver, AuthSource,
    DefaultServerParameterProvider, LoginInfo, Password, StartupHandler,
};
use pgwire::api::portal::{Format, Portal};
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{FieldFormat, FieldInfo, QueryResponse, Response, Tag};
use pgwire::api::stmt::QueryParser;
use pgwire::api::{ClientInfo, ClientPortalStore, PgWireServerHandlers, METADATA_USER};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::data::DataRow;
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio_postgres::types::{Kind, Type};

/// Longest statement text accepted (it is recorded whole).
pub const MAX_SQL_BYTES: usize = 256 << 10;

/// Counters of the endpoint, on `/metrics`.
#[derive(Debug, Default)]
pub struct Stats {
    pub sessions: AtomicU64,
    pub logins: AtomicU64,
    pub logins_refused: AtomicU64,
    pub statements: AtomicU64,
    pub statement_errors: AtomicU64,
    pub unrecorded: AtomicU64,
    pub cancels: AtomicU64,
    pub transactions_expired: AtomicU64,
    /// Statements that outlived their limit and a cancel: their sessions
    /// were ended.
    pub statements_ended: AtomicU64,
    /// Sessions the endpoint ended because they were idle too long.
    pub sessions_ended_idle: AtomicU64,
    /// Sessions the endpoint ended because their auditor or certificate was revoked.
    pub sessions_ended_revoked: AtomicU64,
    /// Password logins refused unchecked: too many failures of that auditor
    /// or from that address just before.
    pub logins_throttled: AtomicU64,
}

/// The endpoint's counters on `/metrics`.
static FIELDS: &[ops::metrics::Field<Stats>] = &[
    ops::stat_field!(
        Stats,
        "strata_audit_sessions",
        Gauge,
        "Auditor sessions open.",
        sessions
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_logins_total",
        Counter,
        "Auditors logged in.",
        logins
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_logins_refused_total",
        Counter,
        "Logins refused (password, certificate, revoked).",
        logins_refused
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_statements_total",
        Counter,
        "Auditor statements run (each recorded first).",
        statements
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_statement_errors_total",
        Counter,
        "Auditor statements PostgreSQL refused or failed.",
        statement_errors
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_cancels_total",
        Counter,
        "Cancel requests passed on to PostgreSQL.",
        cancels
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_statements_ended_total",
        Counter,
        "Auditor statements that outlived their limit and a cancel; their sessions were ended and their database connections closed.",
        statements_ended
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_sessions_ended_idle_total",
        Counter,
        "Auditor sessions ended by the endpoint because they were idle longer than --audit-idle-session-timeout.",
        sessions_ended_idle
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_sessions_ended_revoked_total",
        Counter,
        "Auditor sessions ended by the endpoint because the auditor or the certificate they logged in with was revoked.",
        sessions_ended_revoked
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_logins_throttled_total",
        Counter,
        "Password logins refused without checking the password: the auditor or the address failed too often just before.",
        logins_throttled
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_transactions_expired_total",
        Counter,
        "Auditor transactions ended at the endpoint's maximum age.",
        transactions_expired
    ),
    ops::stat_field!(
        Stats,
        "strata_audit_unrecorded_total",
        Counter,
        "Statements not run because recording them failed.",
        unrecorded
    ),
];

fn endpoints() -> &'static ops::metrics::Instances<Stats> {
    static E: std::sync::OnceLock<ops::metrics::Instances<Stats>> = std::sync::OnceLock::new();
    E.get_or_init(|| ops::metrics::Instances::new(FIELDS))
}

/// What every connection shares.
pub struct Shared {
    pub stats: Arc<Stats>,
    database: events::db::Database,
    accounts_db: Mutex<Option<tokio_postgres::Client>>,
    backend: events::db::Database,
    group: String,
    limits: Limits,
    max_transaction_age: Duration,
    max_result_bytes: usize,
    max_sessions: u64,
    /// Open connections: per-auditor caps, idle and revoked ones ended.
    pub(crate) conns: Arc<crate::sessions::Conns>,
    pub(crate) idle_session_timeout: Duration,
    temp_file_limit_kib: u64,
    throttle: crate::throttle::Throttle,
    appender: Appender,
    server_version: String,
    /// TLS is configured, so nothing is served without it.
    tls: bool,
    /// The raw subject of the root CA whose auditor certificates count: one
    /// the issuing intermediate signed names nobody.
    root_subject: Option<Vec<u8>>,
    cancels: Arc<Cancels>,
}

/// A client's cancel key, and the PostgreSQL process id and key it stands for.
type Cancel = (pgwire::messages::startup::SecretKey, (i32, i32));

/// The cancel key each session was given, and its PostgreSQL process's.
#[derive(Default)]
struct Cancels {
    by_pid: std::sync::Mutex<HashMap<i32, Cancel>>,
}

impl Shared {
    pub async fn new(
        config: &AuditConfig,
        appender: Appender,
        tls: bool,
    ) -> Result<Arc<Shared>, AuditError> {
        let stats = Arc::new(Stats::default());
        endpoints().add(&stats);
        let shared = Shared {
            stats,
            database: config.database.clone(),
            accounts_db: Mutex::new(None),
            backend: config.backend.clone(),
            group: config.role.clone(),
            limits: Limits {
                statement_timeout: config.statement_timeout,
                idle_in_transaction: config.idle_in_transaction,
                lock_timeout: config.statement_timeout,
                idle_session: config.idle_session_timeout + Duration::from_secs(60),
                work_mem_kib: config.work_mem_kib,
            },
            max_transaction_age: config.max_transaction_age,
            max_result_bytes: config.max_result_bytes,
            max_sessions: config.max_sessions.max(1),
            conns: Arc::new(crate::sessions::Conns::new(config.max_sessions_per_auditor)),
            idle_session_timeout: config.idle_session_timeout,
            temp_file_limit_kib: config.temp_file_limit_kib,
            throttle: Default::default(),
            appender,
            server_version: String::new(),
            tls,
            root_subject: config
                .tls
                .as_ref()
                .and_then(|t| t.client_ca_pem.as_deref())
                .and_then(|pem| {
                    let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).ok()?;
                    Some(p.parse_x509().ok()?.subject().as_raw().to_vec())
                }),
            cancels: Default::default(),
        };
        let server_version = {
            let guard = shared.accounts().await.map_err(|e| {
                AuditError::Setup(crate::setup::SetupError::Db {
                    role: config.role.clone(),
                    source: e,
                })
            })?;
            let db = guard.as_ref().expect("connected above");
            crate::setup::ensure_role(db, &config.role).await?;
            db.one("SHOW server_version", &[])
                .await
                .map(|r| r.get::<_, String>(0))
                .unwrap_or_default()
        };
        Ok(Arc::new(Shared {
            server_version,
            ..shared
        }))
    }

    /// A PostgreSQL session as `auditor`'s own role.
    async fn open_backend(&self, auditor: &str) -> Result<Backend, String> {
        let (role, password) = {
            let mut guard = self.accounts().await.map_err(|e| e.to_string())?;
            let db = guard.as_mut().ok_or("no accounts connection")?;
            crate::setup::login_role(db, &self.group, auditor, self.temp_file_limit_kib)
                .await
                .map_err(|e| e.to_string())?
        };
        let mut cfg = self.backend.clone();
        cfg.config.user(&role);
        cfg.config.password(password);
        Backend::connect(&cfg, &self.limits, self.max_result_bytes)
            .await
            .map_err(|e| e.to_string())
    }

    /// The connection for account lookups, made again after a failure.
    async fn accounts(
        &self,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<tokio_postgres::Client>>, tokio_postgres::Error>
    {
        let mut guard = self.accounts_db.lock().await;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            *guard = Some(events::db::connect(&self.database, "audit-accounts").await?);
        }
        Ok(guard)
    }

    pub(crate) async fn lookup(
        &self,
        name: &str,
    ) -> PgWireResult<Option<Option<accounts::Verifier>>> {
        if accounts::check_name(name).is_err() {
            return Ok(None);
        }
        let guard = self.accounts().await.map_err(api)?;
        let db = guard
            .as_ref()
            .ok_or_else(|| api("no accounts connection"))?;
        accounts::active(db, name).await.map_err(api)
    }

    /// Whether a client certificate was revoked (by its serial).
    pub(crate) async fn certificate_revoked(&self, serial: &str) -> PgWireResult<bool> {
        let guard = self.accounts().await.map_err(api)?;
        let db = guard
            .as_ref()
            .ok_or_else(|| api("no accounts connection"))?;
        accounts::certificate_revoked(db, serial).await.map_err(api)
    }
}

/// One authenticated auditor's connection.
pub struct Session {
    stats: Arc<Stats>,
    auditor: String,
    auth: &'static str,
    client: String,
    id: String,
    /// Whether this connection is TLS (as recorded with every statement).
    tls: bool,
    /// The connection as the endpoint's registry holds it.
    conn: Arc<crate::sessions::Conn>,
    backend: Arc<Mutex<Backend>>,
    /// The process id of the cancel key this session's client was given.
    cancel_pid: std::sync::atomic::AtomicI32,
    /// Its PostgreSQL process's id and cancel key.
    pg_key: Option<(i32, i32)>,
    cancels: Arc<Cancels>,
    /// Counts the auditor's transactions begun and ended, so a watchdog
    /// knows whether the one it was set for is still open.
    tx_seq: Arc<AtomicU64>,
    /// The endpoint ended the auditor's transaction at its maximum age; the
    /// next statement is told so.
    expired: Arc<AtomicBool>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stats.sessions.fetch_sub(1, Ordering::Relaxed);
        self.cancels
            .by_pid
            .lock()
            .expect("cancels lock")
            .remove(&self.cancel_pid.load(Ordering::Relaxed));
    }
}

fn api(e: impl ToString) -> PgWireError {
    PgWireError::ApiError(e.to_string().into())
}

fn user_error(severity: &str, code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        severity.into(),
        code.into(),
        message,
    )))
}

fn session<C: ClientInfo>(client: &C) -> PgWireResult<Arc<Session>> {
    client
        .session_extensions()
        .get::<Session>()
        .ok_or_else(|| api("the connection has no audit session"))
}

#[derive(Debug)]
struct AccountSource {
    shared: Arc<Shared>,
}

impl Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

#[async_trait]
impl AuthSource for AccountSource {
    async fn get_password(&self, login: &LoginInfo) -> PgWireResult<Password> {
        Err(PgWireError::InvalidPassword(
            login.user().unwrap_or_default().to_owned(),
        ))
    }

    async fn get_scram_secret(&self, login: &LoginInfo) -> PgWireResult<(ScramSecret, Option<()>)> {
        let user = login.user().unwrap_or_default();
        match self.shared.lookup(user).await? {
            Some(Some(v)) => Ok((v.secret(), None)),
            // Unknown, revoked or certificate-only: a verifier nothing matches,
            // so the answer looks like a wrong password.
            _ => Ok((random_verifier()?, None)),
        }
    }
}

fn random_verifier() -> PgWireResult<ScramSecret> {
    use ring::rand::SecureRandom;
    let rng = ring::rand::SystemRandom::new();
    let mut buf = [0u8; 80];
    rng.fill(&mut buf).map_err(|_| api("no randomness"))?;
    Ok(ScramSecret::Verifier {
        salt: buf[..16].to_vec(),
        iterations: accounts::ITERATIONS,
        stored_key: buf[16..48].to_vec(),
        server_key: buf[48..80].to_vec(),
    })
}

pub struct Startup {
    driver: AuthDriver<DefaultServerParameterProvider>,
    /// Swapped when the serving certificate is renewed: SCRAM-SHA-256-PLUS
    /// binds the exchange to the certificate served.
    scram: std::sync::RwLock<Arc<dyn AuthMechanismFactory>>,
    shared: Arc<Shared>,
}

impl Startup {
    /// A SCRAM exchange for one connection, bound to the certificate served now.
    fn scram_mechanism(&self) -> Box<dyn pgwire::api::auth::mechanism::AuthMechanism> {
        self.scram.read().expect("scram lock").create()
    }

    /// Connects the auditor's session as the audit role.
    async fn open<C: ClientInfo>(
        &self,
        client: &mut C,
        user: &str,
        auth: &'static str,
        serial: Option<String>,
    ) -> PgWireResult<()> {
        let stats = &self.shared.stats;
        let full = |message: String| {
            stats.sessions.fetch_sub(1, Ordering::Relaxed);
            stats.logins_refused.fetch_add(1, Ordering::Relaxed);
            Err(user_error("FATAL", "53300", message))
        };
        // Take a place first (atomically), give it back if the session fails.
        if stats.sessions.fetch_add(1, Ordering::Relaxed) >= self.shared.max_sessions {
            return full(format!(
                "the audit endpoint holds its limit of {} sessions (--audit-max-sessions); try again later",
                self.shared.max_sessions
            ));
        }
        // The auditor's own place: given back when the connection ends.
        let claim = crate::sessions::Claim {
            auditor: user.to_string(),
            serial,
        };
        let conn = match self.shared.conns.claim(client.socket_addr(), claim) {
            Ok(conn) => conn,
            Err(crate::sessions::AtCap(cap)) => {
                return full(format!(
                    "auditor {user:?} holds its limit of {cap} sessions at this endpoint (--audit-max-sessions-per-auditor); close one first"
                ))
            }
        };
        let backend = match self.shared.open_backend(user).await {
            Ok(b) => b,
            Err(e) => {
                stats.sessions.fetch_sub(1, Ordering::Relaxed);
                return Err(user_error(
                    "FATAL",
                    "08006",
                    format!("the audit endpoint cannot reach the database: {e}"),
                ));
            }
        };
        let id = domain::new_id("as");
        stats.logins.fetch_add(1, Ordering::Relaxed);
        let pg_key = backend.key();
        // From here the session's Drop gives the place back.
        client.session_extensions().insert(Session {
            stats: stats.clone(),
            auditor: user.to_string(),
            auth,
            client: client.socket_addr().to_string(),
            id,
            tls: client.is_secure(),
            conn,
            backend: Arc::new(Mutex::new(backend)),
            cancel_pid: std::sync::atomic::AtomicI32::new(0),
            pg_key,
            cancels: self.shared.cancels.clone(),
            tx_seq: Arc::new(AtomicU64::new(0)),
            expired: Arc::new(AtomicBool::new(false)),
        });
        tracing::info!(auditor = user, auth, client = %client.socket_addr(), "auditor connected");
        Ok(())
    }
}

/// The auditor a client certificate names (`urn:strata:auditor:<name>`
/// among its subject alternative names), if any, with the certificate's
/// serial (lowercase hex without leading zero bytes, as the CA stores it).
/// Only a certificate the root issued itself names anyone.
fn auditor_identity(der: &[u8], root_subject: Option<&[u8]>) -> Option<(String, String)> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    if root_subject.is_some_and(|r| cert.issuer().as_raw() != r) {
        return None;
    }
    let san = cert.subject_alternative_name().ok()??;
    let name = san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) => {
            u.strip_prefix(AUDITOR_URI_PREFIX).map(str::to_string)
        }
        _ => None,
    })?;
    let raw = cert.raw_serial();
    let start = raw
        .iter()
        .position(|b| *b != 0)
        .unwrap_or(raw.len().saturating_sub(1));
    let serial = events::hex(&raw[start..]);
    Some((name, serial))
}

/// As the region CA writes it (`strata ca issue-auditor`).
const AUDITOR_URI_PREFIX: &str = "urn:strata:auditor:";

#[async_trait]
impl StartupHandler for Startup {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        match message {
            PgWireFrontendMessage::Startup(ref startup) => {
                if self.shared.tls && !client.is_secure() {
                    self.shared
                        .stats
                        .logins_refused
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(user_error(
                        "FATAL",
                        "28000",
                        "this audit endpoint accepts TLS connections only (sslmode=require or verify-full)".into(),
                    ));
                }
                protocol_negotiation(client, startup).await?;
                save_startup_parameters_to_metadata(client, startup);
                let user = client
                    .metadata()
                    .get(METADATA_USER)
                    .cloned()
                    .ok_or(PgWireError::UserNameRequired)?;
                let cert = client
                    .client_certificates()
                    .and_then(|c| c.first().map(|c| c.as_ref().to_vec()));
                if let Some(der) = cert {
                    let refused = || {
                        self.shared
                            .stats
                            .logins_refused
                            .fetch_add(1, Ordering::Relaxed);
                    };
                    // The TLS layer already checked that it chains to the CA.
                    match auditor_identity(&der, self.shared.root_subject.as_deref()) {
                        Some((named, serial)) if named == user => {
                            if self.shared.lookup(&user).await?.is_none() {
                                refused();
                                return Err(user_error(
                                    "FATAL",
                                    "28000",
                                    format!("auditor {user:?} is not registered or was revoked"),
                                ));
                            }
                            if self.shared.certificate_revoked(&serial).await? {
                                refused();
                                return Err(user_error(
                                    "FATAL",
                                    "28000",
                                    format!("this certificate of auditor {user:?} (serial {serial}) is revoked"),
                                ));
                            }
                            self.open(client, &user, "certificate", Some(serial))
                                .await?;
                            self.driver.complete_authentication(client, None).await?;
                            register_cancel(&self.shared, client)?;
                        }
                        Some((named, _)) => {
                            refused();
                            return Err(user_error(
                                "FATAL",
                                "28000",
                                format!(
                                    "the client certificate names auditor {named:?}, not {user:?}"
                                ),
                            ));
                        }
                        None => {
                            refused();
                            return Err(user_error(
                                "FATAL",
                                "28000",
                                "the client certificate is not an auditor's (auditor certificates are issued by the region's root CA: `strata ca issue-auditor`)".into(),
                            ));
                        }
                    }
                } else {
                    let source = client.socket_addr().ip();
                    let now = std::time::Instant::now();
                    if let Some(wait) = self.shared.throttle.locked(&user, source, now) {
                        self.shared
                            .stats
                            .logins_throttled
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(auditor = %user, client = %client.socket_addr(), "auditor login refused unchecked: too many failed logins just before");
                        return Err(user_error(
                            "FATAL",
                            "28000",
                            format!(
                                "too many failed logins for auditor {user:?} or from this address; try again in {:.1}s",
                                wait.as_secs_f64().max(0.1)
                            ),
                        ));
                    }
                    self.driver
                        .begin_authentication(client, self.scram_mechanism())
                        .await?;
                }
            }
            PgWireFrontendMessage::PasswordMessageFamily(message) => {
                let user = client
                    .metadata()
                    .get(METADATA_USER)
                    .cloned()
                    .ok_or(PgWireError::UserNameRequired)?;
                let outcome = match self.driver.advance_authentication(client, message).await {
                    Err(PgWireError::InvalidPassword(_)) => {
                        self.shared
                            .stats
                            .logins_refused
                            .fetch_add(1, Ordering::Relaxed);
                        self.shared.throttle.failed(
                            &user,
                            client.socket_addr().ip(),
                            std::time::Instant::now(),
                        );
                        tracing::info!(auditor = %user, client = %client.socket_addr(), "auditor refused: password authentication failed");
                        // Unknown, revoked and wrong password look the same.
                        return Err(user_error(
                            "FATAL",
                            "28P01",
                            format!("password authentication failed for auditor {user:?}"),
                        ));
                    }
                    other => other?,
                };
                if let AuthOutcome::Authenticated { final_message, .. } = outcome {
                    self.shared
                        .throttle
                        .succeeded(&user, client.socket_addr().ip());
                    self.open(client, &user, "scram", None).await?;
                    self.driver
                        .complete_authentication(client, final_message)
                        .await?;
                    register_cancel(&self.shared, client)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// A statement as Postgres described it at Parse.
#[derive(Debug, Clone)]
pub struct Statement {
    sql: String,
    params: Vec<u32>,
    columns: Vec<Column>,
}

pub struct Parser;

#[async_trait]
impl QueryParser for Parser {
    type Statement = Statement;

    async fn parse_sql<C>(
        &self,
        client: &C,
        sql: &str,
        types: &[Option<Type>],
    ) -> PgWireResult<Option<Statement>>
    where
        C: ClientInfo + Unpin + Send + Sync,
    {
        if sql.len() > MAX_SQL_BYTES {
            return Err(too_long(sql.len()));
        }
        let session = session(client)?;
        let oids: Vec<u32> = types
            .iter()
            .map(|t| t.as_ref().map(|t| t.oid()).unwrap_or(0))
            .collect();
        let described = session
            .backend
            .lock()
            .await
            .describe(sql, &oids)
            .await
            .map_err(|e| broken(&e))?;
        match described {
            Ok(d) => Ok(Some(Statement {
                sql: sql.to_string(),
                params: d.params,
                columns: d.columns,
            })),
            Err(e) => Err(PgWireError::UserError(e)),
        }
    }

    fn get_parameter_types(&self, stmt: &Statement) -> PgWireResult<Vec<Type>> {
        Ok(stmt.params.iter().map(|o| type_of(*o)).collect())
    }

    fn get_result_schema(
        &self,
        stmt: &Statement,
        format: Option<&Format>,
    ) -> PgWireResult<Vec<FieldInfo>> {
        Ok(fields(&stmt.columns, format))
    }
}

fn too_long(n: usize) -> PgWireError {
    user_error(
        "ERROR",
        "54000",
        format!(
            "statement of {n} bytes is longer than the audit endpoint's limit of {} KiB",
            MAX_SQL_BYTES >> 10
        ),
    )
}

fn broken(e: &BackendError) -> PgWireError {
    user_error(
        "FATAL",
        "08006",
        format!("the audit session lost its database connection: {e}"),
    )
}

fn type_of(oid: u32) -> Type {
    Type::from_oid(oid)
        .unwrap_or_else(|| Type::new(format!("oid_{oid}"), oid, Kind::Simple, "pg_catalog".into()))
}

fn format_at(f: &Format, i: usize) -> FieldFormat {
    match f {
        Format::UnifiedText => FieldFormat::Text,
        Format::UnifiedBinary => FieldFormat::Binary,
        Format::Individual(v) => match v.len() {
            1 => FieldFormat::from(v[0]),
            _ => v
                .get(i)
                .map(|c| FieldFormat::from(*c))
                .unwrap_or(FieldFormat::Text),
        },
    }
}

fn codes(f: &Format) -> Vec<i16> {
    match f {
        Format::UnifiedText => vec![],
        Format::UnifiedBinary => vec![1],
        Format::Individual(v) => v.clone(),
    }
}

fn fields(columns: &[Column], format: Option<&Format>) -> Vec<FieldInfo> {
    columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            FieldInfo::new(
                c.name.clone(),
                (c.table_oid != 0).then_some(c.table_oid as i32),
                (c.column_id != 0).then_some(c.column_id),
                type_of(c.type_oid),
                format.map(|f| format_at(f, i)).unwrap_or(FieldFormat::Text),
            )
            .with_type_size(c.type_size)
            .with_type_modifier(c.type_modifier)
        })
        .collect()
}

fn response(stats: &Stats, outcome: Outcome, change: TxChange, format: &Format) -> Response {
    if matches!(outcome, Outcome::Error(_)) {
        stats.statement_errors.fetch_add(1, Ordering::Relaxed);
    }
    match outcome {
        Outcome::Rows { columns, rows, tag } => {
            let schema = Arc::new(fields(&columns, Some(format)));
            let n = columns.len() as i16;
            let rows = rows.into_iter().map(move |data| Ok(DataRow::new(data, n)));
            let mut q = QueryResponse::new(schema, futures_util::stream::iter(rows));
            // pgwire appends the row count it sent.
            let word = tag.split(' ').next().unwrap_or("SELECT").to_string();
            q.set_command_tag(&word);
            Response::Query(q)
        }
        Outcome::Command { tag } => match change {
            TxChange::Started => Response::TransactionStart(Tag::new(&tag)),
            TxChange::Ended => Response::TransactionEnd(Tag::new(&tag)),
            TxChange::None => Response::Execution(Tag::new(&tag)),
        },
        Outcome::Empty => Response::EmptyQuery,
        Outcome::Error(e) => Response::Error(e),
    }
}

/// How long past the statement timeout a statement may run before it is
/// cancelled again, and after that before its session is ended.
const OVERRUN: Duration = Duration::from_secs(2);

pub struct Queries {
    shared: Arc<Shared>,
    parser: Arc<Parser>,
}

impl Queries {
    /// Runs one recorded statement on the session's PostgreSQL connection,
    /// passes its notices on, and watches the auditor's transaction's age.
    #[allow(clippy::too_many_arguments)]
    #[tracing::instrument(name = "audit.statement", level = "info", skip_all, fields(auditor = %s.auditor, session = %s.id))]
    async fn run<C>(
        &self,
        client: &mut C,
        s: &Session,
        sql: &str,
        param_types: &[u32],
        params: &[Option<bytes::Bytes>],
        param_formats: &[i16],
        result_formats: &[i16],
    ) -> PgWireResult<(Outcome, TxChange)>
    where
        C: Sink<PgWireBackendMessage> + Unpin + Send,
        PgWireError: From<C::Error>,
    {
        use futures_util::SinkExt;
        if s.expired.swap(false, Ordering::SeqCst) {
            return Ok((
                Outcome::Error(Box::new(ErrorInfo::new(
                    "ERROR".into(),
                    "25P03".into(),
                    format!(
                        "the transaction was open longer than the audit endpoint's limit of {} and was rolled back; ROLLBACK, then BEGIN again",
                        humantime::format_duration(self.shared.max_transaction_age)
                    ),
                ))),
                TxChange::None,
            ));
        }
        let _busy = self.shared.conns.busy(&s.conn);
        let mut backend = s.backend.lock().await;
        let (outcome, change) = {
            // PostgreSQL cancels a statement at the statement timeout; one
            // that outlives it and a cancel after it (a DO block catching
            // every cancel) ends with its session: the endpoint closes the
            // connection and the process ends within a second.
            let limit = self.shared.limits.statement_timeout + OVERRUN;
            let mut running =
                Box::pin(backend.execute(sql, param_types, params, param_formats, result_formats));
            let done = match tokio::time::timeout(limit, &mut running).await {
                Ok(done) => Some(done),
                Err(_) => {
                    if let Some((pid, key)) = s.pg_key {
                        let _ = events::replication::cancel(&self.shared.backend.config, pid, key)
                            .await;
                    }
                    tokio::time::timeout(OVERRUN, &mut running).await.ok()
                }
            };
            drop(running);
            match done {
                Some(done) => done.map_err(|e| broken(&e))?,
                None => {
                    backend.close().await;
                    self.shared
                        .stats
                        .statements_ended
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(auditor = %s.auditor, session = %s.id, "an auditor's statement ran past its limit and did not stop when cancelled; its session is ended");
                    return Err(user_error(
                        "FATAL",
                        "57014",
                        format!(
                            "the statement ran past the audit endpoint's limit of {} and did not stop when cancelled; the session is ended",
                            humantime::format_duration(self.shared.limits.statement_timeout)
                        ),
                    ));
                }
            }
        };
        let notices = backend.take_notices();
        drop(backend);
        for n in notices {
            client
                .send(PgWireBackendMessage::NoticeResponse(n.into()))
                .await?;
        }
        match change {
            TxChange::Started => {
                let seq = s.tx_seq.fetch_add(1, Ordering::SeqCst) + 1;
                self.watch(s, seq);
            }
            TxChange::Ended => {
                s.tx_seq.fetch_add(1, Ordering::SeqCst);
            }
            TxChange::None => {}
        }
        Ok((outcome, change))
    }

    /// Ends the auditor's transaction `seq` once it is as old as the
    /// endpoint allows: a statement still running is cancelled, then the
    /// transaction rolled back; the auditor's next statement is told why.
    fn watch(&self, s: &Session, seq: u64) {
        let backend = Arc::downgrade(&s.backend);
        let (tx_seq, expired) = (s.tx_seq.clone(), s.expired.clone());
        let shared_stats = self.shared.stats.clone();
        let cancel_at = self.shared.backend.config.clone();
        let age = self.shared.max_transaction_age;
        let auditor = s.auditor.clone();
        let pg_key = s.pg_key;
        tokio::spawn(async move {
            tokio::time::sleep(age).await;
            if tx_seq.load(Ordering::SeqCst) != seq {
                return;
            }
            let Some(backend) = backend.upgrade() else {
                return;
            };
            expired.store(true, Ordering::SeqCst);
            let mut b = match backend.try_lock() {
                Ok(b) => b,
                Err(_) => {
                    if let Some((pid, key)) = pg_key {
                        let _ = events::replication::cancel(&cancel_at, pid, key).await;
                    }
                    backend.lock().await
                }
            };
            if tx_seq.load(Ordering::SeqCst) != seq {
                expired.store(false, Ordering::SeqCst);
                return;
            }
            tx_seq.fetch_add(1, Ordering::SeqCst);
            shared_stats
                .transactions_expired
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(%auditor, age = %humantime::format_duration(age), "an auditor's transaction reached the maximum age and was rolled back");
            if let Err(e) = b.abandon().await {
                tracing::warn!(%auditor, error = %e, "could not roll back an expired auditor transaction");
            }
        });
    }

    /// Records the statement; it runs only if that succeeded.
    async fn record(
        &self,
        s: &Session,
        protocol: &str,
        sql: &str,
        parameters: serde_json::Value,
    ) -> Result<(), Box<ErrorInfo>> {
        let payload = serde_json::json!({
            "auditor": s.auditor,
            "auth": s.auth,
            "client": s.client,
            "session": s.id,
            "protocol": protocol,
            "tls": s.tls,
            "sql": sql,
            "parameters": parameters,
        });
        let stream = format!("auditor/{}", s.auditor);
        match self
            .shared
            .appender
            .append(
                &stream,
                ExpectedVersion::Any,
                vec![NewEvent::new(
                    crate::catalog::AUDIT_QUERY_RECORDED,
                    &payload,
                )],
            )
            .await
        {
            Ok(_) => {
                self.shared.stats.statements.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.shared.stats.unrecorded.fetch_add(1, Ordering::Relaxed);
                Err(Box::new(ErrorInfo::new(
                    "ERROR".into(),
                    "58000".into(),
                    format!(
                        "the query was not run: it could not be recorded in the audit log ({e})"
                    ),
                )))
            }
        }
    }
}

/// Parameters as recorded: text as text, binary as hex, each cut at 1 KiB.
fn describe_parameters(params: &[Option<bytes::Bytes>], formats: &Format) -> serde_json::Value {
    const CAP: usize = 1024;
    params
        .iter()
        .enumerate()
        .map(|(i, p)| match p {
            None => serde_json::Value::Null,
            Some(b) => {
                let b = &b[..b.len().min(CAP)];
                match format_at(formats, i) {
                    FieldFormat::Text => String::from_utf8_lossy(b).into_owned().into(),
                    FieldFormat::Binary => format!("\\x{}", events::hex(b)).into(),
                }
            }
        })
        .collect::<Vec<_>>()
        .into()
}

#[async_trait]
impl SimpleQueryHandler for Queries {
    async fn do_query<C>(&self, client: &mut C, query: &str) -> PgWireResult<Vec<Response>>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        if query.len() > MAX_SQL_BYTES {
            return Err(too_long(query.len()));
        }
        let s = session(client)?;
        let mut out = Vec::new();
        for stmt in split::statements(query) {
            if let Err(e) = self.record(&s, "simple", stmt, serde_json::json!([])).await {
                out.push(Response::Error(e));
                break;
            }
            let (outcome, change) = self.run(client, &s, stmt, &[], &[], &[], &[]).await?;
            let failed = matches!(outcome, Outcome::Error(_));
            out.push(response(
                &self.shared.stats,
                outcome,
                change,
                &Format::UnifiedText,
            ));
            if failed {
                break;
            }
        }
        if out.is_empty() {
            out.push(Response::EmptyQuery);
        }
        Ok(out)
    }
}

#[async_trait]
impl ExtendedQueryHandler for Queries {
    type Statement = Statement;
    type QueryParser = Parser;

    fn query_parser(&self) -> Arc<Parser> {
        self.parser.clone()
    }

    async fn do_query<C>(
        &self,
        client: &mut C,
        portal: &Portal<Statement>,
        _max_rows: usize,
    ) -> PgWireResult<Response>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: pgwire::api::store::PortalStore<Statement = Statement>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let s = session(client)?;
        let stmt = &portal.statement.statement;
        let params = describe_parameters(&portal.parameters, &portal.parameter_format);
        if let Err(e) = self.record(&s, "extended", &stmt.sql, params).await {
            return Ok(Response::Error(e));
        }
        let (outcome, change) = self
            .run(
                client,
                &s,
                &stmt.sql,
                &stmt.params,
                &portal.parameters,
                &codes(&portal.parameter_format),
                &codes(&portal.result_column_format),
            )
            .await?;
        Ok(response(
            &self.shared.stats,
            outcome,
            change,
            &portal.result_column_format,
        ))
    }
}

pub struct Handlers {
    startup: Arc<Startup>,
    queries: Arc<Queries>,
    cancel: Arc<CancelPass>,
}

/// SCRAM-SHA-256 against the accounts; with a serving certificate, also
/// SCRAM-SHA-256-PLUS, the exchange bound to that certificate's TLS channel.
fn scram_for(
    shared: &Arc<Shared>,
    cert_pem: Option<&str>,
) -> Result<Arc<dyn AuthMechanismFactory>, AuditError> {
    let mut scram = ScramAuth::new(Arc::new(AccountSource {
        shared: shared.clone(),
    }));
    scram.set_iterations(accounts::ITERATIONS);
    if let Some(pem) = cert_pem {
        scram
            .configure_certificate(pem.as_bytes())
            .map_err(|e| AuditError::Tls(e.to_string()))?;
    }
    Ok(Arc::new(scram))
}

impl Handlers {
    /// Binds SCRAM-SHA-256-PLUS to a renewed serving certificate.
    pub(crate) fn renewed(&self, cert_pem: &str) -> Result<(), AuditError> {
        let scram = scram_for(&self.startup.shared, Some(cert_pem))?;
        *self.startup.scram.write().expect("scram lock") = scram;
        Ok(())
    }

    pub fn new(shared: Arc<Shared>, config: &AuditConfig) -> Result<Handlers, AuditError> {
        let mut params = DefaultServerParameterProvider::default();
        if !shared.server_version.is_empty() {
            params.server_version = shared.server_version.clone();
        }
        params.is_superuser = false;
        params.default_transaction_read_only = true;
        params.search_path = "audit, strata, pg_catalog".into();
        params.time_zone = "UTC".into();
        params.date_style = "ISO, MDY".into();
        params.scram_iterations = accounts::ITERATIONS;
        let scram = scram_for(&shared, config.tls.as_ref().map(|t| t.cert_pem.as_str()))?;
        Ok(Handlers {
            startup: Arc::new(Startup {
                driver: AuthDriver::new(params),
                scram: std::sync::RwLock::new(scram),
                shared: shared.clone(),
            }),
            queries: Arc::new(Queries {
                shared: shared.clone(),
                parser: Arc::new(Parser),
            }),
            cancel: Arc::new(CancelPass { shared }),
        })
    }
}

/// Notes the cancel key the client was just given (at the end of
/// authentication), so a cancel request bearing it reaches the session's
/// PostgreSQL process.
fn register_cancel<C: ClientInfo>(shared: &Shared, client: &C) -> PgWireResult<()> {
    let s = session(client)?;
    let (pid, secret) = client.pid_and_secret_key();
    if let Some(key) = s.pg_key {
        s.cancel_pid.store(pid, Ordering::Relaxed);
        shared
            .cancels
            .by_pid
            .lock()
            .expect("cancels lock")
            .insert(pid, (secret, key));
    }
    Ok(())
}

/// Passes a cancel request bearing a session's key on to its PostgreSQL
/// process; any other is ignored, as Postgres ignores a wrong key.
pub struct CancelPass {
    shared: Arc<Shared>,
}

#[async_trait]
impl pgwire::api::cancel::CancelHandler for CancelPass {
    async fn on_cancel_request(&self, req: pgwire::messages::cancel::CancelRequest) {
        let target = self
            .shared
            .cancels
            .by_pid
            .lock()
            .expect("cancels lock")
            .get(&req.pid)
            .filter(|(secret, _)| req.secret_key.eq_value(secret))
            .map(|(_, key)| *key);
        if let Some((pid, key)) = target {
            self.shared.stats.cancels.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = events::replication::cancel(&self.shared.backend.config, pid, key).await
            {
                tracing::warn!(error = %e, "could not pass a cancel request on to PostgreSQL");
            }
        }
    }
}

impl PgWireServerHandlers for Handlers {
    fn cancel_handler(&self) -> Arc<impl pgwire::api::cancel::CancelHandler> {
        self.cancel.clone()
    }

    fn simple_query_handler(&self) -> Arc<impl SimpleQueryHandler> {
        self.queries.clone()
    }

    fn extended_query_handler(&self) -> Arc<impl ExtendedQueryHandler> {
        self.queries.clone()
    }

    fn startup_handler(&self) -> Arc<impl StartupHandler> {
        self.startup.clone()
    }
}
