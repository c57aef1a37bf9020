//! Delivering a batch to NATS JetStream: every event published with a
//! message id naming its region, its sink and its position
//! (`Nats-Msg-Id: <region>:<sink>:<position>`), all acknowledgements
//! awaited; a failed batch is published again whole (JetStream drops the
//! duplicates). Two sinks, or two regions, may feed one stream: their ids
//! differ, so neither's events are taken for the other's duplicates.

use events::Event;
use std::time::Duration;

/// The subject of an event: `<prefix>.<stream, '/' as '.'>.<type>`, with
/// characters NATS does not allow in a token replaced by '_'.
pub fn subject(prefix: &str, e: &Event) -> String {
    subject_of(prefix, &e.stream, &e.event_type)
}

/// [`subject`] from an event's stream and type.
pub fn subject_of(prefix: &str, stream: &str, event_type: &str) -> String {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_whitespace() || c == '*' || c == '>' {
                    '_'
                } else {
                    c
                }
            })
            .collect()
    };
    format!(
        "{prefix}.{}.{}",
        clean(stream).replace('/', "."),
        clean(event_type)
    )
}

/// The message id of the event at `position` delivered by sink `sink` of
/// region `region`. Positions are never handed out twice within a region
/// (see `events::EPOCH_SIZE`), so the id names one event.
pub fn message_id(region: &str, sink: &str, position: u64) -> String {
    format!("{region}:{sink}:{position}")
}

pub async fn connect(url: &str) -> Result<async_nats::jetstream::Context, String> {
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|e| format!("connect to NATS at {url}: {e}"))?;
    Ok(async_nats::jetstream::new(client))
}

/// Publishes a batch once; `Err` if any event was not acknowledged.
pub async fn publish(
    js: &async_nats::jetstream::Context,
    prefix: &str,
    ids: (&str, &str),
    events: &[&Event],
) -> Result<(), String> {
    let mut acks = Vec::with_capacity(events.len());
    for e in events {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            "Nats-Msg-Id",
            message_id(ids.0, ids.1, e.position.0).as_str(),
        );
        headers.insert("Strata-Stream", e.stream.as_str());
        headers.insert("Strata-Type", e.event_type.as_str());
        let ack = js
            .publish_with_headers(subject(prefix, e), headers, e.to_json_line().into())
            .await
            .map_err(|err| format!("publish: {err}"))?;
        acks.push(ack);
    }
    for ack in acks {
        tokio::time::timeout(Duration::from_secs(10), ack)
            .await
            .map_err(|_| "no acknowledgement from JetStream in 10 s".to_string())?
            .map_err(|err| format!("JetStream refused: {err}"))?;
    }
    Ok(())
}

/// Publishes with retries (see [`crate::webhook::with_retries`]).
/// `ids`: the region and the sink, for the message ids.
pub async fn deliver(
    js: &async_nats::jetstream::Context,
    prefix: &str,
    ids: (&str, &str),
    events: &[&Event],
    attempts: u32,
    base: Duration,
    cap: Duration,
) -> Result<u32, (u32, String)> {
    crate::webhook::with_retries(attempts, base, cap, || publish(js, prefix, ids, events)).await
}
