//! A decoder for the streaming replication protocol's CopyData payloads and
//! the pgoutput logical decoding messages inside them (protocol version 1).
//!
//! Pure: it takes bytes and returns values, never touches a socket, and never
//! panics on malformed input; every read is bounds-checked and a bad message
//! yields a [`DecodeError`] naming what was being read and where.
//!
//! ```text
//!  CopyData 'w' XLogData(start, end, clock, data) --data--> 'B' Begin | 'R' Relation | 'I' Insert | 'C' Commit | other (skipped)
//!  CopyData 'k' Keepalive(end, clock, reply requested)
//! ```

use crate::types::Lsn;

/// A decoding failure: what was being read and the byte offset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("decode {what} at byte {offset}: {problem}")]
pub struct DecodeError {
    pub what: &'static str,
    pub offset: usize,
    pub problem: &'static str,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Cursor { buf, pos: 0, what }
    }
    fn err(&self, problem: &'static str) -> DecodeError {
        DecodeError {
            what: self.what,
            offset: self.pos,
            problem,
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or_else(|| self.err("length overflows"))?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| self.err("message is truncated"))?;
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn i16(&mut self) -> Result<i16, DecodeError> {
        let b = self.take(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }
    fn i32(&mut self) -> Result<i32, DecodeError> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(self.i32()? as u32)
    }
    fn i64(&mut self) -> Result<i64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(i64::from_be_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(self.i64()? as u64)
    }
    /// A NUL-terminated string.
    fn cstr(&mut self) -> Result<String, DecodeError> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        let nul = rest
            .iter()
            .position(|b| *b == 0)
            .ok_or_else(|| self.err("string is not terminated"))?;
        let s = std::str::from_utf8(&rest[..nul]).map_err(|_| self.err("string is not UTF-8"))?;
        self.pos += nul + 1;
        Ok(s.to_string())
    }
    fn rest(&mut self) -> &'a [u8] {
        let s = self.buf.get(self.pos..).unwrap_or_default();
        self.pos = self.buf.len();
        s
    }
    fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }
}

/// A message of the streaming replication protocol (inside CopyData).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage<'a> {
    /// WAL data: a pgoutput message in `data`.
    XLogData {
        start: Lsn,
        end: Lsn,
        clock: i64,
        data: &'a [u8],
    },
    /// The server's keepalive; `reply` asks for a status update now.
    Keepalive { end: Lsn, clock: i64, reply: bool },
}

/// Decodes one CopyData payload of the replication stream.
pub fn decode_replication(buf: &[u8]) -> Result<ReplicationMessage<'_>, DecodeError> {
    let mut c = Cursor::new(buf, "replication message");
    match c.u8()? {
        b'w' => {
            let start = Lsn(c.u64()?);
            let end = Lsn(c.u64()?);
            let clock = c.i64()?;
            Ok(ReplicationMessage::XLogData {
                start,
                end,
                clock,
                data: c.rest(),
            })
        }
        b'k' => {
            let end = Lsn(c.u64()?);
            let clock = c.i64()?;
            let reply = c.u8()? != 0;
            Ok(ReplicationMessage::Keepalive { end, clock, reply })
        }
        _ => Err(c.err("unknown replication message tag")),
    }
}

/// Encodes a standby status update ('r').
pub fn encode_status(write: Lsn, flush: Lsn, apply: Lsn, clock: i64, reply: bool) -> [u8; 34] {
    let mut out = [0u8; 34];
    out[0] = b'r';
    out[1..9].copy_from_slice(&write.0.to_be_bytes());
    out[9..17].copy_from_slice(&flush.0.to_be_bytes());
    out[17..25].copy_from_slice(&apply.0.to_be_bytes());
    out[25..33].copy_from_slice(&clock.to_be_bytes());
    out[33] = u8::from(reply);
    out
}

/// A column of a relation as pgoutput describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

/// A relation (table) description, sent before its first row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub replica_identity: u8,
    pub columns: Vec<Column>,
}

/// One column value of a tuple.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Datum<'a> {
    Null,
    /// An unchanged TOASTed value (only in updates).
    Unchanged,
    Text(&'a [u8]),
    Binary(&'a [u8]),
}

/// A pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage<'a> {
    Begin {
        final_lsn: Lsn,
        commit_time: i64,
        xid: u32,
    },
    Commit {
        flags: u8,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_time: i64,
    },
    Relation(Relation),
    Insert {
        relation: u32,
        tuple: Vec<Datum<'a>>,
    },
    /// A message this consumer does not need (origin, type, update, delete,
    /// truncate, logical message): only its tag is kept.
    Skipped(u8),
}

/// Most columns a tuple may claim; Postgres allows 1664 in a result row.
const MAX_COLUMNS: i16 = 1664;

/// Decodes one pgoutput message.
pub fn decode_logical(buf: &[u8]) -> Result<LogicalMessage<'_>, DecodeError> {
    let mut c = Cursor::new(buf, "pgoutput message");
    let tag = c.u8()?;
    match tag {
        b'B' => {
            c.what = "begin message";
            let final_lsn = Lsn(c.u64()?);
            let commit_time = c.i64()?;
            let xid = c.u32()?;
            Ok(LogicalMessage::Begin {
                final_lsn,
                commit_time,
                xid,
            })
        }
        b'C' => {
            c.what = "commit message";
            let flags = c.u8()?;
            let commit_lsn = Lsn(c.u64()?);
            let end_lsn = Lsn(c.u64()?);
            let commit_time = c.i64()?;
            Ok(LogicalMessage::Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_time,
            })
        }
        b'R' => {
            c.what = "relation message";
            let id = c.u32()?;
            let namespace = c.cstr()?;
            let name = c.cstr()?;
            let replica_identity = c.u8()?;
            let n = c.i16()?;
            if !(0..=MAX_COLUMNS).contains(&n) {
                return Err(c.err("column count out of range"));
            }
            let mut columns = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let flags = c.u8()?;
                let name = c.cstr()?;
                let type_oid = c.u32()?;
                let type_modifier = c.i32()?;
                columns.push(Column {
                    flags,
                    name,
                    type_oid,
                    type_modifier,
                });
            }
            Ok(LogicalMessage::Relation(Relation {
                id,
                namespace,
                name,
                replica_identity,
                columns,
            }))
        }
        b'I' => {
            c.what = "insert message";
            let relation = c.u32()?;
            if c.u8()? != b'N' {
                return Err(c.err("expected a new tuple ('N')"));
            }
            let tuple = decode_tuple(&mut c)?;
            if !c.done() {
                return Err(c.err("trailing bytes after the tuple"));
            }
            Ok(LogicalMessage::Insert { relation, tuple })
        }
        b'O' | b'Y' | b'U' | b'D' | b'T' | b'M' => Ok(LogicalMessage::Skipped(tag)),
        _ => Err(c.err("unknown pgoutput message tag")),
    }
}

fn decode_tuple<'a>(c: &mut Cursor<'a>) -> Result<Vec<Datum<'a>>, DecodeError> {
    let n = c.i16()?;
    if !(0..=MAX_COLUMNS).contains(&n) {
        return Err(c.err("column count out of range"));
    }
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let kind = c.u8()?;
        out.push(match kind {
            b'n' => Datum::Null,
            b'u' => Datum::Unchanged,
            b't' | b'b' => {
                let len = c.i32()?;
                if len < 0 {
                    return Err(c.err("negative value length"));
                }
                let v = c.take(len as usize)?;
                if kind == b't' {
                    Datum::Text(v)
                } else {
                    Datum::Binary(v)
                }
            }
            _ => return Err(c.err("unknown tuple value kind")),
        });
    }
    Ok(out)
}

/// Encoders of well-formed messages: for tests, and for the fixed WAL
/// sample the instruction gauge decodes.
pub mod encode {
    use super::*;
    use crate::types::{to_pg_time, Event};

    /// `strata.events` as pgoutput describes it, under relation id `id`.
    pub fn events_relation(id: u32) -> Relation {
        let columns = [
            "position",
            "stream",
            "version",
            "type",
            "payload",
            "metadata",
            "recorded_at",
            "xid",
        ];
        Relation {
            id,
            namespace: "strata".into(),
            name: "events".into(),
            replica_identity: b'd',
            columns: columns
                .iter()
                .map(|n| Column {
                    flags: 0,
                    name: (*n).into(),
                    type_oid: 0,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    /// The insert of `e` into `strata.events` (relation `relation`), every
    /// value in binary as the reader asks for it.
    pub fn event_insert(relation: u32, e: &Event) -> Vec<u8> {
        let position = (e.position.0 as i64).to_be_bytes();
        let version = (e.version as i64).to_be_bytes();
        let recorded_at = to_pg_time(e.recorded_at).to_be_bytes();
        let xid = (e.xid as i64).to_be_bytes();
        // jsonb's binary form: a version byte, then the text.
        let jsonb = |text: &str| {
            let mut v = vec![1u8];
            v.extend(text.as_bytes());
            v
        };
        let (payload, metadata) = (jsonb(&e.payload), jsonb(&e.metadata));
        insert(
            relation,
            &[
                Datum::Binary(&position),
                Datum::Binary(e.stream.as_bytes()),
                Datum::Binary(&version),
                Datum::Binary(e.event_type.as_bytes()),
                Datum::Binary(&payload),
                Datum::Binary(&metadata),
                Datum::Binary(&recorded_at),
                Datum::Binary(&xid),
            ],
        )
    }

    pub fn begin(final_lsn: Lsn, commit_time: i64, xid: u32) -> Vec<u8> {
        let mut v = vec![b'B'];
        v.extend(final_lsn.0.to_be_bytes());
        v.extend(commit_time.to_be_bytes());
        v.extend(xid.to_be_bytes());
        v
    }

    pub fn commit(flags: u8, commit_lsn: Lsn, end_lsn: Lsn, commit_time: i64) -> Vec<u8> {
        let mut v = vec![b'C', flags];
        v.extend(commit_lsn.0.to_be_bytes());
        v.extend(end_lsn.0.to_be_bytes());
        v.extend(commit_time.to_be_bytes());
        v
    }

    pub fn relation(r: &Relation) -> Vec<u8> {
        let mut v = vec![b'R'];
        v.extend(r.id.to_be_bytes());
        v.extend(r.namespace.as_bytes());
        v.push(0);
        v.extend(r.name.as_bytes());
        v.push(0);
        v.push(r.replica_identity);
        v.extend((r.columns.len() as i16).to_be_bytes());
        for c in &r.columns {
            v.push(c.flags);
            v.extend(c.name.as_bytes());
            v.push(0);
            v.extend(c.type_oid.to_be_bytes());
            v.extend(c.type_modifier.to_be_bytes());
        }
        v
    }

    pub fn insert(relation: u32, tuple: &[Datum<'_>]) -> Vec<u8> {
        let mut v = vec![b'I'];
        v.extend(relation.to_be_bytes());
        v.push(b'N');
        v.extend((tuple.len() as i16).to_be_bytes());
        for d in tuple {
            match d {
                Datum::Null => v.push(b'n'),
                Datum::Unchanged => v.push(b'u'),
                Datum::Text(b) | Datum::Binary(b) => {
                    v.push(if matches!(d, Datum::Text(_)) {
                        b't'
                    } else {
                        b'b'
                    });
                    v.extend((b.len() as i32).to_be_bytes());
                    v.extend(*b);
                }
            }
        }
        v
    }

    pub fn xlogdata(start: Lsn, end: Lsn, clock: i64, data: &[u8]) -> Vec<u8> {
        let mut v = vec![b'w'];
        v.extend(start.0.to_be_bytes());
        v.extend(end.0.to_be_bytes());
        v.extend(clock.to_be_bytes());
        v.extend(data);
        v
    }

    pub fn keepalive(end: Lsn, clock: i64, reply: bool) -> Vec<u8> {
        let mut v = vec![b'k'];
        v.extend(end.0.to_be_bytes());
        v.extend(clock.to_be_bytes());
        v.push(u8::from(reply));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::encode::*;
    use super::*;
    use proptest::prelude::*;

    fn rel() -> Relation {
        Relation {
            id: 16384,
            namespace: "strata".into(),
            name: "events".into(),
            replica_identity: b'd',
            columns: vec![
                Column {
                    flags: 1,
                    name: "position".into(),
                    type_oid: 20,
                    type_modifier: -1,
                },
                Column {
                    flags: 0,
                    name: "payload".into(),
                    type_oid: 3802,
                    type_modifier: -1,
                },
            ],
        }
    }

    #[test]
    fn decodes_each_message_kind() {
        assert_eq!(
            decode_logical(&begin(Lsn(10), 5, 77)).unwrap(),
            LogicalMessage::Begin {
                final_lsn: Lsn(10),
                commit_time: 5,
                xid: 77
            }
        );
        assert_eq!(
            decode_logical(&commit(0, Lsn(10), Lsn(11), 5)).unwrap(),
            LogicalMessage::Commit {
                flags: 0,
                commit_lsn: Lsn(10),
                end_lsn: Lsn(11),
                commit_time: 5
            }
        );
        assert_eq!(
            decode_logical(&relation(&rel())).unwrap(),
            LogicalMessage::Relation(rel())
        );
        let t = [
            Datum::Binary(&[0, 0, 0, 0, 0, 0, 0, 1]),
            Datum::Null,
            Datum::Text(b"x"),
            Datum::Unchanged,
        ];
        assert_eq!(
            decode_logical(&insert(7, &t)).unwrap(),
            LogicalMessage::Insert {
                relation: 7,
                tuple: t.to_vec()
            }
        );
        assert_eq!(
            decode_logical(b"Yxyz").unwrap(),
            LogicalMessage::Skipped(b'Y')
        );
        assert_eq!(
            decode_replication(&keepalive(Lsn(3), 4, true)).unwrap(),
            ReplicationMessage::Keepalive {
                end: Lsn(3),
                clock: 4,
                reply: true
            }
        );
        assert_eq!(
            decode_replication(&xlogdata(Lsn(1), Lsn(2), 3, b"abc")).unwrap(),
            ReplicationMessage::XLogData {
                start: Lsn(1),
                end: Lsn(2),
                clock: 3,
                data: b"abc"
            }
        );
    }

    #[test]
    fn rejects_malformed_messages_with_a_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "message is truncated"),
            (b"Z", "unknown pgoutput message tag"),
            (b"B\0\0", "message is truncated"),
            (b"R\0\0\0\x01strata", "string is not terminated"),
            (b"I\0\0\0\x01X", "expected a new tuple ('N')"),
            (b"I\0\0\0\x01N\xff\xff", "column count out of range"),
            (
                b"I\0\0\0\x01N\0\x01t\xff\xff\xff\xff",
                "negative value length",
            ),
            (b"I\0\0\0\x01N\0\x01t\0\0\0\x09ab", "message is truncated"),
            (b"I\0\0\0\x01N\0\x01q", "unknown tuple value kind"),
            (b"I\0\0\0\x01N\0\0extra", "trailing bytes after the tuple"),
        ];
        for (bytes, problem) in cases {
            let e = decode_logical(bytes).unwrap_err();
            assert_eq!(e.problem, *problem, "{bytes:?}");
        }
        assert_eq!(
            decode_replication(b"q").unwrap_err().problem,
            "unknown replication message tag"
        );
        assert_eq!(
            decode_replication(b"k\0").unwrap_err().problem,
            "message is truncated"
        );
    }

    #[test]
    fn status_update_layout() {
        let s = encode_status(Lsn(1), Lsn(2), Lsn(3), 4, true);
        assert_eq!(s[0], b'r');
        assert_eq!(&s[9..17], &2u64.to_be_bytes());
        assert_eq!(s[33], 1);
    }

    fn arb_datum() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..40)
    }

    proptest! {
        #[test]
        fn decoders_never_panic_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_logical(&bytes);
            let _ = decode_replication(&bytes);
        }

        #[test]
        fn decoders_never_panic_on_mutated_valid_messages(
            vals in proptest::collection::vec(arb_datum(), 0..6),
            flip in any::<usize>(), byte in any::<u8>(), cut in any::<usize>(),
        ) {
            let tuple: Vec<Datum<'_>> = vals.iter().map(|v| Datum::Binary(v)).collect();
            let mut msg = insert(42, &tuple);
            let i = flip % msg.len();
            msg[i] = byte;
            let cut = cut % (msg.len() + 1);
            let _ = decode_logical(&msg[..cut]);
            let _ = decode_logical(&msg);
        }

        #[test]
        fn insert_round_trips(vals in proptest::collection::vec(proptest::option::of(arb_datum()), 0..12), rel_id in any::<u32>()) {
            let tuple: Vec<Datum<'_>> = vals.iter().map(|v| match v { Some(b) => Datum::Binary(b), None => Datum::Null }).collect();
            let msg = insert(rel_id, &tuple);
            prop_assert_eq!(decode_logical(&msg).unwrap(), LogicalMessage::Insert { relation: rel_id, tuple: tuple.clone() });
        }

        #[test]
        fn relation_round_trips(names in proptest::collection::vec("[a-z_]{1,12}", 0..8), id in any::<u32>()) {
            let r = Relation {
                id, namespace: "ns".into(), name: "t".into(), replica_identity: b'd',
                columns: names.iter().map(|n| Column { flags: 0, name: n.clone(), type_oid: 25, type_modifier: -1 }).collect(),
            };
            let bytes = relation(&r);
            prop_assert_eq!(decode_logical(&bytes).unwrap(), LogicalMessage::Relation(r));
        }
    }
}
