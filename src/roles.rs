//! The roles a `strata serve` process runs (`--roles`), one module each:
//! `maintenance`, `placer`, `gateway`, `binder`, `sinks`, `audit`, `usage`,
//! `console`. A role
//! keeps nothing but leases in the database, so any number of processes may
//! run it and a dead one's work is handed on when its leases run out.
//!
//! [`ServeArgs`] are `serve`'s flags, most of them one role's settings.
//! [`Running`] starts the roles asked for, in a fixed order, reports on them,
//! notices one that stopped, and stops them in the reverse order.

pub(crate) mod audit;
pub(crate) mod binder;
pub(crate) mod console;
pub(crate) mod gateway;
pub(crate) mod maintenance;
pub(crate) mod placer;
pub(crate) mod sinks;
pub(crate) mod usage;

use crate::cli::DbArgs;
use anyhow::{Context, Result};
use clap::Args;
use events::db::Database;
use events::Reader;
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// A TOML file with any of these flags as keys (`roles = ["placer", "binder"]`, `metrics_listen = "0.0.0.0:9464"`, `lease_ttl = "5s"`); a flag given here or a STRATA_* variable set wins over the file. Check one with `strata config check`
    #[arg(long, env = "STRATA_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub db: DbArgs,
    /// Roles to run, comma-separated. maintenance: partitions ahead, seals of closed months and checkpoints of the open one; placer: places reservations of the pools it leases; gateway: node sessions over mutual TLS; binder: turns placements into bind commands and bound ones active; sinks: delivers events to the defined sinks; audit: the Postgres-protocol endpoint for auditors; usage: keeps the usage rollups (GPU time by pool, queue, owner, class and node) from the log; console: the web console over HTTPS (`strata console login` signs a browser in)
    #[arg(long, value_delimiter = ',', default_value = "maintenance", value_enum)]
    pub roles: Vec<Role>,
    /// Serve Prometheus metrics at this address
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Name of this process's replication slot (default strata_<host>; give each process on a host its own). `{host}` stands for the host's name, so one file serves every host: strata_{host}_gateway
    #[arg(long, env = "STRATA_SLOT")]
    pub slot: Option<String>,
    /// Serve this process's decoded log to the host's other processes over a Unix socket here (readable by this user only), so that the host costs PostgreSQL one walsender instead of one per process. The process follows the log even if none of its roles does; the others name the same path with --log-from
    #[arg(
        long,
        env = "STRATA_LOG_SHARE",
        value_name = "SOCKET",
        conflicts_with = "log_from"
    )]
    pub log_share: Option<PathBuf>,
    /// Follow the log through the share another process of this host serves at this socket (--log-share) instead of a replication slot of its own. A share that sends nothing for --log-share-silence counts as gone; the process connects again with backoff, and its subscriptions read what they missed from the table
    #[arg(long, env = "STRATA_LOG_FROM", value_name = "SOCKET")]
    pub log_from: Option<PathBuf>,
    /// With --log-from: how long the share may stay silent (it sends a keepalive every second) before it counts as gone
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub log_share_silence: std::time::Duration,
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
    /// placer: keep pool index snapshots here and start from the newest; console: start from the newest there
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
    /// gateway: most sessions waiting for their Welcome at once; fewer while the gateway welcomes slowly (as many as it welcomed in 5 s at its recent rate, at least 64), the rest pushed back for about 5 s
    #[arg(long, default_value_t = 1_000)]
    pub max_pending_hellos: usize,
    /// gateway: joins admitted per second (each signs a certificate); only joins with a token the region issued count
    #[arg(long, default_value_t = 200.0)]
    pub joins_per_second: f64,
    /// gateway: joins with a token the region never issued, per second from one address (bursts of five times as many); past it the address's joins are refused before their token is looked at
    #[arg(long, default_value_t = 2.0)]
    pub bad_joins_per_source_per_second: f64,
    /// gateway: joins tried per second with one token (a pattern token may admit a fleet; bursts of twice as many)
    #[arg(long, default_value_t = 100.0)]
    pub joins_per_token_per_second: f64,
    /// gateway: a connection must finish its TLS handshake and start its first RPC within this of its accept
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub handshake_timeout: std::time::Duration,
    /// gateway: a connection with no RPC in progress (no session, join or API call) this long is closed
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub idle_timeout: std::time::Duration,
    /// gateway: most connections without an RPC in progress; one more closes the one idle the longest
    #[arg(long, default_value_t = 1_024)]
    pub max_idle_connections: usize,
    /// gateway: each request message must arrive whole within this of its start (the first from the RPC's headers); a stalled RPC is cancelled and its connection counts as idle
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub request_deadline: std::time::Duration,
    /// gateway: most connections without a client certificate at once (joining nodes, and anyone else), so that they cannot take every descriptor from nodes and operators
    #[arg(long, default_value_t = 256)]
    pub max_unauthenticated_connections: usize,
    /// gateway: while that share is pressed (full within five seconds), TLS handshakes a second for addresses that never presented a client certificate; the rest are closed at accept (nodes' and operators' addresses are never held back)
    #[arg(long, default_value_t = 100.0)]
    pub unknown_handshakes_per_second: f64,
    /// gateway: durable subscriptions one caller of the client API may hold (ListSubscriptions shows them, DeleteSubscription ends one)
    #[arg(long, default_value_t = 16)]
    pub max_subscriptions_per_caller: u64,
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
    /// gateway: the gateway's lease (renewed every third of it); once it lapses (the process died, froze or lost the database) the other gateways mark its nodes lost
    #[arg(long, default_value = "6s", value_parser = humantime::parse_duration)]
    pub gateway_lease_ttl: std::time::Duration,
    /// gateway: how long a node's ack of a command is held for the command's outcome; an outcome within it is written alone, and `command.acked` only for a command still running after it
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub ack_hold: std::time::Duration,
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
    /// audit: most sessions of one auditor at once (so that one auditor cannot hold them all)
    #[arg(long, default_value_t = 4)]
    pub audit_max_sessions_per_auditor: u64,
    /// audit: a session without a statement this long is closed by the endpoint
    #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
    pub audit_idle_session_timeout: std::time::Duration,
    /// audit: memory per sort or hash of an auditor's statement, in MiB (fixed: auditors cannot change work_mem, hash_mem_multiplier or maintenance_work_mem)
    #[arg(long, default_value_t = 16)]
    pub audit_work_mem_mib: u64,
    /// audit: temporary files one auditor's statement may write, in MiB (set on each auditor's database role; needs a superuser or SET ON PARAMETER temp_file_limit)
    #[arg(long, default_value_t = 1024)]
    pub audit_temp_file_limit_mib: u64,
    /// sinks: PEM certificates to trust for https:// webhooks besides the system's roots (a private CA)
    #[arg(long, env = "STRATA_WEBHOOK_CA", value_name = "FILE")]
    pub webhook_ca: Option<PathBuf>,
    /// The region's name, in the message id of every event a NATS sink publishes (`<region>:<sink>:<position>`): regions that feed one JetStream stream need names of their own
    #[arg(long, env = "STRATA_REGION", default_value = "default")]
    pub region: String,
    /// console: where to serve the web console (HTTPS, with a serving certificate of the CA in --ca-dir for --tls-names)
    #[arg(long, default_value = "127.0.0.1:7480")]
    pub console_listen: SocketAddr,
    /// console: how long a browser stays signed in (a removed role or revoked certificate ends it sooner)
    #[arg(long, default_value = "8h", value_parser = humantime::parse_duration)]
    pub console_session_ttl: std::time::Duration,
}

/// A role of `strata serve`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Role {
    /// Partitions ahead, seals and checkpoints, slot metrics.
    Maintenance,
    /// Places reservations in the pools whose leases it holds.
    Placer,
    /// Node sessions, joins and the client API.
    Gateway,
    /// Placements to node commands, bound placements to active reservations.
    Binder,
    /// Events delivered to webhooks and NATS.
    Sinks,
    /// The audit endpoint.
    Audit,
    /// The usage rollups, kept from the log.
    Usage,
    /// The web console over HTTPS.
    Console,
}

impl Role {
    /// Its name on the command line and in a configuration file.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Role::Maintenance => "maintenance",
            Role::Placer => "placer",
            Role::Gateway => "gateway",
            Role::Binder => "binder",
            Role::Sinks => "sinks",
            Role::Audit => "audit",
            Role::Usage => "usage",
            Role::Console => "console",
        }
    }

    /// Whether it follows the log, and so needs the process's replication
    /// reader: a process of maintenance or the audit endpoint alone holds no
    /// slot and costs PostgreSQL no walsender.
    pub(crate) fn follows_log(self) -> bool {
        matches!(
            self,
            Role::Placer | Role::Gateway | Role::Binder | Role::Sinks | Role::Usage | Role::Console
        )
    }
}

/// `roles` as the comma-separated list `--roles` takes.
pub(crate) fn names(roles: &[Role]) -> String {
    roles.iter().map(|r| r.name()).collect::<Vec<_>>().join(",")
}

/// The roles a process runs, each `None` when not asked for.
pub(crate) struct Running {
    placer: Option<::placer::Placer>,
    gateway: Option<::gateway::server::Running>,
    binder: Option<::binder::Binder>,
    sinks: Option<::sinks::Sinks>,
    audit: Option<::audit::Endpoint>,
    console: Option<::console::Console>,
}

impl Running {
    /// Starts every role of `args.roles`; `reader` is the process's
    /// replication reader, started when one of them follows the log.
    pub(crate) async fn start(
        args: &ServeArgs,
        cfg: &Database,
        reader: Option<Reader>,
    ) -> Result<Running> {
        let has = |r: Role| args.roles.contains(&r);
        let reader = || {
            reader
                .clone()
                .context("the reader is started for every role that follows the log")
        };
        let holder = args
            .holder
            .clone()
            .unwrap_or_else(events::lease::default_holder);
        let placer = match has(Role::Placer) {
            true => Some(placer::start(args, cfg, reader()?)),
            false => None,
        };
        let gateway = match has(Role::Gateway) {
            true => Some(gateway::start(args, cfg, reader()?, &holder).await?),
            false => None,
        };
        let binder = match has(Role::Binder) {
            true => Some(binder::start(cfg, reader()?, &holder)),
            false => None,
        };
        let sinks = match has(Role::Sinks) {
            true => Some(sinks::start(args, cfg, reader()?)?),
            false => None,
        };
        if has(Role::Maintenance) {
            maintenance::start(cfg, args.seal_every, args.seal_grace);
        }
        if has(Role::Usage) {
            usage::start(cfg, reader()?);
        }
        let audit = match has(Role::Audit) {
            true => Some(audit::start(args, cfg).await?),
            false => None,
        };
        let console = match has(Role::Console) {
            true => Some(console::start(args, cfg, reader()?).await?),
            false => None,
        };
        Ok(Running {
            placer,
            gateway,
            binder,
            sinks,
            audit,
            console,
        })
    }

    /// Whether a role stopped by itself (the process then stops too).
    pub(crate) fn one_stopped(&self) -> bool {
        self.gateway.as_ref().is_some_and(|g| g.is_finished())
            || self.binder.as_ref().is_some_and(|b| b.is_finished())
            || self.audit.as_ref().is_some_and(|a| a.is_finished())
            || self.console.as_ref().is_some_and(|c| c.is_finished())
            || self.placer.as_ref().is_some_and(|p| p.is_finished())
    }

    /// Logs each running role's counters.
    pub(crate) fn report(&self) {
        if let Some(g) = &self.gateway {
            gateway::report(g);
        }
        if let Some(p) = &self.placer {
            placer::report(p);
        }
    }

    /// Stops every role, the audit endpoint first and the placer last.
    pub(crate) async fn stop(self) -> Result<()> {
        if let Some(c) = self.console {
            c.stop();
        }
        if let Some(a) = self.audit {
            a.stop();
        }
        if let Some(g) = self.gateway {
            g.stop().await.context("the gateway failed")?;
        }
        if let Some(b) = self.binder {
            b.stop().await.context("the binder failed")?;
        }
        if let Some(s) = self.sinks {
            s.stop().await;
        }
        if let Some(p) = self.placer {
            p.stop().await.context("the placer failed")?;
        }
        Ok(())
    }
}
