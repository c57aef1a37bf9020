//! `bench node`: the node's end of a reservation, measured.
//!
//! 1,000 simulated daemons (8 GPUs each, in this process) hold mutual-TLS
//! sessions with a gateway process; a placer and a binder run here.
//!
//! - **Bind to CDI-visible**: reservations of 1 to 4 GPUs are offered at
//!   100/s and released after 1 to 5 s; for every `allocation.bind`, the
//!   time from the command's arrival at its daemon to the moment its
//!   binding and CDI spec are on disk (renamed into place and flushed),
//!   taken by the daemon's own hooks. Baseline, in the same run on the same
//!   disk, with nothing else running: the files a bind writes, written
//!   alone (a spec-sized file whole and flushed: a temporary file, fsync,
//!   rename, fsync of the folder; and the spec renamed into place).
//! - **Fault to quarantine**: 100 live one-GPU reservations each get an
//!   XID 48 (a double-bit ECC error) injected on their GPU, 100 ms apart;
//!   the time from the injection to `device.quarantined` on the pool's
//!   stream and to the reservation's `reservation.failed` (`gpu_fault`), as a
//!   subscription sees them. Baseline, in the same run: an event appended
//!   and seen by the same subscription (the log's own round trip).
//!
//! Everything (daemons, gateway, placer, binder, load generator and
//! PostgreSQL) shares this machine's cores.

use crate::gateway::{provision, setup, wait_for_joins, GatewayProcess};
use crate::util::{self, percentile_ms, round};
use anyhow::Result;
use domain::{Fact, Request, Shape};
use events::{Appender, AppenderConfig, Reader, ReaderConfig, Start};
use node::daemon::{self, DaemonConfig, DaemonStats};
use node::gpu::{FakeGpus, HealthChange};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value_t = 1_000)]
    nodes: u32,
    /// Reservations per second offered in the bind phase
    #[arg(long, default_value_t = 100)]
    rate: u32,
    /// Seconds of bind load
    #[arg(long, default_value_t = 60)]
    seconds: u32,
    /// XIDs injected in the fault phase
    #[arg(long, default_value_t = 100)]
    faults: u32,
    /// A short run: 200 nodes, 20 s of binds, 30 faults
    #[arg(long)]
    quick: bool,
}

/// When each command arrived at its daemon and when it had run.
#[derive(Default)]
struct Commands {
    arrived: HashMap<String, Instant>,
    finished: HashMap<String, Instant>,
}

/// What the subscription saw, and when.
#[derive(Default)]
struct Seen {
    active: HashMap<String, Instant>,
    /// Where each reservation's first device is: (node, device).
    placed: HashMap<String, (String, String)>,
    /// (node, device) -> when it was quarantined.
    quarantined: HashMap<(String, String), Instant>,
    /// Reservations failed for a GPU fault.
    gpu_fault: HashMap<String, Instant>,
    /// Probe events (the baseline's round trips) by stream.
    probes: HashMap<String, Instant>,
}

struct Fleet {
    backends: HashMap<String, Arc<FakeGpus>>,
    commands: Arc<Mutex<Commands>>,
    _stops: Vec<tokio::sync::watch::Sender<bool>>,
}

fn start_fleet(ids: &[String], gateway: &str, dir: &Path) -> Fleet {
    let stats = Arc::new(DaemonStats::default());
    let commands: Arc<Mutex<Commands>> = Arc::default();
    let mut backends = HashMap::new();
    let mut stops = Vec::new();
    for id in ids {
        let backend = Arc::new(FakeGpus::parse("8xH100-80GB", id).expect("spec"));
        backends.insert(id.clone(), backend.clone());
        let mut c = DaemonConfig::new(vec![gateway.to_string()], dir.join(id), id, backend);
        c.health_poll = Duration::from_secs(60);
        let (a, f) = (commands.clone(), commands.clone());
        c.on_command = Some(Arc::new(move |cmd: &str| {
            a.lock()
                .expect("commands lock")
                .arrived
                .entry(cmd.to_string())
                .or_insert_with(Instant::now);
        }));
        c.on_finished = Some(Arc::new(move |cmd: &str| {
            f.lock()
                .expect("commands lock")
                .finished
                .insert(cmd.to_string(), Instant::now());
        }));
        let (stop, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(daemon::run(c, stats.clone(), rx));
        stops.push(stop);
    }
    Fleet {
        backends,
        commands,
        _stops: stops,
    }
}

/// A request of `gpus` GPUs anywhere in the bench's pool.
fn request(id: String, gpus: u32) -> Request {
    crate::placements::request(id, "nodepath", gpus, Shape::Any)
}

/// The baseline of the bind phase: the files a bind writes, alone, `n`
/// times: a spec-sized file whole and flushed, and the spec itself renamed
/// into place (`node::cdi::write`).
fn file_baseline(dir: &Path, n: usize) -> Vec<Duration> {
    use std::io::Write;
    let gpus: Vec<node::cdi::BoundGpu> = (0..4)
        .map(|i| node::cdi::BoundGpu {
            uuid: format!("GPU-fake-baseline-{i}"),
            nodes: vec![node::cdi::DeviceNode {
                path: format!("/dev/nvidia{i}"),
                host_path: Some("/dev/null".into()),
            }],
        })
        .collect();
    let flushed = dir.join("flushed");
    std::fs::create_dir_all(&flushed).expect("baseline folder");
    (0..n)
        .map(|i| {
            let id = format!("base{i}");
            let spec = node::cdi::spec(&id, &gpus, &[]);
            let body = serde_json::to_vec(&spec).expect("spec");
            let t = Instant::now();
            let tmp = flushed.join(format!(".{id}.tmp"));
            let mut f = std::fs::File::create(&tmp).expect("create");
            f.write_all(&body).expect("write");
            f.sync_all().expect("fsync");
            std::fs::rename(&tmp, flushed.join(format!("{id}.json"))).expect("rename");
            std::fs::File::open(&flushed)
                .and_then(|d| d.sync_all())
                .expect("fsync folder");
            node::cdi::write(dir, &id, &spec).expect("write");
            t.elapsed()
        })
        .collect()
}

fn watch(mut sub: events::Subscription, seen: Arc<Mutex<Seen>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(e) = sub.next().await {
            sub.ack(e.position);
            let now = Instant::now();
            if e.event_type == "bench.probed" {
                seen.lock()
                    .expect("seen lock")
                    .probes
                    .insert(e.stream.clone(), now);
                continue;
            }
            let Ok(Some(f)) = Fact::parse(&e.event_type, &e.payload, &e.metadata) else {
                continue;
            };
            let mut s = seen.lock().expect("seen lock");
            match f {
                Fact::ReservationPlaced {
                    reservation,
                    allocations,
                } => {
                    if let Some(d) = allocations
                        .first()
                        .and_then(|a| Some((a.node.clone(), a.devices.first()?.clone())))
                    {
                        s.placed.insert(reservation, d);
                    }
                }
                Fact::ReservationActivated { reservation } => {
                    s.active.insert(reservation, now);
                }
                Fact::DeviceQuarantined { node, device, .. } => {
                    s.quarantined.insert((node, device), now);
                }
                Fact::ReservationFailed {
                    reservation,
                    reason,
                    ..
                } if reason == "gpu_fault" => {
                    s.gpu_fault.insert(reservation, now);
                }
                _ => {}
            }
        }
    })
}

/// Summary of a sample: p50, p99, max (ms) and count.
fn summary(mut v: Vec<Duration>) -> serde_json::Value {
    let n = v.len();
    serde_json::json!({
        "count": n,
        "p50_ms": round(percentile_ms(&mut v, 0.50), 2),
        "p99_ms": round(percentile_ms(&mut v, 0.99), 2),
        "max_ms": round(percentile_ms(&mut v, 1.0), 2),
    })
}

async fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) -> Result<()> {
    let t = Instant::now();
    while !f() {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

pub async fn run(args: Args) -> Result<()> {
    let (nodes, seconds, faults) = if args.quick {
        (
            args.nodes.min(200),
            args.seconds.min(20),
            args.faults.min(30),
        )
    } else {
        (args.nodes, args.seconds, args.faults)
    };
    let (_cluster, cfg, client, url, dir) = setup("nodepath").await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    let nodes_dir = dir.path().join("nodes");
    let ids = provision(
        &client,
        &dir.path().join("ca"),
        &nodes_dir,
        "nodepath",
        nodes,
    )
    .await?;
    let gw = GatewayProcess::start(&url, &dir.path().join("ca"), "2s").await?;
    let fleet = start_fleet(&ids, &gw.addr, &nodes_dir);
    let joined = wait_for_joins(&client, "nodepath", nodes).await?;
    eprintln!("{nodes} nodes joined in {:.1} s", joined.as_secs_f64());

    let mut rc = ReaderConfig::new("bench_nodepath");
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let placer = placer::Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        placer::PlacerConfig::new("nodepath"),
    );
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    while placer.stats().view().pools_held < 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let watcher = watch(reader.subscribe_ephemeral(Start::Now).await?, seen.clone());

    // Phase 1: binds under load.
    let start = Instant::now();
    let offered = u64::from(args.rate) * u64::from(seconds);
    let mut releases = Vec::new();
    for i in 0..offered {
        tokio::time::sleep_until(
            (start + Duration::from_secs_f64(i as f64 / f64::from(args.rate))).into(),
        )
        .await;
        let id = format!("b{i}");
        domain::requests::reserve(
            &client,
            &appender,
            &request(id.clone(), fastrand::u32(1..=4)),
            None,
        )
        .await?;
        let appender = appender.clone();
        releases.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(fastrand::u64(1_000..5_000))).await;
            let _ = domain::requests::release(&appender, &id, "done", None).await;
        }));
    }
    for r in releases {
        let _ = r.await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let binds: Vec<Duration> = {
        let c = fleet.commands.lock().expect("commands lock");
        c.arrived
            .iter()
            .filter(|(id, _)| id.starts_with("bind:"))
            .filter_map(|(id, at)| c.finished.get(id).map(|f| f.duration_since(*at)))
            .collect()
    };
    let baseline_dir = dir.path().join("baseline-cdi");
    let base =
        tokio::task::block_in_place(|| file_baseline(&baseline_dir, binds.len().clamp(200, 2_000)));
    let (bind_p99, base_p99) = (
        percentile_ms(&mut binds.clone(), 0.99),
        percentile_ms(&mut base.clone(), 0.99),
    );
    eprintln!(
        "binds: {} measured, p99 {bind_p99:.2} ms to CDI-visible; the bind's files written alone p99 {base_p99:.2} ms",
        binds.len()
    );

    // Phase 2: faults. One-GPU reservations, each then hit on its GPU.
    let mut targets = Vec::new();
    for i in 0..faults {
        let id = format!("f{i}");
        domain::requests::reserve(&client, &appender, &request(id.clone(), 1), None).await?;
        targets.push(id);
    }
    wait_until("the fault targets are active", 120, || {
        let s = seen.lock().expect("seen lock");
        targets.iter().all(|t| s.active.contains_key(t))
    })
    .await?;
    let mut injected = Vec::new();
    let mut probes_sent = Vec::new();
    for id in &targets {
        let (node, device) = seen.lock().expect("seen lock").placed[id].clone();
        let t0 = Instant::now();
        fleet.backends[&node].inject(HealthChange {
            device: Some(device.clone()),
            condition: "XID-48".into(),
            detail: "bench".into(),
            cleared: false,
        });
        injected.push((id.clone(), node, device, t0));
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The baseline: a probe event through the same log and
        // subscription, between injections.
        let probe = format!("probe/{id}");
        let p0 = Instant::now();
        appender
            .append(
                &probe,
                events::ExpectedVersion::Any,
                vec![events::NewEvent::new(
                    "bench.probed",
                    &serde_json::json!({}),
                )],
            )
            .await?;
        probes_sent.push((probe, p0));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until("every hit reservation ends", 60, || {
        let s = seen.lock().expect("seen lock");
        targets.iter().all(|t| s.gpu_fault.contains_key(t))
    })
    .await?;
    let (mut to_quarantine, mut to_end) = (Vec::new(), Vec::new());
    {
        let s = seen.lock().expect("seen lock");
        for (id, node, device, t0) in &injected {
            if let Some(q) = s.quarantined.get(&(node.clone(), device.clone())) {
                to_quarantine.push(q.duration_since(*t0));
            }
            if let Some(e) = s.gpu_fault.get(id) {
                to_end.push(e.duration_since(*t0));
            }
        }
    }
    let probes: Vec<Duration> = {
        let s = seen.lock().expect("seen lock");
        probes_sent
            .iter()
            .filter_map(|(p, p0)| s.probes.get(p).map(|at| at.duration_since(*p0)))
            .collect()
    };
    let (q99, e99, p99) = (
        percentile_ms(&mut to_quarantine.clone(), 0.99),
        percentile_ms(&mut to_end.clone(), 0.99),
        percentile_ms(&mut probes.clone(), 0.99),
    );
    eprintln!("faults: XID to quarantine p99 {q99:.1} ms, to the reservation's end p99 {e99:.1} ms; an event's round trip p99 {p99:.1} ms");

    watcher.abort();
    binder.stop().await?;
    placer.stop().await?;
    let result = serde_json::json!({
        "bench": "node",
        "machine": util::machine(&pg_version),
        "shared_cores": "daemons, gateway, placer, binder, load and PostgreSQL on the same cores",
        "nodes": nodes,
        "bind": {
            "offered": offered,
            "rate_per_s": args.rate,
            "bind_to_cdi_visible": summary(binds),
            "baseline_the_binds_files_alone": summary(base),
            "ratio_p99": round(bind_p99 / base_p99.max(1e-9), 2),
            "target_p99_ms": 50,
        },
        "faults": {
            "injected": faults,
            "xid_to_quarantine": summary(to_quarantine),
            "xid_to_reservation_end": summary(to_end),
            "baseline_event_round_trip": summary(probes),
            "ratio_end_p99": round(e99 / p99.max(1e-9), 2),
            "target_p99_ms": 1000,
        },
    });
    util::finish(if args.quick { "node-quick" } else { "node" }, &result)
}
