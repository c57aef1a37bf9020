//! A node: its standing and place in the topology, every GPU (class,
//! memory, island, who holds it, its conditions and quarantine), its
//! maintenance windows, the commands sent to it with their outcomes, what
//! the signed-in operator may do to it, and its timeline.

use crate::auth::Who;
use crate::form;
use crate::html::{esc, pool_link, reservation_link, time, Page};
use crate::mentions::node_key;
use crate::pages::{standing, timeline};
use crate::reply::Failure;
use crate::Shared;
use gateway::roles::Need;
use std::fmt::Write;

/// Most commands listed.
const COMMANDS: i64 = 20;

fn facts(pool: &str, n: &projections::index::Node) -> String {
    let st = standing(n);
    let mut s = format!(
        r#"<dl class="facts"><div><dt>Pool</dt><dd>{}</dd></div><div><dt>Standing</dt><dd><span class="dot {st}"></span>{st}</dd></div><div><dt>Rack</dt><dd>{}</dd></div><div><dt>Block</dt><dd>{}</dd></div><div><dt>Rail</dt><dd>{}</dd></div>"#,
        pool_link(pool),
        esc(n.rack.as_deref().unwrap_or("—")),
        esc(n.block.as_deref().unwrap_or("—")),
        esc(n.rail.as_deref().unwrap_or("—")),
    );
    for (what, why) in [
        ("Cordoned", n.cordoned.as_deref()),
        ("Draining", n.drained.as_deref()),
        ("Fault waiting", n.fault.as_deref()),
        ("Failed its check", n.acceptance_failed.as_deref()),
    ] {
        if let Some(why) = why {
            let _ = write!(
                s,
                "<div><dt>{what}</dt><dd>{}</dd></div>",
                esc(if why.is_empty() { "yes" } else { why })
            );
        }
    }
    if let Some(t) = n.unreachable_since_ms {
        let _ = write!(
            s,
            "<div><dt>Out of contact since</dt><dd>{}</dd></div>",
            time(t)
        );
    }
    if !n.conditions.is_empty() {
        let _ = write!(
            s,
            "<div><dt>Conditions</dt><dd>{}</dd></div>",
            esc(&n.conditions.join(", "))
        );
    }
    s.push_str("</dl>");
    s.push_str(r#"<section aria-labelledby="gpus"><h2 id="gpus">GPUs</h2><table><thead><tr><th scope="col">GPU</th><th scope="col">Class</th><th scope="col">Memory</th><th scope="col">Island</th><th scope="col">Held by</th><th scope="col">Health</th></tr></thead><tbody>"#);
    for d in &n.devices {
        let health = [
            d.quarantine.as_ref().map(|q| format!("quarantined ({q})")),
            d.fault.as_ref().map(|f| format!("fault waiting ({f})")),
            d.failed_acceptance.then(|| "failed its check".to_string()),
            (!d.conditions.is_empty()).then(|| d.conditions.join(", ")),
            (!d.present).then(|| "missing".to_string()),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>();
        let _ = write!(
            s,
            r#"<tr><th scope="row">{}{}</th><td>{}</td><td>{} MB</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            esc(&d.spec.id),
            d.spec.parent.as_ref().map_or(String::new(), |p| format!(
                " <small>(MIG of {})</small>",
                esc(p)
            )),
            esc(&d.spec.class),
            d.spec.memory_mb,
            esc(d.spec.island.as_deref().unwrap_or("—")),
            d.booked_by
                .as_deref()
                .map_or("—".to_string(), reservation_link),
            if health.is_empty() {
                "ok".to_string()
            } else {
                esc(&health.join("; "))
            },
        );
    }
    s.push_str("</tbody></table></section>");
    if !n.maintenance.is_empty() {
        s.push_str(r#"<section aria-labelledby="mw"><h2 id="mw">Maintenance</h2><ul>"#);
        for w in &n.maintenance {
            let _ = write!(
                s,
                "<li>{} to {}: {}</li>",
                time(w.start_ms),
                time(w.end_ms),
                esc(&w.reason)
            );
        }
        s.push_str("</ul></section>");
    }
    s
}

fn actions(who: &Who, pool: &str, node: &str, out: &mut String) {
    if let Err(why) = who.role.allows(&who.operator, Need::Pool(pool)) {
        let _ = write!(
            out,
            r#"<p class="note">You may not change this node: {}</p>"#,
            esc(&why)
        );
        return;
    }
    let url = form::encode(node);
    let csrf = esc(&who.csrf);
    out.push_str(
        r#"<section aria-labelledby="act"><h2 id="act">Actions</h2><div class="actions">"#,
    );
    for (action, label, reason) in [
        ("cordon", "Cordon", true),
        ("uncordon", "Uncordon", false),
        ("drain", "Drain", true),
        ("clear-health", "Clear health", false),
    ] {
        let _ = write!(
            out,
            r#"<form method="post" action="/nodes/{url}/{action}" class="action"><input type="hidden" name="csrf" value="{csrf}">{}<button type="submit" id="{action}">{label}</button></form>"#,
            if reason {
                format!(
                    r#"<label>Reason <input name="reason" value="{action}ed in the console"></label>"#
                )
            } else if action == "clear-health" {
                r#"<label>Condition <input name="condition" placeholder="e.g. XID-79" required></label><label>GPU <input name="device" placeholder="all"></label>"#.to_string()
            } else {
                String::new()
            }
        );
    }
    out.push_str("</div></section>");
}

pub async fn page(shared: &Shared, who: &Who, node: &str) -> Result<Page, Failure> {
    let mut page = Page::new(format!("Node {node}"), "region");
    page.mention = vec![node.to_string()];
    let pool = {
        let index = shared.live.index();
        let found = index.state().pools.values().find_map(|p| {
            p.nodes
                .get(node)
                .map(|n| (p.name.clone(), facts(&p.name, n)))
        });
        let Some((pool, facts)) = found else {
            return Err(Failure::not_found(format!("no node {node:?}")));
        };
        page.body.push_str(&facts);
        pool
    };
    actions(who, &pool, node, &mut page.body);
    let client = shared.db.get().await.map_err(Failure::unavailable)?;
    let commands = domain::commands::list(&client, Some(node), COMMANDS)
        .await
        .map_err(Failure::unavailable)?;
    page.body
        .push_str(r#"<section aria-labelledby="cmds"><h2 id="cmds">Commands</h2>"#);
    if commands.is_empty() {
        page.body.push_str("<p>None.</p>");
    } else {
        page.body.push_str(r#"<table><thead><tr><th scope="col">Command</th><th scope="col">Kind</th><th scope="col">By</th><th scope="col">State</th><th scope="col">Outcome</th></tr></thead><tbody>"#);
        for t in &commands {
            let state = serde_json::to_value(t.state)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            let _ = write!(
                page.body,
                r#"<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
                esc(&t.command.id),
                esc(&t.command.kind),
                esc(&t.command.issued_by),
                esc(&state),
                esc(&t
                    .outcome
                    .as_ref()
                    .map(|o| o.to_string())
                    .unwrap_or_default()),
            );
        }
        page.body.push_str("</tbody></table>");
    }
    page.body.push_str("</section>");
    timeline::section(
        &client,
        shared.live.mentions(&node_key(node)),
        "",
        &mut page.body,
    )
    .await?;
    Ok(page)
}
