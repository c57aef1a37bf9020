//! `strata node` (the node daemon) and `strata fleet` (many simulated
//! daemons in one process).

use crate::cli::connect;
use crate::cli::hostname;
use crate::cli::DbArgs;
use anyhow::Context;
use anyhow::Result;
use clap::Args;
use domain::Tier;
use node::daemon;
use node::daemon::DaemonConfig;
use node::daemon::DaemonStats;
use node::gpu::FakeGpus;
use node::gpu::GpuBackend;
use node::gpu::NvmlGpus;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub(crate) struct NodeArgs {
    /// Gateway addresses, e.g. https://gw1:7443 (comma-separated or repeated): the node starts at its home among them (chosen by its id, the same on every start), tries the others in turn when a session ends, and moves back home once it is up
    #[arg(long, value_delimiter = ',', required = true)]
    pub gateway: Vec<String>,
    /// Where the node keeps its key, certificate and command log
    #[arg(long, default_value = "node-data")]
    pub data_dir: PathBuf,
    /// The node's id (default: the host name)
    #[arg(long)]
    pub node_id: Option<String>,
    /// A one-time join token (first start only)
    #[arg(long, env = "STRATA_JOIN_TOKEN")]
    pub token: Option<String>,
    /// The region's CA certificate (first start only)
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// Where the CDI specs of the node's bindings go, for container runtimes (Podman, Docker 25+, containerd with CDI on) to read: run a container on a reservation with `--device strata.dev/reservation=<id>` [default: /var/run/cdi; with --fake-gpus, <data-dir>/cdi]
    #[arg(long, env = "STRATA_CDI_DIR")]
    pub cdi_dir: Option<PathBuf>,
    /// Simulated GPUs instead of NVML, e.g. 8xH100-80GB; with MIG instances,
    /// 8xH100-80GB:mig=1g.10gb*7 (every GPU) or ...:mig=3g.40gb,2g.20gb*2@0-1
    /// (GPUs 0 and 1). A layout `strata nodes mig` gives is kept in the data dir
    #[arg(long)]
    pub fake_gpus: Option<String>,
    /// With --fake-gpus: the device on this machine that stands in for every simulated GPU's device node (/dev/nvidia0, /dev/nvidiactl, ...) in the CDI specs
    #[arg(long, default_value = node::gpu::FAKE_DEVICE_NODE)]
    pub fake_device_node: String,
    /// The name the gateways' certificates carry
    #[arg(long, default_value = "localhost")]
    pub tls_name: String,
    /// With --fake-gpus: how long diag.nvml takes (drills of commands in flight)
    #[arg(long, value_parser = humantime::parse_duration)]
    pub fake_diag_delay: Option<std::time::Duration>,
    /// Away from its home gateway (one of --gateway chosen by its id), how often on average it looks whether home is back and moves to it (0s: never)
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub return_home: std::time::Duration,
    /// The node's rack, reported to its pool as its topology (with --block and --rail; give none and an operator's `strata nodes topology` stands; a change is reported when the daemon starts with it)
    #[arg(long, env = "STRATA_RACK")]
    pub rack: Option<String>,
    /// The node's block: a spine block of racks, or an NVL72 rack's NVLink domain
    #[arg(long, env = "STRATA_BLOCK")]
    pub block: Option<String>,
    /// The node's rail group: the nodes whose NICs share one set of rail switches
    #[arg(long, env = "STRATA_RAIL")]
    pub rail: Option<String>,
    /// How often the acceptance check runs again (it runs whenever the daemon starts; its result goes to the pool, and a node or GPU that fails it takes no work until one passes; 0s: never again)
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    pub recheck_every: std::time::Duration,
    /// The level of `dcgmi diag` in the acceptance check where DCGM is installed (1: quick, 2: medium, 3: long, 4: extended; 0: never run), unless the pool sets one (`strata pool policy --dcgm-level`) [default: 1; with --fake-gpus 0, whose GPUs are not the machine's]
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=4))]
    pub dcgm_level: Option<u32>,
}

/// `strata fault`: what to inject, and where.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["xid", "ecc", "condition", "diag"])))]
pub(crate) struct FaultArgs {
    /// The simulated daemon's data dir (its --data-dir)
    #[arg(long)]
    pub data_dir: PathBuf,
    /// The GPU: its index (3) or id; absent: the whole node
    #[arg(long)]
    pub gpu: Option<String>,
    /// An XID error, e.g. 48 (a double-bit ECC error), 79 (fallen off the bus), 13 (an application's fault)
    #[arg(long)]
    pub xid: Option<u32>,
    /// An uncorrected ECC error, as NVML's counters report it (ECC-uncorrected)
    #[arg(long)]
    pub ecc: bool,
    /// Any condition by name, e.g. NVML-unavailable
    #[arg(long)]
    pub condition: Option<String>,
    /// The GPU's diagnostic (diag.nvml, the acceptance check) fails or passes from now on
    #[arg(long, value_parser = ["fail", "pass"])]
    pub diag: Option<String>,
    /// Clear the condition instead of raising it
    #[arg(long)]
    pub clear: bool,
    /// Free text carried with the condition, or why the diagnostic fails
    #[arg(long, default_value = "injected by strata fault")]
    pub detail: String,
}

#[derive(Args, Debug)]
pub(crate) struct FleetArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// How many daemons
    #[arg(long)]
    pub nodes: u32,
    /// Gateway addresses (comma-separated or repeated)
    #[arg(long, value_delimiter = ',', required = true)]
    pub gateway: Vec<String>,
    /// The pool the nodes join (one token each is issued)
    #[arg(long)]
    pub pool: String,
    /// The region's CA certificate
    #[arg(long)]
    pub ca: PathBuf,
    /// Where each node keeps its files (one folder per node)
    #[arg(long, default_value = "fleet-data")]
    pub data_dir: PathBuf,
    /// Node ids are this prefix and a number
    #[arg(long, default_value = "fleet-n")]
    pub prefix: String,
    /// GPUs per node (MIG instances as in `strata node --fake-gpus`)
    #[arg(long, default_value = "8xH100-80GB")]
    pub fake_gpus: String,
    #[arg(long, default_value = "localhost")]
    pub tls_name: String,
    /// Stop after this long
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<std::time::Duration>,
    /// Let `strata fault --data-dir <data-dir>/<node>` inject faults into the daemons (a thread per node looks for them)
    #[arg(long)]
    pub faults: bool,
}

/// `strata fault`: writes the fault into the daemon's fault folder, where
/// its fake device set takes it within a fraction of a second.
pub(crate) fn fault(args: FaultArgs) -> Result<ExitCode> {
    use node::faults::{Fault, What};
    if !args.data_dir.join("commands.log").exists() && !args.data_dir.join("node.pem").exists() {
        anyhow::bail!(
            "{} is not a node daemon's data dir (no node.pem or commands.log in it)",
            args.data_dir.display()
        );
    }
    let condition = match (&args.xid, args.ecc, &args.condition) {
        (Some(x), _, _) => Some(format!("XID-{x}")),
        (_, true, _) => Some("ECC-uncorrected".to_string()),
        (_, _, Some(c)) => Some(c.clone()),
        _ => None,
    };
    let what = match (condition, args.diag.as_deref()) {
        (Some(condition), _) if args.clear => What::Clear { condition },
        (Some(condition), _) => What::Raise {
            condition,
            detail: args.detail.clone(),
        },
        (None, Some("fail")) => What::DiagnosticFails {
            reason: args.detail.clone(),
        },
        _ => What::DiagnosticPasses,
    };
    let fault = Fault {
        gpu: args.gpu.clone(),
        what,
    };
    let path = node::faults::inject(&args.data_dir, &fault)
        .with_context(|| format!("write into {}", args.data_dir.display()))?;
    if crate::exit::json() {
        crate::exit::print_json(&serde_json::json!({"fault": fault, "file": path}));
    } else {
        println!(
            "injected {} on {}; the daemon (started with --fake-gpus) takes it within a second",
            serde_json::to_string(&fault.what).unwrap_or_default(),
            args.gpu
                .as_deref()
                .map_or("the node".to_string(), |g| format!("GPU {g}"))
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn host_name() -> String {
    hostname().unwrap_or_else(|| "node".into())
}

pub(crate) async fn node(args: NodeArgs) -> Result<ExitCode> {
    let node_id = args.node_id.clone().unwrap_or_else(host_name);
    let backend: Arc<dyn GpuBackend> = match &args.fake_gpus {
        Some(spec) => {
            let mut f = FakeGpus::parse(spec, &node_id)?
                .with_stand_in(&args.fake_device_node)?
                .with_data_dir(&args.data_dir);
            f.diag_delay = args.fake_diag_delay.unwrap_or_default();
            Arc::new(f)
        }
        None => Arc::new(NvmlGpus::open(&node_id).context(
            "read the GPUs through NVML (no NVIDIA driver here? use --fake-gpus 8xH100-80GB)",
        )?),
    };
    tracing::info!(node = %node_id, backend = backend.name(), "node daemon starting");
    let mut c = DaemonConfig::new(args.gateway.clone(), &args.data_dir, &node_id, backend);
    c.server_name = args.tls_name.clone();
    // A simulated node keeps its specs to itself unless told otherwise:
    // several may share a machine, and they need not be root.
    c.cdi_dir = match (&args.cdi_dir, &args.fake_gpus) {
        (Some(dir), _) => dir.clone(),
        (None, Some(_)) => args.data_dir.join("cdi"),
        (None, None) => PathBuf::from(node::cdi::DEFAULT_DIR),
    };
    c.recheck = args.recheck_every;
    c.dcgm_level = args
        .dcgm_level
        .unwrap_or(if args.fake_gpus.is_some() { 0 } else { 1 });
    c.return_home = args.return_home;
    c.token = args.token.clone();
    for (tier, label) in [
        (Tier::Rack, &args.rack),
        (Tier::Block, &args.block),
        (Tier::Rail, &args.rail),
    ] {
        if let Some(v) = label {
            domain::valid_name(tier.name(), v).map_err(anyhow::Error::msg)?;
            c.topology.insert(tier.name().to_string(), v.clone());
        }
    }
    c.ca_pem = match &args.ca {
        Some(p) => {
            Some(std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?)
        }
        None => None,
    };
    let stats = Arc::new(DaemonStats::default());
    let (stop, rx) = tokio::sync::watch::channel(false);
    let mut run = tokio::spawn(daemon::run(c, stats.clone(), rx));
    let result = tokio::select! {
        r = &mut run => r?,
        _ = shutdown_signal() => {
            let _ = stop.send(true);
            run.await?
        }
    };
    result?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

/// What a fleet of simulated daemons is.
pub(crate) struct FleetSpec<'a> {
    pub nodes: u32,
    pub gateways: &'a [String],
    pub pool: &'a str,
    pub ca_pem: &'a str,
    pub data_dir: &'a std::path::Path,
    pub prefix: &'a str,
    /// e.g. `8xH100-80GB`.
    pub gpus: &'a str,
    pub tls_name: &'a str,
    /// Whether each daemon takes faults from `strata fault` (a thread per
    /// node looks for them).
    pub faults: bool,
}

pub(crate) type Daemons = Vec<tokio::task::JoinHandle<Result<(), daemon::DaemonError>>>;

/// Starts the fleet's daemons; tokens are issued for those that have not
/// joined yet.
pub(crate) async fn start_fleet(
    client: &tokio_postgres::Client,
    spec: &FleetSpec<'_>,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Result<(Arc<DaemonStats>, Daemons)> {
    let FleetSpec {
        nodes: n,
        gateways,
        pool,
        ca_pem,
        data_dir,
        prefix,
        gpus: spec,
        tls_name,
        faults,
    } = *spec;
    let stats = Arc::new(DaemonStats::default());
    let mut tasks = Vec::with_capacity(n as usize);
    // One clock of the process's time for all its daemons: one ticker,
    // not one per node.
    let clock = ops::process_clock::ProcessClock::new(node::daemon::ANSWER_SLACK);
    for i in 0..n {
        let node_id = format!("{prefix}{i:05}");
        let mut backend = FakeGpus::parse(spec, &node_id)?;
        if faults {
            backend = backend.with_data_dir(&data_dir.join(&node_id));
        }
        let backend = Arc::new(backend);
        let mut c = DaemonConfig::new(
            gateways.to_vec(),
            data_dir.join(&node_id),
            &node_id,
            backend,
        );
        c.server_name = tls_name.to_string();
        c.clock = clock.clone();
        if !data_dir.join(&node_id).join("node.pem").exists() {
            c.token = Some(
                gateway::identity::create_token(client, pool, Duration::from_secs(3600), &node_id)
                    .await?,
            );
            c.ca_pem = Some(ca_pem.to_string());
        }
        tasks.push(tokio::spawn(daemon::run(c, stats.clone(), stop.clone())));
    }
    Ok((stats, tasks))
}

pub(crate) async fn fleet(args: FleetArgs) -> Result<ExitCode> {
    let client = connect(&args.db).await?;
    let ca_pem =
        std::fs::read_to_string(&args.ca).with_context(|| format!("read {}", args.ca.display()))?;
    let (stop, rx) = tokio::sync::watch::channel(false);
    let spec = FleetSpec {
        nodes: args.nodes,
        gateways: &args.gateway,
        pool: &args.pool,
        ca_pem: &ca_pem,
        data_dir: &args.data_dir,
        prefix: &args.prefix,
        gpus: &args.fake_gpus,
        tls_name: &args.tls_name,
        faults: args.faults,
    };
    let (stats, tasks) = start_fleet(&client, &spec, &rx).await?;
    let started = std::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = shutdown_signal() => break,
            _ = tick.tick() => {
                eprintln!(
                    "fleet: {} of {} connected, {} sessions opened, {} pushbacks, {} commands run",
                    stats.connected.load(Ordering::Relaxed),
                    args.nodes,
                    stats.sessions.load(Ordering::Relaxed),
                    stats.pushbacks.load(Ordering::Relaxed),
                    stats.commands_run.load(Ordering::Relaxed),
                );
                if args.duration.is_some_and(|d| started.elapsed() >= d) {
                    break;
                }
            }
        }
    }
    let _ = stop.send(true);
    for t in tasks {
        if let Ok(Err(e)) = t.await {
            eprintln!("a node stopped with: {e}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
