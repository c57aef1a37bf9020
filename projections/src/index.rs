//! The pool index: every pool's nodes, their GPUs by class, free and booked
//! devices, health, cordons and NVLink islands, and every reservation that is
//! pending or live, folded from the log one event at a time.
//!
//! [`State`] is what the log says, and is what a snapshot stores. Beside it
//! the index keeps derived structures, rebuilt from the state on load and
//! kept up to date on every event: per pool and class, nodes bucketed by
//! their count of free devices and islands bucketed the same way, so the best
//! node or island for a request is found by a range lookup in a `BTreeMap`
//! (logarithmic in the number of distinct free counts), never by a scan.

use crate::hashing::FastMap;
use crate::tally::Tally;
use domain::{Allocation, DeviceSpec, Fact, QueueSpec, Request, Shape};
use events::Event;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::time::UNIX_EPOCH;

mod apply;

/// What the log says about pools and reservations, up to `position`.
#[derive(Debug, Clone, PartialEq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct State {
    /// The last position applied.
    pub position: u64,
    pub pools: BTreeMap<String, Pool>,
    /// Reservations that are pending or live; terminal ones are dropped.
    /// Hashed: the planner looks each request up several times a batch,
    /// and nothing depends on their order.
    pub reservations: crate::hashing::FastMap<String, Reservation>,
    /// Facts whose payload did not parse (skipped, counted).
    pub malformed: u64,
    /// Events that broke an invariant (applied as far as possible, counted).
    pub violations: u64,
    /// A failed reservation -> the live one placed again in its place
    /// (`replaces`), so that releasing the first releases the second.
    pub replaced_by: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Pool {
    pub name: String,
    /// Whether `pool.created` was seen.
    pub created: bool,
    pub description: String,
    /// The version of the pool's stream: the fence placements commit against.
    pub version: u64,
    /// Bumped by every event that may free capacity (a release, a node
    /// joining, a cordon lifted, a condition cleared), so waiting
    /// reservations are tried again only when something changed.
    pub capacity_epoch: u64,
    pub nodes: BTreeMap<String, Node>,
    /// The pool's queues (`queue.configured`), by name: who may use how
    /// much of it.
    pub queues: BTreeMap<String, QueueSpec>,
    /// Faults are reported, not acted on (`pool.fault_policy_set`).
    pub faults_advisory: bool,
    /// The circuit breaker (`pool.fault_policy_set`); `None`: the default.
    pub max_quarantined_percent: Option<u32>,
    /// Its placer does not preempt (`pool.preemption_set`).
    pub preemption_off: bool,
    /// Cohorts whose fair share remembers past usage, with its half-life
    /// in ms (`cohort.decay_set`).
    pub half_lives: BTreeMap<String, u64>,
    /// Each queue's past usage per GPU class (queue -> class -> GPU-ms,
    /// decayed), carried forward at each placement and ending of the queue
    /// (see [`crate::decay`]); kept whether its cohort's decay is on or not.
    pub past: BTreeMap<String, BTreeMap<String, crate::decay::Decayed>>,
    /// Each queue's GPU time in the current day, week and month, for its
    /// budgets (see [`crate::spent`]), carried like `past`.
    pub spent: BTreeMap<String, crate::spent::Spent>,
}

impl Pool {
    /// How its placer acts on GPU faults.
    pub fn fault_policy(&self) -> domain::faults::Policy {
        domain::faults::Policy {
            automatic: !self.faults_advisory,
            max_quarantined_percent: self
                .max_quarantined_percent
                .unwrap_or(domain::faults::DEFAULT_MAX_QUARANTINED_PERCENT),
        }
    }

    /// GPUs present in the pool, and those out of service for faults
    /// (quarantined, one of its MIG instances quarantined, or on a node
    /// drained for a fault). MIG instances are counted as their GPU.
    pub fn fault_budget(&self) -> (usize, usize) {
        let (mut total, mut out) = (0, 0);
        for n in self.nodes.values().filter(|n| !n.left) {
            for d in n
                .devices
                .iter()
                .filter(|d| d.present && d.spec.parent.is_none())
            {
                total += 1;
                let instance_out = || {
                    n.devices.iter().any(|i| {
                        i.quarantine.is_some() && i.spec.parent.as_deref() == Some(&d.spec.id)
                    })
                };
                if d.quarantine.is_some() || n.drained_for.is_some() || instance_out() {
                    out += 1;
                }
            }
        }
        (total, out)
    }
}

#[derive(Debug, Clone, PartialEq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Node {
    pub devices: Vec<Device>,
    /// Maintenance windows not over yet (`node.maintenance_scheduled`).
    pub maintenance: Vec<Window>,
    pub cordoned: Option<String>,
    pub drained: Option<String>,
    /// When a drain ends the node's live reservations (unix ms); at once
    /// when `None`.
    pub drain_deadline_ms: Option<u64>,
    pub left: bool,
    /// Why it left (`revoked`, or empty for a plain leave).
    pub left_reason: String,
    /// Node-wide health conditions.
    pub conditions: Vec<String>,
    /// A fault that asks for the node to be drained (node-wide, or on a
    /// GPU: `XID-79`), waiting for the pool's placer to act on it: no new
    /// placement meanwhile.
    pub fault: Option<String>,
    /// The fault it was drained for, when a fault drained it.
    pub drained_for: Option<String>,
    /// Why its last acceptance check failed, when it failed as a whole
    /// (`node.acceptance_reported`): no placement until one passes.
    pub acceptance_failed: Option<String>,
    /// Unix milliseconds of the `node.contact_lost` in force, if contact is
    /// lost.
    pub unreachable_since_ms: Option<u64>,
    /// Its rack, block and rail group in the pool's topology
    /// (`node.topology_set`).
    pub rack: Option<String>,
    pub block: Option<String>,
    pub rail: Option<String>,
}

impl Node {
    /// Its label of `tier`, if it has one.
    pub fn label(&self, tier: domain::Tier) -> Option<&str> {
        use domain::Tier;
        match tier {
            Tier::Rack => self.rack.as_deref(),
            Tier::Block => self.block.as_deref(),
            Tier::Rail => self.rail.as_deref(),
        }
    }

    /// Whether new placements may land on the node.
    pub fn schedulable(&self) -> bool {
        !self.left
            && self.unreachable_since_ms.is_none()
            && self.cordoned.is_none()
            && self.drained.is_none()
            && self.fault.is_none()
            && self.acceptance_failed.is_none()
    }

    /// Whether live reservations on the node may have to end: it left, is
    /// drained, the region lost contact with it, or a GPU of a live
    /// reservation is quarantined.
    pub fn troubled(&self) -> bool {
        self.left
            || self.drained.is_some()
            || self.unreachable_since_ms.is_some()
            || self.quarantined_bookings().next().is_some()
    }

    /// Reservations holding a quarantined device, or a MIG instance of a
    /// quarantined GPU: those a quarantine ends (`gpu_fault`), once per
    /// device they hold.
    pub fn quarantined_bookings(&self) -> impl Iterator<Item = &str> {
        self.devices.iter().filter_map(move |d| {
            let quarantined = d.quarantine.is_some()
                || d.spec.parent.as_deref().is_some_and(|p| {
                    self.devices
                        .iter()
                        .any(|g| g.spec.id == p && g.quarantine.is_some())
                });
            d.booked_by.as_deref().filter(|_| quarantined)
        })
    }

    /// Whether a fault on the node or a GPU of it waits for the placer, or
    /// a quarantined GPU of it may be restored.
    pub fn fault_pending(&self) -> bool {
        self.fault.is_some()
            || self
                .devices
                .iter()
                .any(|d| d.fault.is_some() || d.restorable())
    }

    /// Whether each device may be booked now (in device order), ignoring
    /// whether the node is schedulable: it is free itself, and a MIG
    /// instance's GPU is neither booked nor out of service, and a GPU with
    /// MIG instances (present, or booked) is never booked whole. So a GPU and its
    /// instances are never booked at once, and a fault on a GPU keeps its
    /// instances out of placement.
    pub fn free_devices(&self) -> Vec<bool> {
        let mut free: Vec<bool> = self.devices.iter().map(Device::own_free).collect();
        if self.devices.iter().all(|d| d.spec.parent.is_none()) {
            return free;
        }
        // The GPUs with present instances, and whether they hold their
        // instances back (booked whole, or out of service): a handful.
        let mut gpus: Vec<(&str, bool)> = Vec::new();
        // A booked instance the node no longer reports still holds its GPU.
        for d in self
            .devices
            .iter()
            .filter(|d| d.present || d.booked_by.is_some())
        {
            if let Some(p) = d.spec.parent.as_deref() {
                if !gpus.iter().any(|(g, _)| *g == p) {
                    gpus.push((p, false));
                }
            }
        }
        for (i, d) in self.devices.iter().enumerate() {
            if let Some(g) = gpus.iter_mut().find(|(g, _)| *g == d.spec.id) {
                g.1 = d.booked_by.is_some() || d.out_of_service();
                free[i] = false;
            }
        }
        for (i, d) in self.devices.iter().enumerate() {
            if let Some(p) = d.spec.parent.as_deref() {
                if gpus.iter().any(|(g, held)| *g == p && *held) {
                    free[i] = false;
                }
            }
        }
        free
    }

    /// Whether booking device `i` now would book a MIG instance and its GPU
    /// at once (the instance's GPU, or one of the GPU's instances, is
    /// booked).
    pub fn books_family(&self, i: usize) -> bool {
        let d = &self.devices[i];
        self.devices.iter().any(|o| {
            o.booked_by.is_some()
                && (d.spec.parent.as_deref() == Some(o.spec.id.as_str())
                    || o.spec.parent.as_deref() == Some(d.spec.id.as_str()))
        })
    }

    /// Reservations holding devices of the node.
    pub fn bookings(&self) -> BTreeSet<&str> {
        self.devices
            .iter()
            .filter_map(|d| d.booked_by.as_deref())
            .collect()
    }

    /// The condition list of a device, or of the node itself when `device`
    /// is `None`; `None` for a device the node does not have.
    fn conditions_mut(&mut self, device: Option<&str>) -> Option<&mut Vec<String>> {
        match device {
            None => Some(&mut self.conditions),
            Some(id) => self
                .devices
                .iter_mut()
                .find(|d| d.spec.id == id)
                .map(|d| &mut d.conditions),
        }
    }

    pub fn device(&self, id: &str) -> Option<(usize, &Device)> {
        self.devices
            .iter()
            .enumerate()
            .find(|(_, d)| d.spec.id == id)
    }
}

#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Device {
    pub spec: DeviceSpec,
    /// Health conditions in force, whatever they ask for.
    pub conditions: Vec<String>,
    /// Whether the node still reports the device.
    pub present: bool,
    pub booked_by: Option<String>,
    /// A fault that asks for the GPU to be taken out of service, waiting
    /// for the pool's placer to act on it: no new placement meanwhile.
    pub fault: Option<String>,
    /// The fault it is quarantined for (`device.quarantined`), until
    /// `device.restored`.
    pub quarantine: Option<String>,
    /// Its node's last acceptance check found it failing: no placement
    /// until one passes.
    pub failed_acceptance: bool,
    /// Quarantined, and a check of its node has passed it since: with the
    /// condition gone, a quarantine for a reset may be lifted.
    pub diagnosed: bool,
}

impl Device {
    /// Free as far as the device itself goes: present, not booked, not
    /// quarantined and no fault waiting. Whether it may be booked also
    /// depends on its node and its MIG family: see [`Node::free_devices`].
    fn own_free(&self) -> bool {
        self.present && self.booked_by.is_none() && !self.out_of_service()
    }

    /// Quarantined for a fault a reset clears (not one that needs
    /// service), the condition gone, and a diagnostic passed since: the
    /// placer may restore it.
    pub fn restorable(&self) -> bool {
        self.diagnosed
            && self.quarantine.as_ref().is_some_and(|c| {
                !self.conditions.contains(c)
                    && domain::faults::classify(c).action.restored_by_diagnostic()
            })
    }

    /// Quarantined, a fault that asks for it waiting, or failing its
    /// node's acceptance check.
    pub fn out_of_service(&self) -> bool {
        self.quarantine.is_some() || self.fault.is_some() || self.failed_acceptance
    }
}

/// A span of time on devices that placements may not last into: a node's
/// maintenance, or a reservation's promise (`[start_ms, end_ms)`, Unix ms).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Window {
    pub start_ms: u64,
    pub end_ms: u64,
    pub reason: String,
}

impl Window {
    /// Whether a reservation booked over `[from, to)` (`to` `None`: with no
    /// end) would last into it.
    pub fn overlaps(&self, from: u64, to: Option<u64>) -> bool {
        from < self.end_ms && to.is_none_or(|t| t > self.start_ms)
    }
}

/// A reservation in advance, promised: where and when it is placed.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Promise {
    pub start_ms: u64,
    pub end_ms: u64,
    pub allocations: Vec<Allocation>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Phase {
    /// Requested, not tried yet.
    Pending,
    /// Tried, waiting for capacity.
    Queued,
    Placed,
    Active,
}

impl Phase {
    pub fn is_live(self) -> bool {
        matches!(self, Phase::Placed | Phase::Active)
    }
    pub fn name(self) -> &'static str {
        match self {
            Phase::Pending => "pending",
            Phase::Queued => "queued",
            Phase::Placed => "placed",
            Phase::Active => "active",
        }
    }
}

#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Reservation {
    pub request: Request,
    pub phase: Phase,
    /// Position of the request: the order among equal priorities.
    pub requested_at: u64,
    pub allocations: Vec<Allocation>,
    /// Unix milliseconds of the placement's commit record.
    pub placed_at_ms: Option<u64>,
    pub expires_at_ms: Option<u64>,
    pub release_requested: bool,
    /// Why it is queued.
    pub reason: String,
    /// The waiting request it is to make room for (`reservation.preemption_scheduled`),
    /// while that request waits.
    pub preempted_by: Option<String>,
    /// When its grace period ends (unix ms); at once when `None`.
    pub preempt_deadline_ms: Option<u64>,
    /// Why it is preempted: `priority` or `reclaim`.
    pub preempt_reason: String,
    /// Why it ends at `expires_at_ms` when that is not its own time to
    /// live: `max_run_time` (its queue's) or `maintenance` (a window on a
    /// node it is on); empty otherwise.
    pub end_reason: String,
    /// Its promise, while it waits for its start (a reservation in
    /// advance, `reservation.promised`).
    pub promise: Option<Promise>,
    /// Its nodes were told of that end (`reservation.ending_noticed`).
    pub noticed: bool,
}

impl Reservation {
    /// Its state as clients are told it: `requested` before its placer
    /// tried it, `promised` for a reservation in advance whose GPUs are
    /// promised, else its phase's name.
    pub fn state(&self) -> &'static str {
        match (self.phase, &self.promise) {
            (Phase::Pending, _) => "requested",
            (Phase::Queued, Some(_)) => "promised",
            (other, _) => other.name(),
        }
    }
}

/// An event that breaks an invariant. The index applies it as far as it can
/// (so live and rebuilt indexes agree) and reports it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("position {position} ({event_type} on {stream}): {message}")]
pub struct Violation {
    pub position: u64,
    pub stream: String,
    pub event_type: String,
    pub message: String,
}

/// An event the index cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// Positions are gap-free; a gap means events were lost on the way.
    #[error("event at position {got} follows position {applied}: positions {missing_from} to {missing_to} never arrived")]
    Gap {
        applied: u64,
        got: u64,
        missing_from: u64,
        missing_to: u64,
    },
}

/// The free devices of one island: by node, device indexes.
#[derive(Debug, Default, Clone, PartialEq)]
struct IslandFree {
    free: u32,
    nodes: BTreeMap<String, Vec<u32>>,
}

/// Free capacity and shape of one device class in one pool.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ClassIndex {
    /// Schedulable nodes with at least one free device of the class.
    node_free: FastMap<String, u32>,
    /// The same nodes by free count.
    by_free: BTreeMap<u32, BTreeSet<String>>,
    /// Free devices per island (only on schedulable nodes).
    island_members: FastMap<String, IslandFree>,
    islands_by_free: BTreeMap<u32, BTreeSet<String>>,
    /// Devices per present node, counted regardless of health and bookings:
    /// what the pool could hold at best. `node size -> nodes`.
    node_sizes: BTreeMap<u32, u32>,
    island_sizes: FastMap<String, u32>,
    island_size_counts: BTreeMap<u32, u32>,
    /// The same free nodes by rack, by block and by rail group (labelled
    /// ones only).
    pub racks: crate::tiers::TierIndex,
    pub blocks: crate::tiers::TierIndex,
    pub rails: crate::tiers::TierIndex,
    /// Present devices, and free ones.
    pub total: u64,
    pub free: u64,
}

fn bump(map: &mut BTreeMap<u32, u32>, key: u32, up: bool) {
    if up {
        *map.entry(key).or_default() += 1;
    } else if let Some(n) = map.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            map.remove(&key);
        }
    }
}

fn bucket_move(buckets: &mut BTreeMap<u32, BTreeSet<String>>, key: &str, from: u32, to: u32) {
    if from == to {
        return;
    }
    // The name moves from set to set, allocated only when first seen.
    let mut moved = None;
    if from > 0 {
        if let Some(set) = buckets.get_mut(&from) {
            moved = set.take(key);
            if set.is_empty() {
                buckets.remove(&from);
            }
        }
    }
    if to > 0 {
        buckets
            .entry(to)
            .or_default()
            .insert(moved.unwrap_or_else(|| key.to_string()));
    }
}

impl ClassIndex {
    /// Free devices on a node (0 if unschedulable).
    pub fn node_free(&self, node: &str) -> u32 {
        self.node_free.get(node).copied().unwrap_or(0)
    }

    /// Nodes with exactly `free` free devices, in name order.
    pub fn nodes_with_free(&self, free: u32) -> impl Iterator<Item = &str> {
        self.by_free
            .get(&free)
            .into_iter()
            .flatten()
            .map(String::as_str)
    }

    /// Nodes with at least `min` free devices, fewest free first (best fit).
    pub fn nodes_best_fit(&self, min: u32) -> impl Iterator<Item = (&str, u32)> {
        self.by_free
            .range(min.max(1)..)
            .flat_map(|(free, nodes)| nodes.iter().map(move |n| (n.as_str(), *free)))
    }

    /// Nodes with free devices, most free first.
    pub fn nodes_most_free(&self) -> impl Iterator<Item = (&str, u32)> {
        self.by_free
            .iter()
            .rev()
            .flat_map(|(free, nodes)| nodes.iter().map(move |n| (n.as_str(), *free)))
    }

    /// Islands with at least `min` free devices, fewest free first.
    pub fn islands_best_fit(&self, min: u32) -> impl Iterator<Item = (&str, u32)> {
        self.islands_by_free
            .range(min.max(1)..)
            .flat_map(|(free, islands)| islands.iter().map(move |i| (i.as_str(), *free)))
    }

    /// The free devices of an island: (node, device index).
    pub fn island_free_devices(&self, island: &str) -> impl Iterator<Item = (&str, u32)> {
        self.island_members
            .get(island)
            .into_iter()
            .flat_map(|m| &m.nodes)
            .flat_map(|(n, ds)| ds.iter().map(move |d| (n.as_str(), *d)))
    }

    pub fn island_free(&self, island: &str) -> u32 {
        self.island_members.get(island).map_or(0, |m| m.free)
    }

    /// The most devices of the class any present node has.
    pub fn largest_node(&self) -> u32 {
        self.node_sizes.keys().next_back().copied().unwrap_or(0)
    }

    /// Present nodes with at least `n` devices of the class.
    pub fn nodes_of_size_at_least(&self, n: u32) -> u32 {
        self.node_sizes.range(n..).map(|(_, c)| *c).sum()
    }

    /// The most devices of the class in one island.
    pub fn largest_island(&self) -> u32 {
        self.island_size_counts
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
    }

    /// Schedulable nodes with a free device, and how many.
    pub fn schedulable_nodes(&self) -> usize {
        self.node_free.len()
    }

    /// The free nodes by `tier`.
    pub fn tier(&self, tier: domain::Tier) -> &crate::tiers::TierIndex {
        match tier {
            domain::Tier::Rack => &self.racks,
            domain::Tier::Block => &self.blocks,
            domain::Tier::Rail => &self.rails,
        }
    }

    /// Moves a node's free count in the tier indexes of its labels.
    fn tiers_move(&mut self, node: &Node, name: &str, from: u32, to: u32) {
        use domain::Tier;
        for tier in Tier::ALL {
            if let Some(value) = node.label(tier) {
                let index = match tier {
                    Tier::Rack => &mut self.racks,
                    Tier::Block => &mut self.blocks,
                    Tier::Rail => &mut self.rails,
                };
                index.update(value, name, from, to);
            }
        }
    }
}

/// A booking on `node` changed its free devices from `before` to `after`
/// (bit masks over `n.devices`): each NVLink island whose free devices
/// changed gets this node's free devices in it and its new free count.
fn move_islands(
    classes: &mut FastMap<String, ClassIndex>,
    n: &Node,
    node: &str,
    before: u64,
    after: u64,
) {
    let changed = before ^ after;
    for (i, d) in n.devices.iter().enumerate() {
        let Some(island) = d.spec.island.as_deref() else {
            continue;
        };
        if changed & (1 << i) == 0 || !d.present {
            continue;
        }
        let class = d.spec.class.as_str();
        let same = |e: &Device| {
            e.present && e.spec.class == class && e.spec.island.as_deref() == Some(island)
        };
        // Handle an island once: at its first changed device.
        if n.devices[..i]
            .iter()
            .enumerate()
            .any(|(j, e)| changed & (1 << j) != 0 && same(e))
        {
            continue;
        }
        let of_island = n
            .devices
            .iter()
            .enumerate()
            .filter(|(_, e)| same(e))
            .fold(0u64, |m, (j, _)| m | 1 << j);
        let old = (before & of_island).count_ones();
        let free: Vec<u32> = (0..n.devices.len() as u32)
            .filter(|j| after & of_island & (1 << j) != 0)
            .collect();
        let Some(c) = classes.get_mut(class) else {
            continue;
        };
        let members = match c.island_members.get_mut(island) {
            Some(m) => m,
            None => c.island_members.entry(island.to_string()).or_default(),
        };
        let was = members.free;
        members.free = (members.free + free.len() as u32).saturating_sub(old);
        if free.is_empty() {
            members.nodes.remove(node);
        } else if let Some(v) = members.nodes.get_mut(node) {
            *v = free;
        } else {
            members.nodes.insert(node.to_string(), free);
        }
        let now = members.free;
        if now == 0 {
            c.island_members.remove(island);
        }
        bucket_move(&mut c.islands_by_free, island, was, now);
    }
}

/// Adds `item` to (or removes it from) the set `map` keeps under `key`; an
/// emptied set is dropped, so derived state equals a rebuilt one.
fn enlist<K: Ord, T: Ord>(map: &mut BTreeMap<K, BTreeSet<T>>, key: K, item: T, add: bool) {
    if add {
        map.entry(key).or_default().insert(item);
    } else if let Some(set) = map.get_mut(&key) {
        set.remove(&item);
        if set.is_empty() {
            map.remove(&key);
        }
    }
}

/// A live reservation where preemption looks: priority (lowest first),
/// request position (newest first), id.
pub type LiveKey = (i32, Reverse<u64>, String);

/// Per pool: what waits for the placer.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Queues {
    /// Never tried, in placement order.
    pub pending: BTreeSet<(Reverse<i32>, u64, String)>,
    /// Tried and waiting for capacity, in placement order.
    pub queued: BTreeSet<(Reverse<i32>, u64, String)>,
    /// Live or pending reservations whose release was requested.
    pub releases: BTreeSet<String>,
    /// Live reservations by expiry (unix ms).
    pub expiries: BTreeSet<(u64, String)>,
    /// Nodes that left, are drained or are out of contact (see
    /// [`Node::troubled`]): where
    /// the placer looks for reservations to end.
    pub troubled: BTreeSet<String>,
    /// Nodes with a fault waiting for the placer to act on (see
    /// [`Node::fault_pending`]).
    pub faulted: BTreeSet<String>,
    /// The queued requests of each queue (those naming one), in placement
    /// order: what the placer retries from each queue in turn.
    pub queued_by_queue: BTreeMap<String, BTreeSet<(Reverse<i32>, u64, String)>>,
    /// GPUs of each class held by each queue's live reservations.
    pub usage: Tally,
    /// Live reservations per (class, queue; empty without one), lowest
    /// priority first and, within a priority, the most recently requested
    /// first: where preemption looks for victims.
    pub live: BTreeMap<(String, String), BTreeSet<LiveKey>>,
    /// Live reservations being preempted, by the end of their grace period
    /// (unix ms; 0 for at once).
    pub preemptions: BTreeSet<(u64, String)>,
    /// Waiting requests with reservations being preempted for them: the
    /// request -> its victims.
    pub preemptors: BTreeMap<String, BTreeSet<String>>,
    /// GPUs of each class held by each queue's reservations being
    /// preempted.
    pub preempting_usage: Tally,
    /// Reservations in advance waiting for their start, by it.
    pub promised: BTreeSet<(u64, String)>,
}

impl Queues {
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.queued.is_empty() && self.releases.is_empty()
    }

    /// GPUs of `class` that `queue`'s reservations being preempted hold.
    pub fn preempting(&self, queue: &str, class: &str) -> u64 {
        self.preempting_usage.get(queue, class)
    }

    /// GPUs of `class` that `queue`'s live reservations hold.
    pub fn used(&self, queue: &str, class: &str) -> u64 {
        self.usage.get(queue, class)
    }
}

/// The state plus what is derived from it.
#[derive(Debug, Default, Clone)]
pub struct Index {
    state: State,
    classes: FastMap<String, FastMap<String, ClassIndex>>,
    queues: FastMap<String, Queues>,
    /// The recorded time of the event being applied (Unix ms): what past
    /// usage is carried to.
    event_ms: u64,
}

impl PartialEq for Index {
    fn eq(&self, other: &Index) -> bool {
        self.state == other.state
            && self.classes == other.classes
            && normalized(&self.queues) == normalized(&other.queues)
    }
}

fn normalized(q: &FastMap<String, Queues>) -> BTreeMap<&String, &Queues> {
    q.iter().filter(|(_, q)| **q != Queues::default()).collect()
}

fn key(r: &Reservation) -> (Reverse<i32>, u64, String) {
    (
        Reverse(r.request.priority),
        r.requested_at,
        r.request.reservation.clone(),
    )
}

fn pool_of(stream: &str) -> Option<&str> {
    stream.strip_prefix("pool/")
}

fn millis(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Index {
    pub fn new() -> Index {
        Index::default()
    }

    /// An index over a state (a loaded snapshot); derives the buckets.
    pub fn from_state(state: State) -> Index {
        let mut index = Index {
            state,
            classes: FastMap::default(),
            queues: FastMap::default(),
            event_ms: 0,
        };
        let pools: Vec<String> = index.state.pools.keys().cloned().collect();
        for pool in pools {
            let nodes: Vec<String> = index.state.pools[&pool].nodes.keys().cloned().collect();
            for node in nodes {
                index.derive_node(&pool, &node, true);
            }
        }
        let reservations: Vec<String> = index.state.reservations.keys().cloned().collect();
        for id in reservations {
            index.queue(&id, true);
        }
        index
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn into_state(self) -> State {
        self.state
    }

    /// The last position applied.
    pub fn position(&self) -> u64 {
        self.state.position
    }

    pub fn pool(&self, pool: &str) -> Option<&Pool> {
        self.state.pools.get(pool)
    }

    pub fn class(&self, pool: &str, class: &str) -> Option<&ClassIndex> {
        self.classes.get(pool)?.get(class)
    }

    /// Device classes present in a pool, with their indexes.
    pub fn classes(&self, pool: &str) -> impl Iterator<Item = (&str, &ClassIndex)> {
        let mut v: Vec<_> = self
            .classes
            .get(pool)
            .into_iter()
            .flatten()
            .map(|(c, i)| (c.as_str(), i))
            .collect();
        v.sort_by(|a, b| a.0.cmp(b.0));
        v.into_iter()
    }

    pub fn queues(&self, pool: &str) -> Option<&Queues> {
        self.queues.get(pool)
    }

    pub fn reservation(&self, id: &str) -> Option<&Reservation> {
        self.state.reservations.get(id)
    }

    /// The half-life `queue`'s past usage decays with, and whether its
    /// cohort's fair share counts it (`cohort.decay_set`); without, the
    /// default half-life, not counted.
    pub fn half_life(&self, pool: &str, queue: &str) -> (u64, bool) {
        let p = self.pool(pool);
        let cohort = p.and_then(|p| p.queues.get(queue)?.cohort.as_deref());
        match cohort.and_then(|c| p?.half_lives.get(c)) {
            Some(&h) => (h, true),
            None => (domain::queues::DEFAULT_HALF_LIFE_MS, false),
        }
    }

    /// `queue`'s past usage of `class` decayed to `at_ms`, counting what it
    /// holds now as held since its last change.
    pub fn past_usage(
        &self,
        pool: &str,
        queue: &str,
        class: &str,
        at_ms: u64,
    ) -> crate::decay::Decayed {
        let held = self.queues(pool).map_or(0, |q| q.used(queue, class));
        let past = self
            .pool(pool)
            .and_then(|p| p.past.get(queue)?.get(class).copied())
            .unwrap_or(crate::decay::Decayed { gpu_ms: 0.0, at_ms });
        past.carried(at_ms, held, self.half_life(pool, queue).0)
    }

    /// `queue`'s GPU time in the current day, week and month, carried to
    /// `at_ms` with what it holds now.
    pub fn spent(&self, pool: &str, queue: &str, at_ms: u64) -> crate::spent::Spent {
        let held = self.queues(pool).map_or(0, |q| {
            q.usage
                .classes(queue)
                .map(|c| q.used(queue, c))
                .sum::<u64>()
        });
        let was = self
            .pool(pool)
            .and_then(|p| p.spent.get(queue).copied())
            .unwrap_or(crate::spent::Spent {
                at_ms,
                ..Default::default()
            });
        was.carried(at_ms, held)
    }

    /// Carries `queue`'s past usage of `class` to the event being applied,
    /// before what it holds changes.
    fn accrue(&mut self, pool: &str, queue: &str, class: &str) {
        let now = self.past_usage(pool, queue, class, self.event_ms);
        let Some(p) = self.state.pools.get_mut(pool) else {
            return;
        };
        // Allocating names only the first time a queue uses a class.
        match p.past.get_mut(queue).and_then(|c| c.get_mut(class)) {
            Some(past) => *past = now,
            None => {
                p.past
                    .entry(queue.to_string())
                    .or_default()
                    .insert(class.to_string(), now);
            }
        }
    }

    /// Carries every queue's past usage in `pool` to the event being
    /// applied, before half-lives change.
    fn accrue_pool(&mut self, pool: &str) {
        let Some(p) = self.pool(pool) else {
            return;
        };
        let all: Vec<(String, String)> = p
            .past
            .iter()
            .flat_map(|(q, classes)| classes.keys().map(move |c| (q.clone(), c.clone())))
            .collect();
        for (q, c) in all {
            self.accrue(pool, &q, &c);
        }
    }

    /// Whether the derived structures equal ones rebuilt from the state (a
    /// check of the incremental upkeep, used by tests).
    pub fn derived_is_consistent(&self) -> bool {
        *self == Index::from_state(self.state.clone())
    }

    /// Adds (or removes) a node's contribution to the derived structures.
    /// Called for the whole node before and after every change to it, so it
    /// works per class and per island, not per device.
    fn derive_node(&mut self, pool: &str, node_name: &str, add: bool) {
        let Some(node) = self
            .state
            .pools
            .get(pool)
            .and_then(|p| p.nodes.get(node_name))
        else {
            return;
        };
        let (troubled, faulted) = (node.troubled(), node.fault_pending());
        if troubled || faulted {
            let q = match self.queues.get_mut(pool) {
                Some(q) => q,
                None => self.queues.entry(pool.to_string()).or_default(),
            };
            for (set, on) in [(&mut q.troubled, troubled), (&mut q.faulted, faulted)] {
                if !on {
                    continue;
                }
                if add {
                    set.insert(node_name.to_string());
                } else {
                    set.remove(node_name);
                }
            }
        }
        if node.left {
            return;
        }
        let classes = match self.classes.get_mut(pool) {
            Some(c) => c,
            None => self.classes.entry(pool.to_string()).or_default(),
        };
        let schedulable = node.schedulable();
        // (class, devices, free); (class, island, devices, free indexes).
        let mut per_class: Vec<(&str, u32, u32)> = Vec::new();
        let mut per_island: Vec<(&str, &str, u32, Vec<u32>)> = Vec::new();
        let frees = node.free_devices();
        for (i, d) in node.devices.iter().enumerate() {
            if !d.present {
                continue;
            }
            let free = schedulable && frees[i];
            let class = d.spec.class.as_str();
            match per_class.iter_mut().find(|c| c.0 == class) {
                Some(c) => {
                    c.1 += 1;
                    c.2 += u32::from(free);
                }
                None => per_class.push((class, 1, u32::from(free))),
            }
            if let Some(island) = d.spec.island.as_deref() {
                let at = match per_island
                    .iter()
                    .position(|e| e.0 == class && e.1 == island)
                {
                    Some(at) => at,
                    None => {
                        per_island.push((class, island, 0, Vec::new()));
                        per_island.len() - 1
                    }
                };
                let entry = &mut per_island[at];
                entry.2 += 1;
                if free {
                    entry.3.push(i as u32);
                }
            }
        }
        for (class, size, free) in per_class {
            let c = match classes.get_mut(class) {
                Some(c) => c,
                None => classes.entry(class.to_string()).or_default(),
            };
            bump(&mut c.node_sizes, size, add);
            if add {
                c.total += size as u64;
                c.free += free as u64;
            } else {
                c.total -= size as u64;
                c.free -= free as u64;
            }
            if free > 0 {
                if add {
                    c.node_free.insert(node_name.to_string(), free);
                    bucket_move(&mut c.by_free, node_name, 0, free);
                    c.tiers_move(node, node_name, 0, free);
                } else {
                    c.node_free.remove(node_name);
                    bucket_move(&mut c.by_free, node_name, free, 0);
                    c.tiers_move(node, node_name, free, 0);
                }
            }
        }
        for (class, island, size, free) in per_island {
            let c = classes.get_mut(class).expect("class entry made above");
            let before = c.island_sizes.get(island).copied().unwrap_or(0);
            let after = if add { before + size } else { before - size };
            if before > 0 {
                bump(&mut c.island_size_counts, before, false);
            }
            if after > 0 {
                bump(&mut c.island_size_counts, after, true);
                match c.island_sizes.get_mut(island) {
                    Some(s) => *s = after,
                    None => {
                        c.island_sizes.insert(island.to_string(), after);
                    }
                }
            } else {
                c.island_sizes.remove(island);
            }
            if free.is_empty() {
                continue;
            }
            let n = free.len() as u32;
            let members = match c.island_members.get_mut(island) {
                Some(m) => m,
                None => c.island_members.entry(island.to_string()).or_default(),
            };
            let before = members.free;
            if add {
                members.free += n;
                members.nodes.insert(node_name.to_string(), free);
            } else {
                members.free -= n;
                members.nodes.remove(node_name);
            }
            let after = members.free;
            if after == 0 {
                c.island_members.remove(island);
            }
            bucket_move(&mut c.islands_by_free, island, before, after);
        }
        if !add {
            classes.retain(|_, c| c.total > 0 || !c.node_sizes.is_empty());
        }
    }

    /// Adds (or removes) a reservation to its pool's queues.
    fn queue(&mut self, id: &str, add: bool) {
        let Some(r) = self.state.reservations.get(id) else {
            return;
        };
        let q = match self.queues.get_mut(&r.request.pool) {
            Some(q) => q,
            None => self.queues.entry(r.request.pool.clone()).or_default(),
        };
        let (class, gpus) = (&r.request.class, r.request.gpus as u64);
        if r.phase.is_live() {
            let at = (class.clone(), r.request.queue.clone().unwrap_or_default());
            let k = (r.request.priority, Reverse(r.requested_at), id.to_string());
            enlist(&mut q.live, at, k, add);
            if let Some(name) = &r.request.queue {
                q.usage.change(name, class, gpus, add);
            }
            if let Some(by) = &r.preempted_by {
                if let Some(name) = &r.request.queue {
                    q.preempting_usage.change(name, class, gpus, add);
                }
                let k = (r.preempt_deadline_ms.unwrap_or(0), id.to_string());
                if add {
                    q.preemptions.insert(k);
                } else {
                    q.preemptions.remove(&k);
                }
                enlist(&mut q.preemptors, by.clone(), id.to_string(), add);
            }
        }
        if let (Some(name), Phase::Queued, None) = (&r.request.queue, r.phase, &r.promise) {
            enlist(&mut q.queued_by_queue, name.clone(), key(r), add);
        }
        if let (Some(p), Phase::Queued) = (&r.promise, r.phase) {
            let k = (p.start_ms, id.to_string());
            if add {
                q.promised.insert(k);
            } else {
                q.promised.remove(&k);
            }
        }
        // A promised reservation waits for its start, not for capacity.
        let set = match (r.phase, &r.promise) {
            (Phase::Pending, _) => Some(&mut q.pending),
            (Phase::Queued, None) => Some(&mut q.queued),
            _ => None,
        };
        if let Some(set) = set {
            let k = key(r);
            if add {
                set.insert(k);
            } else {
                set.remove(&k);
            }
        }
        if r.release_requested {
            if add {
                q.releases.insert(id.to_string());
            } else {
                q.releases.remove(id);
            }
        }
        if let (Some(at), true) = (r.expires_at_ms, r.phase.is_live()) {
            if add {
                q.expiries.insert((at, id.to_string()));
            } else {
                q.expiries.remove(&(at, id.to_string()));
            }
        }
    }

    /// Runs `f` on a node with its derived contribution taken out and put
    /// back afterwards.
    fn with_node<R>(
        &mut self,
        pool: &str,
        node: &str,
        f: impl FnOnce(&mut Node) -> R,
    ) -> Option<R> {
        if !self
            .state
            .pools
            .get(pool)
            .is_some_and(|p| p.nodes.contains_key(node))
        {
            return None;
        }
        self.derive_node(pool, node, false);
        let n = self
            .state
            .pools
            .get_mut(pool)
            .and_then(|p| p.nodes.get_mut(node))
            .expect("checked above");
        let r = f(n);
        self.derive_node(pool, node, true);
        Some(r)
    }

    /// [`Index::with_node`] for a change of bookings only (`f` sets or clears
    /// `booked_by`, nothing else): the node's derived contribution is moved
    /// by the change in free devices per class, in place, without taking it
    /// out and putting it back. Nodes on NVLink islands, and nodes of more
    /// than 64 devices, take the general path.
    fn rebook<R>(&mut self, pool: &str, node: &str, f: impl FnOnce(&mut Node) -> R) -> Option<R> {
        let n = self.state.pools.get(pool)?.nodes.get(node)?;
        if n.left || n.devices.len() > 64 {
            return self.with_node(pool, node, f);
        }
        let free_mask = |n: &Node| -> u64 {
            if !n.schedulable() {
                return 0;
            }
            if n.devices.iter().all(|d| d.spec.parent.is_none()) {
                // No MIG family: each device's own state (no allocation on
                // the path every booking takes).
                return n
                    .devices
                    .iter()
                    .enumerate()
                    .filter(|(_, d)| d.own_free())
                    .fold(0u64, |m, (i, _)| m | 1 << i);
            }
            n.free_devices()
                .iter()
                .enumerate()
                .filter(|(_, free)| **free)
                .fold(0u64, |m, (i, _)| m | 1 << i)
        };
        let before = free_mask(n);
        let n = self
            .state
            .pools
            .get_mut(pool)
            .and_then(|p| p.nodes.get_mut(node))
            .expect("checked above");
        let r = f(n);
        let n = &self.state.pools[pool].nodes[node];
        let after = free_mask(n);
        if before == after {
            return Some(r);
        }
        let Some(classes) = self.classes.get_mut(pool) else {
            return Some(r);
        };
        // Each class whose free count changed: old and new counts.
        let changed = before ^ after;
        for (i, d) in n.devices.iter().enumerate() {
            if changed & (1 << i) == 0 || !d.present {
                continue;
            }
            let class = d.spec.class.as_str();
            // Handle a class once: at its first changed device.
            if n.devices[..i]
                .iter()
                .enumerate()
                .any(|(j, e)| changed & (1 << j) != 0 && e.present && e.spec.class == class)
            {
                continue;
            }
            let of_class = n
                .devices
                .iter()
                .enumerate()
                .filter(|(_, e)| e.present && e.spec.class == class)
                .fold(0u64, |m, (j, _)| m | 1 << j);
            let old = (before & of_class).count_ones();
            let new = (after & of_class).count_ones();
            let Some(c) = classes.get_mut(class) else {
                continue;
            };
            c.free = c.free + new as u64 - old as u64;
            c.tiers_move(n, node, old, new);
            let name = if old > 0 {
                let taken = c.by_free.get_mut(&old).and_then(|set| set.take(node));
                if c.by_free.get(&old).is_some_and(|set| set.is_empty()) {
                    c.by_free.remove(&old);
                }
                taken
            } else {
                None
            };
            match (old > 0, new > 0) {
                (true, true) => {
                    if let Some(v) = c.node_free.get_mut(node) {
                        *v = new;
                    }
                }
                (true, false) => {
                    c.node_free.remove(node);
                }
                (false, true) => {
                    c.node_free.insert(node.to_string(), new);
                }
                (false, false) => {}
            }
            if new > 0 {
                let name = name.unwrap_or_else(|| node.to_string());
                c.by_free.entry(new).or_default().insert(name);
            }
        }
        move_islands(classes, n, node, before, after);
        Some(r)
    }

    fn with_reservation<R>(
        &mut self,
        id: &str,
        f: impl FnOnce(&mut Reservation) -> R,
    ) -> Option<R> {
        if !self.state.reservations.contains_key(id) {
            return None;
        }
        self.queue(id, false);
        let r = f(self.state.reservations.get_mut(id).expect("checked above"));
        self.queue(id, true);
        Some(r)
    }

    /// Books devices for a reservation (a placement being planned, or one
    /// being applied). Devices that are missing or already booked are left
    /// alone and returned.
    pub fn book(&mut self, pool: &str, alloc: &Allocation, reservation: &str) -> Vec<String> {
        let mut refused = Vec::new();
        let done = self.rebook(pool, &alloc.node, |node| {
            for id in &alloc.devices {
                match node.devices.iter().position(|d| &d.spec.id == id) {
                    Some(i) if node.devices[i].booked_by.is_none() && !node.books_family(i) => {
                        node.devices[i].booked_by = Some(reservation.to_string());
                    }
                    _ => refused.push(id.clone()),
                }
            }
        });
        if done.is_none() {
            return alloc.devices.clone();
        }
        refused
    }

    /// Frees the devices of an allocation booked by `reservation`.
    pub fn unbook(&mut self, pool: &str, alloc: &Allocation, reservation: &str) {
        self.rebook(pool, &alloc.node, |node| {
            for id in &alloc.devices {
                if let Some(d) = node.devices.iter_mut().find(|d| &d.spec.id == id) {
                    if d.booked_by.as_deref() == Some(reservation) {
                        d.booked_by = None;
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests;
