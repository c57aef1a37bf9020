//! `strata serve`: the long-running roles against a database, wired from
//! a typed list of roles.

use crate::cli::config;
use crate::cli::connect_long;
use crate::cli::hostname;
use crate::cli::Db;
use crate::config;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Args;
use events::Appender;
use events::AppenderConfig;
use events::Reader;
use events::ReaderConfig;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::SystemTime;

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// A TOML file with any of these flags as keys (`roles = ["placer", "binder"]`, `metrics_listen = "0.0.0.0:9464"`, `lease_ttl = "5s"`); a flag given here or a STRATA_* variable set wins over the file. Check one with `strata config check`
    #[arg(long, env = "STRATA_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub db: Db,
    /// Roles to run, comma-separated. maintenance: partitions ahead, seals of closed months and checkpoints of the open one; placer: places reservations of the pools it leases; gateway: node sessions over mutual TLS; binder: turns placements into bind commands and bound ones active; sinks: delivers events to the defined sinks; audit: the Postgres-protocol endpoint for auditors
    #[arg(long, value_delimiter = ',', default_value = "maintenance", value_parser = clap::builder::PossibleValuesParser::new(config::ROLES))]
    pub roles: Vec<String>,
    /// Serve Prometheus metrics at this address
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Name of this process's replication slot (default strata_<host>; give each process on a host its own). `{host}` stands for the host's name, so one file serves every host: strata_{host}_gateway
    #[arg(long, env = "STRATA_SLOT")]
    pub slot: Option<String>,
    /// placer: most reservations planned in one batch
    #[arg(long, default_value_t = 1024)]
    pub max_batch: usize,
    /// placer: pool lease time to live; a dead placer's pools move after this
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: std::time::Duration,
    /// placer: how long a node may stay out of contact before its live
    /// reservations fail (node_lost); a revoked or drained node's fail at once
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub node_lost_after: std::time::Duration,
    /// placer: how long a reservation being preempted keeps its devices after its nodes are told (allocation.preempting), before it ends and the request it makes room for is placed
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub preemption_grace: std::time::Duration,
    /// placer: only these pools (comma-separated; default all)
    #[arg(long, value_delimiter = ',')]
    pub pools: Vec<String>,
    /// placer: keep pool index snapshots here and start from the newest
    #[arg(long)]
    pub snapshot_dir: Option<PathBuf>,
    /// placer and binder: name in their leases (default host-pid-random)
    #[arg(long)]
    pub holder: Option<String>,
    /// gateway: where to listen for nodes (mutual TLS)
    #[arg(long, default_value = "127.0.0.1:7443")]
    pub listen: std::net::SocketAddr,
    /// gateway: the node CA's folder (`strata ca init`)
    #[arg(long, default_value = "ca")]
    pub ca_dir: PathBuf,
    /// gateway: this gateway's name in the log (default: the holder name)
    #[arg(long)]
    pub gateway_id: Option<String>,
    /// gateway: DNS names and IPs for its serving certificate (comma-separated)
    #[arg(long, value_delimiter = ',', default_value = "localhost,127.0.0.1")]
    pub tls_names: Vec<String>,
    /// gateway: most sessions held at once
    #[arg(long, default_value_t = 20_000)]
    pub max_streams: usize,
    /// gateway: new sessions admitted per second (a token bucket)
    #[arg(long, default_value_t = 2_000.0)]
    pub handshakes_per_second: f64,
    /// gateway: most sessions waiting for their Hello
    #[arg(long, default_value_t = 1_000)]
    pub max_pending_hellos: usize,
    /// gateway: joins admitted per second (each signs a certificate)
    #[arg(long, default_value_t = 200.0)]
    pub joins_per_second: f64,
    /// gateway: a connection must finish its TLS handshake and start its first RPC within this of its accept
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub handshake_timeout: std::time::Duration,
    /// gateway: a connection with no RPC in progress (no session, join or API call) this long is closed
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub idle_timeout: std::time::Duration,
    /// gateway: most connections without an RPC in progress; one more closes the one idle the longest
    #[arg(long, default_value_t = 1_024)]
    pub max_idle_connections: usize,
    /// gateway: inventory and health messages one node may send per second (bursts of ten times as many); past it its session is ended
    #[arg(long, default_value_t = 20.0)]
    pub node_messages_per_second: f64,
    /// gateway and audit: validity of their serving certificates, renewed (and served without a restart) when a third is left
    #[arg(long, default_value = "30days", value_parser = humantime::parse_duration)]
    pub serving_validity: std::time::Duration,
    /// How long a durable subscription (a sink's, say) held by a process that died stays unavailable
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    pub subscription_lease_ttl: std::time::Duration,
    /// gateway: heartbeat interval told to nodes; three missed make a node unreachable
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub heartbeat: std::time::Duration,
    /// maintenance: how often closed months are sealed and the open month checkpointed
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub seal_every: std::time::Duration,
    /// maintenance: how long after a month ends it is sealed (late commits land first)
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub seal_grace: std::time::Duration,
    /// audit: where auditors connect with psql or any Postgres client (TLS from --ca-dir when it exists)
    #[arg(long, default_value = "127.0.0.1:6543")]
    pub audit_listen: SocketAddr,
    /// audit: the read-only group role every auditor's own database role is a member of (created and granted at start)
    #[arg(long, default_value = "strata_audit")]
    pub audit_role: String,
    /// audit: where auditors' statements connect (host, port, database, sslmode; default: the database URL's). Each auditor logs in as a role of their own with a password the endpoint keeps, so user and password here are not used
    #[arg(long, env = "STRATA_AUDIT_DATABASE_URL", value_name = "URL")]
    pub audit_database_url: Option<String>,
    /// audit: statements running longer are cancelled
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub audit_statement_timeout: std::time::Duration,
    /// audit: an auditor's transaction left idle this long is ended (with the session)
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub audit_idle_in_transaction: std::time::Duration,
    /// audit: an auditor's transaction open this long is rolled back by the endpoint, whatever the auditor set
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub audit_max_transaction_age: std::time::Duration,
    /// audit: largest result returned, in MiB
    #[arg(long, default_value_t = 256)]
    pub audit_max_result_mib: usize,
    /// audit: most auditor sessions at once (each holds a PostgreSQL connection)
    #[arg(long, default_value_t = 32)]
    pub audit_max_sessions: u64,
    /// sinks: PEM certificates to trust for https:// webhooks besides the system's roots (a private CA)
    #[arg(long, env = "STRATA_WEBHOOK_CA", value_name = "FILE")]
    pub webhook_ca: Option<PathBuf>,
    /// The region's name, in the message id of every event a NATS sink publishes (`<region>:<sink>:<position>`): regions that feed one JetStream stream need names of their own
    #[arg(long, env = "STRATA_REGION", default_value = "default")]
    pub region: String,
}

/// Migrates, keeps partitions ahead, runs the replication reader and serves
/// metrics until Ctrl-C.
pub(crate) async fn serve(args: ServeArgs) -> Result<ExitCode> {
    let cfg = config(&args.db)?;
    let mut client = connect_long(&args.db).await?;
    schema::migrate(&mut client).await.context("migrate")?;
    let me = Registration::start(&cfg, &args.roles.join(","));
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
    // Only the roles that follow the log stream it: a process of
    // maintenance or the audit endpoint alone holds no slot and costs
    // PostgreSQL no walsender (each decodes all of the WAL).
    let follows = ["placer", "gateway", "binder", "sinks"];
    let reader = args
        .roles
        .iter()
        .any(|r| follows.contains(&r.as_str()))
        .then(|| Reader::start(cfg.clone(), rc));
    let follower = reader.clone();
    let reader = || {
        reader
            .clone()
            .expect("the reader is started for every role that follows the log")
    };
    let placer = if args.roles.iter().any(|r| r == "placer") {
        let mut pc = placer::PlacerConfig::new(
            args.holder
                .clone()
                .unwrap_or_else(events::lease::default_holder),
        );
        pc.max_batch = args.max_batch.max(1);
        pc.lease_ttl = args.lease_ttl;
        pc.node_lost_after = args.node_lost_after;
        pc.preemption_grace = args.preemption_grace;
        if !args.pools.is_empty() {
            pc.pools = Some(args.pools.iter().cloned().collect());
        }
        pc.snapshots = args
            .snapshot_dir
            .clone()
            .map(projections::SnapshotStore::new);
        tracing::info!(holder = %pc.holder, max_batch = pc.max_batch, lease_ttl = ?pc.lease_ttl, "starting the placer");
        let appender = Appender::start(cfg.clone(), AppenderConfig::default());
        Some(placer::Placer::start(cfg.clone(), reader(), appender, pc))
    } else {
        None
    };
    let holder = args
        .holder
        .clone()
        .unwrap_or_else(events::lease::default_holder);
    let gateway = if args.roles.iter().any(|r| r == "gateway") {
        let mut gc = gateway::server::GatewayConfig::new(
            args.gateway_id.clone().unwrap_or_else(|| holder.clone()),
            args.listen,
            &args.ca_dir,
        );
        gc.names = args.tls_names.clone();
        gc.max_streams = args.max_streams;
        gc.handshakes_per_second = args.handshakes_per_second;
        gc.max_pending_hellos = args.max_pending_hellos;
        gc.joins_per_second = args.joins_per_second;
        gc.handshake_timeout = args.handshake_timeout;
        gc.idle_timeout = args.idle_timeout;
        gc.max_idle_connections = args.max_idle_connections;
        gc.node_messages_per_second = args.node_messages_per_second;
        gc.serving_validity = args.serving_validity;
        gc.heartbeat = args.heartbeat;
        let appender = Appender::start(cfg.clone(), AppenderConfig::default());
        let g = gateway::server::start(cfg.clone(), reader(), appender, gc)
            .await
            .context("start the gateway")?;
        eprintln!("gateway listening on {}", g.addr);
        Some(g)
    } else {
        None
    };
    let binder = if args.roles.iter().any(|r| r == "binder") {
        let appender = Appender::start(cfg.clone(), AppenderConfig::default());
        Some(binder::Binder::start_as(
            cfg.clone(),
            reader(),
            appender,
            holder.clone(),
        ))
    } else {
        None
    };
    let sink_role = if args.roles.iter().any(|r| r == "sinks") {
        let sinks = sinks::Sinks::start(
            cfg.clone(),
            reader(),
            sinks::SinksConfig {
                webhook_ca: args.webhook_ca.clone(),
                region: args.region.clone(),
                ..sinks::SinksConfig::default()
            },
        )
        .map_err(anyhow::Error::msg)
        .context("--webhook-ca")?;
        Some(sinks)
    } else {
        None
    };
    if args.roles.iter().any(|r| r == "maintenance") {
        spawn_sealer(cfg.clone(), args.seal_every, args.seal_grace);
        ops::task::spawn(
            "slot-metrics",
            events::slots::watch(cfg.clone(), Duration::from_secs(5)),
        );
    }
    let audit = if args.roles.iter().any(|r| r == "audit") {
        Some(start_audit(&args, &cfg).await?)
    } else {
        None
    };
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
    tracing::info!(roles = %args.roles.join(","), "every role started");
    let mut report = tokio::time::interval(Duration::from_secs(10));
    report.tick().await;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listen for SIGTERM")?;
    loop {
        tokio::select! {
            r = &mut ctrl_c => { r.context("wait for Ctrl-C")?; break; }
            _ = term.recv() => break,
            _ = report.tick() => {
                if gateway.as_ref().is_some_and(|g| g.is_finished())
                    || binder.as_ref().is_some_and(|b| b.is_finished())
                    || audit.as_ref().is_some_and(|a| a.is_finished())
                {
                    break;
                }
                if let Some(g) = &gateway {
                    let s = &g.stats;
                    tracing::info!(sessions = s.sessions.load(Ordering::Relaxed),
                        opened = s.sessions_opened.load(Ordering::Relaxed),
                        refused_admission = s.refused_rate.load(Ordering::Relaxed)
                            + s.refused_full.load(Ordering::Relaxed)
                            + s.refused_pending.load(Ordering::Relaxed),
                        refused_identity = s.refused_identity.load(Ordering::Relaxed),
                        events = s.events_written.load(Ordering::Relaxed),
                        commands = s.commands_dispatched.load(Ordering::Relaxed), "gateway");
                }
                if let Some(p) = &placer {
                    if p.is_finished() {
                        break;
                    }
                    let s = p.stats().view();
                    tracing::info!(pools = s.pools_held, placed = s.placed, queued = s.queued,
                        unschedulable = s.unschedulable, released = s.released, expired = s.expired,
                        batches = s.batches, conflicts = s.conflicts, position = s.position, "placer");
                }
            }
        }
    }
    tracing::info!("stopping");
    me.stop().await;
    if let Some(a) = audit {
        a.stop();
    }
    if let Some(g) = gateway {
        g.stop().await.context("the gateway failed")?;
    }
    if let Some(b) = binder {
        b.stop().await.context("the binder failed")?;
    }
    if let Some(s) = sink_role {
        s.stop().await;
    }
    if let Some(p) = placer {
        p.stop().await.context("the placer failed")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Seals months once they have closed (and nothing that began before the
/// end is still running) and takes running checkpoints of the open month,
/// every `every`. Several processes may run it; one at a time does the work.
pub(crate) fn spawn_sealer(cfg: events::db::Database, every: Duration, grace: Duration) {
    // Sealing a month reads all of it in one statement.
    let cfg = cfg.with_statement_timeout(None);
    ops::task::spawn("sealer", async move {
        let mut tick = tokio::time::interval(every.max(Duration::from_secs(1)));
        let mut client = None;
        loop {
            tick.tick().await;
            if client
                .as_ref()
                .is_none_or(|c: &tokio_postgres::Client| c.is_closed())
            {
                // Sealing holds a session lock: PostgreSQL itself, never
                // through a pooler.
                match events::db::connect(cfg.direct(), "strata-sealer").await {
                    Ok(c) => client = Some(c),
                    Err(e) => {
                        tracing::warn!(error = %e, "sealer: cannot connect; trying again later");
                        continue;
                    }
                }
            }
            let Some(c) = client.as_ref() else { continue };
            match ::replay::seal::maintain(c, grace).await {
                Ok(done) => {
                    for s in &done.sealed {
                        tracing::info!(partition = %s.partition, rows = s.rows, chain = %s.chain, "sealed a closed month");
                    }
                    if let Some(cp) = &done.checkpoint {
                        tracing::debug!(
                            position = cp.last_position,
                            rows = cp.rows,
                            "checkpoint of the open month"
                        );
                    }
                    for (month, why) in &done.refused {
                        tracing::error!(%month, %why, "NOT sealing a closed month: it changed after a checkpoint");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "sealing or checkpointing failed; trying again later")
                }
            }
        }
    });
}

/// The audit endpoint, with TLS from the CA folder when there is one.
pub(crate) async fn start_audit(
    args: &ServeArgs,
    cfg: &events::db::Database,
) -> Result<::replay::audit::Endpoint> {
    let mut ac = ::replay::audit::AuditConfig::new(cfg.clone());
    ::replay::audit::setup::check_role(&args.audit_role)?;
    ac.role = args.audit_role.clone();
    ac.backend = match &args.audit_database_url {
        Some(u) => events::db::Database::parse(u)
            .map_err(anyhow::Error::msg)
            .context("--audit-database-url")?,
        // Each auditor's session is a login of its own, with its settings.
        None => cfg.direct().clone(),
    };
    ac.statement_timeout = args.audit_statement_timeout;
    ac.idle_in_transaction = args.audit_idle_in_transaction;
    ac.max_transaction_age = args.audit_max_transaction_age;
    ac.max_result_bytes = args.audit_max_result_mib.max(1) << 20;
    ac.max_sessions = args.audit_max_sessions;
    if gateway::ca::exists(&args.ca_dir) {
        let ca = gateway::ca::Ca::load(&args.ca_dir)?;
        let (cert_pem, key_pem) = ca.server_identity_for(&args.tls_names, args.serving_validity)?;
        ac.tls = Some(::replay::audit::TlsFiles {
            cert_pem,
            key_pem,
            client_ca_pem: Some(ca.cert_pem().to_string()),
        });
    } else {
        tracing::warn!(ca_dir = %args.ca_dir.display(),
            "audit: no CA there, so no TLS: auditors log in with SCRAM passwords over plain TCP, and certificates are not available");
    }
    let tls = ac.tls.is_some();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let endpoint = ::replay::audit::start(args.audit_listen, ac, appender)
        .await
        .context("start the audit endpoint")?;
    if let Some(renewer) = endpoint.renewer() {
        let (dir, names, validity) = (
            args.ca_dir.clone(),
            args.tls_names.clone(),
            args.serving_validity,
        );
        ops::task::spawn(
            "audit-serving-cert",
            gateway::ca::keep_renewed(dir, names, validity, "audit", move |cert, key| {
                renewer.renew(cert, key).map_err(|e| e.to_string())
            }),
        );
    }
    eprintln!(
        "audit endpoint listening on {} ({}); connect with: psql \"host={} port={} user=<auditor> dbname=audit{}\"",
        endpoint.addr,
        if tls { "TLS" } else { "no TLS" },
        endpoint.addr.ip(),
        endpoint.addr.port(),
        if tls { " sslmode=require" } else { "" }
    );
    Ok(endpoint)
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
            events::db::Db::new(cfg.clone()),
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
