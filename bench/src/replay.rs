//! `bench replay`: rebuilding the pool index from history, against
//! `COPY ... TO STDOUT (FORMAT binary)` of the same rows in the same run.
//!
//! The log is what a region writes: 10,000 nodes of 8 GPUs joining 10
//! pools, then reservations going requested, placed, active, release
//! requested and released (20,000 live at any time), with a node status
//! event from the gateways beside each. It is bulk-loaded with COPY (the
//! append path is measured by `bench append`). Then, three times each:
//!
//! - the baseline: the replay's own COPY statement, its rows only received;
//! - replay from PostgreSQL: the same COPY decoded into events and applied
//!   to a pool index (`strata replay run`);
//! - replay from archives: the month's partition exported (`strata
//!   partitions export`), loaded, validated and applied.
//!
//! Each replayed index must equal the one built while generating the log.

use crate::util::{self, round};
use ::replay::rebuild::{self, Progress};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use domain::{DeviceSpec, Fact, Request, Shape};
use futures_util::SinkExt;
use projections::Index;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Events in the log
    #[arg(long, default_value_t = 10_000_000)]
    events: u64,
    /// A short run: 2,000,000 events
    #[arg(long)]
    quick: bool,
    /// Times each measurement is repeated (the median is reported)
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

const NODES: u64 = 10_000;
const POOLS: u64 = 10;
const LIVE: u64 = 20_000;

fn pool_of(node: u64) -> String {
    format!("p{}", node * POOLS / NODES)
}

/// Writes the log as COPY text rows; returns the index built on the way.
struct Generator {
    position: u64,
    versions: std::collections::HashMap<String, u64>,
    index: Index,
    buf: Vec<u8>,
    /// One time for every row (the index keeps placement times).
    at: std::time::SystemTime,
    at_text: String,
}

impl Generator {
    fn push(&mut self, stream: &str, event_type: &str, payload: &str) {
        self.position += 1;
        let v = self.versions.entry(stream.to_string()).or_insert(0);
        *v += 1;
        let e = events::Event {
            position: events::Position(self.position),
            stream: stream.to_string(),
            version: *v,
            event_type: event_type.to_string(),
            payload: payload.to_string(),
            metadata: "{}".into(),
            recorded_at: self.at,
            xid: 0,
        };
        if let Some(v) = self.index.apply(&e).expect("generated in order") {
            panic!("the generated log breaks an invariant: {v}");
        }
        use std::io::Write;
        // JSON from serde has no tab, newline or backslash-escape issue here:
        // escape backslashes for COPY text anyway.
        let _ = writeln!(
            self.buf,
            "{}\t{}\t{}\t{}\t{}\t{}",
            self.position,
            stream,
            e.version,
            event_type,
            payload.replace('\\', "\\\\"),
            self.at_text
        );
    }

    fn fact(&mut self, stream: &str, f: &Fact) {
        let e = f.to_event();
        self.push(stream, &e.event_type, e.payload.get());
    }
}

async fn load(db: &tokio_postgres::Client, total: u64) -> Result<Index> {
    let sink = db
        .copy_in(
            "COPY strata.events (position, stream, version, type, payload, recorded_at) FROM STDIN",
        )
        .await?;
    futures_util::pin_mut!(sink);
    // Whole microseconds, as PostgreSQL stores them.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_micros(now.as_micros() as u64);
    let mut g = Generator {
        position: 0,
        versions: Default::default(),
        index: Index::new(),
        buf: Vec::with_capacity(2 << 20),
        at,
        at_text: humantime::format_rfc3339_micros(at).to_string(),
    };
    for p in 0..POOLS {
        g.fact(
            &format!("pool/p{p}"),
            &Fact::PoolCreated {
                description: String::new(),
            },
        );
    }
    for n in 0..NODES {
        let devices = (0..8)
            .map(|d| DeviceSpec {
                id: d.to_string(),
                class: "H100-80GB".into(),
                memory_mb: 81_559,
                island: None,
                pci: None,
                numa: None,
                parent: None,
            })
            .collect();
        g.fact(
            &format!("pool/{}", pool_of(n)),
            &Fact::NodeJoined {
                node: format!("n{n}"),
                devices,
            },
        );
    }
    let mut i = 0u64;
    let started = Instant::now();
    while g.position < total {
        let node = i % NODES;
        let device = (i / NODES) % 8;
        let pool = pool_of(node);
        let id = format!("r{i}");
        let rs = format!("reservation/{id}");
        g.fact(
            &rs,
            &Fact::ReservationRequested(Request {
                reservation: id.clone(),
                pool: pool.clone(),
                class: "H100-80GB".into(),
                gpus: 1,
                shape: Shape::Any,
                priority: 0,
                ttl_ms: None,
                replace_on_failure: false,
                replaces: None,
                topology: None,
                requeue_on_preemption: false,
                start_ms: None,
                queue: None,
            }),
        );
        g.fact(
            &format!("pool/{pool}"),
            &Fact::ReservationPlaced {
                reservation: id.clone(),
                allocations: vec![domain::Allocation {
                    node: format!("n{node}"),
                    devices: vec![device.to_string()],
                }],
            },
        );
        g.fact(
            &rs,
            &Fact::ReservationActivated {
                reservation: id.clone(),
            },
        );
        if i >= LIVE {
            let old = i - LIVE;
            let old_id = format!("r{old}");
            g.fact(
                &format!("reservation/{old_id}"),
                &Fact::ReservationReleaseRequested {
                    reservation: old_id.clone(),
                    reason: String::new(),
                },
            );
            g.fact(
                &format!("pool/{}", pool_of(old % NODES)),
                &Fact::ReservationReleased {
                    reservation: old_id,
                },
            );
        }
        g.push(
            &format!("node/n{node}"),
            "node.status_reported",
            &format!(
                "{{\"node\":\"n{node}\",\"status\":\"ready\",\"gpus_busy\":{}}}",
                i % 8
            ),
        );
        i += 1;
        if g.buf.len() >= 1 << 20 {
            let chunk = Bytes::from(std::mem::take(&mut g.buf));
            sink.send(chunk).await?;
            g.buf.reserve(2 << 20);
        }
        if i.is_multiple_of(200_000) {
            eprint!(
                "\rloading the log: {} events ({:.0}/s)",
                g.position,
                g.position as f64 / started.elapsed().as_secs_f64()
            );
        }
    }
    if !g.buf.is_empty() {
        sink.send(Bytes::from(std::mem::take(&mut g.buf))).await?;
    }
    sink.as_mut().finish().await?;
    util::after_bulk_load(db, g.position, started).await?;
    Ok(g.index)
}

/// The baseline: the replay's COPY over the same kind of connection, rows
/// received and counted (one CopyData message per row).
async fn copy_only(cfg: &tokio_postgres::Config, n: u64) -> Result<f64> {
    let t = Instant::now();
    let mut conn =
        events::replication::ReplicationConnection::connect_session(cfg, "bench-copy", None)
            .await?;
    conn.copy_out_start(&rebuild::copy_sql(0, n)).await?;
    let mut bytes = 0usize;
    let mut chunks = 0u64;
    while conn
        .copy_data(|c| {
            bytes += c.len();
            chunks += 1;
            Ok::<(), events::replication::ReplicationError>(())
        })
        .await?
    {}
    let secs = t.elapsed().as_secs_f64();
    if chunks < n {
        bail!("COPY returned {chunks} chunks for {n} rows ({bytes} bytes)");
    }
    Ok(n as f64 / secs)
}

pub async fn run(args: Args) -> Result<()> {
    let n = if args.quick { 2_000_000 } else { args.events };
    let cluster = util::cluster()?;
    let cfg = util::database(&cluster, "replay").await?;
    let db = events::db::connect(&cfg, "bench-replay").await?;
    let pg_version: String = db.query_one("SHOW server_version", &[]).await?.get(0);
    let expected = load(&db, n).await.context("load the log")?;
    let n = expected.position();
    let size: String = db
        .query_one(
            "SELECT pg_size_pretty(pg_total_relation_size('strata.events'::regclass) +
                    coalesce((SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits
                               WHERE inhparent = 'strata.events'::regclass), 0)::bigint)",
            &[],
        )
        .await?
        .get(0);
    eprintln!("log: {n} events, {size}");

    // Warm the cache once (both readers then find the same pages in memory).
    copy_only(&cfg, n).await?;
    let (mut copy, mut pg, mut archive) = (Vec::new(), Vec::new(), Vec::new());
    for round_no in 0..args.repeat {
        copy.push(copy_only(&cfg, n).await?);
        let t = Instant::now();
        let cpu0 = util::cpu_seconds(std::process::id());
        let index = rebuild::from_postgres(
            &events::db::Database::from(&cfg),
            &db,
            Index::new(),
            None,
            Arc::new(Progress::default()),
            |v| eprintln!("violation: {v}"),
        )
        .await?;
        pg.push(n as f64 / t.elapsed().as_secs_f64());
        let cpu = util::cpu_seconds(std::process::id()) - cpu0;
        eprintln!(
            "replay client CPU {:.2} s ({:.2} us/event), wall {:.2} s",
            cpu,
            cpu * 1e6 / n as f64,
            t.elapsed().as_secs_f64()
        );
        if index != expected {
            bail!("the index replayed from PostgreSQL differs from the one built while loading");
        }
        eprintln!(
            "round {}: COPY {:.0}/s, replay from PostgreSQL {:.0}/s",
            round_no + 1,
            copy[round_no],
            pg[round_no]
        );
    }

    // Archives: every partition exported, then replayed from the files.
    let dir = tempfile::tempdir()?;
    let months: Vec<String> = db
        .query(
            "SELECT DISTINCT to_char(recorded_at AT TIME ZONE 'UTC', 'YYYY-MM') FROM strata.events ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut files = Vec::new();
    for m in &months {
        let (bytes, rows) = ::replay::archive::export(&db, m).await?;
        if rows == 0 {
            continue;
        }
        let path = dir.path().join(format!("{m}.archive"));
        std::fs::write(&path, &bytes)?;
        files.push(path);
    }
    let archive_bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    // Where the time goes, on one thread with the events in memory.
    let breakdown = {
        let bytes = std::fs::read(&files[0])?;
        let archive = ::replay::archive::Archive::open(&bytes)?;
        let rows = archive.rows()?;
        let t = Instant::now();
        let evs: Vec<events::Event> = rows.iter().map(|r| r.to_event()).collect();
        let t_ev = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let parsed: Vec<_> = evs
            .iter()
            .map(|e| Fact::parse(&e.event_type, &e.payload, &e.metadata))
            .collect();
        let t_parse = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut index = Index::new();
        for (e, p) in evs.iter().zip(parsed) {
            index.apply_parsed(e, p)?;
        }
        let t_apply = t.elapsed().as_secs_f64();

        eprintln!("one thread, events in memory ({} rows): rows to events {t_ev:.2} s, parse {t_parse:.2} s, apply {t_apply:.2} s", evs.len());
        serde_json::json!({
            "rows_to_events_per_s": round(evs.len() as f64 / t_ev, 0),
            "parse_per_s": round(evs.len() as f64 / t_parse, 0),
            "apply_per_s": round(evs.len() as f64 / t_apply, 0),
        })
    };
    let (mut load_s, mut apply_s) = (Vec::new(), Vec::new());
    for _ in 0..args.repeat {
        let t = Instant::now();
        let mut index = Index::new();
        let (mut l, mut a) = (0.0, 0.0);
        for f in &files {
            let t0 = Instant::now();
            let bytes = std::fs::read(f)?;
            let archive = ::replay::archive::Archive::open(&bytes)?;
            let rows = archive.rows()?;
            l += t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            index = rebuild::from_archive(index, rows, None, &Progress::default(), |v| {
                eprintln!("violation: {v}")
            })?;
            a += t1.elapsed().as_secs_f64();
        }
        archive.push(n as f64 / t.elapsed().as_secs_f64());
        load_s.push(l);
        apply_s.push(a);
        eprintln!("archive: load and validate {l:.2} s, apply {a:.2} s");
        if index != expected {
            bail!("the index replayed from archives differs from the one built while loading");
        }
    }
    let copy_per_s = util::median(&mut copy);
    let replay_pg_per_s = util::median(&mut pg);
    let replay_archive_per_s = util::median(&mut archive);
    let result = serde_json::json!({
        "scenario": "replay",
        "events": n,
        "log_size": size,
        "archive_bytes": archive_bytes,
        "copy_per_s": round(copy_per_s, 0),
        "replay_pg_per_s": round(replay_pg_per_s, 0),
        "replay_ratio": round(replay_pg_per_s / copy_per_s, 3),
        "replay_archive_per_s": round(replay_archive_per_s, 0),
        "runs": {
            "copy_per_s": copy.iter().map(|v| round(*v, 0)).collect::<Vec<_>>(),
            "replay_pg_per_s": pg.iter().map(|v| round(*v, 0)).collect::<Vec<_>>(),
            "replay_archive_per_s": archive.iter().map(|v| round(*v, 0)).collect::<Vec<_>>(),
        },
        "projection": "pool-index",
        "single_thread_breakdown": breakdown,
        "archive_load_s": load_s.iter().map(|v| round(*v, 3)).collect::<Vec<_>>(),
        "archive_apply_s": apply_s.iter().map(|v| round(*v, 3)).collect::<Vec<_>>(),
        "transport": "COPY (SELECT ... ORDER BY position) TO STDOUT (FORMAT binary) over the same raw protocol connection for the baseline and the replay",
        "live_reservations": LIVE,
        "nodes": NODES,
        "machine": util::machine(&pg_version),
    });
    util::finish(if args.quick { "replay-quick" } else { "replay" }, &result)
}
