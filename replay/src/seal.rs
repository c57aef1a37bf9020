//! Sealing a monthly partition and verifying it later.
//!
//! A row's digest is SHA-256 over its columns as text, separated by 0x1f:
//! position, stream, version, type, payload, metadata, recorded_at, xid. The
//! chain folds the digests in position order. A seal stores the chain's head
//! and, per segment of 1,000 rows, the positions and the first 8 bytes of
//! each digest; verification recomputes everything and names the first row
//! that was altered, inserted or deleted since.

use events::db::Sql;
use ring::digest::{Context, SHA256};
use std::collections::BTreeMap;
use tokio_postgres::Client;

const SEGMENT: usize = 1000;

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("month {0:?}: use YYYY-MM")]
    BadMonth(String),
    #[error("partition {0} does not exist")]
    NoPartition(String),
    #[error("partition {0} is already sealed (at {1})")]
    AlreadySealed(String, String),
    #[error("partition {0} has no seal (strata partitions seal)")]
    NotSealed(String),
    #[error("partition {partition} was altered after the checkpoint at position {last_position} (taken {taken_at}): a row at or before it differs; refusing to seal; `strata audit verify` names the range")]
    CheckpointBroken {
        partition: String,
        last_position: u64,
        taken_at: String,
    },
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
}

/// `2026-11` -> `events_2026_11`.
pub fn partition_of(month: &str) -> Result<String, SealError> {
    let ok = month.len() == 7
        && month.as_bytes()[4] == b'-'
        && month[..4].chars().all(|c| c.is_ascii_digit())
        && month[5..]
            .parse::<u32>()
            .is_ok_and(|m| (1..=12).contains(&m));
    if !ok {
        return Err(SealError::BadMonth(month.to_string()));
    }
    Ok(format!("events_{}_{}", &month[..4], &month[5..]))
}

/// What a seal covers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Seal {
    pub partition: String,
    pub rows: u64,
    pub first_position: Option<u64>,
    pub last_position: Option<u64>,
    pub chain: String,
}

/// What verification found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum Finding {
    Intact {
        rows: u64,
    },
    Altered {
        position: u64,
    },
    Inserted {
        position: u64,
    },
    Deleted {
        position: u64,
    },
    /// The open month no longer matches a running checkpoint: a row with a
    /// position in `(after, up_to]` was altered, inserted or deleted.
    CheckpointBroken {
        after: u64,
        up_to: u64,
    },
    /// The open month matches all its checkpoints.
    CheckpointsIntact {
        rows: u64,
        checkpoints: u64,
    },
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Finding::Intact { rows } => write!(f, "intact: {rows} rows match the seal"),
            Finding::Altered { position } => {
                write!(f, "the row at position {position} was altered")
            }
            Finding::Inserted { position } => {
                write!(f, "a row at position {position} was inserted")
            }
            Finding::Deleted { position } => {
                write!(f, "the row at position {position} was deleted")
            }
            Finding::CheckpointBroken { after, up_to } => write!(
                f,
                "the month no longer matches its running checkpoint: a row with a position after {after} and at most {up_to} was altered, inserted or deleted"
            ),
            Finding::CheckpointsIntact { rows, checkpoints } => write!(
                f,
                "not sealed yet (the month is open): {rows} rows match its {checkpoints} running checkpoint(s)"
            ),
        }
    }
}

use events::hex;

async fn exists(client: &Client, partition: &str) -> Result<bool, SealError> {
    Ok(client
        .opt(
            "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'strata' AND c.relname = $1",
            &[&partition],
        )
        .await?
        .is_some())
}

/// Rows of a partition in position order, digested, page by page.
async fn digests(
    client: &Client,
    partition: &str,
    each: impl FnMut(u64, [u8; 32]),
) -> Result<u64, SealError> {
    digests_between(client, partition, -1, i64::MAX, each).await
}

/// Rows with `after < position <= up_to`, digested in position order.
async fn digests_between(
    client: &Client,
    partition: &str,
    after: i64,
    up_to: i64,
    mut each: impl FnMut(u64, [u8; 32]),
) -> Result<u64, SealError> {
    let sql = format!(
        "SELECT position, stream, version::text, type, payload::text, metadata::text,
                recorded_at::text, xid::text
           FROM strata.{partition} WHERE position > $1 AND position <= $2
          ORDER BY position LIMIT 10000"
    );
    let mut after = after;
    let mut n = 0u64;
    loop {
        let rows = client.rows(&sql, &[&after, &up_to]).await?;
        if rows.is_empty() {
            return Ok(n);
        }
        for r in &rows {
            let position: i64 = r.get(0);
            let mut ctx = Context::new(&SHA256);
            ctx.update(position.to_string().as_bytes());
            for i in 1..8 {
                ctx.update(&[0x1f]);
                ctx.update(r.get::<_, &str>(i).as_bytes());
            }
            let d: [u8; 32] = ctx.finish().as_ref().try_into().expect("32 bytes");
            each(position as u64, d);
            after = position;
            n += 1;
        }
    }
}

fn link(chain: &mut [u8; 32], d: &[u8; 32]) {
    let mut ctx = Context::new(&SHA256);
    ctx.update(chain);
    ctx.update(d);
    chain.copy_from_slice(ctx.finish().as_ref());
}

/// Follows a chain being recomputed past the checkpoints taken of it and
/// finds the first one it does not pass through.
struct CheckpointWalk<'a> {
    checkpoints: &'a [Checkpoint],
    next: usize,
    broken: Option<usize>,
}

impl<'a> CheckpointWalk<'a> {
    fn new(checkpoints: &'a [Checkpoint]) -> Self {
        CheckpointWalk {
            checkpoints,
            next: 0,
            broken: None,
        }
    }

    /// Before the row at `position` is linked: every checkpoint below it must
    /// equal the chain so far (`last`: the last position linked, 0 for none).
    fn before_row(&mut self, position: u64, last: u64, chain: &[u8; 32]) {
        while self.broken.is_none()
            && self.next < self.checkpoints.len()
            && position > self.checkpoints[self.next].last_position
        {
            self.check(last, chain);
        }
    }

    /// After the last row: the checkpoints left must equal the final chain.
    /// Returns the index of the first broken checkpoint.
    fn finish(mut self, last: u64, chain: &[u8; 32]) -> Option<usize> {
        while self.broken.is_none() && self.next < self.checkpoints.len() {
            self.check(last, chain);
        }
        self.broken
    }

    fn check(&mut self, last: u64, chain: &[u8; 32]) {
        let c = &self.checkpoints[self.next];
        if last != c.last_position || chain != &c.chain {
            self.broken = Some(self.next);
        }
        self.next += 1;
    }
}

/// Seals a partition (refuses to seal one twice).
pub async fn seal(client: &Client, month: &str) -> Result<Seal, SealError> {
    let partition = partition_of(month)?;
    if !exists(client, &partition).await? {
        return Err(SealError::NoPartition(partition));
    }
    if let Some(r) = client
        .opt(
            "SELECT sealed_at::text FROM strata.seals WHERE partition = $1",
            &[&partition],
        )
        .await?
    {
        return Err(SealError::AlreadySealed(partition, r.get(0)));
    }
    let checkpoints = load_checkpoints(client, &partition).await?;
    let mut walk = CheckpointWalk::new(&checkpoints);
    let mut chain = [0u8; 32];
    let mut segments: Vec<(Vec<i64>, Vec<u8>, [u8; 32])> = Vec::new();
    let (mut positions, mut short) = (Vec::new(), Vec::new());
    let (mut first, mut last) = (None, None);
    let rows = digests(client, &partition, |p, d| {
        // The chain must pass through every checkpoint taken while the month
        // was open.
        walk.before_row(p, last.unwrap_or(0), &chain);
        link(&mut chain, &d);
        first.get_or_insert(p);
        last = Some(p);
        positions.push(p as i64);
        short.extend_from_slice(&d[..8]);
        if positions.len() == SEGMENT {
            segments.push((
                std::mem::take(&mut positions),
                std::mem::take(&mut short),
                chain,
            ));
        }
    })
    .await?;
    if !positions.is_empty() {
        segments.push((positions, short, chain));
    }
    if let Some(i) = walk.finish(last.unwrap_or(0), &chain) {
        let c = &checkpoints[i];
        return Err(SealError::CheckpointBroken {
            partition,
            last_position: c.last_position,
            taken_at: c.taken_at.clone(),
        });
    }
    client
        .exec(
            "INSERT INTO strata.seals (partition, first_position, last_position, rows, chain) VALUES ($1, $2, $3, $4, $5)",
            &[
                &partition,
                &first.map(|p| p as i64),
                &last.map(|p| p as i64),
                &(rows as i64),
                &chain.to_vec(),
            ],
        )
        .await?;
    for (i, (pos, dig, ch)) in segments.iter().enumerate() {
        client
            .exec(
                "INSERT INTO strata.seal_segments (partition, segment, first_position, positions, digests, chain)
                 VALUES ($1, $2, $3, $4, $5, $6)",
                &[&partition, &(i as i32), &pos[0], pos, dig, &ch.to_vec()],
            )
            .await?;
    }
    Ok(Seal {
        partition,
        rows,
        first_position: first,
        last_position: last,
        chain: hex(&chain),
    })
}

/// A running checkpoint of an open month's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub last_position: u64,
    pub rows: u64,
    pub chain: [u8; 32],
    pub taken_at: String,
}

async fn load_checkpoints(client: &Client, partition: &str) -> Result<Vec<Checkpoint>, SealError> {
    Ok(client
        .rows(
            "SELECT last_position, rows, chain, taken_at::text FROM strata.seal_checkpoints
              WHERE partition = $1 ORDER BY last_position",
            &[&partition],
        )
        .await?
        .iter()
        .map(|r| {
            let mut chain = [0u8; 32];
            let c: Vec<u8> = r.get(2);
            if c.len() == 32 {
                chain.copy_from_slice(&c);
            }
            Checkpoint {
                last_position: r.get::<_, i64>(0) as u64,
                rows: r.get::<_, i64>(1) as u64,
                chain,
                taken_at: r.get(3),
            }
        })
        .collect())
}

/// Extends the open month's chain over the rows committed since its last
/// checkpoint (up to the durable head) and records a checkpoint if any were
/// added. Returns the checkpoint written, if any.
pub async fn checkpoint(client: &Client, month: &str) -> Result<Option<Checkpoint>, SealError> {
    let partition = partition_of(month)?;
    if !exists(client, &partition).await? {
        return Err(SealError::NoPartition(partition));
    }
    let head = events::read::head(client).await?.0 as i64;
    let last = load_checkpoints(client, &partition).await?.pop();
    let (mut chain, mut rows, after) = match &last {
        Some(c) => (c.chain, c.rows, c.last_position as i64),
        None => ([0u8; 32], 0, -1),
    };
    let mut last_position = None;
    let n = digests_between(client, &partition, after, head, |p, d| {
        link(&mut chain, &d);
        last_position = Some(p);
    })
    .await?;
    let Some(last_position) = last_position else {
        return Ok(None);
    };
    rows += n;
    let r = client
        .one(
            "INSERT INTO strata.seal_checkpoints (partition, last_position, rows, chain)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (partition, last_position) DO UPDATE SET last_position = EXCLUDED.last_position
             RETURNING taken_at::text",
            &[&partition, &(last_position as i64), &(rows as i64), &chain.to_vec()],
        )
        .await?;
    Ok(Some(Checkpoint {
        last_position,
        rows,
        chain,
        taken_at: r.get(0),
    }))
}

/// Recomputes an open month's chain and checks it against every checkpoint.
async fn verify_checkpoints(
    client: &Client,
    partition: &str,
    checkpoints: &[Checkpoint],
) -> Result<Finding, SealError> {
    let mut chain = [0u8; 32];
    let mut last = 0u64;
    let mut walk = CheckpointWalk::new(checkpoints);
    let up_to = checkpoints
        .last()
        .map(|c| c.last_position as i64)
        .unwrap_or(0);
    let rows = digests_between(client, partition, -1, up_to, |p, d| {
        walk.before_row(p, last, &chain);
        link(&mut chain, &d);
        last = p;
    })
    .await?;
    if let Some(i) = walk.finish(last, &chain) {
        // Something at a position after the checkpoint before it changed.
        return Ok(Finding::CheckpointBroken {
            after: i.checked_sub(1).map_or(0, |j| checkpoints[j].last_position),
            up_to: checkpoints[i].last_position,
        });
    }
    Ok(Finding::CheckpointsIntact {
        rows,
        checkpoints: checkpoints.len() as u64,
    })
}

/// Recomputes a sealed partition and names the first difference; an open
/// month is checked against its running checkpoints.
pub async fn verify(client: &Client, month: &str) -> Result<Finding, SealError> {
    let partition = partition_of(month)?;
    let Some(seal) = client
        .opt(
            "SELECT rows, chain FROM strata.seals WHERE partition = $1",
            &[&partition],
        )
        .await?
    else {
        let checkpoints = load_checkpoints(client, &partition).await?;
        if checkpoints.is_empty() {
            return Err(SealError::NotSealed(partition));
        }
        return verify_checkpoints(client, &partition, &checkpoints).await;
    };
    let sealed_chain: Vec<u8> = seal.get(1);
    let mut sealed: BTreeMap<u64, [u8; 8]> = BTreeMap::new();
    for r in client
        .rows(
            "SELECT positions, digests FROM strata.seal_segments WHERE partition = $1 ORDER BY segment",
            &[&partition],
        )
        .await?
    {
        let pos: Vec<i64> = r.get(0);
        let dig: Vec<u8> = r.get(1);
        for (i, p) in pos.iter().enumerate() {
            let mut d = [0u8; 8];
            d.copy_from_slice(&dig[i * 8..i * 8 + 8]);
            sealed.insert(*p as u64, d);
        }
    }
    let mut current: BTreeMap<u64, [u8; 8]> = BTreeMap::new();
    let mut chain = [0u8; 32];
    let rows = digests(client, &partition, |p, d| {
        link(&mut chain, &d);
        let mut short = [0u8; 8];
        short.copy_from_slice(&d[..8]);
        current.insert(p, short);
    })
    .await?;
    // The first position where the two disagree, and how.
    let mut findings: Vec<Finding> = Vec::new();
    for (p, d) in &current {
        match sealed.get(p) {
            None => findings.push(Finding::Inserted { position: *p }),
            Some(s) if s != d => findings.push(Finding::Altered { position: *p }),
            _ => {}
        }
    }
    for p in sealed.keys() {
        if !current.contains_key(p) {
            findings.push(Finding::Deleted { position: *p });
        }
    }
    let pos = |f: &Finding| match f {
        Finding::Altered { position }
        | Finding::Inserted { position }
        | Finding::Deleted { position } => *position,
        Finding::Intact { .. }
        | Finding::CheckpointBroken { .. }
        | Finding::CheckpointsIntact { .. } => u64::MAX,
    };
    findings.sort_by_key(pos);
    if let Some(f) = findings.into_iter().next() {
        return Ok(f);
    }
    if chain.as_slice() != sealed_chain.as_slice() {
        // Every row matches its 8-byte digest but the chain does not: a
        // change built to collide on 64 bits; report the first row.
        return Ok(Finding::Altered {
            position: current.keys().next().copied().unwrap_or(0),
        });
    }
    Ok(Finding::Intact { rows })
}

/// Months whose partitions exist, closed at least `grace` before `now`, not
/// sealed yet, as `YYYY-MM`. A partition's month is in its name
/// (`strata.partition_name`), as `retire` reads it too.
pub async fn unsealed_closed_months(
    client: &Client,
    grace: std::time::Duration,
) -> Result<Vec<String>, SealError> {
    let grace_s = grace.as_secs_f64();
    Ok(client
        .rows(
            "SELECT month FROM (
               SELECT c.relname, replace(substr(c.relname, 8), '_', '-') AS month,
                      (to_date(substr(c.relname, 8), 'YYYY_MM') + interval '1 month')
                          AT TIME ZONE 'UTC' AS upper_bound
                 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                WHERE i.inhparent = 'strata.events'::regclass
                  AND c.relname ~ '^events_[0-9]{4}_[0-9]{2}$') p
              WHERE upper_bound + make_interval(secs => $1) <= now()
                AND NOT EXISTS (SELECT 1 FROM strata.seals s WHERE s.partition = p.relname)
                -- nothing that started before the month ended is still running
                AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                                 WHERE a.xact_start < p.upper_bound
                                   AND a.backend_type = 'client backend'
                                   AND a.pid <> pg_backend_pid())
              ORDER BY 1",
            &[&grace_s],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The month `now` is in, as `YYYY-MM` (UTC).
pub async fn current_month(client: &Client) -> Result<String, SealError> {
    Ok(client
        .one("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM')", &[])
        .await?
        .get(0))
}

/// What one maintenance pass did.
#[derive(Debug, Default)]
pub struct Maintained {
    pub sealed: Vec<Seal>,
    pub checkpoint: Option<Checkpoint>,
    /// Months that could not be sealed, with why (a broken checkpoint, say).
    pub refused: Vec<(String, String)>,
}

/// Seals every month that closed at least `grace` ago and takes a
/// checkpoint of the open one. One process at a time does it (an advisory
/// lock); others return at once with nothing done.
pub async fn maintain(
    client: &Client,
    grace: std::time::Duration,
) -> Result<Maintained, SealError> {
    const LOCK: i64 = 0x5374_7261_7461_5345;
    let got: bool = client
        .one("SELECT pg_try_advisory_lock($1)", &[&LOCK])
        .await?
        .get(0);
    if !got {
        return Ok(Maintained::default());
    }
    let result = async {
        let mut done = Maintained::default();
        for month in unsealed_closed_months(client, grace).await? {
            // The last rows of the month go into a final checkpoint first,
            // so the seal is checked against everything seen while open.
            match seal(client, &month).await {
                Ok(s) => done.sealed.push(s),
                Err(SealError::AlreadySealed(..)) => {}
                Err(e @ SealError::CheckpointBroken { .. }) => {
                    done.refused.push((month, e.to_string()))
                }
                Err(e) => return Err(e),
            }
        }
        let open = current_month(client).await?;
        match checkpoint(client, &open).await {
            Ok(c) => done.checkpoint = c,
            Err(SealError::NoPartition(_)) => {}
            Err(e) => return Err(e),
        }
        Ok(done)
    }
    .await;
    let _ = client.exec("SELECT pg_advisory_unlock($1)", &[&LOCK]).await;
    result
}
