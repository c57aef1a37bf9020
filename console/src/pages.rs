//! The console's pages, one module each, and what several of them show:
//! a node's standing in a word and a pool's GPUs counted by class and kind.
//! `timeline.rs` is the history of a reservation or node. Each page renders from the console's index under its read lock, copying
//! what it shows, and reads the table only for history.

pub mod events;
pub mod node;
pub mod pool;
pub mod queues;
pub mod region;
pub mod reservation;
pub mod timeline;
pub mod usage;

use projections::index::{Node, Pool};
use std::collections::BTreeMap;

/// A node's standing in one word (and the CSS class it is drawn with).
pub fn standing(n: &Node) -> &'static str {
    if n.left {
        "left"
    } else if n.unreachable_since_ms.is_some() {
        "unreachable"
    } else if n.fault.is_some() || n.devices.iter().any(|d| d.quarantine.is_some()) {
        "faulted"
    } else if n.drained.is_some() {
        "draining"
    } else if n.cordoned.is_some() {
        "cordoned"
    } else if n.acceptance_failed.is_some() {
        "failed-check"
    } else {
        "ready"
    }
}

/// GPUs of one class in a pool, by what they are doing.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Gpus {
    pub total: u64,
    /// Booked by a live reservation.
    pub booked: u64,
    /// Free and placeable now.
    pub free: u64,
    /// Out of service (quarantined, faulted, failing its check).
    pub out: u64,
    /// Neither booked nor out of service, on a node that takes no
    /// placement now (cordoned, draining, unreachable).
    pub held: u64,
}

/// What one GPU is doing, as the pages draw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Booked,
    Out,
    Free,
    Held,
}

impl Use {
    /// Its letter in the pool grid's data (`b`, `o`, `f`, `h`).
    pub fn letter(self) -> char {
        match self {
            Use::Booked => 'b',
            Use::Out => 'o',
            Use::Free => 'f',
            Use::Held => 'h',
        }
    }
}

/// Each GPU a node counts, with its use, in device order: a GPU split into
/// MIG instances counts as its instances, and a missing one not at all.
pub fn uses(n: &Node) -> Vec<(&str, Use)> {
    let placeable = n.schedulable();
    let parents: Vec<&str> = n
        .devices
        .iter()
        .filter_map(|d| d.spec.parent.as_deref())
        .collect();
    n.devices
        .iter()
        .zip(n.free_devices())
        .filter(|(d, _)| {
            d.present && !(parents.contains(&d.spec.id.as_str()) && d.booked_by.is_none())
        })
        .map(|(d, free)| {
            let u = if d.booked_by.is_some() {
                Use::Booked
            } else if d.out_of_service() {
                Use::Out
            } else if placeable && free {
                Use::Free
            } else {
                Use::Held
            };
            (d.spec.class.as_str(), u)
        })
        .collect()
}

/// A pool's GPUs by class (a GPU split into MIG instances as its
/// instances, under their own class).
pub fn gpus_by_class(pool: &Pool) -> BTreeMap<String, Gpus> {
    let mut out: BTreeMap<String, Gpus> = BTreeMap::new();
    for n in pool.nodes.values().filter(|n| !n.left) {
        for (class, u) in uses(n) {
            let g = out.entry(class.to_string()).or_default();
            g.total += 1;
            match u {
                Use::Booked => g.booked += 1,
                Use::Out => g.out += 1,
                Use::Free => g.free += 1,
                Use::Held => g.held += 1,
            }
        }
    }
    out
}
