//! `strata reserve` and `strata release`.

use crate::cli::appender;
use crate::cli::asked_by;
use crate::cli::config;
use crate::cli::connect;
use crate::cli::DbArgs;
use crate::cmd::reservations::print_standing;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Args;
use domain::requests::Outcome;
use domain::Request;
use domain::Shape;
use events::Reader;
use events::ReaderConfig;
use events::Start;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub(crate) struct ReserveArgs {
    #[command(flatten)]
    pub db: DbArgs,
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
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "duration")]
    pub ttl: Option<std::time::Duration>,
    /// Reserve in advance, from this time (e.g. 2026-12-08T09:00:00Z), for --duration: the pool's placer promises the GPUs now or refuses with why (exit 3), holds them free from the start (work that ends before it may still use them) and places the reservation then
    #[arg(long, requires = "duration")]
    pub start: Option<String>,
    /// How long a reservation in advance lasts from its start (e.g. 12h)
    #[arg(long, value_parser = humantime::parse_duration, requires = "start")]
    pub duration: Option<std::time::Duration>,
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

pub(crate) fn shape(args: &ReserveArgs) -> Result<(Shape, u32)> {
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
pub(crate) fn topology(args: &ReserveArgs) -> Option<domain::Topology> {
    use domain::{Tier, Topology};
    // clap admits only the tiers' names.
    let tier = |t: &str| Tier::parse(t).unwrap_or(Tier::Rack);
    match (&args.within, &args.prefer_within, &args.spread) {
        (Some(t), _, _) => Some(Topology::Within(tier(t))),
        (_, Some(t), _) => Some(Topology::Prefer(tier(t))),
        (_, _, Some(t)) => Some(Topology::Spread(tier(t))),
        _ => None,
    }
}

pub(crate) fn print_allocations(id: &str, allocs: &[domain::Allocation]) {
    let gpus: usize = allocs.iter().map(|a| a.devices.len()).sum();
    println!("placed {id}: {gpus} GPU(s) on {} node(s)", allocs.len());
    for a in allocs {
        println!("  {}: {}", a.node, a.devices.join(", "));
    }
    println!(
        "  containers on its node(s) get its GPUs with --device {} once it is bound",
        node::cdi::qualified_name(id)
    );
}

pub(crate) async fn reserve(args: ReserveArgs) -> Result<ExitCode> {
    let (shape, gpus) = shape(&args)?;
    let id = args.id.clone().unwrap_or_else(|| domain::new_id("r"));
    let start_ms = match &args.start {
        Some(t) => {
            let t = humantime::parse_rfc3339_weak(t).map_err(|_| {
                anyhow::anyhow!("--start {t:?}: a time such as 2026-12-08T09:00:00Z")
            })?;
            let ms = t
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            if ms <= crate::cmd::reservations::now_ms() {
                bail!(
                    "--start {}: that is past; leave --start out to be placed as soon as it fits",
                    args.start.as_deref().unwrap_or_default()
                );
            }
            Some(ms)
        }
        None => None,
    };
    let ttl = args.ttl.or(args.duration);
    let request = Request {
        reservation: id.clone(),
        pool: args.pool.clone(),
        class: args.class.clone(),
        gpus,
        shape,
        priority: args.priority,
        ttl_ms: ttl.map(|t| t.as_millis() as u64),
        replace_on_failure: args.replace_on_failure,
        replaces: None,
        topology: topology(&args),
        requeue_on_preemption: args.requeue_on_preemption,
        start_ms,
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
    domain::requests::reserve(&db, &appender, &request, Some(&asked_by())).await?;
    let Some((_reader, mut sub)) = waiting else {
        println!("requested {id}");
        return Ok(ExitCode::SUCCESS);
    };
    eprintln!("requested {id}; waiting for its placement");
    let outcome = tokio::time::timeout(
        args.timeout,
        domain::requests::wait(&mut sub, &id, |reason| {
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
            Outcome::Promised {
                allocations,
                start_ms,
                end_ms,
            } => {
                let gpus: usize = allocations.iter().map(|a| a.devices.len()).sum();
                println!(
                    "promised {id}: {gpus} GPU(s) on {} node(s) from {} to {}; it is placed at its start",
                    allocations.len(),
                    crate::cli::ms_time(start_ms),
                    crate::cli::ms_time(end_ms)
                );
                for a in &allocations {
                    println!("  {}: {}", a.node, a.devices.join(", "));
                }
                Ok(ExitCode::SUCCESS)
            }
            Outcome::Rejected(reason) => {
                println!("rejected {id}: {reason}");
                Ok(ExitCode::from(crate::exit::REJECTED))
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

pub(crate) async fn release(db: &DbArgs, id: &str, reason: &str) -> Result<ExitCode> {
    let appender = appender(db)?;
    domain::requests::release(&appender, id, reason, Some(&asked_by())).await?;
    println!("release of {id} requested; the pool's placer frees its GPUs");
    Ok(ExitCode::SUCCESS)
}
