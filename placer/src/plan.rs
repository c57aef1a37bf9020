//! Planning a batch against the pool index: best fit, topology first.
//!
//! Ranking: a request goes to the candidate with the fewest free devices that
//! still fits it (nodes and islands are bucketed by free count, so this is a
//! range lookup, not a scan). Partly used nodes and islands fill up first and
//! whole ones stay free for large shapes. Within a node, devices come from
//! the smallest island that holds the request, or from as few islands as
//! possible. A gang takes its nodes all at once or not at all.

use crate::backfill::{order, Holds};
pub use crate::fit::{never_fits, place_one};
use domain::{Allocation, Request, Shape};
use projections::budget::Verdict;
use projections::index::Index;
use projections::quota::{self, NotPreemptible};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};

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
    pub rejected: Vec<(String, String)>,
    /// Live reservations to preempt: (victim, the request it makes room
    /// for, `priority` or `reclaim`). The request is queued meanwhile.
    pub preempting: Vec<(String, String, String)>,
    /// Reservations in advance promised: (id, devices, start, end).
    pub promised: Vec<(String, Vec<Allocation>, u64, u64)>,
    /// Requests that looked for victims.
    pub searches: usize,
    /// Waiting requests the batch held devices for (see
    /// [`crate::backfill`]).
    pub held: usize,
    /// Requests that did not fit and may preempt, weighed after the
    /// batch's placements: ((priority, position), id, why it waits).
    candidates: Vec<((Reverse<i32>, u64), String, String)>,
}

/// Plans reservations (ids, in the order given, which is priority order)
/// against the index. Each placement is booked in the index while the batch
/// is planned, so later requests see it, and every booking is undone before
/// returning: the index is left as it was.
///
/// In a pool shared by queues, each request must first be admitted by its
/// queue's quota ([`quota::admit`]), and the queues take turns by weighted
/// dominant resource fairness: the next request planned is the next (by
/// priority) of the queue whose turn comes first, counting what the batch
/// has placed ([`quota::turn`]: short of its quota first, then the
/// smallest dominant share, with its past usage where its cohort
/// remembers it).
///
/// A request that does not fit may preempt (see [`Plan::preempting`]).
///
/// A request that waits for devices keeps what it will start on, by the
/// TTLs of what it waits for, from the requests behind it (see
/// [`crate::backfill`]); `now_ms` (Unix ms) is the batch's moment.
pub fn plan_batch(index: &mut Index, pool: &str, ids: &[String], now_ms: u64) -> Plan {
    plan_with(index, pool, ids, &Ending::default(), now_ms)
}

/// The live reservations the batch ends (released, expired, failed, and
/// preempted once their grace period is over), and the requests those
/// preempted make room for.
#[derive(Debug, Default, Clone)]
pub struct Ending {
    /// The reservations ended now: planned as gone (their devices free,
    /// their GPUs off their queues).
    pub victims: Vec<String>,
    /// The preemptors of those preempted now, planned before anything
    /// else.
    pub first: Vec<String>,
}

/// [`plan_batch`] with `ending`'s victims planned as gone and their
/// preemptors planned first.
pub fn plan_with(
    index: &mut Index,
    pool: &str,
    ids: &[String],
    ending: &Ending,
    now_ms: u64,
) -> Plan {
    let mut plan = Plan::default();
    let mut batch = quota::Batch::default();
    let mut holds = Holds::new(now_ms, &ending.victims);
    let mut gone: Vec<(String, Vec<Allocation>)> = Vec::new();
    for v in &ending.victims {
        if let Some(r) = index.reservation(v) {
            if !r.phase.is_live() {
                continue;
            }
            batch.end(
                v,
                r.request.queue.as_deref(),
                &r.request.class,
                r.request.gpus as u64,
                r.preempted_by.is_some(),
            );
            gone.push((v.clone(), r.allocations.clone()));
        }
    }
    for (v, allocs) in &gone {
        for a in allocs {
            index.unbook(pool, a, v);
        }
    }
    holds.hold_windows(index, pool);
    for id in &ending.first {
        plan_one(index, pool, id, &mut plan, &mut batch, &mut holds, true);
    }
    let ids: Vec<String> = ids
        .iter()
        .filter(|id| !ending.first.contains(id))
        .cloned()
        .collect();
    // What waits ahead of the batch's requests keeps what it will start on.
    let last = ids
        .iter()
        .filter_map(|id| index.reservation(id).map(order))
        .max();
    holds.hold_queued(index, pool, last, &ids);
    let shared = index.pool(pool).is_some_and(|p| !p.queues.is_empty());
    if !shared {
        for id in &ids {
            plan_one(index, pool, id, &mut plan, &mut batch, &mut holds, false);
        }
    } else {
        // Per queue, its requests in placement order (those naming no queue,
        // or an unknown one, under their name: they are rejected in turn).
        let mut groups: BTreeMap<String, VecDeque<Turn>> = BTreeMap::new();
        for id in &ids {
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
        // What does not change while the batch is planned, once per queue.
        let standings: BTreeMap<String, quota::Standing> = groups
            .keys()
            .map(|q| (q.clone(), quota::standing(index, pool, q, now_ms)))
            .collect();
        for (q, g) in groups.iter_mut() {
            g.make_contiguous().sort();
            let key = share_key(index, pool, q, &batch, now_ms, standings[q]);
            turns.push(Reverse((key, q.clone())));
        }
        while let Some(Reverse((_, q))) = turns.pop() {
            let g = groups.get_mut(&q).expect("every turn has a group");
            let Some((_, _, id)) = g.pop_front() else {
                continue;
            };
            plan_one(index, pool, id, &mut plan, &mut batch, &mut holds, false);
            if !g.is_empty() {
                let key = share_key(index, pool, &q, &batch, now_ms, standings[&q]);
                turns.push(Reverse((key, q)));
            }
        }
    }
    preempt_for(index, pool, &mut plan, &mut batch, &mut holds);
    plan.held = holds.count();
    holds.release(index, pool);
    for (id, allocs) in &plan.placed {
        for a in allocs {
            index.unbook(pool, a, id);
        }
    }
    for (v, allocs) in &gone {
        for a in allocs {
            let refused = index.book(pool, a, v);
            debug_assert!(refused.is_empty(), "a victim's devices are as they were");
        }
    }
    plan
}

/// A reservation in advance: promised now if its start is to come (or
/// rejected with why), or placed on what it was promised once its start
/// came. Whether it was dealt with; if not (no start, or its promise can
/// no longer be kept: it is planned as any request, now).
fn in_advance(
    index: &mut Index,
    pool: &str,
    id: &str,
    request: &Request,
    plan: &mut Plan,
    batch: &mut quota::Batch,
    holds: &mut Holds,
) -> bool {
    let now = holds.now_ms();
    let Some(r) = index.reservation(id) else {
        return false;
    };
    match (&r.promise, request.start_ms) {
        (None, Some(start)) if start > now => {
            let end = start.saturating_add(request.ttl_ms.unwrap_or(0));
            match crate::promise::promise(index, pool, request, start, end) {
                Ok(allocs) => {
                    holds.hold_promise(index, pool, id, &request.class, start, &allocs);
                    plan.promised.push((id.to_string(), allocs, start, end));
                }
                Err(why) => plan.rejected.push((id.to_string(), why)),
            }
            true
        }
        (Some(p), _) => {
            let allocs = p.allocations.clone();
            let fits = index.placement_problem(pool, request, &allocs).is_none()
                && quota::admit(index, pool, request, batch).is_ok();
            if !fits {
                return false;
            }
            for a in &allocs {
                let refused = index.book(pool, a, id);
                debug_assert!(refused.is_empty(), "promised devices are free");
            }
            if let Some(q) = &request.queue {
                batch.add(q, &request.class, request.gpus as u64);
            }
            plan.placed.push((id.to_string(), allocs));
            true
        }
        _ => false,
    }
}

/// A request in its queue's turn: priority (highest first), position, id.
type Turn<'a> = (Reverse<i32>, u64, &'a String);

/// A queue's turn ([`quota::turn_with`]) as an orderable key.
fn share_key(
    index: &Index,
    pool: &str,
    queue: &str,
    batch: &quota::Batch,
    now_ms: u64,
    standing: quota::Standing,
) -> (bool, bool, i64) {
    quota::turn_with(index, pool, queue, batch, now_ms, standing).key()
}

impl Plan {
    /// A request that waits, for `reason`: queued again (with the reason)
    /// unless it was queued already for the same kind of reason (see
    /// [`reason_kind`]), then only counted.
    fn wait(&mut self, id: &str, queued: bool, was: &str, reason: String) {
        if queued && reason_kind(&reason) == reason_kind(was) {
            self.still_waiting += 1;
        } else {
            self.queued.push((id.to_string(), reason));
        }
    }
}

/// What a reason is about: the words before its first colon (`waiting for
/// capacity`, `over quota`). A waiting request is queued again only when
/// this changes, not when its figures do.
fn reason_kind(reason: &str) -> &str {
    reason.split(':').next().unwrap_or(reason)
}

/// Plans one request into `plan`, booking its placement in the index and
/// counting it in `batch`; one that does not fit and may preempt is left
/// for [`preempt_for`].
fn plan_one(
    index: &mut Index,
    pool: &str,
    id: &str,
    plan: &mut Plan,
    batch: &mut quota::Batch,
    holds: &mut Holds,
    ending: bool,
) {
    let Some(r) = index.reservation(id) else {
        return;
    };
    let (request, order) = (r.request.clone(), order(r));
    let promised = r.promise.is_some();
    let budgets = request.queue.is_some()
        && index
            .pool(pool)
            .is_some_and(|p| p.queues.values().any(|s| !s.budgets.is_empty()));
    let (queued, was) = (r.phase == projections::Phase::Queued, r.reason.clone());
    if let Some(reason) = never_fits(index, pool, &request) {
        plan.rejected.push((id.to_string(), reason));
        return;
    }
    if (promised || request.start_ms.is_some())
        && in_advance(index, pool, id, &request, plan, batch, holds)
    {
        return;
    }
    let wait = |plan: &mut Plan, reason: String| plan.wait(id, queued, &was, reason);
    // Room is being made for it: it waits for the grace period's end
    // (unless that is now, and its victims are planned as gone).
    let making_room = index.queues(pool).and_then(|q| q.preemptors.get(id));
    if let (Some(victims), false) = (making_room, ending) {
        let reason = format!(
            "preempting: {} reservation(s) make room for it; it is placed when their grace period ends",
            victims.len()
        );
        wait(plan, reason);
        return;
    }
    // A queue's hard budget, spent: it waits for the next period, or is
    // rejected, whatever there is room for.
    let verdict = if budgets {
        projections::budget::judge(index, pool, &request, holds.now_ms())
    } else {
        Verdict::Within
    };
    match verdict {
        Verdict::Over(domain::Enforce::Reject, why) => {
            plan.rejected.push((id.to_string(), why));
            return;
        }
        Verdict::Over(_, why) => {
            wait(plan, why);
            return;
        }
        Verdict::Within | Verdict::Soft => {}
    }
    let why = match quota::admit(index, pool, &request, batch) {
        Ok(()) => {
            let lifted = holds.lift_for(index, pool, order, request.ttl_ms);
            let placed = place_one(index, pool, &request);
            if let Some(allocs) = &placed {
                for a in allocs {
                    let refused = index.book(pool, a, id);
                    debug_assert!(refused.is_empty(), "planned devices are free");
                }
            }
            holds.restore(index, pool, lifted);
            if let Some(allocs) = placed {
                if let Some(q) = &request.queue {
                    batch.add(q, &request.class, request.gpus as u64);
                }
                plan.placed.push((id.to_string(), allocs));
                return;
            }
            let why = match holds.free_without(index, pool, &request, order) {
                Some(free) => holds.held_back(order, request.ttl_ms, &request.class, free),
                None => no_room(index, pool, &request),
            };
            if !ending {
                holds.hold(index, pool, id);
            }
            why
        }
        Err(quota::Refusal::NoQueue(reason)) => {
            plan.rejected.push((id.to_string(), reason));
            return;
        }
        Err(refusal @ quota::Refusal::OverQuota(_)) => refusal.to_string(),
    };
    if !ending && may_preempt_any(index, pool, &request) {
        // It may preempt: weighed once the batch's placements are planned.
        plan.candidates.push((order, id.to_string(), why));
    } else {
        wait(plan, why);
    }
}

/// Whether `request` may have anything to preempt, cheaply: the pool
/// preempts, and it is shared by queues (a queue may take back what it
/// lent) or holds a live reservation of a lower priority of its class.
fn may_preempt_any(index: &Index, pool: &str, request: &Request) -> bool {
    if index.pool(pool).is_none_or(|p| p.preemption_off) {
        return false;
    }
    if request.queue.is_some() {
        return true;
    }
    index
        .queues(pool)
        .and_then(|q| q.live.get(&(request.class.clone(), String::new())))
        .and_then(|set| set.first())
        .is_some_and(|lowest| lowest.0 < request.priority)
}

/// Why an admitted request does not fit: the capacity, or, for a gang
/// that asks for a rack or block (or to be spread) while enough GPUs are
/// free, the topology.
fn no_room(index: &Index, pool: &str, request: &Request) -> String {
    use domain::Topology;
    let free = index.class(pool, &request.class).map_or(0, |c| c.free);
    let class = &request.class;
    match (request.topology, request.shape) {
        (
            Some(Topology::Within(t)),
            Shape::Gang {
                nodes,
                gpus_per_node,
            },
        ) if free >= request.gpus as u64 => format!(
            "topology cannot be met now: {free} {class} GPUs are free, but no {} has {nodes} nodes with {gpus_per_node} free",
            t.name()
        ),
        (
            Some(Topology::Spread(t)),
            Shape::Gang {
                nodes,
                gpus_per_node,
            },
        ) if free >= request.gpus as u64 => format!(
            "topology cannot be met now: {free} {class} GPUs are free, but not {nodes} {}s with a node with {gpus_per_node} free",
            t.name()
        ),
        _ => format!(
            "waiting for capacity: {} {class} GPUs ({}) asked, {free} free",
            request.gpus, request.shape
        ),
    }
}

/// The second pass of a batch: the requests that did not fit, highest
/// priority first, look for victims, at most [`SEARCHES_PER_BATCH`]; the
/// rest wait. Every placement of the batch is planned by now, so each
/// preemption is judged on the state the index judges it on (the batch's
/// placements are written before its preemptions).
fn preempt_for(
    index: &mut Index,
    pool: &str,
    plan: &mut Plan,
    batch: &mut quota::Batch,
    holds: &mut Holds,
) {
    let mut candidates = std::mem::take(&mut plan.candidates);
    candidates.sort();
    for (_, id, why) in candidates {
        let Some(r) = index.reservation(&id) else {
            continue;
        };
        let (request, queued, was) = (
            r.request.clone(),
            r.phase == projections::Phase::Queued,
            r.reason.clone(),
        );
        let order = order(r);
        let chosen = if plan.searches < SEARCHES_PER_BATCH {
            plan.searches += 1;
            let lifted = holds.lift_for(index, pool, order, request.ttl_ms);
            let chosen = victims(index, pool, &request, batch);
            holds.restore(index, pool, lifted);
            chosen
        } else {
            None
        };
        match chosen {
            Some(chosen) => {
                let kinds: BTreeSet<&str> = chosen.iter().map(|(_, k)| *k).collect();
                for (v, kind) in &chosen {
                    if let Some(r) = index.reservation(v) {
                        batch.preempt(
                            v,
                            r.request.queue.as_deref(),
                            &r.request.class,
                            r.request.gpus as u64,
                        );
                    }
                    plan.preempting
                        .push((v.clone(), id.clone(), kind.to_string()));
                }
                plan.queued.push((
                    id,
                    format!(
                        "preempting: {} reservation(s) make room for it ({}); it is placed when their grace period ends",
                        chosen.len(),
                        kinds.into_iter().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
            None => plan.wait(&id, queued, &was, why),
        }
    }
}

/// A victim being weighed: its id, why it may be preempted, its
/// allocations, its queue and its GPUs.
type Chosen = (String, &'static str, Vec<Allocation>, Option<String>, u64);

/// Most reservations one request preempts.
const MAX_VICTIMS: usize = 64;
/// Most requests of one batch that look for victims: what does not fit and
/// has no turn waits for the next batch, so a batch's cost stays bounded
/// when many requests wait (they are tried in the batch's order, the
/// highest priority of each queue first).
pub const SEARCHES_PER_BATCH: usize = 64;
/// Most live reservations looked at for one request's victims.
const MAX_CANDIDATES: usize = 512;

/// The smallest set of live reservations whose preemption lets `request`
/// be admitted and placed, each with why it may be preempted
/// ([`quota::may_preempt`]), or `None` when no such set is found.
///
/// Lowest priority first, and within a priority the most recently
/// requested: each is counted as gone (its devices free, its GPUs off its
/// queue's usage) until the request fits; then each chosen one is put back
/// if the request still fits without it, last chosen first. The index is
/// left as it was.
fn victims(
    index: &mut Index,
    pool: &str,
    request: &Request,
    batch: &quota::Batch,
) -> Option<Vec<(String, &'static str)>> {
    if index.pool(pool)?.preemption_off {
        return None;
    }
    let candidates = candidates(index, pool, request, batch)?;
    // What fits without the chosen (their GPUs freed), and what may still
    // be preempted with them chosen (counted as being preempted).
    let (mut sim, mut picked) = (batch.clone(), batch.clone());
    let mut chosen: Vec<Chosen> = Vec::new();
    let fits = |index: &Index, sim: &quota::Batch| {
        quota::admit(index, pool, request, sim).is_ok() && place_one(index, pool, request).is_some()
    };
    let mut fit = false;
    // Queues whose reservations were refused as a reclaim in this search:
    // what the lender keeps only falls as more of it is chosen, and what
    // the request's queue keeps falls only when one of its own is, so the
    // rest of theirs are refused too until then.
    let mut refused: Vec<String> = Vec::new();
    for v in candidates {
        if chosen.len() >= MAX_VICTIMS {
            break;
        }
        let Some(r) = index.reservation(&v) else {
            continue;
        };
        if r.preempted_by.is_some() || v == request.reservation || batch.preempts(&v) {
            continue;
        }
        let theirs = r.request.queue.as_deref();
        if theirs.is_some_and(|q| refused.iter().any(|x| x == q)) {
            continue;
        }
        let kind = match quota::may_preempt(index, pool, request, r, &picked) {
            Ok(kind) => kind,
            Err(NotPreemptible::BorrowsNothing { .. } | NotPreemptible::OverOwnQuota { .. }) => {
                refused.extend(theirs.map(str::to_string));
                continue;
            }
            Err(_) => continue,
        };
        if theirs == request.queue.as_deref() {
            refused.clear();
        }
        let (allocs, queue, gpus) = (
            r.allocations.clone(),
            r.request.queue.clone(),
            r.request.gpus,
        );
        if let Some(q) = &queue {
            sim.free(q, &request.class, gpus as u64);
        }
        picked.preempt(&v, queue.as_deref(), &request.class, gpus as u64);
        for a in &allocs {
            index.unbook(pool, a, &v);
        }
        chosen.push((v, kind, allocs, queue, gpus as u64));
        if fits(index, &sim) {
            fit = true;
            break;
        }
    }
    let put_back = |index: &mut Index, v: &str, allocs: &[Allocation]| {
        for a in allocs {
            index.book(pool, a, v);
        }
    };
    if !fit {
        for (v, _, allocs, _, _) in &chosen {
            put_back(index, v, allocs);
        }
        return None;
    }
    // The smallest set: drop each one the request fits without. The last
    // of two or more stays: without it is the set just found too small (a
    // single one is weighed, as the request is not known not to fit with
    // none). `sim` is kept as the batch with the GPUs of those still in the
    // set freed.
    let mut keep = vec![true; chosen.len()];
    let weighed = if chosen.len() > 1 {
        chosen.len() - 1
    } else {
        chosen.len()
    };
    for i in (0..weighed).rev() {
        let (v, _, allocs, queue, gpus) = &chosen[i];
        put_back(index, v, allocs);
        if let Some(q) = queue {
            sim.unfree(q, &request.class, *gpus);
        }
        if fits(index, &sim) {
            keep[i] = false;
        } else {
            if let Some(q) = queue {
                sim.free(q, &request.class, *gpus);
            }
            for a in allocs {
                index.unbook(pool, a, v);
            }
        }
    }
    for (i, (v, _, allocs, _, _)) in chosen.iter().enumerate() {
        if keep[i] {
            put_back(index, v, allocs);
        }
    }
    // Each kept one must still be preemptable in the order written (the
    // index checks them so): judged on the batch as it came, which
    // `picked` is again once the chosen are taken out of it.
    for (v, _, _, queue, gpus) in &chosen {
        picked.unpreempt(v, queue.as_deref(), &request.class, *gpus);
    }
    let mut check = picked;
    let mut out = Vec::new();
    for (i, (v, _, _, queue, gpus)) in chosen.iter().enumerate() {
        if !keep[i] {
            continue;
        }
        let kind = quota::may_preempt(index, pool, request, index.reservation(v)?, &check).ok()?;
        check.preempt(v, queue.as_deref(), &request.class, *gpus);
        out.push((v.clone(), kind));
    }
    Some(out)
}

/// The live reservations [`victims`] weighs for `request`, at most
/// [`MAX_CANDIDATES`], in order: first what other queues of its cohort
/// borrowed, when its own queue may take it back (within its nominal quota
/// with the request), then its own queue's of lower priority. `None` when
/// there are none.
fn candidates(
    index: &Index,
    pool: &str,
    request: &Request,
    batch: &quota::Batch,
) -> Option<Vec<String>> {
    // Its queue's, or in a pool without queues the pool's (queue "").
    let mine = request.queue.as_deref().unwrap_or("");
    let q = index.queues(pool)?;
    let queues = &index.pool(pool)?.queues;
    let class = request.class.as_str();
    let nominal = |s: &domain::QueueSpec| s.quota(class).map_or(0, |x| x.nominal) as u64;
    let held = |queue: &str| quota::held(index, pool, queue, class, batch);
    let mut candidates: Vec<String> = Vec::new();
    let spec = queues.get(mine);
    let cohort = spec.and_then(|s| s.cohort.as_deref());
    let within =
        spec.is_some_and(|s| cohort.is_some() && held(mine) + request.gpus as u64 <= nominal(s));
    if within {
        for other in queues.values() {
            // One that keeps no more than its nominal quota, less what is
            // already being preempted of it, lends nothing back: every
            // reservation of it would be refused.
            if other.queue == mine
                || other.cohort.as_deref() != cohort
                || quota::kept(index, pool, &other.queue, class, batch) <= nominal(other)
            {
                continue;
            }
            if let Some(set) = q.live.get(&(class.to_string(), other.queue.clone())) {
                candidates.extend(set.iter().take(MAX_CANDIDATES).map(|k| k.2.clone()));
            }
        }
    }
    // Then its own queue's of lower priority.
    if let Some(set) = q.live.get(&(class.to_string(), mine.to_string())) {
        candidates.extend(
            set.range(..(request.priority, Reverse(u64::MAX), String::new()))
                .take(MAX_CANDIDATES)
                .map(|k| k.2.clone()),
        );
    }
    if candidates.is_empty() {
        return None;
    }
    candidates.truncate(MAX_CANDIDATES);
    Some(candidates)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use domain::pools::devices;
    use domain::Fact;
    use domain::{pool_stream, reservation_stream};
    use projections::testing::Log;
    use projections::Phase;

    const C: &str = "H100-80GB";

    fn now_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }

    /// A log and the index folded from it (the fault tests use it too).
    pub(crate) struct World {
        log: Log,
        pub(crate) index: Index,
    }

    impl World {
        /// A pool of `nodes` nodes (`n00`, `n01`, ...) with 8 GPUs
        /// (`gpu0` to `gpu7`) in two islands of 4.
        pub(crate) fn new(nodes: u32) -> World {
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
                // Every fourth node has two GPUs split into MIG instances.
                if n % 4 == 1 {
                    domain::pools::split_mig(&mut d, 2, "1g.10gb", 7);
                }
                d
            })
        }

        fn build(nodes: u32, devices_of: impl Fn(u32, &str) -> Vec<domain::DeviceSpec>) -> World {
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

        pub(crate) fn pool(&mut self, fact: &Fact) -> Option<projections::Violation> {
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
            self.ask(queue, id, gpus, shape, priority, None);
        }

        /// A request that ends `ttl_ms` after its placement.
        fn request_ttl(&mut self, id: &str, gpus: u32, shape: Shape, ttl_ms: Option<u64>) {
            self.ask(None, id, gpus, shape, 0, ttl_ms);
        }

        fn ask(
            &mut self,
            queue: Option<&str>,
            id: &str,
            gpus: u32,
            shape: Shape,
            priority: i32,
            ttl_ms: Option<u64>,
        ) {
            self.ask_class(C, queue, id, gpus, shape, priority, ttl_ms);
        }

        #[allow(clippy::too_many_arguments)]
        fn ask_class(
            &mut self,
            class: &str,
            queue: Option<&str>,
            id: &str,
            gpus: u32,
            shape: Shape,
            priority: i32,
            ttl_ms: Option<u64>,
        ) {
            let r = Request {
                reservation: id.into(),
                pool: "p".into(),
                class: class.into(),
                gpus,
                shape,
                priority,
                ttl_ms,
                replace_on_failure: false,
                replaces: None,
                topology: None,
                requeue_on_preemption: false,
                start_ms: None,
                queue: queue.map(str::to_string),
            };
            let e = self
                .log
                .push(&reservation_stream(id), &Fact::ReservationRequested(r));
            assert_eq!(self.index.apply(&e).unwrap(), None);
        }

        /// The log's clock (Unix ms), or the machine's.
        fn now(&self) -> u64 {
            self.log.clock.map_or_else(now_ms, |t| {
                t.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
            })
        }

        /// A request for `gpus` from `start_ms` for `duration_ms`.
        fn ask_ahead(&mut self, id: &str, gpus: u32, start_ms: u64, duration_ms: u64) {
            let r = Request {
                start_ms: Some(start_ms),
                ttl_ms: Some(duration_ms),
                ..domain::demand::request(id.into(), "p", C, gpus, Shape::Any)
            };
            let e = self
                .log
                .push(&reservation_stream(id), &Fact::ReservationRequested(r));
            assert_eq!(self.index.apply(&e).unwrap(), None);
        }

        /// Plans the pending reservations and applies the outcome as a
        /// placer's commit would.
        fn run(&mut self) -> Plan {
            self.run_with(false)
        }

        /// [`World::run`] with every grace period over: the reservations
        /// being preempted end, and their preemptors are planned first.
        fn run_ending(&mut self) -> Plan {
            self.run_with(true)
        }

        fn run_with(&mut self, end: bool) -> Plan {
            let mut ending = Ending::default();
            if end {
                for (_, v) in self
                    .index
                    .queues("p")
                    .map(|q| q.preemptions.clone())
                    .unwrap_or_default()
                {
                    let by = self
                        .index
                        .reservation(&v)
                        .unwrap()
                        .preempted_by
                        .clone()
                        .unwrap();
                    ending.victims.push(v);
                    if !ending.first.contains(&by) {
                        ending.first.push(by);
                    }
                }
            }
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
            let now = self.now();
            // Reservations in advance whose start came go first.
            for (_, id) in self
                .index
                .queues("p")
                .map(|q| q.promised.clone())
                .unwrap_or_default()
                .into_iter()
                .filter(|(at, _)| *at <= now)
            {
                ending.first.push(id);
            }
            let plan = plan_with(&mut self.index, "p", &ids, &ending, now);
            assert!(self.index == before, "planning leaves the index as it was");
            for v in &ending.victims {
                let r = self.index.reservation(v).unwrap();
                let fact = Fact::ReservationPreempted {
                    reservation: v.clone(),
                    by: r.preempted_by.clone().unwrap(),
                    reason: r.preempt_reason.clone(),
                    replaced_by: None,
                };
                assert_eq!(self.pool(&fact), None);
            }
            for (reservation, allocations, start, end) in plan.promised.clone() {
                let v = self.pool(&Fact::ReservationPromised {
                    reservation,
                    allocations,
                    start_ms: Some(start),
                    end_ms: Some(end),
                });
                assert_eq!(v, None, "the planner's promises are valid");
            }
            for (reservation, allocations) in plan.placed.clone() {
                let v = self.pool(&Fact::ReservationPlaced {
                    reservation,
                    allocations,
                });
                assert_eq!(v, None, "the planner's placements are valid");
            }
            for (reservation, by, reason) in plan.preempting.clone() {
                let v = self.pool(&Fact::ReservationPreemptionScheduled {
                    reservation,
                    by,
                    reason,
                    deadline_ms: Some(0),
                });
                assert_eq!(v, None, "the planner's preemptions are allowed");
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
            for (reservation, reason) in plan.rejected.clone() {
                assert_eq!(
                    self.pool(&Fact::ReservationRejected {
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
            let spec = domain::QueueSpec {
                queue: name.into(),
                cohort: cohort.map(str::to_string),
                weight,
                quotas: vec![domain::Quota {
                    class: C.into(),
                    nominal,
                    borrowing_limit,
                }],
                budgets: Vec::new(),
                max_run_ms: None,
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
        assert_eq!(plan.rejected.len(), 1);
        assert!(
            plan.rejected[0].1.contains("largest island has 4"),
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
        assert_eq!(w.run().rejected.len(), 1);
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
        assert_eq!(plan.rejected.len(), 2, "{plan:?}");
        assert!(plan.rejected[0].1.contains("name one"), "{plan:?}");
        assert!(plan.rejected[1].1.contains("no queue typo"), "{plan:?}");
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
                topology: None,
                requeue_on_preemption: false,
                start_ms: None,
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
        let n = &w.index.pool("p").unwrap().nodes[&node];
        let free = n.free_devices().iter().position(|f| *f).unwrap();
        let device = n.devices[free].spec.id.clone();
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
        for (wx, wy, want_x) in [(1, 1, 12), (3, 1, 14)] {
            // 24 GPUs, three queues of 8 in one cohort; z wants none, x and
            // y each want 16, x at a higher priority. Each gets its 8, and
            // z's unused 8 is shared by weight.
            let mut w = World::new(3);
            w.queue("x", Some("c"), wx, 8, None);
            w.queue("y", Some("c"), wy, 8, None);
            w.queue("z", Some("c"), 1, 8, None);
            for i in 0..16 {
                w.request_in(Some("x"), &format!("x{i:02}"), 1, Shape::Any, 10);
                w.request_in(Some("y"), &format!("y{i:02}"), 1, Shape::Any, 0);
            }
            let shares = projections::quota::fair_shares(&w.index, "p", now_ms());
            let fair: Vec<u64> = shares.iter().map(|s| s.fair).collect();
            assert_eq!(fair, [want_x, 24 - want_x, 0], "{shares:?}");
            w.run();
            // Priority decides within a queue, fairness across them.
            assert_eq!(w.used("x"), want_x, "weights {wx}:{wy}");
            assert_eq!(w.used("y"), 24 - want_x, "weights {wx}:{wy}");
            assert_eq!(w.phase("x00"), Some(Phase::Placed));
            let shares = projections::quota::fair_shares(&w.index, "p", now_ms());
            assert!(shares.iter().all(|s| s.used == s.fair), "{shares:?}");
        }
    }

    #[test]
    fn a_queue_that_used_more_yields_to_one_that_used_less_where_its_cohort_remembers() {
        use std::time::{Duration, UNIX_EPOCH};
        const HOUR: u64 = 3_600_000;
        for remembers in [false, true] {
            // 24 GPUs, three queues of 8 in one cohort; z wants none.
            let mut w = World::new(3);
            let t0 = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
            w.log.clock = Some(t0);
            w.queue("a", Some("c"), 1, 8, None);
            w.queue("b", Some("c"), 1, 8, None);
            w.queue("z", Some("c"), 1, 8, None);
            if remembers {
                let on = Fact::CohortDecaySet {
                    cohort: "c".into(),
                    half_life_ms: Some(HOUR),
                };
                assert_eq!(w.pool(&on), None);
            }
            // a holds 16 (8 of them b's and z's) for ten hours.
            for i in 0..16 {
                w.request_in(Some("a"), &format!("old{i:02}"), 1, Shape::Any, 0);
            }
            w.run();
            assert_eq!(w.used("a"), 16);
            w.log.clock = Some(t0 + Duration::from_millis(10 * HOUR));
            for i in 0..16 {
                w.release(&format!("old{i:02}"));
            }
            // Now both want 16, a at the higher priority and first in
            // name order: what decides is the past.
            for i in 0..16 {
                w.request_in(Some("a"), &format!("a{i:02}"), 1, Shape::Any, 5);
                w.request_in(Some("b"), &format!("b{i:02}"), 1, Shape::Any, 0);
            }
            let at = 1_800_000_000_000 + 10 * HOUR;
            let shares = projections::quota::fair_shares(&w.index, "p", at);
            let fair: Vec<u64> = shares.iter().map(|s| s.fair).collect();
            // Ten hours of 16 GPUs, on average over the decay: nearly all
            // of 16 with a half-life of an hour, a little with the default
            // week kept while the cohort does not remember.
            let half_life = if remembers { 1.0 } else { 168.0 };
            let expected = 16.0 * (1.0 - 0.5f64.powf(10.0 / half_life));
            assert!((shares[0].past_gpus - expected).abs() < 1e-6, "{shares:?}");
            assert_eq!(shares[1].past_gpus, 0.0, "{shares:?}");
            w.run();
            let (a, b) = (w.used("a"), w.used("b"));
            if remembers {
                // Each gets its quota; z's unused 8 go to b, which borrowed
                // nothing before.
                assert_eq!((a, b), (8, 16));
                assert_eq!(fair, [8, 16, 0], "{shares:?}");
                assert_eq!(shares[0].half_life_ms, Some(HOUR));
            } else {
                assert_eq!((a, b), (12, 12));
                assert_eq!(fair, [12, 12, 0], "{shares:?}");
                assert_eq!(shares[0].half_life_ms, None);
            }
            // Past usage is folded from the events' times alone: the index
            // rebuilt from the log holds the same bits.
            let mut rebuilt = Index::new();
            for e in &w.log.events {
                rebuilt.apply(e).unwrap();
            }
            assert!(rebuilt == w.index);
            assert!(w.index.derived_is_consistent());
            let carried = w.index.pool("p").unwrap().past["a"][C];
            assert!(carried.gpu_ms > 0.0 && carried.at_ms == at, "{carried:?}");
        }
    }

    /// Queue `name` of `nominal` GPUs, no cohort, with `budgets` and a
    /// maximum run time.
    fn limited_queue(
        w: &mut World,
        name: &str,
        nominal: u32,
        budgets: Vec<domain::Budget>,
        max_run_ms: Option<u64>,
    ) {
        let spec = domain::QueueSpec {
            queue: name.into(),
            cohort: None,
            weight: 1,
            quotas: vec![domain::Quota {
                class: C.into(),
                nominal,
                borrowing_limit: None,
            }],
            budgets,
            max_run_ms,
        };
        assert_eq!(w.pool(&Fact::QueueConfigured(spec)), None);
    }

    #[test]
    fn a_spent_budget_makes_requests_wait_or_be_rejected_and_a_soft_one_serves_them_last() {
        use domain::{Budget, BudgetPeriod, Enforce};
        use std::time::{Duration, UNIX_EPOCH};
        const HOUR: u64 = 3_600_000;
        let day = |enforce| {
            vec![Budget {
                period: BudgetPeriod::Day,
                gpu_seconds: 3600,
                enforce,
            }]
        };
        // 8 GPUs. a, b and c may each book one GPU-hour a day.
        let mut w = World::new(1);
        let noon = UNIX_EPOCH + Duration::from_secs(1_800_000_000 / 86_400 * 86_400 + 43_200);
        w.log.clock = Some(noon);
        limited_queue(&mut w, "a", 2, day(Enforce::Wait), None);
        limited_queue(&mut w, "b", 2, day(Enforce::Reject), None);
        limited_queue(&mut w, "c", 2, day(Enforce::Soft), None);
        limited_queue(&mut w, "d", 6, vec![], None);
        for (q, gpus) in [("a", 1), ("b", 1), ("c", 1), ("d", 4)] {
            w.request_in(Some(q), &format!("{q}0"), gpus, Shape::Any, 0);
        }
        assert_eq!(w.run().placed.len(), 4);
        // An hour later each has booked its GPU-hour; one GPU is free.
        w.log.clock = Some(noon + Duration::from_millis(HOUR));
        for q in ["a", "b", "c", "d"] {
            w.request_in(Some(q), &format!("{q}1"), 1, Shape::Any, 0);
        }
        let plan = w.run();
        let placed: Vec<&str> = plan.placed.iter().map(|(id, _)| id.as_str()).collect();
        // c spent its soft budget: d, within its own, is served first.
        assert_eq!(placed, ["d1"], "{plan:?}");
        assert_eq!(w.phase("c1"), Some(Phase::Queued));
        let a1 = w.index.reservation("a1").unwrap().reason.clone();
        assert!(
            a1.starts_with("over budget: queue a booked 1.0 of its 1.0 GPU-hours this day; it renews at 2027-01-16T00:00:00Z"),
            "{a1}"
        );
        assert_eq!(w.phase("b1"), None, "rejected: {plan:?}");
        assert!(
            plan.rejected[0].1.starts_with("over budget: queue b"),
            "{plan:?}"
        );
        // The next day renews it: a1 is placed, within its new budget.
        w.release("d0");
        w.log.clock = Some(noon + Duration::from_millis(12 * HOUR + 1000));
        w.run();
        assert_eq!(w.phase("a1"), Some(Phase::Placed));
        // What was booked is folded from the events' times: a replay holds
        // the same.
        let mut rebuilt = Index::new();
        for e in &w.log.events {
            rebuilt.apply(e).unwrap();
        }
        assert!(rebuilt == w.index);
    }

    #[test]
    fn a_queues_maximum_run_time_ends_its_reservations_unless_their_own_ends_first() {
        let mut w = World::new(1);
        limited_queue(&mut w, "m", 8, vec![], Some(600_000));
        w.request_in(Some("m"), "long", 1, Shape::Any, 0);
        w.ask(Some("m"), "short", 1, Shape::Any, 0, Some(60_000));
        w.run();
        let long = w.index.reservation("long").unwrap().clone();
        let short = w.index.reservation("short").unwrap().clone();
        assert!(long.end_reason == "max_run_time" && short.end_reason.is_empty());
        assert_eq!(long.expires_at_ms, long.placed_at_ms.map(|t| t + 600_000));
        assert_eq!(short.expires_at_ms, short.placed_at_ms.map(|t| t + 60_000));
        // A notice of its end keeps it at least to the notice's deadline;
        // one about a reservation without the limit is a violation.
        let late = long.expires_at_ms.unwrap() + 5_000;
        let notice = |id: &str| Fact::ReservationEndingNoticed {
            reservation: id.into(),
            reason: "max_run_time".into(),
            deadline_ms: Some(late),
        };
        assert_eq!(w.pool(&notice("long")), None);
        let long = w.index.reservation("long").unwrap();
        assert!(long.noticed);
        assert_eq!(long.expires_at_ms, Some(late));
        assert!(w.pool(&notice("short")).is_some());
        assert!(w.index.derived_is_consistent());
    }

    #[test]
    fn a_reservation_in_advance_is_promised_lent_only_to_work_that_ends_before_and_placed_at_its_start(
    ) {
        use std::time::{Duration, UNIX_EPOCH};
        const MIN: u64 = 60_000;
        let mut w = World::new(1);
        let t0 = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let t0_ms = 1_800_000_000_000;
        w.log.clock = Some(t0);
        // The node is full until 30 minutes from now.
        w.request_ttl("fill", 8, Shape::Any, Some(30 * MIN));
        w.run();
        // The whole node from an hour from now, for two hours: promised,
        // on the devices the fill frees.
        w.ask_ahead("ahead", 8, t0_ms + 60 * MIN, 120 * MIN);
        let plan = w.run();
        assert_eq!(plan.promised.len(), 1, "{plan:?}");
        let promise = w
            .index
            .reservation("ahead")
            .unwrap()
            .promise
            .clone()
            .unwrap();
        assert_eq!(
            (promise.start_ms, promise.end_ms),
            (t0_ms + 60 * MIN, t0_ms + 180 * MIN)
        );
        // A second for an overlapping window cannot be promised.
        w.ask_ahead("overlap", 1, t0_ms + 170 * MIN, 60 * MIN);
        let plan = w.run();
        assert!(
            plan.rejected[0]
                .1
                .starts_with("cannot promise 1 H100-80GB GPUs from"),
            "{plan:?}"
        );
        // The fill ends; work that ends 10 minutes later may use the
        // devices, work without an end may not.
        w.log.clock = Some(at(31 * MIN));
        w.release("fill");
        w.request_ttl("short", 4, Shape::Any, Some(10 * MIN));
        w.request("long", 4, Shape::Any, 0);
        w.run();
        assert_eq!(w.phase("short"), Some(Phase::Placed));
        assert_eq!(w.phase("long"), Some(Phase::Queued));
        let why = &w.index.reservation("long").unwrap().reason;
        assert!(
            why.starts_with("held back") && why.contains("ahead"),
            "{why}"
        );
        // At its start, it is placed on what it was promised.
        w.log.clock = Some(at(60 * MIN));
        w.release("short");
        w.run();
        assert_eq!(w.phase("ahead"), Some(Phase::Placed));
        assert_eq!(w.allocs("ahead"), promise.allocations);
        assert_eq!(w.phase("long"), Some(Phase::Queued));
        let mut rebuilt = Index::new();
        for e in &w.log.events {
            rebuilt.apply(e).unwrap();
        }
        assert!(rebuilt == w.index);
        assert!(w.index.derived_is_consistent());
    }

    #[test]
    fn no_placement_lasts_into_a_maintenance_window_and_what_would_ends_at_its_start() {
        use std::time::{Duration, UNIX_EPOCH};
        const MIN: u64 = 60_000;
        let mut w = World::new(1);
        let t0_ms = 1_800_000_000_000;
        w.log.clock = Some(UNIX_EPOCH + Duration::from_millis(t0_ms));
        w.request("old", 2, Shape::Any, 0);
        w.run();
        let window = Fact::NodeMaintenanceScheduled {
            node: "n00".into(),
            start_ms: Some(t0_ms + 60 * MIN),
            end_ms: Some(t0_ms + 120 * MIN),
            reason: "firmware".into(),
        };
        assert_eq!(w.pool(&window), None);
        // What runs ends at its start.
        let old = w.index.reservation("old").unwrap();
        assert_eq!(old.expires_at_ms, Some(t0_ms + 60 * MIN));
        assert_eq!(old.end_reason, "maintenance");
        // Only what ends before it is placed there.
        w.request_ttl("short", 2, Shape::Any, Some(30 * MIN));
        w.request("long", 2, Shape::Any, 0);
        w.request_ttl("across", 2, Shape::Any, Some(90 * MIN));
        w.run();
        assert_eq!(w.phase("short"), Some(Phase::Placed));
        assert_eq!(w.phase("long"), Some(Phase::Queued));
        assert_eq!(w.phase("across"), Some(Phase::Queued));
        // A placement that would last into it is a violation.
        let bad = w.pool(&Fact::ReservationPlaced {
            reservation: "long".into(),
            allocations: vec![Allocation {
                node: "n00".into(),
                devices: vec!["gpu6".into(), "gpu7".into()],
            }],
        });
        assert!(
            bad.as_ref()
                .is_some_and(|v| v.message.contains("would last into node n00's maintenance")),
            "{bad:?}"
        );
        // After it, the node takes placements again.
        w.log.clock = Some(UNIX_EPOCH + Duration::from_millis(t0_ms + 121 * MIN));
        w.run();
        assert_eq!(w.phase("across"), Some(Phase::Placed));
    }

    #[test]
    fn a_higher_priority_request_preempts_the_fewest_lower_ones_and_never_an_equal() {
        let mut w = World::new(1);
        w.queue("q", None, 1, 8, None);
        w.request_in(Some("q"), "low", 2, Shape::Any, 0);
        w.request_in(Some("q"), "low-big", 4, Shape::Any, 0);
        w.request_in(Some("q"), "mid", 2, Shape::Any, 1);
        w.run();
        assert_eq!(w.index.class("p", C).unwrap().free, 0);
        // 4 GPUs for priority 5: one victim (low-big) frees them, two
        // (low and mid) would too; the lowest priority goes first, and no
        // more than needed.
        w.request_in(Some("q"), "high", 4, Shape::Any, 5);
        let plan = w.run();
        assert_eq!(
            plan.preempting,
            [(
                "low-big".to_string(),
                "high".to_string(),
                "priority".to_string()
            )],
            "{plan:?}"
        );
        assert!(
            plan.queued[0].1.starts_with("preempting: 1 reservation(s)"),
            "{plan:?}"
        );
        assert_eq!(
            w.phase("low-big"),
            Some(Phase::Placed),
            "it keeps its GPUs until its grace ends"
        );
        // An equal priority preempts nothing; what is being preempted is
        // not taken twice.
        w.request_in(Some("q"), "peer", 2, Shape::Any, 1);
        let plan = w.run();
        assert!(
            plan.preempting.iter().all(|(v, _, _)| v == "low"),
            "{plan:?}"
        );
        // The grace period ends: low-big is gone and high is on its GPUs.
        let big = w.allocs("low-big");
        let plan = w.run_ending();
        assert!(plan.placed.iter().any(|(id, _)| id == "high"), "{plan:?}");
        assert!(w.index.reservation("low-big").is_none());
        let mut got = w.allocs("high")[0].devices.clone();
        got.sort();
        let mut freed = big[0].devices.clone();
        freed.sort();
        assert_eq!(got, freed);
        assert!(w.index.derived_is_consistent());
        assert_eq!(w.index.state().violations, 0);
        // A preemption of an equal priority in the log is a violation.
        w.request_in(Some("q"), "same", 2, Shape::Any, 1);
        w.run();
        let v = w
            .pool(&Fact::ReservationPreemptionScheduled {
                reservation: "mid".into(),
                by: "same".into(),
                reason: "priority".into(),
                deadline_ms: None,
            })
            .expect("a violation");
        assert!(v.message.contains("only a lower priority is"), "{v}");
    }

    #[test]
    fn a_pool_without_queues_preempts_lower_priorities_unless_it_is_turned_off() {
        let mut w = World::new(1);
        w.request("low", 2, Shape::Any, 0);
        w.request("low-big", 4, Shape::Any, 0);
        w.request("mid", 2, Shape::Any, 1);
        w.run();
        assert_eq!(w.index.class("p", C).unwrap().free, 0);
        // The fewest of the lowest priority, as in a queue.
        w.request("high", 4, Shape::Any, 5);
        let plan = w.run();
        assert_eq!(
            plan.preempting,
            [(
                "low-big".to_string(),
                "high".to_string(),
                "priority".to_string()
            )],
            "{plan:?}"
        );
        // An equal priority preempts nothing.
        w.request("peer", 4, Shape::Any, 0);
        let plan = w.run();
        assert!(plan.preempting.is_empty(), "{plan:?}");
        let plan = w.run_ending();
        assert!(plan.placed.iter().any(|(id, _)| id == "high"), "{plan:?}");
        assert!(w.index.reservation("low-big").is_none());
        // Turned off: a higher priority waits, and a preemption in the log
        // is a violation.
        assert_eq!(w.pool(&Fact::PoolPreemptionSet { enabled: false }), None);
        w.request("top", 2, Shape::Any, 9);
        let plan = w.run();
        assert!(plan.preempting.is_empty(), "{plan:?}");
        assert!(plan.queued.iter().any(|(id, _)| id == "top"), "{plan:?}");
        let v = w
            .pool(&Fact::ReservationPreemptionScheduled {
                reservation: "low".into(),
                by: "top".into(),
                reason: "priority".into(),
                deadline_ms: None,
            })
            .expect("a violation");
        assert!(v.message.contains("does not preempt"), "{v}");
        assert!(w.index.derived_is_consistent());
    }

    #[test]
    fn a_queue_takes_back_what_it_lent_and_only_that() {
        // 16 GPUs; a and b have 8 each in one cohort. b borrowed a's 8.
        let mut w = World::new(2);
        w.queue("a", Some("c"), 1, 8, None);
        w.queue("b", Some("c"), 1, 8, None);
        for i in 0..4 {
            w.request_in(Some("b"), &format!("b{i}"), 4, Shape::Any, 9);
        }
        w.run();
        assert_eq!(w.used("b"), 16);
        // a asks for 4 of its own 8: b's newest goes, whatever its priority.
        w.request_in(Some("a"), "a1", 4, Shape::Any, 0);
        let plan = w.run();
        assert_eq!(
            plan.preempting,
            [("b3".to_string(), "a1".to_string(), "reclaim".to_string())],
            "{plan:?}"
        );
        w.run_ending();
        assert_eq!(w.phase("a1"), Some(Phase::Placed));
        assert_eq!((w.used("a"), w.used("b")), (4, 12));
        // a asks for 4 more: b still borrows 4, and a stays within its 8.
        w.request_in(Some("a"), "a2", 4, Shape::Any, 0);
        assert_eq!(w.run().preempting.len(), 1);
        w.run_ending();
        assert_eq!((w.used("a"), w.used("b")), (8, 8));
        // Beyond its quota a takes nothing back: b borrows nothing now.
        w.request_in(Some("a"), "a3", 4, Shape::Any, 0);
        let plan = w.run();
        assert!(plan.preempting.is_empty(), "{plan:?}");
        assert!(plan.queued[0].1.starts_with("over quota"), "{plan:?}");
        // b, under its quota now, cannot take back from a either: a
        // borrows nothing. No two requests preempt each other.
        w.request_in(Some("b"), "b4", 4, Shape::Any, 9);
        assert!(w.run().preempting.is_empty());
        assert_eq!(w.index.state().violations, 0);
        assert!(w.index.derived_is_consistent());
        // A reclaim from a queue that does not borrow is a violation.
        let v = w
            .pool(&Fact::ReservationPreemptionScheduled {
                reservation: "b0".into(),
                by: "a3".into(),
                reason: "reclaim".into(),
                deadline_ms: None,
            })
            .expect("a violation");
        assert!(v.message.contains("borrows nothing to take back"), "{v}");
    }

    #[test]
    fn a_lender_being_preempted_back_to_its_quota_does_not_hide_the_requests_own_queue() {
        // 640 GPUs: a is given 8 and b 632, in one cohort. b holds 120 in
        // 15 reservations of priority 0; a borrows 512 more than its 8, in
        // 520 reservations of one GPU.
        let mut w = World::new(80);
        w.queue("a", Some("c"), 1, 8, None);
        w.queue("b", Some("c"), 1, 632, None);
        for i in 0..15 {
            w.request_in(Some("b"), &format!("low{i:02}"), 8, Shape::Any, 0);
        }
        w.run();
        for i in 0..520 {
            w.request_in(Some("a"), &format!("a{i:03}"), 1, Shape::Any, 0);
        }
        w.run();
        assert_eq!((w.used("a"), w.used("b")), (520, 120));
        // b takes back all that a borrowed: 512 of a's reservations are
        // being preempted, and a lends nothing more.
        for i in 0..64 {
            w.request_in(Some("b"), &format!("r{i:02}"), 8, Shape::Any, 0);
        }
        let plan = w.run();
        assert_eq!(plan.preempting.len(), 512, "{:?}", plan.queued);
        assert!(plan
            .preempting
            .iter()
            .all(|(v, _, why)| v.starts_with('a') && why == "reclaim"));
        // A request of b of higher priority preempts one of b's own of
        // lower priority. a's 520 reservations, none of which may be
        // preempted for it, are not weighed in their place.
        w.request_in(Some("b"), "hi", 8, Shape::Any, 1);
        let plan = w.run();
        let mine: Vec<_> = plan
            .preempting
            .iter()
            .filter(|(_, by, _)| by == "hi")
            .collect();
        assert_eq!(mine.len(), 1, "{plan:?}");
        assert!(
            mine[0].0.starts_with("low") && mine[0].2 == "priority",
            "{mine:?}"
        );
        assert_eq!(w.index.state().violations, 0);
    }

    #[test]
    fn gangs_go_within_one_rack_prefer_one_or_spread_over_racks() {
        use domain::{Tier, Topology};
        // Two racks of four 8-GPU nodes: r0 = n00..n03, r1 = n04..n07;
        // two rail groups across them, the even nodes and the odd.
        let mut w = World::build(8, |_, node| devices(node, C, 8, 0));
        for n in 0..8 {
            let v = w.pool(&Fact::NodeTopologySet {
                node: format!("n{n:02}"),
                rack: Some(format!("r{}", n / 4)),
                block: Some("b0".into()),
                rail: Some(format!("rail{}", n % 2)),
            });
            assert_eq!(v, None);
        }
        let gang = |w: &mut World, id: &str, nodes: u32, topology: Option<Topology>| {
            let r = Request {
                reservation: id.into(),
                pool: "p".into(),
                class: C.into(),
                gpus: nodes * 8,
                shape: Shape::Gang {
                    nodes,
                    gpus_per_node: 8,
                },
                priority: 0,
                ttl_ms: None,
                replace_on_failure: false,
                replaces: None,
                topology,
                requeue_on_preemption: false,
                start_ms: None,
                queue: None,
            };
            let e = w
                .log
                .push(&reservation_stream(id), &Fact::ReservationRequested(r));
            assert_eq!(w.index.apply(&e).unwrap(), None);
        };
        let racks = |w: &World, id: &str| -> BTreeSet<String> {
            w.allocs(id)
                .iter()
                .map(|a| {
                    w.index.pool("p").unwrap().nodes[&a.node]
                        .rack
                        .clone()
                        .unwrap()
                })
                .collect()
        };
        // One GPU booked on n00, one unhealthy on n05: no rack has four
        // whole nodes.
        w.request("one", 1, Shape::Node, 0);
        w.run();
        assert_eq!(w.allocs("one")[0].node, "n00");
        let xid = |raise: bool| {
            if raise {
                Fact::HealthRaised {
                    node: "n05".into(),
                    device: Some("gpu0".into()),
                    condition: "XID-48".into(),
                    detail: String::new(),
                    severity: None,
                    action: None,
                }
            } else {
                Fact::HealthCleared {
                    node: "n05".into(),
                    device: Some("gpu0".into()),
                    condition: "XID-48".into(),
                }
            }
        };
        assert_eq!(w.pool(&xid(true)), None);
        // Four nodes in one rack: it waits, and says why though 62 GPUs
        // are free.
        gang(&mut w, "g4", 4, Some(Topology::Within(Tier::Rack)));
        let plan = w.run();
        assert!(
            plan.queued[0].1.starts_with("topology cannot be met now")
                && plan.queued[0].1.contains("no rack has 4 nodes with 8 free"),
            "{plan:?}"
        );
        // Preferring one rack: it gets one.
        gang(&mut w, "pr", 2, Some(Topology::Prefer(Tier::Rack)));
        w.run();
        assert_eq!(racks(&w, "pr").len(), 1, "{:?}", w.allocs("pr"));
        // Spread: one node in each rack.
        gang(&mut w, "sp", 2, Some(Topology::Spread(Tier::Rack)));
        w.run();
        assert_eq!(racks(&w, "sp").len(), 2, "{:?}", w.allocs("sp"));
        // Free a rack: the waiting gang takes it whole.
        for id in ["one", "pr", "sp"] {
            w.release(id);
        }
        assert_eq!(w.pool(&xid(false)), None);
        w.run();
        assert_eq!(w.phase("g4"), Some(Phase::Placed));
        assert_eq!(racks(&w, "g4").len(), 1);
        assert!(w.index.derived_is_consistent());
        assert_eq!(w.index.state().violations, 0);
        // Within one rail group: the four whole nodes left are two even
        // and two odd, so three cannot be had in one, and two can.
        gang(&mut w, "rail3", 3, Some(Topology::Within(Tier::Rail)));
        let plan = w.run();
        assert!(
            plan.queued[0].1.contains("no rail has 3 nodes with 8 free"),
            "{plan:?}"
        );
        gang(&mut w, "rail2", 2, Some(Topology::Within(Tier::Rail)));
        w.run();
        let rails: BTreeSet<&str> = w
            .allocs("rail2")
            .iter()
            .map(|a| {
                w.index.pool("p").unwrap().nodes[&a.node]
                    .label(Tier::Rail)
                    .unwrap()
            })
            .collect();
        assert_eq!(rails.len(), 1, "{:?}", w.allocs("rail2"));
        for id in ["rail2", "g4"] {
            w.release(id);
        }
        w.run();
        assert_eq!(
            w.phase("rail3"),
            Some(Phase::Placed),
            "each rail group is whole again"
        );
        w.release("rail3");
        // A gang within one rack placed across two is a violation.
        gang(&mut w, "bad", 2, Some(Topology::Within(Tier::Rack)));
        let v = w
            .pool(&Fact::ReservationPlaced {
                reservation: "bad".into(),
                allocations: ["n01", "n05"]
                    .iter()
                    .map(|n| Allocation {
                        node: n.to_string(),
                        devices: (0..8).map(|d| format!("gpu{d}")).collect(),
                    })
                    .collect(),
            })
            .expect("a violation");
        assert!(
            v.message.contains("gang within one rack placed across"),
            "{v}"
        );
    }

    #[test]
    fn a_waiting_gang_keeps_what_it_will_start_on_from_smaller_requests_behind_it() {
        let gang = Shape::Gang {
            nodes: 2,
            gpus_per_node: 8,
        };
        let mut w = World::new(3);
        // n00 full until a's TTL, n01 half full until b's, n02 held for
        // good by c: the gang starts when b ends, on n00 and n01.
        w.request_ttl("a", 8, Shape::Node, Some(60_000));
        w.run();
        w.request_ttl("b", 4, Shape::Node, Some(120_000));
        w.run();
        w.request_ttl("c", 7, Shape::Node, None);
        w.run();
        let node = |w: &World, id: &str| w.allocs(id)[0].node.clone();
        let (na, nb, nc) = (node(&w, "a"), node(&w, "b"), node(&w, "c"));
        assert_eq!([&na, &nb, &nc], ["n00", "n01", "n02"]);
        w.request_ttl("g", 16, gang, None);
        let plan = w.run();
        assert_eq!(w.phase("g"), Some(Phase::Queued), "{plan:?}");
        // Behind it: s would fit on n01 and never end; u ends before b;
        // v fits on n02, which the gang does not need.
        w.request_ttl("s", 2, Shape::Node, None);
        w.request_ttl("u", 2, Shape::Node, Some(30_000));
        w.request_ttl("v", 1, Shape::Node, None);
        let plan = w.run();
        // The gang's start, and s's (on n00 when a ends), are held.
        assert_eq!(plan.held, 2, "{plan:?}");
        assert_eq!(w.phase("s"), Some(Phase::Queued), "{plan:?}");
        let why = &w.index.reservation("s").unwrap().reason;
        assert!(
            why.starts_with(
                "held back: 5 H100-80GB GPUs are free, but those it could use are kept for g"
            ),
            "{why}"
        );
        assert_eq!(w.phase("u"), Some(Phase::Placed));
        assert_eq!(node(&w, "u"), nb, "u ends before the gang starts");
        assert_eq!(node(&w, "v"), nc);
        // A batch of new requests alone (the gang is not retried in it)
        // still keeps n01's free GPUs for the gang.
        w.request_ttl("x", 2, Shape::Node, None);
        let ids = vec!["x".to_string()];
        let plan = plan_with(&mut w.index, "p", &ids, &Ending::default(), now_ms());
        assert!(plan.placed.is_empty(), "{plan:?}");
        assert_eq!(plan.queued.len(), 1, "{plan:?}");
        assert!(plan.queued[0].1.starts_with("held back"), "{plan:?}");
        // One that asks for more priority than the gang is ahead of it.
        w.ask(None, "hi", 2, Shape::Node, 1, None);
        w.run();
        assert_eq!(node(&w, "hi"), nb, "a higher priority is not held back");
        w.release("hi");
        // When a and b end (and u), the gang starts on n00 and n01; s, x
        // still wait.
        w.release("a");
        w.run();
        assert_eq!(w.phase("g"), Some(Phase::Queued));
        w.release("u");
        w.release("b");
        w.run();
        assert_eq!(w.phase("g"), Some(Phase::Placed));
        let mut nodes: Vec<String> = w.allocs("g").into_iter().map(|a| a.node).collect();
        nodes.sort();
        assert_eq!(nodes, [na, nb]);
        assert_eq!(w.phase("s"), Some(Phase::Queued));
        assert!(w.index.derived_is_consistent());
    }

    #[test]
    fn a_gang_behind_a_thousand_small_reservations_is_held_for_where_nodes_free_first() {
        // 128 nodes full of 1-GPU reservations, filled in name order (best
        // fit). Seven of each node's eight end early, node by node in turn;
        // the last of each ends late, the last node's first: 896
        // reservations end before any node is whole again, and the gang
        // starts on the last two nodes.
        let gang = Shape::Gang {
            nodes: 2,
            gpus_per_node: 8,
        };
        let mut names: Vec<String> = (0..128).map(|n| format!("n{n:02}")).collect();
        names.sort();
        let (last, next) = (names[127].clone(), names[126].clone());
        let mut w = World::new(128);
        for i in 0..1024u64 {
            let (k, j) = (i / 8, i % 8);
            let step = if j < 7 {
                j * 128 + k
            } else {
                7 * 128 + (127 - k)
            };
            w.request_ttl(&format!("f{i}"), 1, Shape::Any, Some(600_000 + step * 100));
        }
        w.run();
        assert_eq!(w.allocs("f1023")[0].node, last);
        assert_eq!(w.allocs("f0")[0].node, names[0]);
        w.request_ttl("g", 16, gang, None);
        w.run();
        assert_eq!(w.phase("g"), Some(Phase::Queued));
        // One GPU frees on each of the last two (released early), and one
        // on the sixth: a request without TTL goes only to the sixth, one
        // that ends in time may go to the gang's nodes.
        for i in [126 * 8, 127 * 8, 5 * 8] {
            w.release(&format!("f{i}"));
        }
        w.request_ttl("s", 1, Shape::Any, None);
        w.request_ttl("t", 1, Shape::Any, None);
        w.request_ttl("u", 1, Shape::Any, Some(60_000));
        let plan = w.run();
        assert!(plan.held >= 1, "{plan:?}");
        assert_eq!(w.allocs("s")[0].node, names[5], "{plan:?}");
        assert_eq!(w.phase("t"), Some(Phase::Queued), "{plan:?}");
        assert!(w
            .index
            .reservation("t")
            .unwrap()
            .reason
            .starts_with("held back"));
        assert!([&last, &next].contains(&&w.allocs("u")[0].node));
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
            condition: "XID-48".into(),
            detail: String::new(),
            severity: None,
            action: None,
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
            severity: None,
            action: None,
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

    /// A long random run: incremental upkeep equals a rebuild, the planner
    /// never produces an invalid placement, and bookings stay consistent.
    /// The class of the MIG instances of [`World::mixed`].
    const MIG: &str = "H100-80GB/1g.10gb";

    #[test]
    fn a_mig_instance_and_its_gpu_are_never_booked_together() {
        // One node: gpu0 is split into seven instances, gpu1..gpu7 are whole.
        let mut w = World::build(1, |_, node| {
            let mut d = devices(node, C, 8, 0);
            domain::pools::split_mig(&mut d, 1, "1g.10gb", 7);
            d
        });
        assert_eq!(w.index.class("p", C).unwrap().free, 7, "gpu0 is not whole");
        assert_eq!(w.index.class("p", MIG).unwrap().free, 7);
        // Eight whole GPUs wait: gpu0 is booked only through its instances.
        w.request("whole", 8, Shape::Any, 0);
        w.ask_class(MIG, None, "slices", 3, Shape::Any, 0, None);
        w.run();
        assert_eq!(w.phase("whole"), Some(Phase::Queued));
        assert_eq!(w.phase("slices"), Some(Phase::Placed));
        assert!(w.allocs("slices")[0]
            .devices
            .iter()
            .all(|d| d.starts_with("gpu0.mig")));
        // A placement naming gpu0 while its instances are booked is refused.
        let v = w.pool(&Fact::ReservationPlaced {
            reservation: "whole".into(),
            allocations: vec![Allocation {
                node: "n00".into(),
                devices: (0..8).map(|i| format!("gpu{i}")).collect(),
            }],
        });
        assert!(v.is_some(), "gpu0 was booked under its instances");
        w.index.check_bookings().unwrap();
        assert!(w.index.derived_is_consistent());

        // A fault on gpu0 keeps its instances out of placement, and a
        // quarantine of it ends the reservations on them.
        let mut w = World::build(1, |_, node| {
            let mut d = devices(node, C, 8, 0);
            domain::pools::split_mig(&mut d, 1, "1g.10gb", 7);
            d
        });
        w.ask_class(MIG, None, "slices", 2, Shape::Any, 0, None);
        w.run();
        assert_eq!(w.phase("slices"), Some(Phase::Placed));
        w.pool(&Fact::HealthRaised {
            node: "n00".into(),
            device: Some("gpu0".into()),
            condition: "XID-48".into(),
            detail: String::new(),
            severity: None,
            action: None,
        });
        assert_eq!(w.index.class("p", MIG).unwrap().free, 0);
        w.pool(&Fact::DeviceQuarantined {
            node: "n00".into(),
            device: "gpu0".into(),
            condition: "XID-48".into(),
            action: domain::faults::Action::ResetGpu,
            reason: String::new(),
        });
        let node = &w.index.pool("p").unwrap().nodes["n00"];
        assert!(node.troubled());
        let ending: std::collections::BTreeSet<&str> = node.quarantined_bookings().collect();
        assert_eq!(ending, ["slices"].into());
        // The fault budget counts GPUs, not instances.
        assert_eq!(w.index.pool("p").unwrap().fault_budget(), (8, 1));

        // Repartitioned while an instance is still booked (the node reports
        // gpu0 whole again): the booked instance keeps gpu0 out of placement.
        let mut w = World::build(1, |_, node| {
            let mut d = devices(node, C, 8, 0);
            domain::pools::split_mig(&mut d, 1, "1g.10gb", 7);
            d
        });
        w.ask_class(MIG, None, "slices", 1, Shape::Any, 0, None);
        w.run();
        w.pool(&Fact::NodeJoined {
            node: "n00".into(),
            devices: devices("n00", C, 8, 0),
        });
        assert_eq!(w.index.class("p", C).unwrap().free, 7);
        w.request("whole", 8, Shape::Any, 0);
        w.run();
        assert_eq!(w.phase("whole"), Some(Phase::Queued));
        w.release("slices");
        assert_eq!(w.index.class("p", C).unwrap().free, 8);
        w.run();
        assert_eq!(w.phase("whole"), Some(Phase::Placed));
        w.index.check_bookings().unwrap();
        assert!(w.index.derived_is_consistent());
    }

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
        let mut preempted = 0;
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
                    // Half of them with a TTL, so waiting requests hold
                    // what they will start on (backfill).
                    let ttl = rng.bool().then(|| rng.u64(1_000..600_000));
                    // Where the pool has MIG instances, a third ask for them.
                    let class = match w.index.class("p", MIG) {
                        Some(_) if rng.u32(0..3) == 0 => MIG,
                        _ => C,
                    };
                    w.ask_class(
                        class,
                        queue.as_deref(),
                        &id,
                        gpus,
                        shape,
                        rng.i32(0..3),
                        ttl,
                    );
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
                            condition: "XID-48".into(),
                            detail: String::new(),
                            severity: None,
                            action: None,
                        }
                    } else {
                        Fact::HealthCleared {
                            node,
                            device,
                            condition: "XID-48".into(),
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
                    let ending = w
                        .index
                        .queues("p")
                        .is_some_and(|q| !q.preemptions.is_empty());
                    let plan = if ending && rng.bool() {
                        w.run_ending()
                    } else {
                        w.run()
                    };
                    placed += plan.placed.len();
                    preempted += plan.preempting.len();
                    live.retain(|id| w.index.reservation(id).is_some());
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
        // Pools with and without queues preempt (priorities vary).
        assert!(preempted > 0, "seed {seed}: nothing was preempted");
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
