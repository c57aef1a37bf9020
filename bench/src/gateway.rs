//! `bench gateway` and `bench spine`: node sessions through one gateway
//! running in its own process, and reservations from request to active.
//!
//! `gateway`: N simulated daemons in this process (one mutual-TLS connection
//! and certificate each, 10 s heartbeats) connect to one gateway process;
//! then 100 commands/s go to random nodes. Reports the ramp time, dispatch
//! latency (`command.issued` committed to the node receiving it), ack latency
//! (committed to the first of `command.acked` and the outcome seen by a
//! subscription: an outcome that follows at once is written without an
//! ack), drops, and the
//! gateway process's RSS and CPU over time. Baseline in the same run: the
//! log's own commit-to-subscription lag for the same `command.issued`
//! events, the floor under any dispatch.
//!
//! Then (`hostile.rs`) joins through the Join service with real tokens at
//! the default join rate (baseline: a gateway with no join limit), and the
//! gateway's RSS, CPU and a fresh handshake's latency with its sessions plus
//! 10,000 idle and half-open connections (baseline: the same just before).
//!
//! `spine`: 1,000 daemons, the gateway process, a placer and a binder;
//! 1-GPU reservations at 50/s. Reports requested-to-active p50/p99, against
//! requested-to-placed in the same run.

use crate::util::{self, percentile_ms, round};
use anyhow::{bail, Context, Result};
use domain::commands::{self, Command};
use domain::{Fact, Request, Shape};
use events::{Appender, AppenderConfig, Reader, ReaderConfig, Start};
use node::daemon::{self, DaemonConfig, DaemonStats};
use node::gpu::FakeGpus;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args, Debug)]
pub struct GatewayArgs {
    /// Sessions (simulated daemons)
    #[arg(long, default_value_t = 10_000)]
    sessions: u32,
    /// A short run: 10 s of commands instead of 30
    #[arg(long)]
    quick: bool,
    /// Commands per second offered
    #[arg(long, default_value_t = 100)]
    commands_per_s: u32,
}

#[derive(clap::Args, Debug)]
pub struct SpineArgs {
    #[arg(long, default_value_t = 1_000)]
    nodes: u32,
    /// Placements per second offered
    #[arg(long, default_value_t = 50)]
    rate: u32,
    /// A short run: 10 s instead of 30
    #[arg(long)]
    quick: bool,
}

/// The hidden `gateway-server` subcommand: the gateway in its own process.
#[derive(clap::Args, Debug)]
pub struct ServerArgs {
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    ca_dir: PathBuf,
    #[arg(long)]
    listen: std::net::SocketAddr,
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    heartbeat: Duration,
    /// Joins admitted per second (the gateway's default when not given)
    #[arg(long)]
    joins_per_second: Option<f64>,
    /// The gateway's id: two gateways running at once need two (the second
    /// would take the first one's lease and end its sessions)
    #[arg(long, default_value = "bench-gw")]
    id: String,
}

pub async fn server(args: ServerArgs) -> Result<()> {
    let cfg: tokio_postgres::Config = args.database_url.parse()?;
    let mut rc = ReaderConfig::new(format!("bench_gateway_server_{}", std::process::id()));
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let mut gc = gateway::server::GatewayConfig::new(&args.id, args.listen, &args.ca_dir);
    gc.heartbeat = args.heartbeat;
    gc.max_streams = 100_000;
    gc.handshakes_per_second = 5_000.0;
    gc.max_pending_hellos = 5_000;
    if let Some(j) = args.joins_per_second {
        gc.joins_per_second = j;
    }
    let gw = gateway::server::start(cfg, reader, appender, gc).await?;
    println!("listening {}", gw.addr);
    tokio::signal::ctrl_c().await?;
    let l = &gw.listener;
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "gateway listener: {}",
        serde_json::json!({
            "accepted": n(&l.accepted),
            "handshakes": n(&l.handshakes),
            "held_back": n(&l.handshakes_held_back),
            "held_back_unread": n(&l.hellos_unread),
            "by_token": n(&l.handshakes_by_token),
            "unauthenticated_refused": n(&l.unauthenticated_refused),
            "unauthenticated_evicted": n(&l.unauthenticated_evicted),
            "requests_cut": n(&l.requests_cut),
        })
    );
    gw.stop().await?;
    Ok(())
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A gateway child process and what is sampled of it.
pub(crate) struct GatewayProcess {
    child: tokio::process::Child,
    pid: u32,
    pub(crate) addr: String,
}

impl GatewayProcess {
    pub(crate) async fn start(url: &str, ca: &Path, heartbeat: &str) -> Result<GatewayProcess> {
        Self::start_with(url, ca, heartbeat, &[]).await
    }

    /// The same with more of `gateway-server`'s arguments.
    pub(crate) async fn start_with(
        url: &str,
        ca: &Path,
        heartbeat: &str,
        extra: &[&str],
    ) -> Result<GatewayProcess> {
        use tokio::io::AsyncBufReadExt;
        let exe = std::env::current_exe()?;
        // `BENCH_GATEWAY_WRAP=heaptrack` runs the gateway under a profiler
        // (with a bench built `--features system-alloc`); RSS and CPU are
        // then the wrapper's.
        let mut command = match std::env::var_os("BENCH_GATEWAY_WRAP") {
            Some(wrapper) => {
                let mut c = tokio::process::Command::new(wrapper);
                c.arg(exe);
                c
            }
            None => tokio::process::Command::new(exe),
        };
        let mut child = command
            .args([
                "gateway-server",
                "--database-url",
                url,
                "--listen",
                "127.0.0.1:0",
                "--heartbeat",
                heartbeat,
            ])
            .arg("--ca-dir")
            .arg(ca)
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true)
            .envs(std::env::vars().filter(|(k, _)| k.starts_with("MIMALLOC_")))
            .spawn()
            .context("start the gateway process")?;
        let pid = child.id().context("gateway pid")?;
        let mut lines = tokio::io::BufReader::new(child.stdout.take().context("stdout")?).lines();
        // A wrapper may print lines of its own first.
        let addr = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let line = lines.next_line().await?.context("the gateway exited")?;
                if let Some(addr) = line.strip_prefix("listening ") {
                    return anyhow::Ok(addr.to_string());
                }
            }
        })
        .await
        .context("the gateway did not start")??;
        Ok(GatewayProcess {
            child,
            pid,
            addr: format!("https://{addr}"),
        })
    }

    fn rss_mib(&self) -> f64 {
        rss_of(self.pid)
    }

    /// CPU seconds used so far (user + system).
    fn cpu_s(&self) -> f64 {
        util::cpu_seconds(self.pid)
    }

    pub(crate) async fn stop(mut self) {
        let _ = tokio::process::Command::new("kill")
            .args(["-INT", &self.pid.to_string()])
            .status()
            .await;
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// A process's resident memory in MiB (0 when it is gone).
pub(crate) fn rss_of(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Provisions `n` nodes (keys, certificates recorded in the database) under
/// `dir` and returns their ids.
pub(crate) async fn provision(
    client: &tokio_postgres::Client,
    ca_dir: &Path,
    dir: &Path,
    pool: &str,
    n: u32,
) -> Result<Vec<String>> {
    let ca = gateway::ca::Ca::load(ca_dir)?;
    let mut ids = Vec::with_capacity(n as usize);
    let mut batch = Vec::new();
    for i in 0..n {
        let node = format!("bn{i:05}");
        let (signed, key) = ca.issue_node(&node, 2)?;
        let d = dir.join(&node);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join("node.pem"), &signed.certificate_pem)?;
        std::fs::write(d.join("node.key"), key)?;
        std::fs::write(d.join("ca.pem"), ca.cert_pem())?;
        std::fs::write(d.join("pool"), pool)?;
        batch.push((node.clone(), signed));
        ids.push(node);
        if batch.len() == 1000 {
            gateway::identity::record(client, pool, &batch).await?;
            batch.clear();
        }
    }
    if !batch.is_empty() {
        gateway::identity::record(client, pool, &batch).await?;
    }
    Ok(ids)
}

type Seen = Arc<Mutex<HashMap<String, Instant>>>;

/// Running daemons: their shared counters, the stop switch, their tasks.
type Daemons = (
    Arc<DaemonStats>,
    tokio::sync::watch::Sender<bool>,
    Vec<tokio::task::JoinHandle<Result<(), daemon::DaemonError>>>,
);

fn start_daemons(ids: &[String], gateway: &str, dir: &Path, hook_seen: Seen) -> Daemons {
    let stats = Arc::new(DaemonStats::default());
    let (stop, rx) = tokio::sync::watch::channel(false);
    let hook: Arc<dyn Fn(&str) + Send + Sync> = Arc::new(move |id: &str| {
        hook_seen
            .lock()
            .expect("seen lock")
            .entry(id.to_string())
            .or_insert_with(Instant::now);
    });
    let mut tasks = Vec::with_capacity(ids.len());
    // One clock for the process's daemons, as a real node has one.
    let clock = ops::process_clock::ProcessClock::new(node::daemon::ANSWER_SLACK);
    for id in ids {
        let backend = Arc::new(FakeGpus::parse("8xH100-80GB", id).expect("spec"));
        let mut c = DaemonConfig::new(
            vec![gateway.to_string()],
            dir.join(id),
            id.as_str(),
            backend,
        );
        c.health_poll = Duration::from_secs(60);
        c.on_command = Some(hook.clone());
        c.clock = clock.clone();
        tasks.push(tokio::spawn(daemon::run(c, stats.clone(), rx.clone())));
    }
    (stats, stop, tasks)
}

pub(crate) async fn setup(
    pool: &str,
) -> Result<(
    schema::Cluster,
    tokio_postgres::Config,
    tokio_postgres::Client,
    String,
    tempfile::TempDir,
)> {
    eprintln!("starting a private PostgreSQL (fsync on) ...");
    let cluster = tokio::task::spawn_blocking(util::cluster).await??;
    let cfg = util::database(&cluster, "bench").await?;
    let client = events::db::connect(&cfg, "bench").await?;
    let url = cluster.url("bench");
    let dir = tempfile::tempdir()?;
    gateway::ca::init(&dir.path().join("ca"), "bench")?;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    domain::pools::create_pool(&appender, pool, "benchmark pool").await?;
    Ok((cluster, cfg, client, url, dir))
}

/// Waits until `nodes` nodes have joined `pool` (their inventory is in the
/// log), five minutes at most; how long it took.
pub(crate) async fn wait_for_joins(
    client: &tokio_postgres::Client,
    pool: &str,
    nodes: u32,
) -> Result<Duration> {
    let t = Instant::now();
    loop {
        let joined: i64 = client
            .query_one(
                "SELECT count(*) FROM strata.events WHERE stream = $1 AND type = 'node.joined'",
                &[&domain::pool_stream(pool)],
            )
            .await?
            .get(0);
        if joined >= i64::from(nodes) {
            return Ok(t.elapsed());
        }
        if t.elapsed() > Duration::from_secs(300) {
            bail!("only {joined} of {nodes} nodes joined pool {pool}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

pub async fn run_gateway(args: GatewayArgs) -> Result<()> {
    let (cluster, cfg, client, url, dir) = setup("gw").await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    let t = Instant::now();
    let ids = provision(
        &client,
        &dir.path().join("ca"),
        &dir.path().join("nodes"),
        "gw",
        args.sessions,
    )
    .await?;
    eprintln!(
        "provisioned {} nodes in {:.1} s",
        ids.len(),
        t.elapsed().as_secs_f64()
    );
    let gw = GatewayProcess::start(&url, &dir.path().join("ca"), "10s").await?;
    let rss_idle = gw.rss_mib();
    let ca_path = dir.path().join("ca").join("ca.pem");
    let ca_pem = std::fs::read_to_string(&ca_path)?;

    // Joins with real one-time tokens, at the gateway's default join rate;
    // the baseline: the same through a gateway with no join limit.
    let n_joins = if args.quick { 1_000 } else { args.sessions };
    eprintln!("joins: {n_joins} new nodes with one-time tokens at the default join rate ...");
    let limited =
        crate::hostile::joins(&client, &gw.addr, &ca_pem, "gw", "jn", n_joins, 64).await?;
    let free = GatewayProcess::start_with(
        &url,
        &dir.path().join("ca"),
        "10s",
        &[
            "--joins-per-second",
            "1000000",
            "--id",
            "bench-gw-unlimited",
        ],
    )
    .await?;
    let n_free = if args.quick { 500 } else { 3_000 };
    let unlimited =
        crate::hostile::joins(&client, &free.addr, &ca_pem, "gw", "ju", n_free, 64).await?;
    free.stop().await;
    eprintln!(
        "joins: {:.0}/s at the default limit ({} pushbacks waited out), {:.0}/s with none",
        limited.per_s, limited.pushbacks, unlimited.per_s
    );

    // Ramp: every daemon connects.
    let received: Seen = Arc::default();
    let t0 = Instant::now();
    let (stats, stop, tasks) =
        start_daemons(&ids, &gw.addr, &dir.path().join("nodes"), received.clone());
    let mut rss = Vec::new();
    let cpu0 = gw.cpu_s();
    loop {
        let c = stats.connected.load(Ordering::Relaxed);
        rss.push(gw.rss_mib());
        if c >= args.sessions as u64 {
            break;
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("only {c} of {} sessions after 10 minutes", args.sessions);
        }
        let ended = tasks.iter().filter(|t| t.is_finished()).count();
        if ended > 0 {
            let mut errors = Vec::new();
            for t in tasks {
                if t.is_finished() {
                    errors.push(format!("{:?}", t.await));
                }
            }
            bail!(
                "{ended} daemons stopped: {:?}",
                &errors[..errors.len().min(3)]
            );
        }
        if t0.elapsed().as_secs().is_multiple_of(10) {
            eprintln!(
                "  ramp: {c} connected ({} connections made, {} sessions opened, {} pushbacks), gateway RSS {:.0} MiB",
                stats.connects.load(Ordering::Relaxed),
                stats.sessions.load(Ordering::Relaxed),
                stats.pushbacks.load(Ordering::Relaxed),
                rss.last().copied().unwrap_or(0.0)
            );
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
    let ramp_s = t0.elapsed().as_secs_f64();
    let ramp_cpu = gw.cpu_s() - cpu0;
    // The daemons' side: connections made and reused after a pushback,
    // pushbacks, sessions.
    let ramp_daemons = util::Tries::all(&stats);
    eprintln!(
        "ramp: {} sessions in {ramp_s:.1} s (gateway CPU {ramp_cpu:.1} s), RSS {:.0} MiB; daemons {ramp_daemons}",
        args.sessions,
        gw.rss_mib(),
    );

    // Commands at a fixed rate to random nodes; a subscription watches the
    // log for the issued (baseline) and acked (or finished) events.
    let mut rc = ReaderConfig::new("bench_gateway_watch");
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let mut sub = reader.subscribe_ephemeral(Start::Now).await?;
    let logged: Seen = Arc::default();
    let acked: Seen = Arc::default();
    let (l2, a2) = (logged.clone(), acked.clone());
    let watcher = tokio::spawn(async move {
        while let Ok(e) = sub.next().await {
            sub.ack(e.position);
            let Some(id) = e.stream.strip_prefix("command/") else {
                continue;
            };
            let map = match domain::canonical_type(&e.event_type) {
                commands::ISSUED => &l2,
                commands::ACKED | commands::SUCCEEDED | commands::FAILED => &a2,
                _ => continue,
            };
            map.lock()
                .expect("lock")
                .entry(id.to_string())
                .or_insert_with(Instant::now);
        }
    });
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let secs = if args.quick { 10 } else { 30 };
    let n = args.commands_per_s as u64 * secs;
    let committed: Seen = Arc::default();
    let cpu1 = gw.cpu_s();
    let t1 = Instant::now();
    let mut issuing = Vec::new();
    let mut next_sample = Instant::now();
    for i in 0..n {
        tokio::time::sleep_until(
            (t1 + Duration::from_secs_f64(i as f64 / args.commands_per_s as f64)).into(),
        )
        .await;
        if Instant::now() >= next_sample {
            rss.push(gw.rss_mib());
            next_sample += Duration::from_secs(1);
        }
        let node = ids[fastrand::usize(..ids.len())].clone();
        let c = Command {
            id: format!("bc{i}"),
            node,
            kind: "diag.nvml".into(),
            args: serde_json::json!({}),
            deadline_ms: now_ms() + 60_000,
            issued_by: "cli:bench".into(),
        };
        let (appender, committed) = (appender.clone(), committed.clone());
        issuing.push(tokio::spawn(async move {
            commands::issue(&appender, &c).await?;
            committed.lock().expect("lock").insert(c.id, Instant::now());
            anyhow::Ok(())
        }));
    }
    for t in issuing {
        t.await??;
    }
    let offered_s = t1.elapsed().as_secs_f64();
    // Let the last ones arrive.
    let deadline = Instant::now() + Duration::from_secs(20);
    while received.lock().expect("lock").len() < n as usize && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cmd_cpu = gw.cpu_s() - cpu1;
    let cmd_wall = t1.elapsed().as_secs_f64();
    rss.push(gw.rss_mib());
    let (mut dispatch, mut ack, mut lag) = (Vec::new(), Vec::new(), Vec::new());
    let committed = committed.lock().expect("lock").clone();
    let (received, acked, logged) = (
        received.lock().expect("lock").clone(),
        acked.lock().expect("lock").clone(),
        logged.lock().expect("lock").clone(),
    );
    for (id, at) in &committed {
        if let Some(r) = received.get(id) {
            dispatch.push(r.saturating_duration_since(*at));
        }
        if let Some(a) = acked.get(id) {
            ack.push(a.saturating_duration_since(*at));
        }
        if let Some(l) = logged.get(id) {
            lag.push(l.saturating_duration_since(*at));
        }
    }
    let drops = n - dispatch.len() as u64;
    let (d50, d99) = (
        percentile_ms(&mut dispatch, 0.5),
        percentile_ms(&mut dispatch, 0.99),
    );
    let a99 = percentile_ms(&mut ack, 0.99);
    let (l50, l99) = (percentile_ms(&mut lag, 0.5), percentile_ms(&mut lag, 0.99));
    let rss_max = rss.iter().copied().fold(0.0, f64::max);
    let rss_end = gw.rss_mib();
    eprintln!(
        "commands: {n} at {}/s (offered in {offered_s:.1} s): dispatch p50 {d50:.2} ms p99 {d99:.2} ms; ack p99 {a99:.2} ms; log lag p50 {l50:.2} ms p99 {l99:.2} ms; drops {drops}",
        args.commands_per_s
    );
    eprintln!(
        "gateway: RSS idle {rss_idle:.0} MiB, max {rss_max:.0} MiB, end {rss_end:.0} MiB; CPU {:.0}% of one core while holding the sessions and dispatching",
        cmd_cpu / cmd_wall * 100.0
    );
    let reconnects = stats
        .sessions
        .load(Ordering::Relaxed)
        .saturating_sub(args.sessions as u64);

    // Hostile connections: 10,000 more (2,000 finish TLS and sit idle, the
    // rest never send a byte) while the gateway holds its sessions. The
    // baseline: the same gateway over the same time just before.
    let addr: std::net::SocketAddr = gw.addr.trim_start_matches("https://").parse()?;
    let flood_secs = if args.quick { 10 } else { 20 };
    let (probe_before, _) = crate::hostile::probe(addr, &ca_pem, 20, None).await?;
    let (cpu_b, tb) = (gw.cpu_s(), Instant::now());
    let mut rss_calm = Vec::new();
    while tb.elapsed() < Duration::from_secs(flood_secs) {
        rss_calm.push(gw.rss_mib());
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let calm_cpu = (gw.cpu_s() - cpu_b) / tb.elapsed().as_secs_f64();
    let sessions_before = stats.sessions.load(Ordering::Relaxed);
    eprintln!("flood: 10,000 idle and half-open connections for {flood_secs} s ...");
    let child = crate::hostile::spawn_flood(addr, &ca_path, 10_000, flood_secs + 5)?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (cpu_f, tf) = (gw.cpu_s(), Instant::now());
    let rss_sampler = {
        let pid = gw.pid;
        tokio::spawn(async move {
            let mut v = Vec::new();
            let until = Instant::now() + Duration::from_secs(flood_secs);
            while Instant::now() < until {
                v.push(crate::gateway::rss_of(pid));
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            v
        })
    };
    let (probe_during, probe_failures) = crate::hostile::probe(addr, &ca_pem, 20, None).await?;
    let rss_flood = rss_sampler.await?;
    let flood_cpu = (gw.cpu_s() - cpu_f) / tf.elapsed().as_secs_f64();
    let flood_out = child.wait_with_output().await?;
    let flood_report: serde_json::Value =
        serde_json::from_slice(&flood_out.stdout).unwrap_or(serde_json::Value::Null);
    let sessions_lost = stats
        .sessions
        .load(Ordering::Relaxed)
        .saturating_sub(sessions_before);
    let connected_after = stats.connected.load(Ordering::Relaxed);
    let (mut pb, mut pd) = (probe_before.clone(), probe_during.clone());
    let (pb50, pb99, pd50, pd99) = (
        percentile_ms(&mut pb, 0.5),
        percentile_ms(&mut pb, 0.99),
        percentile_ms(&mut pd, 0.5),
        percentile_ms(&mut pd, 0.99),
    );
    let rss_calm_max = rss_calm.iter().copied().fold(0.0, f64::max);
    let rss_flood_max = rss_flood.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "flood: gateway RSS {rss_calm_max:.0} -> {rss_flood_max:.0} MiB, CPU {:.0}% -> {:.0}% of a core; a new handshake p50 {pb50:.1} -> {pd50:.1} ms, p99 {pb99:.1} -> {pd99:.1} ms; {probe_failures} of 20 failed; sessions re-opened {sessions_lost}, connected {connected_after}; {flood_report}",
        calm_cpu * 100.0,
        flood_cpu * 100.0
    );
    let stalls = stalled_rpcs(&client, &gw.addr, addr, &ca_pem, &ca_path, args.quick).await?;
    let _ = stop.send(true);
    for t in tasks {
        let _ = t.await;
    }
    watcher.abort();
    gw.stop().await;
    let kib_per_session = (rss_end - rss_idle) * 1024.0 / f64::from(args.sessions);
    let flood = serde_json::json!({
        "connections": 10_000,
        "tls_idle": 2_000,
        "seconds": flood_secs,
        "rss_calm_mib": round(rss_calm_max, 1),
        "rss_flood_mib": round(rss_flood_max, 1),
        "rss_flood_over_calm": round(rss_flood_max / rss_calm_max.max(1e-9), 3),
        "cpu_calm_percent_of_one_core": round(calm_cpu * 100.0, 1),
        "cpu_flood_percent_of_one_core": round(flood_cpu * 100.0, 1),
        "handshake_p50_ms_before": round(pb50, 2),
        "handshake_p99_ms_before": round(pb99, 2),
        "handshake_p50_ms_during": round(pd50, 2),
        "handshake_p99_ms_during": round(pd99, 2),
        "handshake_p99_during_over_before": round(pd99 / pb99.max(1e-9), 2),
        "handshakes_failed_during": probe_failures,
        "sessions_reopened": sessions_lost,
        "connected_after": connected_after,
        "flood_process": flood_report,
    });
    let met = serde_json::json!({
        "rss_mib": rss_max < 512.0,
        "rss_kib_per_session": kib_per_session <= 30.0,
        "dispatch_p99_ms": d99 < 25.0,
        "drops": drops == 0,
    });
    let result = serde_json::json!({
        "bench": "gateway",
        "quick": args.quick,
        "machine": util::machine(&pg_version),
        "sessions": args.sessions,
        "ramp_s": round(ramp_s, 2),
        "ramp_gateway_cpu_s": round(ramp_cpu, 2),
        "ramp_daemons": ramp_daemons,
        "commands": n,
        "commands_per_s": args.commands_per_s,
        "dispatch_p50_ms": round(d50, 3),
        "dispatch_p99_ms": round(d99, 3),
        "ack_p99_ms": round(a99, 3),
        "log_lag_p50_ms": round(l50, 3),
        "log_lag_p99_ms": round(l99, 3),
        "dispatch_over_log_lag_p99": round(if l99 > 0.0 { d99 / l99 } else { 0.0 }, 2),
        "drops": drops,
        "reconnects": reconnects,
        "rss_mib": round(rss_max, 1),
        "rss_idle_mib": round(rss_idle, 1),
        "rss_end_mib": round(rss_end, 1),
        "rss_kib_per_session": round(kib_per_session, 1),
        "rss_samples_mib": rss.iter().map(|v| round(*v, 0)).collect::<Vec<_>>(),
        "gateway_cpu_percent_of_one_core": round(cmd_cpu / cmd_wall * 100.0, 1),
        "joins": {
            "nodes": limited.joins,
            "seconds": round(limited.secs, 1),
            "per_s_default_limit": round(limited.per_s, 1),
            "default_limit_per_s": 200,
            "pushbacks": limited.pushbacks,
            "baseline_nodes": unlimited.joins,
            "per_s_no_limit": round(unlimited.per_s, 1),
            "default_over_no_limit": round(limited.per_s / unlimited.per_s.max(1e-9), 3),
        },
        "stalls": stalls,
        "flood": flood,
        "targets": {"sessions": 10000, "rss_mib": "< 512", "rss_kib_per_session": "<= 30", "dispatch_p99_ms": "< 25", "drops": 0},
        "met": met,
        "note": "the gateway runs in its own process; the simulated daemons, the command issuer and PostgreSQL share the same two cores with it",
    });
    let name = if args.quick {
        format!("gateway-{}-quick", args.sessions)
    } else {
        format!("gateway-{}", args.sessions)
    };
    util::finish(&name, &result)?;
    drop(cluster);
    Ok(())
}

pub async fn run_spine(args: SpineArgs) -> Result<()> {
    let (cluster, cfg, client, url, dir) = setup("spine").await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    let ids = provision(
        &client,
        &dir.path().join("ca"),
        &dir.path().join("nodes"),
        "spine",
        args.nodes,
    )
    .await?;
    let gw = GatewayProcess::start(&url, &dir.path().join("ca"), "10s").await?;
    let (stats, stop, tasks) =
        start_daemons(&ids, &gw.addr, &dir.path().join("nodes"), Arc::default());
    // Every node's inventory in the pool.
    let joined = wait_for_joins(&client, "spine", args.nodes).await?;
    eprintln!(
        "{} nodes in the pool after {:.1} s ({} connected)",
        args.nodes,
        joined.as_secs_f64(),
        stats.connected.load(Ordering::Relaxed)
    );
    let mut rc = ReaderConfig::new("bench_spine");
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let placer = placer::Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        placer::PlacerConfig::new("spine"),
    );
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    let mut sub = reader.subscribe_ephemeral(Start::Now).await?;
    let placed: Seen = Arc::default();
    let active: Seen = Arc::default();
    let (p2, a2) = (placed.clone(), active.clone());
    let watcher = tokio::spawn(async move {
        while let Ok(e) = sub.next().await {
            sub.ack(e.position);
            let map = match domain::canonical_type(&e.event_type) {
                "reservation.placed" => &p2,
                "reservation.activated" => &a2,
                _ => continue,
            };
            if let Ok(Some(f)) = Fact::parse(&e.event_type, &e.payload, &e.metadata) {
                if let Some(id) = f.reservation() {
                    map.lock()
                        .expect("lock")
                        .entry(id.to_string())
                        .or_insert_with(Instant::now);
                }
            }
        }
    });
    while placer.stats().view().pools_held < 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = if args.quick { 10 } else { 30 };
    let n = args.rate as u64 * secs;
    let committed: Seen = Arc::default();
    let t1 = Instant::now();
    let mut reqs = Vec::new();
    for i in 0..n {
        tokio::time::sleep_until(
            (t1 + Duration::from_secs_f64(i as f64 / args.rate as f64)).into(),
        )
        .await;
        let r = Request {
            reservation: format!("sp{i}"),
            pool: "spine".into(),
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
        };
        let (appender, committed) = (appender.clone(), committed.clone());
        reqs.push(tokio::spawn(async move {
            appender
                .append(
                    &domain::reservation_stream(&r.reservation),
                    events::ExpectedVersion::NoStream,
                    vec![Fact::ReservationRequested(r.clone()).to_event()],
                )
                .await?;
            committed
                .lock()
                .expect("lock")
                .insert(r.reservation, Instant::now());
            anyhow::Ok(())
        }));
    }
    for r in reqs {
        r.await??;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while active.lock().expect("lock").len() < n as usize && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (committed, placed, active) = (
        committed.lock().expect("lock").clone(),
        placed.lock().expect("lock").clone(),
        active.lock().expect("lock").clone(),
    );
    let (mut to_placed, mut to_active) = (Vec::new(), Vec::new());
    for (id, at) in &committed {
        if let Some(p) = placed.get(id) {
            to_placed.push(p.saturating_duration_since(*at));
        }
        if let Some(a) = active.get(id) {
            to_active.push(a.saturating_duration_since(*at));
        }
    }
    let not_active = n - to_active.len() as u64;
    let (a50, a99) = (
        percentile_ms(&mut to_active, 0.5),
        percentile_ms(&mut to_active, 0.99),
    );
    let (p50, p99) = (
        percentile_ms(&mut to_placed, 0.5),
        percentile_ms(&mut to_placed, 0.99),
    );
    eprintln!("spine: {n} reservations at {}/s: requested -> placed p50 {p50:.2} ms p99 {p99:.2} ms; requested -> active p50 {a50:.2} ms p99 {a99:.2} ms; {not_active} not active", args.rate);
    let verdict = match projections::check::check(&client, |_| {}).await {
        Ok(r) => format!("ok: {} events, {} live", r.events, r.live),
        Err(e) => format!("violation: {e}"),
    };
    eprintln!("check: {verdict}");
    watcher.abort();
    binder.stop().await?;
    placer.stop().await?;
    let _ = stop.send(true);
    for t in tasks {
        let _ = t.await;
    }
    gw.stop().await;
    let result = serde_json::json!({
        "bench": "spine",
        "quick": args.quick,
        "machine": util::machine(&pg_version),
        "nodes": args.nodes,
        "offered_per_s": args.rate,
        "reservations": n,
        "place_to_active_p50_ms": round(a50, 3),
        "place_to_active_p99_ms": round(a99, 3),
        "requested_to_placed_p50_ms": round(p50, 3),
        "requested_to_placed_p99_ms": round(p99, 3),
        "active_over_placed_p99": round(if p99 > 0.0 { a99 / p99 } else { 0.0 }, 2),
        "not_active": not_active,
        "check": verdict,
        "targets": {"place_to_active_p99_ms": "< 250"},
        "met": {"place_to_active_p99_ms": a99 < 250.0 && not_active == 0},
        "note": "the gateway runs in its own process; daemons, placer, binder, load generator and PostgreSQL share the same two cores",
    });
    let name = if args.quick { "spine-quick" } else { "spine" };
    util::finish(name, &result)?;
    drop(cluster);
    Ok(())
}

/// 5,000 stalled Join RPCs and 1,000 joins a second with bad tokens (the
/// `gateway-stalls` child, from addresses of its own) while real nodes join
/// and new connections shake hands; against the same probes just before.
/// Handshakes are probed from 127.0.0.1, where the fleet's daemons connect
/// from (an address the gateway has seen present a certificate), and from
/// addresses it has never seen (127.7.x), as a new node's; joins from new
/// addresses, retrying as a daemon does. Target: the real ones still
/// served, p99 under 5x calm.
async fn stalled_rpcs(
    client: &tokio_postgres::Client,
    url: &str,
    addr: std::net::SocketAddr,
    ca_pem: &str,
    ca_path: &std::path::Path,
    quick: bool,
) -> Result<serde_json::Value> {
    use crate::hostile::{join_probe, probe};
    let secs = if quick { 15 } else { 30 };
    let stranger = |net: u8| Some(std::net::IpAddr::from([127, 7, net, 1]));
    let (mut hs_calm, _) = probe(addr, ca_pem, 20, None).await?;
    let (mut new_calm, _) = probe(addr, ca_pem, 20, stranger(0)).await?;
    let within = Duration::from_secs(secs - 7);
    let mut joins_calm = join_probe(client, url, ca_pem, "sc", 5, 20, within).await?;
    eprintln!("stalls: 5,000 stalled Join RPCs and 1,000 bad joins/s for {secs} s ...");
    let child = crate::stalls::spawn(addr, ca_path, 5_000, 1_000.0, secs)?;
    let flood_end = Instant::now() + Duration::from_secs(secs);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (mut hs_during, hs_failed) = probe(addr, ca_pem, 20, None).await?;
    let (mut new_during, new_failed) = probe(addr, ca_pem, 20, stranger(1)).await?;
    // The joins must be done while the flood still runs.
    let within = flood_end.saturating_duration_since(Instant::now() + Duration::from_secs(1));
    let mut joins_during = join_probe(client, url, ca_pem, "sd", 6, 20, within).await?;
    let out = child.wait_with_output().await?;
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    let p99 = |v: &mut Vec<Duration>| percentile_ms(v, 0.99);
    let (hc, hd, nc, nd) = (
        p99(&mut hs_calm),
        p99(&mut hs_during),
        p99(&mut new_calm),
        p99(&mut new_during),
    );
    let (jc, jd) = (p99(&mut joins_calm.joined), p99(&mut joins_during.joined));
    let ratio = |d: f64, c: f64| round(d / c.max(1e-9), 2);
    eprintln!(
        "stalls: handshake p99 {hc:.1} -> {hd:.1} ms ({hs_failed} of 20 failed), from new addresses {nc:.1} -> {nd:.1} ms ({new_failed} failed), real join p99 {jc:.1} -> {jd:.1} ms ({} of 20 failed, {} tries); {report}",
        joins_during.failed, joins_during.tries
    );
    let joins_failed = joins_during.failed;
    Ok(serde_json::json!({
        "seconds": secs,
        "handshake_p99_ms_calm": round(hc, 2),
        "handshake_p99_ms_during": round(hd, 2),
        "handshake_p99_during_over_calm": ratio(hd, hc),
        "handshakes_failed_during": hs_failed,
        "new_address_handshake_p99_ms_calm": round(nc, 2),
        "new_address_handshake_p99_ms_during": round(nd, 2),
        "new_address_handshakes_failed_during": new_failed,
        "join_p99_ms_calm": round(jc, 2),
        "join_p99_ms_during": round(jd, 2),
        "join_p99_during_over_calm": ratio(jd, jc),
        "joins_failed_during": joins_failed,
        "join_tries_calm": joins_calm.tries,
        "join_tries_during": joins_during.tries,
        "join_retried_because_during": joins_during.retried_because,
        "join_window_s_during": round(within.as_secs_f64(), 1),
        "note": "handshakes probed from 127.0.0.1, where the fleet's daemons connect from, and from addresses the gateway never saw; twenty nodes join at once, each from a new address, timed from a node's first try to its certificate, retries included, and failed if not joined within the window (during the flood: before it ends); the hostile process shares the two cores with the gateway and PostgreSQL",
        "target": "real joins and handshakes served, p99 during < 5x calm",
        "met": hs_failed == 0 && joins_failed == 0 && hd < 5.0 * hc && jd < 5.0 * jc,
        "hostile": report,
    }))
}
