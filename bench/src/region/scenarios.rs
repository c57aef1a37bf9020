//! The drill's phases: the cold start, the measured steady phase, and each
//! fault. A fault's `recovery_s` is the time from the fault until a fresh
//! reservation (the probe) has gone the whole way again: requested,
//! placed, bound on its node, active, and that activation delivered by the
//! webhook sink.
//!
//! Times of what the region did are read from the log (`recorded_at` of
//! the events the gateways and placers wrote), on the same clock as the
//! drill's.

use super::{procs, Options, Region, HOOK_PREFIX};
use crate::util::round;
use anyhow::{Context, Result};
use domain::{Fact, Request, Shape};
use events::ExpectedVersion;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

pub(super) use crate::util::{pct, unix};

pub(super) fn spread(v: &mut [f64]) -> serde_json::Value {
    serde_json::json!({
        "count": v.len(),
        "p50_s": pct(v, 0.5),
        "p99_s": pct(v, 0.99),
        "all_s": pct(v, 1.0),
    })
}

/// Per node, the first time (unix seconds) an event of `event_type` about
/// it was recorded at or after `since`.
pub(super) async fn first_after(
    r: &Region,
    event_type: &str,
    since: SystemTime,
) -> Result<HashMap<String, f64>> {
    let c = r.client().await?;
    Ok(c.query(
        "SELECT payload->>'node', min(extract(epoch FROM recorded_at))::float8
           FROM strata.events WHERE type = $1 AND recorded_at >= to_timestamp($2)
          GROUP BY 1",
        &[&event_type, &unix(since)],
    )
    .await?
    .iter()
    .filter_map(|row| Some((row.get::<_, Option<String>>(0)?, row.get(1))))
    .collect())
}

/// The nodes with an event of one type since a position, kept up to date
/// by reading only what was appended since the last read (a range of the
/// primary key). A poll that scanned the whole table for the type took
/// seconds of the database's time on each turn once the log held the
/// fleet's joins, on the cores the region runs on.
pub(super) struct Seen {
    event_type: &'static str,
    after: i64,
    nodes: std::collections::HashSet<String>,
}

impl Seen {
    /// Nodes with `event_type` from the log's head on.
    pub(super) async fn from_head(r: &Region, event_type: &'static str) -> Result<Seen> {
        let c = r.client().await?;
        let after: i64 = c
            .query_one("SELECT last_position FROM strata.log_head", &[])
            .await?
            .get(0);
        Ok(Seen {
            event_type,
            after,
            nodes: Default::default(),
        })
    }

    /// How many nodes have had the event so far. Positions up to the log
    /// head read commit before it is (positions commit in order), so
    /// nothing committed later is skipped.
    pub(super) async fn count(&mut self, r: &Region) -> Result<usize> {
        let c = r.client().await?;
        let head: i64 = c
            .query_one("SELECT last_position FROM strata.log_head", &[])
            .await?
            .get(0);
        for row in c
            .query(
                "SELECT payload->>'node' FROM strata.events
                  WHERE position > $1 AND position <= $2 AND type = $3",
                &[&self.after, &head, &self.event_type],
            )
            .await?
        {
            if let Some(node) = row.get::<_, Option<String>>(0) {
                self.nodes.insert(node);
            }
        }
        self.after = head;
        Ok(self.nodes.len())
    }
}

/// Where each node's latest session is: gateway id -> nodes.
pub(super) async fn sessions_by_gateway(r: &Region) -> Result<BTreeMap<String, Vec<String>>> {
    let c = r.client().await?;
    let mut by: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for row in c
        .query(
            "SELECT DISTINCT ON (stream) payload->>'node', payload->>'gateway'
               FROM strata.events WHERE type = 'node.session_opened'
              ORDER BY stream, position DESC",
            &[],
        )
        .await?
    {
        let (node, gw): (Option<String>, Option<String>) = (row.get(0), row.get(1));
        if let (Some(n), Some(g)) = (node, gw) {
            by.entry(g).or_default().push(n);
        }
    }
    Ok(by)
}

fn counts(by: &BTreeMap<String, Vec<String>>) -> serde_json::Value {
    by.iter()
        .map(|(g, n)| (g.clone(), serde_json::Value::from(n.len())))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Every node started at the same instant: until joined (certificate
/// issued), connected (a session open) and schedulable (its inventory in
/// its pool).
pub async fn cold_start(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let n = r.fleet.nodes.len();
    let t0 = SystemTime::now();
    let mut joined = Seen::from_head(r, "node.joined").await?;
    let started = Instant::now();
    r.fleet.start(o.return_home);
    let mut last_report = Instant::now();
    loop {
        let ready = joined.count(r).await?;
        if ready >= n || started.elapsed() > o.patience {
            break;
        }
        if last_report.elapsed() > Duration::from_secs(5) {
            eprintln!(
                "  cold start: {ready} of {n} schedulable, {} sessions open, {:.0} s",
                r.fleet.stats.connected.load(Ordering::Relaxed),
                started.elapsed().as_secs_f64()
            );
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let base = unix(t0);
    let since = |m: HashMap<String, f64>| -> Vec<f64> { m.values().map(|t| t - base).collect() };
    let mut joined = since(first_after(r, "node.certificate_issued", t0).await?);
    let mut connected = since(first_after(r, "node.session_opened", t0).await?);
    let mut schedulable = since(first_after(r, "node.joined", t0).await?);
    let all = (schedulable.len() == n).then(|| pct(&mut schedulable, 1.0));
    Ok(serde_json::json!({
        "nodes": n,
        "joined": spread(&mut joined),
        "connected": spread(&mut connected),
        "schedulable": spread(&mut schedulable),
        "connected_p99_s": pct(&mut connected, 0.99),
        "all_schedulable_s": all.flatten(),
        "pushbacks": r.fleet.stats.pushbacks.load(Ordering::Relaxed),
        "pushback_wait_s": r.fleet.stats.pushback_wait_ms.load(Ordering::Relaxed) as f64 / 1000.0,
        "daemons_refused": r.fleet.ended(),
        "fleet_runtime_lag": r.fleet.lag.since(started),
        "refusals": r.fleet.why.lock().expect("why lock").iter().take(5).cloned().collect::<Vec<_>>(),
    }))
}

/// A sample of what the region uses.
struct Sample {
    at: Instant,
    pg_cpu: procs::PgCpu,
    roles: Vec<(String, f64, f64)>,
    own: (f64, f64),
    wal: i64,
    slot_lag: i64,
    connections: i64,
    commits: i64,
    /// The next transaction id: only a transaction that writes takes one.
    next_xid: i64,
}

async fn sample(r: &Region, c: &tokio_postgres::Client) -> Result<Sample> {
    let row = c
        .query_one(
            "SELECT (pg_current_wal_lsn() - '0/0')::bigint,
                    coalesce((SELECT max(pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
                                FROM pg_replication_slots), 0),
                    (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'
                        OR backend_type = 'walsender'),
                    (SELECT sum(xact_commit)::bigint FROM pg_stat_database),
                    pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
            &[],
        )
        .await?;
    let me = std::process::id();
    Ok(Sample {
        at: Instant::now(),
        pg_cpu: r
            .cluster
            .postmaster_pid()
            .map(procs::postgres_cpu)
            .unwrap_or_default(),
        roles: r
            .roles
            .iter()
            .map(|x| {
                let (cpu, rss) = x.usage();
                (x.name.clone(), cpu, rss)
            })
            .collect(),
        own: (crate::util::cpu_seconds(me), crate::gateway::rss_of(me)),
        wal: row.get(0),
        slot_lag: row.get(1),
        connections: row.get(2),
        commits: row.get(3),
        next_xid: row.get(4),
    })
}

/// The steady phase: CPU and RSS of PostgreSQL and each role, WAL, lag,
/// and what the log recorded in the window.
pub async fn steady(r: &mut Region, load: &super::Load, o: &Options) -> Result<serde_json::Value> {
    let c = r.client().await?;
    if o.statements {
        c.batch_execute(
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()",
        )
        .await
        .context("reset pg_stat_statements")?;
    }
    load.stats.measuring.store(true, Ordering::Relaxed);
    let (t_a, first) = (SystemTime::now(), sample(r, &c).await?);
    let mut samples = vec![];
    let end = Instant::now() + o.steady;
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_secs(1)).await;
        samples.push(sample(r, &c).await?);
    }
    let t_b = SystemTime::now();
    load.stats.measuring.store(false, Ordering::Relaxed);
    // Read at the window's end, before the drill's own reads below.
    let statements = if o.statements {
        top_statements(
            &c,
            (t_b.duration_since(t_a).unwrap_or_default()).as_secs_f64(),
        )
        .await?
    } else {
        serde_json::Value::Null
    };
    let last = samples.last().unwrap_or(&first);
    let secs = (last.at - first.at).as_secs_f64().max(1e-9);
    let mut roles = serde_json::Map::new();
    for (i, (name, cpu, _)) in last.roles.iter().enumerate() {
        let rss_max = samples.iter().map(|s| s.roles[i].2).fold(0.0, f64::max);
        roles.insert(
            name.clone(),
            serde_json::json!({
                "cpu_share": round((cpu - first.roles[i].1) / secs, 3),
                "rss_mib_max": round(rss_max, 1),
            }),
        );
    }
    let own_rss = samples.iter().map(|s| s.own.1).fold(0.0, f64::max);
    roles.insert(
        "nodes_and_load_generator".into(),
        serde_json::json!({
            "cpu_share": round((last.own.0 - first.own.0) / secs, 3),
            "rss_mib_max": round(own_rss, 1),
            "note": "the simulated daemons and the load generator, in the bench process",
        }),
    );
    let window = [unix(t_a), unix(t_b)];
    let count = |sql: &'static str| {
        let c = &c;
        async move {
            let n: i64 = c.query_one(sql, &[&window[0], &window[1]]).await?.get(0);
            anyhow::Ok(round(n as f64 / (window[1] - window[0]), 1))
        }
    };
    let events_per_s = count("SELECT count(*) FROM strata.events WHERE recorded_at >= to_timestamp($1) AND recorded_at < to_timestamp($2)").await?;
    let node_events_per_s = count("SELECT count(*) FROM strata.events WHERE (type LIKE 'node.%' OR type LIKE 'health.%') AND recorded_at >= to_timestamp($1) AND recorded_at < to_timestamp($2)").await?;
    let placed_per_s = count("SELECT count(*) FROM strata.events WHERE type = 'reservation.placed' AND recorded_at >= to_timestamp($1) AND recorded_at < to_timestamp($2)").await?;
    let commands_per_s = count("SELECT count(*) FROM strata.events WHERE type = 'command.issued' AND recorded_at >= to_timestamp($1) AND recorded_at < to_timestamp($2)").await?;
    // Sessions that ended or lost contact while nothing failed: each a
    // count over the window, not a rate.
    let mut sessions_lost = serde_json::Map::new();
    for t in [
        "node.disconnected",
        "node.contact_lost",
        "node.marked_unreachable",
    ] {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM strata.events WHERE type = $3 AND recorded_at >= to_timestamp($1) AND recorded_at < to_timestamp($2)",
                &[&window[0], &window[1], &t],
            )
            .await?
            .get(0);
        sessions_lost.insert(t.into(), n.into());
    }
    let mut to_active: Vec<f64> = c
        .query(
            "SELECT extract(epoch FROM a.recorded_at - q.recorded_at)::float8
               FROM strata.events q JOIN strata.events a
                 ON a.stream = q.stream AND a.type = 'reservation.activated'
              WHERE q.type = 'reservation.requested' AND q.stream LIKE 'reservation/rr%'
                AND q.recorded_at >= to_timestamp($1) AND q.recorded_at < to_timestamp($2)",
            &[&window[0], &window[1]],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    let mut ack: Vec<f64> = load
        .stats
        .ack
        .lock()
        .expect("ack lock")
        .iter()
        .map(|d| d.as_secs_f64() * 1000.0)
        .collect();
    let mix: serde_json::Map<String, serde_json::Value> = c
        .query(
            "SELECT type, count(*) FROM strata.events
              WHERE recorded_at >= to_timestamp($1) AND recorded_at < to_timestamp($2)
              GROUP BY type ORDER BY count(*) DESC LIMIT 16",
            &[&window[0], &window[1]],
        )
        .await?
        .iter()
        .map(|row| {
            let n: i64 = row.get(1);
            (
                row.get::<_, String>(0),
                round(n as f64 / (window[1] - window[0]), 1).into(),
            )
        })
        .collect();
    let binds = r.fleet.binds.lock().expect("binds lock").clone();
    let steps = super::steps::of_window(&c, window, &binds).await?;
    let pg_by_client = postgres_cpu_by_client(&c, &first, last, secs).await?;
    let max_lag = samples.iter().map(|s| s.slot_lag).max().unwrap_or(0);
    let max_conns = samples.iter().map(|s| s.connections).max().unwrap_or(0);
    Ok(serde_json::json!({
        "seconds": round(secs, 1),
        "postgres_cpu_share": round((last.pg_cpu.total - first.pg_cpu.total) / secs, 3),
        "postgres_walsenders_cpu_share": round((last.pg_cpu.walsenders - first.pg_cpu.walsenders) / secs, 3),
        "postgres_cpu_by_client": pg_by_client,
        "statements": statements,
        "roles": roles,
        "events_per_s": events_per_s,
        "event_mix_per_s": mix,
        "commits_per_s": round((last.commits - first.commits) as f64 / secs, 1),
        "writing_transactions_per_s": round((last.next_xid - first.next_xid) as f64 / secs, 1),
        "node_events_per_s": node_events_per_s,
        "placements_per_s": placed_per_s,
        "commands_issued_per_s": commands_per_s,
        "wal_bytes_per_s": round((last.wal - first.wal) as f64 / secs, 0),
        "slot_lag_max_bytes": max_lag,
        "postgres_connections_max": max_conns,
        "request_ack_p50_ms": pct(&mut ack, 0.5),
        "request_ack_p99_ms": pct(&mut ack, 0.99),
        "requested_to_active_p50_s": pct(&mut to_active, 0.5),
        "requested_to_active_p99_s": pct(&mut to_active, 0.99),
        "activated_in_window": to_active.len(),
        "requested_to_active_steps": steps,
        "sessions_lost_in_window": sessions_lost,
        "not_offered": load.stats.not_offered.load(Ordering::Relaxed),
        "appends_given_up": load.stats.gave_up.load(Ordering::Relaxed),
    }))
}

/// The statements of the window that took the most server time
/// (`pg_stat_statements`, reset at the window's start): calls per second,
/// mean milliseconds, and the share of a core their execution took (time
/// spent waiting, for a lock or a WAL flush, counts too: it is time, not
/// CPU); largest first.
async fn top_statements(c: &tokio_postgres::Client, secs: f64) -> Result<serde_json::Value> {
    let rows = c
        .query(
            "SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls,
                    total_exec_time + total_plan_time, rows
               FROM pg_stat_statements ORDER BY 3 DESC LIMIT 16",
            &[],
        )
        .await
        .context("read pg_stat_statements")?;
    Ok(rows
        .iter()
        .map(|row| {
            let (query, calls, ms, n): (String, i64, f64, i64) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            serde_json::json!({
                "query": query.chars().take(160).collect::<String>(),
                "calls_per_s": round(calls as f64 / secs, 1),
                "mean_ms": round(ms / (calls.max(1) as f64), 3),
                "time_share": round(ms / 1000.0 / secs, 3),
                "rows_per_call": round(n as f64 / (calls.max(1) as f64), 1),
            })
        })
        .collect())
}

/// PostgreSQL's CPU in the window by what it served: each live backend's
/// share under its `pg_stat_activity` backend type and application name
/// (the role's connection: `placer-1 reader`, `gateway writer`, ...), the
/// rest (backends that exited in the window, the postmaster) as one entry;
/// largest first.
async fn postgres_cpu_by_client(
    c: &tokio_postgres::Client,
    first: &Sample,
    last: &Sample,
    secs: f64,
) -> Result<serde_json::Value> {
    let rows = c
        .query(
            "SELECT pid, backend_type, coalesce(application_name, '') FROM pg_stat_activity",
            &[],
        )
        .await?;
    let mut by: std::collections::BTreeMap<String, f64> = Default::default();
    let mut attributed = 0.0;
    for row in rows {
        let pid = row.get::<_, i32>(0) as u32;
        let Some(now) = last.pg_cpu.by_pid.get(&pid) else {
            continue;
        };
        let used = now - first.pg_cpu.by_pid.get(&pid).copied().unwrap_or(0.0);
        let (kind, app): (String, String) = (row.get(1), row.get(2));
        let label = if app.is_empty() {
            kind
        } else {
            format!("{kind}: {app}")
        };
        *by.entry(label).or_default() += used;
        attributed += used;
    }
    let total = last.pg_cpu.total - first.pg_cpu.total;
    by.insert(
        "exited in the window, postmaster, not in pg_stat_activity".into(),
        (total - attributed).max(0.0),
    );
    let mut sorted: Vec<(String, f64)> = by.into_iter().filter(|(_, v)| *v > 0.0).collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(sorted
        .into_iter()
        .map(|(k, v)| serde_json::json!({"client": k, "cpu_share": round(v / secs, 3)}))
        .collect())
}

/// A fresh 1-GPU reservation in `pool`, until it is active and its
/// activation reached the webhook: seconds since `since`, or `None` after
/// the drill's patience. A probe that ends without becoming active (its
/// node failed while the fault lasted) is followed by a new one; each is
/// released once it has been seen.
pub async fn probe(r: &Region, o: &Options, pool: &str, since: Instant) -> Result<Option<f64>> {
    let deadline = Instant::now() + o.patience;
    while Instant::now() < deadline {
        let id = format!("probe-{:016x}", fastrand::u64(..));
        let stream = domain::reservation_stream(&id);
        let event = Fact::ReservationRequested(Request {
            reservation: id.clone(),
            pool: pool.into(),
            class: super::fleet::CLASS.into(),
            gpus: 1,
            shape: Shape::Any,
            priority: 10,
            ttl_ms: None,
            replace_on_failure: false,
            replaces: None,
            topology: None,
            requeue_on_preemption: false,
            start_ms: None,
            queue: None,
        })
        .to_event();
        let mut tried = false;
        loop {
            match r
                .appender
                .append(&stream, ExpectedVersion::NoStream, vec![event.clone()])
                .await
            {
                Ok(_) => break,
                Err(events::AppendError::VersionConflict { .. }) if tried => break,
                Err(e) if Instant::now() > deadline => return Err(e.into()),
                Err(_) => {
                    tried = true;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        // Until it is active and delivered, or it ended without that.
        loop {
            if Instant::now() > deadline {
                tell_stuck(r, &id).await;
                return Ok(None);
            }
            let mut ended = false;
            if let Ok(c) = events::db::connect(&r.cfg, "region-probe").await {
                let rows = c
                    .query(
                        "SELECT position, type FROM strata.events WHERE stream = $1
                           AND type IN ('reservation.activated', 'reservation.ended')",
                        &[&stream],
                    )
                    .await
                    .unwrap_or_default();
                let activated = rows
                    .iter()
                    .find(|row| row.get::<_, String>(1) == "reservation.activated")
                    .map(|row| row.get::<_, i64>(0));
                ended = activated.is_none() && !rows.is_empty();
                if let Some(p) = activated {
                    debug_assert!(stream.starts_with(HOOK_PREFIX));
                    let delivered = r.hook.has(p as u64);
                    if delivered {
                        let took = round(since.elapsed().as_secs_f64(), 2);
                        *r.probe_on_node_s.lock().expect("probe lock") = on_node(r, &id);
                        if took > SLOW_PROBE_S {
                            tell_slow(r, &id, since).await;
                        }
                        let _ = domain::requests::release(&r.appender, &id, "probe", None).await;
                        return Ok(Some(took));
                    }
                }
            }
            if ended {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(None)
}

/// The longest any node of probe `id` took from receiving its bind to
/// sending the result, in seconds; `None` if a node's times are not known.
fn on_node(r: &Region, id: &str) -> Option<f64> {
    let prefix = format!("bind:{id}:");
    let binds = r.fleet.binds.lock().expect("binds lock");
    let mut worst: Option<f64> = None;
    for (_, t) in binds.iter().filter(|(k, _)| k.starts_with(&prefix)) {
        let took = t.sent?.duration_since(t.received).unwrap_or_default();
        worst = Some(worst.unwrap_or(0.0).max(took.as_secs_f64()));
    }
    worst.map(|w| round(w, 2))
}

/// A recovery slower than this (the drill's target) tells where its probe
/// spent the time.
const SLOW_PROBE_S: f64 = 10.0;

/// A probe that went the whole way, but slowly, on standard error: each
/// event of its stream, of its pool about it and of its bind commands, at
/// seconds since the fault
/// (`since`), so a slow recovery says which step held it.
async fn tell_slow(r: &Region, id: &str, since: Instant) {
    let fault = unix(SystemTime::now()) - since.elapsed().as_secs_f64();
    let Ok(c) = events::db::connect(&r.cfg, "region-probe").await else {
        return;
    };
    let stream = domain::reservation_stream(id);
    // Its pool's word on it (placed, on which nodes) and its own stream.
    let own = c
        .query(
            "SELECT position, payload FROM strata.events
              WHERE stream = $1 OR (stream LIKE 'pool/%' AND payload->>'reservation' = $2)",
            &[&stream, &id],
        )
        .await
        .unwrap_or_default();
    // Its nodes, from its placement's allocations.
    let mut nodes: Vec<String> = own
        .iter()
        .flat_map(|row| {
            let p: serde_json::Value = row.get(1);
            p["allocations"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| a["node"].as_str().map(String::from))
                .collect::<Vec<_>>()
        })
        .collect();
    nodes.dedup();
    let positions: Vec<i64> = own.iter().map(|row| row.get(0)).collect();
    let binds: Vec<String> = nodes
        .iter()
        .map(|n| domain::commands::command_stream(&format!("bind:{id}:{n}")))
        .collect();
    let rows = c
        .query(
            "SELECT type, extract(epoch FROM recorded_at)::float8 FROM strata.events
              WHERE stream = ANY($1) OR position = ANY($2) ORDER BY position",
            &[&binds, &positions],
        )
        .await
        .unwrap_or_default();
    let mut steps: Vec<String> = rows
        .iter()
        .map(|row| {
            let at: f64 = row.get(1);
            format!("{} {:.1} s", row.get::<_, String>(0), at - fault)
        })
        .collect();
    // Its binds as their nodes saw them.
    let binds = r.fleet.binds.lock().expect("binds lock").clone();
    for n in &nodes {
        if let Some(t) = binds.get(&format!("bind:{id}:{n}")) {
            steps.push(format!(
                "{n} received its bind {:.1} s",
                unix(t.received) - fault
            ));
            if let Some(f) = t.finished {
                steps.push(format!("{n} ran it {:.1} s", unix(f) - fault));
            }
            if let Some(s) = t.sent {
                steps.push(format!("{n} sent its result {:.1} s", unix(s) - fault));
            }
        }
    }
    eprintln!("probe {id}, after the fault: {}", steps.join(", "));
    // What the roles said of its binds (a result recorded a second or more
    // after its session read it), and how late each role's runtime ran.
    // Each role's log is read once for both.
    let said = procs::said_since(&r.roles, SystemTime::now() - since.elapsed());
    let bind = format!("command=bind:{id}:");
    for (role, line) in said.iter().filter(|(_, l)| l.contains(&bind)) {
        eprintln!("  {role}: {line}");
    }
    let mut worst: BTreeMap<String, u64> = Default::default();
    for (role, line) in said.iter().filter(|(_, l)| l.contains("late_ms=")) {
        let late = line
            .split("late_ms=")
            .nth(1)
            .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let w = worst.entry(role.clone()).or_default();
        *w = (*w).max(late);
    }
    if !worst.is_empty() {
        eprintln!("  runtimes late by a second or more since the fault (worst, ms): {worst:?}");
    }
}

/// A probe that did not go the whole way in time, on standard error: every
/// event about it in the log (its own stream, its pool's word on it, its
/// commands), and each role's last warnings, so a failed drill says where
/// it stopped once its folder is gone.
async fn tell_stuck(r: &Region, id: &str) {
    eprintln!("probe {id} did not go the whole way in time; its events:");
    if let Ok(c) = events::db::connect(&r.cfg, "region-probe").await {
        let rows = c
            .query(
                "SELECT position, stream, type, recorded_at::text, payload::text FROM strata.events
                  WHERE stream = $1 OR payload->>'reservation' = $2
                     OR payload->'args'->>'reservation' = $2
                  ORDER BY position",
                &[&domain::reservation_stream(id), &id],
            )
            .await
            .unwrap_or_default();
        for row in rows {
            let payload: String = row.get(4);
            eprintln!(
                "  {} {} {} {} {}",
                row.get::<_, i64>(0),
                row.get::<_, String>(3),
                row.get::<_, String>(1),
                row.get::<_, String>(2),
                payload.chars().take(300).collect::<String>()
            );
        }
        tell_readers(&c).await;
        tell_leases(&c).await;
    }
    procs::tell_warnings(&r.roles, 10);
}

/// Who holds each lease (a pool's placer, the binder, each gateway, each
/// named subscription), since when, and how long ago each pool last had a
/// placement among the log's last 100,000 events: whether a stuck probe's
/// pool had a placer, and whether that placer placed anything.
async fn tell_leases(c: &tokio_postgres::Client) {
    let rows = c
        .query(
            "SELECT name, holder, epoch,
                    extract(epoch FROM now() - acquired_at)::float8,
                    extract(epoch FROM now() - renewed_at)::float8,
                    extract(epoch FROM expires_at - now())::float8
               FROM strata.leases ORDER BY name",
            &[],
        )
        .await
        .unwrap_or_default();
    eprintln!("  leases (name, holder, epoch; taken, renewed s ago; s left):");
    for row in rows {
        eprintln!(
            "    {} {} {} {:.1} {:.1} {:.1}",
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, i64>(2),
            row.get::<_, f64>(3),
            row.get::<_, f64>(4),
            row.get::<_, f64>(5),
        );
    }
    let rows = c
        .query(
            "SELECT stream, count(*), extract(epoch FROM now() - max(recorded_at))::float8
               FROM strata.events
              WHERE position > (SELECT max(position) FROM strata.events) - 100000
                AND type = 'reservation.placed'
              GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await
        .unwrap_or_default();
    eprintln!(
        "  placements among the log's last 100,000 events (pool stream, count, the last s ago):"
    );
    for row in rows {
        eprintln!(
            "    {} {} {:.1}",
            row.get::<_, String>(0),
            row.get::<_, i64>(1),
            row.get::<_, f64>(2),
        );
    }
}

/// Where each process's replication reader stands against the log and the
/// WAL: whether a walsender streams its slot, how far behind the server's
/// WAL its slot's restart and confirmed points are, and the last position
/// it acknowledged against the log's head.
async fn tell_readers(c: &tokio_postgres::Client) {
    let rows = c
        .query(
            "SELECT r.slot_name, r.owner, r.acked_position,
                    (SELECT max(position) FROM strata.events) AS head,
                    s.active, st.state,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::float8 / 1048576,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::float8 / 1048576,
                    extract(epoch FROM now() - r.seen_at)::float8
               FROM strata.replication_readers r
               LEFT JOIN pg_replication_slots s USING (slot_name)
               LEFT JOIN pg_stat_replication st ON st.pid = s.active_pid
              ORDER BY 1",
            &[],
        )
        .await
        .unwrap_or_default();
    eprintln!("  readers (slot, owner, acked position / log head, walsender state, MiB behind: restart, confirmed; seen s ago):");
    for row in rows {
        eprintln!(
            "    {} {} {:?}/{:?} active={:?} {:?} {:.1?} {:.1?} {:.1?}",
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, Option<i64>>(2),
            row.get::<_, Option<i64>>(3),
            row.get::<_, Option<bool>>(4),
            row.get::<_, Option<String>>(5),
            row.get::<_, Option<f64>>(6),
            row.get::<_, Option<f64>>(7),
            row.get::<_, Option<f64>>(8),
        );
    }
}

/// Every node loses power for `o.outage` and comes back.
pub async fn power_cycle(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let tries = crate::util::Tries::of(&r.fleet.stats);
    r.fleet.stop().await;
    tokio::time::sleep(o.outage).await;
    let mut opened = Seen::from_head(r, "node.session_opened").await?;
    let c = r.client().await?;
    if o.statements {
        c.batch_execute("SELECT pg_stat_statements_reset()")
            .await
            .context("reset pg_stat_statements")?;
    }
    let before = sample(r, &c).await?;
    let t = SystemTime::now();
    let back = Instant::now();
    r.fleet.start(o.return_home);
    let n = r.fleet.nodes.len();
    let recovery = probe(r, o, &r.pools[0].clone(), back).await?;
    loop {
        let connected = opened.count(r).await?;
        if connected >= n || back.elapsed() > o.patience {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let after = sample(r, &c).await?;
    let mut storm = storm_cpu(&c, &before, &after).await?;
    if o.statements {
        let secs = (after.at - before.at).as_secs_f64();
        storm["statements"] = top_statements(&c, secs).await?;
    }
    let mut reconnected: Vec<f64> = first_after(r, "node.session_opened", t)
        .await?
        .values()
        .map(|x| x - unix(t))
        .collect();
    Ok(serde_json::json!({
        "outage_s": o.outage.as_secs_f64(),
        "reconnected": spread(&mut reconnected),
        "all_reconnected": reconnected.len() == n,
        "recovery_s": recovery,
        "daemons": tries.since(&r.fleet.stats),
        "fleet_runtime_lag": r.fleet.lag.since(back),
        "reconnection_cpu": storm,
    }))
}

/// Where the CPU went between two samples (the fleet's reconnection), in
/// cores busy on average: PostgreSQL (its walsenders apart, and by client),
/// each role, and the bench's process (the simulated daemons and the load).
async fn storm_cpu(
    c: &tokio_postgres::Client,
    first: &Sample,
    last: &Sample,
) -> Result<serde_json::Value> {
    let secs = (last.at - first.at).as_secs_f64().max(1e-9);
    let share = |a: f64, b: f64| round((b - a) / secs, 3);
    let roles: serde_json::Map<String, serde_json::Value> = first
        .roles
        .iter()
        .zip(&last.roles)
        .map(|((name, a, _), (_, b, _))| (name.clone(), share(*a, *b).into()))
        .collect();
    Ok(serde_json::json!({
        "seconds": round(secs, 1),
        "postgres": share(first.pg_cpu.total, last.pg_cpu.total),
        "postgres_walsenders": share(first.pg_cpu.walsenders, last.pg_cpu.walsenders),
        "postgres_by_client": postgres_cpu_by_client(c, first, last, secs).await?,
        "roles": roles,
        "nodes_and_load_generator": share(first.own.0, last.own.0),
    }))
}

/// SIGKILL of the gateway holding the most sessions; its nodes re-home to
/// the others; then it restarts.
pub async fn gateway_kill(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let before = sessions_by_gateway(r).await?;
    let (victim, nodes) = before
        .iter()
        .max_by_key(|(_, n)| n.len())
        .map(|(g, n)| (g.clone(), n.clone()))
        .unwrap_or_default();
    let (_, ran_twice_before) = super::check::commands_run_twice(&r.fleet);
    let t = SystemTime::now();
    let tries = crate::util::Tries::of(&r.fleet.stats);
    let killed = Instant::now();
    r.role(&victim).kill().await;
    let victims: HashSet<&String> = nodes.iter().collect();
    let recovery = probe(r, o, &r.pools[0].clone(), killed).await?;
    // Re-homed: its latest session is on another gateway. A node that was
    // already moving when the kill came has a session opened in a
    // transaction begun just before it (`recorded_at` is the transaction's
    // start), so it counts as re-homed at once.
    loop {
        let left = sessions_by_gateway(r)
            .await?
            .get(&victim)
            .map_or(0, |n| n.iter().filter(|n| victims.contains(n)).count());
        if left == 0 || killed.elapsed() > o.patience {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let still_there: HashSet<String> = sessions_by_gateway(r)
        .await?
        .remove(&victim)
        .unwrap_or_default()
        .into_iter()
        .collect();
    let opened = first_after(r, "node.session_opened", t).await?;
    let mut rehome: Vec<f64> = nodes
        .iter()
        .filter(|n| !still_there.contains(*n))
        .map(|n| opened.get(n).map_or(0.0, |x| (x - unix(t)).max(0.0)))
        .collect();
    let after_kill = sessions_by_gateway(r).await?;
    let rehoming = tries.since(&r.fleet.stats);
    // It comes back; where are the sessions a while later?
    r.restart(&victim).await?;
    // Its nodes return over the daemons' return-home window: until nine in
    // ten of as many as it had are on it again.
    let restarted = Instant::now();
    let mut spread_back = None;
    let mut after_restart = sessions_by_gateway(r).await?;
    while restarted.elapsed() < o.spread_wait {
        tokio::time::sleep(Duration::from_millis(500)).await;
        after_restart = sessions_by_gateway(r).await?;
        let back = after_restart.get(&victim).map_or(0, Vec::len);
        if back * 10 >= nodes.len() * 9 {
            spread_back = Some(round(restarted.elapsed().as_secs_f64(), 1));
            break;
        }
    }
    let c = r.client().await?;
    let unreachable: i64 = c
        .query_one(
            "SELECT count(*) FROM strata.events WHERE type = 'node.marked_unreachable'
                AND recorded_at >= to_timestamp($1)",
            &[&unix(t)],
        )
        .await?
        .get(0);
    let (ran_twice_after, _) = super::check::commands_run_twice(&r.fleet);
    let p99 = pct(&mut rehome, 0.99);
    Ok(serde_json::json!({
        "killed": victim,
        "sessions_on_it": nodes.len(),
        "rehomed": spread(&mut rehome),
        "rehome_p99_s": p99,
        "all_rehomed": rehome.len() == nodes.len(),
        "false_unreachable": unreachable,
        "commands_run_twice": ran_twice_after.saturating_sub(ran_twice_before.len() as u64),
        "sessions_before": counts(&before),
        "sessions_after_kill": counts(&after_kill),
        "daemons_until_rehomed": rehoming,
        "sessions_after_restart": counts(&after_restart),
        "spread_back_s": spread_back,
        "return_home_s": o.return_home.as_secs_f64(),
        "recovery_s": recovery,
    }))
}

/// The holder of a lease now.
pub(super) async fn holder(r: &Region, lease: &str) -> Result<Option<String>> {
    let c = r.client().await?;
    Ok(c.query_opt(
        "SELECT holder FROM strata.leases WHERE name = $1 AND expires_at > now()",
        &[&lease],
    )
    .await?
    .map(|row| row.get(0)))
}

/// SIGKILL of the role holding `lease`, a probe, then the role restarts.
async fn kill_holder(r: &mut Region, o: &Options, lease: &str) -> Result<serde_json::Value> {
    let deadline = Instant::now() + o.patience;
    let name = loop {
        match holder(r, lease).await? {
            Some(h) if r.roles.iter().any(|x| x.name == h) => break h,
            Some(h) => {
                anyhow::bail!("lease {lease} is held by {h:?}, which is not a role of the region")
            }
            None if Instant::now() > deadline => anyhow::bail!("nobody holds lease {lease}"),
            None => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let killed = Instant::now();
    r.role(&name).kill().await;
    let recovery = probe(r, o, &r.pools[0].clone(), killed).await?;
    r.restart(&name).await?;
    Ok(serde_json::json!({ "killed": name, "lease": lease, "recovery_s": recovery }))
}

pub async fn placer_kill(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let lease = format!("pool/{}", r.pools[0]);
    kill_holder(r, o, &lease).await
}

pub async fn binder_kill(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    kill_holder(r, o, binder::LEASE).await
}

/// SIGKILL of the sinks process; it is started again a second later (as a
/// supervisor would).
pub async fn sinks_kill(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    kill_and_restart(r, o, "sinks").await
}

/// SIGKILL of the process that runs maintenance (with `--log-share`, the
/// one every other process follows the log through); it is started again
/// a second later.
pub async fn maintenance_kill(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let mut out = kill_and_restart(r, o, "maintenance").await?;
    out["shared_the_log"] = o.log_share.into();
    Ok(out)
}

/// SIGKILL of the process running `role`, started again a second later (as
/// a supervisor would); then a probe reservation.
async fn kill_and_restart(r: &mut Region, o: &Options, role: &str) -> Result<serde_json::Value> {
    let name = r.running(role);
    let killed = Instant::now();
    r.role(&name).kill().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    r.restart(&name).await?;
    let recovery = probe(r, o, &r.pools[0].clone(), killed).await?;
    Ok(serde_json::json!({ "killed": name, "restarted_after_s": 1, "recovery_s": recovery }))
}

pub async fn postgres_crash(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let crashed = Instant::now();
    tokio::task::block_in_place(|| {
        r.cluster.crash();
        r.cluster.restart()
    })?;
    let restarted_after = crashed.elapsed().as_secs_f64();
    let recovery = probe(r, o, &r.pools[0].clone(), crashed).await?;
    Ok(serde_json::json!({
        "server_back_after_s": round(restarted_after, 2),
        "recovery_s": recovery,
    }))
}

/// A streaming standby (synchronous) is started under the load, the
/// primary is killed and the standby promoted: every role finds it through
/// the URL's second host. The promoted standby is the region's server from
/// then on.
pub async fn standby_promoted(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let port = r
        .standby_port
        .context("the region was started without a standby port")?;
    let started = Instant::now();
    let standby = tokio::task::block_in_place(|| {
        let base =
            std::env::temp_dir().join(format!("strata-bench-{}-standby", std::process::id()));
        let mut opts = schema::ClusterOptions::new(base.join("pg"));
        opts.port = Some(port);
        opts.fsync = true;
        opts.remove_on_exit = Some(base);
        if o.network() {
            // The roles in namespaces reach it too (its pg_hba.conf is
            // the primary's).
            opts.settings.push(("listen_addresses".into(), "*".into()));
        }
        r.cluster.standby(opts)
    })?;
    let backup_s = started.elapsed().as_secs_f64();
    // Synchronous: an acknowledged event is on the standby too. Named by
    // its WAL receiver's name: '*' would match the readers' replication
    // connections as well.
    let c = r.client().await?;
    let deadline = Instant::now() + o.patience;
    let name = testkit::standbys::physical_name_within(&c, o.patience)
        .await?
        .context("the standby never streamed")?;
    c.batch_execute(&format!(
        "ALTER SYSTEM SET synchronous_standby_names = '\"{name}\"'"
    ))
    .await?;
    c.batch_execute("SELECT pg_reload_conf()").await?;
    // Until the standby is synchronous and every reader streaming now
    // holds what it decodes until the standby has it: before, a reader may
    // hand a role a commit the standby lacks.
    loop {
        let sync = c
            .query_opt(
                "SELECT 1 FROM pg_stat_replication WHERE application_name = $1 AND sync_state = 'sync'",
                &[&name],
            )
            .await?
            .is_some();
        let not_holding = events::slots::not_holding_for_standbys(&c).await?;
        if sync && not_holding.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "the standby never became synchronous (synchronous: {sync}), or readers never held for it: {not_holding:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(c);
    let died = Instant::now();
    tokio::task::block_in_place(|| {
        r.cluster.crash();
        standby.promote()
    })?;
    let promoted_after = died.elapsed().as_secs_f64();
    r.cluster = standby;
    let recovery = probe(r, o, &r.pools[0].clone(), died).await?;
    Ok(serde_json::json!({
        "base_backup_s": round(backup_s, 2),
        "promoted_after_s": round(promoted_after, 2),
        "synchronous": true,
        "recovery_s": recovery,
    }))
}

pub async fn walsenders(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let c = r.client().await?;
    // How much WAL each walsender must decode again before it streams
    // anything new: from its slot's restart point.
    let mut behind = serde_json::Map::new();
    for row in c
        .query(
            "SELECT slot_name::text,
                    round(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) / 1048576.0, 1)::float8,
                    round(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) / 1048576.0, 1)::float8
               FROM pg_replication_slots WHERE slot_type = 'logical' ORDER BY 1",
            &[],
        )
        .await?
    {
        let (slot, restart, confirmed): (String, Option<f64>, Option<f64>) =
            (row.get(0), row.get(1), row.get(2));
        behind.insert(
            slot,
            serde_json::json!({ "restart_mib": restart, "confirmed_mib": confirmed }),
        );
    }
    let at = Instant::now();
    let row = c
        .query_one(
            "SELECT (SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_replication) t),
                    pg_current_wal_lsn()::text",
            &[],
        )
        .await?;
    let (n, lsn): (i64, String) = (row.get(0), row.get(1));
    let pool = r.pools[0].clone();
    let (recovery, back) = tokio::join!(
        probe(r, o, &pool, at),
        readers_back(&c, &lsn, at, o.patience)
    );
    Ok(serde_json::json!({
        "terminated": n,
        "wal_behind_before": behind,
        "recovery_s": recovery?,
        "readers_back_s": back?,
    }))
}

/// For each slot, seconds from `at` until its reader acknowledged the WAL
/// position `lsn` (the server's when the walsenders were terminated): the
/// moment that reader streams live again. Null for a slot not back within
/// `patience`.
async fn readers_back(
    c: &tokio_postgres::Client,
    lsn: &str,
    at: Instant,
    patience: Duration,
) -> Result<serde_json::Value> {
    let mut back = serde_json::Map::new();
    loop {
        let rows = c
            .query(
                "SELECT slot_name::text, confirmed_flush_lsn >= $1::text::pg_lsn
                   FROM pg_replication_slots WHERE slot_type = 'logical' ORDER BY 1",
                &[&lsn],
            )
            .await?;
        let mut all = true;
        for row in rows {
            let (slot, done): (String, Option<bool>) = (row.get(0), row.get(1));
            if done == Some(true) {
                let seen = back.entry(slot).or_insert(serde_json::Value::Null);
                if seen.is_null() {
                    *seen = round(at.elapsed().as_secs_f64(), 2).into();
                }
            } else {
                all = false;
                back.entry(slot).or_insert(serde_json::Value::Null);
            }
        }
        if all || at.elapsed() > patience {
            return Ok(back.into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The replication slot of the placer holding the first pool is dropped
/// while in use (its walsender terminated first, as `pg_drop_replication_slot`
/// refuses an active slot); with `--log-share`, the slot of the process
/// every other one follows.
pub async fn slot_drop(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let name = if o.log_share {
        r.running("maintenance")
    } else {
        let lease = format!("pool/{}", r.pools[0]);
        holder(r, &lease)
            .await?
            .unwrap_or_else(|| "placer-1".into())
    };
    let slot = format!("region_{}", name.replace('-', "_"));
    let c = r.client().await?;
    let at = Instant::now();
    let mut dropped = false;
    while at.elapsed() < Duration::from_secs(15) {
        let _ = c
            .execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                  WHERE slot_name = $1 AND active_pid IS NOT NULL",
                &[&slot],
            )
            .await;
        if c.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
            .is_ok()
        {
            dropped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let recovery = probe(r, o, &r.pools[0].clone(), at).await?;
    Ok(serde_json::json!({ "slot": slot, "of": name, "dropped": dropped, "recovery_s": recovery }))
}
