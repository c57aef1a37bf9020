//! What a join must pass before it costs a transaction and a signature, in
//! order: its address must not have tried too many bad tokens just before
//! (each bad one spends from the address's own bucket, so one address
//! flooding cannot slow another, and a fleet joining from behind one
//! address is not held up by good joins), a cheap check that its token is
//! one the region issued (the hashes found issued are held in memory; one
//! not among them is looked up with the other misses of the moment, in one
//! indexed query every [`LOOKUP_EVERY`] at most, so a token made a moment
//! ago is found at once and a flood of bad ones costs a few small queries a
//! second), the token's
//! own bucket, and then the gateway's bucket for joins, which only tokens
//! the region issued spend. The database still decides whether the token
//! is good (`identity::redeem`).

use crate::bucket::Buckets;
use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;
use tokio::sync::oneshot;

/// How long a lookup of the hashes missing from memory waits after the one
/// before, at least: a token made a moment ago is found within about this,
/// and a flood of bad ones costs one indexed query per interval.
pub(crate) const LOOKUP_EVERY: Duration = Duration::from_millis(50);

/// Hashes looked up in one query, at most.
pub(crate) const LOOKUP_BATCH: usize = 512;

/// Checks waiting for a lookup, at most; one more is refused at once.
pub(crate) const MAX_WAITING: usize = 4096;

/// What a waiting check is answered: whether its hash is a token the
/// region issued, or why the lookup failed.
pub(crate) type Answer = Result<bool, String>;

/// The hashes of the region's join tokens found so far (each with the
/// time, in seconds since the epoch, until which it counts as known), and
/// the checks of hashes not among them, waiting for the next lookup.
#[derive(Default)]
pub(crate) struct KnownTokens {
    issued: HashMap<Vec<u8>, f64>,
    waiting: Vec<(Vec<u8>, oneshot::Sender<Answer>)>,
    looking: bool,
    /// Which run of the lookups is (or was last) under way.
    run: u64,
}

/// A check that missed: its answer, and whether its caller must start the
/// lookups (none is running).
pub(crate) struct Miss {
    pub(crate) answer: oneshot::Receiver<Answer>,
    pub(crate) start_lookups: bool,
    /// The run of the lookups that answers it.
    pub(crate) run: u64,
}

impl KnownTokens {
    pub(crate) fn contains(&self, hash: &[u8], now: f64) -> bool {
        self.issued.get(hash).is_some_and(|until| *until > now)
    }

    /// Queues a check of `hash` for the next lookup; `None` when too many
    /// wait already.
    pub(crate) fn wait_for(&mut self, hash: Vec<u8>) -> Option<Miss> {
        if self.waiting.len() >= MAX_WAITING {
            return None;
        }
        let (tx, answer) = oneshot::channel();
        self.waiting.push((hash, tx));
        let start_lookups = !self.looking;
        if start_lookups {
            self.run += 1;
        }
        self.looking = true;
        Some(Miss {
            answer,
            start_lookups,
            run: self.run,
        })
    }

    /// The next checks to look up, at most [`LOOKUP_BATCH`], oldest first;
    /// none means the lookups stop (the next miss starts them again).
    pub(crate) fn next_batch(&mut self) -> Vec<(Vec<u8>, oneshot::Sender<Answer>)> {
        let n = self.waiting.len().min(LOOKUP_BATCH);
        if n == 0 {
            self.looking = false;
        }
        self.waiting.drain(..n).collect()
    }

    /// The task of lookup run `run` ended: if that run had not stopped by
    /// itself (it found none waiting), its waiting checks are dropped
    /// (their callers see the lookup gone) and the next miss starts a run
    /// again. A run that stopped by itself, or a newer run, is left alone.
    pub(crate) fn lookups_ended(&mut self, run: u64) {
        if self.looking && self.run == run {
            self.waiting.clear();
            self.looking = false;
        }
    }

    /// Remembers the hashes a lookup found, and forgets those past their
    /// time.
    pub(crate) fn learn(&mut self, found: impl IntoIterator<Item = (Vec<u8>, f64)>, now: f64) {
        self.issued.retain(|_, until| *until > now);
        self.issued.extend(found);
    }
}

/// The per-address and per-token buckets of a gateway's joins.
#[derive(Default)]
pub(crate) struct JoinLimits {
    /// Bad tokens tried, per address.
    pub(crate) bad_per_source: Buckets<IpAddr>,
    pub(crate) per_token: Buckets<Vec<u8>>,
    pub(crate) known: std::sync::Mutex<KnownTokens>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_wait_in_batches_and_the_lookups_stop_when_none_wait() {
        let mut k = KnownTokens::default();
        let first = k.wait_for(vec![1]).unwrap();
        assert!(first.start_lookups);
        // While lookups run, a miss only waits for them.
        assert!(!k.wait_for(vec![2]).unwrap().start_lookups);
        for i in 0..LOOKUP_BATCH {
            k.wait_for(vec![3, i as u8]).unwrap();
        }
        let batch = k.next_batch();
        assert_eq!(batch.len(), LOOKUP_BATCH);
        assert_eq!(batch[0].0, vec![1]);
        assert_eq!(k.next_batch().len(), 2);
        // None waits: the lookups stop, and the next miss starts them.
        assert!(k.next_batch().is_empty());
        assert!(k.wait_for(vec![4]).unwrap().start_lookups);
    }

    #[test]
    fn a_full_queue_refuses_and_an_ended_lookup_lets_the_next_miss_start_one() {
        let mut k = KnownTokens::default();
        let mut answers = Vec::new();
        for _ in 0..MAX_WAITING {
            answers.push(k.wait_for(vec![9]).unwrap().answer);
        }
        assert!(k.wait_for(vec![9]).is_none());
        k.lookups_ended(1);
        assert!(answers[0].try_recv().is_err());
        assert!(k.wait_for(vec![9]).unwrap().start_lookups);
    }

    #[test]
    fn a_run_that_stopped_by_itself_does_not_drop_the_next_runs_checks() {
        let mut k = KnownTokens::default();
        let first = k.wait_for(vec![1]).unwrap();
        assert_eq!(k.next_batch().len(), 1);
        // None waits: the first run stops, and a miss starts the next one
        // before the first run's task is gone.
        assert!(k.next_batch().is_empty());
        let second = k.wait_for(vec![2]).unwrap();
        assert!(second.start_lookups && second.run != first.run);
        k.lookups_ended(first.run);
        let mut answer = second.answer;
        assert!(
            matches!(answer.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "the next run's check was dropped"
        );
        assert_eq!(k.next_batch().len(), 1);
    }

    #[test]
    fn found_hashes_count_until_their_time() {
        let mut k = KnownTokens::default();
        k.learn([(vec![1], 100.0), (vec![2], 50.0)], 10.0);
        assert!(k.contains(&[1], 60.0) && !k.contains(&[2], 60.0) && !k.contains(&[3], 0.0));
        k.learn([], 60.0);
        assert_eq!(k.issued.len(), 1);
    }
}
