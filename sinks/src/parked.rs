//! Events a sink gave up on, and delivering them again.

use crate::webhook;
use events::db::Sql;
use events::Event;
use std::time::Duration;

pub async fn park(
    db: &events::db::Database,
    sink: &str,
    events: &[&Event],
    error: &str,
    attempts: u32,
) -> Result<(), tokio_postgres::Error> {
    let client = events::db::connect(db, "sink-park").await?;
    let positions: Vec<i64> = events.iter().map(|e| e.position.0 as i64).collect();
    let bodies: Vec<serde_json::Value> = events
        .iter()
        .map(|e| serde_json::from_str(&e.to_json_line()).unwrap_or(serde_json::Value::Null))
        .collect();
    client
        .exec(
            "INSERT INTO strata.sink_parked (sink, position, event, error, attempts)
             SELECT $1, p, e, $4, $5 FROM unnest($2::bigint[], $3::jsonb[]) AS x(p, e)
             ON CONFLICT (sink, position) DO NOTHING",
            &[&sink, &positions, &bodies, &error, &(attempts as i32)],
        )
        .await?;
    Ok(())
}

/// A parked event.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Parked {
    pub position: u64,
    pub stream: String,
    pub event_type: String,
    pub error: String,
    pub attempts: i32,
    pub parked_at: String,
}

/// How many events of `sink` are parked.
pub async fn count(
    client: &tokio_postgres::Client,
    sink: &str,
) -> Result<i64, tokio_postgres::Error> {
    Ok(client
        .one(
            "SELECT count(*) FROM strata.sink_parked WHERE sink = $1",
            &[&sink],
        )
        .await?
        .get(0))
}

pub async fn list(
    client: &tokio_postgres::Client,
    sink: &str,
) -> Result<Vec<Parked>, tokio_postgres::Error> {
    Ok(client
        .rows(
            "SELECT position, event->>'stream', event->>'type', error, attempts, parked_at::text
               FROM strata.sink_parked WHERE sink = $1 ORDER BY position",
            &[&sink],
        )
        .await?
        .iter()
        .map(|r| Parked {
            position: r.get::<_, i64>(0) as u64,
            stream: r.get::<_, Option<String>>(1).unwrap_or_default(),
            event_type: r.get::<_, Option<String>>(2).unwrap_or_default(),
            error: r.get(3),
            attempts: r.get(4),
            parked_at: r.get(5),
        })
        .collect())
}

/// Delivers a sink's parked events again, in order, in batches of 500;
/// removes each batch once delivered. Returns how many were delivered, and
/// stops at the first batch that fails again.
pub async fn replay(
    client: &tokio_postgres::Client,
    http: &webhook::HttpClient,
    sink: &str,
    url: &str,
    secret: &[u8],
) -> Result<u64, String> {
    let mut done = 0u64;
    loop {
        let rows = client
            .rows(
                "SELECT position, event::text FROM strata.sink_parked WHERE sink = $1 ORDER BY position LIMIT 500",
                &[&sink],
            )
            .await
            .map_err(|e| e.to_string())?;
        if rows.is_empty() {
            return Ok(done);
        }
        let positions: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        let mut body = format!("{{\"sink\":{},\"events\":[", serde_json::json!(sink));
        for (i, r) in rows.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            body.push_str(r.get::<_, &str>(1));
        }
        body.push_str("]}");
        webhook::deliver(
            http,
            url,
            secret,
            body.into(),
            3,
            Duration::from_millis(200),
            Duration::from_secs(2),
        )
        .await
        .map_err(|(_, e)| format!("{done} delivered, then: {e}"))?;
        client
            .exec(
                "DELETE FROM strata.sink_parked WHERE sink = $1 AND position = ANY($2)",
                &[&sink, &positions],
            )
            .await
            .map_err(|e| e.to_string())?;
        done += rows.len() as u64;
    }
}

/// Publishes a sink's parked events to NATS JetStream again, in order, with
/// the message ids the sink gives them (`region` is the sink runner's), on
/// the subjects it gives them; removes them once acknowledged.
pub async fn replay_nats(
    client: &tokio_postgres::Client,
    sink: &str,
    region: &str,
    url: &str,
    prefix: &str,
) -> Result<u64, String> {
    let js = crate::nats::connect(url).await?;
    let rows = client
        .rows(
            "SELECT position, event->>'stream', event->>'type', event::text
               FROM strata.sink_parked WHERE sink = $1 ORDER BY position",
            &[&sink],
        )
        .await
        .map_err(|e| e.to_string())?;
    let mut done = 0u64;
    for r in rows {
        let position: i64 = r.get(0);
        let stream: String = r.get::<_, Option<String>>(1).unwrap_or_default();
        let event_type: String = r.get::<_, Option<String>>(2).unwrap_or_default();
        let body: String = r.get(3);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            "Nats-Msg-Id",
            crate::nats::message_id(region, sink, position as u64).as_str(),
        );
        let subject = crate::nats::subject_of(prefix, &stream, &event_type);
        js.publish_with_headers(subject, headers, body.into())
            .await
            .map_err(|e| format!("{done} published, then: {e}"))?
            .await
            .map_err(|e| format!("{done} published, then: {e}"))?;
        client
            .exec(
                "DELETE FROM strata.sink_parked WHERE sink = $1 AND position = $2",
                &[&sink, &position],
            )
            .await
            .map_err(|e| e.to_string())?;
        done += 1;
    }
    Ok(done)
}
