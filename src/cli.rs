//! What every command shares: the database flags ([`DbArgs`]) and how to
//! connect with them, the output format, who is asking, and reading the
//! whole log into the pool index with progress shown.

use ::replay::rebuild::Progress;
use anyhow::Context;
use anyhow::Result;
use clap::Args;
use events::Appender;
use events::AppenderConfig;
use projections::Index;
use std::io::IsTerminal;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Output {
    Text,
    Json,
    /// `usage report` only
    Csv,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct DbArgs {
    /// PostgreSQL connection string as libpq reads it, e.g. postgres://user@host:5432/strata or 'host=db1,db2 dbname=strata target_session_attrs=read-write'. TLS: sslmode=disable|prefer (the default)|require|verify-ca|verify-full, sslrootcert=FILE (the CA to check the server against), sslcert=FILE and sslkey=FILE (a client certificate)
    #[arg(long, env = "STRATA_DATABASE_URL", value_name = "URL")]
    pub database_url: String,
    /// PostgreSQL itself, when --database-url goes through a connection pooler in transaction mode (PgBouncer): the replication stream, the migration lock, sealing's lock and the audit endpoint's logins connect here, and connections through the pooler keep no prepared statement or session setting past a transaction. Without it every connection uses --database-url
    #[arg(long, env = "STRATA_DATABASE_DIRECT_URL", value_name = "URL")]
    pub database_direct_url: Option<String>,
    /// How long one of Strata's statements may run before PostgreSQL cancels it (0: no limit); a statement stuck behind a lock then fails and is retried instead of hanging. Migrations, exports and seals run without it. Through a pooler it cannot be sent: set it for the role there (ALTER ROLE ... SET statement_timeout)
    #[arg(long, env = "STRATA_STATEMENT_TIMEOUT", value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub statement_timeout: std::time::Duration,
}

#[derive(Args, Debug)]
pub(crate) struct DbOnly {
    #[command(flatten)]
    db: DbArgs,
}

/// The database the command names: libpq's URL or `key=value` string, TLS
/// settings (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`) included.
pub(crate) fn config(db: &DbArgs) -> Result<events::db::Database> {
    let main = events::db::Database::parse(&db.database_url)
        .map_err(anyhow::Error::msg)
        .context("parse the database URL (expected e.g. postgres://user@host:5432/dbname or 'host=db dbname=strata')")?;
    let cfg = match &db.database_direct_url {
        Some(direct) => main.through_pooler(
            events::db::Database::parse(direct)
                .map_err(anyhow::Error::msg)
                .context("parse --database-direct-url")?,
        ),
        None => main,
    };
    Ok(cfg.with_statement_timeout(Some(db.statement_timeout)))
}

/// A connection to PostgreSQL itself (`--database-direct-url` when the
/// main URL goes through a pooler): for the migration lock and the checks
/// of the server.
pub(crate) async fn connect_direct(db: &DbArgs) -> Result<tokio_postgres::Client> {
    let cfg = config(db)?;
    events::db::connect(cfg.direct(), "cli-direct-connection")
        .await
        .context("connect to postgres (directly)")
}

/// A connection to PostgreSQL itself whose statements may take as long as
/// they need: migrations (an index over a big table), exports.
pub(crate) async fn connect_long(db: &DbArgs) -> Result<tokio_postgres::Client> {
    let cfg = config(db)?.with_statement_timeout(None);
    events::db::connect(cfg.direct(), "cli-long-connection")
        .await
        .context("connect to postgres (directly)")
}

pub(crate) async fn connect(db: &DbArgs) -> Result<tokio_postgres::Client> {
    let cfg = config(db)?;
    events::db::connect(&cfg, "cli-connection")
        .await
        .context("connect to postgres")
}

pub(crate) fn appender(db: &DbArgs) -> Result<Appender> {
    Ok(Appender::start(config(db)?, AppenderConfig::default()))
}

/// Who asked, as requests made from the command line record it.
pub(crate) fn asked_by() -> serde_json::Value {
    serde_json::json!({ "cli": whoami() })
}

/// Who runs this command, as the log records it.
pub(crate) fn whoami() -> String {
    std::env::var("USER").unwrap_or_else(|_| "cli".into())
}

/// This machine's host name, if it can be read.
pub(crate) fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
}

pub(crate) fn human_bytes(b: i64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v.abs() >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

/// The index built from the whole log, with progress on a terminal.
pub(crate) async fn index(db: &DbArgs) -> Result<Index> {
    index_until(db, None).await
}

/// The index as it was after `until` (the whole log when `None`).
pub(crate) async fn index_until(db: &DbArgs, until: Option<u64>) -> Result<Index> {
    let client = connect(db).await?;
    let progress = std::sync::Arc::new(::replay::rebuild::Progress::default());
    let display = progress_display("reading the log".into(), progress.clone());
    let index = ::replay::rebuild::from_postgres(
        &config(db)?,
        &client,
        Index::new(),
        until,
        progress,
        |v| eprintln!("warning: the log breaks an invariant: {v}"),
    )
    .await;
    stop_display(display);
    index.context("read the log")
}

/// The last position recorded at or before an RFC 3339 time.
pub(crate) async fn position_at(db: &DbArgs, at: &str) -> Result<u64> {
    let t = time_arg(at)?;
    let client = connect(db).await?;
    Ok(events::read::position_at(&client, t).await?.0)
}

/// `--at`'s time.
pub(crate) fn time_arg(at: &str) -> Result<std::time::SystemTime> {
    humantime::parse_rfc3339_weak(at)
        .map_err(|_| anyhow::anyhow!("--at {at:?}: a time such as 2026-11-30T10:00:00Z"))
}

/// Shows progress on stderr: a bar on a terminal, a line every 5 s otherwise.
pub(crate) fn progress_display(
    label: String,
    progress: Arc<Progress>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let tty = std::io::stderr().is_terminal();
        let started = Instant::now();
        let every = if tty {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(5)
        };
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        loop {
            tick.tick().await;
            let done = progress.applied.load(Ordering::Relaxed);
            let total = progress
                .target
                .load(Ordering::Relaxed)
                .saturating_sub(progress.start.load(Ordering::Relaxed));
            let secs = started.elapsed().as_secs_f64();
            let rate = done as f64 / secs.max(1e-9);
            let eta = if rate > 0.0 && total > done {
                format!("{:.0} s", (total - done) as f64 / rate)
            } else {
                "-".into()
            };
            let pct = if total > 0 {
                100.0 * done as f64 / total as f64
            } else {
                0.0
            };
            let width = 30usize;
            let filled = ((pct / 100.0) * width as f64) as usize;
            let line = format!(
                "{label} [{}{}] {done}/{total} events ({pct:.0}%), {rate:.0} events/s, ETA {eta}",
                "#".repeat(filled.min(width)),
                " ".repeat(width - filled.min(width)),
            );
            if tty {
                eprint!("\r\x1b[K{line}");
            } else {
                eprintln!("{line}");
            }
        }
    })
}

pub(crate) fn stop_display(h: tokio::task::JoinHandle<()>) {
    h.abort();
    if std::io::stderr().is_terminal() {
        eprint!("\r\x1b[K");
    }
}

/// Unix milliseconds as an RFC 3339 time (seconds).
pub(crate) fn ms_time(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}
