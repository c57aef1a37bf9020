//! Each queue's usage over time, sampled from the index every
//! [`EVERY`] for the queues page's charts: GPUs used, its fair share and
//! GPUs waiting, summed over classes. The last [`KEEP`] samples are kept
//! (an hour); older history is the usage reports' job.

use projections::Index;
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

pub const EVERY: Duration = Duration::from_secs(10);
pub const KEEP: usize = 360;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub at_ms: u64,
    pub used: u64,
    pub fair: u64,
    pub waiting: u64,
}

/// Samples per (pool, queue).
#[derive(Default)]
pub struct Samples {
    series: BTreeMap<(String, String), VecDeque<Sample>>,
}

impl Samples {
    /// Takes one sample of every queue of every pool.
    pub fn take(&mut self, index: &Index, at_ms: u64) {
        for pool in index.state().pools.keys() {
            let mut per_queue: BTreeMap<String, Sample> = BTreeMap::new();
            for s in projections::quota::fair_shares(index, pool, at_ms) {
                let e = per_queue.entry(s.queue).or_insert(Sample {
                    at_ms,
                    used: 0,
                    fair: 0,
                    waiting: 0,
                });
                e.used += s.used;
                e.fair += s.fair;
                e.waiting += s.waiting;
            }
            for (queue, sample) in per_queue {
                let series = self.series.entry((pool.clone(), queue)).or_default();
                if series.len() == KEEP {
                    series.pop_front();
                }
                series.push_back(sample);
            }
        }
    }

    /// The samples of one queue, oldest first.
    pub fn of(&self, pool: &str, queue: &str) -> Vec<Sample> {
        self.series
            .get(&(pool.to_string(), queue.to_string()))
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }
}
