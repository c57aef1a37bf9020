//! Reservations in advance: whether a request for a future window
//! `[start, end)` can be promised, and on which devices.
//!
//! The pool is looked at as it will be at the start, as far as the log
//! knows: the live reservations whose time runs out by then are counted as
//! gone, and the devices of other promises and of maintenance windows that
//! overlap the window are counted as taken. A request fits there or is
//! refused now with why. Promised, its devices are held from every request
//! that would not end before its start ([`crate::backfill`]'s window
//! holds), and it is placed on them at its start.

use crate::fit::place_one;
use domain::{Allocation, Request};
use projections::index::{Index, Window};
use std::time::{Duration, UNIX_EPOCH};

/// The name devices are counted taken under while a promise is weighed:
/// no reservation id starts with a NUL.
const TAKEN: &str = "\0taken in the window";

/// The devices `request` is promised for `[start_ms, end_ms)`, or why it
/// cannot be. The index is left as it was.
pub fn promise(
    index: &mut Index,
    pool: &str,
    request: &Request,
    start_ms: u64,
    end_ms: u64,
) -> Result<Vec<Allocation>, String> {
    let window = Window {
        start_ms,
        end_ms,
        reason: String::new(),
    };
    // Gone by the start: what runs out by then.
    let gone: Vec<(String, Vec<Allocation>)> = index
        .queues(pool)
        .into_iter()
        .flat_map(|q| q.expiries.iter())
        .take_while(|(at, _)| *at <= start_ms)
        .filter_map(|(_, id)| {
            let r = index.reservation(id)?;
            Some((id.clone(), r.allocations.clone()))
        })
        .collect();
    for (id, allocs) in &gone {
        for a in allocs {
            index.unbook(pool, a, id);
        }
    }
    // Taken in the window: other promises, maintenance.
    let mut taken: Vec<Allocation> = Vec::new();
    if let Some(q) = index.queues(pool) {
        for (_, id) in &q.promised {
            if let Some(p) = index.reservation(id).and_then(|r| r.promise.as_ref()) {
                if window.overlaps(p.start_ms, Some(p.end_ms)) {
                    taken.extend(p.allocations.iter().cloned());
                }
            }
        }
    }
    if let Some(p) = index.pool(pool) {
        for (node, n) in &p.nodes {
            if n.maintenance
                .iter()
                .any(|w| w.overlaps(start_ms, Some(end_ms)))
            {
                taken.push(Allocation {
                    node: node.clone(),
                    devices: n.devices.iter().map(|d| d.spec.id.clone()).collect(),
                });
            }
        }
    }
    let mut booked = Vec::new();
    for a in &taken {
        let refused = index.book(pool, a, TAKEN);
        booked.push(Allocation {
            node: a.node.clone(),
            devices: a
                .devices
                .iter()
                .filter(|d| !refused.contains(d))
                .cloned()
                .collect(),
        });
    }
    let placed = place_one(index, pool, request);
    for a in &booked {
        index.unbook(pool, a, TAKEN);
    }
    for (id, allocs) in &gone {
        for a in allocs {
            let refused = index.book(pool, a, id);
            debug_assert!(
                refused.is_empty(),
                "a live reservation's devices are as they were"
            );
        }
    }
    placed.ok_or_else(|| {
        format!(
            "cannot promise {} {} GPUs from {} to {}: not enough are free then (reservations without a time limit, other promises and maintenance windows hold the rest)",
            request.gpus,
            request.class,
            time(start_ms),
            time(end_ms)
        )
    })
}

/// A time as the reasons show it.
pub fn time(ms: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}
