//! `bench usage`: usage reports from the rollups, and the rollups recomputed
//! from the raw log, against COPY of the same rows in the same run.
//!
//! The log is a month of a region: 10,000 nodes in 10 pools, 200 owners in
//! 16 queues (each owner in its team's home pool), reservations of 1 to 8 GPUs arriving evenly through the
//! previous calendar month and lasting 5 minutes to a day, each with the
//! 13 events a region writes for it (request, placement, the binder's bind
//! and release commands with their acknowledgements and results, activation,
//! release, end, and a node status report). It is bulk-loaded with COPY.
//! Then:
//!
//! - the usage role folds the whole log into its rollups (its catch-up);
//! - the baseline: `COPY (SELECT type, payload, metadata, recorded_at ...)
//!   TO STDOUT` of every row, received and counted;
//! - the full recompute (`replay check`'s usage part): the reservation
//!   events read and folded again, every bucket compared with the tables;
//! - the report for the month by queue and owner, from the rollups.

use crate::util::{self, round};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use domain::{Allocation, Fact, Request, Shape};
use futures_util::{SinkExt, StreamExt};
use projections::usage::{fold::DAY_MS, By, Period, Query};
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Events in the log
    #[arg(long, default_value_t = 10_000_000)]
    events: u64,
    /// A short run: 1,000,000 events
    #[arg(long)]
    quick: bool,
    /// Times each measurement is repeated (the median is reported)
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

const NODES: u64 = 10_000;
const POOLS: u64 = 10;
const QUEUES: u64 = 16;
const OWNERS: u64 = 200;
const EVENTS_PER_RESERVATION: u64 = 13;

/// Writes the log as COPY text rows.
struct Generator {
    position: u64,
    versions: HashMap<String, u64>,
    buf: Vec<u8>,
}

impl Generator {
    fn push(&mut self, stream: &str, event_type: &str, payload: &str, metadata: &str, at_ms: i64) {
        use std::io::Write;
        self.position += 1;
        let v = self.versions.entry(stream.to_string()).or_insert(0);
        *v += 1;
        let at = UNIX_EPOCH + Duration::from_millis(at_ms as u64);
        let _ = writeln!(
            self.buf,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}",
            self.position,
            stream,
            v,
            event_type,
            payload.replace('\\', "\\\\"),
            metadata,
            humantime::format_rfc3339_millis(at)
        );
    }

    fn fact(&mut self, stream: &str, f: &Fact, metadata: &str, at_ms: i64) {
        let e = f.to_event();
        self.push(stream, &e.event_type, e.payload.get(), metadata, at_ms);
    }

    fn command(&mut self, id: &str, node: &str, kind: &str, at_ms: i64) {
        let stream = format!("command/{id}");
        let p = format!(
            "{{\"id\":\"{id}\",\"node\":\"{node}\",\"kind\":\"{kind}\",\"deadline_ms\":{},\"issued_by\":\"strata:binder\"}}",
            at_ms + 60_000
        );
        self.push(&stream, "command.issued", &p, "{}", at_ms);
        let p = format!("{{\"id\":\"{id}\",\"node\":\"{node}\",\"gateway\":\"gw-1\"}}");
        self.push(&stream, "command.acked", &p, "{}", at_ms + 5);
        let p = format!("{{\"id\":\"{id}\",\"node\":\"{node}\"}}");
        self.push(&stream, "command.succeeded", &p, "{}", at_ms + 10);
    }
}

/// A reservation that ends later: (its end, its number), soonest first.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Ending(std::cmp::Reverse<i64>, u64, u64, u32);

/// Loads about `total` events over the month starting at `month_ms`;
/// returns the last position.
async fn load(db: &tokio_postgres::Client, total: u64, month_ms: i64) -> Result<u64> {
    let month_end = Period::Month.next(month_ms);
    let sink = db
        .copy_in(
            "COPY strata.events (position, stream, version, type, payload, metadata, recorded_at) FROM STDIN",
        )
        .await?;
    futures_util::pin_mut!(sink);
    let mut g = Generator {
        position: 0,
        versions: HashMap::new(),
        buf: Vec::with_capacity(2 << 20),
    };
    for p in 0..POOLS {
        let f = Fact::PoolCreated {
            description: String::new(),
        };
        g.fact(&format!("pool/p{p}"), &f, "{}", month_ms);
    }
    let reservations = total / EVENTS_PER_RESERVATION;
    let every = (month_end - month_ms - DAY_MS) / reservations.max(1) as i64;
    let mut rng = fastrand::Rng::with_seed(35);
    let mut ends: BinaryHeap<Ending> = BinaryHeap::new();
    let started = Instant::now();
    let end_one = |g: &mut Generator, Ending(std::cmp::Reverse(at), i, node, gpus): Ending| {
        let id = format!("r{i}");
        let rs = format!("reservation/{id}");
        let pool = format!("pool/p{}", node * POOLS / NODES);
        let f = Fact::ReservationReleaseRequested {
            reservation: id.clone(),
            reason: String::new(),
        };
        g.fact(&rs, &f, "{}", at - 20);
        let f = Fact::ReservationReleased {
            reservation: id.clone(),
        };
        g.fact(&pool, &f, "{}", at);
        let f = Fact::ReservationEnded {
            reservation: id.clone(),
            outcome: "released".into(),
        };
        g.fact(&rs, &f, "{}", at);
        g.command(
            &format!("release:{id}:n{node}"),
            &format!("n{node}"),
            "allocation.release",
            at,
        );
        let p = format!("{{\"node\":\"n{node}\",\"status\":\"ready\",\"gpus_busy\":{gpus}}}");
        g.push(
            &format!("node/n{node}"),
            "node.status_reported",
            &p,
            "{}",
            at + 20,
        );
    };
    for i in 0..reservations {
        let at = month_ms + i as i64 * every;
        while ends.peek().is_some_and(|e| e.0 .0 <= at) {
            let e = ends.pop().expect("peeked");
            end_one(&mut g, e);
        }
        // Each owner works in its team's home pool, on any of its nodes.
        let owner = rng.u64(0..OWNERS);
        let per_pool = NODES / POOLS;
        let node = (owner % POOLS) * per_pool + rng.u64(0..per_pool);
        let gpus = rng.u32(1..=8);
        let id = format!("r{i}");
        let rs = format!("reservation/{id}");
        let pool = format!("p{}", node * POOLS / NODES);
        let f = Fact::ReservationRequested(Request {
            reservation: id.clone(),
            pool: pool.clone(),
            class: "H100-80GB".into(),
            gpus,
            shape: Shape::Any,
            priority: 0,
            ttl_ms: None,
            replace_on_failure: false,
            replaces: None,
            topology: None,
            requeue_on_preemption: false,
            start_ms: None,
            queue: Some(format!("q{}", owner % QUEUES)),
        });
        g.fact(&rs, &f, &format!("{{\"operator\":\"u{owner}\"}}"), at);
        let f = Fact::ReservationPlaced {
            reservation: id.clone(),
            allocations: vec![Allocation {
                node: format!("n{node}"),
                devices: (0..gpus).map(|d| d.to_string()).collect(),
            }],
        };
        g.fact(&format!("pool/{pool}"), &f, "{}", at + 40);
        g.command(
            &format!("bind:{id}:n{node}"),
            &format!("n{node}"),
            "allocation.bind",
            at + 50,
        );
        let f = Fact::ReservationActivated {
            reservation: id.clone(),
        };
        g.fact(&rs, &f, "{}", at + 80);
        let lasts = rng.i64(5 * 60_000..DAY_MS);
        ends.push(Ending(std::cmp::Reverse(at + lasts), i, node, gpus));
        if g.buf.len() >= 1 << 20 {
            sink.send(Bytes::from(std::mem::take(&mut g.buf))).await?;
            g.buf.reserve(2 << 20);
        }
        if i.is_multiple_of(50_000) {
            eprint!(
                "\rloading the log: {} events ({:.0}/s)",
                g.position,
                g.position as f64 / started.elapsed().as_secs_f64()
            );
        }
    }
    // Those that end within the month end; the rest stay open.
    while let Some(e) = ends.pop() {
        if e.0 .0 < month_end {
            end_one(&mut g, e);
        }
    }
    if !g.buf.is_empty() {
        sink.send(Bytes::from(std::mem::take(&mut g.buf))).await?;
    }
    sink.as_mut().finish().await?;
    util::after_bulk_load(db, g.position, started).await?;
    Ok(g.position)
}

/// The baseline: every row's columns the recompute reads, by COPY,
/// received and counted.
async fn copy_only(db: &tokio_postgres::Client, n: u64) -> Result<f64> {
    let t = Instant::now();
    let stream = db
        .copy_out(&format!(
            "COPY (SELECT type, payload, metadata, recorded_at FROM strata.events WHERE position <= {n}) TO STDOUT"
        ))
        .await?;
    futures_util::pin_mut!(stream);
    let mut rows = 0u64;
    while let Some(chunk) = stream.next().await {
        rows += chunk?.iter().filter(|b| **b == b'\n').count() as u64;
    }
    if rows < n {
        bail!("COPY returned {rows} rows of {n}");
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Peak resident memory of this process so far, MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

pub async fn run(args: Args) -> Result<()> {
    let n = if args.quick { 1_000_000 } else { args.events };
    let cluster = util::cluster()?;
    let cfg = util::database(&cluster, "usage").await?;
    // The load and the reads of the whole log are single long statements.
    let whole = events::db::Database::from(&cfg).with_statement_timeout(None);
    let mut db = events::db::connect(whole.clone(), "bench-usage").await?;
    let pg_version: String = db.query_one("SHOW server_version", &[]).await?.get(0);
    let now = SystemTime::now();
    let this_month = Period::Month.start(projections::usage::unix_ms(now));
    let month_ms = Period::Month.start(this_month - 1);
    schema::partitions::ensure_for(&db, UNIX_EPOCH + Duration::from_millis(month_ms as u64))
        .await
        .context("create the month's partition")?;
    let n = load(&db, n, month_ms).await.context("load the log")?;

    // The usage role's catch-up over the whole log.
    let mut rc = events::ReaderConfig::new("bench_usage");
    rc.temporary = true;
    let reader = events::Reader::start(cfg.clone(), rc);
    let t = Instant::now();
    let keeper = ops::task::spawn(
        "usage",
        projections::usage::keeper::run(reader.clone(), events::db::Database::from(&cfg)),
    );
    loop {
        let at = projections::usage::store::position(&db).await?.unwrap_or(0);
        if at >= n {
            break;
        }
        eprint!("\rthe usage role folds the log: {at} of {n}");
        if t.elapsed() > Duration::from_secs(3600) {
            bail!("the usage role did not catch up in an hour");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let catch_up_s = t.elapsed().as_secs_f64();
    keeper.abort();
    eprintln!("\rthe usage role folded {n} events in {catch_up_s:.1} s");

    // Warm the cache once, then the baseline and the recompute in turns.
    copy_only(&db, n).await?;
    let (mut copy, mut recompute) = (Vec::new(), Vec::new());
    let rss_before = peak_rss_mib();
    let mut check = None;
    for round_no in 0..args.repeat {
        copy.push(copy_only(&db, n).await?);
        let t = Instant::now();
        let c = projections::usage::verify::verify(&whole, &mut db, |_| {}).await?;
        recompute.push(t.elapsed().as_secs_f64());
        if !c.differences.is_empty() {
            bail!("the rollups differ from the log: {:?}", c.differences);
        }
        eprintln!(
            "round {}: COPY {:.2} s, recompute {:.2} s (log read and folded {:.2} s, tables read {:.2} s, compared {:.2} s; {} reservation events, {} buckets)",
            round_no + 1,
            copy[round_no],
            recompute[round_no],
            c.fold_s,
            c.tables_s,
            c.compare_s,
            c.events,
            c.account_buckets + c.node_buckets
        );
        check = Some(c);
    }
    let recompute_rss = peak_rss_mib() - rss_before;
    let check = check.context("no round ran")?;

    // The month's report by queue and owner, from the rollups.
    let q = Query {
        since_ms: month_ms,
        until_ms: this_month,
        by: vec![By::Queue, By::Owner],
        pools: None,
        owner: None,
        now_ms: projections::usage::unix_ms(now),
    };
    let mut times = Vec::new();
    let mut rows = 0;
    for _ in 0..20 {
        let t = Instant::now();
        let r = projections::usage::report::report(&mut db, &q).await?;
        times.push(t.elapsed());
        rows = r.rows.len();
        if r.behind != 0 {
            bail!("the report is {} events behind", r.behind);
        }
    }
    let report_p50 = util::percentile_ms(&mut times, 0.5);
    let report_p99 = util::percentile_ms(&mut times, 0.99);
    let (copy_s, recompute_s) = (util::median(&mut copy), util::median(&mut recompute));
    let ratio = recompute_s / copy_s;
    eprintln!(
        "report p50 {report_p50:.1} ms ({rows} rows); recompute {recompute_s:.2} s vs COPY {copy_s:.2} s: {ratio:.2}x"
    );
    let rollup_rows: i64 = db
        .query_one(
            "SELECT (SELECT count(*) FROM strata.usage_rollups) + (SELECT count(*) FROM strata.usage_node_rollups)",
            &[],
        )
        .await?
        .get(0);
    let result = serde_json::json!({
        "scenario": "usage",
        "machine": util::machine(&pg_version),
        "note": "the load generator, the fold and PostgreSQL share the same cores",
        "events": n,
        "reservation_events": check.events,
        "open_at_end": check.open,
        "rollup_rows": rollup_rows,
        "catch_up": {
            "seconds": round(catch_up_s, 2),
            "events_per_s": round(n as f64 / catch_up_s, 0),
        },
        "report": {
            "by": "queue,owner",
            "rows": rows,
            "p50_ms": round(report_p50, 2),
            "p99_ms": round(report_p99, 2),
            "target_ms": 100,
        },
        "recompute": {
            "seconds": round(recompute_s, 3),
            "copy_seconds": round(copy_s, 3),
            "ratio_vs_copy": round(ratio, 3),
            "target_ratio": 1.5,
            "client_peak_rss_growth_mib": round(recompute_rss, 1),
        },
        "met": {
            "report_under_100ms": report_p99 < 100.0,
            "recompute_under_1_5x_copy": ratio < 1.5,
        },
    });
    let name = if args.quick { "usage-quick" } else { "usage" };
    util::finish(name, &result)
}
