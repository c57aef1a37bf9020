//! GPUs counted per queue and class: what each queue's live reservations
//! hold, what it has being preempted, and a planned batch's changes to
//! them. Looked up by `&str` without building an owned key or comparing
//! every entry: these lookups run several times for every request a
//! multi-tenant batch plans.

use crate::hashing::FastMap;

/// `queue -> class -> GPUs`; a count that reaches 0 is dropped, so two
/// tallies of the same counts are equal.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally(FastMap<String, FastMap<String, u64>>);

impl Tally {
    /// GPUs of `class` counted for `queue` (0 if none).
    pub fn get(&self, queue: &str, class: &str) -> u64 {
        self.0
            .get(queue)
            .and_then(|c| c.get(class))
            .copied()
            .unwrap_or(0)
    }

    /// Adds `n` GPUs of `class` to `queue`'s count.
    pub fn add(&mut self, queue: &str, class: &str, n: u64) {
        let classes = match self.0.get_mut(queue) {
            Some(c) => c,
            None => self.0.entry(queue.to_string()).or_default(),
        };
        match classes.get_mut(class) {
            Some(c) => *c += n,
            None => {
                classes.insert(class.to_string(), n);
            }
        }
    }

    /// Takes `n` GPUs of `class` from `queue`'s count (not below 0).
    pub fn sub(&mut self, queue: &str, class: &str, n: u64) {
        let Some(classes) = self.0.get_mut(queue) else {
            return;
        };
        if let Some(c) = classes.get_mut(class) {
            *c = c.saturating_sub(n);
            if *c == 0 {
                classes.remove(class);
                if classes.is_empty() {
                    self.0.remove(queue);
                }
            }
        }
    }

    /// [`Tally::add`] or [`Tally::sub`].
    pub fn change(&mut self, queue: &str, class: &str, n: u64, add: bool) {
        if add {
            self.add(queue, class, n);
        } else {
            self.sub(queue, class, n);
        }
    }

    /// The classes `queue` has a count of.
    pub fn classes<'a>(&'a self, queue: &str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .get(queue)
            .into_iter()
            .flat_map(|c| c.keys().map(String::as_str))
    }

    /// Every count: (queue, class, GPUs).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, u64)> {
        self.0.iter().flat_map(|(q, c)| {
            c.iter()
                .map(move |(class, n)| (q.as_str(), class.as_str(), *n))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_kept_per_queue_and_class_and_dropped_at_zero() {
        let mut t = Tally::default();
        t.add("a", "H100", 8);
        t.add("a", "L40S", 2);
        t.add("b", "H100", 1);
        t.change("a", "H100", 3, false);
        assert_eq!(t.get("a", "H100"), 5);
        assert_eq!(t.get("a", "A100"), 0);
        assert_eq!(t.get("c", "H100"), 0);
        let mut classes: Vec<_> = t.classes("a").collect();
        classes.sort();
        assert_eq!(classes, ["H100", "L40S"]);
        t.sub("a", "L40S", 5);
        t.sub("a", "H100", 5);
        t.sub("b", "H100", 1);
        assert_eq!(t, Tally::default(), "counts at 0 leave nothing behind");
        assert_eq!(t.iter().count(), 0);
    }
}
