//! `bench console`: the web console under watch. A pool of 10,000 nodes
//! (80,000 GPUs) is placed into at 1,000 reservations a second (a placer
//! here, each reservation 1 GPU for 2 s, so the pool never fills) while
//! 100 browsers' live streams (Server-Sent Events, `mode=events` on the
//! pool's placements, over TLS with a session cookie) watch it from a
//! console in a process of its own (`bench console-server`). Measured:
//!
//! - the delay from an event's commit (its `recorded_at`: the appending
//!   transaction's start, so a little more than from its commit) to its
//!   arrival in a client, p50 and p99 over every event every client got,
//!   against the same delay for one subscription on the log in this
//!   process (the baseline of the run: what the console adds is the ratio);
//! - the pool page's time (a GET of `/pools/<pool>` on an open
//!   connection, its handshake not counted), p50 and p99 of 20 during the
//!   load, against the region page (the baseline: a page with no per-node
//!   work);
//! - the pool page in Debian's headless Chromium after the load (its own
//!   CPU would otherwise take from everything above): its
//!   first contentful paint and the moment its canvas grid of every GPU is
//!   drawn (target: first paint within 1 s);
//! - the console process's CPU (cores) and peak RSS during the load.
//!
//! Everything (PostgreSQL, placer, load generator, console and its 100
//! clients) shares this machine's two cores.

use crate::util::{self, percentile_ms, round};
use anyhow::{bail, Context, Result};
use domain::{Fact, Request, Shape};
use events::{Appender, AppenderConfig, ExpectedVersion, Reader, ReaderConfig, Start};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio_rustls::rustls;

const POOL: &str = "watched";
const OPERATOR: &str = "watcher";

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value_t = 10_000)]
    nodes: u32,
    /// Reservations per second offered
    #[arg(long, default_value_t = 1_000)]
    rate: u32,
    /// Live streams watching
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// Seconds of load
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// A short run: 1,000 nodes, 20 clients, 10 s
    #[arg(long)]
    quick: bool,
}

/// The hidden `console-server` subcommand: the console in a process of its
/// own, so its CPU and memory are its own.
#[derive(clap::Args, Debug)]
pub struct ServerArgs {
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    ca_dir: std::path::PathBuf,
    #[arg(long)]
    listen: std::net::SocketAddr,
}

pub async fn server(args: ServerArgs) -> Result<()> {
    let cfg: tokio_postgres::Config = args.database_url.parse()?;
    let mut rc = ReaderConfig::new(format!("bench_console_{}", std::process::id()));
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let ca = gateway::ca::Ca::load(&args.ca_dir)?;
    let (cert, key) = ca.server_identity(&["localhost".into(), "127.0.0.1".into()])?;
    let cc = console::ConsoleConfig::new(args.listen, cert, key, ca.cert_pem().to_string());
    let c = console::start(cc, cfg.into(), reader, appender).await?;
    println!("serving {}", c.addr);
    tokio::signal::ctrl_c().await?;
    c.stop();
    Ok(())
}

/// A TLS connection to the console, trusting the region's CA.
async fn connect(
    tls: &tokio_rustls::TlsConnector,
    addr: std::net::SocketAddr,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    Ok(tls.connect(name, tcp).await?)
}

fn connector(ca_pem: &str) -> Result<tokio_rustls::TlsConnector> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// GETs `path` on a kept connection: the status line and the body's length.
async fn get<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut BufReader<S>,
    path: &str,
    cookie: &str,
) -> Result<(String, Vec<u8>)> {
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nCookie: {}={cookie}\r\n\r\n",
        console::auth::COOKIE
    );
    s.get_mut().write_all(req.as_bytes()).await?;
    let mut status = String::new();
    s.read_line(&mut status).await?;
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        s.read_line(&mut line).await?;
        if line.trim().is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    Ok((status.trim().to_string(), body))
}

/// One watching client: its delays (ms), pushed into `delays`.
async fn watch(
    tls: tokio_rustls::TlsConnector,
    addr: std::net::SocketAddr,
    cookie: String,
    delays: Arc<Mutex<Vec<f64>>>,
    stop: Arc<AtomicU64>,
) -> Result<u64> {
    let s = connect(&tls, addr).await?;
    let mut s = BufReader::new(s);
    let req = format!(
        "GET /live?mode=events&watch=pool/{POOL}&types=reservation.placed HTTP/1.1\r\nHost: localhost\r\nCookie: {}={cookie}\r\nAccept: text/event-stream\r\n\r\n",
        console::auth::COOKIE
    );
    s.get_mut().write_all(req.as_bytes()).await?;
    let mut line = String::new();
    let mut got = 0u64;
    let mut mine = Vec::new();
    while stop.load(Ordering::Relaxed) == 0 {
        line.clear();
        let n = match tokio::time::timeout(Duration::from_secs(1), s.read_line(&mut line)).await {
            Ok(r) => r?,
            Err(_) => continue,
        };
        if n == 0 {
            bail!("the console closed a live stream");
        }
        // Chunked framing: the SSE lines are inside the chunks; a data
        // line is the JSON array of events.
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        let Ok(serde_json::Value::Array(evs)) = serde_json::from_str::<serde_json::Value>(data)
        else {
            continue;
        };
        let now = projections::usage::unix_ms(SystemTime::now()) as f64;
        for e in evs {
            if let Some(at) = e.get("at_ms").and_then(|v| v.as_f64()) {
                mine.push(now - at);
                got += 1;
            }
        }
    }
    delays.lock().expect("delays").extend(mine);
    Ok(got)
}

/// Offers `rate` reservations a second for `secs` seconds.
async fn offer(appender: Appender, rate: u32, secs: u64) -> u64 {
    let start = Instant::now();
    let total = u64::from(rate) * secs;
    let mut sent = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while sent < total {
        tick.tick().await;
        let due = ((start.elapsed().as_secs_f64() * f64::from(rate)) as u64).min(total);
        let mut batch = Vec::new();
        while sent < due {
            let r = Request {
                reservation: format!("w{sent}"),
                pool: POOL.into(),
                class: "H100-80GB".into(),
                gpus: 1,
                shape: Shape::Any,
                priority: 0,
                ttl_ms: Some(2_000),
                replace_on_failure: false,
                replaces: None,
                topology: None,
                requeue_on_preemption: false,
                start_ms: None,
                queue: None,
            };
            let a = appender.clone();
            batch.push(async move {
                let _ = a
                    .append(
                        &domain::reservation_stream(&r.reservation),
                        ExpectedVersion::NoStream,
                        vec![Fact::ReservationRequested(r).to_event()],
                    )
                    .await;
            });
            sent += 1;
        }
        futures_util::future::join_all(batch).await;
    }
    sent
}

/// In Debian's headless Chromium, signed in with `cookie`: the pool
/// page's first contentful paint and the moment its grid is drawn (ms from
/// the navigation's start), the median of three loads.
async fn first_paint(addr: std::net::SocketAddr, cookie: &str) -> Result<(f64, f64)> {
    let b = testkit::browser::Browser::start().await;
    let base = format!("https://localhost:{}", addr.port());
    b.goto(&format!("{base}/login")).await;
    b.add_cookie(console::auth::COOKIE, cookie).await;
    let (mut fcp, mut grid) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        b.goto(&format!("{base}/pools/{POOL}")).await;
        let t = Instant::now();
        let v = loop {
            let v = b
                .run(
                    "const p = performance.getEntriesByType('paint').find((e) => e.name === 'first-contentful-paint');
                     return [p ? p.startTime : -1, window.__gridDrawnAt || -1];",
                    vec![],
                )
                .await;
            if v[0].as_f64().unwrap_or(-1.0) >= 0.0 && v[1].as_f64().unwrap_or(-1.0) >= 0.0 {
                break v;
            }
            if t.elapsed() > Duration::from_secs(30) {
                bail!("the pool page was not painted within 30 s: {v}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        fcp.push(v[0].as_f64().unwrap_or(0.0));
        grid.push(v[1].as_f64().unwrap_or(0.0));
    }
    Ok((util::median(&mut fcp), util::median(&mut grid)))
}

pub async fn run(args: Args) -> Result<()> {
    let (nodes, clients, seconds) = if args.quick {
        (
            args.nodes.min(1_000),
            args.clients.min(20),
            args.seconds.min(10),
        )
    } else {
        (args.nodes, args.clients, args.seconds)
    };
    let (_cluster, cfg, client, url, dir) = crate::gateway::setup(POOL).await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let fleet = domain::pools::uniform_fleet("w", nodes, "H100-80GB", 8, 8);
    domain::pools::join_nodes(&appender, POOL, fleet, |_| {}).await?;
    let admin = gateway::roles::Assignment {
        role: gateway::roles::Role::Admin,
        pools: vec![],
    };
    gateway::roles::set(&appender, OPERATOR, &admin).await?;
    let (cookie, _) = console::auth::open(&client, OPERATOR, Duration::from_secs(3600)).await?;
    let ca_dir = dir.path().join("ca");
    let listen: std::net::SocketAddr = "127.0.0.1:0".parse()?;
    let port = std::net::TcpListener::bind(listen)?.local_addr()?.port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let mut server = tokio::process::Command::new(std::env::current_exe()?)
        .args([
            "console-server",
            "--database-url",
            &url,
            "--listen",
            &addr.to_string(),
            "--ca-dir",
        ])
        .arg(&ca_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("start the console process")?;
    let pid = server.id().context("the console's pid")?;
    let tls = connector(&std::fs::read_to_string(ca_dir.join(gateway::ca::CA_CERT))?)?;
    // Ready when the pool page shows the whole pool.
    let t0 = Instant::now();
    let whole = format!("{nodes} nodes.");
    loop {
        if let Ok(s) = connect(&tls, addr).await {
            let mut s = BufReader::new(s);
            if let Ok((status, body)) = get(&mut s, &format!("/pools/{POOL}"), &cookie).await {
                if status.contains("200") && String::from_utf8_lossy(&body).contains(&whole) {
                    break;
                }
            }
        }
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("the console did not show the pool within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "console up with {nodes} nodes after {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    // The baseline: one subscription on the log in this process.
    let mut rc = ReaderConfig::new(format!("bench_direct_{}", std::process::id()));
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let mut direct = reader.subscribe_ephemeral(Start::Now).await?;
    let stop = Arc::new(AtomicU64::new(0));
    let direct_delays = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut d = Vec::new();
            while stop.load(Ordering::Relaxed) == 0 {
                let Ok(Ok(e)) = tokio::time::timeout(Duration::from_secs(1), direct.next()).await
                else {
                    continue;
                };
                direct.ack(e.position);
                if e.event_type == "reservation.placed" {
                    let now = projections::usage::unix_ms(SystemTime::now()) as f64;
                    d.push(now - projections::usage::unix_ms(e.recorded_at) as f64);
                }
            }
            d
        })
    };
    let delays = Arc::new(Mutex::new(Vec::new()));
    let mut watchers = Vec::new();
    for _ in 0..clients {
        watchers.push(tokio::spawn(watch(
            tls.clone(),
            addr,
            cookie.clone(),
            delays.clone(),
            stop.clone(),
        )));
    }
    let placer = placer::Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        placer::PlacerConfig::new("bench-placer"),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (cpu0, load_start) = (util::cpu_seconds(pid), Instant::now());
    let load = tokio::spawn(offer(appender.clone(), args.rate, seconds));
    let (mut pool_ms, mut region_ms, mut peak_rss) = (Vec::new(), Vec::new(), 0f64);
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_secs_f64(seconds as f64 / 22.0)).await;
        // A connection of its own each time (an idle one is closed after
        // the console's head timeout), its handshake not timed.
        let mut page = BufReader::new(connect(&tls, addr).await?);
        let t = Instant::now();
        let (status, body) = get(&mut page, &format!("/pools/{POOL}"), &cookie).await?;
        pool_ms.push(t.elapsed());
        if !status.contains("200") || body.is_empty() {
            bail!("the pool page answered {status}");
        }
        let t = Instant::now();
        get(&mut page, "/", &cookie).await?;
        region_ms.push(t.elapsed());
        peak_rss = peak_rss.max(crate::gateway::rss_of(pid));
    }
    let offered = load.await?;
    let load_secs = load_start.elapsed().as_secs_f64();
    let cpu = (util::cpu_seconds(pid) - cpu0) / load_secs;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(1, Ordering::Relaxed);
    let mut received = 0u64;
    for w in watchers {
        received += w.await?.context("a watching client failed")?;
    }
    let mut direct = direct_delays.await?;
    let placed = placer.stats().view().placed;
    // In a real browser, once the load is over: Chromium's own CPU would
    // take a share of the two cores from everything measured above.
    let paint = if testkit::browser::available() {
        Some(first_paint(addr, &cookie).await?)
    } else {
        None
    };
    let _ = placer.stop().await;
    let _ = server.kill().await;
    let mut d = std::mem::take(&mut *delays.lock().expect("delays"));
    let pct = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v.get(((v.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let (c50, c99) = (pct(&mut d, 0.5), pct(&mut d, 0.99));
    let (b50, b99) = (pct(&mut direct, 0.5), pct(&mut direct, 0.99));
    let (p50, p99) = (
        percentile_ms(&mut pool_ms, 0.5),
        percentile_ms(&mut pool_ms, 0.99),
    );
    let (r50, r99) = (
        percentile_ms(&mut region_ms, 0.5),
        percentile_ms(&mut region_ms, 0.99),
    );
    let result = serde_json::json!({
        "machine": util::machine(&pg_version),
        "shared_cores": "PostgreSQL, the placer, the load generator, the console and its clients share the machine's cores",
        "nodes": nodes,
        "gpus": nodes * 8,
        "clients": clients,
        "seconds": seconds,
        "offered": offered,
        "placed_per_s": round(placed as f64 / load_secs, 0),
        "events_received": received,
        "delay_ms": {"p50": round(c50, 1), "p99": round(c99, 1), "target_p99": 250},
        "baseline_direct_subscription_delay_ms": {"p50": round(b50, 1), "p99": round(b99, 1)},
        "delay_p99_ratio_to_direct": round(c99 / b99.max(0.1), 2),
        "pool_page_ms": {"p50": round(p50, 1), "p99": round(p99, 1), "target": 100},
        "baseline_region_page_ms": {"p50": round(r50, 1), "p99": round(r99, 1)},
        "pool_page_ratio_to_region_page": round(p50 / r50.max(0.01), 2),
        "pool_page_in_chromium_ms": match paint {
            Some((fcp, grid)) => serde_json::json!({
                "first_contentful_paint": round(fcp, 0),
                "grid_drawn": round(grid, 0),
                "target_first_paint": 1000,
                "how": "median of 3 loads in headless Chromium after the load phase (the pool as the load left it), from the navigation's start",
            }),
            None => serde_json::json!("not measured: no Chromium here (apt-get install chromium chromium-driver)"),
        },
        "console_cpu_cores": round(cpu, 3),
        "console_peak_rss_mib": round(peak_rss, 1),
    });
    println!("{}", serde_json::to_string_pretty(&result)?);
    util::finish(
        if args.quick {
            "console-quick"
        } else {
            "console"
        },
        &result,
    )
}
