//! `strata nodes`: node identities and an operator's say over a node's
//! standing (cordon, drain, topology).

use crate::cli::config;
use crate::cli::connect;
use crate::cli::whoami;
use crate::cli::DbArgs;
use anyhow::Result;
use clap::Subcommand;
use domain::standing::Change;
use events::Appender;
use events::AppenderConfig;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum NodesCmd {
    /// List nodes with their certificates
    List {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Revoke every certificate of a node: gateways refuse its sessions, it
    /// leaves its pool, and its live reservations fail (node_revoked)
    Revoke {
        #[command(flatten)]
        db: DbArgs,
        node: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Re-provision a node (its machine replaced or rebuilt): in one transaction, revoke its
    /// certificates (it leaves its pool) and make a one-time join token for that node alone
    Replace {
        #[command(flatten)]
        db: DbArgs,
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
    /// Book a maintenance window on nodes (named, or every node of a --rack): from --start for --duration no placement is on them; one placed before must end by the start (work with a time to live that ends by then may still go there), and live reservations that would outlast it end at its start (expired, maintenance) after the notice preemption gives
    Maintenance {
        #[command(flatten)]
        db: DbArgs,
        /// The nodes' ids
        nodes: Vec<String>,
        /// Every node of this rack (with --pool)
        #[arg(long, requires = "pool")]
        rack: Option<String>,
        /// Their pool (found per node when omitted)
        #[arg(long)]
        pool: Option<String>,
        /// When it begins (e.g. 2026-12-08T09:00:00Z)
        #[arg(long)]
        start: String,
        /// How long it lasts (e.g. 4h)
        #[arg(long, value_parser = humantime::parse_duration)]
        duration: std::time::Duration,
        /// Why, for the log
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
    /// Show a node: its standing, each GPU with what holds it and its
    /// conditions (their severity and the action each asks for), its
    /// quarantines, and its health history from the log
    Show {
        #[command(flatten)]
        db: DbArgs,
        node: String,
        /// How many events of its health history (newest first)
        #[arg(long, default_value_t = 20)]
        history: i64,
    },
    /// Split a GPU of a node into MIG instances, or make it whole again: a
    /// command the node's daemon applies through NVML (a fake node applies
    /// it to its fake GPUs). The node must be cordoned or drained and
    /// nothing may hold the GPU or its instances. Each instance is then a
    /// device of class <GPU class>/<profile> (e.g. H100-80GB/1g.10gb) that
    /// reservations ask for like any class; a GPU with instances is booked
    /// only through them
    Mig {
        #[command(flatten)]
        db: DbArgs,
        node: String,
        /// The GPU: its index among the node's whole GPUs, or its id
        #[arg(long)]
        gpu: String,
        /// The instances, e.g. 1g.10gb*7 or 3g.40gb,2g.20gb*2 (at most 7
        /// compute slices and the GPU's memory); `none` makes the GPU whole
        #[arg(long)]
        profiles: String,
        /// How long to wait for the node's answer
        #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
        wait: std::time::Duration,
    },
    /// Clear a health condition the node no longer has, so its GPUs can be
    /// placed on again; on a GPU it also lifts a quarantine (device.restored)
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
pub(crate) struct NodeTarget {
    #[command(flatten)]
    pub db: DbArgs,
    /// The node's id
    pub node: String,
    /// Its pool (found from its certificate or the log when omitted)
    #[arg(long)]
    pub pool: Option<String>,
    /// Print the change as JSON
    #[arg(long)]
    pub json: bool,
}

pub(crate) async fn nodes(cmd: NodesCmd) -> Result<ExitCode> {
    match cmd {
        NodesCmd::List { db } => {
            let client = connect(&db).await?;
            let issued = gateway::identity::issued(&client).await?;
            if crate::exit::json() {
                for c in &issued {
                    crate::exit::print_json(&serde_json::to_value(c)?);
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<24} {:<16} {:<34} {:<12}",
                "NODE", "POOL", "SERIAL", "STATE"
            );
            for c in issued {
                println!(
                    "{:<24} {:<16} {:<34} {}",
                    c.node,
                    c.pool,
                    c.serial,
                    match c.revoked_at {
                        Some(at) => format!("revoked {at}"),
                        None => format!("valid until {}", c.not_after),
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
        NodesCmd::Maintenance {
            db,
            nodes,
            rack,
            pool,
            start,
            duration,
            reason,
        } => maintenance(db, nodes, rack, pool, &start, duration, reason).await?,
        NodesCmd::Drain {
            target,
            reason,
            wait,
        } => standing(target, Change::Drain { reason, wait }).await?,
        NodesCmd::Leave { target, reason } => standing(target, Change::Leave { reason }).await?,
        NodesCmd::Show { db, node, history } => show(&db, &node, history).await?,
        NodesCmd::Mig {
            db,
            node,
            gpu,
            profiles,
            wait,
        } => return crate::cmd::mig::mig(&db, &node, &gpu, &profiles, wait).await,
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

/// The events of a node's health history.
const HEALTH_TYPES: &[&str] = &[
    "node.acceptance_reported",
    "health.raised",
    "health.cleared",
    "device.quarantined",
    "device.quarantine_withheld",
    "device.restored",
    "node.drained",
    "node.cordoned",
    "node.uncordoned",
];

/// `strata nodes show`.
async fn show(db: &DbArgs, node: &str, history: i64) -> Result<()> {
    let index = crate::cli::index(db).await?;
    let Some((pool, n)) = index
        .state()
        .pools
        .iter()
        .find_map(|(name, p)| p.nodes.get(node).map(|n| (name.clone(), n.clone())))
    else {
        return Err(crate::exit::not_found(format!(
            "node {node:?} is in no pool (see `strata pool show POOL --nodes`)"
        )));
    };
    let client = connect(db).await?;
    let types: Vec<String> = HEALTH_TYPES
        .iter()
        .flat_map(|t| domain::stored_types(t))
        .collect();
    let rows = client
        .query(
            "SELECT recorded_at::text, type, payload::text FROM strata.events
              WHERE stream = $1 AND type = ANY($2) AND payload->>'node' = $3
              ORDER BY position DESC LIMIT $4",
            &[&domain::pool_stream(&pool), &types, &node, &history.max(0)],
        )
        .await?;
    let class = |c: &String| {
        let k = domain::faults::classify(c);
        serde_json::json!({"condition": c, "severity": k.severity.name(), "action": k.action.name(), "meaning": k.meaning})
    };
    let gpus: Vec<serde_json::Value> = n
        .devices
        .iter()
        .map(|d| {
            serde_json::json!({
                "id": d.spec.id,
                "class": d.spec.class,
                "present": d.present,
                "booked_by": d.booked_by,
                "mig_of": d.spec.parent,
                "quarantined_for": d.quarantine,
                "fault_waiting": d.fault,
                "failed_acceptance": d.failed_acceptance,
                "conditions": d.conditions.iter().map(class).collect::<Vec<_>>(),
            })
        })
        .collect();
    let events: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "at": r.get::<_, String>(0),
                "type": domain::canonical_type(&r.get::<_, String>(1)),
                "payload": serde_json::from_str::<serde_json::Value>(&r.get::<_, String>(2)).unwrap_or_default(),
            })
        })
        .collect();
    if crate::exit::json() {
        crate::exit::print_json(&serde_json::json!({
            "node": node,
            "pool": pool,
            "schedulable": n.schedulable(),
            "acceptance_failed": n.acceptance_failed,
            "state": crate::cmd::pools::node_state(&n),
            "conditions": n.conditions.iter().map(class).collect::<Vec<_>>(),
            "gpus": gpus,
            "history": events,
        }));
        return Ok(());
    }
    println!(
        "node {node} in pool {pool}: {}",
        crate::cmd::pools::node_state(&n)
    );
    println!("  {:<20} {:<20} {:<24} STATE", "GPU", "CLASS", "BOOKED BY");
    for d in &n.devices {
        let mut state: Vec<String> = Vec::new();
        if !d.present {
            state.push("no longer reported".into());
        }
        if let Some(q) = &d.quarantine {
            state.push(format!("quarantined for {q}"));
        }
        if let Some(f) = &d.fault {
            state.push(format!("fault {f} waiting for the placer"));
        }
        if d.failed_acceptance {
            state.push("failed its acceptance check".into());
        }
        if let Some(gpu) = &d.spec.parent {
            state.push(format!("MIG instance of {gpu}"));
        }
        let instances = n
            .devices
            .iter()
            .filter(|i| i.present && i.spec.parent.as_deref() == Some(&d.spec.id))
            .count();
        if instances > 0 {
            state.push(format!("split into {instances} MIG instances"));
        }
        for c in &d.conditions {
            let k = domain::faults::classify(c);
            state.push(format!(
                "{c}: {} ({}, asks for {})",
                k.meaning,
                k.severity.name(),
                k.action.name()
            ));
        }
        println!(
            "  {:<20} {:<20} {:<24} {}",
            d.spec.id,
            d.spec.class,
            d.booked_by.as_deref().unwrap_or("-"),
            if state.is_empty() {
                "ok".to_string()
            } else {
                state.join("; ")
            }
        );
    }
    if !events.is_empty() {
        println!("  health history (newest first):");
        for e in &events {
            println!(
                "    {}  {:<28} {}",
                e["at"].as_str().unwrap_or_default(),
                e["type"].as_str().unwrap_or_default(),
                e["payload"]
            );
        }
    }
    Ok(())
}

/// Changes a node's standing and says what follows from it.
/// `strata nodes maintenance`: a window on each node named or of the rack.
async fn maintenance(
    db: DbArgs,
    mut nodes: Vec<String>,
    rack: Option<String>,
    pool: Option<String>,
    start: &str,
    duration: std::time::Duration,
    reason: String,
) -> Result<()> {
    let start_ms = crate::cli::time_arg(start)
        .map_err(|_| anyhow::anyhow!("--start {start:?}: a time such as 2026-12-08T09:00:00Z"))?
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let end_ms = start_ms + duration.as_millis() as u64;
    if let (Some(rack), Some(p)) = (&rack, &pool) {
        let index = crate::cli::index(&db).await?;
        let of_rack: Vec<String> = index
            .pool(p)
            .into_iter()
            .flat_map(|p| p.nodes.iter())
            .filter(|(_, n)| !n.left && n.rack.as_deref() == Some(rack.as_str()))
            .map(|(id, _)| id.clone())
            .collect();
        if of_rack.is_empty() {
            return Err(crate::exit::not_found(format!(
                "pool {p:?} has no node in rack {rack:?}"
            )));
        }
        nodes.extend(of_rack);
    }
    if nodes.is_empty() {
        anyhow::bail!("name the nodes, or give --rack and --pool");
    }
    for node in nodes {
        let target = NodeTarget {
            db: db.clone(),
            node,
            pool: pool.clone(),
            json: false,
        };
        let change = Change::Maintenance {
            start_ms,
            end_ms,
            reason: reason.clone(),
        };
        standing(target, change).await?;
    }
    Ok(())
}

pub(crate) async fn standing(target: NodeTarget, change: Change) -> Result<()> {
    let client = connect(&target.db).await?;
    let appender = Appender::start(config(&target.db)?, AppenderConfig::default());
    let who = whoami();
    let meta = serde_json::json!({ "operator": who });
    let pool = domain::standing::change(
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
        Change::ClearHealth { device: Some(_), .. } => (
            "cleared",
            "the condition no longer keeps the GPU out of placement, and a quarantine of it is lifted (device.restored)".to_string(),
        ),
        Change::ClearHealth { .. } => (
            "cleared",
            "the condition no longer keeps its GPUs out of placement".to_string(),
        ),
        Change::Maintenance {
            start_ms, end_ms, ..
        } => (
            "booked maintenance on",
            format!(
                "from {} to {} nothing is placed on it; what would last into it ends at its start, after a notice",
                crate::cli::ms_time(*start_ms),
                crate::cli::ms_time(*end_ms)
            ),
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
