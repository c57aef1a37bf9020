//! Failed password logins slow down further tries, per auditor name and per
//! source address: after a few free failures each one locks the key out for
//! twice as long as the last (up to a cap), and a login tried while locked
//! out is refused without its password being checked, however many
//! connections the guesser opens at once. Tries refused that way do not
//! lengthen the lockout, so the auditor whose name is guessed at gets in
//! once the cap has passed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures without a lockout.
pub const FREE_FAILURES: u32 = 5;
/// The first lockout; each further failure doubles it.
pub const FIRST_LOCKOUT: Duration = Duration::from_millis(250);
/// The longest lockout.
pub const MAX_LOCKOUT: Duration = Duration::from_secs(30);
/// A key without a failure this long starts again from nothing.
const FORGET_AFTER: Duration = Duration::from_secs(15 * 60);
/// Keys kept at most (older ones are forgotten first).
const MAX_KEYS: usize = 100_000;

#[derive(Debug, Clone, Copy)]
struct Entry {
    failures: u32,
    last_failure: Instant,
    until: Instant,
}

/// The failures of each auditor name and source address.
#[derive(Default)]
pub struct Throttle {
    keys: Mutex<HashMap<Key, Entry>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Auditor(String),
    Source(IpAddr),
}

fn keys(auditor: &str, source: IpAddr) -> [Key; 2] {
    [Key::Auditor(auditor.to_string()), Key::Source(source)]
}

impl Throttle {
    /// How long `auditor` from `source` must still wait before a login is
    /// tried; `None` when it may be tried now.
    pub fn locked(&self, auditor: &str, source: IpAddr, now: Instant) -> Option<Duration> {
        let map = self.keys.lock().expect("throttle lock");
        keys(auditor, source)
            .iter()
            .filter_map(|k| map.get(k))
            .filter(|e| e.until > now)
            .map(|e| e.until - now)
            .max()
    }

    /// A wrong password (or an unknown or revoked auditor).
    pub fn failed(&self, auditor: &str, source: IpAddr, now: Instant) {
        let mut map = self.keys.lock().expect("throttle lock");
        if map.len() >= MAX_KEYS {
            map.retain(|_, e| now.duration_since(e.last_failure) < FORGET_AFTER);
            if map.len() >= MAX_KEYS {
                // Still full: forget the half that failed longest ago.
                let mut ages: Vec<Instant> = map.values().map(|e| e.last_failure).collect();
                ages.sort_unstable();
                let cut = ages[ages.len() / 2];
                map.retain(|_, e| e.last_failure > cut);
            }
        }
        for k in keys(auditor, source) {
            let e = map.entry(k).or_insert(Entry {
                failures: 0,
                last_failure: now,
                until: now,
            });
            if now.duration_since(e.last_failure) >= FORGET_AFTER {
                e.failures = 0;
            }
            e.failures += 1;
            e.last_failure = now;
            if e.failures > FREE_FAILURES {
                let doublings = (e.failures - FREE_FAILURES - 1).min(16);
                e.until = now + (FIRST_LOCKOUT * 2u32.pow(doublings)).min(MAX_LOCKOUT);
            }
        }
    }

    /// A login succeeded: the auditor's and the source's failures are forgotten.
    pub fn succeeded(&self, auditor: &str, source: IpAddr) {
        let mut map = self.keys.lock().expect("throttle lock");
        for k in keys(auditor, source) {
            map.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn failures_past_the_free_ones_lock_out_for_twice_as_long_each_time_up_to_the_cap() {
        let t = Throttle::default();
        let now = Instant::now();
        for _ in 0..FREE_FAILURES {
            t.failed("ann", A, now);
        }
        assert_eq!(t.locked("ann", A, now), None);
        t.failed("ann", A, now);
        assert_eq!(t.locked("ann", A, now), Some(FIRST_LOCKOUT));
        t.failed("ann", A, now);
        assert_eq!(t.locked("ann", A, now), Some(FIRST_LOCKOUT * 2));
        for _ in 0..40 {
            t.failed("ann", A, now);
        }
        assert_eq!(t.locked("ann", A, now), Some(MAX_LOCKOUT));
        assert_eq!(t.locked("ann", A, now + MAX_LOCKOUT), None);
    }

    #[test]
    fn a_locked_out_source_is_locked_for_every_name_and_a_locked_name_from_every_source() {
        let t = Throttle::default();
        let now = Instant::now();
        for i in 0..=FREE_FAILURES {
            t.failed(&format!("guess{i}"), A, now);
        }
        assert!(t.locked("bob", A, now).is_some(), "the source is locked");
        assert!(t.locked("bob", B, now).is_none());
        for _ in 0..=FREE_FAILURES {
            t.failed("carl", B, now);
        }
        assert!(t.locked("carl", B, now).is_some());
        t.succeeded("carl", B);
        assert!(t.locked("carl", B, now).is_none());
    }
}
