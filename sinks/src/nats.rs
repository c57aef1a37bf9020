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

/// [`subject`] from an event's stream and type:
/// `<prefix>.<stream segment>...<noun>.<verb>`, one token per `/`-separated
/// segment of the stream and always two for the type (split at its first
/// dot), so a subscriber can match `strata.pool.*.reservation.placed` and
/// no two events' (stream, type) pairs share a subject. Within a token, a
/// `.`, `*`, `>`, `%`, white space or control character is written as `%`
/// and two hex digits, an empty token as a lone `%`, and the missing verb
/// of a type without a dot as `%%` ([`decode`] reads them back). Strata's own stream names and types need no escape.
pub fn subject_of(prefix: &str, stream: &str, event_type: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + stream.len() + event_type.len() + 4);
    out.push_str(prefix);
    for seg in stream.split('/') {
        out.push('.');
        escape_token(seg, &mut out);
    }
    out.push('.');
    match event_type.split_once('.') {
        Some((noun, verb)) => {
            escape_token(noun, &mut out);
            out.push('.');
            escape_token(verb, &mut out);
        }
        None => {
            escape_token(event_type, &mut out);
            out.push_str(".%%");
        }
    }
    out
}

fn escape_token(s: &str, out: &mut String) {
    if s.is_empty() {
        out.push('%');
        return;
    }
    for c in s.chars() {
        if matches!(c, '.' | '*' | '>' | '%') || c.is_whitespace() || c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
}

fn unescape_token(t: &str) -> Option<String> {
    if t == "%" {
        return Some(String::new());
    }
    let mut bytes = Vec::with_capacity(t.len());
    let mut it = t.bytes();
    while let Some(b) = it.next() {
        if b == b'%' {
            let hex = [it.next()?, it.next()?];
            bytes.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
        } else {
            bytes.push(b);
        }
    }
    String::from_utf8(bytes).ok()
}

/// The stream and type a subject made by [`subject_of`] with `prefix`
/// names; `None` for a subject it did not make.
pub fn decode(prefix: &str, subject: &str) -> Option<(String, String)> {
    let rest = subject.strip_prefix(prefix)?.strip_prefix('.')?;
    let tokens: Vec<&str> = rest.split('.').collect();
    if tokens.len() < 3 {
        return None;
    }
    let (stream, ty) = tokens.split_at(tokens.len() - 2);
    let stream = stream
        .iter()
        .map(|t| unescape_token(t))
        .collect::<Option<Vec<_>>>()?
        .join("/");
    let noun = unescape_token(ty[0])?;
    let ty = if ty[1] == "%%" {
        noun
    } else {
        format!("{noun}.{}", unescape_token(ty[1])?)
    };
    Some((stream, ty))
}

/// The message id of the event at `position` delivered by sink `sink` of
/// region `region`. Positions are never handed out twice within a region
/// (see `events::EPOCH_SIZE`), so the id names one event.
pub fn message_id(region: &str, sink: &str, position: u64) -> String {
    format!("{region}:{sink}:{position}")
}

/// Connects to the NATS server at `url`; credentials in it
/// (`user:password@` or `token@`) are given as the client's options.
pub async fn connect(url: &str) -> Result<async_nats::jetstream::Context, String> {
    let (bare, userinfo) = crate::credentials::split(url);
    let options = match userinfo.as_deref().map(|u| u.split_once(':')) {
        Some(Some((user, password))) => {
            async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
        }
        Some(None) => async_nats::ConnectOptions::with_token(userinfo.unwrap_or_default()),
        None => async_nats::ConnectOptions::new(),
    };
    let client = options
        .connection_timeout(Duration::from_secs(5))
        .connect(bare.as_str())
        .await
        .map_err(|e| {
            format!(
                "connect to NATS at {}: {e}",
                crate::credentials::redact(url)
            )
        })?;
    Ok(async_nats::jetstream::new(client))
}

/// The JetStream stream that stores the subjects a sink with `prefix`
/// publishes (`<prefix>.>`) on the server at `url`: its name, and whether
/// it was created now. Without one, `create` makes it (named after the
/// prefix, `.` as `_`, with JetStream's default duplicate window, which the
/// message ids rely on); otherwise it is an error that says what to do.
pub async fn ensure_stream(
    url: &str,
    prefix: &str,
    create: bool,
) -> Result<(String, bool), String> {
    let js = connect(url).await?;
    let url = crate::credentials::redact(url);
    let subjects = format!("{prefix}.>");
    match js.stream_by_subject(subjects.clone()).await {
        Ok(name) => return Ok((name, false)),
        Err(e)
            if e.kind() == async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound => {}
        Err(e) => {
            return Err(format!(
                "look for the JetStream stream of {subjects} at {url}: {e}"
            ))
        }
    }
    if !create {
        return Err(format!(
            "no JetStream stream at {url} stores {subjects}, so every batch would fail:              create one (nats stream add --subjects '{subjects}' ...) or pass --create-stream"
        ));
    }
    let name: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![subjects.clone()],
        ..Default::default()
    })
    .await
    .map_err(|e| format!("create the JetStream stream {name} for {subjects} at {url}: {e}"))?;
    Ok((name, true))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_name_their_stream_and_type_and_never_collide() {
        assert_eq!(
            subject_of("strata", "pool/p1", "reservation.placed"),
            "strata.pool.p1.reservation.placed"
        );
        let cases = [
            ("pool/a.b", "x.y"),
            ("pool/a", "b.x.y"),
            ("pool/a/b", "x.y"),
            ("pool/a", "b"),
            ("pool/a b", "x.y*"),
            ("pool/a%2Eb", "x.y"),
            ("pool//a", "x.y"),
            ("pool/a", ".x"),
            ("pool/a", "x."),
            ("pool/a", "x"),
            ("pool/ä>", "tab\tty.pe"),
            ("", ""),
        ];
        let mut seen = std::collections::HashMap::new();
        for (stream, ty) in cases {
            let subject = subject_of("s", stream, ty);
            for token in subject.split('.') {
                assert!(!token.is_empty(), "{subject}");
                assert!(!token.contains(['*', '>', ' ']), "{subject}");
            }
            assert_eq!(
                decode("s", &subject),
                Some((stream.to_string(), ty.to_string())),
                "{subject}"
            );
            if let Some(other) = seen.insert(subject.clone(), (stream, ty)) {
                panic!("{subject} for both {other:?} and {:?}", (stream, ty));
            }
        }
    }
}
