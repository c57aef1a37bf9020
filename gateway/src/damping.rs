//! Health reports of one node's session, coalesced and damped before they
//! reach the pool's stream (whose version every placement commits against):
//! a raise of a condition already raised is dropped, and so is a clear of
//! one already cleared; a raise is never delayed (it keeps work off a bad
//! GPU); a clear that follows recent clears of the same condition is held
//! back for a hold-down that doubles with every flap (0.5 s, 1 s, 2 s ... up
//! to 30 s, forgotten after a minute of calm), and a raise during the
//! hold-down cancels it. A node toggling a condition every 100 ms then
//! writes a handful of events, not ten a second.
//!
//! Pure: the caller passes the time and writes what it is told to.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// (device, condition); the device is empty for the whole node.
pub type Key = (String, String);

const FIRST_HOLD: Duration = Duration::from_millis(500);
const MAX_HOLD: Duration = Duration::from_secs(30);
/// Flaps further apart than this are forgotten.
const CALM: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    Raised,
    Cleared,
}

/// What to do with a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Write it now.
    Write,
    /// Nothing changes: drop it.
    Drop,
    /// A clear held back until then (written by [`Damper::due`]).
    Held(Instant),
}

#[derive(Debug, Default)]
pub struct Damper {
    written: HashMap<Key, Written>,
    /// Clears held back, and when they are due.
    pending: HashMap<Key, Instant>,
    /// Per condition: clears written recently, and the last one's time.
    flaps: HashMap<Key, (u32, Instant)>,
}

impl Damper {
    pub fn raise(&mut self, key: Key) -> Verdict {
        let pending = self.pending.remove(&key).is_some();
        if pending || self.written.get(&key) == Some(&Written::Raised) {
            // Still raised in the log (its clear was held back): nothing new.
            return Verdict::Drop;
        }
        self.written.insert(key, Written::Raised);
        Verdict::Write
    }

    pub fn clear(&mut self, key: Key, now: Instant) -> Verdict {
        match self.written.get(&key) {
            Some(Written::Cleared) => return Verdict::Drop,
            // Raised before this session: the log may hold it.
            None => {
                self.written.insert(key.clone(), Written::Cleared);
                self.count_flap(key, now);
                return Verdict::Write;
            }
            Some(Written::Raised) => {}
        }
        if self.pending.contains_key(&key) {
            return Verdict::Drop;
        }
        let recent = match self.flaps.get(&key) {
            Some((n, last)) if now.duration_since(*last) < CALM => *n,
            _ => 0,
        };
        if recent == 0 {
            self.written.insert(key.clone(), Written::Cleared);
            self.count_flap(key, now);
            return Verdict::Write;
        }
        let hold = FIRST_HOLD
            .saturating_mul(1 << (recent - 1).min(10))
            .min(MAX_HOLD);
        let at = now + hold;
        self.pending.insert(key, at);
        Verdict::Held(at)
    }

    /// Clears whose hold-down is over: write them now.
    pub fn due(&mut self, now: Instant) -> Vec<Key> {
        let due: Vec<Key> = self
            .pending
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &due {
            self.pending.remove(key);
            self.written.insert(key.clone(), Written::Cleared);
            self.count_flap(key.clone(), now);
        }
        due
    }

    /// Every clear still held back (the session is going away: write them,
    /// so no condition stays raised in the log for nothing).
    pub fn drain_pending(&mut self) -> Vec<Key> {
        let keys: Vec<Key> = self.pending.drain().map(|(k, _)| k).collect();
        for key in &keys {
            self.written.insert(key.clone(), Written::Cleared);
        }
        keys
    }

    fn count_flap(&mut self, key: Key, now: Instant) {
        let e = self.flaps.entry(key).or_insert((0, now));
        if now.duration_since(e.1) >= CALM {
            e.0 = 0;
        }
        e.0 += 1;
        e.1 = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        ("GPU-1".into(), "XID-79".into())
    }

    #[test]
    fn repeated_reports_are_dropped_and_a_flapping_condition_writes_a_handful() {
        let mut d = Damper::default();
        let t0 = Instant::now();
        assert_eq!(d.raise(key()), Verdict::Write);
        assert_eq!(d.raise(key()), Verdict::Drop);
        assert_eq!(d.clear(key(), t0), Verdict::Write);
        assert_eq!(d.clear(key(), t0), Verdict::Drop);
        // Toggling every 100 ms for 10 s.
        let mut written = 0;
        for i in 1..=100u32 {
            let now = t0 + Duration::from_millis(100 * u64::from(i));
            written += d.due(now).len();
            let v = if i % 2 == 1 {
                d.raise(key())
            } else {
                d.clear(key(), now)
            };
            written += usize::from(v == Verdict::Write);
        }
        assert!(written <= 2, "{written} writes for 100 flaps");
        // It calms down raised-then-cleared: the held clear is written.
        let later = t0 + Duration::from_secs(60);
        assert_eq!(d.due(later), vec![key()]);
        assert_eq!(d.raise(key()), Verdict::Write);
    }

    #[test]
    fn a_raise_is_never_held_and_a_pending_clear_is_written_when_the_session_ends() {
        let mut d = Damper::default();
        let t0 = Instant::now();
        d.raise(key());
        d.clear(key(), t0);
        d.raise(key());
        let held = d.clear(key(), t0 + Duration::from_millis(10));
        assert!(matches!(held, Verdict::Held(_)), "{held:?}");
        // Another condition is independent.
        let other: Key = (String::new(), "ECC-uncorrected".into());
        assert_eq!(d.raise(other.clone()), Verdict::Write);
        assert_eq!(d.drain_pending(), vec![key()]);
        // A clear for something this session never saw raised goes through
        // (the log may hold it from an earlier session).
        let old: Key = ("GPU-7".into(), "XID-48".into());
        assert_eq!(d.clear(old, t0), Verdict::Write);
    }
}
