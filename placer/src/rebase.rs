//! A batch whose commit met its pool's stream moved only by reports about
//! other nodes is committed again on top of them, instead of being planned
//! again.
//!
//! The pool's version fences every batch: the plan saw every event of the
//! pool's stream up to the version it expects. Gateways and operators also
//! write to that stream (a node's health, contact, inventory, cordon), and
//! under load they write several times a second. A batch whose planning and
//! commit take longer than the gap between two of their writes is refused,
//! planned again once the index has caught up, and refused again: a pool
//! taken over with a backlog (a large batch) could go unplaced for as long
//! as the reports kept coming.
//!
//! On a conflict on the pool's stream, the events that moved it are read
//! from the table. The batch is committed again, expecting the new version,
//! when every one of them is a fact about one node ([`NODE_FACTS`]) that the
//! batch does not name (no placement, promise or answer to a fault on it),
//! and the batch rejects nothing (a node that joined could have made a
//! rejected request fit). Such a fact changes nothing the batch decided: the
//! same batch planned a moment later, with the fact in view, would decide
//! the same for the nodes it names. Anything else (a placement by another
//! placer, a pool's or queue's setting, a fact about a node the batch uses)
//! is planned again as before. The fence itself is unchanged: each commit
//! expects the exact version it was checked against.

use events::db::{SharedClient, Sql};
use events::{AppendError, Appended, Appender, ExpectedVersion, StreamAppend};
use std::collections::BTreeSet;

/// Facts about one node, written by gateways and operators, that commute
/// with a batch that does not name their node.
pub(crate) const NODE_FACTS: [&str; 13] = [
    "node.joined",
    "node.inventory_reported",
    "node.left",
    "node.contact_lost",
    "node.contact_restored",
    "node.cordoned",
    "node.maintenance_scheduled",
    "node.uncordoned",
    "node.topology_set",
    "node.drained",
    "health.raised",
    "health.cleared",
    "node.acceptance_reported",
];

/// Most times one batch is committed again on top of others' reports
/// before it is planned again instead.
const MOST: u32 = 16;

/// What a batch names: the nodes of its pool stream's events (every `node`
/// anywhere in their payloads: placements' and promises' allocations, the
/// answers to faults), and whether it rejects a request.
#[derive(Debug, Default)]
pub(crate) struct Footprint {
    nodes: BTreeSet<String>,
    rejects: bool,
}

impl Footprint {
    pub(crate) fn of(append: &StreamAppend) -> Footprint {
        let mut f = Footprint::default();
        for e in &append.events {
            if domain::canonical_type(&e.event_type) == "reservation.rejected" {
                f.rejects = true;
            }
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(e.payload.get()) {
                nodes_in(&v, &mut f.nodes);
            }
        }
        f
    }

    /// Whether an event of type `event_type` about `node` leaves the batch
    /// as it was decided.
    pub(crate) fn commutes(&self, event_type: &str, node: Option<&str>) -> bool {
        !self.rejects
            && NODE_FACTS.contains(&domain::canonical_type(event_type))
            && node.is_some_and(|n| !self.nodes.contains(n))
    }
}

fn nodes_in(v: &serde_json::Value, out: &mut BTreeSet<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("node", serde_json::Value::String(n)) => {
                        out.insert(n.clone());
                    }
                    _ => nodes_in(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| nodes_in(v, out)),
        _ => {}
    }
}

/// Commits `appends` (the pool's stream first, expecting an exact
/// version), committing them again on top of others' reports as the
/// module says; `rebased` counts how often.
pub(crate) async fn commit(
    appender: &Appender,
    reads: &SharedClient,
    mut appends: Vec<StreamAppend>,
    rebased: &std::sync::atomic::AtomicU64,
) -> Result<Vec<Appended>, AppendError> {
    let mut footprint: Option<Footprint> = None;
    let mut tries = 0;
    loop {
        let err = match appender.append_batch(appends.clone()).await {
            Ok(out) => return Ok(out),
            Err(e) => e,
        };
        let (from, actual) = match (&err, appends.first().map(|a| (&a.stream, a.expected))) {
            (
                AppendError::VersionConflict { stream, actual, .. },
                Some((pool, ExpectedVersion::Exact(from))),
            ) if stream == pool && *actual > from && tries < MOST => (from, *actual),
            _ => return Err(err),
        };
        let f = footprint.get_or_insert_with(|| Footprint::of(&appends[0]));
        if !moved_by_reports(reads, &appends[0].stream, from, actual, f).await {
            return Err(err);
        }
        appends[0].expected = ExpectedVersion::Exact(actual);
        tries += 1;
        rebased.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::debug!(stream = %appends[0].stream, from, actual, "pool moved by reports about other nodes; committing the batch on top of them");
    }
}

/// Whether every event of `stream` with `from < version <= to` is a report
/// the batch commutes with (all of them read; a read that fails says no).
async fn moved_by_reports(
    reads: &SharedClient,
    stream: &str,
    from: u64,
    to: u64,
    f: &Footprint,
) -> bool {
    let Ok(client) = reads.get().await else {
        return false;
    };
    let rows = client
        .rows(
            "SELECT type, payload->>'node' FROM strata.events
              WHERE stream = $1 AND version > $2 AND version <= $3",
            &[&stream, &(from as i64), &(to as i64)],
        )
        .await;
    match rows {
        Ok(rows) => {
            rows.len() as u64 == to - from
                && rows.iter().all(|r| {
                    f.commutes(
                        &r.get::<_, String>(0),
                        r.get::<_, Option<String>>(1).as_deref(),
                    )
                })
        }
        Err(_) => {
            reads.reset().await;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use domain::Fact;

    fn batch(facts: &[Fact]) -> StreamAppend {
        StreamAppend {
            stream: "pool/p".into(),
            expected: ExpectedVersion::Exact(3),
            events: facts.iter().map(Fact::to_event).collect(),
        }
    }

    #[test]
    fn every_node_fact_is_a_type_the_log_knows() {
        for t in NODE_FACTS {
            assert!(domain::FACT_TYPES.contains(&t), "{t} is no fact's type");
        }
    }

    #[test]
    fn reports_about_nodes_the_batch_does_not_name_commute_and_nothing_else() {
        let placed = Fact::ReservationPlaced {
            reservation: "r1".into(),
            allocations: vec![domain::Allocation {
                node: "n1".into(),
                devices: vec!["gpu0".into()],
            }],
        };
        let f = Footprint::of(&batch(std::slice::from_ref(&placed)));
        assert!(f.commutes("health.raised", Some("n2")));
        assert!(f.commutes("node.joined", Some("n3")));
        assert!(
            !f.commutes("health.raised", Some("n1")),
            "a report about a node it places on"
        );
        assert!(!f.commutes("node.cordoned", Some("n1")));
        assert!(
            !f.commutes("reservation.placed", Some("n2")),
            "another placer's placement"
        );
        assert!(!f.commutes("queue.configured", None));
        assert!(
            !f.commutes("node.joined", None),
            "a node fact that names no node"
        );
        let rejected = Fact::ReservationRejected {
            reservation: "r2".into(),
            reason: "too big".into(),
        };
        let f = Footprint::of(&batch(&[placed, rejected]));
        assert!(
            !f.commutes("node.joined", Some("n3")),
            "a batch that rejects"
        );
    }
}
