//! Why a reservation waits: its place in its pool's queue, the reason the
//! placer gave, and when it could start at the earliest, from the index
//! alone (what `strata reservations show` and the client API report).

use crate::index::{Index, Phase, Queues, Reservation};
use std::cmp::Reverse;

/// Where a waiting reservation stands.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Standing {
    /// `pending` (not tried yet) or `queued` (tried, waiting).
    pub phase: &'static str,
    /// What the placer said when it queued it (empty before it tried).
    pub reason: String,
    /// The queue it waits in (a pool shared by queues), or `None`: the
    /// pool's.
    pub queue: Option<String>,
    /// 1 for the next request its placer tries (in its queue, in a pool
    /// shared by queues).
    pub position: usize,
    /// Requests tried before it (higher priority, or asked earlier), in
    /// its queue or, without one, its pool.
    pub ahead: usize,
    /// GPUs of its class that those requests ask for.
    pub ahead_gpus: u64,
    /// Requests waiting in its queue (or pool).
    pub waiting: usize,
    /// GPUs of its class free now and schedulable.
    pub free_now: u64,
    /// The earliest time (Unix ms) at which enough GPUs of its class are
    /// free for it and every request ahead of it, counting only the live
    /// reservations whose time runs out; `None` when those never free
    /// enough. A lower bound: releases make it sooner, shapes later.
    pub earliest_start_ms: Option<u64>,
    /// Why it waits, in a phrase: `preempting N reservation(s)` (room is
    /// being made for it), `over quota: ...` (its queue's, as it
    /// stands now), `behind N requests`, `waiting for capacity`, `the
    /// shape cannot be met now`.
    pub why: String,
}

/// The standing of reservation `id`, if it waits.
pub fn standing(index: &Index, id: &str, now_ms: u64) -> Option<Standing> {
    let r = index.reservation(id)?;
    if !matches!(r.phase, Phase::Pending | Phase::Queued) {
        return None;
    }
    let pool = &r.request.pool;
    let me = (Reverse(r.request.priority), r.requested_at, id.to_string());
    let q = index.queues(pool)?;
    let queue = r.request.queue.clone();
    let mine = |k: &&(Reverse<i32>, u64, String)| {
        queue.is_none()
            || index
                .reservation(&k.2)
                .is_some_and(|o| o.request.queue == queue)
    };
    let waiting = q.pending.iter().chain(q.queued.iter()).filter(mine).count();
    let ahead_keys: Vec<_> = q
        .pending
        .iter()
        .chain(q.queued.iter())
        .filter(|k| **k < me)
        .filter(mine)
        .collect();
    let ahead = ahead_keys.len();
    let ahead_gpus: u64 = ahead_keys
        .iter()
        .filter_map(|k| index.reservation(&k.2))
        .filter(|o| o.request.class == r.request.class)
        .map(|o| o.request.gpus as u64)
        .sum();
    let free_now = index.class(pool, &r.request.class).map_or(0, |c| c.free);
    let need = ahead_gpus + r.request.gpus as u64;
    // Room being made for it: it starts when its victims' grace period
    // ends.
    let making_room = q.preemptors.get(id);
    let earliest_start_ms = match making_room {
        Some(victims) => victims
            .iter()
            .filter_map(|v| index.reservation(v)?.preempt_deadline_ms)
            .max()
            .map(|at| at.max(now_ms)),
        None => earliest(index, q, r, need, free_now, now_ms),
    };
    let over_quota = || match crate::quota::admit(index, pool, &r.request, &Default::default()) {
        Err(refusal @ crate::quota::Refusal::OverQuota(_)) => Some(refusal.to_string()),
        _ => None,
    };
    let why = if let Some(victims) = making_room {
        format!(
            "preempting {} reservation(s): placed when their grace period ends",
            victims.len()
        )
    } else if let Some(why) = over_quota() {
        why
    } else if ahead > 0 {
        match &queue {
            Some(q) => format!("behind {ahead} request(s) in queue {q}"),
            None => format!("behind {ahead} request(s) in pool {pool}"),
        }
    } else if free_now >= r.request.gpus as u64 && r.phase == Phase::Queued {
        "the shape cannot be met now: enough GPUs are free, but not where it needs them".into()
    } else if r.phase == Phase::Pending {
        "not tried yet".into()
    } else {
        "waiting for capacity".into()
    };
    Some(Standing {
        phase: r.phase.name(),
        reason: r.reason.clone(),
        queue,
        position: ahead + 1,
        ahead,
        ahead_gpus,
        waiting,
        free_now,
        earliest_start_ms,
        why,
    })
}

/// When `need` GPUs of `r`'s class are free at the earliest: now if they
/// are, else at the expiry of the live reservation whose end frees the
/// last of them (the pool's live reservations with a time limit, in the
/// order they run out).
fn earliest(
    index: &Index,
    q: &Queues,
    r: &Reservation,
    need: u64,
    free_now: u64,
    now_ms: u64,
) -> Option<u64> {
    if free_now >= need {
        return Some(now_ms);
    }
    let mut free = free_now;
    for (at, id) in &q.expiries {
        let Some(o) = index
            .reservation(id)
            .filter(|o| o.request.class == r.request.class)
        else {
            continue;
        };
        free += o
            .allocations
            .iter()
            .map(|a| a.devices.len() as u64)
            .sum::<u64>();
        if free >= need {
            return Some((*at).max(now_ms));
        }
    }
    None
}
