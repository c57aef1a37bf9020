//! A pool: every node and GPU as one grid drawn on a canvas by the
//! console's script (free, booked, out of service, held; nodes grouped by
//! rack, or block), zoomable and searchable, from one compact list in a
//! data attribute: 10,000 nodes are one element, not 80,000. Beside it, a
//! table of the nodes a search or a standing picks (the first
//! [`LISTED`]), which is what a keyboard or a screen reader uses, and the
//! pool's queues and policies in brief.

use crate::auth::Who;
use crate::form;
use crate::html::{esc, node_link, Page};
use crate::pages::{gpus_by_class, standing, uses};
use crate::reply::Failure;
use crate::Shared;
use gateway::roles::Need;
use std::fmt::Write;

/// Most nodes listed in the table.
pub const LISTED: usize = 100;

/// `s` as a JSON string, appended to `out`.
fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

pub async fn page(
    shared: &Shared,
    who: &Who,
    pool: &str,
    query: &[(String, String)],
) -> Result<Page, Failure> {
    let search = form::get(query, "q").unwrap_or("").trim().to_string();
    let only = form::get(query, "standing").unwrap_or("").to_string();
    let index = shared.live.index();
    let Some(p) = index.pool(pool).filter(|p| p.created) else {
        return Err(Failure::not_found(format!("no pool {pool:?}")));
    };
    let mut page = Page::new(format!("Pool {pool}"), "region");
    page.watch = vec![format!("pool/{pool}")];
    // The grid's data: [name, group, standing, gpu letters, queues].
    let mut grid = String::with_capacity(p.nodes.len() * 48);
    let mut nodes = 0usize;
    let mut listed = String::new();
    let (mut matched, mut shown) = (0usize, 0usize);
    for (name, n) in p.nodes.iter().filter(|(_, n)| !n.left) {
        let group = n.rack.as_deref().or(n.block.as_deref()).unwrap_or("");
        let st = standing(n);
        let mut holders: Vec<String> = n
            .devices
            .iter()
            .filter_map(|d| d.booked_by.as_deref())
            .filter_map(|r| index.reservation(r))
            .map(|r| {
                r.request
                    .queue
                    .clone()
                    .unwrap_or_else(|| r.request.reservation.clone())
            })
            .collect();
        holders.sort();
        holders.dedup();
        let gpus: String = uses(n).into_iter().map(|(_, u)| u.letter()).collect();
        if nodes > 0 {
            grid.push(',');
        }
        nodes += 1;
        grid.push('[');
        let held = holders.join(" ");
        for (i, field) in [name.as_str(), group, st, &gpus, &held].iter().enumerate() {
            if i > 0 {
                grid.push(',');
            }
            json_string(field, &mut grid);
        }
        grid.push(']');
        let hit = (search.is_empty() || name.contains(&search) || group.contains(&search))
            && (only.is_empty() || only == st);
        if hit && (!search.is_empty() || !only.is_empty()) {
            matched += 1;
            if shown < LISTED {
                shown += 1;
                let free = gpus.chars().filter(|c| *c == 'f').count();
                let _ = write!(
                    listed,
                    r#"<tr><th scope="row">{}</th><td>{}</td><td><span class="dot {st}"></span>{st}</td><td>{free} of {}</td><td>{}</td></tr>"#,
                    node_link(name),
                    esc(group),
                    gpus.len(),
                    esc(&holders.join(", ")),
                );
            }
        }
    }
    let classes: Vec<String> = gpus_by_class(p)
        .iter()
        .map(|(c, g)| {
            format!(
                "{}: {} of {} free, {} booked, {} out of service",
                esc(c),
                g.free,
                g.total,
                g.booked,
                g.out
            )
        })
        .collect();
    let _ = write!(
        page.body,
        r#"<p class="summary">{} nodes. {}</p>
<p><a href="/queues?pool={}">Queues of this pool</a></p>
<section aria-labelledby="grid-h"><h2 id="grid-h">Nodes and GPUs</h2>
<div class="legend"><span class="key f">free</span><span class="key b">booked</span><span class="key o">out of service</span><span class="key h">held (node takes nothing now)</span></div>
<div class="grid-tools"><label>Find a node <input id="grid-find" type="search" placeholder="name or rack"></label>
<button type="button" data-zoom="1" aria-label="Zoom in">+</button><button type="button" data-zoom="-1" aria-label="Zoom out">−</button> <span id="grid-hover" aria-live="polite"></span></div>
<canvas id="grid" data-pool="{}" data-nodes="{}" role="img" aria-label="A grid of the pool's {} nodes, one cell per GPU; the table below lists nodes by search"></canvas>
</section>"#,
        nodes,
        classes.join("; "),
        form::encode(pool),
        esc(pool),
        esc(&format!("[{grid}]")),
        p.nodes.len(),
    );
    let _ = write!(
        page.body,
        r#"<section aria-labelledby="list-h"><h2 id="list-h">Find nodes</h2>
<form method="get" action="/pools/{}" class="inline"><label>Name or rack <input name="q" value="{}"></label>
<label>Standing <select name="standing"><option value="">any</option>{}</select></label><button type="submit">List</button></form>"#,
        form::encode(pool),
        esc(&search),
        [
            "ready",
            "cordoned",
            "draining",
            "faulted",
            "failed-check",
            "unreachable"
        ]
        .iter()
        .map(|s| format!(
            r#"<option{}>{s}</option>"#,
            if only == *s { " selected" } else { "" }
        ))
        .collect::<String>(),
    );
    if !search.is_empty() || !only.is_empty() {
        let _ = write!(
            page.body,
            r#"<table><caption>{matched} nodes match{}</caption><thead><tr><th scope="col">Node</th><th scope="col">Rack</th><th scope="col">Standing</th><th scope="col">Free GPUs</th><th scope="col">Held by</th></tr></thead><tbody>{listed}</tbody></table>"#,
            if matched > shown {
                format!("; the first {shown} are listed")
            } else {
                String::new()
            },
        );
    }
    page.body.push_str("</section>");
    reserve_form(who, pool, p, &mut page.body);
    Ok(page)
}

/// Reserving in the pool, where the operator's role allows it.
fn reserve_form(who: &Who, pool: &str, p: &projections::index::Pool, out: &mut String) {
    if who.role.allows(&who.operator, Need::Pool(pool)).is_err() {
        return;
    }
    let classes: String = gpus_by_class(p)
        .keys()
        .map(|c| format!("<option>{}</option>", esc(c)))
        .collect();
    let queues: String = p
        .queues
        .keys()
        .map(|q| format!("<option>{}</option>", esc(q)))
        .collect();
    let _ = write!(
        out,
        r#"<section aria-labelledby="res-h"><h2 id="res-h">Reserve</h2><form method="post" action="/pools/{}/reserve" class="inline"><input type="hidden" name="csrf" value="{}">
<label>Class <select name="class">{classes}</select></label><label>GPUs <input name="gpus" type="number" min="1" value="1" required></label>
<label>Time to live <input name="ttl" placeholder="e.g. 2h (none: until released)"></label>{}<button type="submit" id="reserve">Reserve</button></form></section>"#,
        form::encode(pool),
        esc(&who.csrf),
        if queues.is_empty() {
            String::new()
        } else {
            format!(r#"<label>Queue <select name="queue">{queues}</select></label>"#)
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_fields_are_json_strings() {
        for s in ["n1", "a\"b", "back\\slash", "tab\there", "é"] {
            let mut out = String::new();
            json_string(s, &mut out);
            assert_eq!(serde_json::from_str::<String>(&out).unwrap(), s);
        }
    }
}
