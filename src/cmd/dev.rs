//! `strata dev`: Strata on this machine with a private PostgreSQL under
//! `.strata/`, every role in one process, a simulated fleet and a demo
//! workload.

use crate::cmd::node::start_fleet;
use crate::cmd::node::FleetSpec;
use crate::roles::maintenance::spawn_sealer;
use anyhow::Context;
use anyhow::Result;
use clap::Args;
use events::db::Sql;
use events::Appender;
use events::AppenderConfig;
use events::ExpectedVersion;
use events::NewEvent;
use events::Reader;
use events::ReaderConfig;
use events::Start;
use schema::Cluster;
use schema::ClusterOptions;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;
use std::time::SystemTime;

#[derive(Args, Debug)]
pub(crate) struct DevArgs {
    /// Folder for the private cluster and its log
    #[arg(long, default_value = ".strata")]
    pub data_dir: PathBuf,
    /// Use this database instead of starting a private cluster
    #[arg(long, env = "STRATA_DATABASE_URL", value_name = "URL")]
    pub database_url: Option<String>,
    /// Events per second the demo writer appends
    #[arg(long, default_value_t = 200)]
    pub rate: u32,
    /// Simulated node daemons (8 GPUs each) joining the demo pool through the gateway
    #[arg(long, default_value_t = 16)]
    pub demo_nodes: u32,
    /// Reservations per second the demo workload asks for (0: none)
    #[arg(long, default_value_t = 4)]
    pub reservations_per_s: u32,
    /// Serve Prometheus metrics at this address
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub metrics_listen: SocketAddr,
    /// Stop by itself after this long (e.g. 30s); runs until Ctrl-C otherwise
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<std::time::Duration>,
    /// Where the roles' logs go (default <data-dir>/strata.log; `-`: the terminal, between the status lines)
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
}

impl DevArgs {
    /// The file the roles log into, if not the terminal.
    pub(crate) fn log_file(&self) -> Option<PathBuf> {
        match &self.log {
            Some(p) if p.as_os_str() == "-" => None,
            Some(p) => Some(p.clone()),
            None => Some(self.data_dir.join("strata.log")),
        }
    }
}

pub(crate) const DEV_PORT: u16 = 55432;

pub(crate) const DEV_GATEWAY_PORT: u16 = 57443;

pub(crate) const DEMO_POOL: &str = "demo";

pub(crate) const DEMO_CLASS: &str = "H100-80GB";

pub(crate) const DEV_AUDIT_PORT: u16 = 56543;

pub(crate) const DEV_CONSOLE_PORT: u16 = 57480;

/// The web console on its dev port (or any free one), an operator `dev`
/// who is an admin, and a link that signs a browser in as it.
async fn start_console(
    cfg: &events::db::Database,
    client: &tokio_postgres::Client,
    reader: &Reader,
    ca_dir: &std::path::Path,
    appender: Appender,
) -> Result<(console::Console, String)> {
    if gateway::roles::get(client, "dev").await?.is_none() {
        let admin = gateway::roles::Assignment {
            role: gateway::roles::Role::Admin,
            pools: vec![],
        };
        gateway::roles::set(&appender, "dev", &admin).await?;
    }
    let ca = gateway::ca::Ca::load(ca_dir)?;
    let (cert_pem, key_pem) = ca.server_identity(&["localhost".into(), "127.0.0.1".into()])?;
    let port = if std::net::TcpListener::bind(("127.0.0.1", DEV_CONSOLE_PORT)).is_ok() {
        DEV_CONSOLE_PORT
    } else {
        0
    };
    let cc = console::ConsoleConfig::new(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        cert_pem,
        key_pem,
        ca.cert_pem().to_string(),
    );
    let c = console::start(cc, cfg.clone(), reader.clone(), appender).await?;
    let url = format!("https://localhost:{}", c.addr.port());
    let link =
        crate::cmd::console::login_link(client, "dev", &url, Duration::from_secs(3600)).await?;
    Ok((c, link))
}

/// The audit endpoint with an auditor `dev` whose password is kept (0600) in
/// the data folder.
pub(crate) async fn start_audit(
    cfg: &events::db::Database,
    client: &tokio_postgres::Client,
    data_dir: &std::path::Path,
    ca_dir: &std::path::Path,
    appender: Appender,
) -> Result<(audit::Endpoint, String)> {
    let path = data_dir.join("auditor-password");
    let password = match std::fs::read_to_string(&path) {
        Ok(p) if !p.trim().is_empty() => p.trim().to_string(),
        _ => {
            let p: String = std::iter::repeat_with(fastrand::alphanumeric)
                .take(20)
                .collect();
            gateway::ca::write_private(&path, p.as_bytes())?;
            p
        }
    };
    audit::accounts::add(client, "dev", Some(&password)).await?;
    let ca = gateway::ca::Ca::load(ca_dir)?;
    let (cert_pem, key_pem) = ca.server_identity(&["localhost".into(), "127.0.0.1".into()])?;
    let mut ac = audit::AuditConfig::new(cfg.clone());
    ac.tls = Some(audit::TlsFiles {
        cert_pem,
        key_pem,
        client_ca_pem: Some(ca.cert_pem().to_string()),
    });
    let port = if std::net::TcpListener::bind(("127.0.0.1", DEV_AUDIT_PORT)).is_ok() {
        DEV_AUDIT_PORT
    } else {
        0
    };
    let endpoint = audit::start(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        ac,
        appender,
    )
    .await?;
    Ok((endpoint, password))
}

pub(crate) async fn run(args: DevArgs) -> Result<ExitCode> {
    let mut cluster = None;
    let url = match &args.database_url {
        Some(url) => url.clone(),
        None => {
            let (c, url) = private_cluster(&args.data_dir).await?;
            cluster = Some(c);
            url
        }
    };
    let cfg = events::db::Database::parse(&url)
        .map_err(anyhow::Error::msg)
        .context("the database URL")?;
    let mut client = events::db::connect(&cfg, "dev-client")
        .await
        .context("connect to postgres")?;
    let applied = schema::migrate(&mut client).await.context("migrate")?;
    schema::partitions::ensure(
        &client,
        schema::partitions::DEFAULT_MONTHS_AHEAD,
        SystemTime::now(),
    )
    .await?;
    metrics_and_banner(&args, &url, &applied).await;

    let mut rc = ReaderConfig::new("strata_dev");
    rc.owner = "strata dev".into();
    let reader = Reader::start(cfg.clone(), rc);
    spawn_sealer(
        cfg.clone(),
        Duration::from_secs(60),
        Duration::from_secs(600),
    );
    crate::roles::usage::start(&cfg, reader.clone());
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());

    // A demo pool whose nodes are simulated daemons joining through a
    // gateway over mutual TLS; a placer and a binder for it.
    match domain::pools::create_pool(&appender, DEMO_POOL, "strata dev demo pool").await {
        Ok(()) | Err(domain::requests::RequestError::PoolExists(_)) => {}
        Err(e) => return Err(e).context("create the demo pool"),
    }
    let (gw, ca_dir) = start_gateway(&cfg, &reader, &appender, &args.data_dir).await?;
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    let audit = start_audit(&cfg, &client, &args.data_dir, &ca_dir, appender.clone()).await;
    print_audit(&audit);
    let web = start_console(&cfg, &client, &reader, &ca_dir, appender.clone()).await;
    print_console(&web, &ca_dir, &url);
    let ca_pem = std::fs::read_to_string(ca_dir.join(gateway::ca::CA_CERT))?;
    let (stop_fleet, fleet_rx) = tokio::sync::watch::channel(false);
    let gateways = [format!("https://{}", gw.addr)];
    let (fleet_dir, gpus) = (args.data_dir.join("fleet"), format!("8x{DEMO_CLASS}"));
    let spec = FleetSpec {
        nodes: args.demo_nodes,
        gateways: &gateways,
        pool: DEMO_POOL,
        ca_pem: &ca_pem,
        data_dir: &fleet_dir,
        prefix: "dev-n",
        gpus: &gpus,
        tls_name: "localhost",
        faults: true,
    };
    let (fleet, fleet_tasks) = start_fleet(&client, &spec, &fleet_rx).await?;
    eprintln!(
        "gateway on {}; {} simulated nodes (8 {DEMO_CLASS} each) joining pool {DEMO_POOL}; each writes its bindings' CDI specs under {fleet}/<node>/cdi and takes faults from `strata fault --data-dir {fleet}/<node>`",
        gw.addr,
        args.demo_nodes,
        fleet = fleet_dir.display()
    );
    let mut pc = placer::PlacerConfig::new(events::lease::default_holder());
    pc.snapshots = Some(projections::SnapshotStore::new(
        args.data_dir.join("snapshots"),
    ));
    let placer = placer::Placer::start(cfg.clone(), reader.clone(), appender.clone(), pc);
    let workload = ops::task::spawn(
        "dev-workload",
        demo_workload(cfg.clone(), appender.clone(), args.reservations_per_s),
    );

    let appended = Arc::new(AtomicU64::new(0));
    let writer = ops::task::spawn(
        "dev-writer",
        demo_writer(appender, args.rate, appended.clone()),
    );
    let (tail, delivered, lags) = start_tail(&reader).await?;

    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.tick().await;
    let (mut last_a, mut last_d, mut last_t) = (0u64, 0u64, Instant::now());
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            _ = &mut ctrl_c => break,
            _ = tick.tick() => {
                let (a, d) = (appended.load(Ordering::Relaxed), delivered.load(Ordering::Relaxed));
                let secs = last_t.elapsed().as_secs_f64();
                let mut v = std::mem::take(&mut *lags.lock().expect("lag lock"));
                v.sort_by(f64::total_cmp);
                let pct = |p: f64| v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0);
                let ps = placer.stats().view();
                println!(
                    "appended {:>6.0}/s  delivered {:>6.0}/s  lag p50 {:>6.1} ms  p99 {:>6.1} ms  head {}  | nodes {} placed {} active {} expired {} queued {} rejected {}",
                    (a - last_a) as f64 / secs, (d - last_d) as f64 / secs, pct(0.5), pct(0.99), reader.head(),
                    fleet.connected.load(Ordering::Relaxed), ps.placed, binder.stats.activated.load(Ordering::Relaxed),
                    ps.expired, ps.queued, ps.rejected
                );
                (last_a, last_d, last_t) = (a, d, Instant::now());
                if args.duration.is_some_and(|limit| started.elapsed() >= limit) {
                    break;
                }
            }
        }
    }
    eprintln!("stopping ...");
    writer.abort();
    tail.abort();
    workload.abort();
    let _ = stop_fleet.send(true);
    for t in fleet_tasks {
        let _ = t.await;
    }
    stop_endpoints(audit, web);
    if let Err(e) = gw.stop().await {
        tracing::warn!(error = %e, "the gateway stopped with an error");
    }
    if let Err(e) = binder.stop().await {
        tracing::warn!(error = %e, "the binder stopped with an error");
    }
    if let Err(e) = placer.stop().await {
        tracing::warn!(error = %e, "the placer stopped with an error");
    }
    drop(reader);
    // The dropped subscription stores its cursor once more in the background;
    // let that land before the database goes away.
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Some(mut c) = cluster {
        tokio::task::spawn_blocking(move || c.stop()).await?;
        eprintln!("postgres stopped");
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts (or restarts) the private cluster under `data_dir` with a
/// `strata` database; its URL.
async fn private_cluster(data_dir: &std::path::Path) -> Result<(Cluster, String)> {
    eprintln!(
        "starting a private PostgreSQL under {} ...",
        data_dir.display()
    );
    let mut opts = ClusterOptions::new(data_dir.join("pg"));
    opts.port = Some(
        if std::net::TcpListener::bind(("127.0.0.1", DEV_PORT)).is_ok() {
            DEV_PORT
        } else {
            0
        },
    )
    .filter(|p| *p != 0);
    let c = tokio::task::spawn_blocking(move || Cluster::start(opts)).await??;
    let admin = events::db::connect(
        &c.url("postgres").parse::<tokio_postgres::Config>()?,
        "dev-admin",
    )
    .await
    .context("connect to the private cluster")?;
    let exists = admin
        .opt("SELECT 1 FROM pg_database WHERE datname = 'strata'", &[])
        .await?
        .is_some();
    if !exists {
        admin
            .batch_execute("CREATE DATABASE strata")
            .await
            .context("create the strata database")?;
    }
    let url = c.url("strata");
    eprintln!("postgres is up (log: {})", c.log_path().display());
    Ok((c, url))
}

/// Serves the metrics (where their address is free) and prints the banner.
async fn metrics_and_banner(args: &DevArgs, url: &str, applied: &[i32]) {
    let listener = tokio::net::TcpListener::bind(args.metrics_listen).await;
    banner(
        url,
        &listener,
        args.metrics_listen,
        applied,
        args.log_file().as_deref(),
    );
    if let Ok(l) = listener {
        ops::task::spawn("metrics", ops::http::serve(l));
    }
    ops::runtime_lag::watch();
}

/// Stops the audit endpoint and the console, those that started.
fn stop_endpoints(
    audit: Result<(audit::Endpoint, String)>,
    web: Result<(console::Console, String)>,
) {
    if let Ok((endpoint, _)) = audit {
        endpoint.stop();
    }
    if let Ok((c, _)) = web {
        c.stop();
    }
}

/// Where the console is and how to sign in to it.
fn print_console(web: &Result<(console::Console, String)>, ca_dir: &std::path::Path, url: &str) {
    match web {
        Ok((c, link)) => println!(
            "  console:   https://localhost:{} (the region's CA signs its certificate: {})\n             sign in as the admin `dev`, within the hour, once: {link}\n             a new link: strata console login --operator dev --url https://localhost:{} --database-url '{url}'",
            c.addr.port(),
            ca_dir.join(gateway::ca::CA_CERT).display(),
            c.addr.port(),
        ),
        Err(e) => println!("  console:   off ({e:#})"),
    }
}

/// What `strata dev` prints when it is up: where everything is, and what to
/// try.
fn banner(
    url: &str,
    listener: &std::io::Result<tokio::net::TcpListener>,
    metrics_listen: std::net::SocketAddr,
    applied: &[i32],
    log: Option<&std::path::Path>,
) {
    println!();
    println!("  Strata dev is running.");
    println!("  database:  {url}");
    println!("  psql:      psql '{url}'");
    match &listener {
        Ok(_) => println!("  metrics:   http://{}/metrics", metrics_listen),
        Err(e) => println!("  metrics:   off ({} is taken: {e})", metrics_listen),
    }
    println!(
        "  schema:    {}",
        if applied.is_empty() {
            "up to date".to_string()
        } else {
            format!("applied {applied:?}")
        }
    );
    println!("  try:       strata events tail --database-url '{url}' --from start");
    println!("             strata pool show {DEMO_POOL} --database-url '{url}'");
    println!(
        "             strata reserve --database-url '{url}' --pool {DEMO_POOL} --class {DEMO_CLASS} --gpus 4 --wait"
    );
    println!(
        "  logs:      {}",
        log.map_or("here, between the status lines".to_string(), |p| p
            .display()
            .to_string())
    );
    println!("  Ctrl-C stops it.");
    println!();
}

/// Follows the log from now on, counting what is delivered and how late.
async fn start_tail(
    reader: &Reader,
) -> Result<(
    tokio::task::JoinHandle<()>,
    Arc<AtomicU64>,
    Arc<Mutex<Vec<f64>>>,
)> {
    let lags: Arc<Mutex<Vec<f64>>> = Arc::default();
    let delivered = Arc::new(AtomicU64::new(0));
    let mut sub = reader.subscribe("dev-tail", Start::Now).await?;
    let (d, l) = (delivered.clone(), lags.clone());
    let tail = ops::task::spawn("dev-tail", async move {
        loop {
            let e = match sub.next().await {
                Ok(e) => e,
                Err(err) => {
                    tracing::warn!(error = %err, "tail stopped");
                    return;
                }
            };
            let lag = SystemTime::now()
                .duration_since(e.recorded_at)
                .unwrap_or_default();
            d.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut v) = l.lock() {
                v.push(lag.as_secs_f64() * 1e3);
            }
            sub.ack(e.position);
        }
    });
    Ok((tail, delivered, lags))
}

/// The demo's gateway, over mutual TLS with the dev CA under `data_dir`
/// (made on first use); the gateway and the CA's folder.
async fn start_gateway(
    cfg: &events::db::Database,
    reader: &Reader,
    appender: &Appender,
    data_dir: &std::path::Path,
) -> Result<(gateway::server::Running, std::path::PathBuf)> {
    let ca_dir = data_dir.join("ca");
    if !ca_dir.join(gateway::ca::CA_CERT).exists() {
        gateway::ca::init(&ca_dir, "dev")?;
    }
    let gw_port = if std::net::TcpListener::bind(("127.0.0.1", DEV_GATEWAY_PORT)).is_ok() {
        DEV_GATEWAY_PORT
    } else {
        0
    };
    let mut gc = gateway::server::GatewayConfig::new(
        "dev-gateway",
        std::net::SocketAddr::from(([127, 0, 0, 1], gw_port)),
        &ca_dir,
    );
    gc.heartbeat = Duration::from_secs(2);
    let gw = gateway::server::start(cfg.clone(), reader.clone(), appender.clone(), gc)
        .await
        .context("start the gateway")?;
    Ok((gw, ca_dir))
}

/// How to reach the audit endpoint, or why it is off.
fn print_audit(audit: &Result<(audit::Endpoint, String)>) {
    match audit {
        Ok((endpoint, password)) => {
            println!(
                "  audit:     PGPASSWORD='{password}' psql 'host=127.0.0.1 port={} user=dev dbname=audit sslmode=require'",
                endpoint.addr.port()
            );
            println!("             (read-only: event partitions, seals, audit.* views; every query is recorded)");
        }
        Err(e) => println!("  audit:     off ({e:#})"),
    }
}

/// Appends `rate` events per second over eight streams, each with its
/// expected version, as a real writer would.
pub(crate) async fn demo_writer(appender: Appender, rate: u32, appended: Arc<AtomicU64>) {
    let streams = 8u64;
    let mut versions = vec![None::<u64>; streams as usize];
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let per_tick = (f64::from(rate) / 100.0).max(0.0);
    let mut owed = 0.0;
    let mut n = 0u64;
    loop {
        tick.tick().await;
        owed += per_tick;
        while owed >= 1.0 {
            owed -= 1.0;
            let i = (n % streams) as usize;
            n += 1;
            let stream = format!("demo/{i}");
            let expected = versions[i].map_or(ExpectedVersion::Any, ExpectedVersion::Exact);
            let ev = NewEvent::new(
                crate::cmd::events::DEMO_TICKED,
                &serde_json::json!({"n": n, "writer": i}),
            );
            match appender.append(&stream, expected, vec![ev]).await {
                Ok(out) => {
                    versions[i] = Some(out.version);
                    appended.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    versions[i] = None;
                    tracing::warn!(error = %e, "demo append failed");
                }
            }
        }
    }
}

/// Reserves GPUs in the demo pool: mostly small requests, some whole nodes,
/// islands and two-node gangs, each released by its TTL a few seconds later.
pub(crate) async fn demo_workload(cfg: events::db::Database, appender: Appender, rate: u32) {
    use domain::{Request, Shape};
    if rate == 0 {
        return;
    }
    let client = match events::db::connect(&cfg, "dev-workload").await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "demo workload could not connect");
            return;
        }
    };
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    loop {
        tick.tick().await;
        let (gpus, shape) = match fastrand::u32(0..10) {
            0..=4 => (1, Shape::Any),
            5 => (2, Shape::Any),
            6 => (4, Shape::Island),
            7 => (8, Shape::Node),
            8 => (
                16,
                Shape::Gang {
                    nodes: 2,
                    gpus_per_node: 8,
                },
            ),
            _ => (4, Shape::Any),
        };
        let request = Request {
            reservation: domain::new_id("r"),
            pool: DEMO_POOL.into(),
            class: DEMO_CLASS.into(),
            gpus,
            shape,
            priority: fastrand::i32(0..3),
            ttl_ms: Some(fastrand::u64(2_000..10_000)),
            replace_on_failure: false,
            replaces: None,
            topology: None,
            requeue_on_preemption: false,
            start_ms: None,
            queue: None,
        };
        if let Err(e) = domain::requests::reserve(&client, &appender, &request, None).await {
            tracing::warn!(error = %e, "demo reservation failed");
        }
    }
}
