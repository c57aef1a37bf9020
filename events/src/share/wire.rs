//! The log share's frames on the wire (pure): what a sharing reader sends a
//! follower over a local socket, and the bounds-checked decoder of them.
//!
//! ```text
//!  frame   = length: u32 LE (of body) , body
//!  body    = 0 , magic "strata-log-share" , version: u32          (Hello, first)
//!          | 1 , position: u64                                    (Head)
//!          | 2 , head: u64                                        (Keepalive)
//!          | 3 , xid: u32 , commit_lsn: u64 , end_lsn: u64 , commit_time: i64 ,
//!              count: u32 , event*                                (Txn)
//!  event   = position: u64 , stream: str , version: u64 , type: str ,
//!            payload: str , metadata: str , recorded_at: i64 , xid: u64
//!  str     = length: u32 , UTF-8 bytes
//! ```
//!
//! Integers are little-endian; times are PostgreSQL's (microseconds since
//! 2000-01-01), which is what the log stores. A decoder never panics: every
//! length is checked against what is left before it is used.

use crate::types::{pg_time, to_pg_time, Event, Lsn, Position, Txn};
use std::sync::Arc;

/// Opens every share connection, with [`VERSION`].
pub const MAGIC: &[u8] = b"strata-log-share";
/// The frames' version; a follower refuses any other.
pub const VERSION: u32 = 1;
/// Largest body a follower accepts (a placer's batch of 1,024 placements
/// is about 2 MiB).
pub const MAX_FRAME: usize = 256 << 20;

/// One frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// The sharer's greeting and version.
    Hello { version: u32 },
    /// Every position up to this one is committed and readable from the
    /// table; later ones follow as `Txn`.
    Head(Position),
    /// The sharer is alive; its reader's head.
    Keepalive(Position),
    /// A committed transaction of the log.
    Txn(Arc<Txn>),
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("the frame ends early: {0}")]
    Short(&'static str),
    #[error("unknown frame tag {0}")]
    Tag(u8),
    #[error("not a Strata log share (bad greeting)")]
    Magic,
    #[error("a frame of {0} bytes is larger than {MAX_FRAME}")]
    TooLarge(usize),
    #[error("{0} is not UTF-8")]
    Utf8(&'static str),
    #[error("{0} bytes left over after the frame")]
    Trailing(usize),
}

/// Appends `frame`, length first, to `out`.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    match frame {
        Frame::Hello { version } => {
            out.push(0);
            out.extend_from_slice(MAGIC);
            out.extend_from_slice(&version.to_le_bytes());
        }
        Frame::Head(p) => {
            out.push(1);
            out.extend_from_slice(&p.0.to_le_bytes());
        }
        Frame::Keepalive(p) => {
            out.push(2);
            out.extend_from_slice(&p.0.to_le_bytes());
        }
        Frame::Txn(t) => {
            out.push(3);
            out.extend_from_slice(&t.xid.to_le_bytes());
            out.extend_from_slice(&t.commit_lsn.0.to_le_bytes());
            out.extend_from_slice(&t.end_lsn.0.to_le_bytes());
            out.extend_from_slice(&to_pg_time(t.commit_time).to_le_bytes());
            out.extend_from_slice(&(t.events.len() as u32).to_le_bytes());
            for e in &t.events {
                out.extend_from_slice(&e.position.0.to_le_bytes());
                put_str(out, &e.stream);
                out.extend_from_slice(&e.version.to_le_bytes());
                put_str(out, &e.event_type);
                put_str(out, &e.payload);
                put_str(out, &e.metadata);
                out.extend_from_slice(&to_pg_time(e.recorded_at).to_le_bytes());
                out.extend_from_slice(&e.xid.to_le_bytes());
            }
        }
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The body length a frame's 4-byte prefix announces, checked.
pub fn body_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len));
    }
    Ok(len)
}

/// Decodes one frame's body (without its length prefix).
pub fn decode(body: &[u8]) -> Result<Frame, WireError> {
    let mut r = Cursor(body);
    let frame = match r.u8("tag")? {
        0 => {
            if r.take(MAGIC.len(), "greeting")? != MAGIC {
                return Err(WireError::Magic);
            }
            Frame::Hello {
                version: r.u32("version")?,
            }
        }
        1 => Frame::Head(Position(r.u64("head")?)),
        2 => Frame::Keepalive(Position(r.u64("keepalive")?)),
        3 => {
            let xid = r.u32("xid")?;
            let commit_lsn = Lsn(r.u64("commit LSN")?);
            let end_lsn = Lsn(r.u64("end LSN")?);
            let commit_time = pg_time(r.i64("commit time")?);
            let count = r.u32("event count")? as usize;
            // Each event takes at least 48 bytes: a count the body cannot
            // hold is refused before anything is reserved for it.
            if count > r.0.len() / 48 {
                return Err(WireError::Short("events"));
            }
            let mut events = Vec::with_capacity(count);
            for _ in 0..count {
                events.push(Arc::new(Event {
                    position: Position(r.u64("position")?),
                    stream: r.str("stream")?,
                    version: r.u64("version")?,
                    event_type: r.str("type")?,
                    payload: r.str("payload")?,
                    metadata: r.str("metadata")?,
                    recorded_at: pg_time(r.i64("recorded at")?),
                    xid: r.u64("event xid")?,
                }));
            }
            Frame::Txn(Arc::new(Txn {
                xid,
                commit_lsn,
                end_lsn,
                commit_time,
                events,
            }))
        }
        t => return Err(WireError::Tag(t)),
    };
    if !r.0.is_empty() {
        return Err(WireError::Trailing(r.0.len()));
    }
    Ok(frame)
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Short(what));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn i64(&mut self, what: &'static str) -> Result<i64, WireError> {
        self.array(what).map(i64::from_le_bytes)
    }

    fn str(&mut self, what: &'static str) -> Result<String, WireError> {
        let len = self.u32(what)? as usize;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::Utf8(what))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn txn(events: Vec<(u64, String, String)>) -> Frame {
        Frame::Txn(Arc::new(Txn {
            xid: 7,
            commit_lsn: Lsn(0x1_0000_0010),
            end_lsn: Lsn(0x1_0000_0040),
            commit_time: pg_time(851_000_000_123_456),
            events: events
                .into_iter()
                .map(|(p, stream, payload)| {
                    Arc::new(Event {
                        position: Position(p),
                        stream,
                        version: p + 1,
                        event_type: "reservation.placed".into(),
                        payload,
                        metadata: "{}".into(),
                        recorded_at: pg_time(851_000_000_000_001),
                        xid: 7,
                    })
                })
                .collect(),
        }))
    }

    fn body(frame: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        encode(frame, &mut out);
        let len = body_len(out[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, out.len() - 4);
        out.split_off(4)
    }

    #[test]
    fn every_frame_comes_back_as_it_was_sent() {
        for f in [
            Frame::Hello { version: VERSION },
            Frame::Head(Position(42)),
            Frame::Keepalive(Position(u64::MAX)),
            txn(vec![]),
            txn(vec![
                (1, "pool/a".into(), r#"{"node":"n-1"}"#.into()),
                (2, "reservation/r-é".into(), "{}".into()),
            ]),
        ] {
            assert_eq!(decode(&body(&f)).unwrap(), f);
        }
    }

    #[test]
    fn a_greeting_of_another_program_or_a_lying_length_is_refused() {
        let mut b = body(&Frame::Hello { version: VERSION });
        b[3] ^= 1;
        assert_eq!(decode(&b), Err(WireError::Magic));
        assert!(matches!(
            body_len(u32::MAX.to_le_bytes()),
            Err(WireError::TooLarge(_))
        ));
        // A count of events the body cannot hold reserves nothing.
        let mut b = body(&txn(vec![]));
        let n = b.len();
        b[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&b), Err(WireError::Short("events")));
    }

    proptest! {
        #[test]
        fn the_decoder_never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn the_decoder_never_panics_on_a_damaged_frame(
            events in proptest::collection::vec((any::<u64>(), ".{0,12}", ".{0,40}"), 0..4),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let f = txn(events);
            let b = body(&f);
            prop_assert_eq!(decode(&b).unwrap(), f);
            let _ = decode(&b[..cut.index(b.len() + 1)]);
            let mut d = b.clone();
            if !d.is_empty() {
                let i = flip.index(d.len());
                d[i] ^= 1 << bit;
                let _ = decode(&d);
            }
        }
    }
}
