//! `strata serve`: migrate, register the process, start the roles of
//! `--roles` (a typed list, see `roles`) with the process's replication
//! reader when one follows the log, serve `/metrics` (with how late the
//! runtime runs, `ops::runtime_lag`), and stop on a signal.

use crate::cli::config;
use crate::cli::connect_long;
use crate::cli::hostname;
use crate::roles::{self, Running, ServeArgs};
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use events::Reader;
use events::ReaderConfig;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::SystemTime;

/// Migrates, keeps partitions ahead, runs the replication reader and serves
/// metrics until Ctrl-C.
pub(crate) async fn serve(args: ServeArgs) -> Result<ExitCode> {
    let cfg = config(&args.db)?;
    let mut client = connect_long(&args.db).await?;
    schema::migrate(&mut client).await.context("migrate")?;
    let me = Registration::start(&cfg, &roles::names(&args.roles));
    // Not fatal: a long-running reader can hold creation off (it gives up
    // after a lock timeout), and the reader keeps months ahead from now on.
    if let Err(e) = schema::partitions::ensure(
        &client,
        schema::partitions::DEFAULT_MONTHS_AHEAD,
        SystemTime::now(),
    )
    .await
    {
        tracing::warn!(error = %format!("{e:#}"), "could not create the coming months' partitions now; retrying in the background");
    }
    if let Some(addr) = args.metrics_listen {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen for metrics on {addr}"))?;
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
        ops::task::spawn("metrics", ops::http::serve(l));
    }
    ops::runtime_lag::watch();
    // Not ready until every role has started.
    let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let started = started.clone();
        ops::http::ready_when("roles", move || {
            if started.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("starting".into())
            }
        });
    }
    let slot = slot_name(args.slot.as_deref());
    if slot.is_empty()
        || slot.len() > 63
        || !slot
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        bail!("--slot {slot:?}: a slot name is 1 to 63 lower-case letters, digits and underscores");
    }
    let mut rc = ReaderConfig::new(slot);
    rc.owner = "strata serve".into();
    rc.subscription_lease_ttl = args.subscription_lease_ttl;
    rc.share_from = args.log_from.clone();
    rc.share_silence = args.log_share_silence;
    let share = match &args.log_share {
        Some(path) => Some((
            path,
            events::share::bind(path)
                .await
                .with_context(|| format!("--log-share {}", path.display()))?,
        )),
        None => None,
    };
    let reader = (share.is_some() || args.roles.iter().any(|r| r.follows_log()))
        .then(|| Reader::start(cfg.clone(), rc));
    // The share ends only if its socket fails; the process then stops, so
    // that whoever runs it starts it again (its followers reconnect).
    let mut sharing = match (share, &reader) {
        (Some((path, listener)), Some(r)) => {
            tracing::info!(socket = %path.display(), "sharing the decoded log with this host's processes");
            Some(ops::task::spawn(
                "log-share",
                events::share::serve(r.clone(), listener, events::share::ShareConfig::default()),
            ))
        }
        _ => None,
    };
    let follower = reader.clone();
    let roles = Running::start(&args, &cfg, reader).await?;
    if let Some(r) = follower {
        ops::http::ready_when("replication", move || {
            if r.streaming() {
                Ok(())
            } else {
                Err("no replication session is streaming (connecting, or reconnecting after a failure)".into())
            }
        });
    }
    started.store(true, Ordering::Relaxed);
    tracing::info!(roles = %roles::names(&args.roles), "every role started");
    let mut report = tokio::time::interval(Duration::from_secs(10));
    report.tick().await;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listen for SIGTERM")?;
    let mut code = ExitCode::SUCCESS;
    loop {
        tokio::select! {
            r = &mut ctrl_c => { r.context("wait for Ctrl-C")?; break; }
            _ = term.recv() => break,
            r = async { sharing.as_mut().expect("sharing").await }, if sharing.is_some() => {
                let why = match r {
                    Ok(Ok(())) => "ended".to_string(),
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                };
                tracing::error!(error = %why, "the log share's socket failed; stopping");
                code = ExitCode::FAILURE;
                break;
            }
            _ = report.tick() => {
                if roles.one_stopped() {
                    break;
                }
                roles.report();
            }
        }
    }
    tracing::info!("stopping");
    me.stop().await;
    roles.stop().await?;
    Ok(code)
}

/// This process's row in `strata.processes`, refreshed while it runs: a
/// contracting migration waits while a process that knows an older schema
/// is live.
pub(crate) struct Registration {
    host: String,
    started_at: SystemTime,
    task: tokio::task::JoinHandle<()>,
    cfg: events::db::Database,
}

impl Registration {
    fn start(cfg: &events::db::Database, roles: &str) -> Registration {
        let host = hostname().unwrap_or_else(|| "local".into());
        let started_at = SystemTime::now();
        let (h, roles, db) = (
            host.clone(),
            roles.to_string(),
            events::db::SharedClient::new(cfg.clone()),
        );
        let task = ops::task::spawn("process-registration", async move {
            let mut backoff =
                ops::task::Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
            loop {
                let result = match db.get().await {
                    Ok(c) => schema::migrate::register(
                        &c,
                        &h,
                        started_at,
                        env!("CARGO_PKG_VERSION"),
                        &roles,
                    )
                    .await
                    .map_err(|e| e.to_string()),
                    Err(e) => Err(format!("connect: {e}")),
                };
                match result {
                    Ok(()) => {
                        backoff.reset();
                        tokio::time::sleep(schema::migrate::PROCESS_REFRESH).await;
                    }
                    Err(e) => {
                        db.reset().await;
                        let wait = backoff.next_delay();
                        tracing::warn!(error = %e, retry_in = ?wait, "could not record this process in strata.processes");
                        tokio::time::sleep(wait).await;
                    }
                }
            }
        });
        Registration {
            host,
            started_at,
            task,
            cfg: cfg.clone(),
        }
    }

    async fn stop(self) {
        self.task.abort();
        if let Ok(c) = events::db::connect(&self.cfg, "process-registration").await {
            if let Err(e) = schema::migrate::unregister(&c, &self.host, self.started_at).await {
                tracing::warn!(error = %e, "could not remove this process from strata.processes");
            }
        }
    }
}

/// `strata_<host>` in the characters a slot name allows.
pub(crate) fn default_slot() -> String {
    format!("strata_{}", host_token())
}

/// `--slot` with `{host}` read as this host's name in slot characters, so
/// one configuration file serves every host: `strata_{host}_control`.
pub(crate) fn slot_name(given: Option<&str>) -> String {
    match given {
        Some(s) => s.replace("{host}", &host_token()),
        None => default_slot(),
    }
}

/// The host name in the characters a slot name may hold.
pub(crate) fn host_token() -> String {
    let host = hostname().unwrap_or_else(|| "local".into());
    host.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(40)
        .collect()
}
