//! Planning a batch against the pool index: best fit, topology first.
//!
//! Ranking: a request goes to the candidate with the fewest free devices that
//! still fits it (nodes and islands are bucketed by free count, so this is a
//! range lookup, not a scan). Partly used nodes and islands fill up first and
//! whole ones stay free for large shapes. Within a node, devices come from
//! the smallest island that holds the request, or from as few islands as
//! possible. A gang takes its nodes all at once or not at all.

use projections::index::{ClassIndex, Index};
use projections::{quota, Allocation, Request, Shape};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

/// What a batch decided.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Plan {
    /// Reservations placed, in priority order.
    pub placed: Vec<(String, Vec<Allocation>)>,
    /// Reservations that do not fit now and were not queued before.
    pub queued: Vec<(String, String)>,
    /// Reservations still waiting (already queued), counted only.
    pub still_waiting: usize,
    /// Reservations that can never fit the pool as it is.
    pub unschedulable: Vec<(String, String)>,
}

/// Why a request can never fit the pool (counting every present device,
/// whatever its health and bookings), or `None`.
pub fn never_fits(index: &Index, pool: &str, r: &Request) -> Option<String> {
    let Some(c) = index.class(pool, &r.class) else {
        return Some(format!("pool {pool:?} has no {} GPUs", r.class));
    };
    match r.shape {
        Shape::Any if r.gpus as u64 > c.total => Some(format!(
            "asks for {} {} GPUs; the pool has {}",
            r.gpus, r.class, c.total
        )),
        Shape::Node if r.gpus > c.largest_node() => Some(format!(
            "asks for {} {} GPUs on one node; the largest node has {}",
            r.gpus,
            r.class,
            c.largest_node()
        )),
        Shape::Island if r.gpus > c.largest_island() => Some(format!(
            "asks for {} {} GPUs in one NVLink island; the largest island has {}",
            r.gpus,
            r.class,
            c.largest_island()
        )),
        Shape::Gang {
            nodes,
            gpus_per_node,
        } if c.nodes_of_size_at_least(gpus_per_node) < nodes => Some(format!(
            "asks for {nodes} nodes with {gpus_per_node} {} GPUs each; the pool has {}",
            r.class,
            c.nodes_of_size_at_least(gpus_per_node)
        )),
        _ => None,
    }
}

/// Picks `n` free devices of `class` on a node: from the smallest island
/// that holds all of them, else from the largest islands first.
fn pick_on_node(index: &Index, pool: &str, node: &str, class: &str, n: u32) -> Option<Vec<String>> {
    let node_state = index.pool(pool)?.nodes.get(node)?;
    let mut by_island: BTreeMap<Option<&str>, Vec<&str>> = BTreeMap::new();
    for d in &node_state.devices {
        if d.spec.class == class && d.free() {
            by_island
                .entry(d.spec.island.as_deref())
                .or_default()
                .push(&d.spec.id);
        }
    }
    let n = n as usize;
    if let Some(devs) = by_island
        .values()
        .filter(|v| v.len() >= n)
        .min_by_key(|v| v.len())
    {
        return Some(devs[..n].iter().map(|s| s.to_string()).collect());
    }
    let mut groups: Vec<&Vec<&str>> = by_island.values().collect();
    groups.sort_by_key(|g| std::cmp::Reverse(g.len()));
    let picked: Vec<String> = groups
        .into_iter()
        .flatten()
        .take(n)
        .map(|s| s.to_string())
        .collect();
    (picked.len() == n).then_some(picked)
}

fn single_node(index: &Index, c: &ClassIndex, pool: &str, r: &Request) -> Option<Vec<Allocation>> {
    let (node, _) = c.nodes_best_fit(r.gpus).next()?;
    let devices = pick_on_node(index, pool, node, &r.class, r.gpus)?;
    Some(vec![Allocation {
        node: node.to_string(),
        devices,
    }])
}

/// Plans one request against the index as it is (nothing is booked).
pub fn place_one(index: &Index, pool: &str, r: &Request) -> Option<Vec<Allocation>> {
    let c = index.class(pool, &r.class)?;
    if (c.free) < r.gpus as u64 {
        return None;
    }
    match r.shape {
        Shape::Node => single_node(index, c, pool, r),
        Shape::Any => {
            if let Some(a) = single_node(index, c, pool, r) {
                return Some(a);
            }
            // Spread over as few nodes as possible: most free first.
            let mut left = r.gpus;
            let mut out = Vec::new();
            for (node, free) in c.nodes_most_free() {
                let take = free.min(left);
                out.push(Allocation {
                    node: node.to_string(),
                    devices: pick_on_node(index, pool, node, &r.class, take)?,
                });
                left -= take;
                if left == 0 {
                    return Some(out);
                }
            }
            None
        }
        Shape::Island => {
            let (island, _) = c.islands_best_fit(r.gpus).next()?;
            let p = index.pool(pool)?;
            let mut per_node: BTreeMap<&str, Vec<String>> = BTreeMap::new();
            for (node, dev) in c.island_free_devices(island).take(r.gpus as usize) {
                let id = &p.nodes.get(node)?.devices.get(dev as usize)?.spec.id;
                per_node.entry(node).or_default().push(id.clone());
            }
            Some(
                per_node
                    .into_iter()
                    .map(|(node, devices)| Allocation {
                        node: node.to_string(),
                        devices,
                    })
                    .collect(),
            )
        }
        Shape::Gang {
            nodes,
            gpus_per_node,
        } => {
            let mut out = Vec::with_capacity(nodes as usize);
            for (node, _) in c.nodes_best_fit(gpus_per_node).take(nodes as usize) {
                out.push(Allocation {
                    node: node.to_string(),
                    devices: pick_on_node(index, pool, node, &r.class, gpus_per_node)?,
                });
            }
            (out.len() == nodes as usize).then_some(out)
        }
    }
}

/// Plans reservations (ids, in the order given, which is priority order)
/// against the index. Each placement is booked in the index while the batch
/// is planned, so later requests see it, and every booking is undone before
/// returning: the index is left as it was.
///
/// In a pool shared by queues, each request must first be admitted by its
/// queue's quota ([`quota::admit`]), and the queues take turns by weighted
/// dominant resource fairness: the next request planned is the next (by
/// priority) of the queue with the smallest dominant share so far, counting
/// what the batch has placed ([`quota::dominant_share`]).
pub fn plan_batch(index: &mut Index, pool: &str, ids: &[String]) -> Plan {
    let mut plan = Plan::default();
    let mut batch = quota::Batch::default();
    let shared = index.pool(pool).is_some_and(|p| !p.queues.is_empty());
    if !shared {
        for id in ids {
            plan_one(index, pool, id, &mut plan, &mut batch);
        }
    } else {
        // Per queue, its requests in placement order (those naming no queue,
        // or an unknown one, under their name: they are rejected in turn).
        let mut groups: BTreeMap<String, VecDeque<Turn>> = BTreeMap::new();
        for id in ids {
            if let Some(r) = index.reservation(id) {
                let q = r.request.queue.clone().unwrap_or_default();
                groups.entry(q).or_default().push_back((
                    Reverse(r.request.priority),
                    r.requested_at,
                    id,
                ));
            }
        }
        let mut turns = BinaryHeap::new();
        for (q, g) in groups.iter_mut() {
            g.make_contiguous().sort();
            turns.push(Reverse((share_key(index, pool, q, &batch), q.clone())));
        }
        while let Some(Reverse((_, q))) = turns.pop() {
            let g = groups.get_mut(&q).expect("every turn has a group");
            let Some((_, _, id)) = g.pop_front() else {
                continue;
            };
            plan_one(index, pool, id, &mut plan, &mut batch);
            if !g.is_empty() {
                turns.push(Reverse((share_key(index, pool, &q, &batch), q)));
            }
        }
    }
    for (id, allocs) in &plan.placed {
        for a in allocs {
            index.unbook(pool, a, id);
        }
    }
    plan
}

/// A request in its queue's turn: priority (highest first), position, id.
type Turn<'a> = (Reverse<i32>, u64, &'a String);

/// A queue's dominant share as an orderable key (parts per billion).
fn share_key(index: &Index, pool: &str, queue: &str, batch: &quota::Batch) -> u64 {
    (quota::dominant_share(index, pool, queue, batch) * 1e9) as u64
}

/// What a reason is about: the words before its first colon (`waiting for
/// capacity`, `over quota`). A waiting request is queued again only when
/// this changes, not when its figures do.
fn reason_kind(reason: &str) -> &str {
    reason.split(':').next().unwrap_or(reason)
}

/// Plans one request into `plan`, booking its placement in the index and
/// counting it in `batch`.
fn plan_one(index: &mut Index, pool: &str, id: &str, plan: &mut Plan, batch: &mut quota::Batch) {
    let Some(r) = index.reservation(id) else {
        return;
    };
    let (request, queued) = (r.request.clone(), r.phase == projections::Phase::Queued);
    let was = r.reason.clone();
    if let Some(reason) = never_fits(index, pool, &request) {
        plan.unschedulable.push((id.to_string(), reason));
        return;
    }
    let wait = |plan: &mut Plan, reason: String| {
        if queued && reason_kind(&reason) == reason_kind(&was) {
            plan.still_waiting += 1;
        } else {
            plan.queued.push((id.to_string(), reason));
        }
    };
    match quota::admit(index, pool, &request, batch) {
        Ok(()) => {}
        Err(quota::Refusal::NoQueue(reason)) => {
            plan.unschedulable.push((id.to_string(), reason));
            return;
        }
        Err(refusal @ quota::Refusal::OverQuota(_)) => {
            wait(plan, refusal.to_string());
            return;
        }
    }
    match place_one(index, pool, &request) {
        Some(allocs) => {
            for a in &allocs {
                let refused = index.book(pool, a, id);
                debug_assert!(refused.is_empty(), "planned devices are free");
            }
            if let Some(q) = &request.queue {
                batch.add(q, &request.class, request.gpus as u64);
            }
            plan.placed.push((id.to_string(), allocs));
        }
        None => {
            let free = index.class(pool, &request.class).map_or(0, |c| c.free);
            wait(
                plan,
                format!(
                    "waiting for capacity: {} {} GPUs ({}) asked, {free} free",
                    request.gpus, request.class, request.shape
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use projections::domain::{pool_stream, reservation_stream};
    use projections::testing::{devices, Log};
    use projections::{Fact, Phase};

    const C: &str = "H100-80GB";

    struct World {
        log: Log,
        index: Index,
    }

    impl World {
        /// A pool of `nodes` nodes with 8 GPUs in two islands of 4.
        fn new(nodes: u32) -> World {
            World::build(nodes, |_, node| devices(node, C, 8, 4))
        }

        /// Like [`World::new`], but odd nodes have no NVLink islands and
        /// every third node also has devices of another class, so both the
        /// island path and the in-place booking path of the index run.
        fn mixed(nodes: u32) -> World {
            World::build(nodes, |n, node| {
                let mut d = devices(node, C, 8, if n % 2 == 0 { 4 } else { 0 });
                if n % 3 == 0 {
                    for mut extra in devices(node, "L40S", 2, 0) {
                        extra.id = format!("x{}", extra.id);
                        d.push(extra);
                    }
                }
                d
            })
        }

        fn build(
            nodes: u32,
            devices_of: impl Fn(u32, &str) -> Vec<projections::DeviceSpec>,
        ) -> World {
            let mut w = World {
                log: Log::new(),
                index: Index::new(),
            };
            w.pool(&Fact::PoolCreated {
                description: String::new(),
            });
            for n in 0..nodes {
                let node = format!("n{n:02}");
                let devices = devices_of(n, &node);
                w.pool(&Fact::NodeJoined { node, devices });
            }
            w
        }

        fn pool(&mut self, fact: &Fact) -> Option<projections::Violation> {
            let e = self.log.push(&pool_stream("p"), fact);
            self.index.apply(&e).unwrap()
        }

        fn request(&mut self, id: &str, gpus: u32, shape: Shape, priority: i32) {
            self.request_in(None, id, gpus, shape, priority);
        }

        fn request_in(
            &mut self,
            queue: Option<&str>,
            id: &str,
            gpus: u32,
            shape: Shape,
            priority: i32,
        ) {
            let r = Request {
                reservation: id.into(),
                pool: "p".into(),
                class: C.into(),
                gpus,
                shape,
                priority,
                ttl_ms: None,
                replace_on_failure: false,
                replaces: None,
                queue: queue.map(str::to_string),
            };
            let e = self
                .log
                .push(&reservation_stream(id), &Fact::ReservationRequested(r));
            assert_eq!(self.index.apply(&e).unwrap(), None);
        }

        /// Plans the pending reservations and applies the outcome as a
        /// placer's commit would.
        fn run(&mut self) -> Plan {
            let ids: Vec<String> = self
                .index
                .queues("p")
                .map(|q| {
                    q.pending
                        .iter()
                        .chain(&q.queued)
                        .map(|k| k.2.clone())
                        .collect()
                })
                .unwrap_or_default();
            let mut ids_sorted: Vec<_> = ids
                .iter()
                .map(|id| {
                    let r = self.index.reservation(id).unwrap();
                    (
                        (std::cmp::Reverse(r.request.priority), r.requested_at),
                        id.clone(),
                    )
                })
                .collect();
            ids_sorted.sort();
            let ids: Vec<String> = ids_sorted.into_iter().map(|(_, id)| id).collect();
            let before = self.index.clone();
            let plan = plan_batch(&mut self.index, "p", &ids);
            assert!(self.index == before, "planning leaves the index as it was");
            for (reservation, allocations) in plan.placed.clone() {
                let v = self.pool(&Fact::ReservationPlaced {
                    reservation,
                    allocations,
                });
                assert_eq!(v, None, "the planner's placements are valid");
            }
            for (reservation, reason) in plan.queued.clone() {
                assert_eq!(
                    self.pool(&Fact::ReservationQueued {
                        reservation,
                        reason
                    }),
                    None
                );
            }
            for (reservation, reason) in plan.unschedulable.clone() {
                assert_eq!(
                    self.pool(&Fact::ReservationUnschedulable {
                        reservation,
                        reason
                    }),
                    None
                );
            }
            plan
        }

        /// Configures queue `name` with `nominal` GPUs of class C.
        fn queue(
            &mut self,
            name: &str,
            cohort: Option<&str>,
            weight: u32,
            nominal: u32,
            borrowing_limit: Option<u32>,
        ) {
            let spec = projections::QueueSpec {
                queue: name.into(),
                cohort: cohort.map(str::to_string),
                weight,
                quotas: vec![projections::Quota {
                    class: C.into(),
                    nominal,
                    borrowing_limit,
                }],
            };
            assert_eq!(self.pool(&Fact::QueueConfigured(spec)), None);
        }

        fn phase(&self, id: &str) -> Option<Phase> {
            self.index.reservation(id).map(|r| r.phase)
        }

        fn used(&self, queue: &str) -> u64 {
            self.index.queues("p").map_or(0, |q| q.used(queue, C))
        }

        fn allocs(&self, id: &str) -> Vec<Allocation> {
            self.index.reservation(id).unwrap().allocations.clone()
        }

        fn release(&mut self, id: &str) {
            assert_eq!(
                self.pool(&Fact::ReservationReleased {
                    reservation: id.into()
                }),
                None
            );
        }
    }

    #[test]
    fn small_requests_fill_partly_used_nodes_first() {
        let mut w = World::new(3);
        w.request("a", 5, Shape::Any, 0);
        w.run();
        let a = w.allocs("a");
        assert_eq!(a.len(), 1);
        w.request("b", 2, Shape::Any, 0);
        w.run();
        // b goes next to a, keeping the two other nodes whole.
        assert_eq!(w.allocs("b")[0].node, a[0].node);
        let c = w.index.class("p", C).unwrap();
        assert_eq!(c.nodes_with_free(8).count(), 2);
        assert_eq!(c.free, 24 - 7);
    }

    #[test]
    fn islands_are_kept_whole_and_island_shapes_stay_in_one() {
        let mut w = World::new(1);
        w.request("a", 2, Shape::Node, 0);
        w.run();
        let a = &w.allocs("a")[0].devices;
        w.request("b", 4, Shape::Island, 0);
        w.run();
        let b = &w.allocs("b")[0].devices;
        // a took two GPUs of one island; b needs a whole island: the other.
        let island = |d: &String| d.trim_start_matches("gpu").parse::<u32>().unwrap() / 4;
        assert!(a.iter().all(|d| island(d) == island(&a[0])));
        assert!(b.iter().all(|d| island(d) == island(&b[0])));
        assert_ne!(island(&a[0]), island(&b[0]));
        // No island has 4 free any more.
        w.request("c", 4, Shape::Island, 0);
        let plan = w.run();
        assert_eq!(plan.queued.len(), 1, "{plan:?}");
        assert_eq!(w.index.reservation("c").unwrap().phase, Phase::Queued);
        // 5 in one island can never fit.
        w.request("d", 5, Shape::Island, 0);
        let plan = w.run();
        assert_eq!(plan.unschedulable.len(), 1);
        assert!(
            plan.unschedulable[0].1.contains("largest island has 4"),
            "{plan:?}"
        );
        assert!(w.index.reservation("d").is_none(), "terminal");
    }

    #[test]
    fn gangs_are_all_or_nothing_on_distinct_nodes() {
        let mut w = World::new(3);
        w.request("x", 1, Shape::Any, 0);
        w.run();
        w.request(
            "g",
            16,
            Shape::Gang {
                nodes: 2,
                gpus_per_node: 8,
            },
            0,
        );
        w.run();
        let g = w.allocs("g");
        assert_eq!(g.len(), 2);
        assert_ne!(g[0].node, g[1].node);
        assert!(g.iter().all(|a| a.devices.len() == 8));
        // Another 2x8 gang does not fit now: nothing of it is booked.
        w.request(
            "h",
            16,
            Shape::Gang {
                nodes: 2,
                gpus_per_node: 8,
            },
            0,
        );
        let plan = w.run();
        assert_eq!(plan.queued.len(), 1);
        assert_eq!(w.index.class("p", C).unwrap().free, 7);
        // 4 nodes can never fit in a 3-node pool.
        w.request(
            "k",
            4,
            Shape::Gang {
                nodes: 4,
                gpus_per_node: 1,
            },
            0,
        );
        assert_eq!(w.run().unschedulable.len(), 1);
        // Releasing the gang lets the waiting one place.
        w.release("g");
        w.run();
        assert_eq!(w.index.reservation("h").unwrap().phase, Phase::Placed);
    }

    #[test]
    fn queues_are_held_to_their_quota_and_borrow_within_their_cohort() {
        // 32 GPUs; queues a and b share cohort c (8 each, b borrows at most
        // 4), solo has 8 of its own.
        let mut w = World::new(4);
        w.queue("a", Some("c"), 1, 8, None);
        w.queue("b", Some("c"), 1, 8, Some(4));
        w.queue("solo", None, 1, 8, None);
        // Without a queue, or with one the pool does not have: rejected.
        w.request("nobody", 1, Shape::Any, 0);
        w.request_in(Some("typo"), "typo", 1, Shape::Any, 0);
        let plan = w.run();
        assert_eq!(plan.unschedulable.len(), 2, "{plan:?}");
        assert!(plan.unschedulable[0].1.contains("name one"), "{plan:?}");
        assert!(
            plan.unschedulable[1].1.contains("no queue typo"),
            "{plan:?}"
        );
        // solo fills its quota and cannot borrow.
        w.request_in(Some("solo"), "s1", 8, Shape::Any, 0);
        w.request_in(Some("solo"), "s2", 1, Shape::Any, 0);
        let plan = w.run();
        assert_eq!(w.phase("s1"), Some(Phase::Placed));
        assert_eq!(w.phase("s2"), Some(Phase::Queued));
        assert!(plan.queued[0]
            .1
            .starts_with("over quota: queue solo holds 8 of its 8"));
        assert!(plan.queued[0].1.contains("borrows nothing"), "{plan:?}");
        // a borrows b's unused quota: 12 of the cohort's 16.
        w.request_in(Some("a"), "a1", 12, Shape::Any, 0);
        w.run();
        assert_eq!(w.phase("a1"), Some(Phase::Placed));
        assert_eq!(w.used("a"), 12);
        // b's nominal quota is its own whatever a borrowed: admitted (the
        // GPUs are there), but beyond it the cohort has nothing to lend.
        w.request_in(Some("b"), "b1", 8, Shape::Any, 0);
        w.request_in(Some("b"), "b2", 2, Shape::Any, 0);
        let plan = w.run();
        assert_eq!(w.phase("b1"), Some(Phase::Placed));
        assert_eq!(w.phase("b2"), Some(Phase::Queued));
        assert!(
            plan.queued[0].1.contains("cohort c has 0 of its 16 unused"),
            "{plan:?}"
        );
        // b may never borrow more than 4.
        w.request_in(Some("b"), "b3", 5, Shape::Any, 0);
        let plan = w.run();
        assert!(plan.queued[0].1.contains("borrow at most 4"), "{plan:?}");
        // a gives its GPUs back: b2 is admitted; what still waits keeps its
        // reason and is not queued again.
        w.release("a1");
        let plan = w.run();
        assert_eq!(w.phase("b2"), Some(Phase::Placed));
        assert_eq!(w.phase("b3"), Some(Phase::Queued));
        assert!(plan.queued.is_empty(), "{plan:?}");
        assert_eq!(plan.still_waiting, 2, "{plan:?}");
        assert!(w.index.derived_is_consistent());
        // A placement over quota in the log is a violation.
        let over = w.log.push(
            &reservation_stream("s3"),
            &Fact::ReservationRequested(Request {
                reservation: "s3".into(),
                pool: "p".into(),
                class: C.into(),
                gpus: 1,
                shape: Shape::Any,
                priority: 0,
                ttl_ms: None,
                replace_on_failure: false,
                replaces: None,
                queue: Some("solo".into()),
            }),
        );
        assert_eq!(w.index.apply(&over).unwrap(), None);
        let node = w
            .index
            .class("p", C)
            .unwrap()
            .nodes_most_free()
            .next()
            .unwrap()
            .0
            .to_string();
        let device = w.index.pool("p").unwrap().nodes[&node]
            .devices
            .iter()
            .find(|d| d.free())
            .unwrap()
            .spec
            .id
            .clone();
        let v = w
            .pool(&Fact::ReservationPlaced {
                reservation: "s3".into(),
                allocations: vec![Allocation {
                    node,
                    devices: vec![device],
                }],
            })
            .expect("a violation");
        assert!(v.message.contains("placed against its quota"), "{v}");
        assert!(v.message.contains("queue solo holds 8 of its 8"), "{v}");
    }

    #[test]
    fn a_waiting_request_is_queued_again_when_why_it_waits_changes() {
        let mut w = World::new(1);
        w.queue("a", Some("c"), 1, 4, None);
        w.queue("b", Some("c"), 1, 4, None);
        w.request_in(Some("a"), "a1", 4, Shape::Any, 0);
        w.request_in(Some("b"), "b1", 2, Shape::Any, 0);
        w.run();
        // a asks for more than the cohort has unused: over quota.
        w.request_in(Some("a"), "a2", 4, Shape::Any, 0);
        let plan = w.run();
        assert!(plan.queued[0].1.starts_with("over quota"), "{plan:?}");
        // b's quota grows: a2 is admitted, but 2 GPUs are free, not 4.
        w.queue("b", Some("c"), 1, 8, None);
        let plan = w.run();
        assert_eq!(plan.queued.len(), 1, "{plan:?}");
        assert!(
            plan.queued[0].1.starts_with("waiting for capacity"),
            "{plan:?}"
        );
        assert!(w
            .index
            .reservation("a2")
            .unwrap()
            .reason
            .starts_with("waiting for capacity"));
        assert_eq!(w.run().still_waiting, 1);
    }

    #[test]
    fn queues_are_served_by_weighted_dominant_share() {
        for (wx, wy, want_x) in [(1, 1, 8), (3, 1, 12)] {
            // 16 GPUs, two queues of 8 in one cohort; each asks for all 16,
            // x at a higher priority.
            let mut w = World::new(2);
            w.queue("x", Some("c"), wx, 8, None);
            w.queue("y", Some("c"), wy, 8, None);
            for i in 0..16 {
                w.request_in(Some("x"), &format!("x{i:02}"), 1, Shape::Any, 10);
                w.request_in(Some("y"), &format!("y{i:02}"), 1, Shape::Any, 0);
            }
            let shares = projections::quota::fair_shares(&w.index, "p");
            let fair: Vec<u64> = shares.iter().map(|s| s.fair).collect();
            assert_eq!(fair, [want_x, 16 - want_x], "{shares:?}");
            w.run();
            // Priority decides within a queue, fairness across them.
            assert_eq!(w.used("x"), want_x, "weights {wx}:{wy}");
            assert_eq!(w.used("y"), 16 - want_x, "weights {wx}:{wy}");
            assert_eq!(w.phase("x00"), Some(Phase::Placed));
            let shares = projections::quota::fair_shares(&w.index, "p");
            assert!(shares.iter().all(|s| s.used == s.fair), "{shares:?}");
        }
    }

    #[test]
    fn priority_orders_a_batch() {
        let mut w = World::new(1);
        w.request("low", 8, Shape::Any, 0);
        w.request("high", 8, Shape::Any, 5);
        w.run();
        assert_eq!(w.index.reservation("high").unwrap().phase, Phase::Placed);
        assert_eq!(w.index.reservation("low").unwrap().phase, Phase::Queued);
    }

    #[test]
    fn health_and_cordons_take_effect_on_the_event() {
        let mut w = World::new(2);
        w.pool(&Fact::HealthRaised {
            node: "n00".into(),
            device: Some("gpu3".into()),
            condition: "XID-79".into(),
            detail: String::new(),
        });
        assert_eq!(w.index.class("p", C).unwrap().node_free("n00"), 7);
        w.pool(&Fact::NodeCordoned {
            node: "n01".into(),
            reason: "maintenance".into(),
        });
        assert_eq!(w.index.class("p", C).unwrap().node_free("n01"), 0);
        // Only n00's 7 healthy GPUs are placeable.
        w.request("a", 8, Shape::Node, 0);
        assert_eq!(w.run().queued.len(), 1);
        w.request("b", 7, Shape::Any, 0);
        w.run();
        let b = w.allocs("b");
        assert_eq!(b[0].node, "n00");
        assert!(!b[0].devices.contains(&"gpu3".to_string()));
        // Uncordoning n01 lets `a` place there.
        w.pool(&Fact::NodeUncordoned { node: "n01".into() });
        w.run();
        assert_eq!(w.allocs("a")[0].node, "n01");
        // A node-wide condition removes the node.
        w.pool(&Fact::HealthRaised {
            node: "n00".into(),
            device: None,
            condition: "ECC".into(),
            detail: String::new(),
        });
        assert!(w
            .index
            .class("p", C)
            .unwrap()
            .nodes_best_fit(1)
            .next()
            .is_none());
        assert!(w.index.derived_is_consistent());
    }

    #[test]
    fn invalid_placements_are_reported() {
        let mut w = World::new(1);
        w.request("a", 1, Shape::Any, 0);
        w.request("b", 1, Shape::Any, 0);
        w.pool(&Fact::HealthRaised {
            node: "n00".into(),
            device: Some("gpu7".into()),
            condition: "XID-48".into(),
            detail: String::new(),
        });
        let on = |d: &str| {
            vec![Allocation {
                node: "n00".into(),
                devices: vec![d.into()],
            }]
        };
        assert_eq!(
            w.pool(&Fact::ReservationPlaced {
                reservation: "a".into(),
                allocations: on("gpu0")
            }),
            None
        );
        let v = w
            .pool(&Fact::ReservationPlaced {
                reservation: "b".into(),
                allocations: on("gpu0"),
            })
            .expect("double booking is a violation");
        assert!(v.message.contains("double booking"), "{v}");
        let v = w
            .pool(&Fact::ReservationPlaced {
                reservation: "a".into(),
                allocations: on("gpu1"),
            })
            .expect("placing twice is a violation");
        assert!(v.message.contains("placed while placed"), "{v}");
        w.request("c", 1, Shape::Any, 0);
        let v = w
            .pool(&Fact::ReservationPlaced {
                reservation: "c".into(),
                allocations: on("gpu7"),
            })
            .unwrap();
        assert!(v.message.contains("unhealthy"), "{v}");
        let v = w
            .pool(&Fact::ReservationPlaced {
                reservation: "nope".into(),
                allocations: on("gpu2"),
            })
            .unwrap();
        assert!(v.message.contains("unknown"), "{v}");
        assert_eq!(w.index.state().violations, 4);
    }

    #[test]
    fn a_gap_is_refused() {
        let mut w = World::new(1);
        let mut e = w.log.push(
            "pool/p",
            &Fact::NodeLeft {
                node: "n00".into(),
                reason: String::new(),
            },
        );
        e.position = events::Position(e.position.0 + 2);
        let err = w.index.apply(&e).unwrap_err();
        assert!(err.to_string().contains("never arrived"), "{err}");
    }

    /// A long random run: incremental upkeep equals a rebuild, the planner
    /// never produces an invalid placement, and bookings stay consistent.
    #[test]
    fn random_runs_keep_the_index_consistent() {
        for seed in [7, 8, 9] {
            random_run(
                seed,
                match seed {
                    7 => World::new(12),
                    8 => World::mixed(12),
                    _ => {
                        // Shared by queues: two in a cohort, one alone.
                        let mut w = World::new(12);
                        w.queue("q0", Some("c"), 1, 30, None);
                        w.queue("q1", Some("c"), 2, 30, Some(10));
                        w.queue("q2", None, 1, 20, None);
                        w
                    }
                },
            );
        }
    }

    fn random_run(seed: u64, mut w: World) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut live: Vec<String> = Vec::new();
        let mut placed = 0;
        for step in 0..600 {
            match rng.u32(0..10) {
                0..=4 => {
                    let id = format!("r{step}");
                    let shape = match rng.u32(0..4) {
                        0 => Shape::Node,
                        1 => Shape::Island,
                        2 => Shape::Gang {
                            nodes: 2,
                            gpus_per_node: rng.u32(1..5),
                        },
                        _ => Shape::Any,
                    };
                    let gpus = match shape {
                        Shape::Gang {
                            nodes,
                            gpus_per_node,
                        } => nodes * gpus_per_node,
                        Shape::Island => rng.u32(1..5),
                        _ => rng.u32(1..9),
                    };
                    let shared = !w.index.pool("p").unwrap().queues.is_empty();
                    let queue = shared.then(|| format!("q{}", rng.u32(0..3)));
                    w.request_in(queue.as_deref(), &id, gpus, shape, rng.i32(0..3));
                    // Now and then a quota changes.
                    if shared && rng.u32(0..20) == 0 {
                        w.queue("q0", Some("c"), 1, rng.u32(10..40), None);
                    }
                }
                5..=6 if !live.is_empty() => {
                    let id = live.swap_remove(rng.usize(..live.len()));
                    w.release(&id);
                }
                7 => {
                    let node = format!("n{:02}", rng.u32(0..12));
                    let device = Some(format!("gpu{}", rng.u32(0..8)));
                    let fact = if rng.bool() {
                        Fact::HealthRaised {
                            node,
                            device,
                            condition: "XID-79".into(),
                            detail: String::new(),
                        }
                    } else {
                        Fact::HealthCleared {
                            node,
                            device,
                            condition: "XID-79".into(),
                        }
                    };
                    w.pool(&fact);
                }
                8 => {
                    let node = format!("n{:02}", rng.u32(0..12));
                    let fact = if rng.bool() {
                        Fact::NodeCordoned {
                            node,
                            reason: String::new(),
                        }
                    } else {
                        Fact::NodeUncordoned { node }
                    };
                    w.pool(&fact);
                }
                _ => {
                    let plan = w.run();
                    placed += plan.placed.len();
                    live.extend(plan.placed.into_iter().map(|(id, _)| id));
                }
            }
            if step % 50 == 0 {
                assert!(w.index.derived_is_consistent(), "step {step}");
                w.index.check_bookings().unwrap();
            }
        }
        assert!(w.index.derived_is_consistent());
        assert_eq!(w.index.state().violations, 0);
        assert!(placed > 100, "the run placed {placed}");
        // And a rebuild from the whole log equals the live index.
        let mut rebuilt = Index::new();
        for e in &w.log.events {
            assert_eq!(rebuilt.apply(e).unwrap(), None);
        }
        assert!(rebuilt == w.index);
        // A snapshot round-trips and resumes to the same index.
        let bytes = projections::snapshot::encode(w.index.state());
        let loaded = Index::from_state(projections::snapshot::decode(&bytes).unwrap());
        assert!(loaded == w.index);
        let mut bad = bytes.clone();
        let at = bad.len() / 2;
        bad[at] ^= 0x40;
        assert!(projections::snapshot::decode(&bad).is_err());
        assert!(projections::snapshot::decode(&bytes[..bytes.len() - 3]).is_err());
    }
}
