//! Joining with a token: the same key gets the same certificate, a join cut
//! off in flight is tried again, a node finds another gateway when its home
//! is down and returns once it is back, and a token cannot take a node id
//! that exists or was revoked.

use super::*;
use std::time::Instant;

/// A channel for joins (no client certificate), from `from` if given.
async fn join_channel(
    ca_pem: &str,
    url: &str,
    from: Option<std::net::IpAddr>,
) -> tonic::transport::Channel {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    Endpoint::from_shared(url.to_string())
        .unwrap()
        .local_address(from)
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A CSR for `key`.
fn csr(key: &rcgen::KeyPair) -> String {
    rcgen::CertificateParams::new(Vec::<String>::new())
        .unwrap()
        .serialize_request(key)
        .unwrap()
        .pem()
        .unwrap()
}

/// A join over `channel`, with a fresh key's CSR.
async fn join_over(
    channel: tonic::transport::Channel,
    token: &str,
    node: &str,
) -> Result<String, tonic::Status> {
    use gateway::proto::{join_client::JoinClient, JoinRequest};
    JoinClient::new(channel)
        .join(JoinRequest {
            token: token.into(),
            node_id: node.into(),
            csr_pem: csr(&rcgen::KeyPair::generate().unwrap()),
        })
        .await
        .map(|r| r.into_inner().certificate_pem)
}

/// A join with this CSR; the certificate it was given.
async fn join_with(
    r: &Region,
    gw: &Running,
    token: &str,
    node: &str,
    csr: &str,
) -> Result<String, tonic::Status> {
    use gateway::proto::{join_client::JoinClient, JoinRequest};
    JoinClient::new(join_channel(&r.ca_pem(), &url(gw), None).await)
        .join(JoinRequest {
            token: token.into(),
            node_id: node.into(),
            csr_pem: csr.into(),
        })
        .await
        .map(|r| r.into_inner().certificate_pem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_asked_again_with_the_same_key_gets_the_same_certificate() {
    let r = region().await;
    let gw = r.gateway("gw", |_| {}).await;
    let token = identity::create_token(&r.client, "p", Duration::from_secs(600), "n1")
        .await
        .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let first = join_with(&r, &gw, &token, "n1", &csr(&key)).await.unwrap();
    // The answer was lost; the node asks again with the same key (a new CSR
    // for it): the same certificate, nothing issued twice.
    let again = join_with(&r, &gw, &token, "n1", &csr(&key)).await.unwrap();
    assert_eq!(first, again);
    // Another key with the spent token: refused.
    let other = join_with(
        &r,
        &gw,
        &token,
        "n1",
        &csr(&rcgen::KeyPair::generate().unwrap()),
    )
    .await;
    assert_eq!(other.unwrap_err().code(), tonic::Code::PermissionDenied);
    // Another node id with the spent token: refused.
    let elsewhere = join_with(&r, &gw, &token, "n2", &csr(&key)).await;
    assert!(elsewhere.is_err());
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.certificate_issued'")
            .await,
        1
    );
    // A daemon keeps its join key until it is answered: one whose first try
    // was answered but lost joins on its next try.
    let dir = tempfile::tempdir().unwrap();
    let t2 = identity::create_token(&r.client, "p", Duration::from_secs(600), "n3")
        .await
        .unwrap();
    let mut c = config(vec![url(&gw)], dir.path(), "n3");
    c.token = Some(t2.clone());
    c.ca_pem = Some(r.ca_pem());
    std::fs::create_dir_all(dir.path().join("n3")).unwrap();
    let k3 = rcgen::KeyPair::generate().unwrap();
    std::fs::write(dir.path().join("n3/join.key"), k3.serialize_pem()).unwrap();
    join_with(&r, &gw, &t2, "n3", &csr(&k3)).await.unwrap();
    let creds = daemon::ensure_joined(&c)
        .await
        .expect("joined on the retry");
    assert!(gateway::ca::same_public_key(&csr(&k3), &creds.cert_pem));
    assert!(!dir.path().join("n3/join.key").exists());
    gw.stop().await.unwrap();
}

/// At 10,000 nodes starting at once, a join whose connection a busy gateway
/// closed before the request went out failed `Cancelled` ("operation was
/// canceled"), which the daemon took for a refusal: 358 nodes gave up for
/// good. Only the gateway's own answers are final.
#[test]
fn only_the_gateways_own_refusals_end_a_join() {
    use node::identity::join_failure;
    use tonic::{Code, Status};
    for code in [
        Code::Cancelled,
        Code::Unknown,
        Code::DeadlineExceeded,
        Code::ResourceExhausted,
        Code::Aborted,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
    ] {
        let e = join_failure(Status::new(code, "operation was canceled"));
        assert!(
            matches!(e, daemon::DaemonError::Unreachable(_)),
            "{code:?} is tried again, got {e:?}"
        );
    }
    for code in [
        Code::PermissionDenied,
        Code::AlreadyExists,
        Code::InvalidArgument,
        Code::Unauthenticated,
    ] {
        let e = join_failure(Status::new(code, "no"));
        assert!(
            matches!(e, daemon::DaemonError::JoinRefused(_)),
            "{code:?} is final, got {e:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_cut_off_in_flight_is_tried_again_not_taken_as_a_refusal() {
    let r = region().await;
    let gw = r.gateway("gw", |_| {}).await;
    let proxy = testkit::cut::Cut::to(gw.addr).await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![proxy.url()], dir.path(), "n-cut");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    // The join's transaction waits behind a lock a psql session holds, so
    // the request is in flight when the network under it fails.
    let holder = events::db::connect(&r.cfg, "lock-holder").await.unwrap();
    holder
        .batch_execute("BEGIN; LOCK TABLE strata.join_tokens IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let n = start(c);
    testkit::eventually(20, "the join waits on the lock", || async {
        r.count(
            "SELECT count(*) FROM pg_stat_activity
              WHERE query LIKE '%FROM strata.join_tokens%' AND wait_event_type = 'Lock'",
        )
        .await
            == 1
    })
    .await;
    assert!(proxy.cut() >= 1, "a connection was open to cut");
    holder.batch_execute("ROLLBACK").await.unwrap();
    testkit::eventually(
        30,
        "the node joins on a later try and opens a session",
        || async {
            assert!(
                !n.task.is_finished(),
                "the daemon gave up: {:?}",
                n.stats.connected.load(Ordering::Relaxed)
            );
            n.stats.connected.load(Ordering::Relaxed) == 1
        },
    )
    .await;
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_home_gateway_is_down_joins_through_another() {
    let r = region().await;
    let up = r.gateway("gw-up", |_| {}).await;
    // Nothing listens at `down`.
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("https://{}", l.local_addr().unwrap())
    };
    let node = (0..)
        .map(|i| format!("n{i}"))
        .find(|n| node::daemon::home_index(n, 2) == 0)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![down, url(&up)], dir.path(), &node);
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    assert_eq!(c.home(), 0, "home is the gateway that is down");
    let n = start(c);
    testkit::eventually(30, "the node joins and opens a session", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(
        r.count(&format!(
            "SELECT count(*) FROM strata.events WHERE stream = 'node/{node}' AND type = 'node.certificate_issued'"
        ))
        .await,
        1
    );
    n.stop().await.unwrap();
    up.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_returns_to_its_home_gateway_once_it_is_back() {
    let r = region().await;
    let a = r.gateway("gw-a", |_| {}).await;
    let b = r.gateway("gw-b", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![url(&a), url(&b)], dir.path(), "n1");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    c.return_home = Duration::from_millis(300);
    let home_is_a = c.home() == 0;
    let (home, away) = if home_is_a { (a, b) } else { (b, a) };
    let home_addr = home.addr;
    let n = start(c);
    testkit::eventually(20, "the session opens at home", || async {
        home.stats.sessions.load(Ordering::Relaxed) == 1
    })
    .await;
    // Home goes away: the node moves to the other gateway.
    home.stop().await.unwrap();
    testkit::eventually(20, "the node moves to the other gateway", || async {
        away.stats.sessions.load(Ordering::Relaxed) == 1
    })
    .await;
    // Home comes back at the same address: the node goes back to it and
    // leaves the other gateway.
    let home = r
        .gateway(if home_is_a { "gw-a" } else { "gw-b" }, |g| {
            g.listen = home_addr
        })
        .await;
    testkit::eventually(20, "the node is home again", || async {
        home.stats.sessions.load(Ordering::Relaxed) == 1
            && away.stats.sessions.load(Ordering::Relaxed) == 0
    })
    .await;
    assert_eq!(n.stats.returned_home.load(Ordering::Relaxed), 1);
    // Its sessions: home, away, home, each recorded by its gateway.
    let gateways: Vec<String> = r
        .client
        .query(
            "SELECT payload->>'gateway' FROM strata.events
              WHERE stream = 'node/n1' AND type = 'node.session_opened' ORDER BY position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    let (h, w) = if home_is_a {
        ("gw-a", "gw-b")
    } else {
        ("gw-b", "gw-a")
    };
    assert_eq!(gateways, [h, w, h]);
    n.stop().await.unwrap();
    home.stop().await.unwrap();
    away.stop().await.unwrap();
}

/// A Join call as any token holder could make it: the status it gets.
async fn join_as(r: &Region, gw: &Running, token: &str, node: &str) -> Result<(), tonic::Status> {
    join_with(r, gw, token, node, &new_csr()).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_token_cannot_take_an_existing_or_revoked_node_id() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let r = &r;
    let certificates = |node: &'static str| async move {
        r.count(&format!(
            "SELECT count(*) FROM strata.node_certificates WHERE node = '{node}'"
        ))
        .await
    };
    join_as(r, &gw, &r.token().await, "alpha").await.unwrap();
    // A second holder of a (fresh, valid) token claims alpha: refused, and
    // its token is not spent.
    let second = r.token().await;
    let err = join_as(r, &gw, &second, "alpha").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    assert_eq!(certificates("alpha").await, 1);
    join_as(r, &gw, &second, "other").await.unwrap();
    // A token made for one node admits no other.
    let for_beta = identity::create_token(&r.client, "p", Duration::from_secs(60), "beta")
        .await
        .unwrap();
    let err = join_as(r, &gw, &for_beta, "gamma").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("for node \"beta\""), "{err:?}");
    assert_eq!(certificates("gamma").await, 0);
    join_as(r, &gw, &for_beta, "beta").await.unwrap();
    // A token for an id pattern the operator chose admits those ids only.
    let rack = identity::create_token(&r.client, "p", Duration::from_secs(60), "rack7-*")
        .await
        .unwrap();
    let err = join_as(r, &gw, &rack, "rack8-1").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("matching \"rack7-*\""), "{err:?}");
    join_as(r, &gw, &rack, "rack7-1").await.unwrap();
    // A token revoked before it is used admits nobody; one spent cannot be
    // revoked, nor one unknown.
    let leaked = r.token().await;
    let id = identity::token_id(&leaked);
    assert_eq!(
        identity::revoke_token(&r.client, &id).await.unwrap(),
        identity::TokenRevoked::Revoked
    );
    let err = join_as(r, &gw, &leaked, "leak-1").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(
        err.message().contains("unknown, already used or expired"),
        "{err:?}"
    );
    assert_eq!(certificates("leak-1").await, 0);
    assert_eq!(
        identity::revoke_token(&r.client, &identity::token_id(&rack))
            .await
            .unwrap(),
        identity::TokenRevoked::AlreadyUnusable
    );
    assert_eq!(
        identity::revoke_token(&r.client, "00000000000000ff")
            .await
            .unwrap(),
        identity::TokenRevoked::NotFound
    );
    let listed = identity::list_tokens(&r.client).await.unwrap();
    let row = listed.iter().find(|t| t.id == id).expect("listed");
    assert_eq!(row.state, "expired");
    assert!(listed
        .iter()
        .any(|t| t.admits.as_deref() == Some("rack7-*") && t.state == "used"));
    // Revoked: a fresh pool token does not bring alpha back; one made for
    // alpha does.
    let mut admin = events::db::connect(&r.cfg, "admin").await.unwrap();
    identity::revoke(&mut admin, "alpha", "stolen")
        .await
        .unwrap();
    let err = join_as(r, &gw, &r.token().await, "alpha")
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("was revoked"), "{err:?}");
    let back = identity::create_token(&r.client, "p", Duration::from_secs(60), "alpha")
        .await
        .unwrap();
    join_as(r, &gw, &back, "alpha").await.unwrap();
    assert_eq!(certificates("alpha").await, 2);
    // Re-provisioned: one transaction revokes the certificate alpha holds
    // and makes a token for alpha alone; the new machine joins with it.
    let (pool, token) = identity::replace(
        &mut admin,
        "alpha",
        None,
        Duration::from_secs(60),
        "new disk",
    )
    .await
    .unwrap();
    assert_eq!(pool, "p");
    assert_eq!(
        r.count("SELECT count(*) FROM strata.node_certificates WHERE node = 'alpha' AND revoked_at IS NULL")
            .await,
        0
    );
    let err = join_as(r, &gw, &token, "other2").await.unwrap_err();
    assert!(err.message().contains("for node \"alpha\""), "{err:?}");
    join_as(r, &gw, &token, "alpha").await.unwrap();
    assert_eq!(
        r.count("SELECT count(*) FROM strata.node_certificates WHERE node = 'alpha' AND revoked_at IS NULL")
            .await,
        1
    );
    assert!(matches!(
        identity::replace(&mut admin, "nobody", None, Duration::from_secs(60), "").await,
        Err(identity::IdentityError::UnknownNode(_))
    ));
    // A bad token gets nothing.
    let err = join_as(r, &gw, "stj_00", "delta").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(gw.stats.refused_joins.load(Ordering::Relaxed) >= 4);
    gw.stop().await.unwrap();

    // Joins have a rate of their own.
    let gw = r.gateway("gw-b", |c| c.joins_per_second = 1.0).await;
    join_as(r, &gw, &r.token().await, "epsilon").await.unwrap();
    let err = join_as(r, &gw, &r.token().await, "zeta").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(err.metadata().get("retry-after-ms").is_some());
    gw.stop().await.unwrap();
}

/// A join from `from` until it is answered other than "too many joins".
async fn join_from(
    r: &Region,
    gw: &Running,
    from: std::net::IpAddr,
    token: &str,
    node: &str,
) -> Result<String, tonic::Status> {
    use gateway::proto::{join_client::JoinClient, JoinRequest};
    let mut client = JoinClient::new(join_channel(&r.ca_pem(), &url(gw), Some(from)).await);
    let csr = csr(&rcgen::KeyPair::generate().unwrap());
    loop {
        let answer = client
            .join(JoinRequest {
                token: token.into(),
                node_id: node.into(),
                csr_pem: csr.clone(),
            })
            .await;
        match answer {
            Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                let ms: u64 = e
                    .metadata()
                    .get("retry-after-ms")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(500);
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            other => return other.map(|r| r.into_inner().certificate_pem),
        }
    }
}

/// Garbage joins from `attacker`, about 50 a second, each sent without
/// waiting for the one before, until `stop`; then how many were answered
/// with each status code.
fn garbage_joins(
    r: &Region,
    gw: &Running,
    attacker: std::net::IpAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<std::collections::BTreeMap<String, u32>> {
    let (url, ca) = (url(gw), r.ca_pem());
    tokio::spawn(async move {
        use gateway::proto::{join_client::JoinClient, JoinRequest};
        let channel = join_channel(&ca, &url, Some(attacker)).await;
        let client = JoinClient::new(channel);
        let mut tries = Vec::new();
        let mut i = 0;
        while !stop.load(Ordering::Relaxed) {
            i += 1;
            let mut client = client.clone();
            tries.push(tokio::spawn(async move {
                let e = client
                    .join(JoinRequest {
                        token: format!("garbage-{i}"),
                        node_id: format!("x{i}"),
                        csr_pem: String::new(),
                    })
                    .await
                    .unwrap_err();
                format!("{:?}", e.code())
            }));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut codes = std::collections::BTreeMap::<String, u32>::new();
        for t in tries {
            *codes.entry(t.await.unwrap()).or_default() += 1;
        }
        codes
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_between_its_handshake_and_its_request_is_not_closed_for_a_newcomer() {
    let r = region().await;
    let gw = r
        .gateway("gw-gap", |c| {
            c.max_unauthenticated_connections = 2;
            c.request_deadline = Duration::from_secs(60);
        })
        .await;
    let (ca, u) = (r.ca_pem(), url(&gw));
    let token = r.token().await;
    // A joining node has its connection (TLS and HTTP/2 set up) and has not
    // sent its Join yet: on a busy machine that gap lasts a while.
    let joining = join_channel(&ca, &u, None).await;
    let other = join_channel(&ca, &u, None).await;
    // The share is full; a newcomer arrives in the gap. It may take a
    // place only from a connection that is not about to be served.
    let newcomer = {
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&ca))
            .domain_name("localhost");
        Endpoint::from_shared(u.clone())
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
    };
    join_over(joining, &token, "gap1")
        .await
        .expect("the joining node's connection was closed for a newcomer");
    drop((other, newcomer));
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_made_a_moment_ago_is_found_at_once_while_bad_ones_flood_in() {
    let r = region().await;
    // Every garbage join reaches the token check (no per-address slowing),
    // and real joins are not held back by the joins' own buckets.
    let gw = r
        .gateway("gw-fresh", |c| {
            c.bad_joins_per_source_per_second = 10_000.0;
            c.joins_per_second = 1_000.0;
        })
        .await;
    let attacker: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let node: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = garbage_joins(&r, &gw, attacker, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Ten nodes, one after the other, each with a token made just before
    // it joins: the check of the token must not wait for a reload of every
    // token that the flood's misses keep busy.
    let mut took = Duration::ZERO;
    for i in 0..10 {
        let token = r.token().await;
        let started = Instant::now();
        join_from(&r, &gw, node, &token, &format!("fresh{i}"))
            .await
            .unwrap();
        took += started.elapsed();
    }
    stop.store(true, Ordering::Relaxed);
    let codes = flood.await.unwrap();
    assert!(
        codes.get("PermissionDenied").is_some_and(|n| *n > 10),
        "the flood did not reach the token check: {codes:?}"
    );
    // Waiting for a once-a-second reload, ten joins take about 5 s.
    assert!(
        took < Duration::from_millis(2500),
        "ten joins with fresh tokens took {took:?}"
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_bad_join_tokens_from_one_address_does_not_keep_real_nodes_out() {
    let r = region().await;
    let gw = r.gateway("gw-flood", |c| c.joins_per_second = 2.0).await;
    let attacker: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let node: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    // ~50 garbage joins a second from one address.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = garbage_joins(&r, &gw, attacker, stop.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Six real nodes, each with its own token, join meanwhile, in time.
    let started = Instant::now();
    let mut tokens = Vec::new();
    for i in 0..6 {
        tokens.push((r.token().await, format!("real{i}")));
    }
    let joins = tokens
        .iter()
        .map(|(token, id)| join_from(&r, &gw, node, token, id));
    let joined = tokio::time::timeout(
        Duration::from_secs(20),
        futures_util::future::join_all(joins),
    )
    .await
    .expect("real nodes could not join during the flood");
    for j in joined {
        j.unwrap();
    }
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let codes = flood.await.unwrap();
    // Bad tokens are refused as such, and the address is slowed down.
    assert!(
        codes.get("PermissionDenied").is_some_and(|n| *n > 10),
        "{codes:?}"
    );
    assert!(
        codes.get("ResourceExhausted").is_some_and(|n| *n > 10),
        "{codes:?}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    gw.stop().await.unwrap();
}
