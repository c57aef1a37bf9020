//! The `strata` command line: parses arguments and dispatches each command
//! to its module under `cmd/`, which calls into the crates.

/// `println!` for every module of the binary: a closed stdout (`strata
/// nodes list | head`) ends a one-shot command quietly instead of
/// panicking (see [`exit::print_line`]).
macro_rules! println {
    () => {
        $crate::exit::print_line(format_args!(""))
    };
    ($($t:tt)*) => {
        $crate::exit::print_line(format_args!($($t)*))
    };
}

mod cli;
mod cmd;
mod config;
mod exit;
mod roles;
mod telemetry;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// mimalloc: the index and its snapshots allocate many small strings, which
/// it serves markedly faster than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Strata: a control plane for GPU fleets, event-sourced on PostgreSQL.
#[derive(Parser, Debug)]
#[command(name = "strata", version, propagate_version = true, after_help = exit::HELP)]
pub struct Cli {
    /// How list and show commands print: text (tables for people), json (one JSON object per line for lists, one object for a show) or csv (`usage report` only)
    #[arg(long, global = true, value_enum, default_value_t = cli::Output::Text, env = "STRATA_OUTPUT")]
    output: cli::Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run Strata on this machine with a private PostgreSQL under .strata/
    Dev(cmd::dev::DevArgs),
    /// Run Strata's long-running services against a database
    Serve(Box<roles::ServeArgs>),
    /// Apply the schema migrations the database does not have yet. Migrations expand the schema (older binaries keep running against it) or contract it (only binaries that know a given schema may run after it; applied once no running Strata process knows less). Exits 1 when a migration still waits
    Migrate(cmd::migrate::MigrateArgs),
    /// Create and inspect the monthly partitions of the event table
    #[command(subcommand)]
    Partitions(cmd::partitions::PartitionsCmd),
    /// Append events and follow the log
    #[command(subcommand)]
    Events(cmd::events::EventsCmd),
    /// Inspect and remove replication slots
    #[command(subcommand)]
    Slots(cmd::slots::SlotsCmd),
    /// Check a database for what Strata needs (wal_level, slots and senders, max_slot_wal_keep_size, the publication, partitions ahead, stale slots, TLS, a synchronous standby and its lag); prints each finding with what to do; exits 1 on a problem (warnings do not fail)
    Doctor {
        #[command(flatten)]
        db: cli::DbArgs,
        /// Print the findings as one JSON object: {"ok": bool, "problems": n, "warnings": n, "findings": [{check, status, detail, advice}]}
        #[arg(long)]
        json: bool,
        /// A slot not in use whose owner has not been seen for longer than this is stale
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        stale_after: std::time::Duration,
    },
    /// Reserve GPUs: the request is placed by the placer holding the pool
    #[command(after_help = exit::HELP)]
    Reserve(cmd::reserve::ReserveArgs),
    /// Release a reservation (or cancel it, if it is not placed yet)
    Release {
        #[command(flatten)]
        db: cli::DbArgs,
        /// The reservation's id
        id: String,
        /// Why, recorded with the request
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Reservations: where each stands, and why one waits
    #[command(subcommand)]
    Reservations(cmd::reservations::ReservationsCmd),
    /// Queues: teams' shares of a pool (quotas per GPU class, cohorts that lend unused quota, weights for fair sharing)
    #[command(subcommand)]
    Queues(cmd::queues::QueuesCmd),
    /// List pools with their nodes and free and booked GPUs by class
    Pools {
        #[command(flatten)]
        db: cli::DbArgs,
    },
    /// Who used what: GPU-hours by pool, queue, owner, class or node, and billing weights
    #[command(subcommand)]
    Usage(cmd::usage::UsageCmd),
    /// Create, seed and inspect one pool
    #[command(subcommand)]
    Pool(cmd::pools::PoolCmd),
    /// Replay the log
    #[command(subcommand)]
    Replay(cmd::replay::ReplayCmd),
    /// The region's node certificate authority
    #[command(subcommand)]
    Ca(cmd::ca::CaCmd),
    /// One-time join tokens for nodes
    #[command(subcommand)]
    Tokens(cmd::tokens::TokensCmd),
    /// Node identities: list, revoke
    #[command(subcommand)]
    Nodes(cmd::nodes::NodesCmd),
    /// Commands to nodes: issue, list, show
    #[command(subcommand)]
    Commands(cmd::commands::CommandsCmd),
    /// Run the node daemon: join, hold a session with a gateway, report GPUs, run commands
    Node(cmd::node::NodeArgs),
    /// Inject a fault into a running simulated node daemon (--fake-gpus): an XID, an ECC error, any condition, a failing diagnostic
    Fault(cmd::node::FaultArgs),
    /// Run many simulated node daemons in one process (each its own TLS connection and certificate)
    Fleet(cmd::node::FleetArgs),
    /// Sinks: deliver events to consumers' webhooks
    #[command(subcommand)]
    Sinks(cmd::sinks::SinksCmd),
    /// What an operator certificate may read through the API's Subscribe
    #[command(subcommand)]
    Grants(cmd::grants::GrantsCmd),
    /// What an operator may do through the client API: admin, operator (scoped to pools) or viewer
    #[command(subcommand)]
    Roles(cmd::roles::RolesCmd),
    /// The web console: sign a browser in with a one-time link, or sign an operator's browsers out
    #[command(subcommand)]
    Console(cmd::console::ConsoleCmd),
    /// Verify sealed history; manage the auditors of the audit endpoint
    #[command(subcommand)]
    Audit(cmd::audit::AuditCmd),
    /// Configuration files for `serve --config`
    #[command(subcommand)]
    Config(config::ConfigCmd),
}

fn main() -> ExitCode {
    let cli = match config::expand(std::env::args_os().collect()).and_then(config::Expanded::parse)
    {
        Ok(cli) => cli,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let long_running = matches!(
        cli.command,
        Command::Dev(_) | Command::Serve(_) | Command::Node(_) | Command::Fleet(_)
    );
    exit::one_shot(!long_running);
    exit::set_json(cli.output == cli::Output::Json);
    exit::set_csv(cli.output == cli::Output::Csv);
    if cli.output == cli::Output::Csv
        && !matches!(
            cli.command,
            Command::Usage(cmd::usage::UsageCmd::Report { .. })
        )
    {
        eprintln!("error: --output csv is for `strata usage report` only; use text or json");
        return ExitCode::from(2);
    }
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
    let log_file = match &cli.command {
        Command::Dev(args) => args.log_file(),
        _ => None,
    };
    let telemetry = {
        let _entered = rt.enter();
        telemetry::init(long_running, log_file.as_deref())
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Dev(args) => cmd::dev::run(args).await,
            Command::Serve(args) => cmd::serve::serve(*args).await,
            Command::Migrate(a) => cmd::migrate::migrate(&a).await,
            Command::Partitions(c) => cmd::partitions::partitions(c).await,
            Command::Events(c) => cmd::events::events(c).await,
            Command::Slots(c) => cmd::slots::slots(c).await,
            Command::Doctor {
                db,
                json,
                stale_after,
            } => cmd::doctor::doctor(&db, json, stale_after).await,
            Command::Reserve(a) => cmd::reserve::reserve(a).await,
            Command::Release { db, id, reason } => cmd::reserve::release(&db, &id, &reason).await,
            Command::Pools { db } => cmd::pools::pools(&db).await,
            Command::Reservations(c) => cmd::reservations::reservations(c).await,
            Command::Queues(c) => cmd::queues::queues(c).await,
            Command::Usage(c) => cmd::usage::usage(c).await,
            Command::Pool(c) => cmd::pools::pool(c).await,
            Command::Replay(c) => cmd::replay::replay(c).await,
            Command::Ca(c) => cmd::ca::ca(c).await,
            Command::Tokens(c) => cmd::tokens::tokens(c).await,
            Command::Nodes(c) => cmd::nodes::nodes(c).await,
            Command::Commands(c) => cmd::commands::commands(c).await,
            Command::Node(a) => cmd::node::node(a).await,
            Command::Fleet(a) => cmd::node::fleet(a).await,
            Command::Fault(a) => cmd::node::fault(a),
            Command::Sinks(c) => cmd::sinks::sinks(c).await,
            Command::Audit(cmd::audit::AuditCmd::Verify { db, month }) => {
                cmd::audit::audit_verify(&db, &month).await
            }
            Command::Audit(cmd::audit::AuditCmd::Users(c)) => cmd::audit::audit_users(c).await,
            Command::Grants(c) => cmd::grants::grants(c).await,
            Command::Roles(c) => cmd::roles::roles(c).await,
            Command::Console(c) => cmd::console::console(c).await,
            Command::Config(config::ConfigCmd::Check { file, json }) => {
                match config::check(&file, json) {
                    Ok(code) => Ok(code),
                    Err(e) => {
                        eprintln!("error: {e:#}");
                        Ok(ExitCode::from(2))
                    }
                }
            }
        }
    });
    drop(telemetry);
    match result {
        Ok(code) => code,
        // The reader of stdout went away: nothing to say, to nobody.
        Err(e) if exit::broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            exit::of(&e)
        }
    }
}
