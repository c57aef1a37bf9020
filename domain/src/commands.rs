//! Commands to nodes, as events on `command/<id>`:
//!
//! | version | event | written by |
//! | --- | --- | --- |
//! | 1 | `command.issued` (node, kind, args, deadline) | whoever issues it |
//! | 2 | `command.acked`, only if the outcome did not follow within the gateway's ack hold | the gateway holding the node's session |
//! | 2 or 3 | `command.succeeded`, `command.failed`, `command.expired` | that gateway (results), any gateway (expiry) |
//!
//! Every transition is appended with the exact version it follows, so a
//! command reaches exactly one terminal state however many gateways try.

use events::catalog::{opt, req, EventSpec, Ty};
use events::db::Sql;
use events::{AppendError, Appender, Event, ExpectedVersion, NewEvent};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

pub const ISSUED: &str = "command.issued";
pub const ACKED: &str = "command.acked";
pub const SUCCEEDED: &str = "command.succeeded";
pub const FAILED: &str = "command.failed";
pub const EXPIRED: &str = "command.expired";

/// The event reference's entries for commands (see `events::catalog`).
pub const EVENTS: &[EventSpec] = &[
    EventSpec {
        event_type: ISSUED,
        stream: "command/<id>",
        written_by: "operators (`strata commands issue`, the client API); the binder (`allocation.bind`, `allocation.release`)",
        about: "A command for a node. Each later transition is appended at the exact version it follows, so a command ends in exactly one terminal state.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("node", Ty::String, "The node that runs it."),
            req("kind", Ty::String, "`diag.nvml`, `allocation.bind`, `allocation.release`, ..."),
            opt("args", Ty::Object, "Its arguments (default none)."),
            req("deadline_ms", Ty::Integer, "Unix milliseconds after which it is not run."),
            opt("issued_by", Ty::String, "`operator:<name>`, `cli:<user>` or `strata:<role>`."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: ACKED,
        stream: "command/<id>",
        written_by: "the gateway holding the node's session",
        about: "The node received the command, and its outcome did not follow within the gateway's ack hold (5 s by default): an outcome that comes sooner is written alone, and says as much.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("node", Ty::String, "The node."),
            req("gateway", Ty::String, "The gateway that heard the ack."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: SUCCEEDED,
        stream: "command/<id>",
        written_by: "the gateway holding the node's session",
        about: "Terminal: the node ran the command.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("node", Ty::String, "The node."),
            req("detail", Ty::String, "The node's words."),
            req("output", Ty::Any, "What the command returned (JSON; null without)."),
            opt("gateway", Ty::String, "The gateway that heard the outcome."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: FAILED,
        stream: "command/<id>",
        written_by: "the gateway holding the node's session",
        about: "Terminal: the node ran the command and it failed.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("node", Ty::String, "The node."),
            req("detail", Ty::String, "Why."),
            req("output", Ty::Any, "What the command returned (JSON; null without)."),
            opt("gateway", Ty::String, "The gateway that heard the outcome."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: EXPIRED,
        stream: "command/<id>",
        written_by: "any gateway",
        about: "Terminal: the deadline passed before a result came.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("gateway", Ty::String, "The gateway that expired it."),
        ],
        formerly: &[],
    },
];

pub fn command_stream(id: &str) -> String {
    format!("command/{id}")
}

/// A command as issued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command {
    pub id: String,
    pub node: String,
    /// `diag.nvml`, `allocation.bind`, `allocation.release`, ...
    pub kind: String,
    /// A JSON object.
    #[serde(default)]
    pub args: serde_json::Value,
    /// Unix milliseconds after which it is not executed.
    pub deadline_ms: u64,
    /// Who asked: `operator:<name>` (the client API), `cli:<user>` (with
    /// database access), `strata:<role>` (Strata's own, such as the binder).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub issued_by: String,
}

/// Command kinds only Strata's own roles issue: a made-up `allocation.bind`
/// would leave a node holding a binding the log does not know.
pub const INTERNAL_PREFIXES: &[&str] = &["allocation."];

pub fn is_internal(kind: &str) -> bool {
    INTERNAL_PREFIXES.iter().any(|p| kind.starts_with(p))
}

/// Command id spaces only Strata's own roles issue in: the binder's
/// (`bind:<reservation>:<node>`, `rebind:<n>:...`, `release:...`,
/// `preempting:...`). An id taken there first would be taken by the binder
/// for its own command ("already issued"), and a reservation would wait for
/// a bind that never comes, or a node keep a binding the log freed.
pub const RESERVED_ID_PREFIXES: &[&str] = &["bind:", "rebind:", "release:", "preempting:"];

pub fn is_reserved_id(id: &str) -> bool {
    RESERVED_ID_PREFIXES.iter().any(|p| id.starts_with(p))
}

/// Why a command id in Strata's own id spaces was refused.
pub fn reserved_id_refusal(id: &str) -> String {
    format!(
        "command id {id:?} is in Strata's own id space ({}): only the binder issues there",
        RESERVED_ID_PREFIXES.join(", ")
    )
}

/// Why a command of Strata's own kind was refused.
pub fn internal_refusal(kind: &str) -> String {
    format!("{kind:?} is one of Strata's own command kinds: only the binder issues it")
}

/// Where a command is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CommandState {
    Issued,
    Acked,
    Succeeded,
    Failed,
    Expired,
}

impl CommandState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            CommandState::Succeeded | CommandState::Failed | CommandState::Expired
        )
    }

    pub fn from_event_type(t: &str) -> Option<CommandState> {
        Some(match t {
            ISSUED => CommandState::Issued,
            ACKED => CommandState::Acked,
            SUCCEEDED => CommandState::Succeeded,
            FAILED => CommandState::Failed,
            EXPIRED => CommandState::Expired,
            _ => return None,
        })
    }
}

/// The largest command arguments, as JSON.
pub const MAX_ARGS_BYTES: usize = 64 << 10;

/// Issues a command. Refused if the id was used before.
pub async fn issue(appender: &Appender, command: &Command) -> Result<(), AppendError> {
    crate::valid_name("command id", &command.id).map_err(AppendError::Invalid)?;
    crate::valid_name("node", &command.node).map_err(AppendError::Invalid)?;
    if command.issued_by.is_empty() {
        return Err(AppendError::Invalid(
            "a command records who issued it".into(),
        ));
    }
    let own = command.issued_by.starts_with("strata:");
    if is_internal(&command.kind) && !own {
        return Err(AppendError::Invalid(internal_refusal(&command.kind)));
    }
    if is_reserved_id(&command.id) && !own {
        return Err(AppendError::Invalid(reserved_id_refusal(&command.id)));
    }
    if !command.args.is_object() && !command.args.is_null() {
        return Err(AppendError::Invalid(
            "command arguments must be a JSON object".into(),
        ));
    }
    let size = command.args.to_string().len();
    if size > MAX_ARGS_BYTES {
        return Err(AppendError::Invalid(format!(
            "command arguments are {size} bytes; at most {MAX_ARGS_BYTES} (every gateway holds open commands in memory and sends them again on every reconnect)"
        )));
    }
    let payload = serde_json::to_value(command).expect("commands serialize");
    appender
        .append(
            &command_stream(&command.id),
            ExpectedVersion::NoStream,
            vec![NewEvent::new(ISSUED, &payload)],
        )
        .await
        .map(|_| ())
}

/// The node a command was issued to, if it was issued.
pub async fn node_of(
    client: &tokio_postgres::Client,
    id: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    Ok(client
        .opt(
            "SELECT payload->>'node' FROM strata.events WHERE stream = $1 AND version = 1",
            &[&command_stream(id)],
        )
        .await?
        .map(|r| r.get(0)))
}

/// Appends a transition after `version`.
pub async fn transition(
    appender: &Appender,
    id: &str,
    version: u64,
    event_type: &str,
    payload: &serde_json::Value,
) -> Result<u64, AppendError> {
    appender
        .append(
            &command_stream(id),
            ExpectedVersion::Exact(version),
            vec![NewEvent::new(event_type, payload)],
        )
        .await
        .map(|a| a.version)
}

/// A command with its current state, folded from its events.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tracked {
    pub command: Command,
    pub state: CommandState,
    /// The stream's version: the one the next transition expects.
    pub version: u64,
    /// The terminal event's payload (detail, output), if any.
    pub outcome: Option<serde_json::Value>,
}

/// Commands folded from events, by id, and the ids of each node's.
///
/// A gateway looks up a node's commands whenever the node's session opens:
/// by node, not by a scan of every command it tracks, which in a storm
/// (a fleet re-homing while commands for unreachable nodes pile up) made
/// each opening cost as much as the whole table, under its lock.
#[derive(Debug, Default)]
pub struct Commands {
    by_id: HashMap<String, Tracked>,
    by_node: HashMap<String, std::collections::BTreeSet<String>>,
}

impl Commands {
    /// Applies a command event (any other event is ignored). Returns the id
    /// when something changed.
    pub fn apply(&mut self, e: &Event) -> Option<String> {
        let id = e.stream.strip_prefix("command/")?;
        let state = CommandState::from_event_type(&e.event_type)?;
        if state == CommandState::Issued {
            let command: Command = serde_json::from_str(&e.payload).ok()?;
            if self.by_id.contains_key(id) {
                return None;
            }
            self.insert(Tracked {
                command,
                state,
                version: e.version,
                outcome: None,
            });
            return Some(id.to_string());
        }
        let t = self.by_id.get_mut(id)?;
        if e.version < t.version || (e.version == t.version && t.outcome.is_some()) {
            return None;
        }
        if e.version == t.version && !state.is_terminal() {
            return None;
        }
        t.state = state;
        t.version = e.version;
        if state.is_terminal() {
            t.outcome = serde_json::from_str(&e.payload).ok();
        }
        Some(id.to_string())
    }
}

impl Commands {
    /// The command `id`, if tracked.
    pub fn get(&self, id: &str) -> Option<&Tracked> {
        self.by_id.get(id)
    }

    /// Every command tracked.
    pub fn values(&self) -> impl Iterator<Item = &Tracked> {
        self.by_id.values()
    }

    /// How many commands are tracked.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The commands of `node` not yet finished, oldest deadline first.
    pub fn open_for(&self, node: &str) -> Vec<&Tracked> {
        let mut open: Vec<&Tracked> = self
            .by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|id| self.by_id.get(id))
            .filter(|t| !t.state.is_terminal())
            .collect();
        open.sort_by_key(|t| t.command.deadline_ms);
        open
    }

    /// Tracks `t`, unless its command is tracked at the same or a later
    /// version already. Whether it was taken.
    pub fn insert(&mut self, t: Tracked) -> bool {
        if self
            .by_id
            .get(&t.command.id)
            .is_some_and(|known| known.version >= t.version)
        {
            return false;
        }
        self.by_node
            .entry(t.command.node.clone())
            .or_default()
            .insert(t.command.id.clone());
        self.by_id.insert(t.command.id.clone(), t);
        true
    }

    /// Stops tracking `id`.
    pub fn remove(&mut self, id: &str) -> Option<Tracked> {
        let t = self.by_id.remove(id)?;
        if let Some(ids) = self.by_node.get_mut(&t.command.node) {
            ids.remove(id);
            if ids.is_empty() {
                self.by_node.remove(&t.command.node);
            }
        }
        Some(t)
    }

    /// Records a transition this process wrote itself (at `version`),
    /// before the subscription brings it back. A terminal one carries its
    /// outcome (`payload`) at once: the next event of the stream seen (an
    /// earlier one, late under load) hands the command to its waiters as
    /// finished, and they must get the outcome with it.
    pub fn wrote(
        &mut self,
        id: &str,
        version: u64,
        state: CommandState,
        payload: &serde_json::Value,
    ) {
        if let Some(t) = self.by_id.get_mut(id) {
            if version > t.version {
                t.version = version;
                t.state = state;
                if state.is_terminal() {
                    t.outcome = Some(payload.clone());
                }
            }
        }
    }
}

/// Reads commands from the table: those of `node` (all nodes when `None`),
/// the newest `limit`.
pub async fn list(
    client: &tokio_postgres::Client,
    node: Option<&str>,
    limit: i64,
) -> Result<Vec<Tracked>, tokio_postgres::Error> {
    let rows = client
        .rows(
            "SELECT i.stream, i.payload::text FROM strata.events i
              WHERE i.type = 'command.issued' AND ($1::text IS NULL OR i.payload->>'node' = $1)
              ORDER BY i.position DESC LIMIT $2",
            &[&node, &limit],
        )
        .await?;
    let streams: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let events = client
        .rows(
            "SELECT position, stream, version, type, payload::text FROM strata.events
              WHERE stream = ANY($1) ORDER BY position",
            &[&streams],
        )
        .await?;
    let mut commands = Commands::default();
    for r in events {
        let e = Event {
            position: events::Position(r.get::<_, i64>(0) as u64),
            stream: r.get(1),
            version: r.get::<_, i64>(2) as u64,
            event_type: r.get(3),
            payload: r.get(4),
            metadata: "{}".into(),
            recorded_at: std::time::SystemTime::UNIX_EPOCH,
            xid: 0,
        };
        commands.apply(&e);
    }
    let mut out: Vec<Tracked> = streams
        .iter()
        .filter_map(|s| commands.remove(s.trim_start_matches("command/")))
        .collect();
    out.reverse();
    Ok(out)
}

/// Commands not yet terminal, as the table has them now, each of them
/// durable: appends commit asynchronously, so a row can be visible before
/// it is flushed (or, with synchronous standbys named, before a standby has
/// it). A flush barrier after the read waits for that, so a command handed
/// to a node from here cannot be lost by a crash or a standby's takeover.
pub async fn open(client: &tokio_postgres::Client) -> Result<Vec<Tracked>, tokio_postgres::Error> {
    let rows = client
        .rows(
            "SELECT i.payload::text, s.version, last.type
               FROM strata.streams s
               JOIN strata.events i ON i.stream = s.stream AND i.version = 1
               JOIN strata.events last ON last.stream = s.stream AND last.version = s.version
              WHERE s.stream LIKE 'command/%'
                AND last.type NOT IN ('command.succeeded', 'command.failed', 'command.expired')",
            &[],
        )
        .await?;
    events::read::flush_barrier(client).await?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let command: Command = serde_json::from_str(r.get::<_, &str>(0)).ok()?;
            Some(Tracked {
                command,
                state: CommandState::from_event_type(r.get(2))?,
                version: r.get::<_, i64>(1) as u64,
                outcome: None,
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(version: u64, event_type: &str, payload: &str) -> Event {
        Event {
            position: events::Position(version),
            stream: command_stream("c1"),
            version,
            event_type: event_type.into(),
            payload: payload.into(),
            metadata: "{}".into(),
            recorded_at: std::time::SystemTime::now(),
            xid: 1,
        }
    }

    #[test]
    fn a_command_this_process_finished_has_its_outcome_before_the_log_brings_it_back() {
        let mut c = Commands::default();
        let issued = serde_json::json!({"id": "c1", "node": "n1", "kind": "diag.nvml", "args": {}, "deadline_ms": 1, "issued_by": "t"});
        c.apply(&event(1, ISSUED, &issued.to_string()));
        // The gateway wrote the result at version 3 before the subscription
        // brought its acknowledgement (version 2).
        let outcome = serde_json::json!({"detail": "all GPUs pass", "output": {}});
        c.wrote("c1", 3, CommandState::Succeeded, &outcome);
        assert_eq!(
            c.apply(&event(2, "command.acked", "{}")),
            None,
            "older than what it knows"
        );
        let t = &c.by_id["c1"];
        assert!(t.state.is_terminal());
        assert_eq!(t.outcome.as_ref(), Some(&outcome));
    }

    #[test]
    fn a_nodes_open_commands_are_found_by_its_node_and_let_go_once_finished() {
        let mut c = Commands::default();
        for (id, node, deadline) in [("a", "n1", 3), ("b", "n2", 1), ("c", "n1", 2)] {
            let issued = serde_json::json!({"id": id, "node": node, "kind": "diag.nvml", "args": {}, "deadline_ms": deadline, "issued_by": "t"});
            let mut e = event(1, ISSUED, &issued.to_string());
            e.stream = command_stream(id);
            c.apply(&e);
        }
        let ids = |c: &Commands, node: &str| -> Vec<String> {
            c.open_for(node)
                .iter()
                .map(|t| t.command.id.clone())
                .collect()
        };
        assert_eq!(ids(&c, "n1"), ["c", "a"], "oldest deadline first");
        assert_eq!(ids(&c, "n2"), ["b"]);
        assert!(ids(&c, "n3").is_empty());
        // Finished: no longer open, then no longer tracked.
        let mut done = event(2, SUCCEEDED, "{}");
        done.stream = command_stream("c");
        c.apply(&done);
        assert_eq!(ids(&c, "n1"), ["a"]);
        c.remove("c");
        c.remove("a");
        assert!(ids(&c, "n1").is_empty());
        assert!(!c.by_node.contains_key("n1"), "{:?}", c.by_node);
        assert_eq!(c.len(), 1);
        // An older copy (a reload from the table) does not replace a newer one.
        let mut older = c.get("b").unwrap().clone();
        older.version = 0;
        assert!(!c.insert(older));
    }
}
