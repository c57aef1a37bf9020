//! The values of the log: positions, LSNs, events as written and as read.

use serde_json::value::RawValue;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A global position in the log: starting at 1, in commit order, gap-free
/// within an epoch. Each PostgreSQL timeline (a standby promoted, a
/// point-in-time recovery) starts a new epoch of [`EPOCH_SIZE`] positions,
/// so that a position the old primary handed out is never handed out again
/// (`strata.log_epochs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Position(pub u64);

/// Positions per epoch: timeline `t`'s start after `(t - 1) * EPOCH_SIZE`.
pub const EPOCH_SIZE: u64 = 1 << 40;

impl Position {
    /// Whether `self` may come right after `prev` with no event missing
    /// between them: the next position, or the first of a later epoch (the
    /// jump a takeover makes).
    pub fn follows(self, prev: Position) -> bool {
        self.0 == prev.0 + 1 || (self.0 > prev.0 && (self.0 - 1).is_multiple_of(EPOCH_SIZE))
    }

    /// Whether this is the first position of an epoch after the first.
    pub fn starts_epoch(self) -> bool {
        self.0 > EPOCH_SIZE && (self.0 - 1).is_multiple_of(EPOCH_SIZE)
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A write-ahead log location, printed the way Postgres does (`16/B374D848`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

impl std::str::FromStr for Lsn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (hi, lo) = s
            .split_once('/')
            .ok_or_else(|| format!("invalid LSN {s:?}: expected HI/LO in hex"))?;
        let hi = u64::from_str_radix(hi, 16).map_err(|e| format!("invalid LSN {s:?}: {e}"))?;
        let lo = u64::from_str_radix(lo, 16).map_err(|e| format!("invalid LSN {s:?}: {e}"))?;
        if hi > u64::from(u32::MAX) || lo > u64::from(u32::MAX) {
            return Err(format!("invalid LSN {s:?}: out of range"));
        }
        Ok(Lsn((hi << 32) | lo))
    }
}

/// The version a writer expects a stream to be at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpectedVersion {
    /// No check.
    Any,
    /// The stream must have no events yet.
    NoStream,
    /// The stream must have at least one event.
    StreamExists,
    /// The stream must be at exactly this version (0 means no events yet).
    Exact(u64),
}

impl ExpectedVersion {
    /// Whether a stream at `actual` satisfies this expectation.
    pub fn admits(self, actual: u64) -> bool {
        match self {
            ExpectedVersion::Any => true,
            ExpectedVersion::NoStream => actual == 0,
            ExpectedVersion::StreamExists => actual > 0,
            ExpectedVersion::Exact(v) => v == actual,
        }
    }
}

impl fmt::Display for ExpectedVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExpectedVersion::Any => f.write_str("any"),
            ExpectedVersion::NoStream => f.write_str("no stream"),
            ExpectedVersion::StreamExists => f.write_str("an existing stream"),
            ExpectedVersion::Exact(v) => write!(f, "{v}"),
        }
    }
}

/// An event to append: its type, its JSON payload and optional metadata
/// (causation, correlation, trace context).
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub event_type: String,
    pub payload: Box<RawValue>,
    pub metadata: Option<Box<RawValue>>,
}

impl NewEvent {
    /// An event with a payload given as a JSON value.
    pub fn new(event_type: impl Into<String>, payload: &serde_json::Value) -> Self {
        let text = serde_json::to_string(payload).unwrap_or_else(|_| "null".into());
        NewEvent {
            event_type: event_type.into(),
            // Serializing a Value always yields valid JSON.
            payload: RawValue::from_string(text).unwrap_or_else(|_| null_raw()),
            metadata: None,
        }
    }

    /// An event with a payload given as JSON text; the text is checked.
    pub fn from_json(event_type: impl Into<String>, payload: &str) -> Result<Self, String> {
        let payload = RawValue::from_string(payload.to_string())
            .map_err(|e| format!("payload is not valid JSON: {e}"))?;
        Ok(NewEvent {
            event_type: event_type.into(),
            payload,
            metadata: None,
        })
    }

    pub fn with_metadata(mut self, metadata: &serde_json::Value) -> Self {
        let text = serde_json::to_string(metadata).unwrap_or_else(|_| "{}".into());
        self.metadata = RawValue::from_string(text).ok();
        self
    }
}

fn null_raw() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("null is JSON")
}

/// An event as recorded in the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub position: Position,
    pub stream: String,
    pub version: u64,
    pub event_type: String,
    /// The payload as JSON text.
    pub payload: String,
    /// The metadata as JSON text.
    pub metadata: String,
    pub recorded_at: SystemTime,
    /// The id of the transaction that appended it.
    pub xid: u64,
}

impl Event {
    /// The event as one JSON object, the shape `strata events tail` prints.
    pub fn to_json_line(&self) -> String {
        let mut out = String::with_capacity(self.payload.len() + 160);
        out.push_str("{\"position\":");
        out.push_str(&self.position.0.to_string());
        out.push_str(",\"stream\":");
        out.push_str(&serde_json::to_string(&self.stream).unwrap_or_default());
        out.push_str(",\"version\":");
        out.push_str(&self.version.to_string());
        out.push_str(",\"type\":");
        out.push_str(&serde_json::to_string(&self.event_type).unwrap_or_default());
        out.push_str(",\"data\":");
        out.push_str(&self.payload);
        out.push_str(",\"recorded_at\":\"");
        out.push_str(&humantime::format_rfc3339_micros(self.recorded_at).to_string());
        out.push_str("\"}");
        out
    }
}

/// One committed transaction as read from the replication stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Txn {
    pub xid: u32,
    /// The LSN of the commit record.
    pub commit_lsn: Lsn,
    /// The LSN just past the commit record: what to acknowledge.
    pub end_lsn: Lsn,
    pub commit_time: SystemTime,
    /// The events it inserted, in position order.
    pub events: Vec<Arc<Event>>,
}

impl Txn {
    pub fn last_position(&self) -> Option<Position> {
        self.events.last().map(|e| e.position)
    }
}

/// Microseconds between the Unix epoch and Postgres' epoch (2000-01-01).
pub const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// Converts a Postgres timestamp (microseconds since 2000-01-01) to a time.
pub fn pg_time(micros: i64) -> SystemTime {
    let unix = micros.saturating_add(PG_EPOCH_OFFSET_MICROS);
    if unix >= 0 {
        UNIX_EPOCH + Duration::from_micros(unix as u64)
    } else {
        UNIX_EPOCH - Duration::from_micros(unix.unsigned_abs())
    }
}

/// Converts a time to a Postgres timestamp.
pub fn to_pg_time(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_micros() as i64 - PG_EPOCH_OFFSET_MICROS,
        Err(e) => -(e.duration().as_micros() as i64) - PG_EPOCH_OFFSET_MICROS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_round_trips_through_text() {
        for v in [0u64, 1, 0x16_B374_D848, u64::MAX] {
            let l = Lsn(v);
            assert_eq!(l.to_string().parse::<Lsn>().unwrap(), l);
        }
        assert!("nope".parse::<Lsn>().is_err());
        assert!("1/ZZ".parse::<Lsn>().is_err());
    }

    #[test]
    fn expected_versions() {
        assert!(ExpectedVersion::Any.admits(7));
        assert!(ExpectedVersion::NoStream.admits(0));
        assert!(!ExpectedVersion::NoStream.admits(1));
        assert!(ExpectedVersion::StreamExists.admits(1));
        assert!(!ExpectedVersion::StreamExists.admits(0));
        assert!(ExpectedVersion::Exact(3).admits(3));
        assert!(!ExpectedVersion::Exact(3).admits(4));
    }

    #[test]
    fn pg_time_round_trips() {
        let t = UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        assert_eq!(pg_time(to_pg_time(t)), t);
    }

    #[test]
    fn json_line_has_the_documented_fields() {
        let e = Event {
            position: Position(5),
            stream: "pool/p1".into(),
            version: 2,
            event_type: "pool.created".into(),
            payload: "{\"a\":1}".into(),
            metadata: "{}".into(),
            recorded_at: UNIX_EPOCH,
            xid: 9,
        };
        let v: serde_json::Value = serde_json::from_str(&e.to_json_line()).unwrap();
        assert_eq!(v["position"], 5);
        assert_eq!(v["stream"], "pool/p1");
        assert_eq!(v["version"], 2);
        assert_eq!(v["type"], "pool.created");
        assert_eq!(v["data"]["a"], 1);
        assert_eq!(v["recorded_at"], "1970-01-01T00:00:00.000000Z");
    }
}
