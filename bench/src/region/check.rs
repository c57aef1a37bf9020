//! The drill's invariant checker. It reads the tables themselves (through
//! `replay::invariants`, which folds the rows with no help from Strata's
//! projections), the daemons' own records (their `allocations/` and
//! `commands.log`), what the webhook receiver was sent and what JetStream
//! stored. Every violation names the positions (or nodes, or ids) it is
//! about.
//!
//! After each scenario: the log's invariants, the acknowledged reservations,
//! and both sinks up to where they had caught up. At the end, once the load
//! has stopped, also the daemons' bound reservations against the log's live
//! allocations (while reservations come and go the two differ by what is in
//! flight), the commands each daemon ran, and the usage rollups against a
//! fold of the raw log.

use super::fleet::Fleet;
use anyhow::Result;
use replay::invariants::Violation;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// At most this many items are named in one violation.
const NAMED: usize = 20;

/// The log's invariants and every acknowledged reservation present.
pub async fn log(client: &Client, acked: &[String]) -> Result<(i64, Vec<Violation>)> {
    let report = replay::invariants::check(client).await?;
    let mut v = report.violations;
    let requested: HashSet<String> = client
        .query(
            "SELECT stream FROM strata.events WHERE stream LIKE 'reservation/%' AND version = 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    let missing: Vec<&String> = acked
        .iter()
        .filter(|id| !requested.contains(&domain::reservation_stream(id)))
        .collect();
    if !missing.is_empty() {
        v.push(Violation {
            invariant: "acknowledged_reservations",
            positions: Vec::new(),
            detail: format!(
                "{} reservations the load generator saw acknowledged are not in the log: {:?}",
                missing.len(),
                missing.iter().take(NAMED).collect::<Vec<_>>()
            ),
        });
    }
    Ok((report.events, v))
}

/// What every daemon recorded as bound against the log's live allocations
/// on its node. The two converge once the binder has caught up, so this
/// waits up to `within` for them to agree before it reports a difference.
pub async fn bound(client: &Client, fleet: &Fleet, within: Duration) -> Result<Vec<Violation>> {
    let deadline = Instant::now() + within;
    let mut placements = replay::invariants::Placements::default();
    loop {
        placements.catch_up(client).await?;
        let live = placements.live();
        let mut differ = Vec::new();
        for n in &fleet.nodes {
            let on_node = node::allocation::bound_reservations(&n.dir);
            let in_log = live.get(&n.id).cloned().unwrap_or_default();
            if on_node != in_log {
                differ.push((n.id.clone(), on_node, in_log));
            }
        }
        if differ.is_empty() {
            return Ok(Vec::new());
        }
        if Instant::now() > deadline {
            let (node, on_node, in_log) = &differ[0];
            let extra: Vec<_> = on_node.difference(in_log).take(NAMED).collect();
            let lacking: Vec<_> = in_log.difference(on_node).take(NAMED).collect();
            let positions = placed_positions(client, extra.iter().chain(&lacking)).await?;
            return Ok(vec![Violation {
                invariant: "bound_devices",
                positions,
                detail: format!(
                    "{} nodes' bound reservations differ from the log's live allocations after {within:?}; first {node}: bound but not live {extra:?}, live but not bound {lacking:?}",
                    differ.len()
                ),
            }]);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Positions of these reservations' `reservation.placed` events.
async fn placed_positions<'a>(
    client: &Client,
    ids: impl Iterator<Item = &'a &'a String>,
) -> Result<Vec<i64>> {
    let ids: Vec<String> = ids.map(|s| s.to_string()).collect();
    Ok(client
        .query(
            "SELECT position FROM strata.events WHERE stream LIKE 'pool/%'
                AND payload->>'reservation' = ANY($1) ORDER BY position LIMIT 40",
            &[&ids],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Command ids a daemon started more than once, from its `commands.log`
/// (a line without an outcome is written before each run).
pub fn commands_run_twice(fleet: &Fleet) -> (u64, Vec<Violation>) {
    let mut twice = Vec::new();
    for n in &fleet.nodes {
        let Ok(text) = std::fs::read_to_string(n.dir.join("commands.log")) else {
            continue;
        };
        let mut started: HashMap<String, u32> = HashMap::new();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if v.get("outcome").is_none_or(|o| o.is_null()) {
                if let Some(id) = v["id"].as_str() {
                    *started.entry(id.to_string()).or_default() += 1;
                }
            }
        }
        twice.extend(
            started
                .into_iter()
                .filter(|(_, c)| *c > 1)
                .map(|(id, _)| format!("{id} on {}", n.id)),
        );
    }
    let count = twice.len() as u64;
    let v = if twice.is_empty() {
        Vec::new()
    } else {
        twice.sort();
        vec![Violation {
            invariant: "commands_run_twice",
            positions: Vec::new(),
            detail: format!(
                "{count} commands ran twice on their node: {:?}",
                &twice[..twice.len().min(NAMED)]
            ),
        }]
    };
    (count, v)
}

/// Arrivals at the webhook receiver, in order, and the set of positions
/// seen (for the probes' lookups).
#[derive(Default)]
pub struct Received {
    pub arrivals: Mutex<(Vec<u64>, HashSet<u64>)>,
}

impl Received {
    pub fn record(&self, positions: impl Iterator<Item = u64>) {
        let mut a = self.arrivals.lock().expect("receiver lock");
        for p in positions {
            a.0.push(p);
            a.1.insert(p);
        }
    }

    /// Deliveries of a position the receiver had already had (at-least-once
    /// delivery repeating itself after a fault).
    pub fn redelivered(&self) -> usize {
        let a = self.arrivals.lock().expect("receiver lock");
        a.0.len() - a.1.len()
    }

    pub fn has(&self, position: u64) -> bool {
        self.arrivals
            .lock()
            .expect("receiver lock")
            .1
            .contains(&position)
    }
}

/// The last position matching `prefix` now, and whether the sink's durable
/// cursor reached it within `within` (events appended meanwhile are for a
/// later check).
pub async fn sink_caught_up(
    client: &Client,
    sink: &str,
    prefix: &str,
    within: Duration,
) -> Result<(i64, bool)> {
    let last: i64 = client
        .query_one(
            "SELECT coalesce(max(position), 0) FROM strata.events WHERE stream LIKE $1",
            &[&format!("{prefix}%")],
        )
        .await?
        .get(0);
    let deadline = Instant::now() + within;
    loop {
        let cursor = sinks::config::cursor(client, sink).await.ok().flatten();
        if cursor.is_some_and(|c| c as i64 >= last) {
            return Ok((last, true));
        }
        if Instant::now() > deadline {
            return Ok((last, false));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The usage rollups against a fold of the raw log (`replay check`'s usage
/// part), once the usage role has caught up with the log's head as it is
/// now (after the last fault it may be behind; it gets `within`).
pub async fn usage(
    cfg: &tokio_postgres::Config,
    client: &mut Client,
    within: Duration,
) -> Result<Vec<Violation>> {
    let head: i64 = client
        .query_one("SELECT last_position FROM strata.log_head", &[])
        .await?
        .get(0);
    let deadline = Instant::now() + within;
    loop {
        let at = projections::usage::store::position(client)
            .await?
            .map_or(0, |p| p as i64);
        if at >= head {
            break;
        }
        if Instant::now() > deadline {
            return Ok(vec![Violation {
                invariant: "usage_caught_up",
                positions: vec![at, head],
                detail: format!(
                    "the usage rollups stand at position {at}, the log's head at {head}, {within:?} after the load stopped"
                ),
            }]);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let db = events::db::Database::from(cfg.clone());
    let c = projections::usage::verify::verify(&db, client, |_| {}).await?;
    Ok(c.differences
        .into_iter()
        .map(|detail| Violation {
            invariant: "usage_rollups",
            positions: Vec::new(),
            detail,
        })
        .collect())
}

/// Positions up to `upto` of the events whose stream starts with `prefix`.
async fn matching(client: &Client, prefix: &str, upto: i64) -> Result<BTreeSet<i64>> {
    Ok(client
        .query(
            "SELECT position FROM strata.events WHERE stream LIKE $1 AND position <= $2",
            &[&format!("{prefix}%"), &upto],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Every event up to `upto` whose stream starts with `prefix` was
/// delivered at least once, and first deliveries came in position order.
pub async fn webhook(
    client: &Client,
    prefix: &str,
    upto: i64,
    got: &Received,
) -> Result<Vec<Violation>> {
    let want = matching(client, prefix, upto).await?;
    let arrivals = got.arrivals.lock().expect("receiver lock").0.clone();
    let mut seen = BTreeSet::new();
    let mut out_of_order = Vec::new();
    let mut last_new = 0u64;
    for p in arrivals {
        if seen.insert(p as i64) {
            if p < last_new {
                out_of_order.push(p as i64);
            }
            last_new = p;
        }
    }
    let mut v = Vec::new();
    let missing: Vec<i64> = want.difference(&seen).copied().collect();
    if !missing.is_empty() {
        v.push(Violation {
            invariant: "sink_delivery",
            positions: missing.iter().take(NAMED).copied().collect(),
            detail: format!(
                "{} events matching the webhook sink's filter were never delivered",
                missing.len()
            ),
        });
    }
    if !out_of_order.is_empty() {
        v.push(Violation {
            invariant: "sink_order",
            positions: out_of_order.iter().take(NAMED).copied().collect(),
            detail: format!(
                "{} events first reached the webhook after a later one",
                out_of_order.len()
            ),
        });
    }
    Ok(v)
}

/// Every event up to `upto` whose stream starts with `prefix` is stored in
/// the JetStream stream exactly once (by its `Nats-Msg-Id`, ending in the position),
/// and nothing is stored twice.
pub async fn jetstream(
    client: &Client,
    prefix: &str,
    upto: i64,
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> Result<Vec<Violation>> {
    use futures_util::StreamExt;
    let want = matching(client, prefix, upto).await?;
    let mut s = js.get_stream(stream).await?;
    let stored = s.info().await?.state.messages;
    let consumer = s
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            // An ephemeral consumer not asked for 5 s is deleted by the
            // server (its default), and a check starved for that long on a
            // saturated machine read nothing more: give it the check's own
            // deadline.
            inactive_threshold: super::CHECK_STATEMENT_TIMEOUT,
            ..Default::default()
        })
        .await?;
    let mut counts: BTreeMap<i64, u32> = BTreeMap::new();
    let mut read = 0u64;
    // A fetch that brings nothing may only be late (the server shares the
    // cores): given up after a minute without progress.
    let mut progressed = Instant::now();
    while read < stored {
        let mut batch = consumer
            .fetch()
            .max_messages(5000)
            .expires(Duration::from_secs(2))
            .messages()
            .await?;
        let before = read;
        while let Some(m) = batch.next().await {
            let m = m.map_err(|e| anyhow::anyhow!("read JetStream: {e}"))?;
            read += 1;
            let id = m
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .and_then(|v| v.as_str().rsplit(':').next()?.parse::<i64>().ok());
            if let Some(p) = id {
                *counts.entry(p).or_default() += 1;
            }
        }
        if read > before {
            progressed = Instant::now();
        } else if progressed.elapsed() > Duration::from_secs(60) {
            break;
        }
    }
    let mut v = Vec::new();
    let twice: Vec<i64> = counts
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(p, _)| *p)
        .collect();
    if !twice.is_empty() {
        v.push(Violation {
            invariant: "jetstream_once",
            positions: twice.iter().take(NAMED).copied().collect(),
            detail: format!(
                "{} events are stored more than once in JetStream",
                twice.len()
            ),
        });
    }
    let missing: Vec<i64> = want
        .iter()
        .filter(|p| !counts.contains_key(p))
        .copied()
        .collect();
    if !missing.is_empty() {
        v.push(Violation {
            invariant: "jetstream_once",
            positions: missing.iter().take(NAMED).copied().collect(),
            detail: format!(
                "{} events matching the NATS sink's filter are not in JetStream ({stored} stored, {read} read{})",
                missing.len(),
                if read < stored {
                    "; the read stopped after a minute without progress"
                } else {
                    ""
                }
            ),
        });
    }
    Ok(v)
}

/// Both sinks: delivered (webhook: at least once, in order; JetStream:
/// exactly once) up to where each had caught up within `within`.
pub async fn sinks(
    client: &Client,
    hook: &Received,
    js: Option<&async_nats::jetstream::Context>,
    within: Duration,
) -> Result<Vec<Violation>> {
    use super::{HOOK_PREFIX, HOOK_SINK, JS_PREFIX, JS_SINK, JS_STREAM};
    let mut v = Vec::new();
    let (upto, caught_up) = sink_caught_up(client, HOOK_SINK, HOOK_PREFIX, within).await?;
    if !caught_up {
        v.push(Violation {
            invariant: "sink_delivery",
            positions: vec![upto],
            detail: format!("the webhook sink had not reached position {upto} after {within:?}"),
        });
    }
    v.extend(webhook(client, HOOK_PREFIX, upto, hook).await?);
    if let Some(js) = js {
        let (upto, caught_up) = sink_caught_up(client, JS_SINK, JS_PREFIX, within).await?;
        if !caught_up {
            v.push(Violation {
                invariant: "jetstream_once",
                positions: vec![upto],
                detail: format!("the NATS sink had not reached position {upto} after {within:?}"),
            });
        }
        v.extend(jetstream(client, JS_PREFIX, upto, js, JS_STREAM).await?);
    }
    Ok(v)
}
