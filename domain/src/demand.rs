//! Synthetic tenants and their demand, for benchmarks and the instruction
//! gauge: queues sharing a pool in cohorts with quotas that sum to the
//! pool, and a mix of request shapes offered round robin across them.

use crate::{QueueSpec, Quota, Request, Shape, Tier, Topology};

/// Queues sharing the pool, and the cohorts they are split over.
pub const QUEUES: u32 = 16;
pub const COHORTS: u32 = 2;

/// The name of queue `i`.
pub fn queue_name(i: u32) -> String {
    format!("team{i:02}")
}

/// The queues of a pool of `gpus` GPUs of `class`: nominal quotas that sum
/// to the pool's GPUs, weight 2 for every other queue.
pub fn queues(class: &str, gpus: u64) -> Vec<QueueSpec> {
    (0..QUEUES)
        .map(|i| {
            let base = gpus / QUEUES as u64;
            let nominal = base + u64::from((i as u64) < gpus % QUEUES as u64);
            QueueSpec {
                queue: queue_name(i),
                cohort: Some(format!("cohort{}", i % COHORTS)),
                weight: 1 + i % 2,
                quotas: vec![Quota {
                    class: class.into(),
                    nominal: nominal as u32,
                    borrowing_limit: None,
                }],
                budgets: Vec::new(),
                max_run_ms: None,
            }
        })
        .collect()
}

/// A request `id` of `gpus` GPUs of `class` in `pool`, shaped `shape`, of
/// priority 0, in no queue, with no time to live.
pub fn request(id: String, pool: &str, class: &str, gpus: u32, shape: Shape) -> Request {
    Request {
        reservation: id,
        pool: pool.to_string(),
        class: class.into(),
        gpus,
        shape,
        priority: 0,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        start_ms: None,
        queue: None,
    }
}

/// A tenant's request in `queue`, requeued when preempted; gangs go
/// within one rack.
pub fn tenant_request(base: Request, queue: String, priority: i32) -> Request {
    let topology = matches!(base.shape, Shape::Gang { .. }).then_some(Topology::Within(Tier::Rack));
    Request {
        priority,
        topology,
        requeue_on_preemption: true,
        start_ms: None,
        queue: Some(queue),
        ..base
    }
}

/// Demand at 150% of `gpus`, spread evenly over the queues and offered
/// round robin across them: 1, 2, 4 and 8 GPUs and 2-node gangs of 8, at
/// priorities 0 and 1; ids `ten-0`, `ten-1`, ...
pub fn mixed(pool: &str, class: &str, gpus: u64) -> Vec<Request> {
    let mut out = Vec::new();
    let mut asked = 0u64;
    let mut i = 0u64;
    while asked < gpus * 3 / 2 {
        let q = queue_name((i % QUEUES as u64) as u32);
        let id = format!("ten-{i}");
        let prio = ((i / QUEUES as u64) % 2) as i32;
        let (n, shape) = match (i / QUEUES as u64) % 10 {
            0..=3 => (1, Shape::Any),
            4 | 5 => (2, Shape::Any),
            6 | 7 => (4, Shape::Node),
            8 => (8, Shape::Node),
            _ => (
                16,
                Shape::Gang {
                    nodes: 2,
                    gpus_per_node: 8,
                },
            ),
        };
        let r = tenant_request(request(id, pool, class, n, shape), q, prio);
        asked += r.gpus as u64;
        out.push(r);
        i += 1;
    }
    out
}
