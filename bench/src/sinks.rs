//! `bench sinks`: events delivered to sinks running in their own process.
//!
//! A generator appends events at a fixed offered rate; the sinks role runs
//! in a child process (this binary's hidden `sinks-server`, so its CPU is its
//! own); a local HTTP receiver in this process takes the webhook batches.
//! Phases: one webhook sink, ten webhook sinks, one NATS JetStream sink.
//! Reported per phase: delivered/s, latency from the append's acknowledgement
//! to the receiver (p50/p99), WAL retained by the sinks process's slot, and
//! the sinks process's CPU; `cpu_ratio_10_vs_1` compares the ten-sink phase
//! with the one-sink phase. Baseline in the same run: the offered rate.

use crate::util::{self, percentile_ms, round};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use events::{Appender, AppenderConfig, ExpectedVersion, NewEvent};
use http_body_util::{BodyExt, Full};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Events per second offered
    #[arg(long, default_value_t = 20_000)]
    rate: u32,
    /// Seconds per phase (default 5 quick, 10 full)
    #[arg(long)]
    seconds: Option<u64>,
    #[arg(long)]
    quick: bool,
    /// NATS server for the JetStream phase (skipped when unreachable)
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats: String,
}

#[derive(clap::Args, Debug)]
pub struct ServerArgs {
    #[arg(long)]
    database_url: String,
}

/// The hidden `sinks-server`: the sinks role alone.
pub async fn server(args: ServerArgs) -> Result<()> {
    let cfg: tokio_postgres::Config = args.database_url.parse()?;
    let mut rc = events::ReaderConfig::new("bench_sinks_server");
    rc.temporary = true;
    let reader = events::Reader::start(cfg.clone(), rc);
    let sc = sinks::SinksConfig {
        poll: Duration::from_millis(200),
        ..sinks::SinksConfig::default()
    };
    let s = sinks::Sinks::start(cfg, reader, sc).map_err(anyhow::Error::msg)?;
    println!("running");
    tokio::signal::ctrl_c().await?;
    s.stop().await;
    Ok(())
}

/// Arrival times of positions at the receiver, per sink.
#[derive(Default)]
struct Received {
    count: AtomicU64,
    at: Mutex<HashMap<u64, Instant>>,
}

async fn receiver(rx: Arc<Received>) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/", listener.local_addr()?);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let rx = rx.clone();
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let rx = rx.clone();
                    async move {
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        let now = Instant::now();
                        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
                            if let Some(events) = v["events"].as_array() {
                                rx.count.fetch_add(events.len() as u64, Ordering::Relaxed);
                                let mut at = rx.at.lock().expect("lock");
                                for e in events {
                                    if let Some(p) = e["position"].as_u64() {
                                        at.entry(p).or_insert(now);
                                    }
                                }
                            }
                        }
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                            Bytes::new(),
                        )))
                    }
                });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(url)
}

struct Phase {
    delivered_per_s: f64,
    p50: f64,
    p99: f64,
    cpu_s: f64,
    wal_bytes: i64,
    delivered: u64,
    expected: u64,
}

/// Offers `rate` events/s for `secs` on `load/*` streams; returns each
/// sampled position's acknowledgement time.
async fn offer(appender: &Appender, rate: u32, secs: u64) -> Result<HashMap<u64, Instant>> {
    let per_tick = (rate / 1000).max(1) as usize; // one append per millisecond
    let committed: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for tick in 0..secs * 1000 {
        tokio::time::sleep_until((t0 + Duration::from_millis(tick)).into()).await;
        let (appender, committed) = (appender.clone(), committed.clone());
        tasks.push(tokio::spawn(async move {
            let events: Vec<NewEvent> = (0..per_tick)
                .map(|i| NewEvent::new("load.tick", &serde_json::json!({ "tick": tick, "i": i })))
                .collect();
            let a = appender
                .append(&format!("load/{}", tick % 16), ExpectedVersion::Any, events)
                .await?;
            let now = Instant::now();
            let mut c = committed.lock().expect("lock");
            for p in a.first_position.0..=a.last_position.0 {
                c.insert(p, now);
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let c = committed.lock().expect("lock").clone();
    Ok(c)
}

async fn phase(
    client: &tokio_postgres::Client,
    appender: &Appender,
    pid: u32,
    receivers: &[Arc<Received>],
    rate: u32,
    secs: u64,
    nats: Option<(&async_nats::jetstream::Context, &str)>,
) -> Result<Phase> {
    let before: Vec<u64> = receivers
        .iter()
        .map(|r| r.count.load(Ordering::Relaxed))
        .collect();
    let cpu0 = util::cpu_seconds(pid);
    let t0 = Instant::now();
    let committed = offer(appender, rate, secs).await?;
    let n = committed.len() as u64;
    let expected = n * receivers.len().max(1) as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    let delivered = |before: &[u64]| -> u64 {
        receivers
            .iter()
            .zip(before)
            .map(|(r, b)| r.count.load(Ordering::Relaxed) - b)
            .sum()
    };
    let mut nats_count = 0u64;
    loop {
        let d = match nats {
            Some((js, name)) => {
                nats_count = js.get_stream(name).await?.info().await?.state.messages;
                nats_count
            }
            None => delivered(&before),
        };
        if d >= expected || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = util::cpu_seconds(pid) - cpu0;
    let wal_bytes: i64 = client
        .query_one(
            "SELECT coalesce(max(pg_current_wal_lsn() - restart_lsn), 0)::bigint FROM pg_replication_slots WHERE slot_name = 'bench_sinks_server'",
            &[],
        )
        .await?
        .get(0);
    let got = if nats.is_some() {
        nats_count
    } else {
        delivered(&before)
    };
    let mut lat = Vec::new();
    if nats.is_none() {
        for r in receivers {
            let at = r.at.lock().expect("lock");
            for (p, c) in &committed {
                if let Some(a) = at.get(p) {
                    lat.push(a.saturating_duration_since(*c));
                }
            }
        }
    }
    Ok(Phase {
        delivered_per_s: got as f64 / wall,
        p50: percentile_ms(&mut lat, 0.5),
        p99: percentile_ms(&mut lat, 0.99),
        cpu_s: cpu,
        wal_bytes,
        delivered: got,
        expected,
    })
}

pub async fn run(args: Args) -> Result<()> {
    let secs = args.seconds.unwrap_or(if args.quick { 5 } else { 10 });
    std::env::set_var("STRATA_SINK_SECRET_BENCH", "bench");
    eprintln!("starting a private PostgreSQL (fsync on) ...");
    let cluster = tokio::task::spawn_blocking(util::cluster).await??;
    let cfg = util::database(&cluster, "bench").await?;
    let client = events::db::connect(&cfg, "bench").await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let receivers: Vec<Arc<Received>> = (0..10).map(|_| Arc::default()).collect();
    let mut urls = Vec::new();
    for r in &receivers {
        urls.push(receiver(r.clone()).await?);
    }
    let webhook = |name: String, url: &str| sinks::SinkConfig {
        name,
        target: sinks::Target::Webhook {
            url: url.to_string(),
            secret_env: "STRATA_SINK_SECRET_BENCH".into(),
        },
        filter: sinks::Filter {
            types: vec![],
            prefixes: vec!["load/".into()],
        },
        start: "now".into(),
        batch_max: 1000,
        max_attempts: 8,
        retry: None,
        credentials: false,
    };
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args(["sinks-server", "--database-url", &cluster.url("bench")])
        .env("STRATA_SINK_SECRET_BENCH", "bench")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("start the sinks process")?;
    let pid = child.id().context("pid")?;
    let wait_workers = |n: usize| async move {
        // Workers open their subscriptions within a poll or two.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let _ = n;
    };

    // One sink.
    sinks::config::create(&appender, &webhook("w0".into(), &urls[0])).await?;
    wait_workers(1).await;
    let one = phase(
        &client,
        &appender,
        pid,
        &receivers[..1],
        args.rate,
        secs,
        None,
    )
    .await?;
    eprintln!(
        "1 webhook sink: {}/{} delivered, {:.0}/s, p50 {:.2} ms, p99 {:.2} ms, sinks CPU {:.2} s, WAL retained {} B",
        one.delivered, one.expected, one.delivered_per_s, one.p50, one.p99, one.cpu_s, one.wal_bytes
    );
    // Ten sinks.
    for (i, u) in urls.iter().enumerate().skip(1) {
        sinks::config::create(&appender, &webhook(format!("w{i}"), u)).await?;
    }
    wait_workers(10).await;
    let ten = phase(&client, &appender, pid, &receivers, args.rate, secs, None).await?;
    eprintln!(
        "10 webhook sinks: {}/{} delivered, {:.0}/s, p50 {:.2} ms, p99 {:.2} ms, sinks CPU {:.2} s, WAL retained {} B",
        ten.delivered, ten.expected, ten.delivered_per_s, ten.p50, ten.p99, ten.cpu_s, ten.wal_bytes
    );
    for i in 0..10 {
        sinks::config::change(&appender, &format!("w{i}"), "sink.deleted").await?;
    }
    // NATS JetStream, if there is a server.
    let mut nats_result = serde_json::Value::Null;
    if let Ok(nc) = async_nats::connect(&args.nats).await {
        let js = async_nats::jetstream::new(nc);
        let name = format!("STRATA_BENCH_{}", std::process::id());
        let prefix = format!("strata_bench_{}", std::process::id());
        let _ = js.delete_stream(&name).await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await?;
        let mut nats_sink = webhook("nats".into(), "");
        nats_sink.target = sinks::Target::Nats {
            url: args.nats.clone(),
            subject_prefix: prefix,
        };
        sinks::config::create(&appender, &nats_sink).await?;
        wait_workers(1).await;
        let n = phase(
            &client,
            &appender,
            pid,
            &[],
            args.rate,
            secs,
            Some((&js, &name)),
        )
        .await?;
        eprintln!(
            "1 NATS JetStream sink: {}/{} stored, {:.0}/s, sinks CPU {:.2} s",
            n.delivered, n.expected, n.delivered_per_s, n.cpu_s
        );
        nats_result = serde_json::json!({
            "delivered": n.delivered, "expected": n.expected,
            "delivered_per_s": round(n.delivered_per_s, 0), "cpu_s": round(n.cpu_s, 2),
        });
        let _ = js.delete_stream(&name).await;
    } else {
        eprintln!(
            "no NATS server at {}; skipping the JetStream phase",
            args.nats
        );
    }
    let _ = tokio::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .await;
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    if one.delivered < one.expected {
        bail!(
            "the one-sink phase lost events: {}/{}",
            one.delivered,
            one.expected
        );
    }
    let ratio = if one.cpu_s > 0.0 {
        ten.cpu_s / one.cpu_s
    } else {
        0.0
    };
    let result = serde_json::json!({
        "bench": "sinks",
        "quick": args.quick,
        "machine": util::machine(&pg_version),
        "offered_per_s": args.rate,
        "phase_seconds": secs,
        "delivered_per_s": round(one.delivered_per_s, 0),
        "p50_ms": round(one.p50, 3),
        "p99_ms": round(one.p99, 3),
        "wal_retained_bytes": one.wal_bytes,
        "sinks_cpu_s_1": round(one.cpu_s, 2),
        "ten_sinks": {
            "delivered": ten.delivered, "expected": ten.expected,
            "delivered_per_s": round(ten.delivered_per_s, 0),
            "p50_ms": round(ten.p50, 3), "p99_ms": round(ten.p99, 3),
            "wal_retained_bytes": ten.wal_bytes, "sinks_cpu_s": round(ten.cpu_s, 2),
        },
        "cpu_ratio_10_vs_1": round(ratio, 2),
        "nats": nats_result,
        "targets": {"delivered_per_s": ">= offered (20,000)", "p99_ms": "< 100 to one sink", "cpu_ratio_10_vs_1": "< 2"},
        "met": {
            "delivered_per_s": one.delivered >= one.expected,
            "p99_ms": one.p99 < 100.0,
            "cpu_ratio_10_vs_1": ratio < 2.0,
        },
        "note": "the sinks run in their own process; the generator, the receivers and PostgreSQL share the same two cores with it",
    });
    util::finish(if args.quick { "sinks-quick" } else { "sinks" }, &result)?;
    drop(cluster);
    Ok(())
}
