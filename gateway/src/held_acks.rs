//! The acks a gateway holds for their commands' outcomes (see the acks
//! module for why): which command, whose node, since when.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The acks a gateway holds: command id -> (node, when the ack came).
#[derive(Default)]
pub(crate) struct HeldAcks(Mutex<HashMap<String, (String, Instant)>>);

impl HeldAcks {
    /// Holds `node`'s ack of command `id`, unless one is held already (a
    /// command pushed again is acked again; the first ack's time counts).
    pub(crate) fn hold(&self, id: &str, node: &str, at: Instant) {
        self.0
            .lock()
            .expect("acks lock")
            .entry(id.to_string())
            .or_insert_with(|| (node.to_string(), at));
    }

    /// Lets go of the ack of command `id`: its outcome came.
    pub(crate) fn settle(&self, id: &str) {
        self.0.lock().expect("acks lock").remove(id);
    }

    /// Takes the acks held `hold` or longer by `now`: (id, node).
    pub(crate) fn due(&self, now: Instant, hold: Duration) -> Vec<(String, String)> {
        let mut due = Vec::new();
        self.0.lock().expect("acks lock").retain(|id, (node, at)| {
            let keep = now.saturating_duration_since(*at) < hold;
            if !keep {
                due.push((id.clone(), std::mem::take(node)));
            }
            keep
        });
        due
    }

    /// How many acks are held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().expect("acks lock").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_is_due_after_the_hold_and_taken_once() {
        let acks = HeldAcks::default();
        let t0 = Instant::now();
        let hold = Duration::from_secs(2);
        acks.hold("c1", "n1", t0);
        acks.hold("c2", "n1", t0 + Duration::from_secs(1));
        // Acked again: the first ack's time counts.
        acks.hold("c1", "n1", t0 + Duration::from_secs(1));
        assert!(acks.due(t0 + Duration::from_millis(1999), hold).is_empty());
        assert_eq!(
            acks.due(t0 + hold, hold),
            [("c1".to_string(), "n1".to_string())]
        );
        assert!(acks.due(t0 + hold, hold).is_empty(), "taken once");
        acks.settle("c2");
        assert_eq!(acks.len(), 0);
        assert!(acks.due(t0 + Duration::from_secs(10), hold).is_empty());
    }
}
