//! `strata nodes mig`: split a GPU of a node into MIG instances, or make it
//! whole again. The layout is checked here (a clear error before anything
//! is issued), the log is asked whether the node is cordoned or drained and
//! nothing holds the GPU, then the `gpu.mig` command goes to the node. The
//! node's daemon checks again against its own bindings, under the lock its
//! binds take, and refuses if anything is bound: that is the guard; the
//! checks here only explain early.

use crate::cli::{config, connect, whoami, DbArgs};
use anyhow::{bail, Result};
use domain::commands::{self, Command, CommandState};
use events::{Appender, AppenderConfig};
use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub(crate) async fn mig(
    db: &DbArgs,
    node: &str,
    gpu: &str,
    profiles: &str,
    wait: Duration,
) -> Result<ExitCode> {
    let layout = node::mig::parse_layout(profiles)?;
    let index = crate::cli::index(db).await?;
    let Some((pool, n)) = index
        .state()
        .pools
        .iter()
        .find_map(|(name, p)| p.nodes.get(node).filter(|n| !n.left).map(|n| (name, n)))
    else {
        return Err(crate::exit::not_found(format!(
            "node {node:?} is in no pool (see `strata pool show POOL --nodes`)"
        )));
    };
    let whole: Vec<_> = n
        .devices
        .iter()
        .filter(|d| d.present && d.spec.parent.is_none())
        .collect();
    let target = gpu
        .parse::<usize>()
        .ok()
        .and_then(|i| whole.get(i).copied())
        .or_else(|| whole.iter().copied().find(|d| d.spec.id == gpu));
    let Some(target) = target else {
        bail!(
            "node {node} has no GPU {gpu:?}: give its index (0 to {}) or its id (see `strata nodes show {node}`)",
            whole.len().saturating_sub(1)
        );
    };
    let id = target.spec.id.clone();
    node::mig::check_fits(&layout, target.spec.memory_mb)?;
    if n.cordoned.is_none() && n.drained.is_none() {
        bail!(
            "cordon or drain node {node} first (`strata nodes cordon {node}`): the GPU's devices change, and nothing may be placed on them meanwhile"
        );
    }
    let holders: BTreeSet<&str> = n
        .devices
        .iter()
        .filter(|d| d.spec.id == id || d.spec.parent.as_deref() == Some(id.as_str()))
        .filter_map(|d| d.booked_by.as_deref())
        .collect();
    if !holders.is_empty() {
        bail!(
            "GPU {id} of node {node} or its MIG instances are held by {}; release them or drain the node (`strata nodes drain {node}`) first",
            holders.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    let text = node::mig::layout_text(&layout);
    let c = Command {
        id: domain::new_id("mig"),
        node: node.to_string(),
        kind: "gpu.mig".into(),
        args: serde_json::json!({ "gpu": id, "profiles": text }),
        deadline_ms: (SystemTime::now() + wait)
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        issued_by: format!("cli:{}", whoami()),
    };
    let appender = Appender::start(config(db)?, AppenderConfig::default());
    commands::issue(&appender, &c).await?;
    eprintln!("asked node {node} (pool {pool}) to make GPU {id} {text}; waiting for its answer");
    let client = connect(db).await?;
    let Some(t) =
        crate::cmd::commands::wait_for_result(&client, &c, wait + Duration::from_secs(5)).await?
    else {
        eprintln!(
            "no answer from node {node} within {}; see `strata commands show {}`",
            humantime::format_duration(wait),
            c.id
        );
        return Ok(ExitCode::from(crate::exit::TIMED_OUT));
    };
    let outcome = t.outcome.clone().unwrap_or_default();
    let ok = t.state == CommandState::Succeeded;
    if crate::exit::json() {
        crate::exit::print_json(&serde_json::json!({
            "node": node,
            "pool": pool,
            "gpu": id,
            "command": c.id,
            "state": t.state,
            "outcome": outcome,
        }));
    } else if ok {
        let classes: BTreeSet<&str> = outcome["output"]["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| i["class"].as_str())
            .collect();
        println!("{}", outcome["detail"].as_str().unwrap_or("done"));
        if !classes.is_empty() {
            println!(
                "  reservations ask for them as --class {}",
                classes.into_iter().collect::<Vec<_>>().join(" or --class ")
            );
        }
        println!("  uncordon node {node} to place on them (`strata nodes uncordon {node}`)");
    } else {
        eprintln!(
            "node {node} did not change GPU {id}: {}",
            outcome["detail"].as_str().unwrap_or("no reason given")
        );
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(crate::exit::FAILURE)
    })
}
