//! Queues: each queue's GPUs used against its quota, what it borrows and
//! its fair share, per class; its usage over the last hour as a chart
//! (`samples.rs`); and who waits in it and why, in the placer's words.

use crate::form;
use crate::html::{bar, esc, lines, pool_link, reservation_link, Page};
use crate::live::unix_ms;
use crate::reply::Failure;
use crate::Shared;
use std::fmt::Write;

/// Most waiting requests listed per queue.
const WAITERS: usize = 10;

pub async fn page(shared: &Shared, only: Option<&str>) -> Result<Page, Failure> {
    let now = unix_ms(std::time::SystemTime::now());
    let index = shared.live.index();
    let mut page = Page::new(
        match only {
            Some(p) => format!("Queues of pool {p}"),
            None => "Queues".to_string(),
        },
        "queues",
    );
    page.watch = match only {
        Some(p) => vec![format!("pool/{p}")],
        None => vec!["pool/".into()],
    };
    let pools: Vec<&String> = index
        .state()
        .pools
        .keys()
        .filter(|p| only.is_none_or(|o| o == p.as_str()))
        .collect();
    if let Some(o) = only {
        if pools.is_empty() {
            return Err(Failure::not_found(format!("no pool {o:?}")));
        }
    }
    let samples = shared.live.samples();
    let mut any = false;
    for pool in pools {
        let shares = projections::quota::fair_shares(&index, pool, now);
        if shares.is_empty() {
            continue;
        }
        any = true;
        let _ = write!(
            page.body,
            r#"<section aria-labelledby="q-{id}"><h2 id="q-{id}">Pool {}</h2><table><caption>Use against quota and fair share</caption><thead><tr><th scope="col">Queue</th><th scope="col">Cohort</th><th scope="col">Class</th><th scope="col">Quota</th><th scope="col">Used</th><th scope="col">Borrowed</th><th scope="col">Fair share</th><th scope="col">Waiting GPUs</th><th scope="col">Past (GPUs)</th><th scope="col" class="wide">Used / quota</th></tr></thead><tbody>"#,
            pool_link(pool),
            id = form::encode(pool),
        );
        for s in &shares {
            let borrowed = s.used.saturating_sub(s.nominal);
            let label = format!(
                "{} used of a quota of {}, fair share {}",
                s.used, s.nominal, s.fair
            );
            let _ = write!(
                page.body,
                r#"<tr><th scope="row">{}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td class="wide">{}</td></tr>"#,
                esc(&s.queue),
                esc(s.cohort.as_deref().unwrap_or("—")),
                esc(&s.class),
                s.nominal,
                s.used,
                if borrowed > 0 {
                    borrowed.to_string()
                } else {
                    "—".into()
                },
                s.fair,
                s.waiting,
                s.past_gpus,
                bar(
                    &[
                        ("booked", s.used.min(s.nominal)),
                        ("borrowed", borrowed),
                        ("free", s.nominal.saturating_sub(s.used))
                    ],
                    s.nominal.max(s.used).max(1),
                    &label
                ),
            );
        }
        page.body.push_str("</tbody></table>");
        let mut queues: Vec<&str> = shares.iter().map(|s| s.queue.as_str()).collect();
        queues.dedup();
        for queue in queues {
            let series = samples.of(pool, queue);
            let times: Vec<u64> = series.iter().map(|s| s.at_ms).collect();
            let _ = write!(
                page.body,
                r#"<details class="queue" open><summary>{} over the last hour</summary>{}"#,
                esc(queue),
                if series.len() < 2 {
                    "<p>Sampled every 10 s: the chart starts with the second sample.</p>"
                        .to_string()
                } else {
                    lines(
                        &times,
                        &[
                            ("used", "used", series.iter().map(|s| s.used).collect()),
                            (
                                "fair",
                                "fair share",
                                series.iter().map(|s| s.fair).collect(),
                            ),
                            (
                                "waiting",
                                "waiting",
                                series.iter().map(|s| s.waiting).collect(),
                            ),
                        ],
                        &format!("GPUs used, fair share and waiting of queue {queue}"),
                    )
                }
            );
            waiters(&index, pool, queue, now, &mut page.body);
            page.body.push_str("</details>");
        }
        page.body.push_str("</section>");
    }
    if !any {
        page.body.push_str(
            "<p>No pool has queues. An admin creates them with <code>strata queues create</code>.</p>",
        );
    }
    Ok(page)
}

/// Who waits in a queue, in order, and why.
fn waiters(index: &projections::Index, pool: &str, queue: &str, now: u64, out: &mut String) {
    let Some(q) = index.queues(pool) else { return };
    let mut ids: Vec<&str> = q
        .queued_by_queue
        .get(queue)
        .map(|keys| keys.iter().map(|k| k.2.as_str()).collect())
        .unwrap_or_default();
    for (_, _, id) in &q.pending {
        if index
            .reservation(id)
            .is_some_and(|r| r.request.queue.as_deref() == Some(queue))
        {
            ids.push(id);
        }
    }
    if ids.is_empty() {
        out.push_str("<p>Nobody waits.</p>");
        return;
    }
    out.push_str(r#"<table><caption>Who waits</caption><thead><tr><th scope="col">#</th><th scope="col">Reservation</th><th scope="col">GPUs</th><th scope="col">Why</th></tr></thead><tbody>"#);
    let mut rows: Vec<(usize, String)> = ids
        .iter()
        .filter_map(|id| {
            let s = projections::waiting::standing(index, id, now)?;
            let r = index.reservation(id)?;
            Some((
                s.position,
                format!(
                    r#"<tr><td>{}</td><td>{}</td><td>{} × {}</td><td>{}</td></tr>"#,
                    s.position,
                    reservation_link(id),
                    r.request.gpus,
                    esc(&r.request.class),
                    esc(&s.why)
                ),
            ))
        })
        .collect();
    rows.sort_by_key(|(p, _)| *p);
    let total = rows.len();
    for (_, row) in rows.into_iter().take(WAITERS) {
        out.push_str(&row);
    }
    out.push_str("</tbody></table>");
    if total > WAITERS {
        let _ = write!(out, "<p>and {} more.</p>", total - WAITERS);
    }
}
