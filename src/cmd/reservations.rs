//! `strata reservations list|show`: where each reservation stands, why
//! one waits, how one ended.

use crate::cli::connect;
use crate::cli::index;
use crate::cli::ms_time;
use crate::cli::DbArgs;
use anyhow::Result;
use clap::Subcommand;
use projections::Index;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum ReservationsCmd {
    /// One reservation: its request, its phase, its devices once placed; while it waits, why (the placer's reason, how many requests are ahead of it in its pool, the GPUs they ask for) and its earliest start from the live reservations' expiries. Exit 6 if there is no such reservation
    Show {
        #[command(flatten)]
        db: DbArgs,
        /// The reservation's id
        id: String,
    },
    /// Reservations waiting or live, in the order each pool's placer tries them
    List {
        #[command(flatten)]
        db: DbArgs,
        /// Only this pool
        #[arg(long)]
        pool: Option<String>,
        /// Only what is promised: reservations in advance waiting for their start, and maintenance windows to come, by start
        #[arg(long)]
        future: bool,
    },
}

pub(crate) struct Counts {
    pub nodes: usize,
    pub schedulable: usize,
    pub pending: usize,
    pub live: usize,
}

pub(crate) fn counts(index: &Index, pool: &str) -> Counts {
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
pub(crate) async fn print_standing(db: &DbArgs, id: &str) {
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
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A reservation of the index as JSON, with its standing while it waits.
pub(crate) fn reservation_json(
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
    if let Some(p) = &r.promise {
        out["promise"] = serde_json::json!({
            "start": ms_time(p.start_ms),
            "end": ms_time(p.end_ms),
            "allocations": p.allocations,
        });
    }
    if r.phase.is_live() {
        out["allocations"] = serde_json::to_value(&r.allocations).unwrap_or_default();
        out["cdi_device"] = node::cdi::qualified_name(&r.request.reservation).into();
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

/// `strata reservations list --future`: what is promised, by start:
/// reservations in advance and maintenance windows not begun.
fn list_future(index: &Index, pool: Option<&str>, now: u64) {
    let mut rows: Vec<(u64, serde_json::Value)> = Vec::new();
    for (name, p) in &index.state().pools {
        if pool.is_some_and(|only| only != name) {
            continue;
        }
        for (_, id) in index
            .queues(name)
            .into_iter()
            .flat_map(|q| q.promised.iter())
        {
            let Some(r) = index.reservation(id) else {
                continue;
            };
            let Some(promise) = &r.promise else {
                continue;
            };
            let gpus: usize = promise.allocations.iter().map(|a| a.devices.len()).sum();
            rows.push((
                promise.start_ms,
                serde_json::json!({
                    "kind": "reservation",
                    "id": id,
                    "pool": name,
                    "class": r.request.class,
                    "gpus": gpus,
                    "nodes": promise.allocations.len(),
                    "start": ms_time(promise.start_ms),
                    "end": ms_time(promise.end_ms),
                }),
            ));
        }
        for (node, n) in &p.nodes {
            for w in n.maintenance.iter().filter(|w| w.end_ms > now) {
                rows.push((
                    w.start_ms,
                    serde_json::json!({
                        "kind": "maintenance",
                        "id": node,
                        "pool": name,
                        "gpus": n.devices.len(),
                        "nodes": 1,
                        "start": ms_time(w.start_ms),
                        "end": ms_time(w.end_ms),
                        "reason": w.reason,
                    }),
                ));
            }
        }
    }
    rows.sort_by(|a, b| (a.0, a.1["id"].as_str()).cmp(&(b.0, b.1["id"].as_str())));
    if crate::exit::json() {
        for (_, row) in rows {
            crate::exit::print_json(&row);
        }
        return;
    }
    println!(
        "{:<12} {:<36} {:<16} {:>5} {:>5}  {:<20} {:<20}",
        "KIND", "ID", "POOL", "GPUS", "NODES", "START", "END"
    );
    for (_, r) in rows {
        println!(
            "{:<12} {:<36} {:<16} {:>5} {:>5}  {:<20} {:<20}",
            r["kind"].as_str().unwrap_or_default(),
            r["id"].as_str().unwrap_or_default(),
            r["pool"].as_str().unwrap_or_default(),
            r["gpus"],
            r["nodes"],
            r["start"].as_str().unwrap_or_default(),
            r["end"].as_str().unwrap_or_default()
        );
    }
}

/// `strata reservations show|list`.
pub(crate) async fn reservations(cmd: ReservationsCmd) -> Result<ExitCode> {
    let now = now_ms();
    match cmd {
        ReservationsCmd::Show { db, id } => {
            let index = index(&db).await?;
            let Some(r) = index.reservation(&id) else {
                // Not live or waiting: ended, or never asked for.
                let client = connect(&db).await?;
                return match domain::requests::outcome(&client, &id).await? {
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
                println!(
                    "  CDI device: {} (e.g. podman run --device {0} IMAGE)",
                    node::cdi::qualified_name(&id)
                );
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
        ReservationsCmd::List { db, pool, future } if future => {
            let index = index(&db).await?;
            list_future(&index, pool.as_deref(), now);
        }
        ReservationsCmd::List { db, pool, .. } => {
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
