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
    /// How the pool's placer acts on GPU faults: automatically (quarantine a GPU, drain a node, end what ran there) or advisory (report only), under a circuit breaker; whether it preempts; and the DCGM level of its nodes' acceptance checks. Without options, shows it
    Policy {
        #[command(flatten)]
        db: DbArgs,
        name: String,
        /// automatic: the placer quarantines GPUs and drains nodes as each fault asks; advisory: faults are reported (device.quarantine_withheld) and an operator acts
        #[arg(long, value_parser = ["automatic", "advisory"])]
        faults: Option<String>,
        /// The circuit breaker: the most of the pool's GPUs out of service for faults at once, in percent (one GPU at least unless 0); past it, faults are reported and an alert fires instead
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=100))]
        max_quarantined: Option<u32>,
        /// The `dcgmi diag` level of its nodes' acceptance checks (1: quick, 2: medium, 3: long, 4: extended; 0: not run), told to each node when its session opens; nodes without DCGM, and simulated ones, ignore it [default: each node's own --dcgm-level]
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=4))]
        dcgm_level: Option<u32>,
        /// on (the default): a waiting request of higher priority makes room by ending the fewest live reservations of lower priority after the grace period (serve --preemption-grace), in its queue or, without queues, in the pool; queues also take back what they lent. off: requests wait
        #[arg(long, value_parser = ["on", "off"])]
        preemption: Option<String>,
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
        PoolCmd::Policy {
            db,
            name,
            faults,
            max_quarantined,
            dcgm_level,
            preemption,
        } => {
            let index = index(&db).await?;
            let Some(p) = index.pool(&name).filter(|p| p.created) else {
                return Err(crate::exit::not_found(format!(
                    "pool {name:?} does not exist (see `strata pools`)"
                )));
            };
            let mut policy = p.fault_policy();
            if faults.is_some() || max_quarantined.is_some() {
                if let Some(f) = &faults {
                    policy.automatic = f == "automatic";
                }
                if let Some(m) = max_quarantined {
                    policy.max_quarantined_percent = m;
                }
                let who = crate::cli::asked_by();
                domain::pools::set_fault_policy(&appender(&db)?, &name, policy, Some(&who)).await?;
            }
            let mut preempts = !p.preemption_off;
            if let Some(on) = &preemption {
                preempts = on == "on";
                let who = crate::cli::asked_by();
                domain::pools::set_preemption(&appender(&db)?, &name, preempts, Some(&who)).await?;
            }
            if let Some(level) = dcgm_level {
                let who = crate::cli::asked_by();
                gateway::dcgm_level::set(&appender(&db)?, &name, level, Some(&who)).await?;
            }
            let client = crate::cli::connect(&db).await?;
            let level = gateway::dcgm_level::level(&client, &name).await?;
            let (total, out) = p.fault_budget();
            if crate::exit::json() {
                crate::exit::print_json(&serde_json::json!({
                    "pool": name,
                    "faults": policy.mode(),
                    "max_quarantined_percent": policy.max_quarantined_percent,
                    "gpus": total,
                    "out_of_service_for_faults": out,
                    "dcgm_level": level,
                    "preemption": preempts,
                }));
            } else {
                println!(
                    "pool {name}: faults {}, circuit breaker {}% ({} of {total} GPUs); {out} out of service for faults now",
                    policy.mode(),
                    policy.max_quarantined_percent,
                    policy.limit(total)
                );
                println!(
                    "  preemption {}",
                    if preempts {
                        "on: higher priorities make room, after the grace period"
                    } else {
                        "off: requests wait"
                    }
                );
                match level {
                    Some(l) => println!("  acceptance checks run dcgmi diag -r {l} where DCGM is installed (told to each node when its session opens)"),
                    None => println!("  acceptance checks run dcgmi diag at each node's own --dcgm-level"),
                }
            }
        }
        PoolCmd::Show { db, name, nodes } => {
            let index = index(&db).await?;
            let now = crate::cmd::reservations::now_ms();
            if crate::exit::json() {
                show_pool_json(&index, &name, nodes, now)?;
            } else {
                show_pool(&index, &name, nodes, now)?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints a pool as `strata pool show` does, its queues' past usage
/// decayed to `at_ms`.
pub(crate) fn show_pool(index: &Index, name: &str, nodes: bool, at_ms: u64) -> Result<()> {
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
    let (total, out) = p.fault_budget();
    let policy = p.fault_policy();
    let held = quarantined(p);
    println!(
        "  faults: {} (circuit breaker {}%: {} GPUs); {out} of {total} GPUs out of service for faults{}",
        policy.mode(),
        policy.max_quarantined_percent,
        policy.limit(total),
        match held.len() {
            0 => String::new(),
            n => format!(", {n} quarantined: {}", held.join(" ")),
        }
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
            let free = node_free(node);
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
    let shares = projections::quota::fair_shares(index, name, at_ms);
    if !shares.is_empty() {
        println!("  queues:");
        for q in shares {
            println!(
                "    {} (cohort {}, weight {}): {} holds {} of its {} nominal, its waiting requests ask for {}, fair share {}; {}",
                q.queue,
                q.cohort.as_deref().unwrap_or("none"),
                q.weight,
                q.class,
                q.used,
                q.nominal,
                q.waiting,
                q.fair,
                crate::cmd::queues::past_words(&q)
            );
        }
    }
    Ok(())
}

/// `strata pool show --output json`: one object.
pub(crate) fn show_pool_json(index: &Index, name: &str, nodes: bool, at_ms: u64) -> Result<()> {
    let Some(p) = index.pool(name).filter(|p| p.created) else {
        return Err(crate::exit::not_found(format!(
            "pool {name:?} does not exist (see `strata pools`)"
        )));
    };
    let c = counts(index, name);
    let policy = p.fault_policy();
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
        "queues": projections::quota::fair_shares(index, name, at_ms),
        "faults": {
            "policy": policy.mode(),
            "max_quarantined_percent": policy.max_quarantined_percent,
            "out_of_service": p.fault_budget().1,
            "quarantined": quarantined(p),
        },
    });
    if nodes {
        out["node_list"] = p
            .nodes
            .iter()
            .map(|(n, node)| {
                serde_json::json!({
                    "node": n,
                    "gpus": node.devices.len(),
                    "free": node_free(node),
                    "booked": node.devices.iter().filter(|d| d.booked_by.is_some()).count(),
                    "state": node_state(node),
                })
            })
            .collect();
    }
    crate::exit::print_json(&out);
    Ok(())
}

/// Devices of a node that may be booked now (none on an unschedulable node).
fn node_free(node: &projections::index::Node) -> usize {
    if !node.schedulable() {
        return 0;
    }
    node.free_devices().into_iter().filter(|f| *f).count()
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
    } else if let Some(why) = &node.acceptance_failed {
        format!("failed its acceptance check: {why}")
    } else if let Some(f) = &node.fault {
        format!("fault {f}: waiting for the pool's placer to act")
    } else {
        // Per GPU: quarantined, a fault waiting, or conditions that keep it
        // in service (what they ask for in brackets).
        let sick: Vec<_> = node
            .devices
            .iter()
            .filter_map(|d| {
                let id = &d.spec.id;
                if let Some(q) = &d.quarantine {
                    Some(format!("{id} quarantined ({q})"))
                } else if let Some(f) = &d.fault {
                    Some(format!("{id} fault {f} waiting"))
                } else if d.failed_acceptance {
                    Some(format!("{id} failed its acceptance check"))
                } else if d.conditions.is_empty() {
                    None
                } else {
                    Some(format!("{id} {}", with_actions(&d.conditions)))
                }
            })
            .collect();
        let own = if node.conditions.is_empty() {
            String::new()
        } else {
            format!(", node {}", with_actions(&node.conditions))
        };
        if sick.is_empty() {
            format!("ready{own}")
        } else {
            format!("ready{own}, {}", sick.join("; "))
        }
    }
}

/// Conditions with what each asks for: `XID-13 (restart_workload)`.
fn with_actions(conditions: &[String]) -> String {
    conditions
        .iter()
        .map(|c| format!("{c} ({})", domain::faults::classify(c).action.name()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The pool's quarantined GPUs: `node/gpu (condition)`.
fn quarantined(p: &projections::index::Pool) -> Vec<String> {
    p.nodes
        .iter()
        .flat_map(|(n, node)| {
            node.devices.iter().filter_map(move |d| {
                d.quarantine
                    .as_ref()
                    .map(|q| format!("{n}/{} ({q})", d.spec.id))
            })
        })
        .collect()
}
