//! `bench lifecycle`: placement under the faults a fleet lives with.
//!
//! 1,000 simulated daemons (8 GPUs each) hold mutual-TLS sessions with a
//! gateway process; a placer runs here and a binder in a process of its own.
//! Reservations of 1 to 8 GPUs are offered at 50/s, each released after a
//! random 2 to 20 s (a fifth instead expire by TTL). Meanwhile, on a fixed
//! schedule: 10 daemons are killed (their tasks dropped: the session breaks
//! with no goodbye), one node is revoked, one is drained, PostgreSQL is
//! crashed (SIGQUIT, crash recovery on restart), the binder process is
//! SIGKILLed and a new one started, and the killed daemons come back.
//!
//! Then, from the log and from the nodes' own disks:
//! - `placed_on_unschedulable`: placements the log's own check finds on a
//!   node that was not schedulable at that position (target 0);
//! - `active_after_release`: activations committed after their reservation's
//!   terminal fact (target 0);
//! - `bindings_leaked`: bindings on a live node's disk whose reservation is
//!   no longer live (target 0), and `bindings_missing`, active reservations
//!   a node does not hold;
//! - `stranded_placed`: reservations still placed, neither active nor ended,
//!   a minute after their placement (target 0);
//! - the recovery after the PostgreSQL restart: seconds to the next
//!   placement and the next activation (target < 5 s);
//! - place-to-active p99 over the whole run, against the same figure in the
//!   calm seconds before the first fault (the baseline of this run).
//!
//! Everything (daemons, gateway, placer, binder, load generator and
//! PostgreSQL) shares this machine's cores.

use crate::gateway::{now_ms, provision, setup, wait_for_joins, GatewayProcess};
use crate::util::{self, percentile_ms, round};
use anyhow::{Context, Result};
use domain::{Fact, Request, Shape};
use events::{Appender, AppenderConfig, Reader, ReaderConfig, Start};
use node::daemon::{self, DaemonConfig, DaemonStats};
use node::gpu::FakeGpus;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value_t = 1_000)]
    nodes: u32,
    /// Reservations per second offered
    #[arg(long, default_value_t = 50)]
    rate: u32,
    /// A short run: 200 nodes and half the schedule (45 s of load)
    #[arg(long)]
    quick: bool,
}

/// The hidden `binder-server` subcommand: a binder in its own process, so
/// that it can be SIGKILLed.
#[derive(clap::Args, Debug)]
pub struct BinderArgs {
    #[arg(long)]
    database_url: String,
}

pub async fn binder_server(args: BinderArgs) -> Result<()> {
    let cfg: tokio_postgres::Config = args.database_url.parse()?;
    let mut rc = ReaderConfig::new(format!("bench_binder_{}", std::process::id()));
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let binder = binder::Binder::start(cfg, reader, appender);
    println!("binding");
    tokio::signal::ctrl_c().await?;
    binder.stop().await?;
    Ok(())
}

fn binder_process(url: &str) -> Result<tokio::process::Child> {
    tokio::process::Command::new(std::env::current_exe()?)
        .args(["binder-server", "--database-url", url])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("start the binder process")
}

/// One simulated daemon, killable on its own.
struct Daemon {
    config: DaemonConfig,
    task: tokio::task::JoinHandle<Result<(), daemon::DaemonError>>,
    _stop: tokio::sync::watch::Sender<bool>,
}

fn start_daemon(id: &str, gateway: &str, dir: &Path, stats: &Arc<DaemonStats>) -> Daemon {
    let backend = Arc::new(FakeGpus::parse("8xH100-80GB", id).expect("spec"));
    let mut c = DaemonConfig::new(vec![gateway.to_string()], dir.join(id), id, backend);
    c.health_poll = Duration::from_secs(60);
    restart_daemon(c, stats)
}

fn restart_daemon(config: DaemonConfig, stats: &Arc<DaemonStats>) -> Daemon {
    let (stop, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(daemon::run(config.clone(), stats.clone(), rx));
    Daemon {
        config,
        task,
        _stop: stop,
    }
}

#[derive(Default)]
struct Seen {
    placed: HashMap<String, Instant>,
    active: HashMap<String, Instant>,
    /// Placements and activations seen after PostgreSQL came back.
    first_placed_after: Option<Instant>,
    first_active_after: Option<Instant>,
    restarted: Option<Instant>,
}

pub async fn run(args: Args) -> Result<()> {
    let nodes = if args.quick {
        args.nodes.min(200)
    } else {
        args.nodes
    };
    // The schedule, in seconds from the start of the load.
    let scale = if args.quick { 0.5 } else { 1.0 };
    let at = |s: f64| Duration::from_secs_f64(s * scale);
    let load_for = at(90.0);
    let (mut cluster, cfg, client, url, dir) = setup("life").await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    let nodes_dir = dir.path().join("nodes");
    let ids = provision(&client, &dir.path().join("ca"), &nodes_dir, "life", nodes).await?;
    let gw = GatewayProcess::start(&url, &dir.path().join("ca"), "2s").await?;
    let stats = Arc::new(DaemonStats::default());
    let mut daemons: Vec<Daemon> = ids
        .iter()
        .map(|id| start_daemon(id, &gw.addr, &nodes_dir, &stats))
        .collect();
    let joined = wait_for_joins(&client, "life", nodes).await?;
    eprintln!(
        "{nodes} nodes in the pool after {:.1} s",
        joined.as_secs_f64()
    );

    let mut rc = ReaderConfig::new("bench_lifecycle");
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let mut pc = placer::PlacerConfig::new("life");
    pc.node_lost_after = Duration::from_secs(10);
    let placer = placer::Placer::start(cfg.clone(), reader.clone(), appender.clone(), pc);
    let mut binder = binder_process(&url)?;
    while placer.stats().view().pools_held < 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let watcher = {
        let seen = seen.clone();
        let mut sub = reader.subscribe_ephemeral(Start::Now).await?;
        tokio::spawn(async move {
            while let Ok(e) = sub.next().await {
                sub.ack(e.position);
                let Ok(Some(f)) = Fact::parse(&e.event_type, &e.payload, &e.metadata) else {
                    continue;
                };
                let now = Instant::now();
                let mut s = seen.lock().expect("seen lock");
                let after = s.restarted.is_some();
                match f {
                    Fact::ReservationPlaced { reservation, .. } => {
                        s.placed.entry(reservation).or_insert(now);
                        if after {
                            s.first_placed_after.get_or_insert(now);
                        }
                    }
                    Fact::ReservationActivated { reservation } => {
                        s.active.entry(reservation).or_insert(now);
                        if after {
                            s.first_active_after.get_or_insert(now);
                        }
                    }
                    _ => {}
                }
            }
        })
    };

    // The load: one request every 1/rate s, each released after 2 to 20 s
    // (or, one in five, expiring by a TTL of 3 to 10 s).
    let start = Instant::now();
    let offered = (f64::from(args.rate) * load_for.as_secs_f64()) as u64;
    let load = {
        let (appender, cfg) = (appender.clone(), cfg.clone());
        let rate = f64::from(args.rate);
        tokio::spawn(async move {
            // Made again after PostgreSQL restarts.
            let db = events::db::SharedClient::new(cfg.clone());
            let mut releases = Vec::new();
            let mut refused = 0u64;
            for i in 0..offered {
                tokio::time::sleep_until((start + Duration::from_secs_f64(i as f64 / rate)).into())
                    .await;
                let ttl = fastrand::u8(0..5) == 0;
                let r = Request {
                    reservation: format!("life{i}"),
                    pool: "life".into(),
                    class: "H100-80GB".into(),
                    gpus: fastrand::u32(1..=8),
                    shape: Shape::Any,
                    priority: 0,
                    ttl_ms: ttl.then(|| fastrand::u64(3_000..10_000)),
                    replace_on_failure: true,
                    replaces: None,
                    topology: None,
                    requeue_on_preemption: false,
                    start_ms: None,
                    queue: None,
                };
                // PostgreSQL may be restarting: the request is retried, as
                // a client would.
                let mut tries = 0;
                loop {
                    let e = match db.get().await {
                        Ok(client) => {
                            match domain::requests::reserve(&client, &appender, &r, None).await {
                                Ok(()) => break,
                                Err(e) => e.to_string(),
                            }
                        }
                        Err(e) => e.to_string(),
                    };
                    tries += 1;
                    // Exists: an earlier try committed though its answer was
                    // lost.
                    if tries > 100 || e.contains("already exists") {
                        refused += u64::from(!e.contains("already exists"));
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                if !ttl {
                    let (appender, id) = (appender.clone(), r.reservation.clone());
                    releases.push(tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(fastrand::u64(2_000..20_000)))
                            .await;
                        for _ in 0..100 {
                            if domain::requests::release(&appender, &id, "done", None)
                                .await
                                .is_ok()
                            {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }));
                }
            }
            for r in releases {
                let _ = r.await;
            }
            anyhow::Ok(refused)
        })
    };

    // The faults.
    let mut faults = Vec::new();
    let mut note = |what: String| {
        eprintln!("{:>6.1} s  {what}", start.elapsed().as_secs_f64());
        faults.push(
            serde_json::json!({ "at_s": round(start.elapsed().as_secs_f64(), 1), "fault": what }),
        );
    };
    tokio::time::sleep_until((start + at(10.0)).into()).await;
    let killed: Vec<usize> = (0..daemons.len())
        .step_by(daemons.len() / 10)
        .take(10)
        .collect();
    for &i in &killed {
        daemons[i].task.abort();
    }
    note(format!("killed {} daemons", killed.len()));
    tokio::time::sleep_until((start + at(20.0)).into()).await;
    let revoked = ids[1].clone();
    let mut admin = events::db::connect(&cfg, "bench-admin").await?;
    gateway::identity::revoke(&mut admin, &revoked, "bench").await?;
    note(format!("revoked {revoked}"));
    tokio::time::sleep_until((start + at(25.0)).into()).await;
    let drained = ids[2].clone();
    domain::standing::change(
        &admin,
        &appender,
        Some("life"),
        &drained,
        &domain::standing::Change::Drain {
            reason: "bench".into(),
            wait: None,
        },
        None,
    )
    .await?;
    note(format!("drained {drained}"));
    tokio::time::sleep_until((start + at(35.0)).into()).await;
    tokio::task::block_in_place(|| {
        cluster.crash();
        cluster.restart()
    })?;
    seen.lock().expect("seen lock").restarted = Some(Instant::now());
    note("PostgreSQL crashed and restarted".into());
    tokio::time::sleep_until((start + at(50.0)).into()).await;
    binder.kill().await?;
    binder = binder_process(&url)?;
    note("SIGKILLed the binder process; started another".into());
    tokio::time::sleep_until((start + at(60.0)).into()).await;
    for &i in &killed {
        let config = daemons[i].config.clone();
        daemons[i] = restart_daemon(config, &stats);
    }
    note(format!("the {} killed daemons came back", killed.len()));
    let refused = load.await??;
    note("load ended".into());

    // Settle: a minute for whatever is still placed to become active or end.
    let settle = if args.quick { 40 } else { 60 };
    tokio::time::sleep(Duration::from_secs(settle)).await;
    let roles_alive = serde_json::json!({
        "placer": !placer.is_finished(),
        "binder": binder.try_wait()?.is_none(),
    });

    // Judged from the log and from the nodes' disks.
    let client = events::db::connect(&cfg, "bench-judge").await?;
    let mut index = projections::Index::new();
    let mut placed_on_unschedulable = 0u64;
    let mut violations = Vec::new();
    projections::projector::catch_up(
        &client,
        &mut index,
        |v| {
            if v.message.contains("not schedulable") {
                placed_on_unschedulable += 1;
            }
            if violations.len() < 10 {
                violations.push(v.to_string());
            }
            true
        },
        |_| {},
    )
    .await?;
    let active_after_release: i64 = client
        .query_one(
            "SELECT count(*) FROM strata.events a JOIN strata.events e
                ON e.type IN ('reservation.released', 'reservation.expired', 'reservation.failed')
               AND e.payload->>'reservation' = substr(a.stream, 13)
             WHERE a.type = 'reservation.activated' AND a.position > e.position",
            &[],
        )
        .await?
        .get(0);
    let live: HashMap<&str, &projections::index::Reservation> = index
        .state()
        .reservations
        .values()
        .filter(|r| r.phase.is_live())
        .map(|r| (r.request.reservation.as_str(), r))
        .collect();
    let (mut leaked, mut missing) = (0u64, 0u64);
    for id in ids.iter().filter(|id| **id != revoked) {
        let bound = node::allocation::bound_reservations(&nodes_dir.join(id));
        leaked += bound
            .iter()
            .filter(|r| !live.contains_key(r.as_str()))
            .count() as u64;
        missing += live
            .values()
            .filter(|r| {
                r.phase == projections::Phase::Active
                    && r.allocations.iter().any(|a| a.node == *id)
                    && !bound.contains(&r.request.reservation)
            })
            .count() as u64;
    }
    let now = now_ms();
    let stranded = index
        .state()
        .reservations
        .values()
        .filter(|r| {
            r.phase == projections::Phase::Placed
                && r.placed_at_ms
                    .is_some_and(|p| now.saturating_sub(p) > 60_000)
        })
        .count();
    let counts: HashMap<String, i64> = client
        .query(
            "SELECT type, count(*) FROM strata.events WHERE type LIKE 'reservation.%' GROUP BY type",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let failed_by: Vec<(String, i64)> = client
        .query(
            "SELECT payload->>'reason', count(*) FROM strata.events WHERE type = 'reservation.failed' GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    let (p50, p99, calm99, to_placement, to_activation) = {
        let s = seen.lock().expect("seen lock");
        let restarted = s.restarted.context("the restart was recorded")?;
        let since =
            |t: Option<Instant>| t.map(|t| round(t.duration_since(restarted).as_secs_f64(), 2));
        let first_fault = start + at(10.0);
        let (mut all, mut calm) = (Vec::new(), Vec::new());
        for (id, placed) in &s.placed {
            if let Some(active) = s.active.get(id) {
                let d = active.saturating_duration_since(*placed);
                all.push(d);
                if *active < first_fault {
                    calm.push(d);
                }
            }
        }
        let (p50, p99, calm99) = (
            percentile_ms(&mut all, 0.5),
            percentile_ms(&mut all, 0.99),
            percentile_ms(&mut calm, 0.99),
        );
        (
            p50,
            p99,
            calm99,
            since(s.first_placed_after),
            since(s.first_active_after),
        )
    };
    watcher.abort();
    placer.stop().await?;
    let _ = binder.kill().await;
    for d in daemons {
        d.task.abort();
    }
    gw.stop().await;
    let recovered = |v: Option<f64>| v.is_some_and(|s| s < 5.0);
    let result = serde_json::json!({
        "bench": "lifecycle",
        "quick": args.quick,
        "machine": util::machine(&pg_version),
        "nodes": nodes,
        "offered_per_s": args.rate,
        "offered": offered,
        "requests_refused": refused,
        "faults": faults,
        "events": counts,
        "failed_by_reason": failed_by,
        "placed_on_unschedulable": placed_on_unschedulable,
        "check_violations": violations,
        "active_after_release": active_after_release,
        "bindings_leaked": leaked,
        "bindings_missing": missing,
        "stranded_placed": stranded,
        "recovery_to_placement_s": to_placement,
        "recovery_to_activation_s": to_activation,
        "place_to_active_p50_ms": round(p50, 2),
        "place_to_active_p99_ms": round(p99, 2),
        "place_to_active_calm_p99_ms": round(calm99, 2),
        "p99_through_faults_over_calm": round(if calm99 > 0.0 { p99 / calm99 } else { 0.0 }, 2),
        "roles_alive": roles_alive,
        "targets": {
            "placed_on_unschedulable": 0, "active_after_release": 0, "bindings_leaked": 0,
            "stranded_placed": 0, "recovery_s": "< 5",
        },
        "met": {
            "placed_on_unschedulable": placed_on_unschedulable == 0,
            "active_after_release": active_after_release == 0,
            "bindings_leaked": leaked == 0,
            "stranded_placed": stranded == 0,
            "recovery_s": recovered(to_placement) && recovered(to_activation),
        },
        "note": "the gateway and the binder run in processes of their own; daemons, placer, load generator and PostgreSQL share the same cores with them",
    });
    let name = if args.quick {
        "lifecycle-quick"
    } else {
        "lifecycle"
    };
    util::finish(name, &result)?;
    drop(cluster);
    Ok(())
}
