//! Quota: which queue may use how much of its pool, and in what order
//! queues are served when they want more than there is.
//!
//! A queue (`queue.configured`, on the pool's stream) has a nominal quota
//! per GPU class: GPUs it is guaranteed, and lends to the other queues of its
//! cohort while it does not use them. A request names its queue; it is
//! admitted when the queue stays within its nominal quota, or, borrowing,
//! within its borrowing limit and within what its cohort as a whole is
//! nominally given. [`admit`] is the one rule: the placer applies it before
//! it places, and the index applies it again to every placement in the log,
//! so a placement over quota is a violation that `strata replay check`
//! reports.
//!
//! When demand exceeds what there is, queues are served by weighted dominant
//! resource fairness over what they borrow: a queue short of its nominal
//! quota first, then the queue whose largest share of any class beyond its
//! quota (over its cohort's nominal total, divided by its weight) is
//! smallest ([`dominant_share`]). [`fair_shares`] is what each queue would
//! hold if the cohort's quota were divided that way: every queue its
//! nominal quota (or what it wants, if less), and what that leaves unused
//! by weight among those that want more.

use crate::hashing::FastSet;
use crate::index::Index;
use crate::tally::Tally;
use domain::{QueueSpec, Request};
use std::collections::{BTreeMap, HashMap};

/// Usage a batch being planned adds to the index's: `(queue, class) ->
/// GPUs` of the placements planned so far.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    added: Tally,
    /// GPUs of live reservations counted as gone (a preemption being
    /// weighed: what would fit without them).
    freed: Tally,
    /// GPUs of reservations the batch chose to preempt, per queue.
    preempting: Tally,
    /// The reservations the batch chose to preempt.
    victims: FastSet<String>,
    /// The reservations the batch ends (released, expired, failed,
    /// preempted): gone before anything it places.
    gone: FastSet<String>,
    /// GPUs of those that were being preempted, per queue.
    gone_preempting: Tally,
}

impl Batch {
    pub fn add(&mut self, queue: &str, class: &str, gpus: u64) {
        self.added.add(queue, class, gpus);
    }

    /// Counts a live reservation's GPUs as gone, for weighing a preemption.
    pub fn free(&mut self, queue: &str, class: &str, gpus: u64) {
        self.freed.add(queue, class, gpus);
    }

    /// Counts live reservation `id` as ended by the batch (`marked`: it was
    /// being preempted).
    pub fn end(&mut self, id: &str, queue: Option<&str>, class: &str, gpus: u64, marked: bool) {
        if let Some(q) = queue {
            self.free(q, class, gpus);
            if marked {
                self.gone_preempting.add(q, class, gpus);
            }
        }
        self.gone.insert(id.to_string());
    }

    /// Undoes [`Batch::free`] of the same GPUs.
    pub fn unfree(&mut self, queue: &str, class: &str, gpus: u64) {
        self.freed.sub(queue, class, gpus);
    }

    /// Undoes [`Batch::preempt`] of a reservation it alone chose.
    pub fn unpreempt(&mut self, id: &str, queue: Option<&str>, class: &str, gpus: u64) {
        if let Some(q) = queue {
            self.preempting.sub(q, class, gpus);
        }
        self.victims.remove(id);
    }

    /// Counts reservation `id` (of `queue`, if it has one) as chosen for
    /// preemption.
    pub fn preempt(&mut self, id: &str, queue: Option<&str>, class: &str, gpus: u64) {
        if let Some(q) = queue {
            self.preempting.add(q, class, gpus);
        }
        self.victims.insert(id.to_string());
    }

    /// Whether the batch chose to preempt reservation `id`, or ends it.
    pub fn preempts(&self, id: &str) -> bool {
        self.victims.contains(id) || self.gone.contains(id)
    }
}

/// Why a request is not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// It names no queue of the pool (or names one where the pool has
    /// none): it never will be admitted as it is.
    #[error("{0}")]
    NoQueue(String),
    /// Its queue has no room for it now.
    #[error("over quota: {0}")]
    OverQuota(String),
}

/// GPUs of `class` that `queue` holds, with the batch's.
pub fn held(index: &Index, pool: &str, queue: &str, class: &str, batch: &Batch) -> u64 {
    (index.queues(pool).map_or(0, |q| q.used(queue, class)) + batch.added.get(queue, class))
        .saturating_sub(batch.freed.get(queue, class))
}

/// The queues of `cohort` in a pool.
fn members<'a>(
    queues: &'a BTreeMap<String, QueueSpec>,
    cohort: &'a str,
) -> impl Iterator<Item = &'a QueueSpec> {
    queues
        .values()
        .filter(move |s| s.cohort.as_deref() == Some(cohort))
}

/// Whether `request` may be placed as far as quota goes, with `batch`'s
/// placements counted as made.
pub fn admit(index: &Index, pool: &str, request: &Request, batch: &Batch) -> Result<(), Refusal> {
    let Some(p) = index.pool(pool) else {
        return Ok(());
    };
    let (queues, asked) = (&p.queues, request.queue.as_deref());
    let name = match (queues.is_empty(), asked) {
        (true, None) => return Ok(()),
        (true, Some(q)) => {
            return Err(Refusal::NoQueue(format!(
                "pool {pool} has no queues; ask without one (not queue {q})"
            )))
        }
        (false, None) => {
            return Err(Refusal::NoQueue(format!(
                "pool {pool} is shared by queues: name one (see `strata queues list --pool {pool}`)"
            )))
        }
        (false, Some(q)) => q,
    };
    let Some(spec) = queues.get(name) else {
        return Err(Refusal::NoQueue(format!(
            "pool {pool} has no queue {name} (see `strata queues list --pool {pool}`)"
        )));
    };
    let class = request.class.as_str();
    let gpus = request.gpus as u64;
    let mine = held(index, pool, name, class, batch);
    let nominal = spec.quota(class).map_or(0, |q| q.nominal) as u64;
    if mine + gpus <= nominal {
        return Ok(());
    }
    // Put into words only when refused: most requests over their nominal
    // quota borrow, and are admitted.
    let holds =
        || format!("queue {name} holds {mine} of its {nominal} {class} GPUs and asks for {gpus}");
    let Some(cohort) = spec.cohort.as_deref() else {
        return Err(Refusal::OverQuota(format!(
            "{}; it is in no cohort, so it borrows nothing",
            holds()
        )));
    };
    if let Some(limit) = spec.quota(class).and_then(|q| q.borrowing_limit) {
        if mine + gpus > nominal + limit as u64 {
            return Err(Refusal::OverQuota(format!(
                "{}; it may borrow at most {limit}",
                holds()
            )));
        }
    }
    let (mut total, mut cohort_holds) = (0u64, 0u64);
    for m in members(queues, cohort) {
        total += m.quota(class).map_or(0, |q| q.nominal) as u64;
        cohort_holds += held(index, pool, &m.queue, class, batch);
    }
    if cohort_holds + gpus > total {
        return Err(Refusal::OverQuota(format!(
            "{}; cohort {cohort} has {} of its {total} unused to lend",
            holds(),
            total.saturating_sub(cohort_holds)
        )));
    }
    Ok(())
}

/// GPUs of `class` held by `queue`'s reservations that are being
/// preempted (`reservation.preemption_scheduled` in the index, and those the batch
/// chose).
/// GPUs of `class` that `queue` holds with the batch's, less those being
/// preempted: what a reclaim weighs, for the queue lending and for the
/// queue taking back ([`may_preempt`]). Choosing more of `queue`'s
/// reservations for preemption only lowers it.
pub fn kept(index: &Index, pool: &str, queue: &str, class: &str, batch: &Batch) -> u64 {
    held(index, pool, queue, class, batch)
        .saturating_sub(being_preempted(index, pool, queue, class, batch))
}

fn being_preempted(index: &Index, pool: &str, queue: &str, class: &str, batch: &Batch) -> u64 {
    let marked = index.queues(pool).map_or(0, |q| q.preempting(queue, class));
    (marked + batch.preempting.get(queue, class))
        .saturating_sub(batch.gone_preempting.get(queue, class))
}

/// Whether waiting request `by` may preempt live reservation `victim` of
/// the same pool and class, and as what. Only a pool shared by queues
/// preempts (a pool without keeps what it placed until it ends):
///
/// - `priority`: both are in one queue and the victim's priority is lower;
/// - `reclaim`: they are in different queues of one cohort, the victim's
///   queue borrows (holds more of the class than its nominal quota, not
///   counting what is already being preempted of it), and `by`'s queue,
///   with `by`, stays within its own nominal quota.
///
/// Judged on the index with `batch`: what it ends, every placement it
/// planned, and what it chose to preempt so far. The placer writes a
/// batch's ends first and its `reservation.preemption_scheduled` after all
/// its placements, and weighs preemptions only once every placement is
/// planned, so the index judges each by the same rule on the same state,
/// and a preemption that breaks it is a violation.
pub fn may_preempt<'a>(
    index: &'a Index,
    pool: &'a str,
    by: &'a Request,
    victim: &'a crate::index::Reservation,
    batch: &Batch,
) -> Result<&'static str, NotPreemptible<'a>> {
    use NotPreemptible as No;
    let v = &victim.request;
    if v.pool != pool || v.class != by.class {
        return Err(No::Elsewhere {
            victim: v,
            by,
            pool,
        });
    }
    if index.pool(pool).is_some_and(|p| p.preemption_off) {
        return Err(No::Off { pool });
    }
    if by.queue.is_none() != v.queue.is_none() {
        return Err(No::NotInQueues { victim: v, by });
    }
    // In its own queue, or both in a pool without queues: by priority.
    if v.queue == by.queue {
        return if v.priority < by.priority {
            Ok("priority")
        } else {
            Err(No::NotLower { victim: v, by })
        };
    }
    let queues = index.pool(pool).map(|p| &p.queues);
    let spec = |q: &Option<String>| q.as_deref().and_then(|q| queues?.get(q));
    let (Some(vs), Some(bs)) = (spec(&v.queue), spec(&by.queue)) else {
        return Err(No::NotBothHere { victim: v, by });
    };
    if vs.cohort.is_none() || vs.cohort != bs.cohort {
        return Err(No::NoCohort {
            lender: &vs.queue,
            borrower: &bs.queue,
        });
    }
    let class = by.class.as_str();
    let nominal = |s: &QueueSpec| s.quota(class).map_or(0, |q| q.nominal) as u64;
    let theirs = kept(index, pool, &vs.queue, class, batch);
    if theirs <= nominal(vs) {
        return Err(No::BorrowsNothing {
            queue: &vs.queue,
            holds: theirs,
            nominal: nominal(vs),
            class,
        });
    }
    let mine = kept(index, pool, &bs.queue, class, batch);
    if mine + by.gpus as u64 > nominal(bs) {
        return Err(No::OverOwnQuota {
            queue: &bs.queue,
            would_hold: mine + by.gpus as u64,
            nominal: nominal(bs),
            class,
            by: &by.reservation,
        });
    }
    Ok("reclaim")
}

/// Why a reservation may not be preempted for a request
/// ([`may_preempt`]); put into words only when it is shown, since the
/// placer's searches weigh many victims that are not.
#[derive(Debug, Clone, Copy)]
pub enum NotPreemptible<'a> {
    Elsewhere {
        victim: &'a Request,
        by: &'a Request,
        pool: &'a str,
    },
    NotInQueues {
        victim: &'a Request,
        by: &'a Request,
    },
    Off {
        pool: &'a str,
    },
    NotLower {
        victim: &'a Request,
        by: &'a Request,
    },
    NotBothHere {
        victim: &'a Request,
        by: &'a Request,
    },
    NoCohort {
        lender: &'a str,
        borrower: &'a str,
    },
    BorrowsNothing {
        queue: &'a str,
        holds: u64,
        nominal: u64,
        class: &'a str,
    },
    OverOwnQuota {
        queue: &'a str,
        would_hold: u64,
        nominal: u64,
        class: &'a str,
        by: &'a str,
    },
}

impl std::fmt::Display for NotPreemptible<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            NotPreemptible::Elsewhere { victim: v, by, pool } => write!(
                f,
                "{} of class {} in pool {} cannot make room for {} {} GPUs in pool {pool}",
                v.reservation, v.class, v.pool, by.gpus, by.class
            ),
            NotPreemptible::NotInQueues { victim, by } => write!(
                f,
                "one of {} and {} is in a queue and the other is not",
                victim.reservation, by.reservation
            ),
            NotPreemptible::Off { pool } => write!(
                f,
                "pool {pool} does not preempt (`strata pool preemption {pool} on` turns it on)"
            ),
            NotPreemptible::NotLower { victim: v, by } => write!(
                f,
                "{} (priority {}) may not be preempted by {} (priority {}): only a lower priority is",
                v.reservation, v.priority, by.reservation, by.priority
            ),
            NotPreemptible::NotBothHere { victim, by } => write!(
                f,
                "{} and {} are in different queues, not both of this pool",
                victim.reservation, by.reservation
            ),
            NotPreemptible::NoCohort { lender, borrower } => write!(
                f,
                "queues {lender} and {borrower} share no cohort: {lender} lent {borrower} nothing"
            ),
            NotPreemptible::BorrowsNothing {
                queue,
                holds,
                nominal,
                class,
            } => write!(
                f,
                "queue {queue} holds {holds} of its {nominal} {class} GPUs (not counting what is being preempted): it borrows nothing to take back"
            ),
            NotPreemptible::OverOwnQuota {
                queue,
                would_hold,
                nominal,
                class,
                by,
            } => write!(
                f,
                "queue {queue} would hold {would_hold} of its {nominal} {class} GPUs with {by}: only a queue within its own quota takes back what it lent"
            ),
        }
    }
}

/// The GPUs of `class` that `spec`'s share is measured against: its
/// cohort's nominal total, or its own nominal quota without a cohort (at
/// least 1).
fn capacity(queues: &BTreeMap<String, QueueSpec>, spec: &QueueSpec, class: &str) -> u64 {
    let total: u64 = match spec.cohort.as_deref() {
        Some(c) => members(queues, c)
            .map(|m| m.quota(class).map_or(0, |q| q.nominal) as u64)
            .sum(),
        None => spec.quota(class).map_or(0, |q| q.nominal) as u64,
    };
    total.max(1)
}

/// The classes `spec`'s queue has quota of or holds (with the batch's
/// placements), each once.
fn classes<'a>(
    index: &'a Index,
    pool: &str,
    spec: &'a QueueSpec,
    batch: &'a Batch,
) -> Vec<&'a str> {
    let queue = spec.queue.as_str();
    let mut classes: Vec<&str> = spec.quotas.iter().map(|q| q.class.as_str()).collect();
    if let Some(q) = index.queues(pool) {
        classes.extend(q.usage.classes(queue));
    }
    classes.extend(batch.added.classes(queue));
    // A class is usually in all three: weigh it once.
    classes.sort_unstable();
    classes.dedup();
    classes
}

/// Per class `spec`'s queue holds, has quota of or has held (with the
/// batch's placements): the class, its nominal quota, and what the queue
/// holds beyond it over the GPUs its share is measured against.
fn overs<'a>(
    index: &'a Index,
    pool: &str,
    queues: &BTreeMap<String, QueueSpec>,
    spec: &'a QueueSpec,
    batch: &'a Batch,
) -> Vec<(&'a str, u64, f64, u64)> {
    let queue = spec.queue.as_str();
    classes(index, pool, spec, batch)
        .into_iter()
        .map(|c| {
            let nominal = spec.quota(c).map_or(0, |q| q.nominal) as u64;
            let capacity = capacity(queues, spec, c);
            let over =
                (held(index, pool, queue, c, batch) as f64 - nominal as f64) / capacity as f64;
            (c, nominal, over, capacity)
        })
        .collect()
}

/// A queue's weighted dominant share: the largest, over the classes it
/// holds or has quota of (with the batch's placements), of what it holds
/// beyond its nominal quota over what its cohort is given, divided by its
/// weight; below its nominal quota, how far below (unweighted and below
/// zero, so a queue short of its guarantee is served before any that
/// borrows; [`turn`] serves those short in turn, whatever the shortfall).
pub fn dominant_share(index: &Index, pool: &str, queue: &str, batch: &Batch) -> f64 {
    let Some(queues) = index.pool(pool).map(|p| &p.queues) else {
        return 0.0;
    };
    let Some(spec) = queues.get(queue) else {
        return 0.0;
    };
    let weight = spec.weight.max(1) as f64;
    classes(index, pool, spec, batch)
        .into_iter()
        .map(|c| {
            let nominal = spec.quota(c).map_or(0, |q| q.nominal) as f64;
            let over = (held(index, pool, queue, c, batch) as f64 - nominal)
                / capacity(queues, spec, c) as f64;
            if over > 0.0 {
                over / weight
            } else {
                over
            }
        })
        .fold(f64::NEG_INFINITY, f64::max)
        .max(-1.0)
}

/// What a queue's turn weighs besides what it holds, which does not change
/// while one batch is planned: whether it spent a soft budget, and the
/// half-life of its past where its cohort remembers it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Standing {
    pub over_soft: bool,
    pub half_life_ms: Option<u64>,
}

/// `queue`'s [`Standing`] at `at_ms`.
pub fn standing(index: &Index, pool: &str, queue: &str, at_ms: u64) -> Standing {
    let (half_life, remembers) = index.half_life(pool, queue);
    Standing {
        over_soft: crate::budget::over_soft(index, pool, queue, at_ms),
        half_life_ms: remembers.then_some(half_life),
    }
}

/// Where a queue stands in a batch's turns: the queue with the smallest
/// turn is served next. A queue past a soft budget comes after every queue
/// within its budgets; among either, first every queue short of its nominal quota in
/// every class, in turn ([`dominant_share`] below zero,
/// history aside: a guarantee is owed whatever was used before); then the
/// queues that borrow, by weighted dominant share. In a cohort whose fair
/// share remembers (`cohort.decay_set`), a borrowing queue's share counts,
/// per class, what it held on average beyond its quota in the past
/// (decayed to `at_ms`) as if it held that now too, so a queue that used
/// more yields to one that used less.
pub fn turn(index: &Index, pool: &str, queue: &str, batch: &Batch, at_ms: u64) -> Turn {
    turn_with(
        index,
        pool,
        queue,
        batch,
        at_ms,
        standing(index, pool, queue, at_ms),
    )
}

/// [`turn`] with the queue's [`Standing`] known (a batch looks it up once
/// per queue).
pub fn turn_with(
    index: &Index,
    pool: &str,
    queue: &str,
    batch: &Batch,
    at_ms: u64,
    standing: Standing,
) -> Turn {
    let share = dominant_share(index, pool, queue, batch);
    let over_soft = standing.over_soft;
    let (Some(queues), true, Some(half_life)) = (
        index.pool(pool).map(|p| &p.queues),
        share >= 0.0,
        standing.half_life_ms,
    ) else {
        return Turn {
            over_soft,
            borrows: share >= 0.0,
            share,
        };
    };
    let spec = &queues[queue];
    let weight = spec.weight.max(1) as f64;
    let mut classes = overs(index, pool, queues, spec, batch);
    // A class it only held in the past: no quota of it, holding none.
    let past = index.pool(pool).and_then(|p| p.past.get(queue));
    for c in past.into_iter().flat_map(|p| p.keys()) {
        if !classes.iter().any(|(k, ..)| *k == c.as_str()) {
            classes.push((c, 0, 0.0, capacity(queues, spec, c)));
        }
    }
    let share = classes
        .into_iter()
        .map(|(c, nominal, over, capacity)| {
            let past = index.past_usage(pool, queue, c, at_ms).average(half_life);
            (over + (past - nominal as f64) / capacity as f64) / weight
        })
        .fold(f64::NEG_INFINITY, f64::max);
    Turn {
        over_soft,
        borrows: true,
        share,
    }
}

/// A queue's place in a batch's turns ([`turn`]): smaller is served first.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Turn {
    /// Whether it spent a soft budget (such queues are served after every
    /// queue within its budgets).
    pub over_soft: bool,
    /// Whether it holds its nominal quota of some class (those that do not
    /// are served first).
    pub borrows: bool,
    /// Its share: how far short while it does not borrow, its weighted
    /// dominant share (with its past, where its cohort remembers) when it
    /// does.
    pub share: f64,
}

impl Turn {
    /// As an integer key that orders the same (shares to a billionth).
    pub fn key(self) -> (bool, bool, i64) {
        // Short of their quota, queues take turns by name (their shares
        // below zero tie): a guarantee is owed whatever the shortfall.
        let share = if self.borrows { self.share } else { 0.0 };
        (self.over_soft, self.borrows, (share * 1e9) as i64)
    }
}

/// One queue's standing in one class.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Share {
    pub queue: String,
    pub cohort: Option<String>,
    pub weight: u32,
    pub class: String,
    pub nominal: u64,
    pub borrowing_limit: Option<u32>,
    /// GPUs its live reservations hold.
    pub used: u64,
    /// GPUs its waiting requests ask for.
    pub waiting: u64,
    /// What it would hold if the cohort's quota were shared fairly: its
    /// nominal quota, or what it wants if that is less, plus a share by
    /// weight of what the cohort's other queues leave unused (weighted
    /// max-min fairness by water filling, each getting at most what it
    /// wants beyond its quota, within its borrowing limit). Without a
    /// cohort, its nominal quota or what it wants, whichever is less.
    /// Where the cohort remembers past usage, the share by weight counts
    /// what each queue held beyond its quota in the past as already given
    /// ([`turn`]'s rule): its effective fair share.
    pub fair: u64,
    /// The half-life its past usage decays with where its cohort's fair
    /// share remembers it (`cohort.decay_set`); `None`: only what it holds
    /// now counts.
    pub half_life_ms: Option<u64>,
    /// GPUs it held on average in the recent past, each moment weighted by
    /// the decay (with the default half-life while its cohort's is off).
    pub past_gpus: f64,
    /// Its decayed past usage, in GPU-hours.
    pub past_gpu_hours: f64,
}

/// Every queue of the pool, per class it has quota of or uses, with its
/// fair share and its past usage decayed to `at_ms`. Sorted by queue, then
/// class.
pub fn fair_shares(index: &Index, pool: &str, at_ms: u64) -> Vec<Share> {
    let Some(p) = index.pool(pool) else {
        return Vec::new();
    };
    let queues = &p.queues;
    // What each queue's waiting requests ask for, per class.
    let mut waiting: HashMap<(&str, &str), u64> = HashMap::new();
    if let Some(q) = index.queues(pool) {
        for k in q.pending.iter().chain(&q.queued) {
            if let Some(r) = index.reservation(&k.2) {
                if let Some(name) = r.request.queue.as_deref() {
                    *waiting.entry((name, r.request.class.as_str())).or_default() +=
                        r.request.gpus as u64;
                }
            }
        }
    }
    let mut out: Vec<Share> = Vec::new();
    for spec in queues.values() {
        let mut classes: Vec<String> = spec.quotas.iter().map(|q| q.class.clone()).collect();
        if let Some(q) = index.queues(pool) {
            for class in q.usage.classes(&spec.queue) {
                if !classes.iter().any(|c| c == class) {
                    classes.push(class.to_string());
                }
            }
        }
        for ((name, class), _) in waiting.iter() {
            if *name == spec.queue && !classes.iter().any(|c| c == class) {
                classes.push(class.to_string());
            }
        }
        let (half_life, remembers) = index.half_life(pool, &spec.queue);
        for class in classes {
            let quota = spec.quota(&class);
            let past = index.past_usage(pool, &spec.queue, &class, at_ms);
            out.push(Share {
                queue: spec.queue.clone(),
                cohort: spec.cohort.clone(),
                weight: spec.weight,
                nominal: quota.map_or(0, |q| q.nominal) as u64,
                borrowing_limit: quota.and_then(|q| q.borrowing_limit),
                used: index
                    .queues(pool)
                    .map_or(0, |q| q.used(&spec.queue, &class)),
                waiting: waiting
                    .get(&(spec.queue.as_str(), class.as_str()))
                    .copied()
                    .unwrap_or(0),
                fair: 0,
                half_life_ms: remembers.then_some(half_life),
                past_gpus: past.average(half_life),
                past_gpu_hours: past.gpu_ms / 3_600_000.0,
                class,
            });
        }
    }
    // Water filling per (cohort, class); a queue without a cohort is its
    // own.
    let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
    for (i, s) in out.iter().enumerate() {
        let group = s.cohort.clone().unwrap_or_else(|| format!("\0{}", s.queue));
        groups.entry((group, s.class.clone())).or_default().push(i);
    }
    for members in groups.values() {
        // Each is guaranteed its nominal quota (what it wants of it); what
        // the others leave unused is shared by weight among those that want
        // more, each within its borrowing limit.
        let want = |s: &Share| s.used + s.waiting;
        let mut unused: u64 = 0;
        for &i in members {
            let s = &mut out[i];
            s.fair = want(s).min(s.nominal);
            unused += s.nominal - s.fair;
        }
        let more = |s: &Share| {
            let beyond = want(s).saturating_sub(s.nominal);
            match (&s.cohort, s.borrowing_limit) {
                (None, _) => 0,
                (Some(_), Some(b)) => beyond.min(b as u64),
                (Some(_), None) => beyond,
            }
        };
        // Where the cohort remembers, what a queue held beyond its quota
        // in the past counts as given already.
        let had = |s: &Share| match s.half_life_ms {
            Some(_) => s.past_gpus - s.nominal as f64,
            None => 0.0,
        };
        let fills = water_fill_after(
            unused,
            &members
                .iter()
                .map(|&i| (out[i].weight as u64, more(&out[i]), had(&out[i])))
                .collect::<Vec<_>>(),
        );
        for (&i, fill) in members.iter().zip(fills) {
            out[i].fair += fill;
        }
    }
    out.sort_by(|a, b| (&a.queue, &a.class).cmp(&(&b.queue, &b.class)));
    out
}

/// Divides `capacity` among claimants `(weight, most it takes)` by
/// weighted max-min fairness: everyone gets `level * weight` or what it
/// takes, whichever is less, with `level` as high as the capacity allows.
/// Whole GPUs: what the rounding leaves goes one each to the heaviest
/// claimants still short, so the fills sum to `min(capacity, sum of most)`.
pub fn water_fill(capacity: u64, claims: &[(u64, u64)]) -> Vec<u64> {
    let claims: Vec<(u64, u64, f64)> = claims.iter().map(|&(w, m)| (w, m, 0.0)).collect();
    water_fill_after(capacity, &claims)
}

/// [`water_fill`] among claimants `(weight, most, had)` that count as
/// having had `had` already (negative: owed): each gets `level * weight -
/// had`, within `0..=most`.
pub fn water_fill_after(capacity: u64, claims: &[(u64, u64, f64)]) -> Vec<u64> {
    let mut fill = vec![0u64; claims.len()];
    let open: Vec<usize> = (0..claims.len())
        .filter(|&i| claims[i].0 > 0 && claims[i].1 > 0)
        .collect();
    let target = capacity.min(open.iter().map(|&i| claims[i].1).sum());
    if target == 0 {
        return fill;
    }
    let given = |level: f64, i: usize| {
        let (w, most, had) = claims[i];
        (level * w as f64 - had).clamp(0.0, most as f64)
    };
    let sum = |level: f64| open.iter().map(|&i| given(level, i)).sum::<f64>();
    // The sum is linear between the levels where a claimant starts or is
    // full: find the piece where it reaches the target, and solve it.
    let mut points: Vec<f64> = open
        .iter()
        .flat_map(|&i| {
            let (w, most, had) = claims[i];
            [had / w as f64, (had + most as f64) / w as f64]
        })
        .collect();
    points.sort_by(f64::total_cmp);
    let (mut below, mut level) = (points[0], points[points.len() - 1]);
    for &p in &points {
        let at = sum(p);
        if at >= target as f64 {
            let from = sum(below);
            if at > from {
                level = below + (p - below) * (target as f64 - from) / (at - from);
            } else {
                level = p;
            }
            break;
        }
        below = p;
    }
    for &i in &open {
        // A hair above, so a share computed as 29.999999 is 30.
        fill[i] = ((given(level, i) + 1e-6).floor() as u64).min(claims[i].1);
    }
    let mut left = target.saturating_sub(fill.iter().sum());
    let mut heaviest = open.clone();
    heaviest.sort_by_key(|&i| (std::cmp::Reverse(claims[i].0), i));
    while left > 0 {
        let before = left;
        for &i in &heaviest {
            if left > 0 && fill[i] < claims[i].1 {
                fill[i] += 1;
                left -= 1;
            }
        }
        if left == before {
            break;
        }
    }
    fill
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn water_filling_gives_by_weight_and_never_more_than_wanted() {
        // Equal weights, everyone wants more: an even split.
        assert_eq!(
            water_fill(90, &[(1, 100), (1, 100), (1, 100)]),
            [30, 30, 30]
        );
        // One wants little: the rest is divided among the others.
        assert_eq!(water_fill(90, &[(1, 10), (1, 100), (1, 100)]), [10, 40, 40]);
        // Weight 2 gets twice as much.
        assert_eq!(water_fill(90, &[(2, 100), (1, 100)]), [60, 30]);
        // More capacity than wanted: everyone gets what it wants.
        assert_eq!(water_fill(100, &[(1, 5), (3, 7)]), [5, 7]);
        // Whole GPUs: the remainder goes to the heaviest.
        let f = water_fill(10, &[(1, 100), (1, 100), (1, 100)]);
        assert_eq!(f.iter().sum::<u64>(), 10);
        assert!(f.iter().all(|&x| (3..=4).contains(&x)), "{f:?}");
        assert_eq!(water_fill(0, &[(1, 5)]), [0]);
        assert_eq!(water_fill(5, &[(1, 0), (1, 9)]), [0, 5]);
        // Every GPU is given, however the weights divide it.
        assert_eq!(water_fill(13, &[(3, 100), (2, 100)]), [8, 5]);
    }

    #[test]
    fn what_a_claimant_had_counts_as_given() {
        // Equal weights; the first had 20 beyond its quota: the others
        // catch up before it gets more.
        assert_eq!(
            water_fill_after(60, &[(1, 100, 20.0), (1, 100, 0.0), (1, 100, 0.0)]),
            [7, 27, 26]
        );
        assert_eq!(
            water_fill_after(30, &[(1, 100, 20.0), (1, 100, 0.0)]),
            [5, 25]
        );
        // Owed (had less than its quota): it gets more.
        assert_eq!(
            water_fill_after(30, &[(1, 100, -10.0), (1, 100, 0.0)]),
            [20, 10]
        );
        // So far behind that it takes everything, within what it wants.
        assert_eq!(water_fill_after(10, &[(1, 100, 50.0), (1, 6, 0.0)]), [4, 6]);
        assert_eq!(
            water_fill_after(10, &[(1, 100, 50.0), (1, 100, 0.0)]),
            [0, 10]
        );
    }
}
