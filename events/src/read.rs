//! Reading the event table directly, in position order. Because positions
//! are handed out under the log head's lock held to commit, every row a
//! snapshot can see has all lower positions visible too: a read by position
//! never skips a row that commits later.

use crate::types::{Event, Position};
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

/// Up to `limit` events after `after`, in position order.
pub async fn after(
    client: &Client,
    after: Position,
    limit: i64,
) -> Result<Vec<Arc<Event>>, tokio_postgres::Error> {
    let rows = client
        .query(
            &format!("SELECT {COLUMNS} FROM strata.events WHERE position > $1 ORDER BY position LIMIT $2"),
            &[&(after.0 as i64), &limit],
        )
        .await?;
    Ok(rows.iter().map(|r| Arc::new(event(r))).collect())
}

/// Events with `from < position < to`, in position order.
pub async fn between(
    client: &Client,
    from: Position,
    to: Position,
) -> Result<Vec<Arc<Event>>, tokio_postgres::Error> {
    let rows = client
        .query(
            &format!("SELECT {COLUMNS} FROM strata.events WHERE position > $1 AND position < $2 ORDER BY position"),
            &[&(from.0 as i64), &(to.0 as i64)],
        )
        .await?;
    Ok(rows.iter().map(|r| Arc::new(event(r))).collect())
}

/// The events of one stream, in version order.
pub async fn stream(client: &Client, stream: &str) -> Result<Vec<Event>, tokio_postgres::Error> {
    let rows = client
        .query(
            &format!("SELECT {COLUMNS} FROM strata.events WHERE stream = $1 ORDER BY version"),
            &[&stream],
        )
        .await?;
    Ok(rows.iter().map(event).collect())
}

/// The last position handed out (the high-water mark of the log).
pub async fn head(client: &Client) -> Result<Position, tokio_postgres::Error> {
    let row = client
        .query_one("SELECT last_position FROM strata.log_head", &[])
        .await?;
    Ok(Position(row.get::<_, i64>(0) as u64))
}
