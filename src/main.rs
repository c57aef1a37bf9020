//! The `strata` command line: parses arguments and calls into the crates.

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

mod catalog;
mod commands;
mod config;
mod dev;
mod exit;
mod nodes;
mod placement;
mod queues;
mod replay_cmd;
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
#[command(name = "strata", version, propagate_version = true, after_help = exit::HELP)]
pub struct Cli {
    /// How list and show commands print: text (tables for people) or json (one JSON object per line for lists, one object for a show)
    #[arg(long, global = true, value_enum, default_value_t = Output::Text, env = "STRATA_OUTPUT")]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Text,
    Json,
}

#[derive(Args, Debug, Clone)]
pub struct Db {
    /// PostgreSQL connection string as libpq reads it, e.g. postgres://user@host:5432/strata or 'host=db1,db2 dbname=strata target_session_attrs=read-write'. TLS: sslmode=disable|prefer (the default)|require|verify-ca|verify-full, sslrootcert=FILE (the CA to check the server against), sslcert=FILE and sslkey=FILE (a client certificate)
    #[arg(long, env = "STRATA_DATABASE_URL", value_name = "URL")]
    database_url: String,
    /// PostgreSQL itself, when --database-url goes through a connection pooler in transaction mode (PgBouncer): the replication stream, the migration lock, sealing's lock and the audit endpoint's logins connect here, and connections through the pooler keep no prepared statement or session setting past a transaction. Without it every connection uses --database-url
    #[arg(long, env = "STRATA_DATABASE_DIRECT_URL", value_name = "URL")]
    database_direct_url: Option<String>,
    /// How long one of Strata's statements may run before PostgreSQL cancels it (0: no limit); a statement stuck behind a lock then fails and is retried instead of hanging. Migrations, exports and seals run without it. Through a pooler it cannot be sent: set it for the role there (ALTER ROLE ... SET statement_timeout)
    #[arg(long, env = "STRATA_STATEMENT_TIMEOUT", value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    statement_timeout: std::time::Duration,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run Strata on this machine with a private PostgreSQL under .strata/
    Dev(DevArgs),
    /// Run Strata's long-running services against a database
    Serve(Box<ServeArgs>),
    /// Apply the schema migrations the database does not have yet. Migrations expand the schema (older binaries keep running against it) or contract it (only binaries that know a given schema may run after it; applied once no running Strata process knows less). Exits 1 when a migration still waits
    Migrate(MigrateArgs),
    /// Create and inspect the monthly partitions of the event table
    #[command(subcommand)]
    Partitions(PartitionsCmd),
    /// Append events and follow the log
    #[command(subcommand)]
    Events(EventsCmd),
    /// Inspect and remove replication slots
    #[command(subcommand)]
    Slots(SlotsCmd),
    /// Check a database for what Strata needs (wal_level, slots and senders, max_slot_wal_keep_size, the publication, partitions ahead, stale slots, TLS, a synchronous standby and its lag); prints each finding with what to do; exits 1 on a problem (warnings do not fail)
    Doctor {
        #[command(flatten)]
        db: Db,
        /// Print the findings as one JSON object: {"ok": bool, "problems": n, "warnings": n, "findings": [{check, status, detail, advice}]}
        #[arg(long)]
        json: bool,
        /// A slot not in use whose owner has not been seen for longer than this is stale
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        stale_after: std::time::Duration,
    },
    /// Reserve GPUs: the request is placed by the placer holding the pool
    #[command(after_help = exit::HELP)]
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
    /// Reservations: where each stands, and why one waits
    #[command(subcommand)]
    Reservations(ReservationsCmd),
    /// Queues: teams' shares of a pool (quotas per GPU class, cohorts that lend unused quota, weights for fair sharing)
    #[command(subcommand)]
    Queues(QueuesCmd),
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
    /// The region's node certificate authority
    #[command(subcommand)]
    Ca(CaCmd),
    /// One-time join tokens for nodes
    #[command(subcommand)]
    Tokens(TokensCmd),
    /// Node identities: list, revoke
    #[command(subcommand)]
    Nodes(NodesCmd),
    /// Commands to nodes: issue, list, show
    #[command(subcommand)]
    Commands(CommandsCmd),
    /// Run the node daemon: join, hold a session with a gateway, report GPUs, run commands
    Node(NodeArgs),
    /// Run many simulated node daemons in one process (each its own TLS connection and certificate)
    Fleet(FleetArgs),
    /// Sinks: deliver events to consumers' webhooks
    #[command(subcommand)]
    Sinks(SinksCmd),
    /// What an operator certificate may read through the API's Subscribe
    #[command(subcommand)]
    Grants(GrantsCmd),
    /// What an operator may do through the client API: admin, operator (scoped to pools) or viewer
    #[command(subcommand)]
    Roles(RolesCmd),
    /// Verify sealed history; manage the auditors of the audit endpoint
    #[command(subcommand)]
    Audit(AuditCmd),
    /// Configuration files for `serve --config`
    #[command(subcommand)]
    Config(ConfigCmd),
}

#[derive(Subcommand, Debug)]
pub enum QueuesCmd {
    /// Create a queue in a pool. Once a pool has a queue, it places only requests that name one (reserve --queue); each is admitted when its queue stays within its nominal quota, or borrows within its borrowing limit what its cohort leaves unused. Exit 6 if the pool does not exist
    Create {
        #[command(flatten)]
        db: Db,
        /// The queue's name (a team), unique within the pool
        name: String,
        /// The pool it shares
        #[arg(long)]
        pool: String,
        /// The cohort it lends its unused quota to and borrows from (none: it only uses its own)
        #[arg(long)]
        cohort: Option<String>,
        /// Its weight in fair sharing within the cohort (1 to 1000): weight 2 is served as if it held half of what it holds
        #[arg(long, default_value_t = 1)]
        weight: u32,
        /// Its nominal quota of a GPU class, CLASS=GPUS (repeat for more classes): guaranteed to it, lent to its cohort while unused
        #[arg(long, value_name = "CLASS=GPUS")]
        quota: Vec<String>,
        /// The most it may borrow of a class beyond its quota, CLASS=GPUS (default: whatever its cohort has unused)
        #[arg(long, value_name = "CLASS=GPUS")]
        borrowing_limit: Vec<String>,
    },
    /// Change a queue: only what is given changes. The change is appended at the pool's version it was read at, so concurrent changes are both kept; waiting requests are tried again under the new quota. Exit 6 if there is no such queue
    Set {
        #[command(flatten)]
        db: Db,
        name: String,
        #[arg(long)]
        pool: String,
        /// Move it to this cohort
        #[arg(long, conflicts_with = "no_cohort")]
        cohort: Option<String>,
        /// Take it out of its cohort: it neither lends nor borrows
        #[arg(long)]
        no_cohort: bool,
        #[arg(long)]
        weight: Option<u32>,
        /// Set the nominal quota of a class, CLASS=GPUS (repeatable)
        #[arg(long, value_name = "CLASS=GPUS")]
        quota: Vec<String>,
        /// Set the borrowing limit of a class, CLASS=GPUS, or CLASS=none for no limit (repeatable)
        #[arg(long, value_name = "CLASS=GPUS")]
        borrowing_limit: Vec<String>,
        /// Remove the quota of a class (repeatable)
        #[arg(long, value_name = "CLASS")]
        remove_quota: Vec<String>,
    },
    /// Every queue per class: its quota, what it holds, what its waiting requests ask for, and its fair share (the cohort's quota divided by weight among the queues that want it)
    List {
        #[command(flatten)]
        db: Db,
        /// Only this pool
        #[arg(long)]
        pool: Option<String>,
    },
    /// One queue: its spec, its waiting requests, its weighted dominant share, and per class what it holds against its quota and fair share. Exit 6 if there is no such queue
    Show {
        #[command(flatten)]
        db: Db,
        name: String,
        #[arg(long)]
        pool: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum ReservationsCmd {
    /// One reservation: its request, its phase, its devices once placed; while it waits, why (the placer's reason, how many requests are ahead of it in its pool, the GPUs they ask for) and its earliest start from the live reservations' expiries. Exit 6 if there is no such reservation
    Show {
        #[command(flatten)]
        db: Db,
        /// The reservation's id
        id: String,
    },
    /// Reservations waiting or live, in the order each pool's placer tries them
    List {
        #[command(flatten)]
        db: Db,
        /// Only this pool
        #[arg(long)]
        pool: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
pub enum ConfigCmd {
    /// Validate a configuration file as `serve --config FILE` reads it (with the STRATA_* variables set now), and print every setting with its value and where it came from (file, env, default); exits 2 on an unknown key or a bad value, naming both
    Check {
        /// The TOML file
        file: PathBuf,
        /// Print one JSON object: {"ok": true, "file": ..., "settings": {name: {"value": ..., "source": "file"|"env"|"default"}}}
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum AuditCmd {
    /// Recompute a sealed month and name the first altered, inserted or deleted row (exit 1 if any)
    Verify {
        #[command(flatten)]
        db: Db,
        /// The month, e.g. 2026-11
        month: String,
    },
    /// Auditors who may connect to the audit endpoint (`serve --roles audit`)
    #[command(subcommand)]
    Users(AuditUsersCmd),
}

#[derive(Subcommand, Debug)]
pub enum AuditUsersCmd {
    /// Add an auditor, or set a new password and lift a revocation
    Add {
        #[command(flatten)]
        db: Db,
        name: String,
        /// Read the password from standard input (one line); only its SCRAM-SHA-256 verifier is stored
        #[arg(long, conflicts_with = "certificate_only")]
        password_stdin: bool,
        /// No password: the auditor logs in with a certificate from `strata ca issue-auditor`
        #[arg(long)]
        certificate_only: bool,
    },
    /// List auditors
    List {
        #[command(flatten)]
        db: Db,
    },
    /// Refuse an auditor's new connections from now on
    Revoke {
        #[command(flatten)]
        db: Db,
        name: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum RolesCmd {
    /// Give an operator a role (replacing the one it had); recorded as an event on role/<name>
    Set {
        #[command(flatten)]
        db: Db,
        /// The operator name in its certificate (urn:strata:operator:<name>)
        operator: String,
        /// admin: everything; operator: reserve, release its own reservations, change nodes' standing and issue commands in its pools; viewer: read only
        #[arg(long)]
        role: String,
        /// The pools an operator acts in (comma-separated); only for --role operator
        #[arg(long, value_delimiter = ',')]
        pools: Vec<String>,
    },
    /// Every operator with a role
    List {
        #[command(flatten)]
        db: Db,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// Take an operator's role away (it may then do nothing through the API)
    Remove {
        #[command(flatten)]
        db: Db,
        operator: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum GrantsCmd {
    /// Set (replace) a caller's grant
    Set {
        #[command(flatten)]
        db: Db,
        /// The operator name in the caller's certificate
        caller: String,
        /// Stream prefixes it may read (comma-separated), e.g. pool/,reservation/
        #[arg(long, value_delimiter = ',', required = true)]
        prefixes: Vec<String>,
        /// Event types it may read (comma-separated; default all within the prefixes)
        #[arg(long, value_delimiter = ',')]
        types: Vec<String>,
    },
    /// List every caller's grant
    List {
        #[command(flatten)]
        db: Db,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// Remove a caller's grant: its Subscribe streams get nothing more (exit code 6 if it had none)
    Remove {
        #[command(flatten)]
        db: Db,
        caller: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum SinksCmd {
    /// Define a sink: a webhook (--webhook) or NATS JetStream (--nats); processes running the sinks role deliver it
    Create {
        #[command(flatten)]
        db: Db,
        name: String,
        /// A webhook: the receiver's URL (http:// or https://)
        #[arg(long, conflicts_with = "nats", requires = "secret_env")]
        webhook: Option<String>,
        /// The environment variable (in the sinks processes) holding the webhook's HMAC secret; its name must start with STRATA_SINK_SECRET_
        #[arg(long)]
        secret_env: Option<String>,
        /// NATS JetStream: the server's URL (nats://host:port)
        #[arg(long, requires = "subject_prefix")]
        nats: Option<String>,
        /// NATS: subjects are PREFIX.<stream's segments>.<noun>.<verb>, e.g. PREFIX.pool.p1.reservation.placed (a '.', '*', '>', '%' or space inside a token is written %XX)
        #[arg(long)]
        subject_prefix: Option<String>,
        /// NATS: create the JetStream stream for PREFIX.> when none stores it (named after the prefix); without it, a missing stream is an error here rather than parked batches later
        #[arg(long, requires = "nats")]
        create_stream: bool,
        /// Only these event types (comma-separated; default all)
        #[arg(long, value_delimiter = ',')]
        types: Vec<String>,
        /// Only streams starting with these prefixes (comma-separated; default all)
        #[arg(long, value_delimiter = ',')]
        prefixes: Vec<String>,
        /// Where to start: start, now or a position
        #[arg(long, default_value = "start")]
        from: String,
        /// Most events in one POST
        #[arg(long, default_value_t = 500)]
        batch: usize,
        /// Attempts before a batch is parked
        #[arg(long, default_value_t = 8)]
        attempts: u32,
        /// The first wait between attempts; each later one doubles, up to --retry-cap, and is drawn between half and all of that (default 500ms: with 8 attempts a batch is retried for 22 s to 45 s)
        #[arg(long, value_parser = humantime::parse_duration)]
        retry_base: Option<std::time::Duration>,
        /// The longest wait between attempts (default 10s)
        #[arg(long, value_parser = humantime::parse_duration)]
        retry_cap: Option<std::time::Duration>,
    },
    /// List sinks with their state and lag
    List {
        #[command(flatten)]
        db: Db,
    },
    /// Stop delivering (the cursor stays)
    Pause {
        #[command(flatten)]
        db: Db,
        name: String,
    },
    /// Deliver again from where it stopped
    Resume {
        #[command(flatten)]
        db: Db,
        name: String,
    },
    /// Remove a sink; deleting a deleted sink does nothing (exit 0), and its name can be used again by `create`
    Delete {
        #[command(flatten)]
        db: Db,
        name: String,
    },
    /// Show a sink's definition, state, cursor and lag
    Show {
        #[command(flatten)]
        db: Db,
        name: String,
    },
    /// Move a paused sink's cursor: deliver again after a position, or from a time (RFC 3339)
    Reset {
        #[command(flatten)]
        db: Db,
        name: String,
        /// A position, or a time such as 2026-11-30T10:00:00Z
        #[arg(long)]
        to: String,
    },
    /// Parked events: list them, or deliver them again
    #[command(subcommand)]
    Parked(ParkedCmd),
}

#[derive(Subcommand, Debug)]
pub enum ParkedCmd {
    List {
        #[command(flatten)]
        db: Db,
        name: String,
    },
    /// Deliver a sink's parked events again, in order (the secret is read from the sink's environment variable here)
    Replay {
        #[command(flatten)]
        db: Db,
        name: String,
        /// PEM certificates to trust for an https:// webhook besides the system's roots
        #[arg(long, env = "STRATA_WEBHOOK_CA", value_name = "FILE")]
        webhook_ca: Option<PathBuf>,
        /// The region's name, as `strata serve --region` has it (NATS message ids)
        #[arg(long, env = "STRATA_REGION", default_value = "default")]
        region: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum CaCmd {
    /// Create the region's CA: an offline root (ca.pem, root.key) and the issuing intermediate gateways and audit hosts hold (issuing.pem, issuing.key); keys readable by their owner only
    Init {
        /// Where to write it
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
        /// The region's name, in the CA's subject
        #[arg(long, default_value = "default")]
        region: String,
    },
    /// Copy what a gateway or audit host needs (ca.pem and the issuing intermediate with its key; never root.key) to another folder
    ExportIssuing {
        /// The CA's folder
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
        /// The folder to give the gateway or audit host (its --ca-dir)
        #[arg(long)]
        out: PathBuf,
    },
    /// Issue an auditor certificate for the audit endpoint (log in without a password); needs the root key
    IssueAuditor(IssueArgs),
    /// Issue an operator certificate for the client API (strata.api.v1 on every gateway); needs the root key
    IssueOperator(IssueArgs),
    /// Revoke an operator's or auditor's certificate before it expires: gateways
    /// refuse its API calls within seconds, the audit endpoint its logins
    #[command(group(clap::ArgGroup::new("which").required(true).args(["cert", "serial"])))]
    Revoke {
        #[command(flatten)]
        db: Db,
        /// The certificate (PEM), e.g. operator.pem; its holder is named in the log
        #[arg(long)]
        cert: Option<PathBuf>,
        /// Its serial in hex, when the file is gone (as `strata ca revoked` and
        /// `openssl x509 -serial` print it; colons allowed)
        #[arg(long)]
        serial: Option<String>,
        /// Why, kept with the revocation and in the log
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// List revoked certificates, newest first
    Revoked {
        #[command(flatten)]
        db: Db,
    },
}

/// A client certificate from the CA.
#[derive(Args, Debug)]
pub struct IssueArgs {
    /// The CA's folder
    #[arg(long, default_value = "ca")]
    dir: PathBuf,
    /// The name it certifies (an auditor as in `strata audit users add`, or an operator)
    #[arg(long)]
    name: String,
    /// Where to write the certificate and key (auditor.pem/.key or operator.pem/.key) and ca.pem
    #[arg(long)]
    out: PathBuf,
    /// Validity in days
    #[arg(long, default_value_t = 90)]
    days: i64,
}

#[derive(Subcommand, Debug)]
pub enum TokensCmd {
    /// Issue a one-time join token for a pool and the node ids it admits (printed once; only its hash is stored)
    #[command(group(clap::ArgGroup::new("admits").required(true).args(["node", "nodes"])))]
    Create {
        #[command(flatten)]
        db: Db,
        #[arg(long)]
        pool: String,
        /// How long it can be used
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
        /// Only this node may join with it (the only way back for a revoked node)
        #[arg(long)]
        node: Option<String>,
        /// Node ids it admits, `*` standing for any characters: gpu-rack7-*, or '*' for any id not taken
        #[arg(long)]
        nodes: Option<String>,
    },
    /// List join tokens (their ids, never the tokens): pool, what they admit, valid, used or expired
    List {
        #[command(flatten)]
        db: Db,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// Revoke an unspent token by its id (from `tokens create` or `tokens list`): joins with it are refused from now on
    Revoke {
        #[command(flatten)]
        db: Db,
        /// 16 hex digits
        id: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum NodesCmd {
    /// List nodes with their certificates
    List {
        #[command(flatten)]
        db: Db,
    },
    /// Revoke every certificate of a node: gateways refuse its sessions, it
    /// leaves its pool, and its live reservations fail (node_revoked)
    Revoke {
        #[command(flatten)]
        db: Db,
        node: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Re-provision a node (its machine replaced or rebuilt): in one transaction, revoke its
    /// certificates (it leaves its pool) and make a one-time join token for that node alone
    Replace {
        #[command(flatten)]
        db: Db,
        node: String,
        /// The pool it joins (default: the one it was in)
        #[arg(long)]
        pool: Option<String>,
        /// How long the token stays valid
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
        #[arg(long, default_value = "replaced")]
        reason: String,
    },
    /// Say where a node is in its pool's topology: its rack, its block (a spine block, or an NVL72 rack's NVLink domain) and its rail group; a label not given is cleared. Gangs asking for one rack, block or rail group (reserve --within), or to be spread over them (--spread), are placed by these. A node's daemon may report its own (strata node --rack/--block/--rail); the newest of the two is in force
    Topology {
        #[command(flatten)]
        target: NodeTarget,
        #[arg(long)]
        rack: Option<String>,
        #[arg(long)]
        block: Option<String>,
        /// Its rail group: the nodes whose NICs share one set of rail switches
        #[arg(long)]
        rail: Option<String>,
    },
    /// Take a node out of placement: nothing new goes to it; its live
    /// reservations stay
    Cordon {
        #[command(flatten)]
        target: NodeTarget,
        /// Why, for `strata pool show --nodes` and the log
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Let placements go to a node again (lifts a cordon and a drain)
    Uncordon {
        #[command(flatten)]
        target: NodeTarget,
    },
    /// Empty a node: nothing new goes to it, and its live reservations fail
    /// (node_drained) now, or once --wait has passed (those with a shorter
    /// TTL end by themselves first)
    Drain {
        #[command(flatten)]
        target: NodeTarget,
        /// Why, for `strata pool show --nodes` and the log
        #[arg(long, default_value = "")]
        reason: String,
        /// Let live reservations run this long before ending them
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<std::time::Duration>,
    },
    /// Take a node out of its pool (decommissioned): its capacity goes, and
    /// its live reservations fail (node_left); it comes back if it joins again
    Leave {
        #[command(flatten)]
        target: NodeTarget,
        /// Why, for the log
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Clear a health condition the node no longer has, so its GPUs can be
    /// placed on again
    ClearHealth {
        #[command(flatten)]
        target: NodeTarget,
        /// The condition, as `strata pool show --nodes` lists it (e.g. XID-79)
        #[arg(long)]
        condition: String,
        /// The device it is on (the whole node when omitted)
        #[arg(long)]
        device: Option<String>,
    },
}

/// The node whose standing changes.
#[derive(clap::Args, Debug)]
pub struct NodeTarget {
    #[command(flatten)]
    pub db: Db,
    /// The node's id
    pub node: String,
    /// Its pool (found from its certificate or the log when omitted)
    #[arg(long)]
    pub pool: Option<String>,
    /// Print the change as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum CommandsCmd {
    /// Issue a command to a node
    Issue {
        #[command(flatten)]
        db: Db,
        #[arg(long)]
        node: String,
        /// diag.nvml, allocation.bind, allocation.release
        #[arg(long)]
        kind: String,
        /// Arguments, a JSON object
        #[arg(long, default_value = "{}")]
        args: String,
        /// Not run after this long
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        deadline: std::time::Duration,
        /// The command's id (generated when omitted)
        #[arg(long)]
        id: Option<String>,
        /// Wait for its result and print it
        #[arg(long)]
        wait: bool,
    },
    /// List recent commands with their state
    List {
        #[command(flatten)]
        db: Db,
        #[arg(long)]
        node: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Show one command and its outcome
    Show {
        #[command(flatten)]
        db: Db,
        id: String,
    },
}

#[derive(Args, Debug)]
pub struct NodeArgs {
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
    /// Simulated GPUs instead of NVML, e.g. 8xH100-80GB
    #[arg(long)]
    pub fake_gpus: Option<String>,
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
}

#[derive(Args, Debug)]
pub struct FleetArgs {
    #[command(flatten)]
    pub db: Db,
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
    /// GPUs per node
    #[arg(long, default_value = "8xH100-80GB")]
    pub fake_gpus: String,
    #[arg(long, default_value = "localhost")]
    pub tls_name: String,
    /// Stop after this long
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<std::time::Duration>,
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
    /// Higher places first within a batch (in a pool shared by queues: within its queue)
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i32,
    /// The queue to be admitted under, in a pool shared by queues (see `strata queues list`)
    #[arg(long)]
    pub queue: Option<String>,
    /// When preempted (by a request of higher priority, or a queue taking back quota it lent), request it again under a new id, <id>~<n>, to wait in its queue, instead of only ending it
    #[arg(long)]
    pub requeue_on_preemption: bool,
    /// A gang: all its nodes in one rack, block or rail group (see `strata nodes topology`), or it waits
    #[arg(long, value_parser = ["rack", "block", "rail"], conflicts_with_all = ["prefer_within", "spread"], requires = "nodes")]
    pub within: Option<String>,
    /// A gang: all in one rack, block or rail group if it can be had now, anywhere otherwise
    #[arg(long, value_parser = ["rack", "block", "rail"], conflicts_with = "spread", requires = "nodes")]
    pub prefer_within: Option<String>,
    /// A gang: each node in a different rack, block or rail group, for availability
    #[arg(long, value_parser = ["rack", "block", "rail"], requires = "nodes")]
    pub spread: Option<String>,
    /// Release automatically this long after placement (e.g. 2h)
    #[arg(long, value_parser = humantime::parse_duration)]
    pub ttl: Option<std::time::Duration>,
    /// When a node it is on fails (lost, revoked, drained), place it again
    /// under a new id, <id>~<n>, instead of only ending it
    #[arg(long)]
    pub replace_on_failure: bool,
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
        /// Label the nodes with racks of this many (rack-0000, rack-0001, ...; 0: no labels)
        #[arg(long, default_value_t = 0)]
        nodes_per_rack: u32,
        /// And the racks with blocks of this many (block-000, ...; 0: no blocks)
        #[arg(long, default_value_t = 0, requires = "nodes_per_rack")]
        racks_per_block: u32,
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
    /// Check the log's invariants against the tables themselves (not the projections): positions, versions, double bookings, activations after the end, commands run or ended twice; exits 1 naming the positions of any violation
    Invariants {
        #[command(flatten)]
        db: Db,
        /// Print the report as JSON
        #[arg(long)]
        json: bool,
    },
    /// Rebuild a projection (pool index, nodes, reservations) from history or archives, with progress; optionally a window, a snapshot, a comparison with the live projection
    Run(replay_cmd::RunArgs),
    /// Print a pool as it was at a time: nodes, free and booked GPUs by class, what waited
    State {
        #[command(flatten)]
        db: Db,
        #[arg(long)]
        pool: String,
        /// A time such as 2026-11-30T10:00:00Z
        #[arg(long)]
        at: String,
        /// List every node
        #[arg(long)]
        nodes: bool,
    },
    /// Print a stream's events (up to a time), as JSON lines
    Stream {
        #[command(flatten)]
        db: Db,
        stream: String,
        /// Only events recorded at or before this time (RFC 3339)
        #[arg(long)]
        at: Option<String>,
    },
}

#[derive(Args, Debug)]
struct DbOnly {
    #[command(flatten)]
    db: Db,
}

#[derive(Args, Debug)]
pub struct MigrateArgs {
    #[command(flatten)]
    db: Db,
    /// Change nothing: say which migrations would be applied (expand or contract, their statements), which running Strata processes know which schema, and whether they stay compatible. Exits 1 when this binary may not run against the database or a migration would wait
    #[arg(long)]
    check: bool,
    /// With --check: one JSON object {known, database, runnable, refused, unknown, pending: [{version, name, change, needs, statements, blocked_by}], processes}
    #[arg(long, requires = "check")]
    json: bool,
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
}

#[derive(Args, Debug)]
pub struct ServeArgs {
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
    /// Export a month's rows as an rkyv archive with a checksum (replay it with `replay run --archive`)
    Export {
        #[command(flatten)]
        db: Db,
        /// The month, e.g. 2026-11
        month: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Detach and drop months older than a bound, only those sealed and exported
    Retire {
        #[command(flatten)]
        db: Db,
        /// e.g. 13mo: months that ended more than 13 months ago
        #[arg(long)]
        older_than: String,
        /// Only say what would be dropped or kept, and why
        #[arg(long)]
        dry_run: bool,
    },
    /// Seal a month: a hash chain over its rows in position order, stored for `strata audit verify`
    Seal {
        #[command(flatten)]
        db: Db,
        /// The month, e.g. 2026-11
        month: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum EventsCmd {
    /// The event reference: every event type Strata writes, its stream and its payload's fields (docs/events.md is `--markdown`)
    Types {
        /// One JSON object per type: {type, stream, written_by, about, formerly, fields: [{name, type, optional, about}]}
        #[arg(long, conflicts_with = "markdown")]
        json: bool,
        /// The reference page in Markdown
        #[arg(long)]
        markdown: bool,
    },
    /// Check the stored log against the event reference: every event's type is known, it is on the stream its type goes to, and its payload has the fields its type declares, of their types. Exits 1 on a problem
    Check {
        #[command(flatten)]
        db: Db,
        /// Only events after this position
        #[arg(long, default_value_t = 0)]
        after: i64,
        /// Types the reference does not know (appended with `events append`, say) are counted, not a problem
        #[arg(long)]
        allow_unknown: bool,
        /// One JSON object: {ok, checked, types: {type: n}, unknown_types: {type: n}, problems: [{position, problem}]}
        #[arg(long)]
        json: bool,
    },
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
        /// The event's metadata: a JSON object, e.g. '{"operator":"ana"}' or '{"payload_version":2}' for a payload in a newer version of its type's shape
        #[arg(long)]
        metadata: Option<String>,
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
    exit::set_json(cli.output == Output::Json);
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
            Command::Serve(args) => commands::serve(*args).await,
            Command::Migrate(a) => commands::migrate(&a).await,
            Command::Partitions(c) => commands::partitions(c).await,
            Command::Events(c) => commands::events(c).await,
            Command::Slots(c) => commands::slots(c).await,
            Command::Doctor {
                db,
                json,
                stale_after,
            } => commands::doctor(&db, json, stale_after).await,
            Command::Reserve(a) => placement::reserve(a).await,
            Command::Release { db, id, reason } => placement::release(&db, &id, &reason).await,
            Command::Pools { db } => placement::pools(&db).await,
            Command::Reservations(c) => placement::reservations(c).await,
            Command::Queues(c) => queues::queues(c).await,
            Command::Pool(c) => placement::pool(c).await,
            Command::Replay(c) => placement::replay(c).await,
            Command::Ca(c) => nodes::ca(c).await,
            Command::Tokens(c) => nodes::tokens(c).await,
            Command::Nodes(c) => nodes::nodes(c).await,
            Command::Commands(c) => nodes::commands(c).await,
            Command::Node(a) => nodes::node(a).await,
            Command::Fleet(a) => nodes::fleet(a).await,
            Command::Sinks(c) => nodes::sinks(c).await,
            Command::Audit(AuditCmd::Verify { db, month }) => {
                nodes::audit_verify(&db, &month).await
            }
            Command::Audit(AuditCmd::Users(c)) => nodes::audit_users(c).await,
            Command::Grants(c) => nodes::grants(c).await,
            Command::Roles(c) => nodes::roles(c).await,
            Command::Config(ConfigCmd::Check { file, json }) => match config::check(&file, json) {
                Ok(code) => Ok(code),
                Err(e) => {
                    eprintln!("error: {e:#}");
                    Ok(ExitCode::from(2))
                }
            },
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
