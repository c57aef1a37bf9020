//! GPU time a queue booked in the current UTC day, ISO week and month.
//!
//! The index keeps one [`Spent`] per queue and carries it forward, like past
//! usage ([`crate::decay`]), only when what the queue holds changes: to the
//! recorded time of the placement or ending, in whole GPU-milliseconds, so a
//! replay holds the same figures. A period that began since the last carry
//! counts only the time since it began. Budgets judge requests by it.

use domain::BudgetPeriod;

/// GPU time booked in one period.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct Window {
    /// When the period began (Unix ms).
    pub start_ms: i64,
    pub gpu_ms: u64,
}

/// A queue's GPU time in the periods holding `at_ms`: day, week, month.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct Spent {
    pub at_ms: u64,
    pub windows: [Window; 3],
}

impl Spent {
    /// Carried to `at_ms`, `held` GPUs having been booked since
    /// `self.at_ms` (an earlier `at_ms` leaves it as it is).
    pub fn carried(self, at_ms: u64, held: u64) -> Spent {
        if at_ms <= self.at_ms {
            return self;
        }
        let mut out = self;
        out.at_ms = at_ms;
        // Within the same day, no period began (weeks and months begin on
        // days): the common case, without calendar arithmetic.
        if self.windows[0].start_ms == BudgetPeriod::Day.start(at_ms as i64) {
            for w in &mut out.windows {
                w.gpu_ms += held * (at_ms - self.at_ms);
            }
            return out;
        }
        for (i, period) in BudgetPeriod::ALL.into_iter().enumerate() {
            let start = period.start(at_ms as i64);
            let w = &mut out.windows[i];
            if w.start_ms == start {
                w.gpu_ms += held * (at_ms - self.at_ms);
            } else {
                // A new period: only the time since it began.
                let since = (at_ms as i64 - start.max(self.at_ms as i64)).max(0) as u64;
                *w = Window {
                    start_ms: start,
                    gpu_ms: held * since,
                };
            }
        }
        out
    }

    /// GPU-milliseconds in `period` as of `self.at_ms`.
    pub fn of(&self, period: BudgetPeriod) -> u64 {
        let i = BudgetPeriod::ALL
            .iter()
            .position(|p| *p == period)
            .expect("every period has a window");
        self.windows[i].gpu_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use domain::calendar::{days_from_civil, DAY_MS, HOUR_MS};

    #[test]
    fn time_is_counted_in_each_period_and_starts_again_when_one_begins() {
        // Sunday 2026-12-06 22:00 UTC; the week began Monday the 30th.
        let t0 = (days_from_civil(2026, 12, 6) * DAY_MS + 22 * HOUR_MS) as u64;
        let s = Spent::default().carried(t0, 0);
        let s = s.carried(t0 + HOUR_MS as u64, 4);
        for p in BudgetPeriod::ALL {
            assert_eq!(s.of(p), 4 * HOUR_MS as u64, "{p:?}");
        }
        // Four more hours, across midnight into Monday 03:00: a new day
        // and a new week (three hours of them), the same month.
        let s = s.carried(t0 + 5 * HOUR_MS as u64, 4);
        assert_eq!(s.of(BudgetPeriod::Day), 12 * HOUR_MS as u64);
        assert_eq!(s.of(BudgetPeriod::Week), 12 * HOUR_MS as u64);
        assert_eq!(s.of(BudgetPeriod::Month), 20 * HOUR_MS as u64);
        // Time stepping back changes nothing.
        assert_eq!(s.carried(t0, 100), s);
    }
}
