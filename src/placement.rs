//! `strata reserve`, `release`, `pools`, `pool ...` and `replay check`.

use crate::commands::{config, connect};
use crate::{Db, PoolCmd, ReplayCmd, ReserveArgs};
use anyhow::{bail, Context, Result};
use events::db::Sql;
use events::{Appender, AppenderConfig, Reader, ReaderConfig, Start};
use placer::client::{self, Outcome};
use projections::index::Phase;
use projections::{Index, Request, Shape};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::process::ExitCode;

pub(crate) fn appender(db: &Db) -> Result<Appender> {
    Ok(Appender::start(config(db)?, AppenderConfig::default()))
}

fn shape(args: &ReserveArgs) -> Result<(Shape, u32)> {
    match (args.nodes, args.gpus_per_node) {
        (Some(nodes), Some(gpus_per_node)) => {
            if args.shape.is_some() {
                bail!("--shape does not go with --nodes (a gang is its own shape)");
            }
            let total = nodes
                .checked_mul(gpus_per_node)
                .context("--nodes times --gpus-per-node is too large")?;
            if let Some(g) = args.gpus {
                if g != total {
                    bail!("--gpus {g} disagrees with --nodes {nodes} x --gpus-per-node {gpus_per_node} = {total}");
                }
            }
            Ok((
                Shape::Gang {
                    nodes,
                    gpus_per_node,
                },
                total,
            ))
        }
        _ => {
            let gpus = args.gpus.context("say how many GPUs with --gpus")?;
            let shape = match args.shape.as_deref().unwrap_or("any") {
                "node" => Shape::Node,
                "island" => Shape::Island,
                _ => Shape::Any,
            };
            Ok((shape, gpus))
        }
    }
}

/// The topology `--within`, `--prefer-within` or `--spread` asks for.
fn topology(args: &ReserveArgs) -> Option<projections::domain::Topology> {
    use projections::domain::{Tier, Topology};
    // clap admits only the tiers' names.
    let tier = |t: &str| Tier::parse(t).unwrap_or(Tier::Rack);
    match (&args.within, &args.prefer_within, &args.spread) {
        (Some(t), _, _) => Some(Topology::Within(tier(t))),
        (_, Some(t), _) => Some(Topology::Prefer(tier(t))),
        (_, _, Some(t)) => Some(Topology::Spread(tier(t))),
        _ => None,
    }
}

fn print_allocations(id: &str, allocs: &[projections::Allocation]) {
    let gpus: usize = allocs.iter().map(|a| a.devices.len()).sum();
    println!("placed {id}: {gpus} GPU(s) on {} node(s)", allocs.len());
    for a in allocs {
        println!("  {}: {}", a.node, a.devices.join(", "));
    }
}

pub async fn reserve(args: ReserveArgs) -> Result<ExitCode> {
    let (shape, gpus) = shape(&args)?;
    let id = args.id.clone().unwrap_or_else(client::new_id);
    let request = Request {
        reservation: id.clone(),
        pool: args.pool.clone(),
        class: args.class.clone(),
        gpus,
        shape,
        priority: args.priority,
        ttl_ms: args.ttl.map(|t| t.as_millis() as u64),
        replace_on_failure: args.replace_on_failure,
        replaces: None,
        topology: topology(&args),
        requeue_on_preemption: args.requeue_on_preemption,
        queue: args.queue.clone(),
    };
    request
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid reservation: {e}"))?;
    let db = connect(&args.db).await?;
    let appender = appender(&args.db)?;
    // Subscribe before asking, so the answer cannot slip past.
    let mut waiting = None;
    if args.wait {
        let mut rc = ReaderConfig::new(format!("strata_reserve_{}", std::process::id()));
        rc.temporary = true;
        rc.owner = "strata reserve --wait".into();
        let reader = Reader::start(config(&args.db)?, rc);
        let sub = reader
            .subscribe_ephemeral_as("reserve-wait", Start::Now)
            .await
            .context("subscribe to the log")?;
        waiting = Some((reader, sub));
    }
    client::reserve_as(&db, &appender, &request, &crate::nodes::asked_by()).await?;
    let Some((_reader, mut sub)) = waiting else {
        println!("requested {id}");
        return Ok(ExitCode::SUCCESS);
    };
    eprintln!("requested {id}; waiting for its placement");
    let outcome = tokio::time::timeout(
        args.timeout,
        client::wait(&mut sub, &id, |reason| {
            eprintln!("queued: {reason}");
            // Where it stands, once the log is read (the wait goes on).
            let (db, id) = (args.db.clone(), id.clone());
            tokio::spawn(async move { print_standing(&db, &id).await });
        }),
    )
    .await;
    match outcome {
        Err(_) => {
            eprintln!(
                "not placed after {}; it stays queued (see `strata reservations show {id}`)",
                humantime::format_duration(args.timeout),
            );
            print_standing(&args.db, &id).await;
            Ok(ExitCode::from(crate::exit::TIMED_OUT))
        }
        Ok(r) => match r? {
            Outcome::Placed(allocs) => {
                print_allocations(&id, &allocs);
                Ok(ExitCode::SUCCESS)
            }
            Outcome::Unschedulable(reason) => {
                println!("unschedulable {id}: {reason}");
                Ok(ExitCode::from(crate::exit::NEVER_FITS))
            }
            Outcome::Released => {
                println!("released {id} before it was placed");
                Ok(ExitCode::from(crate::exit::ENDED))
            }
            Outcome::Expired => {
                println!("expired {id}");
                Ok(ExitCode::from(crate::exit::ENDED))
            }
            Outcome::Failed(reason) => {
                println!("failed {id}: {reason}");
                Ok(ExitCode::from(crate::exit::ENDED))
            }
            Outcome::Preempted(reason) => {
                println!("preempted {id}: {reason}");
                Ok(ExitCode::from(crate::exit::ENDED))
            }
        },
    }
}

pub async fn release(db: &Db, id: &str, reason: &str) -> Result<ExitCode> {
    let appender = appender(db)?;
    client::release_as(&appender, id, reason, &crate::nodes::asked_by()).await?;
    println!("release of {id} requested; the pool's placer frees its GPUs");
    Ok(ExitCode::SUCCESS)
}

/// The index built from the whole log, with progress on a terminal.
pub(crate) async fn index(db: &Db) -> Result<Index> {
    index_until(db, None).await
}

/// The index as it was after `until` (the whole log when `None`).
async fn index_until(db: &Db, until: Option<u64>) -> Result<Index> {
    let client = connect(db).await?;
    let progress = std::sync::Arc::new(::replay::rebuild::Progress::default());
    let display = crate::replay_cmd::progress_display("reading the log".into(), progress.clone());
    let index = ::replay::rebuild::from_postgres(
        &config(db)?,
        &client,
        Index::new(),
        until,
        progress,
        |v| eprintln!("warning: the log breaks an invariant: {v}"),
    )
    .await;
    crate::replay_cmd::stop_display(display);
    index.context("read the log")
}

/// The last position recorded at or before an RFC 3339 time.
pub async fn position_at(db: &Db, at: &str) -> Result<u64> {
    let t = humantime::parse_rfc3339_weak(at)
        .map_err(|_| anyhow::anyhow!("--at {at:?}: a time such as 2026-11-30T10:00:00Z"))?;
    let client = connect(db).await?;
    let p: Option<i64> = client
        .one(
            "SELECT max(position) FROM strata.events WHERE recorded_at <= $1",
            &[&t],
        )
        .await?
        .get(0);
    Ok(p.unwrap_or(0) as u64)
}

struct Counts {
    nodes: usize,
    schedulable: usize,
    pending: usize,
    live: usize,
}

fn counts(index: &Index, pool: &str) -> Counts {
    let p = index.pool(pool).expect("listed");
    let q = index.queues(pool);
    Counts {
        nodes: p.nodes.values().filter(|n| !n.left).count(),
        schedulable: p.nodes.values().filter(|n| n.schedulable()).count(),
        pending: q.map_or(0, |q| q.pending.len() + q.queued.len()),
        live: index
            .state()
            .reservations
            .values()
            .filter(|r| r.request.pool == pool && r.phase.is_live())
            .count(),
    }
}

/// Prints where a waiting reservation stands (to stderr); nothing when it
/// does not wait or the log cannot be read.
async fn print_standing(db: &Db, id: &str) {
    let Ok(index) = index(db).await else { return };
    let Some(s) = projections::waiting::standing(&index, id, now_ms()) else {
        return;
    };
    eprintln!(
        "  {}: position {} of {} waiting; {} GPUs of its class asked for ahead of it, {} free; earliest start {}",
        s.why,
        s.position,
        s.waiting,
        s.ahead_gpus,
        s.free_now,
        s.earliest_start_ms
            .map_or("unknown (nothing live with a time limit frees enough)".into(), ms_time)
    );
}

/// Unix milliseconds now.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A reservation of the index as JSON, with its standing while it waits.
fn reservation_json(
    index: &Index,
    r: &projections::index::Reservation,
    now: u64,
) -> serde_json::Value {
    let id = &r.request.reservation;
    let mut out = serde_json::json!({
        "reservation": id,
        "pool": r.request.pool,
        "class": r.request.class,
        "gpus": r.request.gpus,
        "shape": r.request.shape,
        "priority": r.request.priority,
        "queue": r.request.queue,
        "ttl_ms": r.request.ttl_ms,
        "phase": r.phase.name(),
        "requested_at_position": r.requested_at,
    });
    if let Some(by) = &r.preempted_by {
        out["preempted_by"] = by.clone().into();
        out["preemption"] = r.preempt_reason.clone().into();
        out["preempted_at"] = r.preempt_deadline_ms.map(ms_time).into();
    }
    if r.phase.is_live() {
        out["allocations"] = serde_json::to_value(&r.allocations).unwrap_or_default();
        out["placed_at"] = r.placed_at_ms.map(ms_time).into();
        out["expires_at"] = r.expires_at_ms.map(ms_time).into();
        out["release_requested"] = r.release_requested.into();
    }
    if let Some(s) = projections::waiting::standing(index, id, now) {
        let mut w = serde_json::to_value(&s).unwrap_or_default();
        w["earliest_start"] = s.earliest_start_ms.map(ms_time).into();
        out["waiting"] = w;
    }
    out
}

/// `strata reservations show|list`.
pub async fn reservations(cmd: crate::ReservationsCmd) -> Result<ExitCode> {
    let now = now_ms();
    match cmd {
        crate::ReservationsCmd::Show { db, id } => {
            let index = index(&db).await?;
            let Some(r) = index.reservation(&id) else {
                // Not live or waiting: ended, or never asked for.
                let client = connect(&db).await?;
                return match projections::requests::outcome(&client, &id).await? {
                    Some(outcome) => {
                        if crate::exit::json() {
                            crate::exit::print_json(&serde_json::json!({
                                "reservation": id, "phase": "ended", "outcome": outcome,
                            }));
                        } else {
                            println!("reservation {id}: ended ({outcome})");
                        }
                        Ok(ExitCode::SUCCESS)
                    }
                    None => Err(crate::exit::not_found(format!(
                        "reservation {id:?} does not exist"
                    ))),
                };
            };
            if crate::exit::json() {
                crate::exit::print_json(&reservation_json(&index, r, now));
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "reservation {id}: {} x {} ({}) in pool {}{}, priority {}",
                r.request.gpus,
                r.request.class,
                r.request.shape,
                r.request.pool,
                r.request
                    .queue
                    .as_deref()
                    .map_or(String::new(), |q| format!(", queue {q}")),
                r.request.priority
            );
            println!("  {}", r.phase.name());
            if r.phase.is_live() {
                for a in &r.allocations {
                    println!("  on {}: {}", a.node, a.devices.join(", "));
                }
                if let Some(at) = r.expires_at_ms {
                    println!("  expires at {}", ms_time(at));
                }
                if let Some(by) = &r.preempted_by {
                    println!(
                        "  being preempted ({}) for {by}: it ends at {}",
                        r.preempt_reason,
                        r.preempt_deadline_ms.map_or("once seen".into(), ms_time)
                    );
                }
            }
            if let Some(s) = projections::waiting::standing(&index, &id, now) {
                println!(
                    "  waits: {} (position {} of {} waiting in the {})",
                    s.why,
                    s.position,
                    s.waiting,
                    s.queue
                        .as_deref()
                        .map_or("pool".to_string(), |q| format!("queue {q}"))
                );
                if !s.reason.is_empty() {
                    println!("  the placer said: {}", s.reason);
                }
                println!(
                    "  {} GPUs of its class free now; {} asked for by the requests ahead of it",
                    s.free_now, s.ahead_gpus
                );
                match s.earliest_start_ms {
                    Some(at) => println!(
                        "  earliest start: {} (as live reservations' time runs out; sooner if one is released)",
                        ms_time(at)
                    ),
                    None => println!(
                        "  earliest start: unknown: the live reservations with a time limit do not free enough GPUs of its class"
                    ),
                }
            }
        }
        crate::ReservationsCmd::List { db, pool } => {
            let index = index(&db).await?;
            let mut all: Vec<_> = index
                .state()
                .reservations
                .values()
                .filter(|r| pool.as_ref().is_none_or(|p| *p == r.request.pool))
                .collect();
            // Live first, then waiting in the order they are tried.
            all.sort_by_key(|r| {
                (
                    r.request.pool.clone(),
                    !r.phase.is_live(),
                    std::cmp::Reverse(r.request.priority),
                    r.requested_at,
                )
            });
            if crate::exit::json() {
                for r in all {
                    crate::exit::print_json(&reservation_json(&index, r, now));
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<36} {:<16} {:<14} {:>5} {:>8} {:<8}  WHY",
                "RESERVATION", "POOL", "CLASS", "GPUS", "PRIORITY", "PHASE"
            );
            for r in all {
                let why = projections::waiting::standing(&index, &r.request.reservation, now)
                    .map(|s| s.why)
                    .unwrap_or_default();
                println!(
                    "{:<36} {:<16} {:<14} {:>5} {:>8} {:<8}  {why}",
                    r.request.reservation,
                    r.request.pool,
                    r.request.class,
                    r.request.gpus,
                    r.request.priority,
                    r.phase.name()
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn pools(db: &Db) -> Result<ExitCode> {
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

fn booked(index: &Index, pool: &str, class: &str) -> usize {
    index.pool(pool).map_or(0, |p| {
        p.nodes
            .values()
            .flat_map(|n| &n.devices)
            .filter(|d| d.spec.class == class && d.booked_by.is_some())
            .count()
    })
}

pub async fn pool(cmd: PoolCmd) -> Result<ExitCode> {
    match cmd {
        PoolCmd::Create {
            db,
            name,
            description,
        } => {
            client::create_pool(&appender(&db)?, &name, &description).await?;
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
            let fleet = client::uniform_fleet(&prefix, nodes, &class, gpus, per_island);
            let tty = std::io::stderr().is_terminal();
            let n = client::join_nodes(&appender(&db)?, &name, fleet, |done| {
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
                client::label_nodes(&appender(&db)?, &name, labels).await?;
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

/// Unix milliseconds as an RFC 3339 time (seconds).
fn ms_time(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

/// Prints a pool as `strata pool show` does.
fn show_pool(index: &Index, name: &str, nodes: bool) -> Result<()> {
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
fn show_pool_json(index: &Index, name: &str, nodes: bool) -> Result<()> {
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
fn node_state(node: &projections::index::Node) -> String {
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

pub async fn replay(cmd: ReplayCmd) -> Result<ExitCode> {
    match cmd {
        ReplayCmd::Run(args) => crate::replay_cmd::run(args).await,
        ReplayCmd::State {
            db,
            pool,
            at,
            nodes,
        } => {
            let until = position_at(&db, &at).await?;
            let index = index_until(&db, Some(until)).await?;
            if crate::exit::json() {
                show_pool_json(&index, &pool, nodes)?;
            } else {
                println!("as of {at} (position {until}):");
                show_pool(&index, &pool, nodes)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        ReplayCmd::Stream { db, stream, at } => {
            let until = match &at {
                Some(t) => Some(position_at(&db, t).await?),
                None => None,
            };
            let client = connect(&db).await?;
            let events = events::read::stream(&client, &stream)
                .await
                .context("read the stream")?;
            if events.is_empty() {
                bail!("stream {stream:?} has no events");
            }
            for e in events
                .iter()
                .filter(|e| until.is_none_or(|u| e.position.0 <= u))
            {
                println!("{}", e.to_json_line());
            }
            Ok(ExitCode::SUCCESS)
        }
        ReplayCmd::Invariants { db, json } => {
            let client = connect(&db).await?;
            let r = ::replay::invariants::check(&client)
                .await
                .context("check the log's invariants")?;
            if json || crate::exit::json() {
                println!("{}", serde_json::to_string(&r)?);
            } else if r.violations.is_empty() {
                println!(
                    "ok: {} events in {} streams, {} placements; no violation",
                    r.events, r.streams, r.placements
                );
            }
            for v in &r.violations {
                if !json {
                    println!(
                        "violation ({}): {} at positions {:?}",
                        v.invariant, v.detail, v.positions
                    );
                }
            }
            Ok(if r.violations.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        ReplayCmd::Check { db, json } => {
            let client = connect(&db).await?;
            let tty = std::io::stderr().is_terminal();
            let result = projections::check::check(&client, |p| {
                if tty {
                    eprint!("\rchecked up to position {p}");
                }
            })
            .await;
            if tty {
                eprint!("\r\x1b[K");
            }
            match result {
                Ok(r) => {
                    if json || crate::exit::json() {
                        println!("{}", serde_json::to_string(&r)?);
                    } else {
                        println!(
                            "ok: {} events up to position {}; {} pools, {} nodes, {} devices ({} booked), {} live and {} waiting reservations",
                            r.events, r.position, r.pools, r.nodes, r.devices, r.booked_devices, r.live, r.pending
                        );
                    }
                    Ok(ExitCode::SUCCESS)
                }
                Err(projections::check::CheckError::Read(e)) => Err(e).context("replay the log"),
                Err(e) => {
                    println!("violation: {e}");
                    Ok(ExitCode::from(1))
                }
            }
        }
    }
}
