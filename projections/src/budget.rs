//! Budgets: what a queue's budgets make of a request, from the GPU time
//! it booked in the current UTC day, ISO week and month ([`Spent`], which
//! the index keeps).
//!
//! A budget is judged by the placer as it plans (a request is admitted or
//! not at the batch's moment); the index does not judge placements by it
//! again, since what was spent grows by the millisecond between the plan and
//! its commit.

use crate::index::Index;
use domain::{Enforce, Request};

/// What a queue's budgets make of a request now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Within every budget (or none).
    Within,
    /// Past a soft budget: served after the queues within theirs.
    Soft,
    /// Past a hard one: it waits, or is rejected, for this reason.
    Over(Enforce, String),
}

/// Whether `queue` is past a soft budget at `at_ms`.
pub fn over_soft(index: &Index, pool: &str, queue: &str, at_ms: u64) -> bool {
    let Some(spec) = index.pool(pool).and_then(|p| p.queues.get(queue)) else {
        return false;
    };
    if !spec.budgets.iter().any(|b| b.enforce == Enforce::Soft) {
        return false;
    }
    let spent = index.spent(pool, queue, at_ms);
    spec.budgets
        .iter()
        .any(|b| b.enforce == Enforce::Soft && spent.of(b.period) >= b.gpu_seconds * 1000)
}

/// What `request`'s queue's budgets make of it at `at_ms`. A hard budget
/// refuses it once spent, or when its own GPUs for its time to live would
/// take the queue past it.
pub fn judge(index: &Index, pool: &str, request: &Request, at_ms: u64) -> Verdict {
    let Some(queue) = request.queue.as_deref() else {
        return Verdict::Within;
    };
    let Some(spec) = index.pool(pool).and_then(|p| p.queues.get(queue)) else {
        return Verdict::Within;
    };
    if spec.budgets.is_empty() {
        return Verdict::Within;
    }
    let spent = index.spent(pool, queue, at_ms);
    let mut verdict = Verdict::Within;
    for b in &spec.budgets {
        let (used, budget) = (spent.of(b.period), b.gpu_seconds * 1000);
        let wants = request.ttl_ms.map_or(0, |t| t * request.gpus as u64);
        if used < budget && (b.enforce == Enforce::Soft || used + wants <= budget) {
            continue;
        }
        if b.enforce == Enforce::Soft {
            verdict = Verdict::Soft;
            continue;
        }
        let renews = b.period.next(at_ms as i64);
        let why = format!(
            "over budget: queue {queue} booked {} of its {} GPU-hours this {}{}; it renews at {}",
            hours(used),
            hours(budget),
            b.period.name(),
            if used < budget {
                format!(
                    ", and {} GPUs for {} would take it past",
                    request.gpus,
                    humantime::format_duration(std::time::Duration::from_millis(
                        wants / request.gpus.max(1) as u64
                    ))
                )
            } else {
                String::new()
            },
            humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(renews.max(0) as u64)
            )
        );
        return Verdict::Over(b.enforce, why);
    }
    verdict
}

/// GPU-milliseconds as GPU-hours in words.
pub fn hours(gpu_ms: u64) -> String {
    let h = gpu_ms as f64 / 3_600_000.0;
    if h >= 100.0 {
        format!("{h:.0}")
    } else if h >= 1.0 {
        format!("{h:.1}")
    } else {
        format!("{h:.3}")
    }
}
