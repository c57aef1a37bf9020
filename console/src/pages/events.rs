//! Events: a live tail of the log, filtered by stream prefix and event
//! type. The first rows are the console's newest events; the console's
//! script then adds each new one as it commits (`/live?mode=events` with
//! the same filter), newest first, keeping the last [`KEPT`]. Raw events
//! are an admin's to read, or what an operator's Subscribe grant allows
//! (`strata grants`), exactly as through the client API.

use crate::auth::Who;
use crate::html::{esc, time, Page};
use crate::reply::Failure;
use crate::sse::Filter;
use crate::{form, Shared};
use std::fmt::Write;

/// Rows the tail keeps in the page.
pub const KEPT: usize = 200;

pub async fn page(shared: &Shared, who: &Who, query: &[(String, String)]) -> Result<Page, Failure> {
    let grant = match crate::auth::readable(shared, who).await {
        Ok(g) => g,
        Err(
            crate::auth::Refused::Unavailable(m)
            | crate::auth::Refused::SignIn(m)
            | crate::auth::Refused::Forbidden(m),
        ) => return Err(Failure::unavailable(m)),
    };
    let prefix = form::get(query, "stream").unwrap_or("").trim().to_string();
    let types = form::get(query, "type").unwrap_or("").trim().to_string();
    let mut page = Page::new("Events", "events");
    let filter = Filter {
        watch: vec![if prefix.is_empty() {
            "*".to_string()
        } else {
            prefix.clone()
        }],
        mention: Vec::new(),
        types: if types.is_empty() {
            Vec::new()
        } else {
            vec![types.clone()]
        },
    };
    let _ = write!(
        page.body,
        r#"<form method="get" action="/events" class="inline"><label>Stream prefix <input name="stream" value="{}" placeholder="pool/demo"></label><label>Type prefix <input name="type" value="{}" placeholder="reservation."></label><button type="submit">Filter</button> <button type="button" id="tail-pause" aria-pressed="false">Pause</button></form>
<table class="tail"><caption>The newest events, newest first; new ones appear as they commit</caption><thead><tr><th scope="col">Position</th><th scope="col">When</th><th scope="col">Stream</th><th scope="col">Type</th><th scope="col">Payload</th></tr></thead>
<tbody id="tail" data-kept="{KEPT}" data-watch="{}" data-types="{}">"#,
        esc(&prefix),
        esc(&types),
        esc(&filter.watch.join(",")),
        esc(&filter.types.join(",")),
    );
    if matches!(grant, crate::auth::Reads::Nothing) {
        let _ = write!(
            page.body,
            r#"</tbody></table><p class="note" id="no-grant">Raw events are an admin's to read, or what a grant allows: an admin gives {} one with <code>strata grants set {} --prefixes PREFIX,...</code>.</p>"#,
            esc(&who.operator),
            esc(&who.operator)
        );
        return Ok(page);
    }
    let recent = shared.live.recent();
    let readable =
        |s: &&std::sync::Arc<crate::live::Summary>| grant.allows(&s.stream, &s.event_type);
    for s in recent
        .iter()
        .rev()
        .filter(|s| filter.matches(s))
        .filter(readable)
        .take(KEPT)
    {
        let _ = write!(
            page.body,
            r#"<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>"#,
            s.position,
            time(s.at_ms),
            esc(&s.stream),
            esc(&s.event_type),
            esc(&s.brief),
        );
    }
    page.body.push_str("</tbody></table>");
    Ok(page)
}
