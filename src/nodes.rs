//! `strata ca`, `tokens`, `nodes`, `commands`, `node` and `fleet`.

use crate::commands::{config, connect};
use crate::{
    AuditUsersCmd, CaCmd, CommandsCmd, FleetArgs, IssueArgs, NodeArgs, NodeTarget, NodesCmd,
    ParkedCmd, SinksCmd, TokensCmd,
};
use anyhow::{bail, Context, Result};
use events::db::Sql;
use events::{Appender, AppenderConfig};
use node::daemon::{self, DaemonConfig, DaemonStats};
use node::gpu::{FakeGpus, GpuBackend, NvmlGpus};
use projections::domain::Tier;
use projections::standing::Change;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub async fn ca(cmd: CaCmd) -> Result<ExitCode> {
    match cmd {
        CaCmd::Revoke {
            db,
            cert,
            serial,
            reason,
        } => {
            use gateway::revocation;
            let presented = match &cert {
                Some(path) => {
                    let pem = std::fs::read_to_string(path)
                        .with_context(|| format!("read {}", path.display()))?;
                    let p = revocation::presented_pem(&pem)
                        .with_context(|| format!("read the certificate in {}", path.display()))?;
                    if p.kind.is_none() {
                        bail!(
                            "{} is not an operator's or an auditor's certificate (nodes are revoked with `strata nodes revoke`)",
                            path.display()
                        );
                    }
                    Some(p)
                }
                None => None,
            };
            let (serial, target) = match (&presented, &serial) {
                (Some(p), _) => (p.serial.clone(), revocation::Target::Certificate(p)),
                (None, Some(s)) => (revocation::parse_serial(s)?, revocation::Target::Serial(s)),
                (None, None) => bail!("give --cert or --serial"),
            };
            let mut client = connect(&db).await?;
            let who = presented
                .as_ref()
                .and_then(|p| Some(format!("{} {}", p.kind?, p.name.as_deref()?)))
                .unwrap_or_else(|| "certificate".into());
            if revocation::revoke(&mut client, target, &reason).await? {
                println!("revoked the {who} (serial {serial}); gateways refuse it within {} s, the audit endpoint at once", gateway::revocation::Revoked::RELOAD.as_secs());
            } else {
                println!("the {who} (serial {serial}) was already revoked");
            }
        }
        CaCmd::Revoked { db } => {
            let client = connect(&db).await?;
            let list = gateway::revocation::list(&client).await?;
            if crate::exit::json() {
                for r in &list {
                    crate::exit::print_json(&serde_json::json!({
                        "serial": r.serial,
                        "kind": r.kind,
                        "name": r.name,
                        "not_after": r.not_after.map(crate::exit::time),
                        "reason": r.reason,
                        "revoked_at": crate::exit::time(r.revoked_at),
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            if list.is_empty() {
                println!("no certificates are revoked");
            }
            for r in list {
                println!(
                    "{:<34} {:<9} {:<24} revoked {}  {}",
                    r.serial,
                    r.kind.as_deref().unwrap_or("-"),
                    r.name.as_deref().unwrap_or("-"),
                    humantime::format_rfc3339_seconds(r.revoked_at),
                    r.reason
                );
            }
        }
        CaCmd::Init { dir, region } => {
            let cert = gateway::ca::init(&dir, &region)?;
            println!(
                "created the region's CA in {}:\n  {}  the root certificate: give it to nodes, operators and auditors\n  {}  the root's key (private): it issues operator and auditor certificates; keep it offline\n  {} and {}  the issuing intermediate (private key): gateways and audit hosts sign node and serving certificates with it\ngive a gateway or audit host its folder with: strata ca export-issuing --dir {} --out <folder>",
                dir.display(),
                cert.display(),
                dir.join(gateway::ca::ROOT_KEY).display(),
                dir.join(gateway::ca::ISSUING_CERT).display(),
                dir.join(gateway::ca::ISSUING_KEY).display(),
                dir.display()
            );
        }
        CaCmd::ExportIssuing { dir, out } => {
            gateway::ca::export_issuing(&dir, &out)?;
            println!(
                "wrote {} (without the root's key): pass it as --ca-dir to gateways and audit hosts",
                out.display()
            );
        }
        CaCmd::IssueAuditor(a) => {
            ::replay::audit::accounts::check_name(&a.name)?;
            let out = issue(&a, "auditor", |ca| ca.issue_auditor(&a.name, a.days))?;
            println!(
                "psql: sslmode=verify-full sslrootcert={} sslcert={} sslkey={}",
                out.join("ca.pem").display(),
                out.join("auditor.pem").display(),
                out.join("auditor.key").display()
            );
        }
        CaCmd::IssueOperator(a) => {
            projections::domain::valid_name("operator name", &a.name)
                .map_err(anyhow::Error::msg)?;
            issue(&a, "operator", |ca| ca.issue_operator(&a.name, a.days))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `<kind>.pem`, `<kind>.key` (private) and `ca.pem` under `--out`.
fn issue(
    a: &IssueArgs,
    kind: &str,
    sign: impl FnOnce(&gateway::ca::Ca) -> Result<(String, String), gateway::ca::CaError>,
) -> Result<std::path::PathBuf> {
    if !(1..=3650).contains(&a.days) {
        bail!("--days must be 1 to 3650");
    }
    let ca = gateway::ca::Ca::load(&a.dir)?;
    let (cert, key) = sign(&ca)?;
    let out = &a.out;
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    gateway::ca::write_private(&out.join(format!("{kind}.key")), key.as_bytes())?;
    std::fs::write(out.join(format!("{kind}.pem")), &cert)?;
    std::fs::write(out.join("ca.pem"), ca.cert_pem())?;
    let serial = gateway::revocation::presented_pem(&cert)
        .map(|p| p.serial)
        .unwrap_or_default();
    println!(
        "wrote {} and {} (private) for {kind} {}, valid {} days, serial {serial} (`strata ca revoke --serial` revokes it)",
        out.join(format!("{kind}.pem")).display(),
        out.join(format!("{kind}.key")).display(),
        a.name,
        a.days
    );
    Ok(out.clone())
}

pub async fn audit_users(cmd: AuditUsersCmd) -> Result<ExitCode> {
    match cmd {
        AuditUsersCmd::Add {
            db,
            name,
            password_stdin,
            certificate_only,
        } => {
            if !password_stdin && !certificate_only {
                bail!("give --password-stdin (a password login) or --certificate-only (log in with `strata ca issue-auditor`)");
            }
            let password = if password_stdin {
                let mut line = String::new();
                std::io::stdin()
                    .read_line(&mut line)
                    .context("read the password from standard input")?;
                let p = line.trim_end_matches(['\r', '\n']).to_string();
                if p.is_empty() {
                    bail!("the password read from standard input is empty");
                }
                Some(p)
            } else {
                None
            };
            let client = connect(&db).await?;
            ::replay::audit::accounts::add(&client, &name, password.as_deref()).await?;
            println!(
                "auditor {name} can connect to the audit endpoint ({})",
                if password.is_some() {
                    "SCRAM-SHA-256 password"
                } else {
                    "certificate"
                }
            );
        }
        AuditUsersCmd::List { db } => {
            let client = connect(&db).await?;
            let list = ::replay::audit::accounts::list(&client).await?;
            if crate::exit::json() {
                for a in &list {
                    crate::exit::print_json(&serde_json::json!({
                        "name": a.name,
                        "password": a.has_password,
                        "created_at": crate::exit::time(a.created_at),
                        "revoked_at": a.revoked_at.map(crate::exit::time),
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!("{:<24} {:<9} {:<20} REVOKED", "NAME", "PASSWORD", "CREATED");
            for a in list {
                println!(
                    "{:<24} {:<9} {:<20} {}",
                    a.name,
                    if a.has_password { "yes" } else { "no" },
                    humantime::format_rfc3339_seconds(a.created_at),
                    a.revoked_at
                        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
                        .unwrap_or_else(|| "-".into())
                );
            }
        }
        AuditUsersCmd::Revoke { db, name } => {
            let client = connect(&db).await?;
            ::replay::audit::accounts::revoke(&client, &name).await?;
            println!("auditor {name} revoked: new connections are refused");
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn tokens(cmd: TokensCmd) -> Result<ExitCode> {
    match cmd {
        TokensCmd::Create {
            db,
            pool,
            ttl,
            node,
            nodes,
        } => {
            let client = connect(&db).await?;
            if !placer::client::pool_exists(&client, &pool).await? {
                return Err(crate::exit::not_found(format!(
                    "pool {pool:?} does not exist (see `strata pools`)"
                )));
            }
            let admits = node.as_deref().or(nodes.as_deref()).unwrap_or_default();
            let token = gateway::identity::create_token(&client, &pool, ttl, admits).await?;
            let only = match (&node, &nodes) {
                (Some(n), _) => format!(" and node {n} alone"),
                (None, Some(p)) if p == "*" => " and any node id not taken".to_string(),
                (None, Some(p)) => format!(" and a node id matching {p}"),
                (None, None) => String::new(),
            };
            eprintln!(
                "a one-time token for pool {pool}{only}, valid for {} (id {}, for `strata tokens revoke`); it is not shown again:",
                humantime::format_duration(ttl),
                gateway::identity::token_id(&token)
            );
            println!("{token}");
        }
        TokensCmd::List { db, json } => {
            let client = connect(&db).await?;
            let tokens = gateway::identity::list_tokens(&client).await?;
            if json || crate::exit::json() {
                for t in &tokens {
                    println!("{}", serde_json::to_string(t)?);
                }
            } else {
                println!(
                    "{:<16}  {:<16}  {:<16}  {:<7}  {:<20}  USED BY",
                    "ID", "POOL", "ADMITS", "STATE", "EXPIRES"
                );
                for t in &tokens {
                    println!(
                        "{:<16}  {:<16}  {:<16}  {:<7}  {:<20}  {}",
                        t.id,
                        t.pool,
                        t.admits.as_deref().unwrap_or("*"),
                        t.state,
                        t.expires_at,
                        t.used_by.as_deref().unwrap_or("-")
                    );
                }
            }
        }
        TokensCmd::Revoke { db, id } => {
            let client = connect(&db).await?;
            use gateway::identity::TokenRevoked;
            match gateway::identity::revoke_token(&client, &id).await? {
                TokenRevoked::Revoked => println!("revoked token {id}: joins with it are refused"),
                TokenRevoked::AlreadyUnusable => {
                    println!("token {id} was already spent or expired; nothing to do")
                }
                TokenRevoked::NotFound => {
                    return Err(crate::exit::not_found(format!(
                        "no join token with id {id} (see `strata tokens list`)"
                    )))
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn grants(cmd: crate::GrantsCmd) -> Result<ExitCode> {
    match cmd {
        crate::GrantsCmd::Set {
            db,
            caller,
            prefixes,
            types,
        } => return grant(&db, &caller, prefixes, types).await,
        crate::GrantsCmd::List { db, json } => {
            let client = connect(&db).await?;
            let grants = gateway::grants::list(&client).await?;
            if json || crate::exit::json() {
                for (caller, g) in &grants {
                    println!(
                        "{}",
                        serde_json::json!({"caller": caller, "stream_prefixes": g.stream_prefixes, "types": g.types})
                    );
                }
            } else {
                println!("{:<24}  {:<40}  TYPES", "CALLER", "STREAM PREFIXES");
                for (caller, g) in &grants {
                    let types = if g.types.is_empty() {
                        "all".to_string()
                    } else {
                        g.types.join(",")
                    };
                    println!("{caller:<24}  {:<40}  {types}", g.stream_prefixes.join(","));
                }
            }
        }
        crate::GrantsCmd::Remove { db, caller } => {
            let client = connect(&db).await?;
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            if gateway::grants::remove(&appender, &client, &caller)
                .await
                .map_err(anyhow::Error::msg)?
            {
                println!("removed {caller}'s grant");
            } else {
                return Err(crate::exit::not_found(format!(
                    "{caller} has no grant (see `strata grants list`)"
                )));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn nodes(cmd: NodesCmd) -> Result<ExitCode> {
    match cmd {
        NodesCmd::List { db } => {
            let client = connect(&db).await?;
            let rows = client
                .rows(
                    "SELECT node, pool, serial, issued_at::text, not_after::text, revoked_at::text
                       FROM strata.node_certificates ORDER BY node, issued_at",
                    &[],
                )
                .await?;
            if crate::exit::json() {
                for r in &rows {
                    crate::exit::print_json(&serde_json::json!({
                        "node": r.get::<_, String>(0),
                        "pool": r.get::<_, String>(1),
                        "serial": r.get::<_, String>(2),
                        "issued_at": r.get::<_, String>(3),
                        "not_after": r.get::<_, String>(4),
                        "revoked_at": r.get::<_, Option<String>>(5),
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<24} {:<16} {:<34} {:<12}",
                "NODE", "POOL", "SERIAL", "STATE"
            );
            for r in rows {
                let revoked: Option<String> = r.get(5);
                println!(
                    "{:<24} {:<16} {:<34} {}",
                    r.get::<_, String>(0),
                    r.get::<_, String>(1),
                    r.get::<_, String>(2),
                    match revoked {
                        Some(at) => format!("revoked {at}"),
                        None => format!("valid until {}", r.get::<_, String>(4)),
                    }
                );
            }
        }
        NodesCmd::Revoke { db, node, reason } => {
            let mut client = connect(&db).await?;
            let n = gateway::identity::revoke(&mut client, &node, &reason).await?;
            println!("revoked {n} certificate(s) of node {node}; gateways refuse its new sessions, and it left its pool");
        }
        NodesCmd::Replace {
            db,
            node,
            pool,
            ttl,
            reason,
        } => {
            let mut client = connect(&db).await?;
            let (pool, token) =
                gateway::identity::replace(&mut client, &node, pool.as_deref(), ttl, &reason)
                    .await?;
            eprintln!(
                "revoked node {node}'s certificates (it left its pool); this token joins it again, in pool {pool}, once, within {}:",
                humantime::format_duration(ttl)
            );
            println!("{token}");
        }
        NodesCmd::Cordon { target, reason } => {
            standing(target, Change::Cordon { reason }).await?;
        }
        NodesCmd::Uncordon { target } => standing(target, Change::Uncordon).await?,
        NodesCmd::Drain {
            target,
            reason,
            wait,
        } => standing(target, Change::Drain { reason, wait }).await?,
        NodesCmd::Leave { target, reason } => standing(target, Change::Leave { reason }).await?,
        NodesCmd::ClearHealth {
            target,
            condition,
            device,
        } => standing(target, Change::ClearHealth { device, condition }).await?,
        NodesCmd::Topology {
            target,
            rack,
            block,
            rail,
        } => standing(target, Change::Topology { rack, block, rail }).await?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Changes a node's standing and says what follows from it.
async fn standing(target: NodeTarget, change: Change) -> Result<()> {
    let client = connect(&target.db).await?;
    let appender = Appender::start(config(&target.db)?, AppenderConfig::default());
    let who = whoami();
    let meta = serde_json::json!({ "operator": who });
    let pool = projections::standing::change(
        &client,
        &appender,
        target.pool.as_deref(),
        &target.node,
        &change,
        Some(&meta),
    )
    .await?;
    let node = &target.node;
    let (what, follows) = match &change {
        Change::Cordon { .. } => (
            "cordoned",
            "nothing new is placed on it; its live reservations stay".to_string(),
        ),
        Change::Uncordon => ("uncordoned", "it takes placements again".to_string()),
        Change::Drain { wait: None, .. } => (
            "drained",
            "nothing new is placed on it; its live reservations end now".to_string(),
        ),
        Change::Drain { wait: Some(w), .. } => (
            "drained",
            format!(
                "nothing new is placed on it; its live reservations end in {}",
                humantime::format_duration(*w)
            ),
        ),
        Change::Leave { .. } => (
            "left",
            "its GPUs are out of the pool; its live reservations end now".to_string(),
        ),
        Change::ClearHealth { .. } => (
            "cleared",
            "the condition no longer keeps its GPUs out of placement".to_string(),
        ),
        Change::Topology { rack, block, rail } => (
            "labelled",
            format!(
                "rack {}, block {}, rail group {}: gangs asking for one (or to spread) see it there",
                rack.as_deref().unwrap_or("none"),
                block.as_deref().unwrap_or("none"),
                rail.as_deref().unwrap_or("none")
            ),
        ),
    };
    if target.json || crate::exit::json() {
        println!(
            "{}",
            serde_json::json!({ "node": node, "pool": pool, "change": what, "operator": who })
        );
    } else {
        println!("{what} node {node} in pool {pool}: {follows}");
    }
    Ok(())
}

/// Who asked, as requests made from the command line record it.
pub fn asked_by() -> serde_json::Value {
    serde_json::json!({ "cli": whoami() })
}

/// Who runs this command, as the log records it.
fn whoami() -> String {
    std::env::var("USER").unwrap_or_else(|_| "cli".into())
}

fn print_command(t: &projections::commands::Tracked) {
    let outcome = t
        .outcome
        .as_ref()
        .and_then(|o| o["detail"].as_str())
        .unwrap_or("");
    println!(
        "{:<40} {:<20} {:<20} {:<10} {}",
        t.command.id,
        t.command.node,
        t.command.kind,
        serde_json::to_value(t.state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        outcome
    );
}

pub async fn commands(cmd: CommandsCmd) -> Result<ExitCode> {
    use projections::commands::{self, Command};
    match cmd {
        CommandsCmd::Issue {
            db,
            node,
            kind,
            args,
            deadline,
            id,
            wait,
        } => {
            let args: serde_json::Value =
                serde_json::from_str(&args).context("--args must be a JSON object")?;
            if !args.is_object() {
                bail!("--args must be a JSON object");
            }
            let id = id.unwrap_or_else(|| projections::domain::new_id("c"));
            let deadline_ms = (SystemTime::now() + deadline)
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            let c = Command {
                id: id.clone(),
                node,
                kind,
                args,
                deadline_ms,
                issued_by: format!("cli:{}", whoami()),
            };
            commands::issue(&appender, &c).await.map_err(|e| match e {
                events::AppendError::VersionConflict { .. } => {
                    anyhow::anyhow!("command {id:?} already exists")
                }
                e => e.into(),
            })?;
            println!("issued {id}");
            if wait {
                let client = connect(&db).await?;
                let limit = std::time::Instant::now() + deadline + Duration::from_secs(5);
                loop {
                    let found = commands::list(&client, Some(&c.node), 1000).await?;
                    if let Some(t) = found.iter().find(|t| t.command.id == id) {
                        if t.state.is_terminal() {
                            print_command(t);
                            if let Some(o) = &t.outcome {
                                println!("{}", serde_json::to_string_pretty(o)?);
                            }
                            return Ok(if t.state == commands::CommandState::Succeeded {
                                ExitCode::SUCCESS
                            } else {
                                ExitCode::from(crate::exit::FAILURE)
                            });
                        }
                    }
                    if std::time::Instant::now() > limit {
                        eprintln!("no result before the deadline");
                        return Ok(ExitCode::from(crate::exit::TIMED_OUT));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        CommandsCmd::List { db, node, limit } => {
            let client = connect(&db).await?;
            let list = commands::list(&client, node.as_deref(), limit).await?;
            if crate::exit::json() {
                for t in &list {
                    crate::exit::print_json(&serde_json::to_value(t)?);
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<40} {:<20} {:<20} {:<10} DETAIL",
                "ID", "NODE", "KIND", "STATE"
            );
            for t in list {
                print_command(&t);
            }
        }
        CommandsCmd::Show { db, id } => {
            let client = connect(&db).await?;
            let node: Option<String> = client
                .opt(
                    "SELECT payload->>'node' FROM strata.events WHERE stream = $1 AND version = 1",
                    &[&commands::command_stream(&id)],
                )
                .await?
                .map(|r| r.get(0));
            let Some(node) = node else {
                return Err(crate::exit::not_found(format!(
                    "command {id:?} does not exist"
                )));
            };
            let found = commands::list(&client, Some(&node), 100_000).await?;
            let t = found
                .iter()
                .find(|t| t.command.id == id)
                .context("command not found")?;
            if crate::exit::json() {
                crate::exit::print_json(&serde_json::to_value(t)?);
            } else {
                println!("{}", serde_json::to_string_pretty(t)?);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn host_name() -> String {
    crate::commands::hostname().unwrap_or_else(|| "node".into())
}

pub async fn node(args: NodeArgs) -> Result<ExitCode> {
    let node_id = args.node_id.clone().unwrap_or_else(host_name);
    let backend: Arc<dyn GpuBackend> = match &args.fake_gpus {
        Some(spec) => {
            let mut f = FakeGpus::parse(spec, &node_id)?;
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
    c.return_home = args.return_home;
    c.token = args.token.clone();
    for (tier, label) in [
        (Tier::Rack, &args.rack),
        (Tier::Block, &args.block),
        (Tier::Rail, &args.rail),
    ] {
        if let Some(v) = label {
            projections::domain::valid_name(tier.name(), v).map_err(anyhow::Error::msg)?;
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

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

/// What a fleet of simulated daemons is.
pub struct FleetSpec<'a> {
    pub nodes: u32,
    pub gateways: &'a [String],
    pub pool: &'a str,
    pub ca_pem: &'a str,
    pub data_dir: &'a std::path::Path,
    pub prefix: &'a str,
    /// e.g. `8xH100-80GB`.
    pub gpus: &'a str,
    pub tls_name: &'a str,
}

type Daemons = Vec<tokio::task::JoinHandle<Result<(), daemon::DaemonError>>>;

/// Starts the fleet's daemons; tokens are issued for those that have not
/// joined yet.
pub async fn start_fleet(
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
    } = *spec;
    let stats = Arc::new(DaemonStats::default());
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let node_id = format!("{prefix}{i:05}");
        let backend = Arc::new(FakeGpus::parse(spec, &node_id)?);
        let mut c = DaemonConfig::new(
            gateways.to_vec(),
            data_dir.join(&node_id),
            &node_id,
            backend,
        );
        c.server_name = tls_name.to_string();
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

pub async fn fleet(args: FleetArgs) -> Result<ExitCode> {
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

pub async fn sinks(cmd: SinksCmd) -> Result<ExitCode> {
    use sinks::config::{self, Filter, SinkConfig, Target};
    let change = |db: &crate::Db, name: String, t: &'static str| {
        let db = db.clone();
        async move {
            let client = connect(&db).await?;
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            match config::apply(&client, &appender, &name, t).await {
                Ok(changed) => anyhow::Ok((name, changed)),
                Err(config::SinkError::NotFound(n)) => {
                    Err(crate::exit::not_found(format!("sink {n:?} does not exist")))
                }
                Err(e) => Err(e.into()),
            }
        }
    };
    match cmd {
        SinksCmd::Create {
            db,
            name,
            webhook,
            secret_env,
            nats,
            subject_prefix,
            types,
            prefixes,
            from,
            batch,
            attempts,
            create_stream,
            retry_base,
            retry_cap,
        } => {
            let target = match (webhook, nats) {
                (Some(url), None) => Target::Webhook {
                    url,
                    secret_env: secret_env.unwrap_or_default(),
                },
                (None, Some(url)) => Target::Nats {
                    url,
                    subject_prefix: subject_prefix.unwrap_or_default(),
                },
                _ => bail!("say where the sink delivers: --webhook URL --secret-env VAR, or --nats URL --subject-prefix P"),
            };
            let c = SinkConfig {
                name: name.clone(),
                target,
                filter: Filter { types, prefixes },
                start: from,
                batch_max: batch,
                max_attempts: attempts,
                retry: (retry_base.is_some() || retry_cap.is_some()).then(|| {
                    let d = config::Retry::default();
                    config::Retry {
                        base_ms: retry_base.map_or(d.base_ms, |b| b.as_millis() as u64),
                        cap_ms: retry_cap.map_or(d.cap_ms, |c| c.as_millis() as u64),
                    }
                }),
            };
            c.validate().map_err(anyhow::Error::msg)?;
            if let Target::Nats {
                url,
                subject_prefix,
            } = &c.target
            {
                let (stream, created) =
                    sinks::nats::ensure_stream(url, subject_prefix, create_stream)
                        .await
                        .map_err(anyhow::Error::msg)?;
                if created {
                    eprintln!("created the JetStream stream {stream} for {subject_prefix}.>");
                } else {
                    eprintln!("JetStream stream {stream} stores {subject_prefix}.>");
                }
            }
            let mut client = connect(&db).await?;
            config::create_in(&mut client, &c).await?;
            println!("created sink {name}; processes running `serve --roles sinks` deliver it");
        }
        SinksCmd::List { db } => {
            let client = connect(&db).await?;
            let head = events::read::head(&client).await?.0 as i64;
            if !crate::exit::json() {
                println!(
                    "{:<20} {:<8} {:>12} {:>10} {:>8}  TARGET",
                    "SINK", "STATE", "LAG EVENTS", "LAG S", "PARKED"
                );
            }
            for s in config::list(&client).await? {
                let cursor: Option<i64> = client
                    .opt(
                        "SELECT position FROM strata.subscriptions WHERE name = $1",
                        &[&format!("sink.{}", s.config.name)],
                    )
                    .await?
                    .map(|r| r.get(0));
                let parked: i64 = client
                    .one(
                        "SELECT count(*) FROM strata.sink_parked WHERE sink = $1",
                        &[&s.config.name],
                    )
                    .await?
                    .get(0);
                let url = match &s.config.target {
                    Target::Webhook { url, .. } => url.clone(),
                    Target::Nats {
                        url,
                        subject_prefix,
                    } => format!("{url} {subject_prefix}.>"),
                };
                // The age of the oldest event the sink has not acknowledged.
                let lag_s: Option<f64> = match cursor {
                    Some(c) if c < head => client
                        .opt(
                            "SELECT extract(epoch FROM now() - recorded_at)::float8 FROM strata.events WHERE position = $1",
                            &[&(c + 1)],
                        )
                        .await?
                        .map(|r| r.get(0)),
                    Some(_) => Some(0.0),
                    None => None,
                };
                if crate::exit::json() {
                    crate::exit::print_json(&serde_json::json!({
                        "name": s.config.name,
                        "paused": s.paused,
                        "cursor": cursor,
                        "lag_events": cursor.map(|c| (head - c).max(0)),
                        "lag_seconds": lag_s,
                        "parked": parked,
                        "target": url,
                        "config": s.config,
                    }));
                    continue;
                }
                println!(
                    "{:<20} {:<8} {:>12} {:>10} {:>8}  {url}",
                    s.config.name,
                    if s.paused { "paused" } else { "active" },
                    cursor.map_or("not started".into(), |c| (head - c).max(0).to_string()),
                    lag_s.map_or("-".into(), |l| format!("{l:.1}")),
                    parked
                );
            }
        }
        SinksCmd::Pause { db, name } => match change(&db, name, "sink.paused").await? {
            (name, true) => println!("paused {name}"),
            (name, false) => println!("{name} was paused already"),
        },
        SinksCmd::Resume { db, name } => match change(&db, name, "sink.resumed").await? {
            (name, true) => println!("resumed {name}"),
            (name, false) => println!("{name} was not paused"),
        },
        SinksCmd::Delete { db, name } => match change(&db, name, "sink.deleted").await? {
            (name, true) => println!("deleted {name}"),
            (name, false) => println!("{name} was deleted already"),
        },
        SinksCmd::Show { db, name } => {
            let client = connect(&db).await?;
            let s = config::list(&client)
                .await?
                .into_iter()
                .find(|s| s.config.name == name)
                .ok_or_else(|| crate::exit::not_found(format!("sink {name:?} does not exist")))?;
            let head = events::read::head(&client).await?.0;
            let cursor = config::cursor(&client, &name).await?;
            let parked = sinks::parked::list(&client, &name).await?.len();
            let shown = serde_json::json!({
                    "config": s.config,
                    "paused": s.paused,
                    "cursor": cursor,
                    "lag_events": cursor.map(|c| head.saturating_sub(c)),
                    "parked": parked,
            });
            if crate::exit::json() {
                crate::exit::print_json(&shown);
            } else {
                println!("{}", serde_json::to_string_pretty(&shown)?);
            }
        }
        SinksCmd::Reset { db, name, to } => {
            let mut client = connect(&db).await?;
            let position = match to.parse::<u64>() {
                Ok(p) => p,
                Err(_) => {
                    let t = humantime::parse_rfc3339_weak(&to).map_err(|_| {
                        anyhow::anyhow!("--to {to:?}: a position (a whole number) or a time such as 2026-11-30T10:00:00Z")
                    })?;
                    let head = events::read::head(&client).await?.0 as i64;
                    let first: Option<i64> = client
                        .one(
                            "SELECT min(position) FROM strata.events WHERE recorded_at >= $1 AND position <= $2",
                            &[&t, &head],
                        )
                        .await?
                        .get(0);
                    (first.unwrap_or(head + 1) - 1).max(0) as u64
                }
            };
            config::reset(&mut client, &name, position).await?;
            println!("sink {name} now stands at position {position}; it delivers what follows when resumed");
        }
        SinksCmd::Parked(ParkedCmd::List { db, name }) => {
            let client = connect(&db).await?;
            let list = sinks::parked::list(&client, &name).await?;
            if crate::exit::json() {
                for p in &list {
                    crate::exit::print_json(&serde_json::to_value(p)?);
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:>10} {:<24} {:<24} {:>8}  ERROR",
                "POSITION", "STREAM", "TYPE", "ATTEMPTS"
            );
            for p in list {
                println!(
                    "{:>10} {:<24} {:<24} {:>8}  {}",
                    p.position, p.stream, p.event_type, p.attempts, p.error
                );
            }
        }
        SinksCmd::Parked(ParkedCmd::Replay {
            db,
            name,
            webhook_ca,
            region,
        }) => {
            let client = connect(&db).await?;
            let sink = config::list(&client)
                .await?
                .into_iter()
                .find(|s| s.config.name == name)
                .ok_or_else(|| crate::exit::not_found(format!("sink {name:?} does not exist")))?;
            let n = match &sink.config.target {
                Target::Webhook { url, secret_env } => {
                    sinks::config::check_secret_env(secret_env).map_err(anyhow::Error::msg)?;
                    let secret = std::env::var(secret_env)
                        .with_context(|| format!("the sink's secret: set {secret_env} here"))?;
                    let http = sinks::webhook::client(webhook_ca.as_deref())
                        .map_err(anyhow::Error::msg)?;
                    sinks::parked::replay(&client, &http, &name, url, secret.as_bytes()).await
                }
                Target::Nats {
                    url,
                    subject_prefix,
                } => sinks::parked::replay_nats(&client, &name, &region, url, subject_prefix).await,
            }
            .map_err(anyhow::Error::msg)?;
            println!("delivered {n} parked event(s) of {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn grant(
    db: &crate::Db,
    caller: &str,
    prefixes: Vec<String>,
    types: Vec<String>,
) -> Result<ExitCode> {
    projections::domain::valid_name("caller", caller).map_err(anyhow::Error::msg)?;
    if prefixes.iter().any(|p| p.is_empty()) {
        bail!("--prefixes: empty prefixes would grant everything; name them");
    }
    let appender = Appender::start(config(db)?, AppenderConfig::default());
    let g = gateway::grants::Grant {
        stream_prefixes: prefixes,
        types,
    };
    gateway::grants::set(&appender, caller, &g).await?;
    println!(
        "{caller} may read {:?}{}",
        g.stream_prefixes,
        if g.types.is_empty() {
            String::new()
        } else {
            format!(" of types {:?}", g.types)
        }
    );
    Ok(ExitCode::SUCCESS)
}

pub async fn roles(cmd: crate::RolesCmd) -> Result<ExitCode> {
    use gateway::roles::{self, Assignment};
    match cmd {
        crate::RolesCmd::Set {
            db,
            operator,
            role,
            pools,
        } => {
            let role = role.parse().map_err(anyhow::Error::msg)?;
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            let a = Assignment { role, pools };
            roles::set(&appender, &operator, &a).await?;
            match a.pools.is_empty() {
                true => println!("{operator} is {}", a.role),
                false => println!("{operator} is {} in pools {}", a.role, a.pools.join(", ")),
            }
        }
        crate::RolesCmd::List { db, json } => {
            let client = connect(&db).await?;
            for (name, a) in roles::list(&client).await? {
                if json || crate::exit::json() {
                    println!(
                        "{}",
                        serde_json::json!({ "operator": name, "role": a.role, "pools": a.pools })
                    );
                } else {
                    println!("{name:<24} {:<9} {}", a.role.to_string(), a.pools.join(","));
                }
            }
        }
        crate::RolesCmd::Remove { db, operator } => {
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            roles::remove(&appender, &operator)
                .await
                .map_err(|e| match e {
                    events::AppendError::VersionConflict { .. } => {
                        anyhow::anyhow!("{operator} has no role")
                    }
                    e => e.into(),
                })?;
            println!("{operator} has no role now: it may do nothing through the API");
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn audit_verify(db: &crate::Db, month: &str) -> Result<ExitCode> {
    // Recomputing a month's chain reads all of it in one statement.
    let client = crate::commands::connect_long(db).await?;
    let finding = ::replay::seal::verify(&client, month).await?;
    println!("{finding}");
    Ok(match finding {
        ::replay::seal::Finding::Intact { .. }
        | ::replay::seal::Finding::CheckpointsIntact { .. } => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    })
}
