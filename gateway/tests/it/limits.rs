//! The gateway under connections that never open a session: half-open TLS
//! handshakes, finished handshakes that then sit idle, a node sending health
//! reports without end; and its serving certificate outliving its validity.

use super::*;
use std::time::Instant;

/// A TLS client that trusts the region's CA and offers HTTP/2, as a node would.
fn tls_client(ca_pem: &str) -> tokio_rustls::TlsConnector {
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::pem::PemObject::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_connections_do_not_keep_out_a_real_node_or_client() {
    use gateway::api_proto::ListPoolsRequest;
    let r = region().await;
    let gw = r
        .gateway("gw-a", |c| {
            c.handshake_timeout = Duration::from_secs(1);
            c.idle_timeout = Duration::from_secs(2);
            c.max_idle_connections = 64;
        })
        .await;
    // 150 connections that never send a byte of their handshake, and 100
    // that finish it and then send nothing.
    let mut half_open = Vec::new();
    for _ in 0..150 {
        half_open.push(tokio::net::TcpStream::connect(gw.addr).await.unwrap());
    }
    let connector = tls_client(&r.ca_pem());
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut idle = Vec::new();
    for _ in 0..100 {
        let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        if let Ok(s) = connector.connect(name.clone(), tcp).await {
            idle.push(s);
        }
    }
    // 100 callers that make one (refused) API call each and then sit on
    // their connections: never more than the cap of them idle at once.
    let mut callers = Vec::new();
    for _ in 0..100 {
        let ch = tonic::transport::Endpoint::from_shared(url(&gw))
            .unwrap()
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(r.ca_pem()))
                    .domain_name("localhost"),
            )
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = gateway::api_proto::api_client::ApiClient::new(ch);
        let e = c
            .list_pools(gateway::api_proto::ListPoolsRequest {})
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        callers.push(c);
    }
    let (_, idle_now) = gw.connections();
    assert!(idle_now <= 64, "{idle_now} idle connections");
    assert!(gw.listener.idle_closed.load(Ordering::Relaxed) >= 36);
    // A real node joins and holds its session meanwhile.
    let dir = tempfile::tempdir().unwrap();
    let c = joining(&r, &gw, dir.path(), "n1").await;
    let started = Instant::now();
    let n = start(c);
    testkit::eventually(20, "n1 joined and opened a session", || async {
        n.stats.connected.load(Ordering::Relaxed) >= 1
    })
    .await;
    let joined_in = started.elapsed();
    // And an operator's call goes through.
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let (cert, key) = ca.issue_operator("alice", 1).unwrap();
    admin(&r, "alice").await;
    let mut api = api_as(&r, &gw, cert, key).await;
    let pools = api.list_pools(ListPoolsRequest {}).await.unwrap();
    assert_eq!(pools.into_inner().pools.len(), 1);
    // Every flood connection is closed by the gateway: half-open ones at
    // the handshake timeout (or sooner, as the longest idle), idle ones at
    // the idle timeout.
    use tokio::io::AsyncReadExt;
    for mut s in half_open {
        let mut b = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut b))
            .await
            .expect("a half-open connection was left open");
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    }
    for mut s in idle {
        let mut b = [0u8; 64];
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match s.read(&mut b).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {} // the server's HTTP/2 preface
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "an idle connection was left open");
    }
    let stats = &gw.listener;
    assert!(
        stats.handshake_timeouts.load(Ordering::Relaxed)
            + stats.idle_closed.load(Ordering::Relaxed)
            >= 250
    );
    // The node's session outlived the idle timeout: it is busy, not idle.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        n.stats.connected.load(Ordering::Relaxed),
        1,
        "the node reconnected"
    );
    assert_eq!(gw.stats.sessions.load(Ordering::Relaxed), 1);
    assert!(joined_in < Duration::from_secs(20));
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_flooding_health_reports_is_ended_and_others_go_on() {
    use node::proto::{
        node_message, session_client::SessionClient, HealthReport, Hello, NodeMessage,
    };
    let r = region().await;
    let gw = r
        .gateway("gw-a", |c| {
            c.node_messages_per_second = 5.0;
        })
        .await;
    let dir = tempfile::tempdir().unwrap();
    let c = joining(&r, &gw, dir.path(), "n1").await;
    let creds = daemon::ensure_joined(&c).await.unwrap();
    let channel = node_channel(&gw, &creds.ca_pem, &creds.cert_pem, &creds.key_pem)
        .await
        .unwrap();
    let mut msgs = vec![NodeMessage {
        body: Some(node_message::Body::Hello(Hello {
            node_id: "n1".into(),
            generation: 1,
            ..Hello::default()
        })),
    }];
    for i in 0..500 {
        msgs.push(NodeMessage {
            body: Some(node_message::Body::Health(HealthReport {
                device: "GPU-0".into(),
                condition: format!("flood-{i}"),
                detail: String::new(),
                cleared: false,
            })),
        });
    }
    let mut client = SessionClient::new(channel);
    let mut inbound = client
        .open(futures_util::stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    let status = loop {
        match inbound.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the session ended without a status"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(gw.stats.refused_messages.load(Ordering::Relaxed), 1);
    // At most the burst was written.
    let raised = r
        .count("SELECT count(*) FROM strata.events WHERE type = 'health.raised'")
        .await;
    assert!(raised <= 50, "{raised} health events written");
    // The same node, well-behaved, opens a session again.
    let n = start(c);
    testkit::eventually(20, "n1's session opens again", || async {
        n.stats.connected.load(Ordering::Relaxed) >= 1
    })
    .await;
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

/// The serving certificate's serial and expiry, as openssl sees it.
fn served_certificate(addr: std::net::SocketAddr) -> (String, std::time::SystemTime) {
    use std::io::Write;
    let mut child = std::process::Command::new("openssl")
        .args([
            "s_client",
            "-connect",
            &addr.to_string(),
            "-servername",
            "localhost",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("openssl");
    child.stdin.take().unwrap().write_all(b"").unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text
        .find("-----BEGIN CERTIFICATE-----")
        .expect("a certificate");
    let end = text.find("-----END CERTIFICATE-----").unwrap() + 25;
    let (_, pem) = x509_parser::pem::parse_x509_pem(text[start..end].as_bytes()).unwrap();
    let cert = pem.parse_x509().unwrap();
    let not_after =
        std::time::UNIX_EPOCH + Duration::from_secs(cert.validity().not_after.timestamp() as u64);
    (events::hex(cert.raw_serial()), not_after)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serving_certificate_is_renewed_before_it_expires() {
    let r = region().await;
    let gw = r
        .gateway("gw-a", |c| c.serving_validity = Duration::from_secs(6))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let c = joining(&r, &gw, dir.path(), "n1").await;
    let n = start(c.clone());
    testkit::eventually(20, "n1's session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) >= 1
    })
    .await;
    let (first, first_expiry) = served_certificate(gw.addr);
    let started = Instant::now();
    // Past the first certificate's expiry, the gateway serves a valid one,
    // and new connections (which check it) go through.
    tokio::time::sleep_until((started + Duration::from_secs(8)).into()).await;
    assert!(std::time::SystemTime::now() > first_expiry);
    let (now, expiry) = served_certificate(gw.addr);
    assert_ne!(now, first, "the same certificate is served");
    assert!(
        expiry > std::time::SystemTime::now(),
        "an expired certificate is served"
    );
    let dir2 = tempfile::tempdir().unwrap();
    let c2 = joining(&r, &gw, dir2.path(), "n2").await;
    let n2 = start(c2);
    testkit::eventually(20, "n2 joins through the renewed certificate", || async {
        n2.stats.connected.load(Ordering::Relaxed) >= 1
    })
    .await;
    n.stop().await.unwrap();
    n2.stop().await.unwrap();
    gw.stop().await.unwrap();
}

/// The `i`th loopback address of a stranger (127.20.0.1 and up).
fn stranger(i: u8) -> std::net::IpAddr {
    std::net::IpAddr::from([127, 20, 0, 1 + i])
}

/// An HTTP/2 connection, without a client certificate, whose Join RPC sent
/// its headers and the first 10 of the 100 bytes its message announced, and
/// then nothing more, from the loopback address `from` (Linux routes all of
/// 127.0.0.0/8 here; the nodes of these tests come from 127.0.0.1): what
/// comes back, and when the gateway closed it.
async fn stalled_join(
    addr: std::net::SocketAddr,
    from: std::net::IpAddr,
    connector: tokio_rustls::TlsConnector,
) -> Option<(Option<String>, Duration)> {
    let started = Instant::now();
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.bind(std::net::SocketAddr::new(from, 0)).ok()?;
    let tcp = socket.connect(addr).await.ok()?;
    let tls = connector.connect(name, tcp).await.ok()?;
    let (mut h2, connection) = h2::client::handshake(tls).await.ok()?;
    let driver = tokio::spawn(connection);
    let req = http::Request::post("https://localhost/strata.node.v1.Join/Join")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut body) = h2.send_request(req, false).ok()?;
    let mut partial = vec![0u8, 0, 0, 0, 100];
    partial.extend_from_slice(&[0x0a; 10]);
    body.send_data(bytes::Bytes::from(partial), false).ok()?;
    // The gRPC status the gateway answers with, if it answers.
    let status = match response.await {
        Ok(resp) => {
            let from_headers = resp
                .headers()
                .get("grpc-status")
                .map(|v| v.to_str().unwrap().to_string());
            let mut recv = resp.into_body();
            while recv.data().await.is_some() {}
            let trailers = recv.trailers().await.ok().flatten();
            from_headers.or_else(|| {
                trailers.and_then(|t| {
                    t.get("grpc-status")
                        .map(|v| v.to_str().unwrap().to_string())
                })
            })
        }
        Err(_) => None,
    };
    // Keep our side open: only the gateway may close the connection.
    let _keep = (h2, body);
    let _ = driver.await;
    Some((status, started.elapsed()))
}

/// Stalled joins from each of `sources`, each opened again as soon as the
/// gateway ends it, until `done`.
fn stalling(
    addr: std::net::SocketAddr,
    sources: impl Iterator<Item = std::net::IpAddr>,
    connector: &tokio_rustls::TlsConnector,
    done: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    sources
        .map(|from| {
            let (connector, done) = (connector.clone(), done.clone());
            tokio::spawn(async move {
                while !done.load(Ordering::Relaxed) {
                    if stalled_join(addr, from, connector.clone()).await.is_none() {
                        // Closed before its handshake: try again soon.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_rpcs_are_cut_at_their_deadline_and_their_connections_closed() {
    let r = region().await;
    let gw = r
        .gateway("gw-stall", |c| {
            c.request_deadline = Duration::from_secs(2);
            c.idle_timeout = Duration::from_secs(2);
            c.max_unauthenticated_connections = 40;
        })
        .await;
    let connector = tls_client(&r.ca_pem());
    let stalled: Vec<_> = (0..60)
        .map(|i| tokio::spawn(stalled_join(gw.addr, stranger(i), connector.clone())))
        .collect();
    // Meanwhile the unauthenticated share is full, but a node with a
    // certificate gets its session.
    let dir = tempfile::tempdir().unwrap();
    let c = joining(&r, &gw, dir.path(), "n1").await;
    let n = start(c);
    testkit::eventually(30, "n1 joined and opened a session", || async {
        n.stats.connected.load(Ordering::Relaxed) >= 1
    })
    .await;
    let mut cut = 0;
    for s in stalled {
        let outcome = tokio::time::timeout(Duration::from_secs(20), s)
            .await
            .expect("a stalled connection was left open")
            .unwrap();
        if let Some((status, took)) = outcome {
            // DEADLINE_EXCEEDED, or closed before an answer (over the share).
            if status.as_deref() == Some("4") {
                cut += 1;
                assert!(took >= Duration::from_secs(2), "{took:?}");
            } else {
                assert_eq!(status, None, "{status:?}");
            }
        }
    }
    assert!(cut > 0, "no stalled RPC was cut at its deadline");
    // Past the share of 40, each new connection without a certificate
    // closed one of them that was idle, or the oldest when all were busy
    // (which of the two depends on how far the others had got), or was
    // refused: the share held.
    let refused = gw.listener.unauthenticated_refused.load(Ordering::Relaxed);
    let closed = gw.listener.idle_closed.load(Ordering::Relaxed);
    let evicted = gw.listener.unauthenticated_evicted.load(Ordering::Relaxed);
    assert!(
        refused + closed + evicted >= 20,
        "{refused} refused, {closed} closed, {evicted} evicted"
    );
    assert!(gw.listener.requests_cut.load(Ordering::Relaxed) >= cut);
    assert_eq!(n.stats.connected.load(Ordering::Relaxed), 1);
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_kept_full_of_stalled_joins_still_lets_a_real_node_join_at_once() {
    let r = region().await;
    let gw = r
        .gateway("gw-stalls", |c| {
            c.request_deadline = Duration::from_secs(20);
            c.max_unauthenticated_connections = 20;
        })
        .await;
    // Stalls opened again as soon as the gateway ends one, until the test
    // is done: the share never frees by itself before the deadline.
    let connector = tls_client(&r.ca_pem());
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Forty addresses, and ten loops more from one of them, which gets no
    // more handshakes than the others while the share is pressed.
    let sources = (0..40).map(stranger).chain((0..10).map(|_| stranger(0)));
    let stalls = stalling(gw.addr, sources, &connector, &done);
    testkit::eventually(20, "the share is full of stalled joins", || async {
        let (open, idle) = gw.connections();
        open >= 20 && idle == 0
    })
    .await;
    // A real node joins and opens its session long before any stalled
    // RPC reaches its deadline (20 s).
    let dir = tempfile::tempdir().unwrap();
    let (took, n) = joins_within(&r, &gw, dir.path(), Duration::from_secs(10)).await;
    let l = &gw.listener;
    eprintln!(
        "joined after {took:?}: {} evicted, {} refused, {} idle closed, {} cut, {} held back, {} by token",
        l.unauthenticated_evicted.load(Ordering::Relaxed),
        l.unauthenticated_refused.load(Ordering::Relaxed),
        l.idle_closed.load(Ordering::Relaxed),
        l.requests_cut.load(Ordering::Relaxed),
        l.handshakes_held_back.load(Ordering::Relaxed),
        l.handshakes_by_token.load(Ordering::Relaxed)
    );
    // It got in either by room made for it (a stall closed: one waiting on
    // its client, or one that had not begun its RPC a second after its
    // handshake; which depends on how far each had got) or, held back
    // itself, by naming its token; the stalls' addresses were held back at
    // accept.
    let made_room =
        l.unauthenticated_evicted.load(Ordering::Relaxed) + l.idle_closed.load(Ordering::Relaxed);
    assert!(made_room + l.handshakes_by_token.load(Ordering::Relaxed) > 0);
    assert!(l.handshakes_held_back.load(Ordering::Relaxed) > 0);
    done.store(true, Ordering::Relaxed);
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
    for s in stalls {
        s.abort();
    }
}

/// Starts a node joining through `gw` with a fresh token and waits for its
/// session; how long that took, which must be under `within`.
async fn joins_within(
    r: &Region,
    gw: &Running,
    dir: &std::path::Path,
    within: Duration,
) -> (Duration, Node) {
    let started = Instant::now();
    let n = start(joining(r, gw, dir, "n1").await);
    testkit::eventually(
        within.as_secs() + 5,
        "n1 joined and opened a session",
        || async { n.stats.connected.load(Ordering::Relaxed) >= 1 },
    )
    .await;
    let took = started.elapsed();
    assert!(took < within, "joined only after {took:?}");
    (took, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_naming_its_token_is_let_through_while_strangers_are_held_back() {
    let r = region().await;
    let gw = r
        .gateway("gw-named", |c| {
            c.request_deadline = Duration::from_secs(60);
            c.max_unauthenticated_connections = 10;
            // While pressed, strangers get no handshake at all: as if a
            // flood from many addresses had spent every turn.
            c.unknown_handshakes_per_second = 0.1;
        })
        .await;
    let connector = tls_client(&r.ca_pem());
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // More strangers than the share holds: it stays full and pressed.
    let stalls = stalling(gw.addr, (0..14).map(stranger), &connector, &done);
    let l = &gw.listener;
    testkit::eventually(20, "the share is full and pressed", || async {
        let (open, idle) = gw.connections();
        open >= 10 && idle == 0 && l.handshakes_held_back.load(Ordering::Relaxed) > 0
    })
    .await;
    // Pressed: a stranger naming no token is closed before its handshake.
    let held = l.handshakes_held_back.load(Ordering::Relaxed);
    assert!(
        stalled_join(gw.addr, stranger(50), connector.clone())
            .await
            .is_none(),
        "a stranger got a handshake while pressed"
    );
    assert!(l.handshakes_held_back.load(Ordering::Relaxed) > held);
    // A real node, from an address that never presented a certificate
    // here, names its token in its ClientHello and joins long before any
    // stall reaches its deadline (60 s).
    let dir = tempfile::tempdir().unwrap();
    let (_, n) = joins_within(&r, &gw, dir.path(), Duration::from_secs(15)).await;
    assert!(l.handshakes_by_token.load(Ordering::Relaxed) >= 1);
    done.store(true, Ordering::Relaxed);
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
    for s in stalls {
        s.abort();
    }
}
