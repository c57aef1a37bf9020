//! The projections `strata replay run` rebuilds: the pool index, and two
//! operator views folded from the same facts, one row per node and one per
//! reservation (terminal ones included, which the index forgets).

use crate::index::{ApplyError, Index, Violation};
use domain::Fact;
use events::Event;
use std::collections::{BTreeMap, BTreeSet};

/// State folded from events strictly in position order.
pub trait Projection: Send + 'static {
    /// Applies one event whose fact was parsed with [`Fact::parse`]; an
    /// event at or below the applied position is skipped, a gap is an error.
    fn apply_parsed(
        &mut self,
        event: &Event,
        parsed: Parsed,
    ) -> Result<Option<Violation>, ApplyError>;

    fn apply(&mut self, event: &Event) -> Result<Option<Violation>, ApplyError> {
        let parsed = Fact::parse(&event.event_type, &event.payload, &event.metadata);
        self.apply_parsed(event, parsed)
    }

    fn position(&self) -> u64;
}

/// An event's fact, parsed ([`Fact::parse`]).
pub type Parsed = Result<Option<Fact>, String>;

impl Projection for Index {
    fn apply_parsed(
        &mut self,
        event: &Event,
        parsed: Parsed,
    ) -> Result<Option<Violation>, ApplyError> {
        Index::apply_parsed(self, event, parsed)
    }

    fn position(&self) -> u64 {
        Index::position(self)
    }
}

fn step(position: &mut u64, event: &Event) -> Result<bool, ApplyError> {
    let p = event.position.0;
    if p <= *position {
        return Ok(false);
    }
    // A view may start anywhere (its first event); after that, no gaps.
    if *position != 0 && !event.position.follows(events::Position(*position)) {
        return Err(ApplyError::Gap {
            applied: *position,
            got: p,
            missing_from: *position + 1,
            missing_to: p - 1,
        });
    }
    *position = p;
    Ok(true)
}

fn violation(event: &Event, parsed: Parsed) -> Result<Option<Fact>, Violation> {
    parsed.map_err(|message| Violation {
        position: event.position.0,
        stream: event.stream.clone(),
        event_type: event.event_type.clone(),
        message,
    })
}

/// One node as the log tells it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct NodeRow {
    pub pool: String,
    pub devices: u32,
    pub classes: BTreeSet<String>,
    pub cordoned: bool,
    pub drained: bool,
    pub left: bool,
    /// Out of contact with the region (`node.contact_lost` in force).
    pub unreachable: bool,
    /// Open health conditions, as `condition` or `device:condition`.
    pub conditions: BTreeSet<String>,
    pub last_position: u64,
}

/// Every node that ever joined a pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodesView {
    pub position: u64,
    pub nodes: BTreeMap<String, NodeRow>,
}

impl Projection for NodesView {
    fn apply_parsed(
        &mut self,
        event: &Event,
        parsed: Parsed,
    ) -> Result<Option<Violation>, ApplyError> {
        if !step(&mut self.position, event)? {
            return Ok(None);
        }
        let Some(pool) = event.stream.strip_prefix("pool/") else {
            return Ok(None);
        };
        let fact = match violation(event, parsed) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(None),
            Err(v) => return Ok(Some(v)),
        };
        let p = event.position.0;
        let mut touch = |node: &str| {
            let r = self.nodes.entry(node.to_string()).or_default();
            r.pool = pool.to_string();
            r.last_position = p;
        };
        match &fact {
            Fact::NodeJoined { node, .. }
            | Fact::NodeInventoryReported { node, .. }
            | Fact::NodeLeft { node, .. }
            | Fact::NodeContactLost { node }
            | Fact::NodeContactRestored { node }
            | Fact::NodeCordoned { node, .. }
            | Fact::NodeUncordoned { node }
            | Fact::NodeDrained { node, .. }
            | Fact::HealthRaised { node, .. }
            | Fact::HealthCleared { node, .. } => touch(node),
            _ => return Ok(None),
        }
        match fact {
            Fact::NodeJoined { node, devices } | Fact::NodeInventoryReported { node, devices } => {
                let r = self.nodes.get_mut(&node).expect("touched");
                r.devices = devices.len() as u32;
                r.classes = devices.into_iter().map(|d| d.class).collect();
                r.left = false;
            }
            Fact::NodeLeft { node, .. } => self.nodes.get_mut(&node).expect("touched").left = true,
            Fact::NodeContactLost { node } => {
                self.nodes.get_mut(&node).expect("touched").unreachable = true
            }
            Fact::NodeContactRestored { node } => {
                self.nodes.get_mut(&node).expect("touched").unreachable = false
            }
            Fact::NodeCordoned { node, .. } => {
                self.nodes.get_mut(&node).expect("touched").cordoned = true
            }
            Fact::NodeUncordoned { node } => {
                let r = self.nodes.get_mut(&node).expect("touched");
                r.cordoned = false;
                r.drained = false;
            }
            Fact::NodeDrained { node, .. } => {
                self.nodes.get_mut(&node).expect("touched").drained = true
            }
            Fact::HealthRaised {
                node,
                device,
                condition,
                ..
            } => {
                let key = condition_key(device.as_deref(), &condition);
                self.nodes
                    .get_mut(&node)
                    .expect("touched")
                    .conditions
                    .insert(key);
            }
            Fact::HealthCleared {
                node,
                device,
                condition,
            } => {
                let key = condition_key(device.as_deref(), &condition);
                self.nodes
                    .get_mut(&node)
                    .expect("touched")
                    .conditions
                    .remove(&key);
            }
            _ => {}
        }
        Ok(None)
    }

    fn position(&self) -> u64 {
        self.position
    }
}

fn condition_key(device: Option<&str>, condition: &str) -> String {
    match device {
        Some(d) => format!("{d}:{condition}"),
        None => condition.to_string(),
    }
}

/// Where a reservation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationState {
    Requested,
    Queued,
    Placed,
    Active,
    Releasing,
    Released,
    Expired,
    Rejected,
    /// Ended because a node it was on left or was lost.
    Failed,
    /// Ended to make room for another request.
    Preempted,
}

/// One reservation as the log tells it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReservationRow {
    pub pool: String,
    pub class: String,
    pub gpus: u32,
    pub state: ReservationState,
    pub nodes: Vec<String>,
    pub requested_at: u64,
    pub last_position: u64,
}

/// Every reservation ever requested, terminal ones included.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReservationsView {
    pub position: u64,
    pub reservations: BTreeMap<String, ReservationRow>,
}

impl ReservationsView {
    /// Reservations by state.
    pub fn counts(&self) -> BTreeMap<ReservationState, u64> {
        let mut m = BTreeMap::new();
        for r in self.reservations.values() {
            *m.entry(r.state).or_insert(0) += 1;
        }
        m
    }
}

impl Projection for ReservationsView {
    fn apply_parsed(
        &mut self,
        event: &Event,
        parsed: Parsed,
    ) -> Result<Option<Violation>, ApplyError> {
        if !step(&mut self.position, event)? {
            return Ok(None);
        }
        let fact = match violation(event, parsed) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(None),
            Err(v) => return Ok(Some(v)),
        };
        let p = event.position.0;
        if let Fact::ReservationRequested(r) = &fact {
            self.reservations
                .entry(r.reservation.clone())
                .or_insert_with(|| ReservationRow {
                    pool: r.pool.clone(),
                    class: r.class.clone(),
                    gpus: r.gpus,
                    state: ReservationState::Requested,
                    nodes: Vec::new(),
                    requested_at: p,
                    last_position: p,
                });
            return Ok(None);
        }
        let Some(id) = fact.reservation() else {
            return Ok(None);
        };
        let Some(row) = self.reservations.get_mut(id) else {
            // Its request is before the replayed window.
            return Ok(None);
        };
        row.last_position = p;
        row.state = match fact {
            Fact::ReservationQueued { .. } => ReservationState::Queued,
            Fact::ReservationPlaced { allocations, .. } => {
                row.nodes = allocations.into_iter().map(|a| a.node).collect();
                ReservationState::Placed
            }
            Fact::ReservationActivated { .. } => ReservationState::Active,
            Fact::ReservationReleaseRequested { .. } if row.state < ReservationState::Released => {
                ReservationState::Releasing
            }
            Fact::ReservationReleased { .. } => ReservationState::Released,
            Fact::ReservationExpired { .. } => ReservationState::Expired,
            Fact::ReservationRejected { .. } => ReservationState::Rejected,
            Fact::ReservationFailed { .. } => ReservationState::Failed,
            Fact::ReservationPreempted { .. } => ReservationState::Preempted,
            _ => row.state,
        };
        Ok(None)
    }

    fn position(&self) -> u64 {
        self.position
    }
}
