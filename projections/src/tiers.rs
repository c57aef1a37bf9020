//! Nodes grouped by a topology tier (their rack, or their block), for one
//! device class of one pool: which rack has `n` nodes with `g` free GPUs
//! each is a range lookup, never a scan of the racks.
//!
//! Per tier value (a rack's name) its nodes are bucketed by free count, as
//! the class index buckets the pool's. Per GPU count `g` up to
//! [`MAX_PER_NODE`], each value's count of nodes with at least `g` free is
//! kept, and the values are bucketed by that count. A node's change of free
//! count from `a` to `b` moves it in its value's buckets and touches the
//! counts of `g` between `a` and `b` only.

use crate::hashing::FastMap;
use std::collections::{BTreeMap, BTreeSet};

/// The most GPUs per node a tier lookup indexes (larger asks scan).
pub const MAX_PER_NODE: u32 = 16;

#[derive(Debug, Default, Clone)]
pub struct TierIndex {
    /// Value -> its schedulable nodes with free GPUs, by free count.
    values: FastMap<String, BTreeMap<u32, BTreeSet<String>>>,
    /// `counts[g - 1]`: value -> its nodes with at least `g` free.
    counts: Vec<FastMap<String, u32>>,
    /// `by_count[g - 1]`: that count -> the values that have it.
    by_count: Vec<BTreeMap<u32, BTreeSet<String>>>,
}

impl PartialEq for TierIndex {
    /// Equal when they index the same nodes the same way (one that was
    /// never used and one that was emptied are equal).
    fn eq(&self, other: &TierIndex) -> bool {
        fn counts(t: &TierIndex) -> Vec<&FastMap<String, u32>> {
            t.counts.iter().filter(|m| !m.is_empty()).collect()
        }
        fn buckets(t: &TierIndex) -> Vec<&BTreeMap<u32, BTreeSet<String>>> {
            t.by_count.iter().filter(|m| !m.is_empty()).collect()
        }
        self.values == other.values
            && counts(self) == counts(other)
            && buckets(self) == buckets(other)
    }
}

impl TierIndex {
    /// Node `node` of tier value `value` now has `to` free GPUs, not `from`.
    pub fn update(&mut self, value: &str, node: &str, from: u32, to: u32) {
        if from == to {
            return;
        }
        if self.counts.is_empty() {
            self.counts = vec![FastMap::default(); MAX_PER_NODE as usize];
            self.by_count = vec![BTreeMap::new(); MAX_PER_NODE as usize];
        }
        let buckets = match self.values.get_mut(value) {
            Some(b) => b,
            None => self.values.entry(value.to_string()).or_default(),
        };
        // The names move from set to set: taken out of the old one and put
        // into the new one, allocated only when first seen.
        let mut moved = None;
        if from > 0 {
            if let Some(set) = buckets.get_mut(&from) {
                moved = set.take(node);
                if set.is_empty() {
                    buckets.remove(&from);
                }
            }
        }
        if to > 0 {
            buckets
                .entry(to)
                .or_default()
                .insert(moved.unwrap_or_else(|| node.to_string()));
        }
        if buckets.is_empty() {
            self.values.remove(value);
        }
        let (lo, hi, up) = if to > from {
            (from, to, true)
        } else {
            (to, from, false)
        };
        for g in lo + 1..=hi.min(MAX_PER_NODE) {
            let i = (g - 1) as usize;
            let before = self.counts[i].get(value).copied().unwrap_or(0);
            let after = if up {
                before + 1
            } else {
                before.saturating_sub(1)
            };
            let mut name = None;
            if before > 0 {
                if let Some(set) = self.by_count[i].get_mut(&before) {
                    name = set.take(value);
                    if set.is_empty() {
                        self.by_count[i].remove(&before);
                    }
                }
            }
            if after > 0 {
                match self.counts[i].get_mut(value) {
                    Some(c) => *c = after,
                    None => {
                        self.counts[i].insert(value.to_string(), after);
                    }
                }
                self.by_count[i]
                    .entry(after)
                    .or_default()
                    .insert(name.unwrap_or_else(|| value.to_string()));
            } else {
                self.counts[i].remove(value);
            }
        }
    }

    /// The value with the fewest nodes that still has `n` nodes with at
    /// least `g` free (best fit: fuller racks first, whole ones kept).
    pub fn best_fit(&self, n: u32, g: u32) -> Option<&str> {
        if g == 0 || g > MAX_PER_NODE {
            return self.values.iter().find_map(|(v, b)| {
                let enough: usize = b.range(g.max(1)..).map(|(_, s)| s.len()).sum();
                (enough >= n as usize).then_some(v.as_str())
            });
        }
        self.by_count
            .get((g - 1) as usize)?
            .range(n.max(1)..)
            .next()
            .and_then(|(_, values)| values.iter().next())
            .map(String::as_str)
    }

    /// Nodes of `value` with at least `g` free, fewest free first.
    pub fn nodes(&self, value: &str, g: u32) -> impl Iterator<Item = &str> {
        self.values
            .get(value)
            .into_iter()
            .flat_map(move |b| b.range(g.max(1)..))
            .flat_map(|(_, s)| s.iter().map(String::as_str))
    }

    /// Values with a node with at least `g` free, fullest first: one node
    /// from each spreads a gang.
    pub fn spread(&self, g: u32) -> impl Iterator<Item = &str> {
        let i = g.clamp(1, MAX_PER_NODE) as usize - 1;
        self.by_count
            .get(i)
            .into_iter()
            .flat_map(|b| b.values())
            .flatten()
            .map(String::as_str)
    }

    /// Whether any node has this tier's label.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn racks_with_enough_free_nodes_are_found_by_lookup_and_kept_in_step() {
        let mut t = TierIndex::default();
        // Rack a: two nodes with 8 free; rack b: four nodes with 8 free.
        for n in ["a1", "a2"] {
            t.update("a", n, 0, 8);
        }
        for n in ["b1", "b2", "b3", "b4"] {
            t.update("b", n, 0, 8);
        }
        assert_eq!(t.best_fit(2, 8), Some("a"), "the fuller rack first");
        assert_eq!(t.best_fit(3, 8), Some("b"));
        assert_eq!(t.best_fit(5, 8), None);
        // a1 is half booked: a has one node with 8 free, two with 4.
        t.update("a", "a1", 8, 4);
        assert_eq!(t.best_fit(2, 8), Some("b"));
        assert_eq!(t.best_fit(2, 4), Some("a"));
        assert_eq!(t.nodes("a", 8).collect::<Vec<_>>(), ["a2"]);
        assert_eq!(t.nodes("a", 4).collect::<Vec<_>>(), ["a1", "a2"]);
        // Spread: one rack each.
        assert_eq!(t.spread(8).count(), 2);
        for n in ["a1", "a2"] {
            let from = if n == "a1" { 4 } else { 8 };
            t.update("a", n, from, 0);
        }
        assert_eq!(t.spread(1).collect::<Vec<_>>(), ["b"]);
        let mut fresh = TierIndex::default();
        for n in ["b1", "b2", "b3", "b4"] {
            fresh.update("b", n, 0, 8);
        }
        assert_eq!(t.best_fit(4, 8), fresh.best_fit(4, 8));
        assert_eq!(t.values, fresh.values);
    }
}
