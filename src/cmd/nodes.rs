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
