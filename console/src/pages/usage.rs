//! Usage: the usage reports (`projections::usage::report`, exact from the
//! log up to the position they name) over a period and grouped as asked,
//! scoped by the signed-in operator's role exactly as the client API's
//! `GetUsage` scopes them (`gateway::usage::scope`), as a table and a bar
//! chart of the largest groups, and as CSV (`/usage.csv`, same query).
//! Each report reads on a connection of its own, [`AT_ONCE`] at a time.

use crate::auth::Who;
use crate::form;
use crate::html::{esc, Page};
use crate::reply::Failure;
use crate::Shared;
use http::StatusCode;
use projections::usage::report::{self, By, Query, Report};
use std::fmt::Write;
use std::time::SystemTime;

/// Reports one console runs at once; more are refused, not queued.
pub const AT_ONCE: usize = 2;
/// Groups drawn in the chart.
const CHARTED: usize = 12;

/// Runs the report the query asks for, as `who` may see it.
pub async fn run(
    shared: &Shared,
    who: &Who,
    query: &[(String, String)],
) -> Result<Report, Failure> {
    let bad = |m: String| Failure::new(StatusCode::BAD_REQUEST, m);
    let now = SystemTime::now();
    let since = match form::get(query, "since")
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        Some(s) => report::parse_time(s, now).map_err(bad)?,
        None => report::month_start(now),
    };
    let until = match form::get(query, "until")
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        Some(s) => report::parse_time(s, now).map_err(bad)?,
        None => now,
    };
    if until < since {
        return Err(bad("until is before since".into()));
    }
    let by = By::parse_list(form::get(query, "by").unwrap_or("pool,queue")).map_err(bad)?;
    let asked: Vec<String> = form::get(query, "pool")
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| vec![p.to_string()])
        .unwrap_or_default();
    let (pools, owner) = gateway::usage::scope(&who.operator, &who.role, asked, &by)
        .map_err(|m| Failure::new(StatusCode::FORBIDDEN, m))?;
    let _permit = shared.reports.try_acquire().map_err(|_| {
        Failure::unavailable(format!(
            "this console runs {AT_ONCE} usage reports at once; try again shortly"
        ))
    })?;
    let mut client = events::db::connect(shared.db.config.clone(), "strata-console-usage")
        .await
        .map_err(Failure::unavailable)?;
    let q = Query {
        since_ms: projections::usage::unix_ms(since),
        until_ms: projections::usage::unix_ms(until),
        by,
        pools,
        owner,
        now_ms: projections::usage::unix_ms(now),
    };
    report::report(&mut client, &q)
        .await
        .map_err(Failure::unavailable)
}

pub async fn page(shared: &Shared, who: &Who, query: &[(String, String)]) -> Result<Page, Failure> {
    let mut page = Page::new("Usage", "usage");
    let field = |k: &str, d: &str| form::get(query, k).unwrap_or(d).to_string();
    let _ = write!(
        page.body,
        r#"<form method="get" action="/usage" class="inline"><label>Since <input name="since" value="{}" placeholder="7d, 2026-12-01 (default: this month)"></label><label>Until <input name="until" value="{}" placeholder="now"></label>
<label>By <input name="by" value="{}" placeholder="pool,queue,owner,class,node"></label><label>Pool <input name="pool" value="{}" placeholder="all you may see"></label><button type="submit">Report</button></form>"#,
        esc(&field("since", "")),
        esc(&field("until", "")),
        esc(&field("by", "pool,queue")),
        esc(&field("pool", "")),
    );
    let r = run(shared, who, query).await?;
    let csv_query: String = query
        .iter()
        .map(|(k, v)| format!("{}={}", form::encode(k), form::encode(v)))
        .collect::<Vec<_>>()
        .join("&");
    let _ = write!(
        page.body,
        r#"<p>From {} to {}, {}. <a href="/usage.csv?{}" download="usage.csv">Download as CSV</a></p>"#,
        esc(&r.since),
        esc(&r.until),
        match r.position {
            Some(p) if r.behind > 0 => format!(
                "exact up to position {p} ({} later events not counted yet)",
                r.behind
            ),
            Some(p) => format!("exact up to position {p}"),
            None => "nothing counted yet: no process runs the usage role".to_string(),
        },
        esc(&csv_query),
    );
    chart(&r, &mut page.body);
    table(&r, &mut page.body);
    Ok(page)
}

/// The largest groups by GPU-hours, as bars.
fn chart(r: &Report, out: &mut String) {
    let rows: Vec<_> = r.rows.iter().take(CHARTED).collect();
    let max = rows.iter().map(|x| x.gpu_hours).fold(0.0f64, f64::max);
    if rows.is_empty() || max <= 0.0 {
        return;
    }
    let (w, bar_h) = (600.0, 18.0);
    let _ = write!(
        out,
        r#"<figure class="chart"><svg class="bars" viewBox="0 0 {w} {}" role="img" aria-label="GPU-hours of the {} largest groups">"#,
        rows.len() as f64 * (bar_h + 4.0),
        rows.len()
    );
    for (i, row) in rows.iter().enumerate() {
        let y = i as f64 * (bar_h + 4.0);
        let len = row.gpu_hours / max * (w - 270.0);
        let _ = write!(
            out,
            r#"<text x="0" y="{:.1}" class="label">{}</text><rect class="used" x="200" y="{y:.1}" width="{len:.1}" height="{bar_h}"/><text x="{:.1}" y="{:.1}" class="label">{:.3}</text>"#,
            y + 13.0,
            esc(&row
                .keys
                .iter()
                .map(|k| if k.is_empty() { "-" } else { k })
                .collect::<Vec<_>>()
                .join(" / ")),
            205.0 + len,
            y + 13.0,
            row.gpu_hours,
        );
    }
    out.push_str("</svg><figcaption>GPU-hours (active), largest first</figcaption></figure>");
}

fn table(r: &Report, out: &mut String) {
    out.push_str(r#"<table><caption>GPU-hours by group</caption><thead><tr>"#);
    for b in &r.by {
        let _ = write!(out, r#"<th scope="col">{}</th>"#, b.name());
    }
    out.push_str(r#"<th scope="col">GPU-hours</th><th scope="col">Held GPU-hours</th><th scope="col">Billed</th><th scope="col">Ended</th><th scope="col">Running</th></tr></thead><tbody>"#);
    for row in r.rows.iter().chain((r.rows.len() > 1).then_some(&r.total)) {
        out.push_str("<tr>");
        let total = std::ptr::eq(row, &r.total);
        for (i, k) in row.keys.iter().enumerate() {
            let k = if total && i == 0 {
                "total"
            } else if k.is_empty() {
                "—"
            } else {
                k
            };
            let _ = write!(out, "<td>{}</td>", esc(k));
        }
        if total && row.keys.is_empty() {
            for (i, _) in r.by.iter().enumerate() {
                let _ = write!(out, "<td>{}</td>", if i == 0 { "total" } else { "" });
            }
        }
        for f in report::figures(row) {
            let _ = write!(out, "<td>{f}</td>");
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
}
