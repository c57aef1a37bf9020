//! The `bench` command line: one subcommand per scenario of the library
//! (`lib.rs`).

use bench::{
    append, audit, console, gateway, hostile, lifecycle, node_path, placements, region, replay,
    sinks, stalls, usage,
};

use clap::{Parser, Subcommand};

/// mimalloc: the index and its snapshots allocate many small strings, which
/// it serves markedly faster than the system allocator. The `system-alloc`
/// feature leaves it out, for heap profilers that follow `malloc`.
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "bench",
    about = "Strata's load generators and measured scenarios"
)]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand, Debug)]
enum Scenario {
    /// Append throughput and latency, end-to-end lag, and decode throughput
    Append(append::Args),
    /// Reservations placed end to end: throughput, latency, index build and snapshot load, invariants
    Placements(placements::Args),
    /// Node sessions through one gateway process: ramp, dispatch latency, RSS, CPU, drops
    Gateway(gateway::GatewayArgs),
    /// Reservations from requested to active through placer, binder, gateway and daemons
    Spine(gateway::SpineArgs),
    /// Placement under faults: dead, revoked and drained nodes, a PostgreSQL crash, a binder SIGKILLed
    Lifecycle(lifecycle::Args),
    /// The node's end: bind to CDI-visible at 1,000 nodes, and an injected XID to its GPU's quarantine and its reservation's end
    Node(node_path::Args),
    /// (internal) the binder process of `lifecycle`
    #[command(hide = true)]
    BinderServer(lifecycle::BinderArgs),
    /// (internal) the gateway process of `gateway` and `spine`
    #[command(hide = true)]
    GatewayServer(gateway::ServerArgs),
    /// (internal) the hostile connections of `gateway`
    #[command(hide = true)]
    GatewayFlood(hostile::FloodArgs),
    /// (internal) the stalled RPCs and bad joins of `gateway`
    #[command(hide = true)]
    GatewayStalls(stalls::StallArgs),
    /// Statements per second through the audit endpoint against PostgreSQL directly (pgbench, select-only)
    Audit(audit::Args),
    /// Events delivered to webhook and NATS JetStream sinks: rate, latency, WAL, CPU of 10 sinks vs 1
    Sinks(sinks::Args),
    /// Rebuilding the pool index from history: from PostgreSQL against COPY binary of the same rows, and from archives
    Replay(replay::Args),
    /// Usage reports from the rollups and the rollups recomputed from a month's log, against COPY of the same rows
    Usage(usage::Args),
    /// A whole region as separate processes (3 gateways, 2 placers, 2 binders, sinks, maintenance, audit) and simulated nodes: cold start, steady load, faults, and the invariant checker after each
    Region(region::Args),
    /// The web console watched: 100 live streams on a 10,000-node pool placed into at 1,000/s; delay from commit to client, the pool page's time, the console's CPU and RSS
    Console(console::Args),
    /// (internal) the console process of `console`
    #[command(hide = true)]
    ConsoleServer(console::ServerArgs),
    /// (internal) the sinks process of `sinks`
    #[command(hide = true)]
    SinksServer(sinks::ServerArgs),
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cli.scenario {
            Scenario::Append(a) => append::run(a).await,
            Scenario::Placements(a) => placements::run(a).await,
            Scenario::Gateway(a) => gateway::run_gateway(a).await,
            Scenario::Spine(a) => gateway::run_spine(a).await,
            Scenario::GatewayServer(a) => gateway::server(a).await,
            Scenario::GatewayFlood(a) => hostile::flood(a).await,
            Scenario::GatewayStalls(a) => stalls::stalls(a).await,
            Scenario::Lifecycle(a) => lifecycle::run(a).await,
            Scenario::Node(a) => node_path::run(a).await,
            Scenario::BinderServer(a) => lifecycle::binder_server(a).await,
            Scenario::Sinks(a) => sinks::run(a).await,
            Scenario::SinksServer(a) => sinks::server(a).await,
            Scenario::Replay(a) => replay::run(a).await,
            Scenario::Usage(a) => usage::run(a).await,
            Scenario::Audit(a) => audit::run(a).await,
            Scenario::Region(a) => region::run(a).await,
            Scenario::Console(a) => console::run(a).await,
            Scenario::ConsoleServer(a) => console::server(a).await,
        }
    })
}
