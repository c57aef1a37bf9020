//! Turns a stream of pgoutput messages into committed transactions of
//! [`Event`]s. Pure: bytes in, values out.
//!
//! ```text
//!  Relation -> remember which column is which (by name, so column order can change)
//!  Begin    -> open a transaction
//!  Insert   -> decode a row of strata.events (binary values) into an Event
//!  Commit   -> close it: a Txn with its commit and end LSNs
//! ```
//!
//! Rows of other relations are ignored; anything out of order is an error,
//! never a panic.

use crate::pgoutput::{decode_logical, Datum, DecodeError, LogicalMessage, Relation};
use crate::types::{pg_time, Event, Position, Txn};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Debug, Clone, Copy)]
struct EventColumns {
    position: usize,
    stream: usize,
    version: usize,
    event_type: usize,
    payload: usize,
    metadata: usize,
    recorded_at: usize,
    xid: usize,
}

impl EventColumns {
    fn of(rel: &Relation) -> Option<EventColumns> {
        let find = |name: &str| rel.columns.iter().position(|c| c.name == name);
        Some(EventColumns {
            position: find("position")?,
            stream: find("stream")?,
            version: find("version")?,
            event_type: find("type")?,
            payload: find("payload")?,
            metadata: find("metadata")?,
            recorded_at: find("recorded_at")?,
            xid: find("xid")?,
        })
    }
}

struct Open {
    xid: u32,
    events: Vec<Arc<Event>>,
}

/// Assembles transactions from pgoutput messages.
#[derive(Default)]
pub struct Assembler {
    /// Relation id -> columns, for the event table only (`None` = other table).
    relations: HashMap<u32, Option<EventColumns>>,
    open: Option<Open>,
}

fn bad(what: &'static str, problem: &'static str) -> DecodeError {
    DecodeError {
        what,
        offset: 0,
        problem,
    }
}

impl Assembler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a transaction is open (between Begin and Commit).
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// Feeds one pgoutput message; returns a transaction when it commits.
    pub fn push(&mut self, data: &[u8]) -> Result<Option<Txn>, DecodeError> {
        match decode_logical(data)? {
            LogicalMessage::Begin { xid, .. } => {
                if self.open.is_some() {
                    return Err(bad("begin message", "begin inside an open transaction"));
                }
                self.open = Some(Open {
                    xid,
                    events: Vec::new(),
                });
                Ok(None)
            }
            LogicalMessage::Relation(rel) => {
                let cols = (rel.namespace == "strata" && rel.name == "events")
                    .then(|| EventColumns::of(&rel))
                    .flatten();
                if rel.namespace == "strata" && rel.name == "events" && cols.is_none() {
                    return Err(bad(
                        "relation message",
                        "strata.events lacks a column this build needs",
                    ));
                }
                self.relations.insert(rel.id, cols);
                Ok(None)
            }
            LogicalMessage::Insert { relation, tuple } => {
                let open = self
                    .open
                    .as_mut()
                    .ok_or_else(|| bad("insert message", "insert outside a transaction"))?;
                match self.relations.get(&relation) {
                    None => Err(bad(
                        "insert message",
                        "insert for a relation that was never described",
                    )),
                    Some(None) => Ok(None),
                    Some(Some(cols)) => {
                        open.events.push(Arc::new(event_from_tuple(cols, &tuple)?));
                        Ok(None)
                    }
                }
            }
            LogicalMessage::Commit {
                commit_lsn,
                end_lsn,
                commit_time,
                ..
            } => {
                let open = self
                    .open
                    .take()
                    .ok_or_else(|| bad("commit message", "commit outside a transaction"))?;
                let mut events = open.events;
                // Rows arrive in insert order, which is position order within
                // one append; sort anyway so the invariant never rests on it.
                if events.windows(2).any(|w| w[0].position > w[1].position) {
                    events.sort_by_key(|e| e.position);
                }
                Ok(Some(Txn {
                    xid: open.xid,
                    commit_lsn,
                    end_lsn,
                    commit_time: pg_time(commit_time),
                    events,
                }))
            }
            LogicalMessage::Skipped(_) => Ok(None),
        }
    }
}

fn col<'a>(tuple: &[Datum<'a>], i: usize) -> Result<Datum<'a>, DecodeError> {
    tuple
        .get(i)
        .copied()
        .ok_or_else(|| bad("event row", "row has fewer columns than its relation"))
}

fn int8(d: Datum<'_>) -> Result<i64, DecodeError> {
    match d {
        Datum::Binary(b) => <[u8; 8]>::try_from(b)
            .map(i64::from_be_bytes)
            .map_err(|_| bad("event row", "int8 value is not 8 bytes")),
        Datum::Text(t) => std::str::from_utf8(t)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("event row", "int8 value is not a number")),
        _ => Err(bad("event row", "int8 column is null")),
    }
}

fn text(d: Datum<'_>) -> Result<String, DecodeError> {
    match d {
        Datum::Binary(b) | Datum::Text(b) => {
            String::from_utf8(b.to_vec()).map_err(|_| bad("event row", "text value is not UTF-8"))
        }
        _ => Err(bad("event row", "text column is null")),
    }
}

fn jsonb(d: Datum<'_>) -> Result<String, DecodeError> {
    match d {
        // Binary jsonb is a version byte (1) followed by the JSON text.
        Datum::Binary(b) => match b.split_first() {
            Some((1, rest)) => String::from_utf8(rest.to_vec())
                .map_err(|_| bad("event row", "jsonb value is not UTF-8")),
            _ => Err(bad("event row", "unknown jsonb binary version")),
        },
        Datum::Text(t) => {
            String::from_utf8(t.to_vec()).map_err(|_| bad("event row", "jsonb value is not UTF-8"))
        }
        _ => Err(bad("event row", "jsonb column is null")),
    }
}

fn event_from_tuple(c: &EventColumns, t: &[Datum<'_>]) -> Result<Event, DecodeError> {
    let position = int8(col(t, c.position)?)?;
    let version = int8(col(t, c.version)?)?;
    if position <= 0 || version <= 0 {
        return Err(bad("event row", "position and version must be positive"));
    }
    let recorded_at = match col(t, c.recorded_at)? {
        Datum::Binary(b) => pg_time(
            <[u8; 8]>::try_from(b)
                .map(i64::from_be_bytes)
                .map_err(|_| bad("event row", "timestamptz value is not 8 bytes"))?,
        ),
        _ => return Err(bad("event row", "recorded_at must arrive in binary")),
    };
    let xid = int8(col(t, c.xid)?)? as u64;
    Ok(Event {
        position: Position(position as u64),
        stream: text(col(t, c.stream)?)?,
        version: version as u64,
        event_type: text(col(t, c.event_type)?)?,
        payload: jsonb(col(t, c.payload)?)?,
        metadata: jsonb(col(t, c.metadata)?)?,
        recorded_at,
        xid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pgoutput::encode;
    use crate::types::Lsn;

    fn rel(id: u32, name: &str) -> Relation {
        Relation {
            name: name.into(),
            ..encode::events_relation(id)
        }
    }

    fn row(pos: i64) -> Vec<u8> {
        let p = pos.to_be_bytes();
        let v = 1i64.to_be_bytes();
        let ts = 0i64.to_be_bytes();
        let xid = 7i64.to_be_bytes();
        let payload = b"\x01{\"k\":1}";
        let meta = b"\x01{}";
        encode::insert(
            1,
            &[
                Datum::Binary(&p),
                Datum::Binary(b"s/1"),
                Datum::Binary(&v),
                Datum::Binary(b"t.x"),
                Datum::Binary(payload),
                Datum::Binary(meta),
                Datum::Binary(&ts),
                Datum::Binary(&xid),
            ],
        )
    }

    #[test]
    fn assembles_a_transaction() {
        let mut a = Assembler::new();
        assert!(a
            .push(&encode::relation(&rel(1, "events")))
            .unwrap()
            .is_none());
        assert!(a.push(&encode::begin(Lsn(100), 0, 9)).unwrap().is_none());
        a.push(&row(1)).unwrap();
        a.push(&row(2)).unwrap();
        let txn = a
            .push(&encode::commit(0, Lsn(100), Lsn(108), 0))
            .unwrap()
            .unwrap();
        assert_eq!(txn.events.len(), 2);
        assert_eq!(txn.end_lsn, Lsn(108));
        assert_eq!(txn.events[1].position, Position(2));
        assert_eq!(txn.events[0].payload, "{\"k\":1}");
        assert_eq!(txn.events[0].stream, "s/1");
        assert_eq!(txn.xid, 9);
    }

    #[test]
    fn ignores_other_relations_and_refuses_disorder() {
        let mut a = Assembler::new();
        a.push(&encode::relation(&rel(1, "other"))).unwrap();
        a.push(&encode::begin(Lsn(1), 0, 1)).unwrap();
        a.push(&row(1)).unwrap();
        let txn = a
            .push(&encode::commit(0, Lsn(1), Lsn(2), 0))
            .unwrap()
            .unwrap();
        assert!(txn.events.is_empty());
        assert_eq!(
            a.push(&row(1)).unwrap_err().problem,
            "insert outside a transaction"
        );
        assert_eq!(
            a.push(&encode::commit(0, Lsn(1), Lsn(2), 0))
                .unwrap_err()
                .problem,
            "commit outside a transaction"
        );
        a.push(&encode::begin(Lsn(1), 0, 1)).unwrap();
        assert_eq!(
            a.push(&encode::begin(Lsn(1), 0, 1)).unwrap_err().problem,
            "begin inside an open transaction"
        );
        let mut b = Assembler::new();
        b.push(&encode::begin(Lsn(1), 0, 1)).unwrap();
        assert_eq!(
            b.push(&row(1)).unwrap_err().problem,
            "insert for a relation that was never described"
        );
    }
}
