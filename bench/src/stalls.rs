//! The `gateway-stalls` child of `bench gateway`: hostile RPCs over real
//! TLS and HTTP/2, from many loopback source addresses (127.10.0.1 and up
//! for stalls, 127.9.0.1 and up for bad joins; Linux routes all of
//! 127.0.0.0/8 to this host). Join RPCs whose message never arrives whole
//! (the headers and 10 of the 100 bytes announced, then silence; opened
//! again once the gateway ends them), and Joins with tokens the region
//! never issued at a steady rate. Prints what happened as JSON.

use anyhow::Result;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct StallArgs {
    #[arg(long)]
    addr: SocketAddr,
    /// The CA certificate (to finish TLS handshakes)
    #[arg(long)]
    ca: std::path::PathBuf,
    /// Join RPCs held stalled at once
    #[arg(long, default_value_t = 5_000)]
    stalled: u32,
    /// Joins per second with tokens the region never issued
    #[arg(long, default_value_t = 1_000.0)]
    bad_joins_per_s: f64,
    #[arg(long, default_value_t = 20)]
    seconds: u64,
}

/// The `i`th source address: 127.(`base` + i / 250).0.(1 + i % 250).
fn source(base: u8, i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        127,
        base.saturating_add((i / 250) as u8),
        0,
        1 + (i % 250) as u8,
    ))
}

type H2 = h2::client::SendRequest<Bytes>;

/// A TLS and HTTP/2 connection to the gateway from `from`, without a
/// client certificate.
async fn connect(addr: SocketAddr, from: IpAddr, tls: &tokio_rustls::TlsConnector) -> Result<H2> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    let tcp = socket.connect(addr).await?;
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost")?.to_owned();
    let stream = tls.connect(name, tcp).await?;
    let (h2, connection) = h2::client::handshake(stream).await?;
    tokio::spawn(connection);
    Ok(h2)
}

fn join_request() -> http::Request<()> {
    http::Request::post("https://localhost/strata.node.v1.Join/Join")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a valid request")
}

/// The gRPC status of a response: from its headers (trailers-only) or its
/// trailers; "reset" when the stream or connection ended without one.
async fn status(response: h2::client::ResponseFuture) -> String {
    let Ok(resp) = response.await else {
        return "reset".into();
    };
    if let Some(s) = resp.headers().get("grpc-status") {
        return s.to_str().unwrap_or("?").to_string();
    }
    let mut body = resp.into_body();
    while let Some(d) = body.data().await {
        if d.is_err() {
            return "reset".into();
        }
    }
    match body.trailers().await {
        Ok(Some(t)) => t
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("?")
            .to_string(),
        _ => "reset".into(),
    }
}

#[derive(Default)]
struct Counts {
    stalls_started: AtomicU64,
    /// Stalled RPCs the gateway ended before the run did (cut at their
    /// deadline, or refused).
    stalls_ended: AtomicU64,
    connect_failures: AtomicU64,
    bad_joins_sent: AtomicU64,
    /// Bad joins' answers by gRPC status code.
    answers: Mutex<BTreeMap<String, u64>>,
}

/// Keeps one stalled Join open from source `i` until `deadline`, opening
/// another each time the gateway ends one.
async fn stall_loop(
    addr: SocketAddr,
    i: u32,
    tls: tokio_rustls::TlsConnector,
    deadline: tokio::time::Instant,
    c: Arc<Counts>,
) {
    while tokio::time::Instant::now() < deadline {
        let attempt = async {
            let mut h2 = connect(addr, source(10, i), &tls).await?;
            h2 = h2.ready().await?;
            let (response, mut body) = h2.send_request(join_request(), false)?;
            let mut partial = vec![0u8, 0, 0, 0, 100];
            partial.extend_from_slice(&[0x0a; 10]);
            body.send_data(Bytes::from(partial), false)?;
            c.stalls_started.fetch_add(1, Ordering::Relaxed);
            let _ = status(response).await;
            anyhow::Ok((h2, body))
        };
        match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(_)) => {
                c.stalls_ended.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(_)) => {
                c.connect_failures.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => return,
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Sends Joins with made-up tokens from source `i`, `per_s` a second,
/// until `deadline`.
async fn bad_joins(
    addr: SocketAddr,
    i: u32,
    per_s: f64,
    tls: tokio_rustls::TlsConnector,
    deadline: tokio::time::Instant,
    c: Arc<Counts>,
) {
    use prost::Message;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_s.max(0.01)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut h2: Option<H2> = None;
    while tokio::time::Instant::now() < deadline {
        tick.tick().await;
        if h2.is_none() {
            h2 = connect(addr, source(9, i), &tls).await.ok();
            if h2.is_none() {
                c.connect_failures.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        }
        let msg = gateway::proto::JoinRequest {
            token: format!("{:032x}", fastrand::u128(..)),
            node_id: format!("bad-{i}"),
            csr_pem: String::new(),
        }
        .encode_to_vec();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        framed.extend_from_slice(&msg);
        let sent = async {
            let mut ready = h2.take().expect("a connection").ready().await?;
            let (response, mut body) = ready.send_request(join_request(), false)?;
            body.send_data(Bytes::from(framed), true)?;
            anyhow::Ok((ready, response))
        };
        match sent.await {
            Ok((ready, response)) => {
                h2 = Some(ready);
                c.bad_joins_sent.fetch_add(1, Ordering::Relaxed);
                let c = c.clone();
                tokio::spawn(async move {
                    let s = status(response).await;
                    *c.answers.lock().expect("answers").entry(s).or_default() += 1;
                });
            }
            // The connection is gone: a new one at the next tick.
            Err(_) => {
                c.connect_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Runs the hostile RPCs for `seconds` and prints what happened.
pub async fn stalls(args: StallArgs) -> Result<()> {
    let ca_pem = std::fs::read_to_string(&args.ca)?;
    let tls = crate::hostile::tls_connector(&ca_pem)?;
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.seconds);
    let c = Arc::new(Counts::default());
    let mut tasks = Vec::new();
    for i in 0..args.stalled {
        tasks.push(tokio::spawn(stall_loop(
            args.addr,
            i,
            tls.clone(),
            deadline,
            c.clone(),
        )));
    }
    // A hundred sources share the bad joins' rate.
    let sources = 100u32;
    for i in 0..sources {
        tasks.push(tokio::spawn(bad_joins(
            args.addr,
            i,
            args.bad_joins_per_s / sources as f64,
            tls.clone(),
            deadline,
            c.clone(),
        )));
    }
    for t in tasks {
        let _ = t.await;
    }
    let secs = started.elapsed().as_secs_f64();
    let answers = c.answers.lock().expect("answers").clone();
    println!(
        "{}",
        serde_json::json!({
            "seconds": secs,
            "stalled_at_once": args.stalled,
            "stalls_started": c.stalls_started.load(Ordering::Relaxed),
            "stalls_ended_by_gateway": c.stalls_ended.load(Ordering::Relaxed),
            "connect_failures": c.connect_failures.load(Ordering::Relaxed),
            "bad_joins_sent": c.bad_joins_sent.load(Ordering::Relaxed),
            "bad_joins_per_s": c.bad_joins_sent.load(Ordering::Relaxed) as f64 / secs,
            "bad_join_answers_by_grpc_status": answers,
        })
    );
    Ok(())
}

/// Runs `gateway-stalls` against `addr` as a child process.
pub(crate) fn spawn(
    addr: SocketAddr,
    ca: &std::path::Path,
    stalled: u32,
    bad_joins_per_s: f64,
    seconds: u64,
) -> Result<tokio::process::Child> {
    crate::hostile::spawn_self(
        "gateway-stalls",
        &[
            "--addr",
            &addr.to_string(),
            "--stalled",
            &stalled.to_string(),
            "--bad-joins-per-s",
            &bad_joins_per_s.to_string(),
            "--seconds",
            &seconds.to_string(),
        ],
        ca,
    )
}
