//! Acknowledgements held back: a node's `command.acked` is written only
//! when the command's outcome does not follow within the gateway's
//! `ack_hold`.
//!
//! A node acks a command as it receives it and reports the outcome once it
//! has run it. For most commands (every bind and release of a reservation)
//! the outcome follows within milliseconds, and an `acked` written between
//! says nothing the outcome does not say: in the region at 10,000 nodes it
//! was one event and one transaction in every seven. So the gateway holds an
//! ack: an outcome that comes within the hold is written alone (at the
//! version after `command.issued`), and an ack whose command is still open
//! after the hold is written then, for whoever watches a long command.
//!
//! Nothing waits on `acked`: the binder and the client API's waiters wait
//! for the outcome, and expiry looks at the deadline whatever the state. An
//! ack held by a gateway that stops is not written at all; the command is
//! pushed again to the node's next session, whose ack and outcome are
//! written as any other. The hold only decides whether an event is worth a
//! transaction; no guarantee rests on its timing.

use crate::state::Shared;
use domain::commands::{self, CommandState};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Status;

/// Acks written at once, each its own append (the appender groups them).
const AT_ONCE: usize = 64;

/// A node's ack of command `id`: refused if the command is another node's,
/// ignored if the gateway does not know it or it is past `acked`, held
/// otherwise.
pub(crate) fn acked(shared: &Shared, node: &str, id: &str) -> Result<(), Status> {
    if let Some((CommandState::Issued, _)) = crate::dispatch::reported(shared, node, id)? {
        shared.acks.hold(id, node, Instant::now());
    }
    Ok(())
}

/// Writes the acks held past the hold whose command is still open, for as
/// long as the gateway runs.
pub(crate) async fn writer(shared: Arc<Shared>) {
    let hold = shared.config.ack_hold;
    let every = (hold / 4).clamp(Duration::from_millis(10), Duration::from_millis(250));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let due = shared.acks.due(Instant::now(), hold);
        if due.is_empty() {
            continue;
        }
        futures_util::stream::iter(due)
            .map(|(id, node)| {
                let shared = &shared;
                async move {
                    let payload = serde_json::json!({
                        "id": id, "node": node, "gateway": shared.config.id,
                    });
                    // Not written (the outcome came meanwhile, or the
                    // database is away): the outcome says as much.
                    if let Err(e) = crate::dispatch::command_transition(
                        shared,
                        &node,
                        &id,
                        (commands::ACKED, payload),
                        Duration::ZERO,
                    )
                    .await
                    {
                        tracing::debug!(command = %id, error = %e.message(), "a held ack was not written");
                    }
                }
            })
            .buffer_unordered(AT_ONCE)
            .collect::<Vec<()>>()
            .await;
    }
}
