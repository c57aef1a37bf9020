//! An operator's say over a node's standing in its pool: cordon it (no new
//! placements), uncordon it (placements again, a drain lifted too), drain it
//! (no new placements, and its live reservations end: at once, or when a
//! wait runs out), take it out of the pool (leave), clear a health
//! condition the node no longer has, say where it is in the topology, and
//! book a maintenance window on it. Each
//! is one fact on the pool's stream, so the pool's version fences it like
//! any other change of what can be placed. The CLI and the client API both
//! come through here.

use crate::error::RequestError;
use crate::Fact;
use crate::{pool_stream, stored_types, valid_name};
use events::db::Sql;
use events::{Appender, ExpectedVersion};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_postgres::Client;

/// A change of a node's standing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Cordon {
        reason: String,
    },
    Uncordon,
    /// Live reservations on the node fail (`node_drained`) once `wait` has
    /// passed; at once without one.
    Drain {
        reason: String,
        wait: Option<Duration>,
    },
    /// The node leaves the pool: its capacity goes, and its live
    /// reservations fail (`node_left`). Joining again brings it back.
    Leave {
        reason: String,
    },
    /// Where the node is in the pool's topology (absent: cleared).
    Topology {
        rack: Option<String>,
        block: Option<String>,
        rail: Option<String>,
    },
    /// A maintenance window `[start_ms, end_ms)` (Unix ms): no placement
    /// lasts into it, and what would is ended at its start after a notice.
    Maintenance {
        start_ms: u64,
        end_ms: u64,
        reason: String,
    },
    /// A condition of the node (`device: None`) or of one of its devices.
    ClearHealth {
        device: Option<String>,
        condition: String,
    },
}

impl Change {
    /// The facts of the change: one, and for a GPU's condition cleared by
    /// an operator also `device.restored` (an operator's clear is the way
    /// back for a quarantined GPU).
    fn facts(&self, node: &str) -> Vec<Fact> {
        let mut out = vec![self.fact(node)];
        if let Change::ClearHealth {
            device: Some(device),
            condition,
        } = self
        {
            out.push(Fact::DeviceRestored {
                node: node.to_string(),
                device: device.clone(),
                reason: format!("{condition} cleared by an operator"),
            });
        }
        out
    }

    fn fact(&self, node: &str) -> Fact {
        let node = node.to_string();
        match self {
            Change::Cordon { reason } => Fact::NodeCordoned {
                node,
                reason: reason.clone(),
            },
            Change::Uncordon => Fact::NodeUncordoned { node },
            Change::Drain { reason, wait } => Fact::NodeDrained {
                node,
                reason: reason.clone(),
                deadline_ms: wait.map(|w| {
                    (SystemTime::now() + w)
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64)
                }),
                fault: None,
            },
            Change::Leave { reason } => Fact::NodeLeft {
                node,
                reason: reason.clone(),
            },
            Change::Topology { rack, block, rail } => Fact::NodeTopologySet {
                node,
                rack: rack.clone(),
                block: block.clone(),
                rail: rail.clone(),
            },
            Change::Maintenance {
                start_ms,
                end_ms,
                reason,
            } => Fact::NodeMaintenanceScheduled {
                node,
                start_ms: Some(*start_ms),
                end_ms: Some(*end_ms),
                reason: reason.clone(),
            },
            Change::ClearHealth { device, condition } => Fact::HealthCleared {
                node,
                device: device.clone(),
                condition: condition.clone(),
            },
        }
    }
}

/// The pool a node is in: the one its certificate was issued for, or, for
/// a node without one (seeded), the pool it last joined, from the log.
pub async fn pool_of_node(client: &Client, node: &str) -> Result<String, RequestError> {
    if let Some(row) = client
        .opt(
            "SELECT pool FROM strata.node_certificates WHERE node = $1 ORDER BY issued_at DESC LIMIT 1",
            &[&node],
        )
        .await?
    {
        return Ok(row.get(0));
    }
    let row = client
        .opt(
            "SELECT stream FROM strata.events WHERE type = ANY($1) AND payload->>'node' = $2
              ORDER BY position DESC LIMIT 1",
            &[&stored_types("node.joined"), &node],
        )
        .await?;
    row.and_then(|r| {
        r.get::<_, String>(0)
            .strip_prefix("pool/")
            .map(str::to_string)
    })
    .ok_or_else(|| RequestError::NoSuchNode(node.to_string()))
}

/// Changes `node`'s standing in `pool` (looked up when `None`), recording
/// `metadata` (who asked). Returns the pool.
pub async fn change(
    client: &Client,
    appender: &Appender,
    pool: Option<&str>,
    node: &str,
    change: &Change,
    metadata: Option<&serde_json::Value>,
) -> Result<String, RequestError> {
    valid_name("node", node).map_err(RequestError::Invalid)?;
    if let Change::ClearHealth { condition, .. } = change {
        if condition.is_empty() {
            return Err(RequestError::Invalid("name the condition to clear".into()));
        }
    }
    if let Change::Maintenance {
        start_ms, end_ms, ..
    } = change
    {
        if end_ms <= start_ms {
            return Err(RequestError::Invalid(
                "a maintenance window ends after it starts".into(),
            ));
        }
    }
    if let Change::Topology { rack, block, rail } = change {
        for (what, v) in [("rack", rack), ("block", block), ("rail", rail)] {
            if let Some(v) = v {
                valid_name(what, v).map_err(RequestError::Invalid)?;
            }
        }
    }
    let pool = match pool {
        // A pool named must be the node's own: a change written to another
        // pool's stream would be a no-op there, reported as done.
        Some(p) => match pool_of_node(client, node).await {
            Ok(own) if own != p => {
                return Err(RequestError::Invalid(format!(
                    "node {node} is in pool {own}, not {p}"
                )))
            }
            Ok(_) | Err(RequestError::NoSuchNode(_)) => p.to_string(),
            Err(e) => return Err(e),
        },
        None => pool_of_node(client, node).await?,
    };
    let events = change
        .facts(node)
        .iter()
        .map(|f| match metadata {
            Some(m) => f.to_event().with_metadata(m),
            None => f.to_event(),
        })
        .collect();
    match appender
        .append(&pool_stream(&pool), ExpectedVersion::StreamExists, events)
        .await
    {
        Ok(_) => Ok(pool),
        Err(events::AppendError::VersionConflict { .. }) => Err(RequestError::NoSuchPool(pool)),
        Err(e) => Err(RequestError::Append(e)),
    }
}
