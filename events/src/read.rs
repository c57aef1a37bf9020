//! Reading the event table directly, in position order.
//!
//! Two properties make such reads safe:
//!
//! - Positions are handed out under the log head's row lock, held to commit,
//!   so every row a snapshot can see has all lower positions visible too: a
//!   read by position never skips a row that commits later.
//! - Appends commit asynchronously and are acknowledged after a WAL flush
//!   barrier, so a row can be visible a moment before it is durable. Readers
//!   therefore bound every read by a head taken *before* a flush barrier:
//!   everything at or below it is durable, and nothing a reader delivers can
//!   be lost in a crash. (Rows that arrive through the replication stream are
//!   durable too: logical decoding only sends flushed WAL, and the reader
//!   holds back what synchronous standbys do not have yet, see
//!   `standby_gate`.) With synchronous standbys named, the barrier's commit
//!   waits for them as well, so nothing read is lost by a takeover either.

use crate::types::{Event, Position};
use schema::sql::Sql;
use std::sync::Arc;
use std::time::SystemTime;
use tokio_postgres::{Client, Row};

const COLUMNS: &str =
    "position, stream, version, type, payload::text, metadata::text, recorded_at, xid::text";

fn event(row: &Row) -> Event {
    let xid: String = row.get(7);
    Event {
        position: Position(row.get::<_, i64>(0) as u64),
        stream: row.get(1),
        version: row.get::<_, i64>(2) as u64,
        event_type: row.get(3),
        payload: row.get(4),
        metadata: row.get(5),
        recorded_at: row.get::<_, SystemTime>(6),
        xid: xid.parse().unwrap_or(0),
    }
}

/// Waits until every transaction committed before the call is durable.
///
/// The barrier is a tiny write (this connection's row in
/// `strata.flush_barriers`) committed synchronously: its commit waits for the
/// WAL to be flushed up to its own commit record, which lies after the commit
/// record of everything committed before it. It must write WAL of its own:
/// Postgres does not flush for a transaction that wrote none, even if it took
/// a transaction id. `batch_execute` returns only at ReadyForQuery, after the
/// commit.
pub async fn flush_barrier(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(FLUSH_BARRIER_SQL).await
}

/// The statements of [`flush_barrier`].
///
/// Its setting is `SET LOCAL`, so that a server connection shared through a
/// pooler is left as it was.
pub const FLUSH_BARRIER_SQL: &str = "BEGIN; SET LOCAL synchronous_commit TO on; \
    INSERT INTO strata.flush_barriers AS b (pid) VALUES (pg_backend_pid()) \
    ON CONFLICT (pid) DO UPDATE SET n = b.n + 1; COMMIT";

/// The highest position whose events are committed and durable: every
/// position up to it is visible to any new snapshot and survives a crash.
///
/// On a primary the head is read before a flush barrier (a write). On a
/// standby nothing is written: what it shows it replayed from WAL the
/// primary had flushed (a physical walsender sends nothing else), and that
/// the standby has flushed itself, so every visible row is durable already.
/// Reads of the table (catch-up, replay, the audit endpoint) can therefore
/// be pointed at a standby.
pub async fn head(client: &Client) -> Result<Position, tokio_postgres::Error> {
    let row = client
        .one(
            "SELECT last_position, pg_is_in_recovery() FROM strata.log_head",
            &[],
        )
        .await?;
    if !row.get::<_, bool>(1) {
        flush_barrier(client).await?;
    }
    Ok(Position(row.get::<_, i64>(0) as u64))
}

/// How long ago the event at `position` was recorded, in seconds; `None`
/// when there is no such event.
pub async fn age(
    client: &Client,
    position: Position,
) -> Result<Option<f64>, tokio_postgres::Error> {
    Ok(client
        .opt(
            "SELECT extract(epoch FROM now() - recorded_at)::float8 FROM strata.events WHERE position = $1",
            &[&(position.0 as i64)],
        )
        .await?
        .map(|r| r.get(0)))
}

/// The last position recorded at or before `t` (0 when none is).
pub async fn position_at(
    client: &Client,
    t: std::time::SystemTime,
) -> Result<Position, tokio_postgres::Error> {
    let p: Option<i64> = client
        .one(
            "SELECT max(position) FROM strata.events WHERE recorded_at <= $1",
            &[&t],
        )
        .await?
        .get(0);
    Ok(Position(p.unwrap_or(0) as u64))
}

/// The last position recorded before `t`: where a reader starts to receive
/// everything from `t` on (the head when nothing is that recent).
pub async fn position_before(
    client: &Client,
    t: std::time::SystemTime,
) -> Result<Position, tokio_postgres::Error> {
    let head = head(client).await?.0 as i64;
    let first: Option<i64> = client
        .one(
            "SELECT min(position) FROM strata.events WHERE recorded_at >= $1 AND position <= $2",
            &[&t, &head],
        )
        .await?
        .get(0);
    Ok(Position((first.unwrap_or(head + 1) - 1).max(0) as u64))
}

/// Up to `limit` durable events after `after`, in position order.
pub async fn after(
    client: &Client,
    after: Position,
    limit: i64,
) -> Result<Vec<Arc<Event>>, tokio_postgres::Error> {
    let head = head(client).await?;
    if head <= after {
        return Ok(Vec::new());
    }
    let rows = client
        .rows(
            &format!(
                "SELECT {COLUMNS} FROM strata.events
                  WHERE position > $1 AND position <= $2 ORDER BY position LIMIT $3"
            ),
            &[&(after.0 as i64), &(head.0 as i64), &limit],
        )
        .await?;
    Ok(rows.iter().map(|r| Arc::new(event(r))).collect())
}

/// Events with `from < position < to`, in position order. For filling gaps
/// below a position that is already known durable (it came through the
/// replication stream, or from [`head`]), so no barrier is needed: lower
/// positions committed earlier.
pub async fn between(
    client: &Client,
    from: Position,
    to: Position,
) -> Result<Vec<Arc<Event>>, tokio_postgres::Error> {
    let rows = client
        .rows(
            &format!(
                "SELECT {COLUMNS} FROM strata.events
                  WHERE position > $1 AND position < $2 ORDER BY position"
            ),
            &[&(from.0 as i64), &(to.0 as i64)],
        )
        .await?;
    Ok(rows.iter().map(|r| Arc::new(event(r))).collect())
}

/// The durable events of one stream, in version order.
pub async fn stream(client: &Client, stream: &str) -> Result<Vec<Event>, tokio_postgres::Error> {
    let head = head(client).await?;
    let rows = client
        .rows(
            &format!(
                "SELECT {COLUMNS} FROM strata.events
                  WHERE stream = $1 AND position <= $2 ORDER BY version"
            ),
            &[&stream, &(head.0 as i64)],
        )
        .await?;
    Ok(rows.iter().map(event).collect())
}

/// The events at these positions, in position order (those that are not
/// in the table are left out): one look-up by primary key each.
pub async fn at(client: &Client, positions: &[u64]) -> Result<Vec<Event>, tokio_postgres::Error> {
    let positions: Vec<i64> = positions.iter().map(|p| *p as i64).collect();
    let rows = client
        .rows(
            &format!(
                "SELECT {COLUMNS} FROM strata.events
                  WHERE position = ANY($1) ORDER BY position"
            ),
            &[&positions],
        )
        .await?;
    Ok(rows.iter().map(event).collect())
}
