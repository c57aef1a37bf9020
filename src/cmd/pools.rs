//! `strata pools` and `strata pool create|seed|show|...`.

use crate::cli::appender;
use crate::cli::index;
use crate::cli::ms_time;
use crate::cli::DbArgs;
use crate::cmd::reservations::counts;
use anyhow::bail;
use anyhow::Result;
use clap::Subcommand;
use projections::index::Phase;
use projections::Index;
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum PoolCmd {
    /// Create a pool
    Create {
        #[command(flatten)]
        db: DbArgs,
        name: String,
        #[arg(long, default_value = "")]
        description: String,
    },
    /// Join simulated nodes to a pool (for demos and drills; real nodes join through the gateway)
    Seed {
        #[command(flatten)]
        db: DbArgs,
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
        db: DbArgs,
        name: String,
        /// List every node (default: a summary by free count)
        #[arg(long)]
        nodes: bool,
    },
}

pub(crate) async fn pools(db: &DbArgs) -> Result<ExitCode> {
    let index = index(db).await?;
    if crate::exit::json() {
        for p in index.state().pools.values().filter(|p| p.created) {
            let c = counts(&index, &p.name);
            let classes: Vec<_> = index
                .classes(&p.name)
                .map(|(class, ci)| {
                    serde_json::json!({
                        "class": class, "gpus": ci.total, "free": ci.free,
                        "booked": booked(&index, &p.name, class),
                    })
                })
                .collect();
            crate::exit::print_json(&serde_json::json!({
                "pool": p.name,
                "nodes": c.nodes,
                "schedulable": c.schedulable,
                "live": c.live,
                "waiting": c.pending,
                "classes": classes,
            }));
        }
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<20} {:>7} {:>11} {:<14} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "POOL", "NODES", "SCHEDULABLE", "CLASS", "GPUS", "FREE", "BOOKED", "LIVE", "WAITING"
    );
    for p in index.state().pools.values().filter(|p| p.created) {
        let c = counts(&index, &p.name);
        let classes: Vec<_> = index.classes(&p.name).collect();
        if classes.is_empty() {
            println!(
                "{:<20} {:>7} {:>11} {:<14} {:>8} {:>8} {:>8} {:>8} {:>8}",
                p.name, c.nodes, c.schedulable, "-", 0, 0, 0, c.live, c.pending
            );
        }
        for (i, (class, ci)) in classes.iter().enumerate() {
            let booked = booked(&index, &p.name, class);
            let (name, nodes, sched) = if i == 0 {
                (
                    p.name.as_str(),
                    c.nodes.to_string(),
                    c.schedulable.to_string(),
                )
            } else {
                ("", String::new(), String::new())
            };
            println!(
                "{:<20} {:>7} {:>11} {:<14} {:>8} {:>8} {:>8} {:>8} {:>8}",
                name, nodes, sched, class, ci.total, ci.free, booked, c.live, c.pending
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn booked(index: &Index, pool: &str, class: &str) -> usize {
    index.pool(pool).map_or(0, |p| {
        p.nodes
            .values()
            .flat_map(|n| &n.devices)
            .filter(|d| d.spec.class == class && d.booked_by.is_some())
            .count()
    })
}

pub(crate) async fn pool(cmd: PoolCmd) -> Result<ExitCode> {
    match cmd {
        PoolCmd::Create {
            db,
            name,
            description,
        } => {
            domain::pools::create_pool(&appender(&db)?, &name, &description).await?;
            println!("created pool {name}");
        }
        PoolCmd::Seed {
            db,
            name,
            nodes,
            gpus,
            class,
            per_island,
            prefix,
            nodes_per_rack,
            racks_per_block,
        } => {
            if gpus == 0 || gpus > 1024 {
                bail!("--gpus must be 1 to 1024");
            }
            let prefix = prefix.unwrap_or_else(|| format!("{name}-n"));
            let fleet = domain::pools::uniform_fleet(&prefix, nodes, &class, gpus, per_island);
            let tty = std::io::stderr().is_terminal();
            let n = domain::pools::join_nodes(&appender(&db)?, &name, fleet, |done| {
                if tty {
                    eprint!("\rjoined {done}/{nodes} nodes");
                }
            })
            .await?;
            if tty {
                eprintln!();
            }
            println!("joined {n} nodes with {gpus} {class} GPUs each to pool {name}");
            if nodes_per_rack > 0 {
                let labels: Vec<(String, Option<String>, Option<String>)> = (0..nodes)
                    .map(|i| {
                        let rack = i / nodes_per_rack;
                        (
                            format!("{prefix}{i:05}"),
                            Some(format!("rack-{rack:04}")),
                            (racks_per_block > 0)
                                .then(|| format!("block-{:03}", rack / racks_per_block)),
                        )
                    })
                    .collect();
                domain::pools::label_nodes(&appender(&db)?, &name, labels).await?;
                println!(
                    "labelled them in racks of {nodes_per_rack}{}",
                    if racks_per_block > 0 {
                        format!(", blocks of {racks_per_block} racks")
                    } else {
                        String::new()
                    }
                );
            }
        }
        PoolCmd::Show { db, name, nodes } => {
            let index = index(&db).await?;
            if crate::exit::json() {
                show_pool_json(&index, &name, nodes)?;
            } else {
                show_pool(&index, &name, nodes)?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints a pool as `strata pool show` does.
pub(crate) fn show_pool(index: &Index, name: &str, nodes: bool) -> Result<()> {
    let Some(p) = index.pool(name).filter(|p| p.created) else {
        return Err(crate::exit::not_found(format!(
            "pool {name:?} does not exist (see `strata pools`)"
        )));
    };
    let c = counts(index, name);
    println!("pool {name}: {}", p.description);
    println!(
        "  nodes {} ({} schedulable), version {}, live reservations {}, waiting {}",
        c.nodes, c.schedulable, p.version, c.live, c.pending
    );
    for (class, ci) in index.classes(name) {
        println!(
            "  {class}: {} GPUs, {} free, {} booked; {} nodes with free GPUs",
            ci.total,
            ci.free,
            booked(index, name, class),
            ci.schedulable_nodes()
        );
        let mut by_free: BTreeMap<u32, usize> = BTreeMap::new();
        for n in p.nodes.keys() {
            *by_free.entry(ci.node_free(n)).or_default() += 1;
        }
        let summary: Vec<String> = by_free
            .iter()
            .rev()
            .map(|(free, n)| format!("{n} with {free} free"))
            .collect();
        println!("    nodes: {}", summary.join(", "));
    }
    if nodes {
        println!(
            "  {:<24} {:>6} {:>6} {:>6}  STATE",
            "NODE", "GPUS", "FREE", "BOOKED"
        );
        for (n, node) in &p.nodes {
            let state = node_state(node);
            let free = node
                .devices
                .iter()
                .filter(|d| node.schedulable() && d.free())
                .count();
            let booked = node
                .devices
                .iter()
                .filter(|d| d.booked_by.is_some())
                .count();
            println!(
                "  {n:<24} {:>6} {free:>6} {booked:>6}  {state}",
                node.devices.len()
            );
        }
    }
    let waiting: Vec<_> = index
        .state()
        .reservations
        .values()
        .filter(|r| r.request.pool == name && matches!(r.phase, Phase::Pending | Phase::Queued))
        .collect();
    if !waiting.is_empty() {
        println!("  waiting:");
        for r in waiting.iter().take(20) {
            println!(
                "    {} {} x {} ({}) priority {}: {}",
                r.request.reservation,
                r.request.gpus,
                r.request.class,
                r.request.shape,
                r.request.priority,
                if r.reason.is_empty() {
                    r.phase.name()
                } else {
                    &r.reason
                }
            );
        }
        if waiting.len() > 20 {
            println!("    ... and {} more", waiting.len() - 20);
        }
    }
    let shares = projections::quota::fair_shares(index, name);
    if !shares.is_empty() {
        println!("  queues:");
        for q in shares {
            println!(
                "    {} (cohort {}, weight {}): {} holds {} of its {} nominal, its waiting requests ask for {}, fair share {}",
                q.queue,
                q.cohort.as_deref().unwrap_or("none"),
                q.weight,
                q.class,
                q.used,
                q.nominal,
                q.waiting,
                q.fair
            );
        }
    }
    Ok(())
}

/// `strata pool show --output json`: one object.
pub(crate) fn show_pool_json(index: &Index, name: &str, nodes: bool) -> Result<()> {
    let Some(p) = index.pool(name).filter(|p| p.created) else {
        return Err(crate::exit::not_found(format!(
            "pool {name:?} does not exist (see `strata pools`)"
        )));
    };
    let c = counts(index, name);
    let classes: Vec<_> = index
        .classes(name)
        .map(|(class, ci)| {
            serde_json::json!({
                "class": class,
                "gpus": ci.total,
                "free": ci.free,
                "booked": booked(index, name, class),
                "nodes_with_free": ci.schedulable_nodes(),
            })
        })
        .collect();
    let mut out = serde_json::json!({
        "pool": name,
        "description": p.description,
        "version": p.version,
        "nodes": c.nodes,
        "schedulable": c.schedulable,
        "live": c.live,
        "waiting": c.pending,
        "classes": classes,
        "queues": projections::quota::fair_shares(index, name),
    });
    if nodes {
        out["node_list"] = p
            .nodes
            .iter()
            .map(|(n, node)| {
                serde_json::json!({
                    "node": n,
                    "gpus": node.devices.len(),
                    "free": node.devices.iter().filter(|d| node.schedulable() && d.free()).count(),
                    "booked": node.devices.iter().filter(|d| d.booked_by.is_some()).count(),
                    "state": node_state(node),
                })
            })
            .collect();
    }
    crate::exit::print_json(&out);
    Ok(())
}

/// A node's standing as `pool show` prints it.
pub(crate) fn node_state(node: &projections::index::Node) -> String {
    if node.left {
        match node.left_reason.as_str() {
            "" => "left".to_string(),
            why => format!("left ({why})"),
        }
    } else if let Some(since) = node.unreachable_since_ms {
        format!("unreachable since {}", ms_time(since))
    } else if let Some(r) = &node.drained {
        match node.drain_deadline_ms {
            Some(at) => format!("draining {r} (live reservations end at {})", ms_time(at)),
            None => format!("drained {r}"),
        }
    } else if let Some(r) = &node.cordoned {
        format!("cordoned {r}")
    } else if !node.conditions.is_empty() {
        format!("unhealthy {}", node.conditions.join(","))
    } else {
        let sick: Vec<_> = node
            .devices
            .iter()
            .filter(|d| !d.conditions.is_empty())
            .map(|d| format!("{}:{}", d.spec.id, d.conditions.join("+")))
            .collect();
        if sick.is_empty() {
            "ready".into()
        } else {
            format!("ready, unhealthy devices {}", sick.join(" "))
        }
    }
}
