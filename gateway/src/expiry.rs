//! Overdue commands expired, apart from their delivery.
//!
//! A command past its deadline without an outcome is ended `expired` by a
//! gateway. This was the dispatcher's own work, one append after another in
//! the loop that follows the log and pushes new commands to sessions: in a
//! storm (a third of a 10,000-node fleet re-homing) thousands of commands
//! fell due at once, every gateway tried to expire every one of them in
//! turn, each attempt after the first a version conflict that only the
//! subscription could settle, and the subscription was not read while the
//! attempts ran. New commands then went undelivered, fell due in their
//! turn, and the region stopped delivering commands at all.
//!
//! So expiry is a task of its own: every [`EVERY`], the commands due are
//! expired [`AT_ONCE`] at a time (the appender batches them into a few
//! transactions), an attempt that lost to another writer is not repeated
//! until the subscription brings a newer version, and a gateway lets the
//! gateway holding the node's session go first for [`OTHERS_GRACE`].

use crate::state::Shared;
use domain::commands;
use events::AppendError;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How often the commands due are looked for.
pub(crate) const EVERY: Duration = Duration::from_millis(500);
/// Expiries in flight at once.
pub(crate) const AT_ONCE: usize = 64;
/// How long past a command's deadline the gateway holding its node's
/// session waits before expiring it.
const HOLDER_GRACE: Duration = Duration::from_secs(1);
/// How long the others wait: the holder is the one that knows.
pub(crate) const OTHERS_GRACE: Duration = Duration::from_secs(5);

/// Expires the commands due, for as long as the gateway runs.
pub(crate) async fn expirer(shared: Arc<Shared>) {
    // Command id -> the version this gateway last tried to expire it at.
    let mut tried: HashMap<String, u64> = HashMap::new();
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let due = due(&shared, &mut tried);
        let results: Vec<(String, u64, Result<u64, AppendError>)> = futures_util::stream::iter(due)
            .map(|(id, version)| {
                let shared = shared.clone();
                async move {
                    let payload = serde_json::json!({ "id": id, "gateway": shared.config.id });
                    let r = commands::transition(
                        &shared.appender,
                        &id,
                        version,
                        commands::EXPIRED,
                        &payload,
                    )
                    .await;
                    (id, version, r)
                }
            })
            .buffer_unordered(AT_ONCE)
            .collect()
            .await;
        for (id, version, r) in results {
            match r {
                Ok(_) => {
                    shared
                        .stats
                        .commands_finished
                        .fetch_add(1, Ordering::Relaxed);
                }
                // Another writer moved the command, which the subscription
                // brings; the same attempt again would only conflict again.
                Err(AppendError::VersionConflict { .. }) => {}
                // Not written (the database away, say): tried again at the
                // next look.
                Err(_) => continue,
            }
            tried.insert(id, version);
        }
    }
}

/// The commands due now (id, version), leaving out those already tried at
/// the version the gateway knows; forgets what it tried of commands no
/// longer tracked. The two locks are taken one after the other, never
/// together.
fn due(shared: &Shared, tried: &mut HashMap<String, u64>) -> Vec<(String, u64)> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let past = |t: &commands::Tracked, grace: Duration| {
        t.command.deadline_ms + (grace.as_millis() as u64) < now
    };
    // (id, version, node, past the others' grace too)
    let candidates: Vec<(String, u64, String, bool)> = {
        let cmds = shared.commands.lock().expect("commands lock");
        tried.retain(|id, _| cmds.get(id).is_some());
        cmds.values()
            .filter(|t| !t.state.is_terminal() && past(t, HOLDER_GRACE))
            .filter(|t| tried.get(&t.command.id) != Some(&t.version))
            .map(|t| {
                (
                    t.command.id.clone(),
                    t.version,
                    t.command.node.clone(),
                    past(t, OTHERS_GRACE),
                )
            })
            .collect()
    };
    let sessions = shared.sessions.lock().expect("sessions lock");
    candidates
        .into_iter()
        .filter(|(_, _, node, late)| *late || sessions.get(node).is_some_and(|s| !s.closed))
        .map(|(id, version, _, _)| (id, version))
        .collect()
}
