//! A timeline: the events that name something, read by position from the
//! table (their positions come from `mentions.rs`), or, for what the
//! console has no positions of, the events of its own stream; each with
//! when, its stream and type, who acted (the operator in its metadata) and
//! its trace id.

use crate::html::{esc, time};
use crate::live::unix_ms;
use crate::reply::Failure;
use std::fmt::Write;

/// Most events shown.
pub const SHOWN: usize = 500;

pub async fn section(
    client: &tokio_postgres::Client,
    positions: Option<Vec<u64>>,
    fallback_stream: &str,
    out: &mut String,
) -> Result<(), Failure> {
    let mut events = match positions {
        Some(p) => events::read::at(client, &p).await,
        None => events::read::stream(client, fallback_stream).await,
    }
    .map_err(Failure::unavailable)?;
    let cut = events.len().saturating_sub(SHOWN);
    events.drain(..cut);
    let _ = write!(
        out,
        r#"<section aria-labelledby="tl"><h2 id="tl">Timeline</h2>{}<ol class="timeline">"#,
        if cut > 0 {
            format!("<p>The newest {SHOWN} of {} events.</p>", cut + SHOWN)
        } else {
            String::new()
        }
    );
    for e in &events {
        let meta: serde_json::Value = serde_json::from_str(&e.metadata).unwrap_or_default();
        let by = meta
            .get("operator")
            .and_then(|v| v.as_str())
            .map(|o| format!("operator {o}"))
            .or_else(|| meta.get("by").and_then(|v| v.as_str()).map(str::to_string))
            .unwrap_or_default();
        let trace = events::trace::of_metadata(&e.metadata)
            .and_then(|tp| tp.split('-').nth(1).map(str::to_string))
            .map(|t| {
                format!(
                    r#"<span class="trace" title="trace id">trace {}</span>"#,
                    esc(&t)
                )
            })
            .unwrap_or_default();
        let _ = write!(
            out,
            r#"<li><span class="when">{}</span> <strong>{}</strong> <span class="stream">{}</span> {}{}<pre>{}</pre></li>"#,
            time(unix_ms(e.recorded_at)),
            esc(&e.event_type),
            esc(&e.stream),
            if by.is_empty() {
                String::new()
            } else {
                format!(r#"<span class="by">by {}</span> "#, esc(&by))
            },
            trace,
            esc(&e.payload),
        );
    }
    out.push_str("</ol></section>");
    Ok(())
}
