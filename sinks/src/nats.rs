//! Delivering a batch to NATS JetStream: every event published with its
//! position as `Nats-Msg-Id`, all acknowledgements awaited; a failed batch is
//! published again whole (JetStream drops the duplicates).

use events::Event;
use std::time::Duration;

/// The subject of an event: `<prefix>.<stream, '/' as '.'>.<type>`, with
/// characters NATS does not allow in a token replaced by '_'.
pub fn subject(prefix: &str, e: &Event) -> String {
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
        clean(&e.stream).replace('/', "."),
        clean(&e.event_type)
    )
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
    events: &[&Event],
) -> Result<(), String> {
    let mut acks = Vec::with_capacity(events.len());
    for e in events {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", e.position.0.to_string().as_str());
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
pub async fn deliver(
    js: &async_nats::jetstream::Context,
    prefix: &str,
    events: &[&Event],
    attempts: u32,
    base: Duration,
    cap: Duration,
) -> Result<u32, (u32, String)> {
    crate::webhook::with_retries(attempts, base, cap, || publish(js, prefix, events)).await
}
