//! Building logs in memory, for tests and benchmarks of the index and the
//! planner: positions and stream versions are assigned as the database
//! would.

use domain::Fact;
use events::{Event, Position};
use std::collections::HashMap;
use std::time::SystemTime;

/// An in-memory log.
#[derive(Debug, Default)]
pub struct Log {
    pub events: Vec<Event>,
    versions: HashMap<String, u64>,
    /// The time events are recorded at from now on (`None`: the clock's).
    pub clock: Option<SystemTime>,
}

impl Log {
    pub fn new() -> Log {
        Log::default()
    }

    /// Appends a fact to a stream and returns the event.
    pub fn push(&mut self, stream: &str, fact: &Fact) -> Event {
        let e = fact.to_event();
        let version = self.versions.entry(stream.to_string()).or_default();
        *version += 1;
        let event = Event {
            position: Position(self.events.len() as u64 + 1),
            stream: stream.to_string(),
            version: *version,
            event_type: e.event_type,
            payload: e.payload.get().to_string(),
            metadata: e
                .metadata
                .map_or_else(|| "{}".into(), |m| m.get().to_string()),
            recorded_at: self.clock.unwrap_or_else(SystemTime::now),
            xid: 1,
        };
        self.events.push(event.clone());
        event
    }
}
