//! `bench region`: a whole region on the wall clock, under load and faults.
//!
//! The roles run as separate `strata serve` processes, started the way an
//! operator would start them (`procs.rs`): 3 gateways, 2 placers, 2 binders,
//! a sinks process (a webhook receiver of the drill's own and a NATS
//! JetStream sink, on a `nats-server` the drill starts), maintenance and the
//! audit endpoint, on a private PostgreSQL. The simulated nodes
//! (`fleet.rs`) are real daemons with fake GPUs that join through the Join
//! service with one-time tokens and hold mutual-TLS sessions spread over
//! the gateways. `load.rs` offers the steady load; `scenarios.rs` injects
//! the faults; `check.rs` is the invariant checker, run after every
//! scenario and at the end.
//!
//! Everything shares this machine's cores: the load generator and the
//! daemons in this process, every role, PostgreSQL and NATS.

pub mod check;
pub mod fleet;
pub mod lag;
pub mod load;
pub mod net;
pub mod partitions;
pub mod procs;
pub mod scenarios;
pub mod steps;

use crate::util;
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use events::{Appender, AppenderConfig};
use http_body_util::{BodyExt, Full};
use load::{Load, Rates};
use procs::{Launch, Role};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Simulated nodes (8 GPUs each)
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    /// Pools the nodes are spread over
    #[arg(long, default_value_t = 4)]
    pools: usize,
    /// Seconds of the steady phase
    #[arg(long, default_value_t = 60)]
    steady_seconds: u64,
    /// A short run: 1,000 nodes, 20 s of steady load, shorter waits
    #[arg(long)]
    quick: bool,
    /// The `strata` binary (default: next to this one, built first with cargo when run through cargo)
    #[arg(long)]
    strata: Option<PathBuf>,
    /// Run the placers, binders, sinks, maintenance and audit in two processes (`--roles placer,binder,sinks,audit,maintenance` and `--roles placer,binder`) instead of seven: five replication slots instead of eight (maintenance and audit hold none)
    #[arg(long)]
    shared_processes: bool,
    /// The process that runs maintenance shares its decoded log (`--log-share`) and every other process follows it (`--log-from`): one walsender for the region instead of one per process
    #[arg(long)]
    log_share: bool,
    /// Load `pg_stat_statements` and report the steady phase's statements
    /// by the server time they took (`statements` in the steady phase's
    /// figures); off by default, since tracking costs the server a little
    #[arg(long)]
    statements: bool,
    /// The faults to inject after the steady phase, comma-separated, in
    /// this order: power_cycle, gateway_kill, rack_power_loss, placer_kill,
    /// binder_kill, sinks_kill, maintenance_kill, postgres_crash, walsenders_terminated,
    /// slot_dropped, gateway_cut_from_postgres, rack_cut_from_gateway,
    /// placer_cut_from_postgres, lossy_links, standby_promoted (the four
    /// network faults need root: `ip netns`, `iptables`, `tc`);
    /// `all` (the default) or `none` (cold start and steady load only; the
    /// targets of faults left out are reported as not measured)
    #[arg(long, default_value = "all")]
    faults: String,
    /// The offered load as a multiple of the reference's (200 placements/s,
    /// 50 commands/s and about 170 node events/s at 10,000 nodes): 1.5
    /// offers half as much again, to see how the region behaves past what
    /// the machine does (the file's name then says `-x1.5`)
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// A setting of the private PostgreSQL, `name=value` (repeatable; the
    /// result lists them): `--pg-setting commit_delay=200`, say
    #[arg(long = "pg-setting", value_parser = parse_setting)]
    pg_settings: Vec<(String, String)>,
    /// Keep the region's folder (each role's log, PostgreSQL's data and
    /// log) after the run instead of removing it; its path is printed
    #[arg(long)]
    keep: bool,
    /// The nice value of the simulated daemons' threads (-20 to 19; below
    /// 0 needs root): -5 runs them ahead of the region's processes when the
    /// cores are short, as nodes with machines of their own would be. 0
    /// (the default) shares the cores evenly; the result's
    /// `fleet_runtime_lag` says how late the daemons ran either way
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    fleet_nice: i32,
}

fn parse_setting(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("{s:?}: expected name=value")),
    }
}

/// Every fault the drill knows, in the order it injects them.
pub const FAULTS: [&str; 15] = [
    "power_cycle",
    "gateway_kill",
    "rack_power_loss",
    "placer_kill",
    "binder_kill",
    "sinks_kill",
    "maintenance_kill",
    "postgres_crash",
    "walsenders_terminated",
    "slot_dropped",
    "gateway_cut_from_postgres",
    "rack_cut_from_gateway",
    "placer_cut_from_postgres",
    "lossy_links",
    "standby_promoted",
];

/// The faults that cut or degrade links (`net.rs`): with any of them, a
/// gateway and a placer run in network namespaces of their own.
pub const NETWORK_FAULTS: [&str; 4] = [
    "gateway_cut_from_postgres",
    "rack_cut_from_gateway",
    "placer_cut_from_postgres",
    "lossy_links",
];

/// The faults `--faults` names, in the drill's order.
fn parse_faults(spec: &str) -> Result<Vec<&'static str>> {
    let spec = spec.trim();
    if spec == "all" {
        return Ok(FAULTS.to_vec());
    }
    if spec == "none" || spec.is_empty() {
        return Ok(vec![]);
    }
    let named: Vec<&str> = spec.split(',').map(str::trim).collect();
    if let Some(bad) = named.iter().find(|n| !FAULTS.contains(n)) {
        bail!(
            "unknown fault {bad:?}: the faults are {}",
            FAULTS.join(", ")
        );
    }
    Ok(FAULTS
        .iter()
        .copied()
        .filter(|f| named.contains(f))
        .collect())
}

/// What a drill runs.
#[derive(Debug, Clone)]
pub struct Options {
    pub strata: PathBuf,
    pub nodes: usize,
    pub pools: usize,
    pub steady: Duration,
    /// The power cycle's outage.
    pub outage: Duration,
    /// Daemons away from their home gateway look whether it is back this
    /// often (on average).
    pub return_home: Duration,
    /// Longest wait, after the killed gateway restarts, for its nodes to be
    /// back on it.
    pub spread_wait: Duration,
    pub rates: Rates,
    /// Longest wait for any one thing (all nodes schedulable, a re-home, a
    /// probe) before it is reported as not done.
    pub patience: Duration,
    /// The roles other than the gateways in two processes (one slot each)
    /// instead of seven.
    pub shared: bool,
    /// One process shares the decoded log, the others follow it.
    pub log_share: bool,
    /// Report the steady phase's statements (`pg_stat_statements`).
    pub statements: bool,
    /// Settings of the private PostgreSQL beyond the drill's own.
    pub pg_settings: Vec<(String, String)>,
    /// Keep the region's folder after the run.
    pub keep: bool,
    /// The faults to inject (of [`FAULTS`]), in that order.
    pub faults: Vec<&'static str>,
    /// How long a network fault is held before it is healed.
    pub partition: Duration,
    /// The placers' `--node-lost-after`.
    pub node_lost_after: Duration,
    /// The nice value of the simulated daemons' threads.
    pub fleet_nice: i32,
}

impl Options {
    pub fn network(&self) -> bool {
        self.faults.iter().any(|f| NETWORK_FAULTS.contains(f))
    }
}

impl Options {
    /// The reference's sizing for `nodes` nodes: 200 placements/s, 50
    /// commands/s and about 170 node events/s at 10,000, in proportion
    /// below it.
    pub fn sized(strata: PathBuf, nodes: usize) -> Options {
        let scale = (nodes as f64 / 10_000.0).min(1.0);
        Options {
            strata,
            nodes,
            pools: 4,
            steady: Duration::from_secs(60),
            outage: Duration::from_secs(10),
            return_home: Duration::from_secs(30),
            spread_wait: Duration::from_secs(90),
            rates: Rates {
                placements: (200.0 * scale).max(10.0),
                commands: (50.0 * scale).max(5.0),
                // Each change is a status and a health event: ~170/s.
                drift: (85.0 * scale).max(2.0),
            },
            patience: Duration::from_secs(180),
            shared: false,
            log_share: false,
            statements: false,
            pg_settings: Vec::new(),
            keep: false,
            faults: FAULTS.to_vec(),
            partition: Duration::from_secs(30),
            node_lost_after: Duration::from_secs(30),
            fleet_nice: 0,
        }
    }
}

pub async fn run(args: Args) -> Result<()> {
    let strata = match args.strata {
        Some(p) => p,
        None => build_strata()?,
    };
    let nodes = if args.quick && args.nodes == 10_000 {
        1_000
    } else {
        args.nodes
    };
    let mut o = Options::sized(strata, nodes);
    o.pools = args.pools.max(1);
    o.shared = args.shared_processes;
    o.log_share = args.log_share;
    o.statements = args.statements;
    o.pg_settings = args.pg_settings;
    o.keep = args.keep;
    if !(-20..=19).contains(&args.fleet_nice) {
        anyhow::bail!(
            "--fleet-nice must be from -20 to 19, not {}",
            args.fleet_nice
        );
    }
    o.fleet_nice = args.fleet_nice;
    o.faults = parse_faults(&args.faults)?;
    if !(args.load > 0.0 && args.load.is_finite()) {
        anyhow::bail!(
            "--load must be a positive multiple of the reference load, not {}",
            args.load
        );
    }
    o.rates.placements *= args.load;
    o.rates.commands *= args.load;
    o.rates.drift *= args.load;
    let partial = o.faults.len() < FAULTS.len();
    o.steady = Duration::from_secs(if args.quick { 20 } else { args.steady_seconds });
    if args.quick {
        o.return_home = Duration::from_secs(10);
        o.spread_wait = Duration::from_secs(40);
        o.partition = Duration::from_secs(20);
    }
    let result = drill(o).await?;
    let name = format!(
        "region-{}{}",
        if args.quick {
            "quick".to_string()
        } else {
            nodes.to_string()
        },
        if args.shared_processes { "-shared" } else { "" },
    );
    let name = if args.log_share {
        format!("{name}-log-share")
    } else {
        name
    };
    let name = if args.load == 1.0 {
        name
    } else {
        format!("{name}-x{}", args.load)
    };
    let name = if partial {
        format!("{name}-partial")
    } else {
        name
    };
    util::finish(&name, &result)?;
    let violations = result["violations"].as_u64().unwrap_or(0);
    if violations > 0 {
        anyhow::bail!("{violations} invariant violations (see {name}.json)");
    }
    Ok(())
}

/// Builds the `strata` binary of this workspace with the same profile as
/// this one (when run through cargo) and returns its path.
fn build_strata() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("the bench binary's folder")?;
    let strata = dir.join("strata");
    if let Ok(cargo) = std::env::var("CARGO") {
        eprintln!("building the strata binary ...");
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "--bin", "strata", "-p", "strata"]);
        if dir.ends_with("release") {
            cmd.arg("--release");
        }
        let status = cmd.status().context("run cargo build")?;
        if !status.success() {
            anyhow::bail!("cargo build --bin strata failed");
        }
    }
    if !strata.exists() {
        anyhow::bail!(
            "no strata binary at {}: build it (cargo build --release --bin strata) or pass --strata",
            strata.display()
        );
    }
    Ok(strata)
}

/// The region's processes and shared parts.
pub struct Region {
    pub cluster: schema::Cluster,
    /// Where the standby listens once it runs (`standby_promoted`): every
    /// URL of the region names this port second, with
    /// `target_session_attrs=read-write`, from the start.
    pub standby_port: Option<u16>,
    pub cfg: tokio_postgres::Config,
    pub launch: Launch,
    pub roles: Vec<Role>,
    pub fleet: fleet::Fleet,
    pub appender: Appender,
    pub pools: Vec<String>,
    pub hook: Arc<check::Received>,
    pub js: Option<async_nats::jetstream::Context>,
    /// How long the last probe that went the whole way spent on its node:
    /// from the node receiving its bind to the node sending the result.
    pub probe_on_node_s: std::sync::Mutex<Option<f64>>,
    nats: Option<tokio::process::Child>,
    _dir: tempfile::TempDir,
    _nodes_dir: tempfile::TempDir,
}

/// The webhook sink's filter, and the NATS sink's.
pub const HOOK_PREFIX: &str = "reservation/";
pub const JS_PREFIX: &str = "command/";
pub const HOOK_SINK: &str = "region-hook";
pub const JS_SINK: &str = "region-js";
pub const JS_STREAM: &str = "REGION";
/// How long one of the drill's own statements or JetStream requests may
/// take: the checker reads the whole log, on the cores the region uses.
pub const CHECK_STATEMENT_TIMEOUT: Duration = Duration::from_secs(600);

impl Region {
    /// The process running `role` (the first, if several do).
    pub fn running(&self, role: &str) -> String {
        self.roles
            .iter()
            .find(|r| r.runs(role))
            .map(|r| r.name.clone())
            .unwrap_or_default()
    }

    /// The port PostgreSQL listens on.
    pub fn pg_port(&self) -> u16 {
        self.cluster.port()
    }

    /// Starts a role's process again (after a kill) and, for a gateway,
    /// waits until it listens.
    pub async fn restart(&mut self, name: &str) -> Result<()> {
        let Region { roles, launch, .. } = self;
        let role = roles
            .iter_mut()
            .find(|r| r.name == name)
            .expect("a role of the region");
        role.start(launch)?;
        if let Some(l) = role.listen.clone() {
            procs::wait_listening(&l, Duration::from_secs(60)).await?;
        }
        Ok(())
    }

    pub fn role(&mut self, name: &str) -> &mut Role {
        self.roles
            .iter_mut()
            .find(|r| r.name == name)
            .expect("a role of the region")
    }

    /// A connection for the drill's own reads (a new one: the server may
    /// have restarted since the last).
    pub async fn client(&self) -> Result<tokio_postgres::Client> {
        // The drill's own statements (the checker reads the whole log) may
        // run long on a machine the region keeps busy: they are given
        // minutes, not a role's deadline.
        let db = events::db::Database::from(self.cfg.clone())
            .with_statement_timeout(Some(CHECK_STATEMENT_TIMEOUT));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match events::db::connect(db.clone(), "region-drill").await {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() > deadline => return Err(e.into()),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Fails if a role has exited by itself.
    pub fn check_alive(&mut self) -> Result<()> {
        for r in &mut self.roles {
            r.check_alive()?;
        }
        Ok(())
    }
}

/// The webhook receiver, on a thread and runtime of its own: the bench
/// process also runs thousands of daemons, and a receiver sharing their
/// runtime would be as slow to answer as they are busy.
fn receiver(rx: Arc<check::Received>) -> Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let url = format!("http://{}/", listener.local_addr()?);
    ops::task::spawn_apart("webhook-receiver", move || {
        async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            loop {
                // An accept that fails (descriptors run out, say) is
                // tried again: the sink retries what it could not send.
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, "webhook receiver: accept failed; retrying");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let rx = rx.clone();
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let rx = rx.clone();
                        async move {
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
                                rx.record(
                                    v["events"]
                                        .as_array()
                                        .into_iter()
                                        .flatten()
                                        .filter_map(|e| e["position"].as_u64()),
                                );
                            }
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                                Bytes::new(),
                            )))
                        }
                    },
                );
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        }
    })?;
    Ok(url)
}

/// Starts `nats-server` with JetStream on a free port, if there is one.
async fn nats(dir: &std::path::Path) -> Result<Option<(tokio::process::Child, String)>> {
    let port = procs::free_port()?;
    let store = dir.join("nats");
    std::fs::create_dir_all(&store)?;
    let child = tokio::process::Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(&store)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("nats.log"))?)
        .kill_on_drop(true)
        .spawn();
    let Ok(child) = child else {
        eprintln!("no nats-server on this machine: the JetStream sink is left out");
        return Ok(None);
    };
    let addr = format!("127.0.0.1:{port}");
    procs::wait_listening(&addr, Duration::from_secs(10)).await?;
    Ok(Some((child, format!("nats://{addr}"))))
}

/// Starts the region: PostgreSQL, the CA, pools, sinks, every role, and the
/// fleet's tokens (the nodes are not started).
pub async fn start(o: &Options) -> Result<Region> {
    let mut dir = tempfile::Builder::new()
        .prefix("strata-region-")
        .tempdir()?;
    if o.keep {
        dir.disable_cleanup(true);
        eprintln!("the region's folder (kept): {}", dir.path().display());
    }
    eprintln!("starting a private PostgreSQL (fsync on) ...");
    let (namespaces, statements, settings) = (o.network(), o.statements, o.pg_settings.clone());
    let cluster =
        tokio::task::spawn_blocking(move || util::region_cluster(namespaces, statements, settings))
            .await??;
    let cfg = util::database(&cluster, "region").await?;
    let standby_port = if o.faults.contains(&"standby_promoted") {
        Some(procs::free_port()?)
    } else {
        None
    };
    let (url, cfg) = match standby_port {
        Some(p2) => {
            let url = format!(
                "postgres://{}@127.0.0.1:{},127.0.0.1:{p2}/region?target_session_attrs=read-write&connect_timeout=2",
                schema::cluster::SUPERUSER,
                cluster.port()
            );
            let cfg: tokio_postgres::Config = url.parse()?;
            (url, cfg)
        }
        None => (cluster.url("region"), cfg),
    };
    let client = events::db::connect(&cfg, "region-setup").await?;
    let ca = dir.path().join("ca");
    gateway::ca::init(&ca, "region-drill")?;
    let ca_pem = std::fs::read_to_string(ca.join("ca.pem"))?;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let pools: Vec<String> = (0..o.pools)
        .map(|i| format!("pool-{}", (b'a' + i as u8) as char))
        .collect();
    for p in &pools {
        domain::pools::create_pool(&appender, p, "region drill").await?;
    }
    // Sinks: a webhook to the drill's receiver, and JetStream.
    std::env::set_var("STRATA_SINK_SECRET_REGION", "region-drill");
    let hook = Arc::new(check::Received::default());
    let hook_url = receiver(hook.clone())?;
    let filter = |prefix: &str| sinks::Filter {
        types: vec![],
        prefixes: vec![prefix.into()],
    };
    sinks::config::create(
        &appender,
        &sinks::SinkConfig {
            name: HOOK_SINK.into(),
            target: sinks::Target::Webhook {
                url: hook_url,
                secret_env: "STRATA_SINK_SECRET_REGION".into(),
            },
            filter: filter(HOOK_PREFIX),
            start: "start".into(),
            batch_max: 1000,
            max_attempts: 100,
            retry: None,
            credentials: false,
        },
    )
    .await?;
    let (nats, js) = match nats(dir.path()).await? {
        Some((child, nats_url)) => {
            let mut js = async_nats::jetstream::new(async_nats::connect(&nats_url).await?);
            // The checker's requests are answered by a server that shares
            // two cores with the region: not within the default 5 s.
            js.set_timeout(CHECK_STATEMENT_TIMEOUT);
            js.create_stream(async_nats::jetstream::stream::Config {
                name: JS_STREAM.into(),
                subjects: vec!["region.>".into()],
                duplicate_window: Duration::from_secs(3600),
                ..Default::default()
            })
            .await?;
            sinks::config::create(
                &appender,
                &sinks::SinkConfig {
                    name: JS_SINK.into(),
                    target: sinks::Target::Nats {
                        url: nats_url,
                        subject_prefix: "region".into(),
                    },
                    filter: filter(JS_PREFIX),
                    start: "start".into(),
                    batch_max: 1000,
                    max_attempts: 100,
                    retry: None,
                    credentials: false,
                },
            )
            .await?;
            (Some(child), Some(js))
        }
        None => (None, None),
    };
    // The roles.
    let launch = Launch {
        strata: std::fs::canonicalize(&o.strata)
            .with_context(|| format!("the strata binary {}", o.strata.display()))?,
        url,
        dir: dir.path().to_path_buf(),
    };
    let ca_arg = ca.display().to_string();
    let mut roles = Vec::new();
    let lost_after = format!("{}s", o.node_lost_after.as_secs());
    let share_sock = dir.path().join("log.sock").display().to_string();
    let role = |name: &str, args: &[&str]| {
        let mut a: Vec<String> = vec![
            "--slot".into(),
            format!("region_{}", name.replace('-', "_")),
            "--holder".into(),
            name.into(),
            "--subscription-lease-ttl".into(),
            "5s".into(),
        ];
        a.extend(args.iter().map(|s| s.to_string()));
        let mut r = Role::new(name, a, dir.path());
        if r.runs("placer") {
            r.args_push(&["--node-lost-after", &lost_after]);
        }
        if o.log_share {
            let flag = if r.runs("maintenance") {
                "--log-share"
            } else {
                "--log-from"
            };
            r.args_push(&[flag, &share_sock]);
        }
        r
    };
    // With network faults, a gateway and a placer each in a namespace.
    let (gw_ns, placer_ns) = if o.network() {
        (
            Some(Arc::new(net::Netns::create(1)?)),
            Some(Arc::new(net::Netns::create(2)?)),
        )
    } else {
        (None, None)
    };
    if !o.shared {
        roles.push(role("maintenance", &["--roles", "maintenance"]));
    }
    for i in 1..=3 {
        let ns = gw_ns.clone().filter(|_| i == 1);
        let host = ns
            .as_ref()
            .map_or("127.0.0.1".to_string(), |n| n.role_ip.clone());
        let listen = format!("{host}:{}", procs::free_port()?);
        let mut r = role(
            &format!("gw-{i}"),
            &[
                "--roles",
                "gateway",
                "--listen",
                &listen,
                "--gateway-id",
                &format!("gw-{i}"),
                "--ca-dir",
                &ca_arg,
            ],
        );
        r.listen = Some(listen);
        r.netns = ns;
        roles.push(r);
    }
    let audit = format!("127.0.0.1:{}", procs::free_port()?);
    let audit_args = ["--audit-listen", &audit, "--ca-dir", &ca_arg];
    if o.shared {
        // Two processes run the other roles, each with one slot.
        let mut core = vec!["--roles", "placer,binder,sinks,audit,maintenance,usage"];
        core.extend(audit_args);
        roles.push(role("core-1", &core));
        roles.push(role("core-2", &["--roles", "placer,binder,usage"]));
    } else {
        for i in 1..=2 {
            roles.push(role(&format!("placer-{i}"), &["--roles", "placer"]));
        }
        for i in 1..=2 {
            // The usage rollups ride on the binders' readers: killing a
            // binder hands them on too.
            roles.push(role(&format!("binder-{i}"), &["--roles", "binder,usage"]));
        }
        roles.push(role("sinks", &["--roles", "sinks"]));
        let mut a = vec!["--roles", "audit"];
        a.extend(audit_args);
        roles.push(role("audit", &a));
    }
    if let Some(ns) = placer_ns {
        let name = if o.shared { "core-2" } else { "placer-1" };
        if let Some(r) = roles.iter_mut().find(|r| r.name == name) {
            r.netns = Some(ns);
        }
    }
    for r in &mut roles {
        r.start(&launch)?;
    }
    for r in &roles {
        if let Some(l) = &r.listen {
            procs::wait_listening(l, Duration::from_secs(60))
                .await
                .with_context(|| format!("{} did not start", r.name))?;
        }
    }
    procs::wait_listening(&audit, Duration::from_secs(60))
        .await
        .context("the audit endpoint did not start")?;
    for r in &mut roles {
        r.check_alive()?;
    }
    eprintln!(
        "region up: {} roles; issuing {} join tokens ...",
        roles.len(),
        o.nodes
    );
    let nodes_dir = nodes_dir()?;
    let mut fleet = fleet::Fleet::provision(
        &client,
        o.nodes,
        &pools,
        nodes_dir.path(),
        ca_pem,
        o.fleet_nice,
    )
    .await?;
    fleet.set_gateways(
        roles
            .iter()
            .filter_map(|r| r.listen.as_ref().map(|l| format!("https://{l}")))
            .collect(),
    );
    Ok(Region {
        cluster,
        standby_port,
        cfg,
        launch,
        roles,
        fleet,
        appender,
        pools,
        hook,
        js,
        probe_on_node_s: Default::default(),
        nats,
        _dir: dir,
        _nodes_dir: nodes_dir,
    })
}

/// Where the simulated nodes keep their data dirs (certificates, command
/// logs, bindings and CDI specs, each write synced): on tmpfs where there
/// is one. A real node syncs to a disk of its own; 10,000 nodes syncing
/// (six times for each command) on the disk PostgreSQL commits to would
/// measure that disk, not the region.
fn nodes_dir() -> Result<tempfile::TempDir> {
    let shm = std::path::Path::new(FLEET_TMPFS);
    let b = tempfile::Builder::new()
        .prefix("strata-region-nodes-")
        .clone();
    Ok(if shm.is_dir() {
        b.tempdir_in(shm)?
    } else {
        b.tempdir()?
    })
}

/// The tmpfs the simulated nodes' data dirs go to, where it exists.
const FLEET_TMPFS: &str = "/dev/shm";

/// Runs the whole drill and returns its result (one JSON object).
pub async fn drill(o: Options) -> Result<serde_json::Value> {
    let mut r = start(&o).await?;
    let client = r.client().await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    let mut all_violations: Vec<serde_json::Value> = Vec::new();
    let mut scenarios = serde_json::Map::new();

    // Cold start.
    let cold = scenarios::cold_start(&mut r, &o).await?;
    eprintln!("cold start: {cold}");
    scenarios.insert("cold_start".into(), cold.clone());

    // Steady load, measured.
    let mut load = Load::start(r.appender.clone(), &r.fleet, r.pools.clone(), o.rates);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let steady = scenarios::steady(&mut r, &load, &o).await?;
    eprintln!("steady: {steady}");

    // Faults, each followed by the checker. The load keeps running.
    type Fault = for<'a> fn(
        &'a mut Region,
        &'a Options,
    ) -> futures_util::future::BoxFuture<'a, Result<serde_json::Value>>;
    let faults: Vec<(&str, Fault)> = vec![
        ("power_cycle", |r, o| Box::pin(scenarios::power_cycle(r, o))),
        ("gateway_kill", |r, o| {
            Box::pin(scenarios::gateway_kill(r, o))
        }),
        ("rack_power_loss", |r, o| {
            Box::pin(partitions::rack_power_loss(r, o))
        }),
        ("placer_kill", |r, o| Box::pin(scenarios::placer_kill(r, o))),
        ("binder_kill", |r, o| Box::pin(scenarios::binder_kill(r, o))),
        ("sinks_kill", |r, o| Box::pin(scenarios::sinks_kill(r, o))),
        ("maintenance_kill", |r, o| {
            Box::pin(scenarios::maintenance_kill(r, o))
        }),
        ("postgres_crash", |r, o| {
            Box::pin(scenarios::postgres_crash(r, o))
        }),
        ("walsenders_terminated", |r, o| {
            Box::pin(scenarios::walsenders(r, o))
        }),
        ("slot_dropped", |r, o| Box::pin(scenarios::slot_drop(r, o))),
        ("gateway_cut_from_postgres", |r, o| {
            Box::pin(partitions::gateway_cut_from_postgres(r, o))
        }),
        ("rack_cut_from_gateway", |r, o| {
            Box::pin(partitions::rack_cut_from_gateway(r, o))
        }),
        ("placer_cut_from_postgres", |r, o| {
            Box::pin(partitions::placer_cut_from_postgres(r, o))
        }),
        ("lossy_links", |r, o| {
            Box::pin(partitions::lossy_links(r, o))
        }),
        ("standby_promoted", |r, o| {
            Box::pin(scenarios::standby_promoted(r, o))
        }),
    ];
    for (name, fault) in faults.into_iter().filter(|(n, _)| o.faults.contains(n)) {
        eprintln!("scenario {name} ...");
        let redelivered_before = r.hook.redelivered();
        r.probe_on_node_s.lock().expect("probe lock").take();
        let mut s = fault(&mut r, &o).await?;
        // The probe's trip less its time on its simulated node, which
        // shares the cores with 10,000 others (a real node has its own).
        if let (Some(on_node), Some(took)) = (
            r.probe_on_node_s.lock().expect("probe lock").take(),
            s.get("recovery_s").and_then(|x| x.as_f64()),
        ) {
            s["probe_on_node_s"] = on_node.into();
            s["recovery_less_node_s"] = crate::util::round((took - on_node).max(0.0), 2).into();
        }
        // The checker reads the whole log; the offer pauses while it does
        // (on two cores it would otherwise compete with the load for them).
        load.pause(true);
        let acked = load.stats.acked.lock().expect("acked").clone();
        let c = r.client().await?;
        let (_, mut v) = check::log(&c, &acked).await?;
        v.extend(check::sinks(&c, &r.hook, r.js.as_ref(), Duration::from_secs(120)).await?);
        s["violations"] = v.len().into();
        // Events the webhook received twice because of the fault (allowed:
        // delivery is at least once; JetStream's are checked stored once).
        s["webhook_redeliveries"] = (r.hook.redelivered() - redelivered_before).into();
        for x in &v {
            eprintln!(
                "  violation after {name}: {} {:?}: {}",
                x.invariant, x.positions, x.detail
            );
            all_violations.push(serde_json::json!({"after": name, "violation": x}));
        }
        eprintln!("  {name}: {s}");
        scenarios.insert(name.into(), s);
        r.check_alive()?;
        load.pause(false);
    }

    // The end: stop offering, let the region settle, check everything.
    load.stop().await;
    eprintln!("final check ...");
    let c = r.client().await?;
    let acked = load.stats.acked.lock().expect("acked").clone();
    let (events, mut v) = check::log(&c, &acked).await?;
    v.extend(check::bound(&c, &r.fleet, o.patience.min(Duration::from_secs(120))).await?);
    let (run_twice, twice) = check::commands_run_twice(&r.fleet);
    v.extend(twice);
    v.extend(check::sinks(&c, &r.hook, r.js.as_ref(), Duration::from_secs(120)).await?);
    let mut uc = r.client().await?;
    v.extend(check::usage(&r.cfg, &mut uc, Duration::from_secs(120)).await?);
    let jetstream = r.js.is_some();
    for x in &v {
        eprintln!(
            "  violation at the end: {} {:?}: {}",
            x.invariant, x.positions, x.detail
        );
        all_violations.push(serde_json::json!({"after": "end", "violation": x}));
    }
    if !all_violations.is_empty() {
        procs::tell_warnings(&r.roles, 40);
    }
    r.fleet.stop().await;
    for role in &mut r.roles {
        role.stop().await;
    }
    if let Some(mut n) = r.nats.take() {
        let _ = n.kill().await;
    }

    let recovery: serde_json::Map<String, serde_json::Value> = scenarios
        .iter()
        .filter_map(|(k, s)| s.get("recovery_s").map(|x| (k.clone(), x.clone())))
        .collect();
    // Beside it, each probe's trip less its time on its simulated node
    // (not a target: the node's own time counts in `recovery_s`).
    let less_node: serde_json::Map<String, serde_json::Value> = scenarios
        .iter()
        .filter_map(|(k, s)| {
            s.get("recovery_less_node_s")
                .map(|x| (k.clone(), x.clone()))
        })
        .collect();
    let worst_recovery = recovery
        .values()
        .map(|x| x.as_f64().unwrap_or(f64::INFINITY))
        .fold(0.0, f64::max);
    let g = &scenarios
        .get("gateway_kill")
        .cloned()
        .unwrap_or(serde_json::Value::Null);
    // A target whose fault was left out is not measured (null), not missed.
    let measured = |yes: bool, met: bool| {
        if yes {
            serde_json::Value::from(met)
        } else {
            serde_json::Value::Null
        }
    };
    let killed_gateway = !g.is_null();
    let cold_all = cold["all_schedulable_s"].as_f64().unwrap_or(f64::INFINITY);
    let rehome_p99 = g["rehome_p99_s"].as_f64().unwrap_or(f64::INFINITY);
    let false_unreachable = g["false_unreachable"].as_u64().unwrap_or(u64::MAX);
    let pg_share = steady["postgres_cpu_share"]
        .as_f64()
        .unwrap_or(f64::INFINITY);
    let violations = all_violations.len();
    Ok(serde_json::json!({
        "bench": "region",
        "nodes": o.nodes,
        "gpus": o.nodes * 8,
        "pools": o.pools,
        "machine": util::machine(&pg_version),
        "processes": if o.shared {
            "3 gateways, each `strata serve --roles gateway`; `--roles placer,binder,sinks,audit,maintenance` and `--roles placer,binder`; the simulated daemons and the load generator in the bench process; PostgreSQL and nats-server; all on the same cores"
        } else {
            "3 gateways, 2 placers, 2 binders, sinks, maintenance, audit: each `strata serve --roles <one>`; the simulated daemons and the load generator in the bench process; PostgreSQL and nats-server; all on the same cores"
        },
        "shared_processes": o.shared,
        "log_share": o.log_share,
        "fleet_nice": o.fleet_nice,
        "postgres_settings": o.pg_settings.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
        "nodes_data": if std::path::Path::new(FLEET_TMPFS).is_dir() {
            "the simulated nodes' data dirs on tmpfs (a real node syncs to a disk of its own)"
        } else {
            "the simulated nodes' data dirs on the disk PostgreSQL commits to"
        },
        "faults": o.faults,
        "offered": {
            "placements_per_s": o.rates.placements,
            "commands_per_s": o.rates.commands,
            "drift_changes_per_s": o.rates.drift,
        },
        "cold_start_all_schedulable_s": cold["all_schedulable_s"],
        "cold_start_connected_p99_s": cold["connected_p99_s"],
        "gateway_kill_rehome_p99_s": g["rehome_p99_s"],
        "gateway_restart_spread_back_s": g["spread_back_s"],
        "false_unreachable": g["false_unreachable"],
        "commands_run_twice": run_twice,
        "postgres_cpu_share_steady": steady["postgres_cpu_share"],
        "recovery_s": recovery,
        "recovery_less_node_s": less_node,
        "violations": violations,
        "violation_list": all_violations,
        "events_in_log": events,
        "jetstream_checked": jetstream,
        "webhook_redeliveries": r.hook.redelivered(),
        "steady": steady,
        "scenarios": scenarios,
        "targets": {
            "cold_start_all_schedulable_s": "< 60",
            "gateway_kill_rehome_p99_s": "< 30",
            "false_unreachable": "0",
            "commands_run_twice": "0",
            "postgres_cpu_share_steady": "< 0.5",
            "recovery_s": "< 10 each",
            "violations": "0",
        },
        "met": {
            "cold_start_all_schedulable_s": cold_all < 60.0,
            "gateway_kill_rehome_p99_s": measured(killed_gateway, rehome_p99 < 30.0),
            "false_unreachable": measured(killed_gateway, false_unreachable == 0),
            "commands_run_twice": run_twice == 0,
            "postgres_cpu_share_steady": pg_share < 0.5,
            "recovery_s": measured(!recovery.is_empty(), worst_recovery < 10.0),
            "violations": violations == 0,
        },
        "recorded_at_unix": SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    }))
}
