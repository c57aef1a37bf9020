//! A placer's counters, and how they appear on `/metrics` (summed over
//! the placers of the process).

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of a running placer.
#[derive(Debug, Default)]
pub struct Stats {
    pub batches: AtomicU64,
    /// Batches planned, committed or not (a batch that changes nothing
    /// writes nothing).
    pub planned: AtomicU64,
    pub placed: AtomicU64,
    pub queued: AtomicU64,
    pub rejected: AtomicU64,
    pub released: AtomicU64,
    pub expired: AtomicU64,
    /// Reservations ended because a node of theirs left or was lost.
    pub failed: AtomicU64,
    /// Live reservations told to make room for a waiting request.
    pub preempting: AtomicU64,
    /// Reservations preempted once their grace period ended.
    pub preempted: AtomicU64,
    /// GPUs quarantined for a fault.
    pub quarantined: AtomicU64,
    /// Nodes drained for a fault.
    pub drained_for_faults: AtomicU64,
    /// Faults reported but not acted on (advisory policy, circuit breaker).
    pub quarantine_withheld: AtomicU64,
    /// Quarantined GPUs restored after their condition went and a
    /// diagnostic passed.
    pub restored: AtomicU64,
    /// Batches refused because the pool stream moved (replanned).
    pub conflicts: AtomicU64,
    /// Commits made again on top of reports about other nodes that had
    /// moved the pool stream (not replanned; `rebase.rs`).
    pub rebased: AtomicU64,
    /// Batches that failed otherwise (retried).
    pub errors: AtomicU64,
    pub pools_held: AtomicU64,
    /// The index's applied position.
    pub position: AtomicU64,
    /// Leases taken over or lost.
    pub leases_acquired: AtomicU64,
    pub leases_lost: AtomicU64,
}

/// A plain copy of [`Stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsView {
    pub batches: u64,
    pub planned: u64,
    pub placed: u64,
    pub queued: u64,
    pub rejected: u64,
    pub released: u64,
    pub expired: u64,
    pub failed: u64,
    pub preempting: u64,
    pub preempted: u64,
    pub quarantined: u64,
    pub drained_for_faults: u64,
    pub quarantine_withheld: u64,
    pub restored: u64,
    pub conflicts: u64,
    pub rebased: u64,
    pub errors: u64,
    pub pools_held: u64,
    pub position: u64,
    pub leases_acquired: u64,
    pub leases_lost: u64,
}

impl Stats {
    pub fn view(&self) -> StatsView {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsView {
            batches: l(&self.batches),
            planned: l(&self.planned),
            placed: l(&self.placed),
            queued: l(&self.queued),
            rejected: l(&self.rejected),
            released: l(&self.released),
            expired: l(&self.expired),
            failed: l(&self.failed),
            preempting: l(&self.preempting),
            preempted: l(&self.preempted),
            quarantined: l(&self.quarantined),
            drained_for_faults: l(&self.drained_for_faults),
            quarantine_withheld: l(&self.quarantine_withheld),
            restored: l(&self.restored),
            conflicts: l(&self.conflicts),
            rebased: l(&self.rebased),
            errors: l(&self.errors),
            pools_held: l(&self.pools_held),
            position: l(&self.position),
            leases_acquired: l(&self.leases_acquired),
            leases_lost: l(&self.leases_lost),
        }
    }
}

use ops::metrics::{Field, Instances};

/// The placers' counters on `/metrics`, summed over the placers of the
/// process.
static FIELDS: &[Field<Stats>] = &[
    ops::stat_field!(
        Stats,
        "strata_placer_batches_total",
        Counter,
        "Batches committed.",
        batches
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_planned_total",
        Counter,
        "Batches planned, committed or not.",
        planned
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_placed_total",
        Counter,
        "Reservations placed.",
        placed
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_queued_total",
        Counter,
        "Reservations queued for capacity.",
        queued
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_rejected_total",
        Counter,
        "Reservations that can never fit.",
        rejected
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_released_total",
        Counter,
        "Reservations released.",
        released
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_expired_total",
        Counter,
        "Reservations expired.",
        expired
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_failed_total",
        Counter,
        "Reservations ended because a node of theirs left, was revoked, was lost or drained, or a GPU of theirs was quarantined.",
        failed
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_preempting_total",
        Counter,
        "Live reservations told to make room for a waiting request (reservation.preemption_scheduled).",
        preempting
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_preempted_total",
        Counter,
        "Reservations preempted once their grace period ended.",
        preempted
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_quarantined_total",
        Counter,
        "GPUs quarantined for a fault (device.quarantined).",
        quarantined
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_drained_for_faults_total",
        Counter,
        "Nodes drained for a fault (node.drained with its fault).",
        drained_for_faults
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_quarantine_withheld_total",
        Counter,
        "Faults reported but not acted on: the pool's policy is advisory or its circuit breaker is open (device.quarantine_withheld).",
        quarantine_withheld
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_restored_total",
        Counter,
        "Quarantined GPUs restored by the placer: their condition went and a diagnostic passed (device.restored).",
        restored
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_conflicts_total",
        Counter,
        "Batches refused by the pool version fence and replanned.",
        conflicts
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_rebased_total",
        Counter,
        "Commits made again on top of reports about nodes the batch does not name, which had moved the pool stream: not replanned.",
        rebased
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_errors_total",
        Counter,
        "Batches that failed otherwise and were retried.",
        errors
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_leases_acquired_total",
        Counter,
        "Pool leases taken.",
        leases_acquired
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_leases_lost_total",
        Counter,
        "Pool leases lost to another placer or to expiry.",
        leases_lost
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_pools_held",
        Gauge,
        "Pools whose lease this process's placer holds.",
        pools_held
    ),
    ops::stat_field!(
        Stats,
        "strata_placer_position",
        Gauge,
        "Position of the log the placer's index has applied.",
        position
    ),
];

pub(crate) fn placers() -> &'static Instances<Stats> {
    static P: std::sync::OnceLock<Instances<Stats>> = std::sync::OnceLock::new();
    P.get_or_init(|| Instances::new(FIELDS))
}
