//! `bench placements`: reservations placed end to end, against plain
//! PostgreSQL inserts in the same run.
//!
//! A fleet of 8-GPU nodes joins by events; a placer runs in this process
//! (one pool lease per pool) and a separate subscription watches the log for
//! outcomes. Phases, in order, each on what the previous left free:
//!
//! 1. latency: 1-GPU requests at a fixed offered rate; each request's
//!    `reservation.requested` commit to its `reservation.placed` seen by the
//!    watching subscription;
//! 2. throughput, 1-GPU requests: as many as the generator can offer;
//! 3. throughput, a mix of 1, 2, 4 and 8 GPUs and 2-node gangs of 8;
//! 4. multi-tenant (`tenants.rs`), on a pool of its own as large as the
//!    fleet: 16 queues in 2 cohorts with quotas summing to the pool, demand
//!    at 150% of it, then requests of high priority placed by preemption
//!    with a short grace period; then the same on a pool alike whose
//!    cohorts' fair share remembers past usage;
//! 5. backfill (`backfill.rs`): gangs behind a stream of small requests,
//!    then a whole pool reserved in advance behind short ones;
//! 6. MIG (`mig.rs`): 1-GPU requests on a pool where a tenth of the GPUs
//!    are split into MIG instances, against a pool of whole GPUs.
//!
//! Then: the index built from the whole log, written as a snapshot and
//! loaded again (and a synthetic 100,000-GPU index, when the fleet is
//! smaller), and the invariant check over the whole log. The baseline is
//! the 64-row multi-row INSERT (4 clients) on the same PostgreSQL.

use crate::append::{prepare_raw, raw_multirow};
use crate::util::{self, percentile_ms, round};
use anyhow::{bail, Context, Result};
use domain::reservation_stream;
use domain::{Fact, Request, Shape};
use events::{Appender, AppenderConfig, ExpectedVersion, Reader, ReaderConfig, Start};
use placer::{Placer, PlacerConfig};
use projections::testing::Log;
use projections::{check, projector, snapshot, Index, SnapshotStore};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod backfill;
mod mig;
mod tenants;

const CLASS: &str = "H100-80GB";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Nodes in the fleet (8 GPUs each)
    #[arg(long, default_value_t = 10_000)]
    nodes: u32,
    /// Pools the nodes are split over
    #[arg(long, default_value_t = 1)]
    pools: u32,
    /// A short run: a 3-second latency phase, smaller throughput phases
    #[arg(long)]
    quick: bool,
    /// Offered requests per second in the latency phase
    #[arg(long, default_value_t = 1000)]
    offered: u32,
    /// Seconds of the latency phase (default 3 quick, 10 full)
    #[arg(long)]
    latency_seconds: Option<u64>,
    /// The placer's largest batch
    #[arg(long, default_value_t = 1024)]
    max_batch: usize,
    /// Concurrent clients offering requests in the throughput phases
    #[arg(long, default_value_t = 256)]
    clients: usize,
    /// Nodes of the multi-tenant phase's own pool (default: --nodes; 0 skips the phase)
    #[arg(long)]
    tenant_nodes: Option<u32>,
    /// The preemption grace period in the multi-tenant phase
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    grace: Duration,
    /// Requests of high priority placed by preemption (default 200, 50 quick)
    #[arg(long)]
    high: Option<u64>,
    /// Nodes of each of the backfill phase's two pools (default 1,000, 200 quick; 0 skips the phase)
    #[arg(long)]
    backfill_nodes: Option<u32>,
    /// Nodes of each of the MIG phase's two pools (default --nodes, 1,000 quick; 0 skips the phase)
    #[arg(long)]
    mig_nodes: Option<u32>,
}

/// What the watching subscription saw, by reservation.
#[derive(Default)]
struct Seen {
    placed: AtomicU64,
    /// Devices of the placements seen.
    placed_devices: AtomicU64,
    decided: AtomicU64,
    queued: AtomicU64,
    preempted: AtomicU64,
    at: Mutex<HashMap<String, Instant>>,
}

async fn watch(reader: Reader, seen: Arc<Seen>) -> Result<()> {
    let mut sub = reader.subscribe_ephemeral(Start::Now).await?;
    loop {
        let e = sub.next().await?;
        sub.ack(e.position);
        if !e.stream.starts_with("pool/") {
            continue;
        }
        let Ok(Some(fact)) = Fact::parse(&e.event_type, &e.payload, &e.metadata) else {
            continue;
        };
        let now = Instant::now();
        match fact {
            Fact::ReservationPlaced {
                reservation,
                allocations,
                ..
            } => {
                seen.at.lock().expect("seen lock").insert(reservation, now);
                seen.placed.fetch_add(1, Ordering::Relaxed);
                let devices: usize = allocations.iter().map(|a| a.devices.len()).sum();
                seen.placed_devices
                    .fetch_add(devices as u64, Ordering::Relaxed);
                seen.decided.fetch_add(1, Ordering::Relaxed);
            }
            Fact::ReservationQueued { .. } | Fact::ReservationRejected { .. } => {
                seen.queued.fetch_add(1, Ordering::Relaxed);
                seen.decided.fetch_add(1, Ordering::Relaxed);
            }
            Fact::ReservationPreempted { .. } => {
                seen.preempted.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}

/// A request of `gpus` H100s in `pool`, shaped `shape`, priority 0.
pub(crate) fn request(id: String, pool: &str, gpus: u32, shape: Shape) -> Request {
    domain::demand::request(id, pool, CLASS, gpus, shape)
}

async fn offer(appender: &Appender, r: &Request) -> Result<()> {
    appender
        .append(
            &reservation_stream(&r.reservation),
            ExpectedVersion::NoStream,
            vec![Fact::ReservationRequested(r.clone()).to_event()],
        )
        .await
        .with_context(|| format!("request {}", r.reservation))?;
    Ok(())
}

/// Waits until `counter` reaches `target`; returns when it did.
async fn until(counter: &AtomicU64, target: u64, limit: Duration) -> Result<Instant> {
    let deadline = Instant::now() + limit;
    loop {
        if counter.load(Ordering::Relaxed) >= target {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!(
                "stalled at {} of {target} after {limit:?}",
                counter.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Offers `requests` from `clients` concurrent clients as fast as they go.
/// Returns the seconds until all were decided (placed, queued or refused).
async fn flood(
    appender: &Appender,
    seen: &Seen,
    requests: Vec<Request>,
    clients: usize,
) -> Result<(f64, f64)> {
    let n = requests.len() as u64;
    let target = seen.decided.load(Ordering::Relaxed) + n;
    let requests = Arc::new(requests);
    let next = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (appender, requests, next) = (appender.clone(), requests.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(r) = requests.get(i) else {
                    return anyhow::Ok(());
                };
                offer(&appender, r).await?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let offered_secs = t0.elapsed().as_secs_f64();
    let done = until(&seen.decided, target, Duration::from_secs(300)).await?;
    Ok(((done - t0).as_secs_f64(), offered_secs))
}

/// Waits until the placer's counters satisfy `done`, for at most 120 s
/// from `since`; fails, saying it did not `what`, when it runs out or the
/// placer stops.
async fn until_placer(
    placer: &Placer,
    since: Instant,
    what: &str,
    done: impl Fn(&placer::StatsView) -> bool,
) -> Result<()> {
    let stats = placer.stats();
    loop {
        let v = stats.view();
        if done(&v) {
            return Ok(());
        }
        if since.elapsed() > Duration::from_secs(120) || placer.is_finished() {
            bail!("the placer did not {what}: {v:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Offers 1-GPU requests at a fixed rate; returns each request's latency
/// from its commit and from its send to its placement seen.
async fn paced(
    appender: &Appender,
    seen: &Arc<Seen>,
    pools: &[String],
    rate: u32,
    secs: u64,
) -> Result<(Vec<Duration>, Vec<Duration>, f64)> {
    let n = rate as u64 * secs;
    let target = seen.placed.load(Ordering::Relaxed) + n;
    let committed: Arc<Mutex<HashMap<String, (Instant, Instant)>>> = Arc::default();
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let at = t0 + Duration::from_secs_f64(i as f64 / rate as f64);
        tokio::time::sleep_until(at.into()).await;
        let r = request(
            format!("lat-{i}"),
            &pools[i as usize % pools.len()],
            1,
            Shape::Any,
        );
        let (appender, committed) = (appender.clone(), committed.clone());
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            offer(&appender, &r).await?;
            committed
                .lock()
                .expect("lock")
                .insert(r.reservation, (sent, Instant::now()));
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let achieved = n as f64 / t0.elapsed().as_secs_f64();
    until(&seen.placed, target, Duration::from_secs(120)).await?;
    let at = seen.at.lock().expect("lock");
    let mut from_commit = Vec::new();
    let mut from_send = Vec::new();
    for (id, (sent, done)) in committed.lock().expect("lock").iter() {
        let placed = at.get(id).context("a placement was not seen")?;
        from_commit.push(placed.saturating_duration_since(*done));
        from_send.push(placed.saturating_duration_since(*sent));
    }
    Ok((from_commit, from_send, achieved))
}

/// A synthetic index of `nodes` 8-GPU nodes, half of the GPUs booked.
fn synthetic(nodes: u32) -> Index {
    let mut log = Log::new();
    let mut index = Index::new();
    let mut apply = |log: &mut Log, stream: &str, f: &Fact| {
        let e = log.push(stream, f);
        index.apply(&e).expect("in order");
    };
    apply(
        &mut log,
        "pool/synthetic",
        &Fact::PoolCreated {
            description: String::new(),
        },
    );
    for (node, devices) in domain::pools::uniform_fleet("s", nodes, CLASS, 8, 8) {
        apply(
            &mut log,
            "pool/synthetic",
            &Fact::NodeJoined { node, devices },
        );
    }
    for n in 0..nodes {
        let id = format!("syn-{n}");
        let r = request(id.clone(), "synthetic", 4, Shape::Node);
        apply(
            &mut log,
            &reservation_stream(&id),
            &Fact::ReservationRequested(r),
        );
        apply(
            &mut log,
            "pool/synthetic",
            &Fact::ReservationPlaced {
                reservation: id,
                allocations: vec![domain::Allocation {
                    node: format!("s{n:05}"),
                    devices: (0..4).map(|d| format!("gpu{d}")).collect(),
                }],
            },
        );
    }
    index
}

/// Median time to load a snapshot file (read, validate, decode, derive).
fn snapshot_load_ms(index: &Index, dir: &std::path::Path, reps: usize) -> Result<(f64, u64)> {
    let store = SnapshotStore::new(dir);
    let path = store.write(index.state())?;
    let size = std::fs::metadata(&path)?.len();
    let mut times = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let bytes = std::fs::read(&path)?;
        let loaded = Index::from_state(snapshot::decode(&bytes)?);
        times.push(t.elapsed().as_secs_f64() * 1e3);
        if loaded.position() != index.position() {
            bail!("the snapshot loaded at another position");
        }
    }
    Ok((util::median(&mut times), size))
}

pub async fn run(args: Args) -> Result<()> {
    if args.nodes == 0 || args.pools == 0 || args.pools > args.nodes {
        bail!("need at least one node per pool");
    }
    let latency_secs = args
        .latency_seconds
        .unwrap_or(if args.quick { 3 } else { 10 });
    let reps = if args.quick { 1 } else { 3 };
    let raw_secs = Duration::from_secs(if args.quick { 3 } else { 5 });
    eprintln!("starting a private PostgreSQL (fsync on) ...");
    let cluster = tokio::task::spawn_blocking(util::cluster).await??;
    let cfg = util::database(&cluster, "bench").await?;
    let client = events::db::connect(&cfg, "bench").await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    prepare_raw(&client).await?;
    let mut raw = Vec::new();
    for _ in 0..reps {
        raw.push(
            raw_multirow(&cfg, "raw_events", 4, 64, raw_secs)
                .await?
                .rate,
        );
    }
    let raw_multirow = util::median(&mut raw);
    eprintln!("raw: 64-row INSERT x4 {raw_multirow:.0} rows/s");

    // The fleet, by events.
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let pools: Vec<String> = (0..args.pools).map(|p| format!("bench{p}")).collect();
    let t = Instant::now();
    for (i, pool) in pools.iter().enumerate() {
        domain::pools::create_pool(&appender, pool, "benchmark pool").await?;
        let share = args.nodes / args.pools + u32::from((i as u32) < args.nodes % args.pools);
        let fleet = domain::pools::uniform_fleet(&format!("{pool}-n"), share, CLASS, 8, 8);
        domain::pools::join_nodes(&appender, pool, fleet, |_| {}).await?;
    }
    let gpus = args.nodes as u64 * 8;
    eprintln!(
        "fleet: {} nodes, {gpus} GPUs in {} pool(s), joined by events in {:.1} s",
        args.nodes,
        args.pools,
        t.elapsed().as_secs_f64()
    );

    let mut rc = ReaderConfig::new("bench_placements");
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let seen = Arc::new(Seen::default());
    let watcher = tokio::spawn(watch(reader.clone(), seen.clone()));
    let mut pc = PlacerConfig::new("bench");
    pc.max_batch = args.max_batch;
    pc.preemption_grace = args.grace;
    let log_head = events::read::head(&client).await?.0;
    let placer = Placer::start(cfg.clone(), reader.clone(), appender.clone(), pc);
    let stats = placer.stats();
    let t = Instant::now();
    // Ready: every pool's lease held, and the index caught up with the log
    // as it was at the start (each timed on its own).
    let (mut pools_held_s, mut caught_up_s) = (None, None);
    while pools_held_s.is_none() || caught_up_s.is_none() {
        if t.elapsed() > Duration::from_secs(120) || placer.is_finished() {
            bail!("the placer did not take the pools: {:?}", stats.view());
        }
        let v = stats.view();
        if pools_held_s.is_none() && v.pools_held >= args.pools as u64 {
            pools_held_s = Some(t.elapsed().as_secs_f64());
        }
        if caught_up_s.is_none() && v.position >= log_head {
            caught_up_s = Some(t.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let index_ready_s = t.elapsed().as_secs_f64();
    let (pools_held_s, caught_up_s) = (pools_held_s.unwrap_or(0.0), caught_up_s.unwrap_or(0.0));
    eprintln!(
        "placer holds {} pool(s) after {pools_held_s:.2} s, its index caught up with the log ({log_head} events) after {caught_up_s:.2} s",
        args.pools
    );

    // 1. Latency at a fixed offered rate.
    let (mut lat, mut lat_send, achieved) =
        paced(&appender, &seen, &pools, args.offered, latency_secs).await?;
    let (p50, p99) = (percentile_ms(&mut lat, 0.5), percentile_ms(&mut lat, 0.99));
    let p99_send = percentile_ms(&mut lat_send, 0.99);
    eprintln!(
        "latency at {} offered ({achieved:.0}/s achieved): requested committed -> placed seen p50 {p50:.2} ms, p99 {p99:.2} ms (from send p99 {p99_send:.2} ms)",
        args.offered
    );

    // 2. Throughput, 1-GPU requests, on 40% of the GPUs.
    let n1 = (gpus * 4 / 10).min(if args.quick { 20_000 } else { u64::MAX });
    let ones: Vec<Request> = (0..n1)
        .map(|i| {
            request(
                format!("one-{i}"),
                &pools[i as usize % pools.len()],
                1,
                Shape::Any,
            )
        })
        .collect();
    let before = stats.view();
    let head1 = events::read::head(&client).await?;
    let (secs1, offered1) = flood(&appender, &seen, ones, args.clients).await?;
    let events1 = events::read::head(&client).await?.0 - head1.0;
    let after = stats.view();
    let rate1 = n1 as f64 / secs1;
    let batches1 = after.batches - before.batches;
    eprintln!(
        "1-GPU: {n1} placed in {secs1:.2} s = {rate1:.0} placements/s (offered in {offered1:.2} s; {batches1} batches, {} conflicts; {events1} events appended)",
        after.conflicts - before.conflicts
    );
    // Events per placement in the 1-GPU phase: a request and its placement.
    let per_placement1 = events1 as f64 / n1.max(1) as f64;
    let events_per_s1 = events1 as f64 / secs1;

    // 3. Throughput, the mix, on about 30% of the GPUs.
    let n3 = (gpus * 3 / 10 / 4).min(if args.quick { 3_000 } else { u64::MAX });
    let mix: Vec<Request> = (0..n3)
        .map(|i| {
            let pool = &pools[i as usize % pools.len()];
            let id = format!("mix-{i}");
            match i % 10 {
                0..=3 => request(id, pool, 1, Shape::Any),
                4 | 5 => request(id, pool, 2, Shape::Any),
                6 | 7 => request(id, pool, 4, Shape::Node),
                8 => request(id, pool, 8, Shape::Node),
                _ => request(
                    id,
                    pool,
                    16,
                    Shape::Gang {
                        nodes: 2,
                        gpus_per_node: 8,
                    },
                ),
            }
        })
        .collect();
    let before = stats.view();
    let placed_before = seen.placed.load(Ordering::Relaxed);
    let (secs3, _) = flood(&appender, &seen, mix, args.clients).await?;
    let after = stats.view();
    let placed3 = seen.placed.load(Ordering::Relaxed) - placed_before;
    let rate3 = n3 as f64 / secs3;
    eprintln!(
        "mix: {n3} decided in {secs3:.2} s = {rate3:.0}/s ({placed3} placed, {} queued; {} conflicts)",
        after.queued - before.queued,
        after.conflicts - before.conflicts
    );
    // 4. Multi-tenant, on a pool of its own, then on one whose cohorts
    // remember past usage.
    let tenant_nodes = args.tenant_nodes.unwrap_or(args.nodes);
    let (tenants, remembering) = if tenant_nodes > 0 {
        let t = Instant::now();
        let held = stats.view().pools_held;
        for pool in [tenants::POOL, tenants::REMEMBERING] {
            tenants::prepare(&appender, &client, pool, tenant_nodes).await?;
        }
        until_placer(&placer, t, "take the tenants' pools", |v| {
            v.pools_held >= held + 2
        })
        .await?;
        let held_s = t.elapsed().as_secs_f64();
        // Each phase starts with the placer's index caught up with the log,
        // as the 1-GPU phase does: the pools' nodes and labels (tens of
        // thousands of events) would otherwise still be folded into the
        // first phase's time.
        let head = events::read::head(&client).await?.0;
        until_placer(&placer, t, "catch up with the tenants' pools", |v| {
            v.position >= head
        })
        .await?;
        let tenant_gpus = tenant_nodes as u64 * 8;
        eprintln!(
            "tenants: two pools of {tenant_nodes} nodes in racks of {}, {tenant_gpus} GPUs, {} queues in {} cohorts, held in {held_s:.1} s, the placer caught up with them in {:.1} s",
            tenants::NODES_PER_RACK,
            tenants::QUEUES,
            tenants::COHORTS,
            t.elapsed().as_secs_f64()
        );
        let high = args.high.unwrap_or(if args.quick { 50 } else { 200 });
        let mut runs = Vec::new();
        for pool in [tenants::POOL, tenants::REMEMBERING] {
            let r = tenants::run(
                &appender,
                &seen,
                &client,
                pool,
                tenant_gpus,
                args.grace,
                args.clients,
                high,
            )
            .await?;
            runs.push(r);
        }
        let remembering = runs.pop();
        (runs.pop(), remembering)
    } else {
        (None, None)
    };
    // 5. Backfill, on two pools of its own.
    let backfill_nodes = args
        .backfill_nodes
        .unwrap_or(if args.quick { 200 } else { 1_000 });
    let ahead_nodes = backfill_nodes.min(backfill::AHEAD_MAX_NODES);
    let backfill = if backfill_nodes > 0 {
        let held = stats.view().pools_held;
        for (pool, nodes) in [
            (backfill::QUIET, backfill_nodes),
            (backfill::CONTENDED, backfill_nodes),
            (backfill::AHEAD, ahead_nodes),
        ] {
            domain::pools::create_pool(&appender, pool, "backfill benchmark pool").await?;
            let fleet = domain::pools::uniform_fleet(&format!("{pool}-n"), nodes, CLASS, 8, 8);
            domain::pools::join_nodes(&appender, pool, fleet, |_| {}).await?;
        }
        let t = Instant::now();
        until_placer(&placer, t, "take the backfill pools", |v| {
            v.pools_held >= held + 3
        })
        .await?;
        let rounds = backfill::run(&appender, &seen, backfill_nodes, args.clients).await?;
        let ahead = backfill::ahead(&appender, &seen, ahead_nodes, args.clients).await?;
        Some((rounds, ahead))
    } else {
        None
    };
    let (backfill, ahead) = backfill.unzip();
    // 6. MIG, on two pools of its own.
    let mig_nodes = args
        .mig_nodes
        .unwrap_or(if args.quick { 1_000 } else { args.nodes });
    let mig = if mig_nodes > 0 {
        let held = stats.view().pools_held;
        for (pool, split) in [(mig::PLAIN, false), (mig::SPLIT, true)] {
            domain::pools::create_pool(&appender, pool, "MIG benchmark pool").await?;
            domain::pools::join_nodes(&appender, pool, mig::fleet(pool, mig_nodes, split), |_| {})
                .await?;
        }
        let t = Instant::now();
        until_placer(&placer, t, "take the MIG pools", |v| {
            v.pools_held >= held + 2
        })
        .await?;
        // A quarter of the plain pool per round at most.
        let per_round = (u64::from(mig_nodes) * 2).min(if args.quick { 2_000 } else { 20_000 });
        let rounds = if args.quick { 2 } else { 3 };
        Some(mig::run(&appender, &seen, mig_nodes, args.clients, per_round, rounds).await?)
    } else {
        None
    };
    let placer_stats = stats.view();
    placer.stop().await?;
    watcher.abort();
    let _ = watcher.await;
    drop(reader);

    // The index from the log and from a snapshot.
    let t = Instant::now();
    let built = projector::build(&client, Index::new()).await?;
    let build_ms = t.elapsed().as_secs_f64() * 1e3;
    let dir = tempfile::tempdir()?;
    let (fleet_load_ms, fleet_bytes) = snapshot_load_ms(&built, &dir.path().join("fleet"), 5)?;
    let (load_100k_ms, bytes_100k) = if gpus < 100_000 {
        let syn = synthetic(12_500);
        snapshot_load_ms(&syn, &dir.path().join("synthetic"), 5)?
    } else {
        (fleet_load_ms, fleet_bytes)
    };
    eprintln!(
        "index: built from {} events in {build_ms:.0} ms; snapshot {:.1} MB loads in {fleet_load_ms:.1} ms; 100,000 GPUs: {:.1} MB in {load_100k_ms:.1} ms",
        built.position(),
        fleet_bytes as f64 / 1e6,
        bytes_100k as f64 / 1e6
    );

    // The invariants over the whole log.
    let mut double_bookings = 0u64;
    let mut violations = 0u64;
    let mut replayed = Index::new();
    projector::catch_up(
        &client,
        &mut replayed,
        |v| {
            violations += 1;
            if v.message.contains("double booking") {
                double_bookings += 1;
            }
            true
        },
        |_| {},
    )
    .await?;
    let verdict = match check::check(&client, |_| {}).await {
        Ok(r) => format!(
            "ok: {} events, {} booked devices, {} live",
            r.events, r.booked_devices, r.live
        ),
        Err(e) => format!("violation: {e}"),
    };
    eprintln!("check: {verdict}");

    let placements_ratio = rate1 / raw_multirow;
    if let Some(t) = &tenants {
        eprintln!(
            "tenants against the 1-GPU phase: placements/s {:.2}, requests decided/s {:.2}, GPUs placed/s {:.2}, events/s {:.2} ({:.2} events per placement against {per_placement1:.2})",
            t.placements_per_s / rate1,
            t.requests as f64 / t.decided_s / rate1,
            t.placed_gpus as f64 / t.decided_s / rate1,
            t.events_per_s() / events_per_s1,
            t.events_per_placement()
        );
    }
    let tenant_json = |t: &tenants::Tenants| {
        serde_json::json!({
            "nodes": tenant_nodes,
            "nodes_per_rack": tenants::NODES_PER_RACK,
            "gangs": "2 nodes x 8 GPUs within one rack",
            "gpus": t.gpus,
            "queues": tenants::QUEUES,
            "cohorts": tenants::COHORTS,
            "requests": t.requests,
            "requested_gpus": t.requested_gpus,
            "demand_pct": t.requested_gpus * 100 / t.gpus.max(1),
            "decided_s": round(t.decided_s, 2),
            "placed": t.placed,
            "placements_per_s": round(t.placements_per_s, 0),
            "placements_ratio_vs_raw_rows": round(t.placements_per_s / raw_multirow, 3),
            // Against the 1-GPU phase of the same run: placements, requests
            // decided (a third of them wait, at 150% demand) and GPUs placed
            // (4 per request on average, against 1) per second.
            "placements_ratio_vs_1gpu": round(t.placements_per_s / rate1, 3),
            "decided_per_s": round(t.requests as f64 / t.decided_s, 0),
            "decided_ratio_vs_1gpu": round(t.requests as f64 / t.decided_s / rate1, 3),
            "gpus_placed_per_s": round(t.placed_gpus as f64 / t.decided_s, 0),
            "gpus_placed_ratio_vs_1gpu": round(t.placed_gpus as f64 / t.decided_s / rate1, 3),
            // What the log took: a multi-tenant placement comes with more
            // events than a 1-GPU one (waits, preemptions, the requests
            // they requeue). At the 1-GPU phase's cost per event the
            // placements ratio would be the ratio of events per placement;
            // the events ratio is how fast each event went against it.
            "events": t.events,
            "events_per_placement": round(t.events_per_placement(), 3),
            "events_per_placement_1gpu": round(per_placement1, 3),
            "placements_ratio_at_1gpu_cost_per_event": round(per_placement1 / t.events_per_placement(), 3),
            "events_ratio_vs_1gpu": round(t.events_per_s() / events_per_s1, 3),
            "high_priority_requests": t.high,
            "preempted": t.preempted,
            "preemptions_per_s": round(t.preemptions_per_s, 1),
            "preemption_p50_ms": round(t.p50_ms, 1),
            "preemption_p99_ms": round(t.p99_ms, 1),
            "grace_ms": t.grace_ms,
            "fair_share_spread": round(t.spread, 4),
            "shares": t.shares.iter().map(|(q, w, u, f)| serde_json::json!({"queue": q, "weight": w, "used": u, "fair": f})).collect::<Vec<_>>(),
        })
    };
    let tenants_json = tenants.as_ref().map(tenant_json);
    // Decayed fair share on against off: the same phase on a pool alike.
    let decay_ratio = tenants
        .as_ref()
        .zip(remembering.as_ref())
        .map(|(off, on)| on.placements_per_s / off.placements_per_s);
    let remembering_json = remembering.as_ref().map(|t| {
        let mut j = tenant_json(t);
        j["half_life_ms"] = tenants::HALF_LIFE_MS.into();
        j["placements_ratio_vs_forgetting"] = decay_ratio.map(|r| round(r, 3)).into();
        j
    });
    if let Some(r) = decay_ratio {
        eprintln!("tenants, cohorts remembering against forgetting: placements/s {r:.3}");
    }
    let round_json = |r: &backfill::Round| {
        let mut w = r.waits.clone();
        serde_json::json!({
            "gangs_placed": r.placed_gangs,
            "gang_wait_p50_ms": round(percentile_ms(&mut w, 0.5), 0),
            "gang_wait_max_ms": round(percentile_ms(&mut w, 1.0), 0),
            "stream_offered": r.stream_offered,
            "stream_placed": r.stream_placed,
            "secs": round(r.secs, 2),
        })
    };
    let max_wait = |r: &backfill::Round| {
        let mut w = r.waits.clone();
        percentile_ms(&mut w, 1.0)
    };
    let backfill_ratio = backfill
        .as_ref()
        .map(|b| max_wait(&b.contended) / max_wait(&b.quiet).max(1.0));
    let backfill_json = backfill.as_ref().map(|b| {
        serde_json::json!({
            "nodes_per_pool": b.nodes,
            "gangs": format!("{} gangs of {}x8", backfill::GANGS, backfill::GANG_NODES),
            "fill": "every GPU booked by a 1-GPU reservation, TTL uniform in 2-6 s",
            "stream": format!("{}/s 1-GPU requests with a 60 s TTL, from the gangs' request until all are placed", b.stream_rate),
            "alone": round_json(&b.quiet),
            "with_stream": round_json(&b.contended),
            "gang_wait_ratio": backfill_ratio.map(|r| round(r, 2)),
        })
    });
    let mig_ratio = mig.as_ref().map(|m| {
        let (mut plain, mut split) = (m.plain.clone(), m.split.clone());
        util::median(&mut split) / util::median(&mut plain).max(1.0)
    });
    let mig_json = mig.as_ref().map(|m| {
        let (mut plain, mut split) = (m.plain.clone(), m.split.clone());
        serde_json::json!({
            "nodes_per_pool": m.nodes,
            "split": format!("GPUs 0-3 of every fifth node as {} x {}", mig::PROFILE, mig::PER_GPU),
            "split_gpus": m.split_gpus,
            "instances": m.instances,
            "requests_per_round": m.per_round,
            "instance_requests_per_round": m.mig_requests_per_round,
            "rounds_per_pool": m.plain.len(),
            "plain_per_s": m.plain.iter().map(|r| round(*r, 0)).collect::<Vec<_>>(),
            "split_per_s": m.split.iter().map(|r| round(*r, 0)).collect::<Vec<_>>(),
            "plain_median_per_s": round(util::median(&mut plain), 0),
            "split_median_per_s": round(util::median(&mut split), 0),
            "placed": m.placed,
            "ratio": mig_ratio.map(|r| round(r, 3)),
        })
    });
    let mut result = serde_json::json!({
        "bench": "placements",
        "quick": args.quick,
        "machine": util::machine(&pg_version),
        "nodes": args.nodes,
        "gpus": gpus,
        "pools": args.pools,
        "max_batch": args.max_batch,
        "clients": args.clients,
        "raw_multirow_rows_per_s": round(raw_multirow, 0),
        "placements_per_s": round(rate1, 0),
        "placements_1gpu": n1,
        "placements_ratio_vs_raw_rows": round(placements_ratio, 3),
        "mix_decided_per_s": round(rate3, 0),
        "mix_requests": n3,
        "mix_placed": placed3,
        "offered_per_s": args.offered,
        "achieved_offered_per_s": round(achieved, 0),
        "p50_ms": round(p50, 3),
        "p99_ms": round(p99, 3),
        "p99_from_send_ms": round(p99_send, 3),
        "batches": placer_stats.batches,
        "conflicts": placer_stats.conflicts,
        "replans": placer_stats.conflicts,
        "placer": placer_stats,
        "index_ready_s": round(index_ready_s, 3),
        "pools_held_after_s": round(pools_held_s, 3),
        "index_caught_up_after_s": round(caught_up_s, 3),
        "index_build_from_log_ms": round(build_ms, 1),
        "index_events": built.position(),
        "snapshot_bytes": fleet_bytes,
        "snapshot_fleet_load_ms": round(fleet_load_ms, 2),
        "snapshot_load_ms": round(load_100k_ms, 2),
        "snapshot_load_gpus": 100_000u64.max(gpus),
        "double_bookings": double_bookings,
        "violations": violations,
        "check": verdict,
        "tenants": tenants_json,
        "tenants_remembering": remembering_json,
        "backfill": backfill_json,
        "mig": mig_json,
    });
    result["ahead"] = ahead
        .as_ref()
        .map(|a| {
            serde_json::json!({
                "nodes": a.nodes,
                "gpus": a.gpus,
                "starts_in_s": 10,
                "placed_after_start_ms": round(a.late_ms, 1),
                "short_requests_offered": a.stream_offered,
                "short_requests_placed_before_it": a.stream_placed,
            })
        })
        .into();
    result["targets"] = serde_json::json!({
        "placements_per_s": ">= 10000 at 10,000 nodes",
        "p99_ms": "< 50 at 1,000/s offered",
        "snapshot_load_ms": "< 100 for 100,000 GPUs",
        "double_bookings": "0",
        "tenants_placements_per_s": ">= 10000 with quotas and fair share on",
        "tenants_preemption_p99_ms": "< 1000 including the grace period",
        "tenants_fair_share_spread": "<= 0.05",
        "tenants_placements_ratio_vs_1gpu": ">= 0.6: multi-tenant placements/s over 1-GPU placements/s in the same run",
        "tenants_decay_ratio": ">= 0.9: multi-tenant placements/s with the cohorts' fair share remembering past usage over the same phase forgetting it",
        "tenants_decay_fair_share_spread": "<= 0.05, against the fair shares that count past usage",
        "backfill_gang_wait_ratio": "<= 1.25: gangs behind a stream of smaller requests start when they would alone (max wait, with the stream over alone), every gang placed",
        "mig_ratio": ">= 0.8: placements/s with 10% of GPUs as MIG instances over the same load on whole GPUs",
        "ahead_placed_after_start_ms": "0 to 1000: a reservation in advance for a whole pool, 10 s ahead, placed within 1 s of its start while short requests ran before it",
    });
    result["met"] = serde_json::json!({
        "placements_per_s": rate1 >= 10_000.0,
        "p99_ms": p99 < 50.0,
        "snapshot_load_ms": load_100k_ms < 100.0,
        "double_bookings": double_bookings == 0 && violations == 0,
        "tenants_placements_per_s": tenants.as_ref().map(|t| t.placements_per_s >= 10_000.0),
        "tenants_preemption_p99_ms": tenants.as_ref().map(|t| t.p99_ms < 1000.0),
        "tenants_fair_share_spread": tenants.as_ref().map(|t| t.spread <= 0.05),
        "tenants_placements_ratio_vs_1gpu": tenants.as_ref().map(|t| t.placements_per_s / rate1 >= 0.6),
        "tenants_decay_ratio": decay_ratio.map(|r| r >= 0.9),
        "tenants_decay_fair_share_spread": remembering.as_ref().map(|t| t.spread <= 0.05),
        "backfill_gang_wait_ratio": backfill.as_ref().map(|b| {
            b.contended.placed_gangs == backfill::GANGS as usize
                && backfill_ratio.is_some_and(|r| r <= 1.25)
        }),
        "mig_ratio": mig_ratio.map(|r| r >= 0.8),
        "ahead_placed_after_start_ms": ahead.as_ref().map(|a| (0.0..=1000.0).contains(&a.late_ms)),
    });
    let mut name = format!("placements-{}", args.nodes);
    if args.pools > 1 {
        name.push_str(&format!("-p{}", args.pools));
    }
    if tenants.is_none() || backfill.is_none() || mig.is_none() {
        // Some phases skipped: not to be taken for a whole run.
        name.push_str("-partial");
    }
    if args.quick {
        name.push_str("-quick");
    }
    util::finish(&name, &result)?;
    drop(appender);
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(cluster);
    Ok(())
}
