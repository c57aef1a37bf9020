//! Token buckets: one (new sessions, joins, a session's messages), and one
//! per key (joins per address and per token).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Instant;

pub(crate) struct Bucket {
    pub(crate) tokens: f64,
    pub(crate) last: Instant,
}

impl Bucket {
    /// Adds what `rate` per second gave since the last call, up to `burst`.
    pub(crate) fn refill(&mut self, rate: f64, burst: f64) {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * rate).min(burst);
        self.last = now;
    }

    /// Takes one token if there is one, refilling at `rate` per second up
    /// to `burst`.
    pub(crate) fn take(&mut self, rate: f64, burst: f64) -> bool {
        self.refill(rate, burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Keys kept per bucket map; past it, full (long idle) buckets are dropped.
const MAX_KEYS: usize = 50_000;

/// A token bucket per key.
pub(crate) struct Buckets<K> {
    map: Mutex<HashMap<K, Bucket>>,
}

impl<K: Hash + Eq + Clone> Default for Buckets<K> {
    fn default() -> Self {
        Buckets {
            map: Mutex::default(),
        }
    }
}

impl<K: Hash + Eq + Clone> Buckets<K> {
    /// Takes a token from `key`'s bucket (refilled at `rate` a second up to
    /// `burst`), a new key's bucket starting full.
    pub(crate) fn take(&self, key: &K, rate: f64, burst: f64) -> bool {
        self.with(key, rate, burst, |b| b.take(rate, burst))
    }

    /// Whether `key`'s bucket holds a token now (none is taken).
    pub(crate) fn holds(&self, key: &K, rate: f64, burst: f64) -> bool {
        self.with(key, rate, burst, |b| {
            b.refill(rate, burst);
            b.tokens >= 1.0
        })
    }

    fn with(&self, key: &K, rate: f64, burst: f64, f: impl FnOnce(&mut Bucket) -> bool) -> bool {
        let mut map = self.map.lock().expect("buckets lock");
        if map.len() >= MAX_KEYS && !map.contains_key(key) {
            let now = Instant::now();
            // A bucket that would be full again is the same as none.
            map.retain(|_, b| b.tokens + now.duration_since(b.last).as_secs_f64() * rate < burst);
            if map.len() >= MAX_KEYS {
                return false;
            }
        }
        f(map.entry(key.clone()).or_insert(Bucket {
            tokens: burst,
            last: Instant::now(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_has_its_own_bucket() {
        let b = Buckets::<u32>::default();
        assert!(b.take(&1, 1.0, 2.0));
        assert!(b.take(&1, 1.0, 2.0));
        assert!(!b.take(&1, 1.0, 2.0), "the burst is spent");
        assert!(!b.holds(&1, 1.0, 2.0));
        assert!(
            b.holds(&2, 1.0, 2.0) && b.holds(&2, 1.0, 2.0),
            "holds takes nothing"
        );
        assert!(b.take(&2, 1.0, 2.0), "another key is not held up");
    }
}
