//! A browser's live stream (`GET /live`, Server-Sent Events), fed by the
//! console's one subscription (`live.rs`), never by a query per browser.
//! A page asks for the events of some stream prefixes (`watch`) or naming
//! some ids (`mention`); `mode=events` sends them (the events page), the
//! default sends a `change` at most every [`COALESCE`] so the page fetches
//! its new content once. A stream that fell behind the broadcast is told
//! to `resync`; one whose sign-in ended (the session signed out or
//! expired, the role removed, the certificate revoked) is told `ended`
//! within [`RECHECK`] and closed. Streams are bounded per process.

use crate::auth::{self, Who};
use crate::live::Summary;
use crate::reply::{full, Body};
use crate::{form, Shared};
use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast::error::RecvError;

/// Events that arrive together are sent together after at most this.
pub const COALESCE: Duration = Duration::from_millis(50);
/// How often a stream's sign-in is checked again.
pub const RECHECK: Duration = Duration::from_secs(2);
/// A comment sent when nothing else was, so proxies keep the stream.
const KEEPALIVE: Duration = Duration::from_secs(15);
/// Most prefixes or ids one stream follows.
const MAX_FILTERS: usize = 32;

/// What a stream follows.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Stream prefixes (`*`: every stream).
    pub watch: Vec<String>,
    /// Ids named anywhere in an event's payload or stream.
    pub mention: Vec<String>,
    /// Event type prefixes (empty: every type).
    pub types: Vec<String>,
}

fn list(s: Option<&str>) -> Vec<String> {
    s.unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .take(MAX_FILTERS)
        .map(str::to_string)
        .collect()
}

impl Filter {
    pub fn from_query(query: &[(String, String)]) -> Filter {
        Filter {
            watch: list(form::get(query, "watch")),
            mention: list(form::get(query, "mention")),
            types: list(form::get(query, "types")),
        }
    }

    pub fn matches(&self, s: &Summary) -> bool {
        let by_stream = self
            .watch
            .iter()
            .any(|w| w == "*" || s.stream.starts_with(w.as_str()));
        let by_mention = self
            .mention
            .iter()
            .any(|m| s.stream.contains(m.as_str()) || s.brief.contains(m.as_str()));
        let by_type = self.types.is_empty()
            || self
                .types
                .iter()
                .any(|t| s.event_type.starts_with(t.as_str()));
        (by_stream || by_mention) && by_type
    }
}

fn message(event: &str, data: &str) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// Opens a live stream for `who`.
pub async fn stream(
    shared: &Arc<Shared>,
    who: Who,
    cookie: Option<String>,
    cert: Option<Vec<u8>>,
    query: &[(String, String)],
) -> Response<Body> {
    let Ok(permit) = shared.streams.clone().try_acquire_owned() else {
        return full(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "too many live streams on this console; try again",
        );
    };
    let filter = Filter::from_query(query);
    let events = form::get(query, "mode") == Some("events");
    // The events themselves are sent only as far as a grant allows (an
    // admin's covers all); a page's `change` says nothing but a position.
    let mut grant = match events {
        true => auth::readable(shared, &who)
            .await
            .unwrap_or(auth::Reads::Nothing),
        false => auth::Reads::Nothing,
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    // Subscribed before the position is read: every event after it comes
    // through the subscription.
    let mut sub = shared.live.subscribe();
    let at = shared.live.index().position();
    // What the task needs of Shared, which is not 'static here.
    let check = Recheck {
        shared: shared.clone(),
        cookie,
        cert,
    };
    ops::task::spawn("console-live-stream", async move {
        let _permit = permit;
        let _ = tx
            .send(Bytes::from(format!(
                "retry: 2000\nevent: hello\ndata: {{\"position\":{at}}}\n\n"
            )))
            .await;
        let mut pending: Vec<Arc<Summary>> = Vec::new();
        let mut flush_at: Option<tokio::time::Instant> = None;
        let mut recheck = tokio::time::interval(RECHECK);
        recheck.tick().await;
        let mut last_sent = tokio::time::Instant::now();
        loop {
            let flush = async {
                match flush_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                got = sub.recv() => match got {
                    Ok(s) => if filter.matches(&s)
                        && (!events || grant.allows(&s.stream, &s.event_type))
                    {
                        pending.push(s);
                        flush_at.get_or_insert(tokio::time::Instant::now() + COALESCE);
                    },
                    Err(RecvError::Lagged(_)) => {
                        pending.clear();
                        flush_at = None;
                        crate::metrics::counters().resyncs.inc();
                        if tx.send(message("resync", "{}")).await.is_err() { return; }
                    }
                    Err(RecvError::Closed) => return,
                },
                _ = flush => {
                    let msg = if events {
                        message("events", &serde_json::to_string(&pending.iter().map(|s| &**s).collect::<Vec<&Summary>>()).unwrap_or_default())
                    } else {
                        let newest = pending.last().map_or(0, |s| s.position);
                        message("change", &format!("{{\"position\":{newest}}}"))
                    };
                    pending.clear();
                    flush_at = None;
                    if tx.send(msg).await.is_err() { return; }
                    last_sent = tokio::time::Instant::now();
                }
                _ = recheck.tick() => {
                    if events {
                        if let Ok(g) = auth::readable(&check.shared, &who).await {
                            grant = g;
                        }
                    }
                    if let Err(why) = check.still(&who).await {
                        crate::metrics::counters().ended.inc();
                        let _ = tx.send(message("ended", &serde_json::to_string(&why).unwrap_or_default())).await;
                        return;
                    }
                    if last_sent.elapsed() >= KEEPALIVE {
                        if tx.send(Bytes::from_static(b": keepalive\n\n")).await.is_err() { return; }
                        last_sent = tokio::time::Instant::now();
                    }
                }
            }
        }
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| {
            (
                Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)),
                rx,
            )
        })
    });
    let mut r = Response::new(StreamBody::new(body).boxed());
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}

/// What a stream checks its sign-in with, again and again.
struct Recheck {
    shared: Arc<Shared>,
    cookie: Option<String>,
    cert: Option<Vec<u8>>,
}

impl Recheck {
    async fn still(&self, was: &Who) -> Result<(), String> {
        match auth::who(&self.shared, self.cert.as_deref(), self.cookie.as_deref()).await {
            Ok(w) if w.operator == was.operator => Ok(()),
            Ok(_) => Err("signed in as someone else".into()),
            Err(auth::Refused::SignIn(m) | auth::Refused::Forbidden(m)) => Err(m),
            // The database not answering is not the sign-in ending: keep
            // the stream and ask again.
            Err(auth::Refused::Unavailable(_)) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(stream: &str, t: &str, brief: &str) -> Summary {
        Summary {
            position: 1,
            stream: stream.into(),
            event_type: t.into(),
            at_ms: 0,
            brief: brief.into(),
        }
    }

    #[test]
    fn filters_pick_by_stream_id_and_type() {
        let f = Filter::from_query(&form::pairs(
            "watch=pool/p1,reservation/&types=reservation.",
        ));
        assert!(f.matches(&summary("pool/p1", "reservation.placed", "{}")));
        assert!(!f.matches(&summary("pool/p1", "node.joined", "{}")));
        assert!(!f.matches(&summary("pool/p2", "reservation.placed", "{}")));
        let f = Filter::from_query(&form::pairs("mention=r-9"));
        assert!(f.matches(&summary(
            "pool/p",
            "reservation.placed",
            r#"{"reservation":"r-9"}"#
        )));
        assert!(f.matches(&summary("command/bind:r-9:n1", "command.issued", "{}")));
        assert!(!f.matches(&summary("pool/p", "reservation.placed", "{}")));
        let all = Filter::from_query(&form::pairs("watch=*"));
        assert!(all.matches(&summary("x", "y", "")));
        assert!(!Filter::default().matches(&summary("x", "y", "")));
        let many = (0..100)
            .map(|i| format!("p{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            Filter::from_query(&form::pairs(&format!("watch={many}")))
                .watch
                .len(),
            MAX_FILTERS
        );
    }
}
