//! Where the database is ([`Database`]: libpq's connection string, TLS
//! included), connecting to it, and a shared, self-healing SQL connection:
//! handed out as `Arc<Client>`, made again on the next call after it closes.

use crate::pgtls::{SslMode, Tls, TlsSettings};
pub use schema::sql::{Param, Sql};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio_postgres::{Client, Config};

/// A database to connect to: what tokio-postgres reads of a libpq
/// connection string (a `postgres://` URL or `key=value` pairs), and the TLS
/// settings it does not read itself (`sslmode=verify-ca|verify-full`,
/// `sslrootcert`, `sslcert`, `sslkey`).
///
/// A database reached through a connection pooler in transaction mode
/// (PgBouncer) carries the way to PostgreSQL itself ([`Database::direct`]):
/// what needs a session of its own (the replication stream, the migration
/// lock, sealing's lock, the audit endpoint's logins) connects there, and
/// connections through the pooler keep no prepared statement and no session
/// setting past a transaction.
#[derive(Clone, Debug)]
pub struct Database {
    pub config: Config,
    pub tls: Tls,
    direct: Option<Arc<Database>>,
    statement_timeout: Option<Duration>,
}

impl Database {
    /// Parses a connection string; a TLS file that cannot be read is an
    /// error here.
    pub fn parse(s: &str) -> Result<Database, String> {
        let (rest, settings) = split_tls(s)?;
        let mut config: Config = rest
            .parse()
            .map_err(|e| format!("{e} (expected e.g. postgres://user@host:5432/dbname)"))?;
        config.ssl_mode(settings.mode.for_tokio_postgres());
        bounded(&mut config);
        Ok(Database {
            config,
            tls: Tls::new(settings)?,
            direct: None,
            statement_timeout: Some(DEFAULT_STATEMENT_TIMEOUT),
        })
    }

    /// This database as reached through a transaction-mode pooler, and
    /// `direct`, PostgreSQL itself, for what needs a session of its own.
    pub fn through_pooler(mut self, direct: Database) -> Database {
        self.direct = Some(Arc::new(direct.direct().clone()));
        self
    }

    /// Whether connections go through a transaction-mode pooler: no named
    /// statement or session setting may outlive a transaction.
    pub fn pooled(&self) -> bool {
        self.direct.is_some()
    }

    /// PostgreSQL itself: this database unless it goes through a pooler.
    pub fn direct(&self) -> &Database {
        self.direct.as_deref().unwrap_or(self)
    }

    /// How long one statement may run on this database's connections
    /// (`None`: as long as it takes), for this database and the direct one.
    /// Work meant to be long (a migration, an export or seal of a month)
    /// connects with `None`.
    pub fn with_statement_timeout(mut self, timeout: Option<Duration>) -> Database {
        self.statement_timeout = timeout.filter(|t| !t.is_zero());
        if let Some(d) = self.direct.take() {
            self.direct = Some(Arc::new((*d).clone().with_statement_timeout(timeout)));
        }
        self
    }

    /// How long a connection attempt to one host may take: the URL's
    /// `connect_timeout`, or [`DEFAULT_CONNECT_TIMEOUT`].
    pub fn connect_timeout(&self) -> Duration {
        self.config
            .get_connect_timeout()
            .copied()
            .unwrap_or(DEFAULT_CONNECT_TIMEOUT)
    }

    /// The statement timeout connections get (see [`Database::startup`]).
    pub fn statement_timeout(&self) -> Option<Duration> {
        self.statement_timeout
    }

    /// What a connection is opened with: the URL's settings, plus
    /// `statement_timeout` in the startup options so the server itself
    /// cancels a statement that runs too long, whether it waits on a lock
    /// or works. Not through a pooler (PgBouncer 1.18 refuses startup
    /// options; there the server's setting for the role, or the pooler's
    /// `query_timeout`, bounds statements), and not where the URL's
    /// `options` set one already.
    pub fn startup(&self) -> std::borrow::Cow<'_, Config> {
        let Some(t) = self.statement_timeout else {
            return std::borrow::Cow::Borrowed(&self.config);
        };
        let options = self.config.get_options().unwrap_or("");
        if self.pooled() || options.contains("statement_timeout") {
            return std::borrow::Cow::Borrowed(&self.config);
        }
        let mut config = self.config.clone();
        let set = format!("-c statement_timeout={}", t.as_millis().max(1));
        config.options(if options.is_empty() {
            set
        } else {
            format!("{options} {set}")
        });
        std::borrow::Cow::Owned(config)
    }
}

impl std::str::FromStr for Database {
    type Err = String;
    fn from_str(s: &str) -> Result<Database, String> {
        Database::parse(s)
    }
}

/// How long one of Strata's statements may run unless the database says
/// otherwise ([`Database::with_statement_timeout`]): long past what any of a
/// role's statements takes, short enough that a statement stuck behind a
/// lock is given up and retried rather than hanging its role.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a connection attempt to one host may take when the URL does
/// not say (`connect_timeout`): a server that accepts TCP but never answers
/// (stopped, overloaded) is given up on and the next host tried.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn bounded(config: &mut Config) {
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
    }
}

/// A configuration made in code: TLS as its `ssl_mode` says, unverified.
impl From<Config> for Database {
    fn from(mut config: Config) -> Database {
        bounded(&mut config);
        let mode = match config.get_ssl_mode() {
            tokio_postgres::config::SslMode::Disable => SslMode::Disable,
            tokio_postgres::config::SslMode::Require => SslMode::Require,
            _ => SslMode::Prefer,
        };
        Database {
            config,
            tls: Tls::unchecked(mode),
            direct: None,
            statement_timeout: Some(DEFAULT_STATEMENT_TIMEOUT),
        }
    }
}

impl From<&Config> for Database {
    fn from(config: &Config) -> Database {
        config.clone().into()
    }
}

impl From<&Database> for Database {
    fn from(db: &Database) -> Database {
        db.clone()
    }
}

/// Takes the TLS settings tokio-postgres does not know out of a connection
/// string: what is left, and the settings.
fn split_tls(s: &str) -> Result<(String, TlsSettings), String> {
    let mut settings = TlsSettings::default();
    let mut take = |key: &str, value: &str| -> Result<bool, String> {
        match key {
            "sslmode" => settings.mode = SslMode::parse(value)?,
            "sslrootcert" => settings.root_cert = Some(PathBuf::from(value)),
            "sslcert" => settings.cert = Some(PathBuf::from(value)),
            "sslkey" => settings.key = Some(PathBuf::from(value)),
            _ => return Ok(false),
        }
        Ok(true)
    };
    let s = s.trim();
    if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        let Some((base, query)) = s.split_once('?') else {
            return Ok((s.to_string(), settings));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if !take(&percent_decode(k)?, &percent_decode(v)?)? {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, settings));
    }
    let mut kept = Vec::new();
    for (k, v) in key_values(s)? {
        if !take(&k, &v)? {
            kept.push(format!(
                "{k}='{}'",
                v.replace('\\', "\\\\").replace('\'', "\\'")
            ));
        }
    }
    Ok((kept.join(" "), settings))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-encoding in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once decoded"))
}

/// libpq's `key = value` pairs; a value may be single-quoted, with `\'` and
/// `\\` inside.
fn key_values(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut it = s.chars().peekable();
    loop {
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        if it.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(c) = it.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        if it.next() != Some('=') {
            return Err(format!("{key:?} has no value: expected {key}=value"));
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if it.next_if_eq(&'\'').is_some() {
            loop {
                match it.next() {
                    None => return Err(format!("the value of {key} has no closing quote")),
                    Some('\'') => break,
                    Some('\\') => value.extend(it.next()),
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = it.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(it.next());
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
}

/// Connects to `db` and drives the connection in a named task.
pub async fn connect(
    db: impl Into<Database>,
    task: &'static str,
) -> Result<Client, tokio_postgres::Error> {
    Ok(open(&db.into(), task).await?.0)
}

/// Connects to `db` (see [`Database::startup`]) and drives the connection
/// in a named task, returned with the client. A server that refuses startup
/// options (a pooler given as the only URL) is connected to without them,
/// once more, with a warning: its statements are then bounded only by the
/// server's own setting.
pub async fn open(
    db: &Database,
    task: &'static str,
) -> Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error> {
    let startup = db.startup();
    let (client, connection) = match within_bound(db, startup.connect(db.tls.maker())).await {
        Err(e) if matches!(startup, std::borrow::Cow::Owned(_)) && refuses_options(&e) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    "the server refused startup options (a connection pooler?): connecting without a statement timeout; give --database-direct-url for PostgreSQL itself, and set the role's statement_timeout"
                )
            });
            within_bound(db, db.config.connect(db.tls.maker())).await?
        }
        r => r?,
    };
    let handle = ops::task::spawn(task, async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "connection closed");
        }
    });
    Ok((client, handle))
}

/// `connect` given the URL's `connect_timeout` for each host it may try.
/// tokio-postgres bounds only the socket's connect with it; a server that
/// accepts TCP and then answers nothing (stopped, its backlog still taking
/// connections) would hold the start-up exchange for ever.
async fn within_bound<T>(
    db: &Database,
    connect: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, tokio_postgres::Error> {
    let hosts = db.config.get_hosts().len().max(1) as u32;
    match tokio::time::timeout(db.connect_timeout() * hosts, connect).await {
        Ok(r) => r,
        // The crate's own "timeout waiting for server" error; it has no
        // other constructor.
        Err(_) => Err(tokio_postgres::Error::__private_api_timeout()),
    }
}

/// PgBouncer's answer to a startup packet with `options` in it.
fn refuses_options(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|d| {
        *d.code() == tokio_postgres::error::SqlState::PROTOCOL_VIOLATION
            && d.message().contains("startup parameter")
    })
}

/// A lazily made connection shared by the tasks of one reader.
pub struct SharedClient {
    pub config: Database,
    client: Mutex<Option<Arc<Client>>>,
}

impl SharedClient {
    pub fn new(config: impl Into<Database>) -> Self {
        SharedClient {
            config: config.into(),
            client: Mutex::new(None),
        }
    }

    /// The current connection, connecting first if there is none or it closed.
    pub async fn get(&self) -> Result<Arc<Client>, tokio_postgres::Error> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let c = Arc::new(connect(&self.config, "db-connection").await?);
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Forgets the current connection (one that stopped answering), so the
    /// next [`Db::get`] connects afresh.
    pub async fn reset(&self) {
        self.client.lock().await.take();
    }
}
