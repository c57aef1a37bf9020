//! At most one warning a period for something that may happen many times
//! at once: a database outage makes every write in flight retry, and one
//! warning per try buried the log in copies of the same line. The first
//! occurrence is warned about at once; the rest of the period's are
//! counted and handed to the next warning, so none goes unsaid.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A warning allowed once every `period`.
#[derive(Debug)]
pub struct WarnEvery {
    period: Duration,
    /// When the last warning was allowed, and the occurrences held back
    /// since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl WarnEvery {
    pub const fn new(period: Duration) -> WarnEvery {
        WarnEvery {
            period,
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts one occurrence at `now`: `Some(n)` when it is to be warned
    /// about, `n` being how many were held back since the last warning;
    /// `None` when it is held back.
    pub fn at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().expect("warn-every lock");
        let (last, held) = &mut *s;
        if last.is_some_and(|l| now.saturating_duration_since(l) < self.period) {
            *held += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(held))
    }

    /// [`WarnEvery::at`] now.
    pub fn now(&self) -> Option<u64> {
        self.at(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_warned_about_once_and_the_rest_counted_into_the_next() {
        let w = WarnEvery::new(Duration::from_secs(10));
        let t = Instant::now();
        assert_eq!(w.at(t), Some(0), "the first is warned about at once");
        let held = (1..=35)
            .map(|i| w.at(t + Duration::from_millis(200 * i)))
            .filter(Option::is_none)
            .count();
        assert_eq!(held, 35, "the rest of the period's are held back");
        assert_eq!(
            w.at(t + Duration::from_secs(10)),
            Some(35),
            "the next warning says how many were held back"
        );
        assert_eq!(w.at(t + Duration::from_secs(21)), Some(0));
    }
}
