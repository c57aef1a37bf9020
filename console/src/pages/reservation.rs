//! A reservation: its phase, devices and CDI device name, why it waits and
//! its place in its queue, what the signed-in operator may do with it, and
//! its timeline: every event that names it, from the request to the end,
//! with who acted and the trace id. A reservation that ended is known from
//! its own stream (and its timeline from the events that name it); one
//! the log has but this console has not folded yet is said to be so, and
//! its page turns live when the console catches up.

use crate::auth::Who;
use crate::form;
use crate::html::{esc, node_link, pool_link, time, Page};
use crate::live::unix_ms;
use crate::mentions::reservation_key;
use crate::pages::timeline;
use crate::reply::Failure;
use crate::Shared;
use gateway::roles::Need;
use std::fmt::Write;

pub async fn page(shared: &Shared, who: &Who, id: &str) -> Result<Page, Failure> {
    let now = unix_ms(std::time::SystemTime::now());
    let mut page = Page::new(format!("Reservation {id}"), "region");
    page.watch = vec![format!("reservation/{id}")];
    page.mention = vec![id.to_string()];
    let live_part = {
        let index = shared.live.index();
        index.reservation(id).map(|r| {
            let mut s = String::new();
            let state = r.state();
            let q = &r.request;
            let _ = write!(
                s,
                r#"<dl class="facts"><div><dt>State</dt><dd class="phase {state}">{state}</dd></div><div><dt>Pool</dt><dd>{}</dd></div><div><dt>Queue</dt><dd>{}</dd></div>
<div><dt>Asks for</dt><dd>{} × {} ({})</dd></div><div><dt>Priority</dt><dd>{}</dd></div>"#,
                pool_link(&q.pool),
                esc(q.queue.as_deref().unwrap_or("—")),
                q.gpus,
                esc(&q.class),
                serde_json::to_value(q.shape)
                    .ok()
                    .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_string))
                    .unwrap_or_default(),
                q.priority,
            );
            if let Some(at) = r.expires_at_ms {
                let _ = write!(s, "<div><dt>Ends by</dt><dd>{}</dd></div>", time(at));
            }
            if !r.reason.is_empty() {
                let _ = write!(s, "<div><dt>Said</dt><dd>{}</dd></div>", esc(&r.reason));
            }
            if r.phase.is_live() {
                let _ = write!(
                    s,
                    "<div><dt>CDI device</dt><dd><code>{}</code></dd></div>",
                    esc(&node::cdi::qualified_name(id))
                );
            }
            s.push_str("</dl>");
            if let Some(w) = projections::waiting::standing(&index, id, now) {
                let _ = write!(
                    s,
                    r#"<section aria-labelledby="why"><h2 id="why">Why it waits</h2><p class="why">{}</p><p>Place {} of {} in {}; {} requests ({} GPUs) ahead; {} GPUs of its class free now{}.</p></section>"#,
                    esc(&w.why),
                    w.position,
                    w.waiting,
                    esc(&w.queue.map_or("the pool".to_string(), |q| format!("queue {q}"))),
                    w.ahead,
                    w.ahead_gpus,
                    w.free_now,
                    w.earliest_start_ms.map_or(String::new(), |t| format!("; it could start at {} at the earliest", time(t))),
                );
            }
            let allocations = r.promise.as_ref().map_or(&r.allocations, |p| &p.allocations);
            if !allocations.is_empty() {
                s.push_str(r#"<section aria-labelledby="dev"><h2 id="dev">Devices</h2><table><thead><tr><th scope="col">Node</th><th scope="col">Devices</th></tr></thead><tbody>"#);
                for a in allocations {
                    let _ = write!(s, "<tr><td>{}</td><td>{}</td></tr>", node_link(&a.node), esc(&a.devices.join(", ")));
                }
                s.push_str("</tbody></table></section>");
            }
            s
        })
    };
    let client = shared.db.get().await.map_err(Failure::unavailable)?;
    let live = live_part.is_some();
    match live_part {
        Some(s) => {
            page.body.push_str(&s);
        }
        None => {
            match domain::requests::outcome(&client, id)
                .await
                .map_err(Failure::unavailable)?
            {
                Some(outcome) => {
                    let _ = write!(
                        page.body,
                        r#"<dl class="facts"><div><dt>State</dt><dd class="phase ended">{}</dd></div></dl>"#,
                        esc(&outcome)
                    );
                }
                // In the log but not yet folded here (this console is
                // behind, or folding again after a restart): said so, and
                // the page follows its stream until the request arrives.
                None if domain::requests::recorded(&client, id)
                    .await
                    .map_err(Failure::unavailable)? =>
                {
                    let _ = write!(
                        page.body,
                        r#"<dl class="facts"><div><dt>State</dt><dd class="phase requested">requested</dd></div></dl><p class="note" role="status">Recorded in the log; this console has not caught up with it yet. The page updates when it does.</p>"#
                    );
                }
                None => return Err(Failure::not_found(format!("no reservation {id:?}"))),
            }
        }
    }
    if live {
        let owner = domain::requests::owner(&client, id)
            .await
            .map_err(Failure::unavailable)?;
        let may = who.role.allows(
            &who.operator,
            Need::Release {
                owner: owner.flatten().as_deref(),
            },
        );
        match may {
            Ok(()) => {
                let _ = write!(
                    page.body,
                    r#"<form method="post" action="/reservations/{}/release" class="action"><input type="hidden" name="csrf" value="{}"><label>Reason <input name="reason" value="released in the console"></label><button type="submit" id="release">Release</button></form>"#,
                    form::encode(id),
                    esc(&who.csrf)
                );
            }
            Err(why) => {
                let _ = write!(
                    page.body,
                    r#"<p class="note">You may not release it: {}</p>"#,
                    esc(&why)
                );
            }
        }
    }
    let root = id.split('~').next().unwrap_or(id);
    let positions = shared.live.mentions(&reservation_key(id));
    let fallback = format!("reservation/{root}");
    timeline::section(&client, positions, &fallback, &mut page.body).await?;
    Ok(page)
}
