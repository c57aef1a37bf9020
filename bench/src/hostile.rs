//! The gateway's phases of `bench gateway` that measure it against its own
//! limits and against hostile clients: joins through the Join service with
//! real one-time tokens (at the default join rate, against a gateway with
//! no join limit as the baseline), and a flood of idle and half-open
//! connections (from a child process of its own, `gateway-flood`) while
//! the gateway holds its sessions.

use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Joins made through one gateway.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JoinRate {
    pub(crate) joins: u32,
    pub(crate) secs: f64,
    pub(crate) per_s: f64,
    /// RESOURCE_EXHAUSTED answers waited out (the join rate limit).
    pub(crate) pushbacks: u64,
}

/// Makes `n` one-time tokens and joins `n` new nodes with them through the
/// gateway at `addr`, `concurrency` at a time, each waiting out pushbacks
/// as a daemon does.
pub(crate) async fn joins(
    client: &tokio_postgres::Client,
    addr: &str,
    ca_pem: &str,
    pool: &str,
    prefix: &str,
    n: u32,
    concurrency: usize,
) -> Result<JoinRate> {
    let mut tokens = Vec::with_capacity(n as usize);
    for i in 0..n {
        let node = format!("{prefix}{i:05}");
        tokens.push(
            gateway::identity::create_token(client, pool, Duration::from_secs(3600), &node).await?,
        );
    }
    let channel = tonic::transport::Endpoint::from_shared(addr.to_string())?
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca_pem))
                .domain_name("localhost"),
        )?
        .connect()
        .await
        .context("connect to the gateway for joins")?;
    let work = Arc::new(std::sync::Mutex::new(
        tokens.into_iter().enumerate().collect::<Vec<_>>(),
    ));
    let pushbacks = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (work, pushbacks, channel) = (work.clone(), pushbacks.clone(), channel.clone());
        let prefix = prefix.to_string();
        tasks.push(tokio::spawn(async move {
            let mut join = gateway::proto::join_client::JoinClient::new(channel);
            loop {
                let Some((i, token)) = work.lock().expect("work lock").pop() else {
                    return anyhow::Ok(());
                };
                let key = rcgen_key()?;
                loop {
                    let req = gateway::proto::JoinRequest {
                        token: token.clone(),
                        node_id: format!("{prefix}{i:05}"),
                        csr_pem: key.clone(),
                    };
                    match join.join(req).await {
                        Ok(_) => break,
                        Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                            pushbacks.fetch_add(1, Ordering::Relaxed);
                            let ms = s
                                .metadata()
                                .get("retry-after-ms")
                                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                                .unwrap_or(100);
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                        }
                        Err(s) => anyhow::bail!("join {prefix}{i}: {s}"),
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let secs = t.elapsed().as_secs_f64();
    Ok(JoinRate {
        joins: n,
        secs,
        per_s: n as f64 / secs,
        pushbacks: pushbacks.load(Ordering::Relaxed),
    })
}

/// A CSR for a new key (PEM).
fn rcgen_key() -> Result<String> {
    let key = rcgen::KeyPair::generate()?;
    Ok(rcgen::CertificateParams::new(Vec::<String>::new())?
        .serialize_request(&key)?
        .pem()?)
}

pub(crate) fn tls_connector(ca_pem: &str) -> Result<tokio_rustls::TlsConnector> {
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::pem::PemObject::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c?)?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// How long a fresh TCP connection and TLS handshake take, `n` times, and
/// how many of them failed (reset, or over 30 s); from `from` if given.
pub(crate) async fn probe(
    addr: SocketAddr,
    ca_pem: &str,
    n: usize,
    from: Option<std::net::IpAddr>,
) -> Result<(Vec<Duration>, u32)> {
    let connector = tls_connector(ca_pem)?;
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost")?;
    let (mut out, mut failed) = (Vec::with_capacity(n), 0);
    for _ in 0..n {
        let t = Instant::now();
        let attempt = async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            if let Some(ip) = from {
                socket.bind(SocketAddr::new(ip, 0))?;
            }
            let tcp = socket.connect(addr).await?;
            connector.connect(name.clone(), tcp).await
        };
        match tokio::time::timeout(Duration::from_secs(30), attempt).await {
            Ok(Ok(tls)) => {
                out.push(t.elapsed());
                drop(tls);
            }
            _ => failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((out, failed))
}

/// The hidden `gateway-flood` subcommand: hostile connections.
#[derive(clap::Args, Debug)]
pub struct FloodArgs {
    #[arg(long)]
    addr: SocketAddr,
    /// The CA certificate (to finish TLS handshakes)
    #[arg(long)]
    ca: std::path::PathBuf,
    /// Connections held open at once (as many as the gateway lets stay)
    #[arg(long, default_value_t = 10_000)]
    connections: u32,
    /// Of them, how many finish their TLS handshake and then sit idle (the
    /// rest never send a byte)
    #[arg(long, default_value_t = 2_000)]
    tls: u32,
    #[arg(long, default_value_t = 15)]
    seconds: u64,
}

/// Holds `connections` connections for `seconds`, each opened again five
/// seconds after the gateway closes it; prints what happened as JSON.
pub async fn flood(args: FloodArgs) -> Result<()> {
    let ca_pem = std::fs::read_to_string(&args.ca)?;
    let connector = tls_connector(&ca_pem)?;
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost")?.to_owned();
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let (opened, closed, failed) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let mut tasks = Vec::new();
    for i in 0..args.connections {
        let (opened, closed, failed) = (opened.clone(), closed.clone(), failed.clone());
        let (connector, name) = (connector.clone(), name.clone());
        let tls = i < args.tls;
        tasks.push(tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            while Instant::now() < deadline {
                let Ok(mut tcp) = tokio::net::TcpStream::connect(args.addr).await else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                };
                opened.fetch_add(1, Ordering::Relaxed);
                let mut buf = [0u8; 512];
                let held = async {
                    if tls {
                        if let Ok(mut s) = connector.connect(name.clone(), tcp).await {
                            while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                        }
                    } else {
                        while matches!(tcp.read(&mut buf).await, Ok(n) if n > 0) {}
                    }
                };
                if tokio::time::timeout_at(deadline.into(), held).await.is_ok() {
                    closed.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    println!(
        "{}",
        serde_json::json!({
            "opened": opened.load(Ordering::Relaxed),
            "closed_by_gateway": closed.load(Ordering::Relaxed),
            "connect_failures": failed.load(Ordering::Relaxed),
        })
    );
    Ok(())
}

/// Runs `gateway-flood` against `addr` as a child process; returns its
/// output once it ends.
pub(crate) fn spawn_flood(
    addr: SocketAddr,
    ca: &std::path::Path,
    connections: u32,
    seconds: u64,
) -> Result<tokio::process::Child> {
    spawn_self(
        "gateway-flood",
        &[
            "--addr",
            &addr.to_string(),
            "--connections",
            &connections.to_string(),
            "--seconds",
            &seconds.to_string(),
        ],
        ca,
    )
}

/// This program's hidden subcommand `sub` with `args` and `--ca ca`, as a
/// child whose standard output (its JSON report) is kept.
pub(crate) fn spawn_self(
    sub: &str,
    args: &[&str],
    ca: &std::path::Path,
) -> Result<tokio::process::Child> {
    tokio::process::Command::new(std::env::current_exe()?)
        .arg(sub)
        .args(args)
        .arg("--ca")
        .arg(ca)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start the {sub} process"))
}

/// What [`join_probe`] saw.
pub(crate) struct JoinProbe {
    /// Time to join of each node that joined: from its first try to its
    /// certificate, retries included.
    pub joined: Vec<Duration>,
    /// Nodes not joined within 60 s, or refused for good.
    pub failed: u32,
    /// Tries in all (a node's first try included).
    pub tries: u32,
    /// Why tries failed and were made again, with how many did so.
    pub retried_because: std::collections::BTreeMap<String, u32>,
}

/// How long `n` real nodes take to join, all at once, each with a fresh
/// one-time token from an address of its own (127.`net`.0.1 and up,
/// addresses the gateway has never seen), trying again as a daemon does (a
/// new connection each time, after a full-jitter backoff from 500 ms
/// doubling to 30 s); a node not joined `within` of the start counts as
/// failed.
pub(crate) async fn join_probe(
    client: &tokio_postgres::Client,
    addr: &str,
    ca_pem: &str,
    prefix: &str,
    net: u8,
    n: u32,
    within: Duration,
) -> Result<JoinProbe> {
    let mut nodes = Vec::new();
    for i in 0..n {
        let node = format!("{prefix}{i:05}");
        let token =
            gateway::identity::create_token(client, "gw", Duration::from_secs(3600), &node).await?;
        let req = gateway::proto::JoinRequest {
            token,
            node_id: node,
            csr_pem: rcgen_key()?,
        };
        let from = std::net::IpAddr::from([127, net, (i / 250) as u8, 1 + (i % 250) as u8]);
        nodes.push((req, from));
    }
    let started = Instant::now();
    let deadline = started + within;
    let joiners = nodes.into_iter().map(|(req, from)| {
        let (addr, ca_pem) = (addr.to_string(), ca_pem.to_string());
        tokio::spawn(async move { join_until(&addr, &ca_pem, req, from, deadline).await })
    });
    let mut probe = JoinProbe {
        joined: Vec::new(),
        failed: 0,
        tries: 0,
        retried_because: Default::default(),
    };
    for j in joiners.collect::<Vec<_>>() {
        let (joined, tries, why) = j.await??;
        probe.tries += tries;
        for w in why {
            *probe.retried_because.entry(w).or_default() += 1;
        }
        match joined {
            Some(took) => probe.joined.push(took),
            None => probe.failed += 1,
        }
    }
    Ok(probe)
}

/// One node joining from `from` until `deadline`, as a daemon retries: how
/// long it took (`None`: not joined in time, or refused for good), its
/// tries, and why each try that was made again failed.
async fn join_until(
    addr: &str,
    ca_pem: &str,
    req: gateway::proto::JoinRequest,
    from: std::net::IpAddr,
    deadline: Instant,
) -> Result<(Option<Duration>, u32, Vec<String>)> {
    let started = Instant::now();
    let mut tries = 0u32;
    let mut why = Vec::new();
    loop {
        tries += 1;
        // As a daemon joins: its ClientHello names its token.
        let connector = ops::join_alpn::JoinConnector::new(ca_pem, "localhost", &req.token)
            .map_err(anyhow::Error::msg)?
            .from_address(from);
        let channel =
            tonic::transport::Endpoint::from_shared(ops::join_alpn::endpoint_address(addr))?
                .connect_with_connector_lazy(connector);
        let mut join = gateway::proto::join_client::JoinClient::new(channel);
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, join.join(req.clone())).await {
            Ok(Ok(_)) => return Ok((Some(started.elapsed()), tries, why)),
            Ok(Err(s)) if s.code() == tonic::Code::PermissionDenied => {
                return Ok((None, tries, why))
            }
            Err(_) => return Ok((None, tries, why)),
            Ok(Err(s)) => why.push(format!("{:?}: {}", s.code(), s.message())),
        }
        let ceiling = Duration::from_millis(500)
            .saturating_mul(1u32 << tries.min(16))
            .min(Duration::from_secs(30));
        let pause = ceiling.mul_f64(fastrand::f64());
        if Instant::now() + pause >= deadline {
            return Ok((None, tries, why));
        }
        tokio::time::sleep(pause).await;
    }
}
