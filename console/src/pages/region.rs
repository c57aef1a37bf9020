//! The region: every pool with its GPUs by class (free, booked, out of
//! service, held on nodes that take nothing now) and what waits for them,
//! its nodes by standing, and how fast the log moves and how far behind
//! the console is.

use crate::html::{ago, bar, esc, pool_link, Page};
use crate::live::unix_ms;
use crate::pages::{gpus_by_class, standing};
use crate::reply::Failure;
use crate::Shared;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Waiting requests of a pool per class: (requests, GPUs).
fn waiting(index: &projections::Index, pool: &str) -> BTreeMap<String, (u64, u64)> {
    let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    if let Some(q) = index.queues(pool) {
        for (_, _, id) in q.pending.iter().chain(q.queued.iter()) {
            if let Some(r) = index.reservation(id) {
                let e = out.entry(r.request.class.clone()).or_default();
                e.0 += 1;
                e.1 += u64::from(r.request.gpus);
            }
        }
    }
    out
}

pub async fn page(shared: &Shared) -> Result<Page, Failure> {
    let live = &shared.live;
    let now = unix_ms(std::time::SystemTime::now());
    let mut p = Page::new("Region", "region");
    p.watch = vec!["pool/".into()];
    let behind = match live.newest_ms() {
        0 => "nothing yet".to_string(),
        t => ago(now.saturating_sub(t)),
    };
    let index = live.index();
    let _ = write!(
        p.body,
        r#"<section aria-labelledby="flow"><h2 id="flow">The log</h2><dl class="stats">
<div><dt>Position</dt><dd>{}</dd></div><div><dt>Events per second</dt><dd>{:.1}</dd></div>
<div><dt>Newest event</dt><dd>{behind} ago</dd></div><div><dt>Caught up</dt><dd>{}</dd></div></dl></section>"#,
        index.position(),
        live.events_per_second(),
        if live.caught_up() {
            "yes"
        } else {
            "catching up…"
        },
    );
    p.body
        .push_str(r#"<section aria-labelledby="pools"><h2 id="pools">Pools</h2>"#);
    let pools: Vec<_> = index.state().pools.values().filter(|p| p.created).collect();
    if pools.is_empty() {
        p.body
            .push_str("<p>No pool yet: create one with <code>strata pool create NAME</code>.</p>");
    } else {
        p.body.push_str(
            r#"<table class="pools"><caption>GPUs by pool and class</caption><thead><tr><th scope="col">Pool</th><th scope="col">Class</th><th scope="col">GPUs</th><th scope="col">Free</th><th scope="col">Booked</th><th scope="col">Out of service</th><th scope="col">Held</th><th scope="col">Waiting</th><th scope="col" class="wide">Use</th></tr></thead><tbody>"#,
        );
    }
    for pool in &pools {
        let by_class = gpus_by_class(pool);
        let waits = waiting(&index, &pool.name);
        if by_class.is_empty() {
            let _ = write!(
                p.body,
                r#"<tr><th scope="row">{}</th><td colspan="8">no nodes</td></tr>"#,
                pool_link(&pool.name)
            );
        }
        for (i, (class, g)) in by_class.iter().enumerate() {
            let (wr, wg) = waits.get(class).copied().unwrap_or_default();
            let label = format!(
                "{} of {} booked, {} free, {} out of service",
                g.booked, g.total, g.free, g.out
            );
            let _ = write!(
                p.body,
                r#"<tr><th scope="row">{}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class="wide">{}</td></tr>"#,
                if i == 0 {
                    pool_link(&pool.name)
                } else {
                    String::new()
                },
                esc(class),
                g.total,
                g.free,
                g.booked,
                g.out,
                g.held,
                if wr == 0 {
                    "—".to_string()
                } else {
                    format!("{wr} ({wg} GPUs)")
                },
                bar(
                    &[
                        ("booked", g.booked),
                        ("free", g.free),
                        ("out", g.out),
                        ("held", g.held)
                    ],
                    g.total,
                    &label
                ),
            );
        }
    }
    if !pools.is_empty() {
        p.body.push_str("</tbody></table>");
    }
    p.body.push_str("</section>");
    p.body
        .push_str(r#"<section aria-labelledby="nodes"><h2 id="nodes">Nodes by standing</h2>"#);
    let kinds = [
        "ready",
        "cordoned",
        "draining",
        "faulted",
        "failed-check",
        "unreachable",
    ];
    p.body
        .push_str(r#"<table><thead><tr><th scope="col">Pool</th>"#);
    for k in kinds {
        let _ = write!(
            p.body,
            r#"<th scope="col"><span class="dot {k}"></span>{k}</th>"#
        );
    }
    p.body.push_str("</tr></thead><tbody>");
    for pool in &pools {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for n in pool.nodes.values().filter(|n| !n.left) {
            *counts.entry(standing(n)).or_default() += 1;
        }
        let _ = write!(
            p.body,
            r#"<tr><th scope="row">{}</th>"#,
            pool_link(&pool.name)
        );
        for k in kinds {
            let _ = write!(p.body, "<td>{}</td>", counts.get(k).copied().unwrap_or(0));
        }
        p.body.push_str("</tr>");
    }
    p.body.push_str("</tbody></table></section>");
    Ok(p)
}
