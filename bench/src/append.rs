//! `bench append`: the event log's write and read paths against plain
//! PostgreSQL in the same run.
//!
//! - raw baselines: single-row INSERT transactions at 16 clients, 64-row
//!   multi-row INSERT transactions at 4 clients (plain tokio-postgres);
//! - Strata appends through the append API at 1, 16 and 256 writers, one
//!   stream per writer, with acknowledgement latency;
//! - end-to-end lag, append acknowledged to delivered by a subscription, at an
//!   offered 5,000 events/s;
//! - decoding a backlog through a subscription against `pg_recvlogical`
//!   consuming a pgoutput slot over the same backlog;
//! - a peer event store on the same cluster: Message DB (`message_db.rs`)
//!   at 16 and 256 writers, one message per call with an expected version,
//!   right after Strata's phase at the same number of writers
//!   (`vs_message_db`).

use crate::util::{self, percentile_ms, round};
use crate::writers::{payload, timed, Phase};
use anyhow::{bail, Context, Result};
use events::{
    Appender, AppenderConfig, ExpectedVersion, NewEvent, Reader, ReaderConfig, Start, StreamAppend,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_postgres::Config;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A short run (under a minute): shorter phases, a 200,000-event backlog
    #[arg(long)]
    quick: bool,
    /// Seconds per throughput phase (default 3 quick, 8 full)
    #[arg(long)]
    seconds: Option<u64>,
    /// Events in the decode backlog (default 200,000 quick, 1,000,000 full)
    #[arg(long)]
    backlog: Option<u64>,
    /// Committing connections of the appender
    #[arg(long, default_value_t = AppenderConfig::default().connections)]
    connections: usize,
    /// Longest a flusher waits for its share of the appends in flight while
    /// another commits, in microseconds (even 0 lets the tasks already woken
    /// run first: a timer fires on the runtime's next turn at the earliest)
    #[arg(long, default_value_t = AppenderConfig::default().batch_linger.as_micros() as u64)]
    batch_linger_us: u64,
    /// Measure only the append phases (no lag or decode)
    #[arg(long)]
    appends_only: bool,
    /// Concurrent writers of the append phases (comma-separated);
    /// `append_ratio` needs 256 among them
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 256])]
    writers: Vec<usize>,
}

pub async fn run(args: Args) -> Result<()> {
    let secs = Duration::from_secs(args.seconds.unwrap_or(if args.quick { 3 } else { 8 }));
    let backlog = args
        .backlog
        .unwrap_or(if args.quick { 200_000 } else { 1_000_000 });
    let reps = if args.quick { 1 } else { 3 };
    if !args.appends_only && !args.writers.contains(&256) {
        anyhow::bail!(
            "--writers must include 256 (append_ratio is measured there), or pass --appends-only"
        );
    }
    eprintln!("starting a private PostgreSQL (fsync on, serving TLS too) ...");
    let (cluster, ca_file) = tokio::task::spawn_blocking(util::cluster_with_tls).await??;
    let recvlogical = cluster.bindir().join("pg_recvlogical");
    let cfg = util::database(&cluster, "bench").await?;
    let client = events::db::connect(&cfg, "bench").await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    prepare_raw(&client).await?;
    let message_db = {
        let (cfg, bindir) = (cfg.clone(), cluster.bindir().to_path_buf());
        tokio::task::spawn_blocking(move || crate::message_db::install(&cfg, &bindir)).await?
    };
    if let Err(why) = &message_db {
        eprintln!("Message DB skipped: {why}");
    }

    let appender = Appender::start(
        cfg.clone(),
        AppenderConfig {
            connections: args.connections,
            batch_linger: Duration::from_micros(args.batch_linger_us),
            ..AppenderConfig::default()
        },
    );
    // The same appends over TLS to the same server (verify-ca against the
    // cluster's own CA), for `tls_ratio`.
    let tls_db = events::db::Database::parse(&format!(
        "host=127.0.0.1 port={} user={} dbname=bench sslmode=verify-ca sslrootcert={}",
        cluster.port(),
        schema::cluster::SUPERUSER,
        ca_file.display()
    ))
    .map_err(anyhow::Error::msg)?;
    let tls_appender = Appender::start(
        &tls_db,
        AppenderConfig {
            connections: args.connections,
            batch_linger: Duration::from_micros(args.batch_linger_us),
            ..AppenderConfig::default()
        },
    );
    // The same appends through a PgBouncer in transaction mode (Debian's,
    // 20 server connections) in front of the same server, for
    // `pgbouncer_ratio`; skipped, and said so, when there is no pgbouncer.
    let bouncer_dir = tempfile::tempdir()?;
    let bouncer = match testkit::Bouncer::start(
        &cluster,
        bouncer_dir.path(),
        &testkit::BouncerOptions {
            pool_size: 20,
            ..testkit::BouncerOptions::default()
        },
    ) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("PgBouncer phase skipped: {e}");
            None
        }
    };
    let pgbouncer_version = bouncer.as_ref().and_then(|_| {
        std::process::Command::new(testkit::Bouncer::find().ok()?)
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|v| v.lines().next().map(str::to_string))
    });
    let pooled_appender = match &bouncer {
        Some(b) => {
            let through = events::db::Database::parse(&b.url("bench"))
                .map_err(anyhow::Error::msg)?
                .through_pooler(cfg.clone().into());
            Some(Appender::start(
                through,
                AppenderConfig {
                    connections: args.connections,
                    batch_linger: Duration::from_micros(args.batch_linger_us),
                    ..AppenderConfig::default()
                },
            ))
        }
        None => None,
    };
    let mut variants = vec![Variant::new(
        "strata over TLS",
        "tls",
        tls_appender,
        args.writers.len(),
    )];
    if let Some(p) = pooled_appender {
        variants.push(Variant::new(
            "strata through PgBouncer",
            "pgbouncer",
            p,
            args.writers.len(),
        ));
    }
    // Each repetition measures the baselines and then Strata, back to back,
    // so a ratio compares phases minutes apart at most; `append_ratio` is
    // the median of the repetitions' ratios.
    let mut single = Vec::new();
    let mut multi = Vec::new();
    let mut multi_partitioned = Vec::new();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); args.writers.len()];
    let mut lats: Vec<Vec<Duration>> = vec![Vec::new(); args.writers.len()];
    let mut ratios = Vec::new();
    // Per number of writers: Strata's rate over Message DB's, per repetition.
    let mut vs_peer: Vec<Vec<f64>> = vec![Vec::new(); args.writers.len()];
    let mut peer_rates: Vec<Vec<f64>> = vec![Vec::new(); args.writers.len()];
    // CPU per row or append (whole machine, and this process's share).
    let mut raw_cpu = Vec::new();
    let mut strata_cpu = Vec::new();
    for rep in 0..reps {
        single.push(raw_single(&cfg, 16, secs).await?.rate);
        let raw = raw_multirow(&cfg, "raw_events", 4, 64, secs).await?;
        let m = raw.rate;
        multi.push(m);
        raw_cpu.push(raw.cpu_per_event());
        multi_partitioned.push(
            raw_multirow(&cfg, "raw_partitioned", 4, 64, secs)
                .await?
                .rate,
        );
        for (k, &writers) in args.writers.iter().enumerate() {
            // The variants (TLS, PgBouncer) before plaintext in every other
            // repetition, so that neither is always the later phase.
            let variant_phase = matches!(writers, 16 | 256);
            let variants_first = variant_phase && rep % 2 == 1;
            let mut measured = Vec::new();
            if variants_first {
                measured = Variant::measure(&variants, writers, secs).await?;
            }
            let (phase, l) = strata_appends(&appender, writers, secs).await?;
            let rate = phase.rate;
            rates[k].push(rate);
            lats[k].extend(l);
            if variant_phase && !variants_first {
                measured = Variant::measure(&variants, writers, secs).await?;
            }
            for (v, r) in variants.iter_mut().zip(measured) {
                v.rates[k].push(r);
                v.ratios[k].push(r / rate.max(1e-9));
            }
            if let (Ok(peer), 16 | 256) = (&message_db, writers) {
                let theirs = crate::message_db::appends(peer, writers, secs).await?.rate;
                peer_rates[k].push(theirs);
                vs_peer[k].push(rate / theirs.max(1e-9));
            }
            if writers == 256 {
                strata_cpu.push(phase.cpu_per_event());
                ratios.push(rate / m);
                eprintln!(
                    "repetition {}: raw 64-row INSERT x4 {m:.0} rows/s, Strata 256 writers {rate:.0} appends/s: ratio {:.3}",
                    rep + 1,
                    rate / m
                );
            }
        }
    }
    let raw_single_tps = util::median(&mut single);
    let raw_multirow = util::median(&mut multi);
    let raw_partitioned = util::median(&mut multi_partitioned);
    eprintln!("raw: single-row INSERT x16 {raw_single_tps:.0} rows/s; 64-row INSERT x4 {raw_multirow:.0} rows/s ({raw_partitioned:.0} rows/s into a partitioned table)");
    let mut levels = serde_json::Map::new();
    for (k, &writers) in args.writers.iter().enumerate() {
        let rate = util::median(&mut rates[k]);
        let (p50, p99) = (
            percentile_ms(&mut lats[k], 0.5),
            percentile_ms(&mut lats[k], 0.99),
        );
        eprintln!("strata: {writers:>3} writers {rate:>8.0} appends/s, ack p50 {p50:.2} ms, p99 {p99:.2} ms");
        levels.insert(format!("appends_per_s_{writers}"), round(rate, 0).into());
        levels.insert(format!("ack_p50_ms_{writers}"), round(p50, 3).into());
        levels.insert(format!("ack_p99_ms_{writers}"), round(p99, 3).into());
        for v in &mut variants {
            if v.ratios[k].is_empty() {
                continue;
            }
            let r = util::median(&mut v.rates[k]);
            let ratio = util::median(&mut v.ratios[k]);
            eprintln!(
                "{}: {writers:>3} writers {r:>8.0} appends/s; {}_ratio {ratio:.3}",
                v.label, v.key
            );
            levels.insert(
                format!("{}_appends_per_s_{writers}", v.key),
                round(r, 0).into(),
            );
            levels.insert(format!("{}_ratio_{writers}", v.key), round(ratio, 3).into());
        }
        if !vs_peer[k].is_empty() {
            let theirs = util::median(&mut peer_rates[k]);
            let vs = util::median(&mut vs_peer[k]);
            eprintln!(
                "message db: {writers:>3} writers {theirs:>8.0} writes/s; vs_message_db {vs:.2}"
            );
            levels.insert(
                format!("message_db_writes_per_s_{writers}"),
                round(theirs, 0).into(),
            );
            levels.insert(format!("vs_message_db_{writers}"), round(vs, 3).into());
        }
    }
    levels.insert(
        "tls".into(),
        serde_json::json!({
            "how": "the same appends to the same server over TLS (sslmode=verify-ca, rustls with ring, TLS 1.3), next to the plaintext phase in each repetition (after it in the first and third, before it in the second); tls_ratio = the median of the repetitions' TLS appends/s over plaintext appends/s",
        }),
    );
    levels.insert(
        "pgbouncer".into(),
        match &pgbouncer_version {
            Some(v) => serde_json::json!({
                "version": v,
                "how": "the same appends through a PgBouncer in transaction mode (default_pool_size 20) on the same machine in front of the same server, plaintext, next to the direct plaintext phase like the TLS phase; the appender's statements go unnamed (no prepared statement outlives a transaction) and its settings are SET LOCAL; pgbouncer_ratio = the median of the repetitions' PgBouncer appends/s over direct appends/s",
            }),
            None => serde_json::json!({"measured": false, "skipped": "no pgbouncer binary (apt-get install pgbouncer)"}),
        },
    );
    levels.insert(
        "message_db".into(),
        match &message_db {
            Ok(_) => serde_json::json!({
                "installed": true,
                "how": "npm pack @eventide/message-db, database/install.sh into the same cluster; one connection per writer, each writer its own category (no shared advisory lock); write_message with the expected version",
            }),
            Err(why) => serde_json::json!({"installed": false, "skipped": why}),
        },
    );
    if !strata_cpu.is_empty() {
        let (raw_us, raw_client) = medians(&raw_cpu);
        let (strata_us, strata_client) = medians(&strata_cpu);
        eprintln!(
            "cpu: raw {raw_us:.1} us per row ({raw_client:.1} in the client), Strata {strata_us:.1} us per append ({strata_client:.1} in the writers and appender)"
        );
        levels.insert(
            "cpu_us_per_event".into(),
            serde_json::json!({
                "raw_multirow_row": round(raw_us, 2),
                "raw_multirow_row_client": round(raw_client, 2),
                "strata_append_256": round(strata_us, 2),
                "strata_append_256_client": round(strata_client, 2),
                "note": "busy CPU time of the whole machine per event during the phase; client: the benchmark process (load generator, and for Strata the appender too)",
            }),
        );
    }
    let ratio_per_rep: Vec<f64> = ratios.iter().map(|r| round(*r, 3)).collect();
    let append_ratio = util::median(&mut ratios);
    levels.insert(
        "append_ratio_per_repetition".into(),
        serde_json::json!(ratio_per_rep),
    );

    if args.appends_only {
        eprintln!("append_ratio {append_ratio:.3} (median of the repetitions' ratios)");
        return Ok(());
    }
    let offered = 5000.0;
    let (achieved, lag50, lag99) =
        lag(&cfg, &appender, offered, secs.max(Duration::from_secs(5))).await?;
    eprintln!(
        "lag at {offered} offered ({achieved:.0}/s achieved): p50 {lag50:.2} ms, p99 {lag99:.2} ms"
    );

    let (decode, recv) = decode(&cfg, &appender, &recvlogical, backlog).await?;
    eprintln!("decode of {backlog} events: strata {decode:.0}/s, pg_recvlogical {recv:.0}/s");

    let decode_ratio = decode / recv;
    let mut result = serde_json::json!({
        "bench": "append",
        "quick": args.quick,
        "repetitions": reps,
        "phase_seconds": secs.as_secs(),
        "machine": util::machine(&pg_version),
        "raw_single_row_tx_per_s_16": round(raw_single_tps, 0),
        "raw_multirow_rows_per_s": round(raw_multirow, 0),
        "raw_multirow_partitioned_rows_per_s": round(raw_partitioned, 0),
        "append_ratio": round(append_ratio, 3),
        "offered_per_s": offered,
        "lag_achieved_per_s": round(achieved, 0),
        "lag_p50_ms": round(lag50, 3),
        "lag_p99_ms": round(lag99, 3),
        "decode_events": backlog,
        "decode_per_s": round(decode, 0),
        "recvlogical_per_s": round(recv, 0),
        "decode_ratio": round(decode_ratio, 3),
        "targets": {"append_ratio": ">= 0.6", "lag_p99_ms": "< 20", "decode_ratio": ">= 0.9"},
        "met": {
            "append_ratio": append_ratio >= 0.6,
            "lag_p99_ms": lag99 < 20.0,
            "decode_ratio": decode_ratio >= 0.9,
        },
    });
    if let Some(vs) = levels.get("vs_message_db_256").and_then(|v| v.as_f64()) {
        result["targets"]["vs_message_db_256"] = ">= 2".into();
        result["met"]["vs_message_db_256"] = (vs >= 2.0).into();
    }
    if let serde_json::Value::Object(m) = &mut result {
        m.extend(levels);
    }
    util::finish(if args.quick { "append-quick" } else { "append" }, &result)?;
    drop(cluster);
    Ok(())
}

pub(crate) async fn prepare_raw(client: &tokio_postgres::Client) -> Result<()> {
    // The same columns and indexes as strata.events, without partitions,
    // positions from a sequence.
    client
        .batch_execute(
            "CREATE TABLE raw_events (
                 position bigserial PRIMARY KEY, stream text NOT NULL, version bigint NOT NULL,
                 type text NOT NULL, payload jsonb NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',
                 recorded_at timestamptz NOT NULL DEFAULT now());
             CREATE INDEX ON raw_events (stream, version);
             -- The same again, partitioned by month like strata.events: tells
             -- how much of the gap to the baseline is partition routing.
             CREATE SEQUENCE raw_partitioned_position;
             CREATE TABLE raw_partitioned (
                 position bigint NOT NULL DEFAULT nextval('raw_partitioned_position'),
                 stream text NOT NULL, version bigint NOT NULL,
                 type text NOT NULL, payload jsonb NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',
                 recorded_at timestamptz NOT NULL DEFAULT now(),
                 PRIMARY KEY (position, recorded_at)) PARTITION BY RANGE (recorded_at);
             CREATE INDEX ON raw_partitioned (stream, version);
             CREATE TABLE raw_partitioned_now PARTITION OF raw_partitioned
                 FOR VALUES FROM (date_trunc('month', now())) TO (date_trunc('month', now()) + interval '1 month');
             CREATE TABLE raw_partitioned_next PARTITION OF raw_partitioned
                 FOR VALUES FROM (date_trunc('month', now()) + interval '1 month') TO (date_trunc('month', now()) + interval '2 months');",
        )
        .await
        .context("create the raw baseline tables")
}

/// The medians of (machine, own) CPU microseconds per event.
fn medians(v: &[(f64, f64)]) -> (f64, f64) {
    let mut machine: Vec<f64> = v.iter().map(|c| c.0).collect();
    let mut own: Vec<f64> = v.iter().map(|c| c.1).collect();
    (util::median(&mut machine), util::median(&mut own))
}

async fn raw_single(cfg: &Config, clients: usize, secs: Duration) -> Result<Phase> {
    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let client = events::db::connect(cfg, "raw").await?;
        let (count, stop) = (count.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let stmt = client
                .prepare("INSERT INTO raw_events (stream, version, type, payload) VALUES ($1, $2, 'bench.raw', $3)")
                .await?;
            let stream = format!("raw/{c}");
            let mut v = 0i64;
            while !stop.load(Ordering::Relaxed) {
                v += 1;
                client.execute(&stmt, &[&stream, &v, &payload(v as u64)]).await?;
                count.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    let (phase, _) = timed(count, stop, None, tasks, secs, "", "client").await?;
    Ok(phase)
}

pub(crate) async fn raw_multirow(
    cfg: &Config,
    table: &str,
    clients: usize,
    rows: usize,
    secs: Duration,
) -> Result<Phase> {
    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut sql = format!("INSERT INTO {table} (stream, version, type, payload) VALUES ");
    for r in 0..rows {
        if r > 0 {
            sql.push(',');
        }
        sql.push_str(&format!(
            "(${}, ${}, 'bench.raw', ${})",
            r * 3 + 1,
            r * 3 + 2,
            r * 3 + 3
        ));
    }
    let mut tasks = Vec::new();
    for c in 0..clients {
        let client = events::db::connect(cfg, "raw").await?;
        let (count, stop, sql) = (count.clone(), stop.clone(), sql.clone());
        tasks.push(tokio::spawn(async move {
            let stmt = client.prepare(&sql).await?;
            let stream = format!("multi/{c}");
            let mut v = 0i64;
            while !stop.load(Ordering::Relaxed) {
                let mut vals: Vec<(String, i64, serde_json::Value)> = Vec::with_capacity(rows);
                for _ in 0..rows {
                    v += 1;
                    vals.push((stream.clone(), v, payload(v as u64)));
                }
                let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vals
                    .iter()
                    .flat_map(|(s, v, p)| [s as &(dyn tokio_postgres::types::ToSql + Sync), v, p])
                    .collect();
                client.execute(&stmt, &params).await?;
                count.fetch_add(rows as u64, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    let (phase, _) = timed(count, stop, None, tasks, secs, "", "client").await?;
    Ok(phase)
}

static RUN: AtomicU64 = AtomicU64::new(0);

/// `writers` tasks, each appending one event at a time to its own stream.
async fn strata_appends(
    appender: &Appender,
    writers: usize,
    secs: Duration,
) -> Result<(Phase, Vec<Duration>)> {
    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (a, count, stop, measuring) = (
            appender.clone(),
            count.clone(),
            stop.clone(),
            measuring.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let stream = format!("bench/{run}/{w}");
            let mut lat = Vec::new();
            let mut v = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                a.append(
                    &stream,
                    ExpectedVersion::Exact(v),
                    vec![NewEvent::new("bench.append", &payload(v))],
                )
                .await?;
                if measuring.load(Ordering::Relaxed) {
                    lat.push(t.elapsed());
                }
                v += 1;
                count.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(lat)
        }));
    }
    let label = format!("{writers} writers: ");
    let (phase, lats) = timed(
        count,
        stop,
        Some(&measuring),
        tasks,
        secs,
        &label,
        "writers and appender",
    )
    .await?;
    Ok((phase, lats.into_iter().flatten().collect()))
}

/// Offers `rate` events/s (open loop, 1 ms ticks) and measures, per event,
/// the time from its append being acknowledged to its delivery to a
/// subscription. Delivery before the writer saw its acknowledgement counts 0.
async fn lag(
    cfg: &Config,
    appender: &Appender,
    rate: f64,
    secs: Duration,
) -> Result<(f64, f64, f64)> {
    let mut rc = ReaderConfig::new("bench_lag");
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let mut sub = reader.subscribe_ephemeral(Start::Now).await?;
    let acked: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let seen: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let consumer = {
        let (seen, stop) = (seen.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(Ok(e)) =
                    tokio::time::timeout(Duration::from_millis(200), sub.next()).await
                {
                    seen.lock()
                        .expect("lock")
                        .insert(e.position.0, Instant::now());
                    sub.ack(e.position);
                }
            }
        })
    };
    // Let the subscription reach the live stream.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let per_tick = rate / 1000.0;
    let mut owed = 0.0;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut sent = 0u64;
    let mut inflight = tokio::task::JoinSet::new();
    while started.elapsed() < secs {
        tick.tick().await;
        owed += per_tick;
        while owed >= 1.0 {
            owed -= 1.0;
            sent += 1;
            let (a, acked) = (appender.clone(), acked.clone());
            let stream = format!("lag/{}", sent % 512);
            inflight.spawn(async move {
                if let Ok(out) = a
                    .append(
                        &stream,
                        ExpectedVersion::Any,
                        vec![NewEvent::new("bench.lag", &payload(sent))],
                    )
                    .await
                {
                    acked
                        .lock()
                        .expect("lock")
                        .insert(out.last_position.0, Instant::now());
                }
            });
        }
        while inflight.try_join_next().is_some() {}
    }
    while inflight.join_next().await.is_some() {}
    let achieved = sent as f64 / started.elapsed().as_secs_f64();
    // Wait for the deliveries to come in.
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.lock().expect("lock").len() < acked.lock().expect("lock").len()
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    consumer.await?;
    let acked = acked.lock().expect("lock");
    let seen = seen.lock().expect("lock");
    if seen.len() < acked.len() {
        bail!(
            "{} of {} acknowledged events were not delivered within 10 s",
            acked.len() - seen.len(),
            acked.len()
        );
    }
    let mut lags: Vec<Duration> = acked
        .iter()
        .filter_map(|(p, a)| seen.get(p).map(|s| s.saturating_duration_since(*a)))
        .collect();
    Ok((
        achieved,
        percentile_ms(&mut lags, 0.5),
        percentile_ms(&mut lags, 0.99),
    ))
}

/// Writes a backlog in 1,000-event transactions with two slots waiting, then
/// times Strata's subscription and pg_recvlogical each consuming all of it.
async fn decode(
    cfg: &Config,
    appender: &Appender,
    recvlogical: &std::path::Path,
    backlog: u64,
) -> Result<(f64, f64)> {
    let client = events::db::connect(cfg, "bench-decode").await?;
    client
        .execute(
            "SELECT pg_create_logical_replication_slot('bench_recv', 'pgoutput')",
            &[],
        )
        .await?;
    // Strata's slot is made by its reader, which records where it starts.
    {
        let reader = Reader::start(cfg.clone(), ReaderConfig::new("bench_strata"));
        let _sub = reader.subscribe("bench-decode", Start::Now).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let n: i64 = client
                .query_one("SELECT count(*) FROM strata.replication_readers WHERE slot_name = 'bench_strata' AND acked_position IS NOT NULL", &[])
                .await?
                .get(0);
            if n == 1 {
                break;
            }
            if Instant::now() > deadline {
                bail!("the reader did not create its slot");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let start_pos = events::read::head(&client).await?.0;
    eprintln!("writing a backlog of {backlog} events in 1,000-event transactions ...");
    let t = Instant::now();
    let mut written = 0u64;
    while written < backlog {
        let n = 1000.min(backlog - written);
        appender
            .append_batch(vec![StreamAppend {
                stream: format!("backlog/{}", written / 1000),
                expected: ExpectedVersion::Any,
                events: (0..n)
                    .map(|i| NewEvent::new("bench.backlog", &payload(written + i)))
                    .collect(),
            }])
            .await?;
        written += n;
    }
    eprintln!("backlog written in {:.1} s", t.elapsed().as_secs_f64());
    let end: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    // Wait until the slot inactive from the reader above is released.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // pg_recvlogical: decode on the server, bytes to /dev/null.
    let (host, port, user, db) = conn_parts(cfg)?;
    let t = Instant::now();
    let status = tokio::process::Command::new(recvlogical)
        .args([
            "-h",
            &host,
            "-p",
            &port,
            "-U",
            &user,
            "-d",
            &db,
            "--slot",
            "bench_recv",
            "--start",
            "--endpos",
            &end,
        ])
        .args([
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=strata_events",
            "-o",
            "binary=true",
            "-f",
            "/dev/null",
        ])
        .status()
        .await
        .context("run pg_recvlogical")?;
    let recv_secs = t.elapsed().as_secs_f64();
    if !status.success() {
        bail!("pg_recvlogical failed: {status}");
    }

    // Strata: the reader decodes and a subscription receives every event.
    let t = Instant::now();
    let reader = Reader::start(cfg.clone(), ReaderConfig::new("bench_strata"));
    let mut sub = reader.subscribe("bench-decode", Start::Now).await?;
    let want = start_pos + backlog;
    let mut last = 0;
    while last < want {
        let e = tokio::time::timeout(Duration::from_secs(60), sub.next())
            .await
            .context("decode stalled")??;
        last = e.position.0;
        if last % 1000 == 0 {
            sub.ack(e.position);
        }
    }
    let strata_secs = t.elapsed().as_secs_f64();
    if sub.attachments() != 1 {
        eprintln!("note: the subscription left the live stream during the decode run");
    }
    Ok((backlog as f64 / strata_secs, backlog as f64 / recv_secs))
}

fn conn_parts(cfg: &Config) -> Result<(String, String, String, String)> {
    let host = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => bail!("the benchmark cluster listens on TCP"),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432).to_string();
    Ok((
        host,
        port,
        cfg.get_user().unwrap_or("postgres").into(),
        cfg.get_dbname().unwrap_or("postgres").into(),
    ))
}

/// The same appends another way (over TLS, through PgBouncer), measured
/// next to the direct plaintext phase: its rate over that phase's, per
/// repetition, is its ratio.
struct Variant {
    label: &'static str,
    /// The JSON keys' prefix: `<key>_appends_per_s_<n>`, `<key>_ratio_<n>`.
    key: &'static str,
    appender: Appender,
    /// Per number of writers, per repetition.
    rates: Vec<Vec<f64>>,
    ratios: Vec<Vec<f64>>,
}

impl Variant {
    fn new(label: &'static str, key: &'static str, appender: Appender, levels: usize) -> Variant {
        Variant {
            label,
            key,
            appender,
            rates: vec![Vec::new(); levels],
            ratios: vec![Vec::new(); levels],
        }
    }

    /// Each variant's appends/s with `writers` writers, one after another.
    async fn measure(
        variants: &[Variant],
        writers: usize,
        secs: Duration,
    ) -> anyhow::Result<Vec<f64>> {
        let mut out = Vec::with_capacity(variants.len());
        for v in variants {
            out.push(strata_appends(&v.appender, writers, secs).await?.0.rate);
        }
        Ok(out)
    }
}
