//! Backfill without starvation: a request that waits for capacity keeps
//! what it will start on, and a request behind it may use only what that
//! start does not need, or what it gives back before then.
//!
//! ```text
//!  waiting request W (ahead in placement order: priority, then position)
//!        |  walk the pool's live reservations of W's class by expiry,
//!        |  each counted as gone, until W fits (place_one)
//!        v
//!  W's hold: its start S (the expiry that made it fit) and the devices
//!  it would take then; those free now are held (booked in the index under
//!  a name no reservation has) while the batch is planned
//!        |
//!        v
//!  a request R behind W is planned with W's holds in place, unless R has a
//!  TTL that ends by S; R ahead of W (or W itself) plans with them lifted
//! ```
//!
//! So R never takes a device W's start needs, unless R is gone by then,
//! and W's start, recomputed every batch, is never later than it was: the
//! devices it needs are either held or booked by reservations that end by
//! S. The holds are undone before the plan is returned, like every booking
//! of a batch: the index only changes by applying the log.
//!
//! What holds nothing: a request whose start no TTL tells (what it needs
//! is held by reservations without one, or lies past the first
//! [`MAX_WALK`] expiries, [`MAX_PLACING_WALK`] for shapes other than whole
//! nodes) holds nothing, and only the first
//! [`MAX_HOLDS`] waiting requests of a batch hold anything (of the first
//! [`MAX_TRIES`] whose start it looks for). A request
//! waiting for quota holds nothing either: it waits for its queue, not for
//! devices.
//!
//! Windows hold the same way ([`Holds::hold_windows`]): the devices
//! promised to a reservation in advance, and the nodes of a maintenance
//! window, are held from every request that would not end before the
//! window begins, as if a request ahead of all waited to start there.

use crate::fit::{pick_on_node, place_one};
use domain::{Allocation, Request, Shape};
use domain::{Tier, Topology};
use projections::index::{Index, Reservation};
use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, UNIX_EPOCH};

/// Where a request stands in its pool's placement order: priority (highest
/// first), then request position. Smaller is ahead.
pub type Order = (Reverse<i32>, u64);

/// Where a reservation stands in its pool's placement order.
pub fn order(r: &Reservation) -> Order {
    (Reverse(r.request.priority), r.requested_at)
}

/// Most live reservations counted as gone to find one request's start on
/// whole nodes (counted per node: cheap).
pub const MAX_WALK: usize = 65_536;
/// Most live reservations counted as gone, on the index, to find the start
/// of a request of another shape (each is unbooked and booked again).
pub const MAX_PLACING_WALK: usize = 512;
/// Most waiting requests one batch holds devices for.
pub const MAX_HOLDS: usize = 8;
/// Most waiting requests whose start one batch looks for, found or not:
/// a walk costs up to [`MAX_WALK`] steps, and when what waits has no start
/// the TTLs tell, every blocked request of a batch would walk in vain.
pub const MAX_TRIES: usize = 2 * MAX_HOLDS;
/// How long before a window (a promise, a maintenance) a request must end
/// to be lent its devices: room for the placement's commit, which the
/// index judges at its own time.
pub const WINDOW_MARGIN_MS: u64 = 2_000;
/// Most queued requests looked at, before a batch, for those to hold for.
const MAX_SCAN: usize = 64;

/// A waiting request's hold: its start as the TTLs tell it, and what of
/// it is held.
#[derive(Debug, Clone)]
struct Hold {
    id: String,
    class: String,
    order: Order,
    start_ms: u64,
    /// The devices it would take at its start that are free now, booked in
    /// the index under [`Hold::name`] unless lifted.
    held: Vec<Allocation>,
    lifted: bool,
    /// A window's (a promise or a maintenance), not a waiting request's.
    window: bool,
}

impl Hold {
    /// Devices it holds.
    fn held_count(&self) -> u64 {
        self.held.iter().map(|a| a.devices.len() as u64).sum()
    }

    /// The name its holds are booked under: no reservation id starts with
    /// a NUL.
    fn name(&self) -> String {
        format!("\0held for {}", self.id)
    }

    fn lift(&mut self, index: &mut Index, pool: &str) {
        let name = self.name();
        for a in &self.held {
            index.unbook(pool, a, &name);
        }
        self.lifted = true;
    }

    /// Books its holds again, keeping only what is still free (a request
    /// planned while they were lifted may have taken some).
    fn restore(&mut self, index: &mut Index, pool: &str) {
        let name = self.name();
        for a in &mut self.held {
            let refused = index.book(pool, a, &name);
            a.devices.retain(|d| !refused.contains(d));
        }
        self.held.retain(|a| !a.devices.is_empty());
        self.lifted = false;
    }
}

/// The holds of a batch's waiting requests, and the batch's moment.
#[derive(Debug, Default)]
pub struct Holds {
    now_ms: u64,
    /// What the batch ends: free already, so never waited for.
    gone: HashSet<String>,
    holds: Vec<Hold>,
    /// Starts looked for so far, found or not.
    tries: usize,
}

impl Holds {
    /// The batch's moment (Unix ms).
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }
}

/// The holds lifted for one request, to be restored after it is planned.
#[must_use]
pub struct Lifted(Vec<usize>);

impl Holds {
    /// Holds for a batch planned at `now_ms` (Unix ms) that ends `gone`.
    pub fn new(now_ms: u64, gone: &[String]) -> Holds {
        Holds {
            now_ms,
            gone: gone.iter().cloned().collect(),
            holds: Vec::new(),
            tries: 0,
        }
    }

    /// Waiting requests holding devices now.
    pub fn count(&self) -> usize {
        self.holds.iter().filter(|h| !h.window).count()
    }

    /// Holds the devices of the pool's windows that are not over: those
    /// promised to reservations in advance that start later, and the nodes
    /// of maintenance windows. They bind every request that would not end
    /// [`WINDOW_MARGIN_MS`] before the window begins (its placement commits
    /// a little after the plan, and the index judges it by then).
    pub fn hold_windows(&mut self, index: &mut Index, pool: &str) {
        let now = self.now_ms;
        let ahead: Order = (Reverse(i32::MAX), 0);
        let mut windows: Vec<Hold> = Vec::new();
        if let Some(q) = index.queues(pool) {
            for (start, id) in q.promised.iter().filter(|(s, _)| *s > now) {
                let Some(r) = index.reservation(id) else {
                    continue;
                };
                let Some(p) = &r.promise else {
                    continue;
                };
                windows.push(Hold {
                    id: id.clone(),
                    class: r.request.class.clone(),
                    order: ahead,
                    start_ms: start.saturating_sub(WINDOW_MARGIN_MS),
                    held: p.allocations.clone(),
                    lifted: true,
                    window: true,
                });
            }
        }
        if let Some(p) = index.pool(pool) {
            for (node, n) in &p.nodes {
                for w in n.maintenance.iter().filter(|w| w.end_ms > now) {
                    // One hold per class of the node's devices.
                    let mut by_class: HashMap<&str, Vec<String>> = HashMap::new();
                    for d in &n.devices {
                        by_class
                            .entry(&d.spec.class)
                            .or_default()
                            .push(d.spec.id.clone());
                    }
                    for (class, devices) in by_class {
                        windows.push(Hold {
                            id: format!("maintenance of node {node}"),
                            class: class.to_string(),
                            order: ahead,
                            start_ms: w.start_ms.max(now).saturating_sub(WINDOW_MARGIN_MS),
                            held: vec![Allocation {
                                node: node.clone(),
                                devices,
                            }],
                            lifted: true,
                            window: true,
                        });
                    }
                }
            }
        }
        for w in windows {
            self.push_window(index, pool, w);
        }
    }

    /// Holds the devices just promised to `id` from `start_ms`, for the
    /// rest of the batch.
    pub fn hold_promise(
        &mut self,
        index: &mut Index,
        pool: &str,
        id: &str,
        class: &str,
        start_ms: u64,
        allocations: &[Allocation],
    ) {
        let hold = Hold {
            id: id.to_string(),
            class: class.to_string(),
            order: (Reverse(i32::MAX), 0),
            start_ms: start_ms.saturating_sub(WINDOW_MARGIN_MS),
            held: allocations.to_vec(),
            lifted: true,
            window: true,
        };
        self.push_window(index, pool, hold);
    }

    fn push_window(&mut self, index: &mut Index, pool: &str, mut hold: Hold) {
        hold.restore(index, pool);
        self.holds.push(hold);
    }

    /// Holds for the queued requests of `pool` that wait for capacity and
    /// stand ahead of some request of the batch (`last`: the batch's last
    /// in placement order) but are not in it (`batch`), before the batch is
    /// planned.
    pub fn hold_queued(
        &mut self,
        index: &mut Index,
        pool: &str,
        last: Option<Order>,
        batch: &[String],
    ) {
        let Some(last) = last else {
            return;
        };
        let waiting: Vec<String> = match index.queues(pool) {
            Some(q) => q
                .queued
                .iter()
                .take(MAX_SCAN)
                .take_while(|k| (k.0, k.1) < last)
                .filter(|k| !batch.contains(&k.2))
                .filter(|k| {
                    index
                        .reservation(&k.2)
                        .is_some_and(|r| waits_for_devices(&r.reason))
                })
                .map(|k| k.2.clone())
                .collect(),
            None => return,
        };
        for id in waiting {
            self.hold(index, pool, &id);
        }
    }

    /// Holds for request `id`, which does not fit now: finds its start from
    /// the live reservations' expiries (those the batch ends are free
    /// already) and holds what of it is free now. Nothing when its start
    /// is unknown, or [`MAX_HOLDS`] are held already, or the batch
    /// looked for [`MAX_TRIES`] starts.
    pub fn hold(&mut self, index: &mut Index, pool: &str, id: &str) {
        if self.count() >= MAX_HOLDS
            || self.tries >= MAX_TRIES
            || self.holds.iter().any(|s| s.id == id)
        {
            return;
        }
        self.tries += 1;
        let Some(r) = index.reservation(id) else {
            return;
        };
        let order = order(r);
        let request = r.request.clone();
        let Some((start_ms, at_start)) = start(index, pool, &request, &self.gone, self.now_ms)
        else {
            return;
        };
        let mut hold = Hold {
            id: id.to_string(),
            class: request.class.clone(),
            order,
            start_ms,
            held: at_start,
            lifted: true,
            window: false,
        };
        hold.restore(index, pool);
        self.holds.push(hold);
    }

    /// Lifts the holds that a request at `order` with time to live `ttl_ms`
    /// need not respect (see [`binds`]).
    pub fn lift_for(
        &mut self,
        index: &mut Index,
        pool: &str,
        order: Order,
        ttl_ms: Option<u64>,
    ) -> Lifted {
        let now_ms = self.now_ms;
        self.lift_where(index, pool, |s| !binds(s, now_ms, order, ttl_ms))
    }

    /// When `request` (at `order`), which does not fit with the holds that
    /// bind it in place, would fit without any: the GPUs of its class free
    /// then. A request of any shape fits by count; others are placed with
    /// the holds lifted.
    pub fn free_without(
        &mut self,
        index: &mut Index,
        pool: &str,
        request: &Request,
        order: Order,
    ) -> Option<u64> {
        let now_ms = self.now_ms;
        let of_class = || self.holds.iter().filter(|s| s.class == request.class);
        if !of_class().any(|s| s.held_count() > 0 && binds(s, now_ms, order, request.ttl_ms)) {
            return None;
        }
        let held: u64 = of_class().map(Hold::held_count).sum();
        let free = index.class(pool, &request.class).map_or(0, |c| c.free) + held;
        if matches!(request.shape, Shape::Any) {
            return (free >= request.gpus as u64).then_some(free);
        }
        let lifted = self.lift_where(index, pool, |_| true);
        let fits = place_one(index, pool, request).is_some();
        self.restore(index, pool, lifted);
        fits.then_some(free)
    }

    fn lift_where(
        &mut self,
        index: &mut Index,
        pool: &str,
        lift: impl Fn(&Hold) -> bool,
    ) -> Lifted {
        let mut lifted = Vec::new();
        for (i, s) in self.holds.iter_mut().enumerate() {
            if !s.lifted && lift(s) {
                s.lift(index, pool);
                lifted.push(i);
            }
        }
        Lifted(lifted)
    }

    /// Restores the holds lifted for one request, after it was planned.
    pub fn restore(&mut self, index: &mut Index, pool: &str, lifted: Lifted) {
        for i in lifted.0 {
            self.holds[i].restore(index, pool);
        }
    }

    /// Why a request at `order` with time to live `ttl_ms`, which fits
    /// only without the holds, waits: the first held-for request whose
    /// holds bind it.
    pub fn held_back(&self, order: Order, ttl_ms: Option<u64>, class: &str, free: u64) -> String {
        let first = self
            .holds
            .iter()
            .find(|s| !s.held.is_empty() && binds(s, self.now_ms, order, ttl_ms));
        match first {
            Some(s) => format!(
                "held back: {free} {class} GPUs are free, but those it could use are kept for {}, waiting ahead of it to start by {} (the TTLs of what it waits for); a request whose TTL ends by then may use them",
                s.id,
                humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(s.start_ms)),
            ),
            None => format!("held back: {free} {class} GPUs are free, but kept for requests ahead of it"),
        }
    }

    /// Undoes every hold: the index is left as it was.
    pub fn release(&mut self, index: &mut Index, pool: &str) {
        for s in &mut self.holds {
            if !s.lifted {
                s.lift(index, pool);
            }
        }
        self.holds.clear();
    }
}

/// Whether `s`'s holds bind a request at `order` with time to live
/// `ttl_ms`: `s` waits ahead of it, and it would not end by `s`'s start.
fn binds(s: &Hold, now_ms: u64, order: Order, ttl_ms: Option<u64>) -> bool {
    let ends_by = ttl_ms.map(|t| now_ms.saturating_add(t));
    s.order < order && ends_by.is_none_or(|end| end > s.start_ms)
}

/// Whether a waiting request's reason is about devices (capacity, its
/// shape, topology, or held back for another), not its queue's quota or a
/// preemption under way.
fn waits_for_devices(reason: &str) -> bool {
    ["waiting for capacity", "topology cannot", "held back"]
        .iter()
        .any(|p| reason.starts_with(p))
}

/// When `request` could start at the earliest, by the TTLs of the pool's
/// live reservations of its class, and where. Those in `gone` are free
/// already; those being preempted are skipped (their devices go to their
/// preemptor). Whole nodes (a node shape, a gang, within a tier or not)
/// are counted node by node ([`start_on_nodes`]); other shapes are placed
/// on the index with the reservations counted as gone ([`start_by_placing`]).
fn start(
    index: &mut Index,
    pool: &str,
    request: &Request,
    gone: &HashSet<String>,
    now_ms: u64,
) -> Option<(u64, Vec<Allocation>)> {
    let ends = Ends {
        pool,
        class: &request.class,
        gone,
        now_ms,
    };
    match (request.shape, request.topology) {
        (Shape::Node, _) => start_on_nodes(index, pool, request, &ends, 1, request.gpus, None),
        (
            Shape::Gang {
                nodes,
                gpus_per_node,
            },
            None | Some(Topology::Prefer(_)),
        ) => start_on_nodes(index, pool, request, &ends, nodes, gpus_per_node, None),
        (
            Shape::Gang {
                nodes,
                gpus_per_node,
            },
            Some(Topology::Within(tier)),
        ) => start_on_nodes(
            index,
            pool,
            request,
            &ends,
            nodes,
            gpus_per_node,
            Some(tier),
        ),
        _ => start_by_placing(index, pool, request, &ends),
    }
}

/// The live reservations of a class that end by their TTL, in the order
/// they do (with when: not before now).
struct Ends<'a> {
    pool: &'a str,
    class: &'a str,
    gone: &'a HashSet<String>,
    now_ms: u64,
}

impl<'a> Ends<'a> {
    fn iter<'i>(&'i self, index: &'i Index) -> impl Iterator<Item = (u64, &'i str)> + 'i {
        index
            .queues(self.pool)
            .into_iter()
            .flat_map(|q| q.expiries.iter())
            .filter(move |(_, id)| {
                !self.gone.contains(id)
                    && index
                        .reservation(id)
                        .is_some_and(|r| r.request.class == self.class && r.preempted_by.is_none())
            })
            .map(move |(at, id)| ((*at).max(self.now_ms), id.as_str()))
    }
}

/// [`start`] for `n` nodes with `g` free each (within one value of `tier`
/// when given): the first `n` nodes to have `g` free as the reservations
/// end, counted per node without touching the index (at most
/// [`MAX_WALK`] reservations), held on each: its devices free now.
fn start_on_nodes(
    index: &Index,
    pool: &str,
    request: &Request,
    ends: &Ends,
    n: u32,
    g: u32,
    tier: Option<Tier>,
) -> Option<(u64, Vec<Allocation>)> {
    let (c, p) = (index.class(pool, &request.class)?, index.pool(pool)?);
    let n = n as usize;
    // Per tier value ("" without a tier): the nodes with `g` free, those
    // free now first, then in the order they get there.
    let mut ready: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut freed: HashMap<&str, u32> = HashMap::new();
    let mut found = None;
    'walk: for (at, id) in ends.iter(index).take(MAX_WALK) {
        let Some(r) = index.reservation(id) else {
            continue;
        };
        for a in &r.allocations {
            let Some(node) = p.nodes.get(&a.node).filter(|x| x.schedulable()) else {
                continue;
            };
            let usable = a
                .devices
                .iter()
                .filter_map(|d| node.device(d))
                .filter(|(_, d)| {
                    d.spec.class == request.class && d.present && d.conditions.is_empty()
                })
                .count() as u32;
            let was = freed.get(a.node.as_str()).copied().unwrap_or(0);
            freed.insert(a.node.as_str(), was + usable);
            let before = c.node_free(&a.node) + was;
            if before >= g || before + usable < g {
                continue;
            }
            let value = match tier {
                None => "",
                Some(t) => match node.label(t) {
                    Some(v) => v,
                    None => continue,
                },
            };
            let list = ready.entry(value).or_insert_with(|| match tier {
                None => c.nodes_best_fit(g).map(|(x, _)| x).take(n).collect(),
                Some(t) => c.tier(t).nodes(value, g).take(n).collect(),
            });
            list.push(a.node.as_str());
            if list.len() >= n {
                found = Some((at, list[..n].to_vec()));
                break 'walk;
            }
        }
    }
    let (at, nodes) = found?;
    let mut held = Vec::new();
    for node in nodes {
        let free = c.node_free(node).min(g);
        if free == 0 {
            continue;
        }
        if let Some(devices) = pick_on_node(index, pool, node, &request.class, free) {
            held.push(Allocation {
                node: node.to_string(),
                devices,
            });
        }
    }
    Some((at, held))
}

/// [`start`] for the other shapes: the reservations counted as gone on the
/// index one by one (at most [`MAX_PLACING_WALK`]) until the request fits
/// ([`place_one`]). The index is left as it was.
fn start_by_placing(
    index: &mut Index,
    pool: &str,
    request: &Request,
    ends: &Ends,
) -> Option<(u64, Vec<Allocation>)> {
    let walk: Vec<(u64, String, Vec<Allocation>)> = ends
        .iter(index)
        .take(MAX_PLACING_WALK)
        .filter_map(|(at, id)| {
            Some((
                at,
                id.to_string(),
                index.reservation(id)?.allocations.clone(),
            ))
        })
        .collect();
    let mut found = None;
    let mut ended = 0;
    for (at, id, allocations) in &walk {
        for a in allocations {
            index.unbook(pool, a, id);
        }
        ended += 1;
        let free = index.class(pool, &request.class).map_or(0, |c| c.free);
        if free < request.gpus as u64 {
            continue;
        }
        if let Some(allocs) = place_one(index, pool, request) {
            found = Some((*at, allocs));
            break;
        }
    }
    for (_, id, allocations) in walk.iter().take(ended) {
        for a in allocations {
            let refused = index.book(pool, a, id);
            debug_assert!(
                refused.is_empty(),
                "a live reservation's devices are as they were"
            );
        }
    }
    found
}
