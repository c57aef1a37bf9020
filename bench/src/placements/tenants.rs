//! `bench placements`, the multi-tenant phase: a pool shared by 16 queues
//! in 2 cohorts, quotas summing to the fleet, its nodes in racks of
//! [`NODES_PER_RACK`], demand at 150% of it (gangs within one rack), then
//! requests of high priority that get their GPUs by preemption. It runs
//! twice, on two pools alike but for one thing: in [`REMEMBERING`] both
//! cohorts' fair share remembers past usage ([`HALF_LIFE_MS`]).

use crate::util::percentile_ms;
use anyhow::{bail, Result};
pub use domain::demand::{COHORTS, QUEUES};
use domain::{QueueSpec, Shape};
use events::Appender;
use projections::Index;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{flood, offer, Seen, CLASS};

/// The pool whose cohorts forget: only what queues hold counts.
pub const POOL: &str = "tenants";
/// The pool whose cohorts remember past usage.
pub const REMEMBERING: &str = "tenants-decay";
/// Its cohorts' half-life: short enough that the past moves within the
/// phase.
pub const HALF_LIFE_MS: u64 = 60_000;
/// Nodes per rack of the pool.
pub const NODES_PER_RACK: u32 = 32;

/// What the phase measured.
pub struct Tenants {
    pub gpus: u64,
    pub requests: u64,
    pub requested_gpus: u64,
    pub decided_s: f64,
    pub placed: u64,
    /// GPUs (devices) those placements took.
    pub placed_gpus: u64,
    pub placements_per_s: f64,
    /// Events the log took from the first request to the last decision
    /// (requests, placements, waits, preemptions and what they requeue).
    pub events: u64,
    pub high: u64,
    pub preempted: u64,
    pub preemptions_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub grace_ms: u64,
    /// Per queue: (queue, weight, used, fair).
    pub shares: Vec<(String, u32, u64, u64)>,
    /// The largest |used - fair| / fair over the queues.
    pub spread: f64,
}

impl Tenants {
    /// Events the log took per placement in the phase.
    pub fn events_per_placement(&self) -> f64 {
        self.events as f64 / self.placed.max(1) as f64
    }

    /// Events per second in the phase.
    pub fn events_per_s(&self) -> f64 {
        self.events as f64 / self.decided_s
    }
}

/// The queues of the pool (see [`domain::demand::queues`]).
pub fn specs(gpus: u64) -> Vec<QueueSpec> {
    domain::demand::queues(CLASS, gpus)
}

/// Creates `pool` with `nodes` nodes in racks and the queues, its cohorts
/// remembering when it is [`REMEMBERING`].
pub async fn prepare(
    appender: &Appender,
    client: &tokio_postgres::Client,
    pool: &str,
    nodes: u32,
) -> Result<()> {
    domain::pools::create_pool(appender, pool, "multi-tenant benchmark pool").await?;
    let prefix = format!("{pool}-n");
    let fleet = domain::pools::uniform_fleet(&prefix, nodes, CLASS, 8, 8);
    domain::pools::join_nodes(appender, pool, fleet, |_| {}).await?;
    let racks = (0..nodes)
        .map(|i| {
            (
                format!("{prefix}{i:05}"),
                Some(format!("rack-{:04}", i / NODES_PER_RACK)),
                None,
            )
        })
        .collect();
    domain::pools::label_nodes(appender, pool, racks).await?;
    for spec in specs(nodes as u64 * 8) {
        let name = spec.queue.clone();
        domain::queues::configure(client, appender, pool, &name, &|_| Ok(spec.clone()), None)
            .await?;
    }
    if pool == REMEMBERING {
        for c in 0..COHORTS {
            let cohort = format!("cohort{c}");
            domain::queues::set_decay(client, appender, pool, &cohort, Some(HALF_LIFE_MS), None)
                .await?;
        }
    }
    Ok(())
}

/// Runs the phase on `pool` ([`prepare`]d) with a placer whose preemption
/// grace is `grace`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    appender: &Appender,
    seen: &Seen,
    client: &tokio_postgres::Client,
    pool: &str,
    gpus: u64,
    grace: Duration,
    clients: usize,
    high: u64,
) -> Result<Tenants> {
    // Demand at 150%: every request decided (placed or queued); ids apart
    // per pool.
    let mut requests = domain::demand::mixed(pool, CLASS, gpus);
    for r in &mut requests {
        r.reservation = format!("{pool}-{}", r.reservation);
    }
    let n = requests.len() as u64;
    let requested_gpus: u64 = requests.iter().map(|r| r.gpus as u64).sum();
    let placed_before = seen.placed.load(Ordering::Relaxed);
    let devices_before = seen.placed_devices.load(Ordering::Relaxed);
    // Preemptions of the whole phase: priority 1 requests preempt priority
    // 0 reservations of their queue as the queues fill, and those of high
    // priority preempt both.
    let phase = Instant::now();
    let preempted_before = seen.preempted.load(Ordering::Relaxed);
    let head = events::read::head(client).await?;
    let (decided_s, _) = flood(appender, seen, requests, clients).await?;
    let events = events::read::head(client).await?.0 - head.0;
    let placed = seen.placed.load(Ordering::Relaxed) - placed_before;
    let placed_gpus = seen.placed_devices.load(Ordering::Relaxed) - devices_before;
    // Placements per second: until the last placement of the flood was seen.
    let placements_per_s = placed as f64 / decided_s;
    eprintln!(
        "{pool}: {n} requests for {requested_gpus} GPUs ({}% of {gpus}) decided in {decided_s:.2} s; {placed} placed = {placements_per_s:.0} placements/s; {events} events appended, {:.2} per placement",
        requested_gpus * 100 / gpus,
        events as f64 / placed.max(1) as f64
    );
    // Requests of high priority, one GPU each, round robin over the queues,
    // one at a time: each gets a GPU by preemption (in its own queue, or
    // taking back what its queue lent).
    let t0 = Instant::now();
    let mut lat = Vec::new();
    for i in 0..high {
        let r = domain::demand::tenant_request(
            super::request(format!("{pool}-hp-{i}"), pool, 1, Shape::Any),
            domain::demand::queue_name((i % QUEUES as u64) as u32),
            10,
        );
        let sent = Instant::now();
        offer(appender, &r).await?;
        let deadline = sent + Duration::from_secs(60);
        loop {
            let at = seen
                .at
                .lock()
                .expect("seen lock")
                .get(&r.reservation)
                .copied();
            if let Some(at) = at {
                lat.push(at.saturating_duration_since(sent));
                break;
            }
            if Instant::now() > deadline {
                bail!("{} was not placed within 60 s", r.reservation);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let high_s = t0.elapsed().as_secs_f64();
    let secs = phase.elapsed().as_secs_f64();
    let preempted = seen.preempted.load(Ordering::Relaxed) - preempted_before;
    let (p50_ms, p99_ms) = (percentile_ms(&mut lat, 0.5), percentile_ms(&mut lat, 0.99));
    eprintln!(
        "{pool}: {high} requests of high priority placed through preemption, one at a time in {high_s:.1} s: p50 {p50_ms:.0} ms, p99 {p99_ms:.0} ms (grace {} ms); {preempted} preempted in the phase's {secs:.1} s = {:.1}/s",
        grace.as_millis(),
        preempted as f64 / secs
    );
    // Each queue's usage against its fair share, from the log.
    let index = projections::projector::build(client, Index::new()).await?;
    let now = projections::usage::unix_ms(std::time::SystemTime::now()).max(0) as u64;
    let mut shares = Vec::new();
    let mut spread = 0f64;
    for s in projections::quota::fair_shares(&index, pool, now) {
        if s.fair > 0 {
            spread = spread.max((s.used as f64 - s.fair as f64).abs() / s.fair as f64);
        }
        shares.push((s.queue, s.weight, s.used, s.fair));
    }
    eprintln!(
        "{pool}: usage against fair share within {:.1}% (worst queue)",
        spread * 100.0
    );
    Ok(Tenants {
        gpus,
        requests: n,
        requested_gpus,
        decided_s,
        placed,
        placed_gpus,
        placements_per_s,
        events,
        high,
        preempted,
        preemptions_per_s: preempted as f64 / secs,
        p50_ms,
        p99_ms,
        grace_ms: grace.as_millis() as u64,
        shares,
        spread,
    })
}
