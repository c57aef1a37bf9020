//! The `strata` command line: parses arguments and calls into the crates.

mod commands;
mod dev;
mod placement;
mod telemetry;

use clap::{Args, Parser, Subcommand};

/// mimalloc: the index and its snapshots allocate many small strings, which
/// it serves markedly faster than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// Strata: a control plane for GPU fleets, event-sourced on PostgreSQL.
#[derive(Parser, Debug)]
#[command(name = "strata", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Debug, Clone)]
pub struct Db {
    /// PostgreSQL connection string, e.g. postgres://user@host:5432/strata
    #[arg(long, env = "STRATA_DATABASE_URL", value_name = "URL")]
    database_url: String,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run Strata on this machine with a private PostgreSQL under .strata/
    Dev(DevArgs),
    /// Run Strata's long-running services against a database
    Serve(ServeArgs),
    /// Apply the schema migrations the database does not have yet
    Migrate(DbOnly),
    /// Create and inspect the monthly partitions of the event table
    #[command(subcommand)]
    Partitions(PartitionsCmd),
    /// Append events and follow the log
    #[command(subcommand)]
    Events(EventsCmd),
    /// Inspect and remove replication slots
    #[command(subcommand)]
    Slots(SlotsCmd),
    /// Reserve GPUs: the request is placed by the placer holding the pool
    Reserve(ReserveArgs),
    /// Release a reservation (or cancel it, if it is not placed yet)
    Release {
        #[command(flatten)]
        db: Db,
        /// The reservation's id
        id: String,
        /// Why, recorded with the request
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// List pools with their nodes and free and booked GPUs by class
    Pools {
        #[command(flatten)]
        db: Db,
    },
    /// Create, seed and inspect one pool
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Replay the log
    #[command(subcommand)]
    Replay(ReplayCmd),
}

#[derive(Args, Debug)]
pub struct ReserveArgs {
    #[command(flatten)]
    pub db: Db,
    /// The pool to place in
    #[arg(long)]
    pub pool: String,
    /// The GPU class, e.g. H100-80GB
    #[arg(long)]
    pub class: String,
    /// GPUs in all (with --nodes, GPUs per node times nodes; may be omitted)
    #[arg(long)]
    pub gpus: Option<u32>,
    /// any: anywhere in the pool; node: all on one node; island: all in one NVLink island
    #[arg(long, value_parser = ["any", "node", "island"])]
    pub shape: Option<String>,
    /// A gang: this many nodes, all or nothing (with --gpus-per-node)
    #[arg(long, requires = "gpus_per_node")]
    pub nodes: Option<u32>,
    /// GPUs on each node of a gang
    #[arg(long, requires = "nodes")]
    pub gpus_per_node: Option<u32>,
    /// Higher places first within a batch
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i32,
    /// Release automatically this long after placement (e.g. 2h)
    #[arg(long, value_parser = humantime::parse_duration)]
    pub ttl: Option<std::time::Duration>,
    /// The reservation's id (generated when omitted)
    #[arg(long)]
    pub id: Option<String>,
    /// Wait for the placement (or the reason it cannot be placed) and print it
    #[arg(long)]
    pub wait: bool,
    /// Give up waiting after this long (the reservation stays queued)
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: std::time::Duration,
}

#[derive(Subcommand, Debug)]
pub enum PoolCmd {
    /// Create a pool
    Create {
        #[command(flatten)]
        db: Db,
        name: String,
        #[arg(long, default_value = "")]
        description: String,
    },
    /// Join simulated nodes to a pool (for demos and drills; real nodes join through the gateway)
    Seed {
        #[command(flatten)]
        db: Db,
        name: String,
        /// How many nodes
        #[arg(long)]
        nodes: u32,
        /// GPUs per node
        #[arg(long, default_value_t = 8)]
        gpus: u32,
        #[arg(long, default_value = "H100-80GB")]
        class: String,
        /// GPUs per NVLink island (0: no islands)
        #[arg(long, default_value_t = 8)]
        per_island: u32,
        /// Node names are this prefix and a number
        #[arg(long)]
        prefix: Option<String>,
    },
    /// Show a pool's nodes, free and booked GPUs, and what waits
    Show {
        #[command(flatten)]
        db: Db,
        name: String,
        /// List every node (default: a summary by free count)
        #[arg(long)]
        nodes: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum ReplayCmd {
    /// Replay the whole log and verify the placement invariants; exits non-zero at the first violation
    Check {
        #[command(flatten)]
        db: Db,
        /// Print the report as JSON
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
struct DbOnly {
    #[command(flatten)]
    db: Db,
}

#[derive(Args, Debug)]
pub struct DevArgs {
    /// Folder for the private cluster and its log
    #[arg(long, default_value = ".strata")]
    pub data_dir: PathBuf,
    /// Use this database instead of starting a private cluster
    #[arg(long, env = "STRATA_DATABASE_URL", value_name = "URL")]
    pub database_url: Option<String>,
    /// Events per second the demo writer appends
    #[arg(long, default_value_t = 200)]
    pub rate: u32,
    /// Nodes (8 GPUs each) in the demo pool, when it is first created
    #[arg(long, default_value_t = 64)]
    pub demo_nodes: u32,
    /// Reservations per second the demo workload asks for (0: none)
    #[arg(long, default_value_t = 20)]
    pub reservations_per_s: u32,
    /// Serve Prometheus metrics at this address
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub metrics_listen: SocketAddr,
    /// Stop by itself after this long (e.g. 30s); runs until Ctrl-C otherwise
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<std::time::Duration>,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub db: Db,
    /// Roles to run, comma-separated. maintenance: partitions ahead and the replication reader; placer: places reservations of the pools it leases
    #[arg(long, value_delimiter = ',', default_value = "maintenance")]
    pub roles: Vec<String>,
    /// Serve Prometheus metrics at this address
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Name of this process's replication slot (default strata_<host>; give each process on a host its own)
    #[arg(long)]
    pub slot: Option<String>,
    /// placer: most reservations planned in one batch
    #[arg(long, default_value_t = 1024)]
    pub max_batch: usize,
    /// placer: pool lease time to live; a dead placer's pools move after this
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: std::time::Duration,
    /// placer: only these pools (comma-separated; default all)
    #[arg(long, value_delimiter = ',')]
    pub pools: Vec<String>,
    /// placer: keep pool index snapshots here and start from the newest
    #[arg(long)]
    pub snapshot_dir: Option<PathBuf>,
    /// placer: name in pool leases (default host-pid-random)
    #[arg(long)]
    pub holder: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum PartitionsCmd {
    /// Create the partitions for this month and the months ahead
    Ensure {
        #[command(flatten)]
        db: Db,
        /// How many months past the current one to create
        #[arg(long, default_value_t = schema::partitions::DEFAULT_MONTHS_AHEAD)]
        months_ahead: i32,
    },
    /// List the partitions with their row counts and sizes
    List {
        #[command(flatten)]
        db: Db,
    },
}

#[derive(Subcommand, Debug)]
pub enum EventsCmd {
    /// Append one event to a stream
    Append {
        #[command(flatten)]
        db: Db,
        /// The stream, e.g. pool/p1
        #[arg(long)]
        stream: String,
        /// The event type, e.g. pool.created
        #[arg(long = "type")]
        event_type: String,
        /// The payload: a JSON object
        #[arg(long)]
        data: String,
        /// Expected stream version: a number (0 = new stream), `any`, or `exists`
        #[arg(long, default_value = "any")]
        expect: String,
    },
    /// Print events as JSON lines: history, then live
    Tail {
        #[command(flatten)]
        db: Db,
        /// Where to start: `start`, `now` or a position (ignored when a named subscription already exists)
        #[arg(long, default_value = "now")]
        from: String,
        /// A durable subscription: resumes after its last acknowledged event
        #[arg(long)]
        subscription: Option<String>,
        /// Exit after printing this many events
        #[arg(long)]
        limit: Option<u64>,
        /// How long a subscription held by a tail that died stays unavailable
        #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
        lease_ttl: std::time::Duration,
    },
}

#[derive(Subcommand, Debug)]
pub enum SlotsCmd {
    /// List replication slots with owner, lag and retained WAL
    List {
        #[command(flatten)]
        db: Db,
        /// Flag slots whose owner has not been seen for longer than this
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        stale_after: std::time::Duration,
    },
    /// Drop a replication slot
    Drop {
        #[command(flatten)]
        db: Db,
        /// The slot's name
        name: String,
        /// End the connection using it first
        #[arg(long)]
        force: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let long_running = matches!(cli.command, Command::Dev(_) | Command::Serve(_));
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The OTLP exporter runs on the runtime; the guard flushes it on drop,
    // before the runtime goes away.
    let telemetry = {
        let _entered = rt.enter();
        telemetry::init(long_running)
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Dev(args) => dev::run(args).await,
            Command::Serve(args) => commands::serve(args).await,
            Command::Migrate(a) => commands::migrate(&a.db).await,
            Command::Partitions(c) => commands::partitions(c).await,
            Command::Events(c) => commands::events(c).await,
            Command::Slots(c) => commands::slots(c).await,
            Command::Reserve(a) => placement::reserve(a).await,
            Command::Release { db, id, reason } => placement::release(&db, &id, &reason).await,
            Command::Pools { db } => placement::pools(&db).await,
            Command::Pool(c) => placement::pool(c).await,
            Command::Replay(c) => placement::replay(c).await,
        }
    });
    drop(telemetry);
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
