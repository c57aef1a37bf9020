//! Where a reservation's time from request to active goes, step by step:
//! the log's `recorded_at` of its request, placement, first bind command,
//! last bind outcome and activation, and between them when the bind reached
//! its node and when the node had run it (the fleet's own clock, the same
//! wall clock: everything runs on one machine).

use super::fleet::NodeTimes;
use crate::util::{pct, unix};
use anyhow::Result;
use std::collections::HashMap;
use std::time::SystemTime;

/// What the log says of one reservation.
#[derive(Default)]
struct Seen {
    requested: Option<f64>,
    placed: Option<f64>,
    activated: Option<f64>,
    /// Bind command id -> (issued, finished in the log).
    binds: HashMap<String, (Option<f64>, Option<f64>)>,
}

/// The steps' p50 and p99 in seconds, for the reservations requested in
/// `window` (unix seconds) and active by now.
pub async fn of_window(
    c: &tokio_postgres::Client,
    window: [f64; 2],
    node: &HashMap<String, NodeTimes>,
) -> Result<serde_json::Value> {
    // Reservations requested in the window, and what followed them within
    // a minute.
    let rows = c
        .query(
            "SELECT stream, type, coalesce(payload->>'reservation', ''),
                    extract(epoch FROM recorded_at)::float8
               FROM strata.events
              WHERE recorded_at >= to_timestamp($1) AND recorded_at < to_timestamp($2) + interval '60 s'
                AND type IN ('reservation.requested', 'reservation.placed', 'reservation.activated',
                             'command.issued', 'command.succeeded')",
            &[&window[0], &window[1]],
        )
        .await?;
    let mut seen: HashMap<String, Seen> = HashMap::new();
    for row in &rows {
        let (stream, t, res, at): (&str, &str, &str, f64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        match t {
            "reservation.requested" | "reservation.activated" => {
                let Some(id) = stream.strip_prefix("reservation/") else {
                    continue;
                };
                let s = seen.entry(id.to_string()).or_default();
                if t == "reservation.requested" {
                    s.requested = Some(at);
                } else {
                    s.activated = Some(at);
                }
            }
            "reservation.placed" => {
                seen.entry(res.to_string()).or_default().placed = Some(at);
            }
            _ => {
                // command/bind:<reservation>:<node>
                let Some(id) = stream.strip_prefix("command/") else {
                    continue;
                };
                let Some(rest) = id.strip_prefix("bind:") else {
                    continue;
                };
                let Some((res, _)) = rest.rsplit_once(':') else {
                    continue;
                };
                let b = seen
                    .entry(res.to_string())
                    .or_default()
                    .binds
                    .entry(id.to_string())
                    .or_default();
                if t == "command.issued" {
                    b.0 = Some(at);
                } else {
                    b.1 = Some(at);
                }
            }
        }
    }
    let secs = |t: Option<SystemTime>| t.map(unix);
    let names = [
        "requested_to_placed",
        "placed_to_bind_issued",
        "bind_issued_to_node",
        "run_on_node",
        "node_to_bind_succeeded",
        "bind_succeeded_to_active",
    ];
    let mut steps: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for s in seen.values() {
        let (Some(q), Some(p), Some(a)) = (s.requested, s.placed, s.activated) else {
            continue;
        };
        if q < window[0] || q >= window[1] {
            continue;
        }
        // The bind that finished last decided the activation.
        let Some((id, (Some(issued), Some(done)))) = s
            .binds
            .iter()
            .filter(|(_, (i, d))| i.is_some() && d.is_some())
            .max_by(|x, y| x.1 .1.partial_cmp(&y.1 .1).expect("times compare"))
            .map(|(id, b)| (id, *b))
        else {
            continue;
        };
        steps[0].push(p - q);
        steps[1].push(issued - p);
        steps[5].push(a - done);
        let times = node.get(id);
        if let (Some(got), Some(ran)) = (
            secs(times.map(|t| t.received)),
            secs(times.and_then(|t| t.finished)),
        ) {
            steps[2].push(got - issued);
            steps[3].push(ran - got);
            steps[4].push(done - ran);
        }
    }
    let mut out = serde_json::Map::new();
    for (name, v) in names.iter().zip(steps.iter_mut()) {
        out.insert(
            name.to_string(),
            serde_json::json!({ "count": v.len(), "p50_s": pct(v, 0.5), "p99_s": pct(v, 0.99) }),
        );
    }
    Ok(out.into())
}
