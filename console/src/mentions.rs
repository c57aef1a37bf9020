//! Which events name which reservation and which node, as positions, so a
//! reservation's or a node's timeline is one read of the table by primary
//! key instead of a scan of every pool's stream. Built from the events the
//! console folds; bounded (the oldest keys are forgotten first, and a key
//! keeps only its newest positions), so a timeline of something long gone
//! falls back to its own stream.

use events::Event;
use std::collections::{HashMap, VecDeque};

/// Most keys remembered.
pub const MAX_KEYS: usize = 200_000;
/// Most positions remembered per key.
pub const MAX_PER_KEY: usize = 2_000;

#[derive(Default)]
pub struct Mentions {
    positions: HashMap<String, Vec<u64>>,
    order: VecDeque<String>,
}

/// The key of a reservation's timeline.
pub fn reservation_key(id: &str) -> String {
    format!("r:{id}")
}

/// The key of a node's timeline.
pub fn node_key(node: &str) -> String {
    format!("n:{node}")
}

impl Mentions {
    pub fn of(&self, key: &str) -> Option<Vec<u64>> {
        self.positions.get(key).cloned()
    }

    /// Notes the reservations and nodes `e` names.
    pub fn note(&mut self, e: &Event) {
        for key in keys(e) {
            self.add(key, e.position.0);
        }
    }

    fn add(&mut self, key: String, position: u64) {
        match self.positions.get_mut(&key) {
            Some(list) => {
                if list.last() != Some(&position) {
                    if list.len() == MAX_PER_KEY {
                        list.remove(0);
                    }
                    list.push(position);
                }
            }
            None => {
                if self.order.len() == MAX_KEYS {
                    if let Some(old) = self.order.pop_front() {
                        self.positions.remove(&old);
                    }
                }
                self.order.push_back(key.clone());
                self.positions.insert(key, vec![position]);
            }
        }
    }
}

/// The keys an event names: its own stream's reservation, the reservations
/// and nodes in its payload (`reservation`, `replaces`, `node`, each
/// allocation's node, a command's `args.reservation`), and the reservation
/// in one of Strata's own command ids (`bind:<reservation>:<node>`).
pub fn keys(e: &Event) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(id) = e.stream.strip_prefix("reservation/") {
        out.push(reservation_key(id));
    }
    if let Some(id) = e.stream.strip_prefix("command/") {
        let mut parts = id.split(':');
        if let (Some("bind" | "release" | "rebind" | "preempting"), Some(r)) =
            (parts.next(), parts.next())
        {
            out.push(reservation_key(r));
        }
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&e.payload) else {
        return out;
    };
    let text =
        |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
    for k in ["reservation", "replaces"] {
        if let Some(r) = text(&v, k) {
            out.push(reservation_key(&r));
        }
    }
    if let Some(args) = v.get("args") {
        if let Some(r) = text(args, "reservation") {
            out.push(reservation_key(&r));
        }
    }
    if let Some(n) = text(&v, "node") {
        out.push(node_key(&n));
    }
    for field in ["allocations", "nodes"] {
        if let Some(list) = v.get(field).and_then(|a| a.as_array()) {
            for a in list {
                if let Some(n) = a.as_str().map(str::to_string).or_else(|| text(a, "node")) {
                    out.push(node_key(&n));
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use events::Position;

    fn event(position: u64, stream: &str, payload: &str) -> Event {
        Event {
            position: Position(position),
            stream: stream.into(),
            version: 1,
            event_type: "t".into(),
            payload: payload.into(),
            metadata: "{}".into(),
            recorded_at: std::time::SystemTime::now(),
            xid: 1,
        }
    }

    #[test]
    fn events_name_their_reservations_and_nodes() {
        let placed = event(
            1,
            "pool/p",
            r#"{"reservation":"r1","allocations":[{"node":"n1","devices":["gpu0"]},{"node":"n2","devices":[]}]}"#,
        );
        assert_eq!(keys(&placed), ["n:n1", "n:n2", "r:r1"]);
        let bind = event(
            2,
            "command/bind:r1:n1",
            r#"{"node":"n1","kind":"allocation.bind"}"#,
        );
        assert_eq!(keys(&bind), ["n:n1", "r:r1"]);
        assert_eq!(keys(&event(3, "reservation/r2", "not json")), ["r:r2"]);
        // An operator's command id that looks like nothing of Strata's.
        assert_eq!(keys(&event(4, "command/c1", r#"{"node":"n3"}"#)), ["n:n3"]);
    }

    #[test]
    fn it_forgets_the_oldest_and_keeps_the_newest() {
        let mut m = Mentions::default();
        for p in 0..(MAX_PER_KEY as u64 + 5) {
            m.note(&event(p + 1, "reservation/r1", "{}"));
        }
        let list = m.of("r:r1").unwrap();
        assert_eq!(list.len(), MAX_PER_KEY);
        assert_eq!(list.first(), Some(&6));
        for i in 0..MAX_KEYS {
            m.add(format!("k{i}"), 1);
        }
        assert!(m.of("r:r1").is_none(), "the oldest key went first");
        assert!(m.of(&format!("k{}", MAX_KEYS - 1)).is_some());
    }
}
