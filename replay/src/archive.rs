//! Partition archives: a month's rows as an rkyv archive with a checked
//! header (magic, format, row count, payload length, checksum), written by
//! `strata partitions export` and replayed by `strata replay run --archive`.

use crate::seal::{partition_of, SealError};
use events::db::Sql;
use events::{Event, Position};
use std::time::{Duration, UNIX_EPOCH};
use tokio_postgres::Client;

const MAGIC: &[u8; 8] = b"STRATAPA";
const FORMAT: u32 = 1;
const HEADER: usize = 32;

/// One event row as archived.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Row {
    pub position: u64,
    pub stream: String,
    pub version: u64,
    pub event_type: String,
    pub payload: String,
    pub metadata: String,
    /// Microseconds since the Unix epoch.
    pub recorded_at_us: i64,
    pub xid: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error(transparent)]
    Seal(#[from] SealError),
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a partition archive: {0}")]
    Invalid(String),
}

fn checksum(bytes: &[u8]) -> [u8; 8] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref()[..8].try_into().expect("8 bytes")
}

/// Reads a month's rows (position order) and encodes them.
pub async fn export(client: &Client, month: &str) -> Result<(Vec<u8>, u64), ArchiveError> {
    let partition = partition_of(month)?;
    let sql = format!(
        "SELECT position, stream, version, type, payload::text, metadata::text,
                (extract(epoch FROM recorded_at) * 1000000)::bigint, xid::text::bigint
           FROM strata.{partition} WHERE position > $1 ORDER BY position LIMIT 50000"
    );
    let mut rows: Vec<Row> = Vec::new();
    let mut after = -1i64;
    loop {
        let page = client.rows(&sql, &[&after]).await?;
        if page.is_empty() {
            break;
        }
        for r in &page {
            after = r.get(0);
            rows.push(Row {
                position: r.get::<_, i64>(0) as u64,
                stream: r.get(1),
                version: r.get::<_, i64>(2) as u64,
                event_type: r.get(3),
                payload: r.get(4),
                metadata: r.get(5),
                recorded_at_us: r.get(6),
                xid: r.get::<_, i64>(7) as u64,
            });
        }
    }
    let n = rows.len() as u64;
    let payload = rkyv::to_bytes::<rkyv::rancor::Error>(&rows).expect("rows serialize");
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&checksum(&payload));
    out.extend_from_slice(&payload);
    Ok((out, n))
}

impl ArchivedRow {
    /// The event without its payload and metadata (for a projection that
    /// takes the fact parsed from [`ArchivedRow::payload`]).
    pub fn to_event_without_payload(&self) -> Event {
        let us = self.recorded_at_us.to_native();
        Event {
            position: Position(self.position.to_native()),
            stream: self.stream.as_str().to_string(),
            version: self.version.to_native(),
            event_type: self.event_type.as_str().to_string(),
            payload: String::new(),
            metadata: String::new(),
            recorded_at: UNIX_EPOCH + Duration::from_micros(us.max(0) as u64),
            xid: self.xid.to_native(),
        }
    }

    /// The event, read straight from the archive.
    pub fn to_event(&self) -> Event {
        Event {
            payload: self.payload.as_str().to_string(),
            metadata: self.metadata.as_str().to_string(),
            ..self.to_event_without_payload()
        }
    }
}

/// An archive read into memory with its header and checksum checked; its
/// rows are read in place ([`Archive::rows`]), not copied out.
pub struct Archive {
    bytes: rkyv::util::AlignedVec<16>,
    rows: u64,
}

impl Archive {
    pub fn open(bytes: &[u8]) -> Result<Archive, ArchiveError> {
        let (n, payload) = check_header(bytes)?;
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(payload.len());
        aligned.extend_from_slice(payload);
        Ok(Archive {
            bytes: aligned,
            rows: n,
        })
    }

    /// The rows, after validating the archive's structure.
    pub fn rows(&self) -> Result<&rkyv::vec::ArchivedVec<ArchivedRow>, ArchiveError> {
        let rows =
            rkyv::access::<rkyv::vec::ArchivedVec<ArchivedRow>, rkyv::rancor::Error>(&self.bytes)
                .map_err(|e| ArchiveError::Invalid(format!("archive does not validate: {e}")))?;
        if rows.len() as u64 != self.rows {
            return Err(ArchiveError::Invalid(format!(
                "{} rows, header says {}",
                rows.len(),
                self.rows
            )));
        }
        Ok(rows)
    }
}

fn check_header(bytes: &[u8]) -> Result<(u64, &[u8]), ArchiveError> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err(ArchiveError::Invalid("bad magic or short header".into()));
    }
    let format = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if format != FORMAT {
        return Err(ArchiveError::Invalid(format!(
            "format {format}, this build reads {FORMAT}"
        )));
    }
    let n = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    let payload = &bytes[HEADER..];
    if checksum(payload) != bytes[24..32] {
        return Err(ArchiveError::Invalid(
            "checksum mismatch (altered or truncated)".into(),
        ));
    }
    Ok((n, payload))
}

/// Records an export (after the file is safely written).
pub async fn record_export(
    client: &Client,
    month: &str,
    path: &std::path::Path,
    rows: u64,
    bytes: &[u8],
) -> Result<(), ArchiveError> {
    let partition = partition_of(month)?;
    let sum = events::hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    client
        .exec(
            "INSERT INTO strata.partition_exports (partition, path, rows, checksum) VALUES ($1, $2, $3, $4)",
            &[&partition, &path.display().to_string(), &(rows as i64), &sum],
        )
        .await?;
    Ok(())
}

/// A month that retirement considered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retirement {
    pub partition: String,
    /// `None` when dropped; otherwise why it was kept.
    pub refused: Option<String>,
}

/// Detaches and drops one partition in one transaction, its lock waits
/// bounded, trying again while a reader holds the table.
async fn detach_and_drop(client: &Client, partition: &str) -> Result<(), ArchiveError> {
    let sql = format!(
        "BEGIN; SET LOCAL lock_timeout = '{}';
         ALTER TABLE strata.events DETACH PARTITION strata.{partition};
         DROP TABLE strata.{partition}; COMMIT;",
        schema::ddl::DDL_LOCK_TIMEOUT
    );
    let mut retries = schema::ddl::LockRetries::new(schema::ddl::LockRetries::DEFAULT_TRIES);
    loop {
        match client.batch_execute(&sql).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                let _ = client.batch_execute("ROLLBACK").await;
                let locked = e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE);
                if !retries
                    .again(locked, &format!("detaching {partition}"))
                    .await
                {
                    return Err(e.into());
                }
            }
        }
    }
}

/// Detaches and drops the monthly partitions that ended more than `months`
/// months ago, each only if it is sealed and exported with the sealed row
/// count (and still holds exactly those rows). With `dry_run`, only says.
pub async fn retire(
    client: &Client,
    months: u32,
    dry_run: bool,
) -> Result<Vec<Retirement>, ArchiveError> {
    let rows = client
        .rows(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'strata.events'::regclass
                AND c.relname::text < 'events_' || to_char(date_trunc('month', now() AT TIME ZONE 'UTC') - make_interval(months => $1), 'YYYY_MM')
              ORDER BY 1",
            &[&(months as i32)],
        )
        .await?;
    let mut out = Vec::new();
    for r in rows {
        let partition: String = r.get(0);
        let sealed: Option<i64> = client
            .opt(
                "SELECT rows FROM strata.seals WHERE partition = $1",
                &[&partition],
            )
            .await?
            .map(|r| r.get(0));
        let exported: Option<i64> = client
            .opt(
                "SELECT rows FROM strata.partition_exports WHERE partition = $1 ORDER BY exported_at DESC LIMIT 1",
                &[&partition],
            )
            .await?
            .map(|r| r.get(0));
        let now_rows: i64 = client
            .one(&format!("SELECT count(*) FROM strata.{partition}"), &[])
            .await?
            .get(0);
        let refused = match (sealed, exported) {
            (None, _) => Some("not sealed (strata partitions seal)".to_string()),
            (_, None) => Some("not exported (strata partitions export)".to_string()),
            (Some(s), Some(e)) if s != e => {
                Some(format!("sealed with {s} rows but exported with {e}"))
            }
            (Some(s), _) if s != now_rows => Some(format!(
                "sealed with {s} rows but holds {now_rows} now (strata audit verify)"
            )),
            _ => None,
        };
        if refused.is_none() && !dry_run {
            detach_and_drop(client, &partition).await?;
        }
        out.push(Retirement { partition, refused });
    }
    Ok(out)
}
