//! Rebuilding a projection from history at the speed of `COPY`.
//!
//! The log is read with one `COPY (SELECT ... ORDER BY position) TO STDOUT
//! (FORMAT binary)` below the high-water mark (the durable head read first:
//! every position up to it is committed, so the COPY's snapshot holds them
//! all and nothing above it is read). Rows are decoded from the binary format
//! on the reading task and handed in batches to a thread that applies them,
//! so decoding and applying run side by side.

use crate::archive::ArchivedRow;
use bytes::{Buf, BytesMut};
use domain::Fact;
use events::replication::{ReplicationConnection, ReplicationError};
use events::{Event, Position};
use projections::views::{Parsed, Projection};
use projections::{ApplyError, Violation};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};
use tokio_postgres::Client;

/// Events handed to the applying thread at a time.
pub const BATCH: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("database: {0}")]
    Db(#[from] tokio_postgres::Error),
    #[error("database: {0}")]
    Connection(#[from] ReplicationError),
    #[error("COPY data: {0}")]
    Decode(String),
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("the applying thread stopped")]
    Stopped,
}

/// Counters a progress display reads while a replay runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Events applied.
    pub applied: AtomicU64,
    /// The position replay runs to.
    pub target: AtomicU64,
    /// The position it started after.
    pub start: AtomicU64,
    pub violations: AtomicU64,
}

/// Decodes PostgreSQL's binary COPY format, rows of
/// `position, stream, version, type, payload, metadata, recorded_at, xid`,
/// into events with their facts parsed straight from the buffer. A
/// projection reads the parsed fact, so the event's `payload` and
/// `metadata` are left empty (no copy is made of them).
#[derive(Default)]
pub struct CopyDecoder {
    buf: BytesMut,
    header: bool,
    done: bool,
}

const SIGNATURE: &[u8] = b"PGCOPY\n\xff\r\n\0";
/// 2000-01-01 in Unix seconds: PostgreSQL's epoch for timestamps.
const PG_EPOCH: u64 = 946_684_800;

impl CopyDecoder {
    /// Takes a chunk of COPY data; appends every complete row to `out`.
    pub fn push(
        &mut self,
        chunk: &[u8],
        out: &mut Vec<(Event, Parsed)>,
    ) -> Result<(), ReplayError> {
        if self.header && self.buf.is_empty() {
            // The common case: whole rows in the chunk, read in place.
            let used = self.rows(chunk, out)?;
            self.buf.extend_from_slice(&chunk[used..]);
            return Ok(());
        }
        self.buf.extend_from_slice(chunk);
        if !self.header {
            if self.buf.len() < SIGNATURE.len() + 8 {
                return Ok(());
            }
            if &self.buf[..SIGNATURE.len()] != SIGNATURE {
                return Err(ReplayError::Decode("not binary COPY data".into()));
            }
            let ext = u32::from_be_bytes(self.buf[15..19].try_into().expect("4 bytes")) as usize;
            if self.buf.len() < 19 + ext {
                return Ok(());
            }
            self.buf.advance(19 + ext);
            self.header = true;
        }
        let buf = std::mem::take(&mut self.buf);
        let used = self.rows(&buf, out)?;
        self.buf = buf;
        self.buf.advance(used);
        Ok(())
    }

    /// Decodes the whole rows at the start of `b` (and the trailer); returns
    /// the bytes they took.
    fn rows(&mut self, b: &[u8], out: &mut Vec<(Event, Parsed)>) -> Result<usize, ReplayError> {
        let mut at = 0;
        while !self.done {
            match tuple(&b[at..])? {
                Some((Some(e), n)) => {
                    out.push(e);
                    at += n;
                }
                Some((None, n)) => {
                    self.done = true;
                    at += n;
                }
                None => break,
            }
        }
        Ok(at)
    }

    /// True once the trailer was read and nothing is left over.
    pub fn finished(&self) -> bool {
        self.done && self.buf.is_empty()
    }
}

fn field(b: &[u8], at: &mut usize) -> Result<Option<Option<std::ops::Range<usize>>>, ReplayError> {
    if b.len() < *at + 4 {
        return Ok(None);
    }
    let len = i32::from_be_bytes(b[*at..*at + 4].try_into().expect("4 bytes"));
    *at += 4;
    if len < 0 {
        return Ok(Some(None));
    }
    let len = len as usize;
    if b.len() < *at + len {
        return Ok(None);
    }
    let r = *at..*at + len;
    *at += len;
    Ok(Some(Some(r)))
}

fn bad(what: &str) -> ReplayError {
    ReplayError::Decode(format!("unexpected {what}"))
}

/// One tuple: `Some((Some(event), bytes))`, the trailer `Some((None, 2))`,
/// or `None` when the buffer does not hold a whole tuple yet.
#[allow(clippy::type_complexity)]
fn tuple(b: &[u8]) -> Result<Option<(Option<(Event, Parsed)>, usize)>, ReplayError> {
    if b.len() < 2 {
        return Ok(None);
    }
    let n = i16::from_be_bytes([b[0], b[1]]);
    if n == -1 {
        return Ok(Some((None, 2)));
    }
    if n != 8 {
        return Err(ReplayError::Decode(format!("{n} columns, expected 8")));
    }
    let mut at = 2;
    let mut f = [0usize..0, 0..0, 0..0, 0..0, 0..0, 0..0, 0..0, 0..0];
    for slot in f.iter_mut() {
        match field(b, &mut at)? {
            None => return Ok(None),
            Some(None) => return Err(bad("NULL column")),
            Some(Some(r)) => *slot = r,
        }
    }
    let int8 = |r: &std::ops::Range<usize>, what| -> Result<i64, ReplayError> {
        Ok(i64::from_be_bytes(
            b[r.clone()].try_into().map_err(|_| bad(what))?,
        ))
    };
    let text = |r: &std::ops::Range<usize>, what| -> Result<String, ReplayError> {
        String::from_utf8(b[r.clone()].to_vec()).map_err(|_| bad(what))
    };
    let jsonb = |r: &std::ops::Range<usize>, what| -> Result<&str, ReplayError> {
        let s = &b[r.clone()];
        match s.split_first() {
            Some((1, rest)) => std::str::from_utf8(rest).map_err(|_| bad(what)),
            _ => Err(bad(what)),
        }
    };
    let us = int8(&f[6], "recorded_at")?;
    let base = UNIX_EPOCH + Duration::from_secs(PG_EPOCH);
    let recorded_at = if us >= 0 {
        base.checked_add(Duration::from_micros(us as u64))
    } else {
        base.checked_sub(Duration::from_micros(us.unsigned_abs()))
    }
    .ok_or_else(|| bad("recorded_at"))?;
    let event_type = text(&f[3], "type")?;
    let parsed = Fact::parse(
        &event_type,
        jsonb(&f[4], "payload")?,
        jsonb(&f[5], "metadata")?,
    );
    let e = Event {
        position: Position(int8(&f[0], "position")? as u64),
        stream: text(&f[1], "stream")?,
        version: int8(&f[2], "version")? as u64,
        event_type,
        payload: String::new(),
        metadata: String::new(),
        recorded_at,
        xid: int8(&f[7], "xid")? as u64,
    };
    Ok(Some((Some((e, parsed)), at)))
}

/// The statement that reads positions `(after, until]` in order.
pub fn copy_sql(after: u64, until: u64) -> String {
    format!(
        "COPY (SELECT position, stream, version, type, payload, metadata, recorded_at, xid
                 FROM strata.events WHERE position > {after} AND position <= {until}
                ORDER BY position) TO STDOUT (FORMAT binary)"
    )
}

/// Applies batches on a thread of its own; returns the projection.
fn applier<P: Projection>(
    mut projection: P,
    progress: Arc<Progress>,
    mut rx: tokio::sync::mpsc::Receiver<Vec<(Event, Parsed)>>,
    mut on_violation: impl FnMut(Violation) + Send + 'static,
) -> std::thread::JoinHandle<Result<P, ApplyError>> {
    std::thread::Builder::new()
        .name("replay-apply".into())
        .spawn(move || {
            while let Some(batch) = rx.blocking_recv() {
                let n = batch.len() as u64;
                apply_batch(&mut projection, batch, &progress, &mut on_violation)?;
                progress.applied.fetch_add(n, Ordering::Relaxed);
            }
            Ok(projection)
        })
        .expect("spawn the replay thread")
}

fn apply_batch<P: Projection>(
    projection: &mut P,
    batch: Vec<(Event, Parsed)>,
    progress: &Progress,
    on_violation: &mut impl FnMut(Violation),
) -> Result<(), ApplyError> {
    for (e, parsed) in batch {
        if let Some(v) = projection.apply_parsed(&e, parsed)? {
            progress.violations.fetch_add(1, Ordering::Relaxed);
            on_violation(v);
        }
    }
    Ok(())
}

async fn join<P: Send + 'static>(
    h: std::thread::JoinHandle<Result<P, ApplyError>>,
) -> Result<P, ReplayError> {
    tokio::task::spawn_blocking(move || h.join())
        .await
        .map_err(|_| ReplayError::Stopped)?
        .map_err(|_| ReplayError::Stopped)?
        .map_err(ReplayError::from)
}

/// Replays positions after the projection's own up to `until` (at most the
/// durable head) from Postgres into `projection`. `client` reads the head;
/// the rows come over a connection of its own to `db`, read in whole
/// buffers.
pub async fn from_postgres<P: Projection>(
    db: &events::db::Database,
    client: &Client,
    projection: P,
    until: Option<u64>,
    progress: Arc<Progress>,
    on_violation: impl FnMut(Violation) + Send + 'static,
) -> Result<P, ReplayError> {
    let head = events::read::head(client).await?.0;
    let after = projection.position();
    let until = until.unwrap_or(head).min(head);
    progress.start.store(after, Ordering::Relaxed);
    progress.target.store(until.max(after), Ordering::Relaxed);
    if until <= after {
        return Ok(projection);
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<(Event, Parsed)>>(8);
    let handle = applier(projection, progress.clone(), rx, on_violation);
    let read = async {
        let mut conn = ReplicationConnection::connect_session(db, "strata-replay", None).await?;
        conn.copy_out_start(&copy_sql(after, until)).await?;
        let mut decoder = CopyDecoder::default();
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            let more = conn
                .copy_data(|chunk| decoder.push(chunk, &mut batch))
                .await?;
            if !more {
                break;
            }
            if batch.len() >= BATCH {
                let full = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
                tx.send(full).await.map_err(|_| ReplayError::Stopped)?;
            }
        }
        if !decoder.finished() {
            return Err(ReplayError::Decode("the COPY data ended early".into()));
        }
        if !batch.is_empty() {
            tx.send(batch).await.map_err(|_| ReplayError::Stopped)?;
        }
        Ok::<(), ReplayError>(())
    };
    let read_result = read.await;
    drop(tx);
    let projection = join(handle).await;
    read_result?;
    projection
}

/// Replays archived rows (up to `until`) into `projection`: one thread
/// reads rows out of the archive and parses their facts, this one applies.
pub fn from_archive<P: Projection>(
    mut projection: P,
    rows: &[ArchivedRow],
    until: Option<u64>,
    progress: &Progress,
    mut on_violation: impl FnMut(Violation),
) -> Result<P, ReplayError> {
    let after = projection.position();
    let until = until.unwrap_or(u64::MAX);
    let start = rows.partition_point(|r| r.position.to_native() <= after);
    let end = rows.partition_point(|r| r.position.to_native() <= until);
    let rows = &rows[start..end.max(start)];
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(Event, Parsed)>>(8);
        s.spawn(move || {
            for chunk in rows.chunks(BATCH) {
                let batch = chunk
                    .iter()
                    .map(|r| {
                        // The fact is parsed in place; payload and metadata
                        // are not copied (see CopyDecoder).
                        let p = Fact::parse(
                            r.event_type.as_str(),
                            r.payload.as_str(),
                            r.metadata.as_str(),
                        );
                        (r.to_event_without_payload(), p)
                    })
                    .collect();
                if tx.send(batch).is_err() {
                    return;
                }
            }
        });
        for batch in rx {
            let n = batch.len() as u64;
            apply_batch(&mut projection, batch, progress, &mut on_violation)?;
            progress.applied.fetch_add(n, Ordering::Relaxed);
        }
        Ok(projection)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// position, stream, version, type, payload, metadata, recorded_at, xid
    type TestRow<'a> = (i64, &'a str, i64, &'a str, &'a str, &'a str, i64, i64);

    fn encode(rows: &[TestRow<'_>]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(SIGNATURE);
        b.extend_from_slice(&0u32.to_be_bytes());
        b.extend_from_slice(&0u32.to_be_bytes());
        for (p, s, v, t, pl, md, at, x) in rows {
            b.extend_from_slice(&8i16.to_be_bytes());
            let mut put = |bytes: &[u8]| {
                b.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
                b.extend_from_slice(bytes);
            };
            put(&p.to_be_bytes());
            put(s.as_bytes());
            put(&v.to_be_bytes());
            put(t.as_bytes());
            put(&[&[1u8][..], pl.as_bytes()].concat());
            put(&[&[1u8][..], md.as_bytes()].concat());
            put(&at.to_be_bytes());
            put(&x.to_be_bytes());
        }
        b.extend_from_slice(&(-1i16).to_be_bytes());
        b
    }

    #[test]
    fn decodes_rows_split_at_any_byte() {
        let data = encode(&[
            (1, "pool/a", 1, "PoolCreated", "{}", "{}", 1_000_000, 7),
            (
                2,
                "pool/a",
                2,
                "NodeJoined",
                "{\"node\":\"n\"}",
                "{}",
                2_000_000,
                8,
            ),
        ]);
        for cut in 0..data.len() {
            let mut d = CopyDecoder::default();
            let mut out = Vec::new();
            d.push(&data[..cut], &mut out).unwrap();
            d.push(&data[cut..], &mut out).unwrap();
            assert!(d.finished());
            assert_eq!(out.len(), 2);
            assert!(
                matches!(&out[1].1, Err(e) if e.contains("node.joined")),
                "{:?}",
                out[1].1
            );
            assert!(matches!(&out[0].1, Ok(Some(Fact::PoolCreated { .. }))));
            assert_eq!(out[1].0.stream, "pool/a");
            assert_eq!(
                out[0].0.recorded_at,
                UNIX_EPOCH + Duration::from_secs(PG_EPOCH + 1)
            );
        }
    }

    #[test]
    fn malformed_copy_data_is_an_error_never_a_panic() {
        let good = encode(&[(1, "s", 1, "T", "{}", "{}", 0, 0)]);
        for i in 0..good.len() {
            for b in [0u8, 0xff, 0x7f] {
                let mut data = good.clone();
                data[i] = b;
                let mut d = CopyDecoder::default();
                let _ = d.push(&data, &mut Vec::new());
            }
        }
        let mut d = CopyDecoder::default();
        assert!(d
            .push(b"PGCOPX\n\xff\r\n\0\0\0\0\0\0\0\0\0", &mut Vec::new())
            .is_err());
    }
}
