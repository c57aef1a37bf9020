//! The webhook sink against a real HTTP receiver and a real Postgres:
//! delivery in order with signatures, retries, parking and replay, pause and
//! resume, filters.

use bytes::Bytes;
use events::{Appender, AppenderConfig, ExpectedVersion, NewEvent, Reader, ReaderConfig};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use sinks::config::{self, Filter, SinkConfig, Target};
use sinks::{parked, webhook, Sinks, SinksConfig};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SECRET: &str = "a test secret";

/// A webhook receiver: checks signatures, records positions in arrival
/// order, fails on request.
#[derive(Default)]
struct Receiver {
    positions: Mutex<Vec<u64>>,
    fail_next: AtomicU32,
    always_fail: AtomicBool,
    bad_signatures: AtomicU32,
    requests: AtomicU32,
    /// Answer this many requests only after a second.
    slow_next: AtomicU32,
    /// The last request's Authorization header.
    authorization: Mutex<Option<String>>,
}

async fn receiver() -> (String, Arc<Receiver>) {
    receiver_on(None).await
}

/// A receiver; over TLS (`https://localhost:PORT/hook`) with `tls`.
async fn receiver_on(tls: Option<tokio_rustls::TlsAcceptor>) -> (String, Arc<Receiver>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = match &tls {
        None => format!("http://{}/hook", listener.local_addr().unwrap()),
        Some(_) => format!(
            "https://localhost:{}/hook",
            listener.local_addr().unwrap().port()
        ),
    };
    let state = Arc::new(Receiver::default());
    let s = state.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let s = s.clone();
            let tls = tls.clone();
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let s = s.clone();
                async move {
                    s.requests.fetch_add(1, Ordering::Relaxed);
                    *s.authorization.lock().unwrap() = req
                        .headers()
                        .get("authorization")
                        .map(|v| v.to_str().unwrap().to_string());
                    if s.slow_next
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                        .is_ok()
                    {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    let ts: u64 = req.headers()["x-strata-timestamp"]
                        .to_str()
                        .unwrap()
                        .parse()
                        .unwrap();
                    let sig = req.headers()["x-strata-signature"]
                        .to_str()
                        .unwrap()
                        .to_string();
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let fail = s.always_fail.load(Ordering::Relaxed)
                        || s.fail_next
                            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                                n.checked_sub(1)
                            })
                            .is_ok();
                    let status = if !webhook::verify(SECRET.as_bytes(), ts, &body, &sig) {
                        s.bad_signatures.fetch_add(1, Ordering::Relaxed);
                        401
                    } else if fail {
                        500
                    } else {
                        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                        let mut p = s.positions.lock().unwrap();
                        for e in v["events"].as_array().unwrap() {
                            p.push(e["position"].as_u64().unwrap());
                        }
                        200
                    };
                    Ok::<_, std::convert::Infallible>(
                        Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::new()))
                            .unwrap(),
                    )
                }
            });
            tokio::spawn(async move {
                let http = hyper::server::conn::http1::Builder::new();
                match tls {
                    None => {
                        let _ = http
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                            .await;
                    }
                    Some(tls) => {
                        // A client that does not trust the certificate ends here.
                        if let Ok(stream) = tls.accept(stream).await {
                            let _ = http
                                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                                .await;
                        }
                    }
                }
            });
        }
    });
    (url, state)
}

/// A webhook sink from the start of the log, taking the streams under `prefix`.
fn webhook_sink(
    name: &str,
    url: &str,
    secret_env: &str,
    prefix: &str,
    batch_max: usize,
    max_attempts: u32,
) -> SinkConfig {
    SinkConfig {
        name: name.into(),
        target: Target::Webhook {
            url: url.into(),
            secret_env: secret_env.into(),
        },
        filter: Filter {
            types: vec![],
            prefixes: vec![prefix.into()],
        },
        start: "start".into(),
        batch_max,
        max_attempts,
        retry: None,
        credentials: false,
    }
}

/// A replication reader whose slot goes with it.
fn temporary_reader(cfg: &tokio_postgres::Config, tag: &str) -> Reader {
    let mut rc = ReaderConfig::new(format!("sink_{tag}_{}", std::process::id()));
    rc.temporary = true;
    Reader::start(cfg.clone(), rc)
}

async fn append(appender: &Appender, stream: &str, n: usize) -> Vec<u64> {
    let mut out = Vec::new();
    for i in 0..n {
        let a = appender
            .append(
                stream,
                ExpectedVersion::Any,
                vec![NewEvent::new("t.happened", &serde_json::json!({ "i": i }))],
            )
            .await
            .unwrap();
        out.push(a.first_position.0);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_sink_delivers_in_order_retries_parks_and_replays() {
    std::env::set_var("STRATA_SINK_SECRET_TEST", SECRET);
    let url_db = testkit::migrated_database(testkit::shared_cluster()).await;
    let cfg: tokio_postgres::Config = url_db.parse().unwrap();
    let client = events::db::connect(&cfg, "test").await.unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let (url, rx) = receiver().await;

    // History before the sink exists, on two streams; the sink takes pool/ only.
    let mut want = append(&appender, "pool/a", 30).await;
    append(&appender, "other/b", 10).await;
    let sink = webhook_sink("hook", &url, "STRATA_SINK_SECRET_TEST", "pool/", 7, 3);
    config::create(&appender, &sink).await.unwrap();
    let err = config::create(&appender, &sink).await.unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    rx.fail_next.store(2, Ordering::Relaxed);
    let reader = temporary_reader(&cfg, "t");
    let sc = SinksConfig {
        poll: Duration::from_millis(200),
        backoff_base: Duration::from_millis(10),
        backoff_cap: Duration::from_millis(50),
        pause_after_parked: 3,
        request_timeout: Duration::from_secs(5),
        ..SinksConfig::default()
    };
    let sinks = Sinks::start(cfg.clone(), reader.clone(), sc).unwrap();
    testkit::eventually(30, "history delivered", || async {
        rx.positions.lock().unwrap().len() == 30
    })
    .await;
    // Live events too, all in log order, nothing from other/.
    want.extend(append(&appender, "pool/a", 20).await);
    testkit::eventually(30, "live delivered", || async {
        rx.positions.lock().unwrap().len() == 50
    })
    .await;
    assert_eq!(
        *rx.positions.lock().unwrap(),
        want,
        "in order, exactly the filtered events"
    );
    assert!(
        rx.requests.load(Ordering::Relaxed) >= 2 + 50 / 7,
        "the failures were retried"
    );
    assert_eq!(rx.bad_signatures.load(Ordering::Relaxed), 0);

    // A receiver that keeps failing: the batch is parked and the sink goes on.
    rx.always_fail.store(true, Ordering::Relaxed);
    let stuck = append(&appender, "pool/a", 5).await;
    testkit::eventually(30, "the failing batch is parked", || async {
        parked::list(&client, "hook").await.unwrap().len() == 5
    })
    .await;
    rx.always_fail.store(false, Ordering::Relaxed);
    let after = append(&appender, "pool/a", 3).await;
    testkit::eventually(30, "later events still flow", || async {
        rx.positions.lock().unwrap().len() == 53
    })
    .await;
    let p = parked::list(&client, "hook").await.unwrap();
    assert_eq!(p.iter().map(|x| x.position).collect::<Vec<_>>(), stuck);
    assert!(p[0].error.contains("500"), "{p:?}");
    let http = webhook::client(None).unwrap();
    let n = parked::replay(&client, &http, "hook", &url, SECRET.as_bytes())
        .await
        .unwrap();
    assert_eq!(n, 5);
    assert!(parked::list(&client, "hook").await.unwrap().is_empty());
    let got = rx.positions.lock().unwrap().clone();
    assert_eq!(got[50..53], after[..]);
    assert_eq!(got[53..], stuck[..]);

    // Paused: nothing is delivered; resumed: it catches up.
    config::change(&appender, "hook", "sink.paused")
        .await
        .unwrap();
    testkit::eventually(10, "the worker stops", || async {
        sinks.stats.workers.load(Ordering::Relaxed) == 0
    })
    .await;
    let paused = append(&appender, "pool/a", 4).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(rx.positions.lock().unwrap().len(), 58);
    config::change(&appender, "hook", "sink.resumed")
        .await
        .unwrap();
    testkit::eventually(30, "caught up after resuming", || async {
        rx.positions.lock().unwrap().len() == 62
    })
    .await;
    assert_eq!(rx.positions.lock().unwrap()[58..], paused[..]);
    let listed = config::list(&client).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(!listed[0].paused);

    // A receiver that stays down: after three parked batches in a row the
    // sink pauses itself with an alert instead of parking everything.
    rx.always_fail.store(true, Ordering::Relaxed);
    for _ in 0..6 {
        append(&appender, "pool/a", 7).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    testkit::eventually(30, "the failing sink paused itself", || async {
        config::list(&client).await.unwrap()[0].paused
    })
    .await;
    assert_eq!(sinks.stats.alerts.load(Ordering::Relaxed), 1);
    let alerts: i64 = client
        .query_one(
            "SELECT count(*) FROM strata.events WHERE stream = 'sink/hook' AND type = 'sink.alerted'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(alerts, 1);
    let parked_now = parked::list(&client, "hook").await.unwrap().len();
    assert!(
        (3..=21).contains(&parked_now),
        "a few batches parked, not everything: {parked_now}"
    );
    // Resumed once the receiver is back, it catches up on what it had not taken.
    rx.always_fail.store(false, Ordering::Relaxed);
    let before = rx.positions.lock().unwrap().len();
    config::change(&appender, "hook", "sink.resumed")
        .await
        .unwrap();
    testkit::eventually(30, "caught up after the alert", || async {
        rx.positions.lock().unwrap().len() + parked_now == before + 42
    })
    .await;
    config::change(&appender, "hook", "sink.deleted")
        .await
        .unwrap();
    assert!(config::list(&client).await.unwrap().is_empty());

    // The name again, while the sinks process runs: a new sink from its own
    // start (now), with none of the old one's cursor or parked events.
    testkit::eventually(10, "the deleted sink's worker stops", || async {
        sinks.stats.workers.load(Ordering::Relaxed) == 0
    })
    .await;
    let mut admin = events::db::connect(&cfg, "test").await.unwrap();
    let again = SinkConfig {
        start: "now".into(),
        ..webhook_sink("hook", &url, "STRATA_SINK_SECRET_TEST", "pool/", 7, 3)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match config::create_in(&mut admin, &again).await {
            Ok(()) => break,
            Err(e) if e.to_string().contains("still being stopped") => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the old subscription stays held"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(parked::list(&client, "hook").await.unwrap().is_empty());
    let err = config::create_in(&mut admin, &again).await.unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    testkit::eventually(10, "the new sink's worker starts", || async {
        sinks.stats.workers.load(Ordering::Relaxed) == 1
    })
    .await;
    let before = rx.positions.lock().unwrap().len();
    let fresh = append(&appender, "pool/a", 3).await;
    testkit::eventually(30, "the new sink delivers", || async {
        rx.positions.lock().unwrap().len() >= before + 3
    })
    .await;
    assert_eq!(
        rx.positions.lock().unwrap()[before..],
        fresh[..],
        "only what came after it"
    );
    sinks.stop().await;
}

/// The NATS server the tests use (with JetStream).
fn nats_url() -> String {
    std::env::var("STRATA_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_sink_stores_each_event_once_in_jetstream() {
    let url_db = testkit::migrated_database(testkit::shared_cluster()).await;
    let cfg: tokio_postgres::Config = url_db.parse().unwrap();
    let client = events::db::connect(&cfg, "test").await.unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let nats = async_nats::connect(nats_url())
        .await
        .expect("a NATS server with JetStream (.ci/run starts one)");
    let js = async_nats::jetstream::new(nats);
    let prefix = format!("strata_t{}", std::process::id());
    let name = format!("STRATA_T{}", std::process::id());
    let _ = js.delete_stream(&name).await;
    let mut stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();
    let positions = append(&appender, "pool/a", 40).await;
    let sink = |n: &str| SinkConfig {
        name: n.into(),
        target: Target::Nats {
            url: nats_url(),
            subject_prefix: prefix.clone(),
        },
        filter: Filter {
            types: vec![],
            prefixes: vec!["pool/".into()],
        },
        start: "start".into(),
        batch_max: 16,
        max_attempts: 3,
        retry: None,
        credentials: false,
    };
    config::create(&appender, &sink("js")).await.unwrap();
    let mut rc = ReaderConfig::new(format!("sink_n_{}", std::process::id()));
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let sinks = Sinks::start(
        cfg.clone(),
        reader.clone(),
        SinksConfig {
            poll: Duration::from_millis(200),
            ..SinksConfig::default()
        },
    )
    .unwrap();
    let count = |s: &mut async_nats::jetstream::stream::Stream| {
        let s = s.clone();
        async move {
            let mut s = s;
            s.info().await.unwrap().state.messages
        }
    };
    let mut polls = 0;
    while count(&mut stream).await < 40 && polls < 300 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        polls += 1;
    }
    assert_eq!(count(&mut stream).await, 40);
    // The first message is the first event, on its derived subject, with
    // its position as the message id.
    let first = stream.get_raw_message(1).await.unwrap();
    assert_eq!(
        first.subject.as_str(),
        format!("{prefix}.pool.a.t.happened")
    );
    assert_eq!(
        first.headers.get("Nats-Msg-Id").unwrap().as_str(),
        format!("default:js:{}", positions[0])
    );
    // The same sink publishing a batch again (a retry, a parked replay)
    // adds nothing to the stream.
    let again = events::read::after(&client, events::Position(0), 10)
        .await
        .unwrap();
    let again: Vec<&events::Event> = again
        .iter()
        .map(|e| &**e)
        .filter(|e| e.stream == "pool/a")
        .collect();
    sinks::nats::publish(&js, &prefix, ("default", "js"), &again)
        .await
        .unwrap();
    assert_eq!(
        count(&mut stream).await,
        40,
        "a retried batch is dropped as duplicates"
    );
    // A second sink on the same stream publishes the same events under
    // its own ids: they are its deliveries, not the first sink's duplicates.
    config::create(&appender, &sink("js-again")).await.unwrap();
    let head = events::read::head(&client).await.unwrap().0 as i64;
    let mut polls = 0;
    loop {
        let cursor: Option<i64> = client
            .query_opt(
                "SELECT position FROM strata.subscriptions WHERE name = 'sink.js-again'",
                &[],
            )
            .await
            .unwrap()
            .map(|r| r.get(0));
        if cursor.is_some_and(|c| c >= head) || polls > 300 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        polls += 1;
    }
    assert_eq!(
        sinks.stats.delivered.load(Ordering::Relaxed),
        80,
        "both sinks published everything"
    );
    let mut polls = 0;
    while count(&mut stream).await < 80 && polls < 300 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        polls += 1;
    }
    assert_eq!(
        count(&mut stream).await,
        80,
        "each sink's events are its own, none dropped as another's duplicates"
    );
    sinks.stop().await;
    let _ = js.delete_stream(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_times_out_and_the_batch_is_retried() {
    std::env::set_var("STRATA_SINK_SECRET_TEST", SECRET);
    let url_db = testkit::migrated_database(testkit::shared_cluster()).await;
    let cfg: tokio_postgres::Config = url_db.parse().unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let (url, rx) = receiver().await;
    rx.slow_next.store(2, Ordering::Relaxed);
    let want = append(&appender, "pool/s", 10).await;
    let sink = webhook_sink("slow", &url, "STRATA_SINK_SECRET_TEST", "pool/", 100, 5);
    config::create(&appender, &sink).await.unwrap();
    let reader = temporary_reader(&cfg, "s");
    let sinks = Sinks::start(
        cfg.clone(),
        reader,
        SinksConfig {
            poll: Duration::from_millis(200),
            backoff_base: Duration::from_millis(10),
            backoff_cap: Duration::from_millis(50),
            pause_after_parked: 3,
            request_timeout: Duration::from_millis(200),
            ..SinksConfig::default()
        },
    )
    .unwrap();
    testkit::eventually(30, "delivered after the slow answers", || async {
        rx.positions.lock().unwrap().len() >= 10
    })
    .await;
    // The slow requests timed out on the sink's side (the receiver may still
    // have recorded them late), so the batch went again: at least once.
    let got = rx.positions.lock().unwrap().clone();
    let distinct: std::collections::BTreeSet<u64> = got.iter().copied().collect();
    assert_eq!(distinct.into_iter().collect::<Vec<_>>(), want);
    assert!(
        rx.requests.load(Ordering::Relaxed) >= 3,
        "two timed out, then one got through"
    );
    assert_eq!(sinks.stats.parked.load(Ordering::Relaxed), 0);
    sinks.stop().await;
}

/// A CA (PEM) and a TLS acceptor for `localhost` with a certificate it signed.
fn private_ca() -> (String, tokio_rustls::TlsAcceptor) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    (
        ca_cert.pem(),
        tokio_rustls::TlsAcceptor::from(Arc::new(config)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_sink_delivers_over_https_when_it_trusts_the_receivers_ca() {
    std::env::set_var("STRATA_SINK_SECRET_TEST_TLS", SECRET);
    let url_db = testkit::migrated_database(testkit::shared_cluster()).await;
    let cfg: tokio_postgres::Config = url_db.parse().unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let (ca_pem, acceptor) = private_ca();
    let (url, rx) = receiver_on(Some(acceptor)).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca_pem).unwrap();

    // Without the CA the receiver's certificate is not trusted: nothing is
    // delivered, and the error says why.
    let body = Bytes::from_static(b"{}");
    let untrusting = webhook::client(None).unwrap();
    let err = webhook::post(
        &untrusting,
        &url,
        SECRET.as_bytes(),
        body.clone(),
        Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    assert_eq!(rx.requests.load(Ordering::Relaxed), 0);
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    assert!(webhook::client(Some(&empty))
        .unwrap_err()
        .contains("no PEM certificate"));
    assert!(webhook::client(Some(&dir.path().join("missing.pem"))).is_err());

    let want = append(&appender, "pool/tls", 12).await;
    let sink = webhook_sink(
        "tls-hook",
        &url,
        "STRATA_SINK_SECRET_TEST_TLS",
        "pool/tls",
        5,
        3,
    );
    config::create(&appender, &sink).await.unwrap();
    let reader = temporary_reader(&cfg, "tls");
    let sinks = Sinks::start(
        cfg.clone(),
        reader,
        SinksConfig {
            poll: Duration::from_millis(200),
            webhook_ca: Some(ca_file),
            ..SinksConfig::default()
        },
    )
    .unwrap();
    testkit::eventually(30, "delivered over https", || async {
        rx.positions.lock().unwrap().len() >= want.len()
    })
    .await;
    assert_eq!(*rx.positions.lock().unwrap(), want);
    assert_eq!(rx.bad_signatures.load(Ordering::Relaxed), 0);
    sinks.stop().await;
}

/// A `nats-server` with JetStream that wants a user and password.
struct AuthNats {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for AuthNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nats_with_password(user: &str, password: &str) -> AuthNats {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let child = std::process::Command::new("nats-server")
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string()])
        .args(["--user", user, "--pass", password, "-sd"])
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nats-server is on this machine");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "nats-server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    AuthNats {
        child,
        port,
        _dir: dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sinks_url_credentials_stay_out_of_the_log_and_it_still_delivers() {
    let url_db = testkit::migrated_database(testkit::shared_cluster()).await;
    let cfg: tokio_postgres::Config = url_db.parse().unwrap();
    let mut client = events::db::connect(&cfg, "test").await.unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let nats = nats_with_password("alice", "s3cr3t-pw");
    let with_creds = format!("nats://alice:s3cr3t-pw@127.0.0.1:{}", nats.port);
    let prefix = "credtest";
    sinks::nats::ensure_stream(&with_creds, prefix, true)
        .await
        .unwrap();
    // A wrong password's error names the server, never the password.
    let wrong = format!("nats://alice:not-the-pw@127.0.0.1:{}", nats.port);
    let err = sinks::nats::ensure_stream(&wrong, prefix, true)
        .await
        .unwrap_err();
    assert!(
        !err.contains("not-the-pw") && err.contains("***@127.0.0.1"),
        "{err}"
    );

    let sink = SinkConfig {
        name: "cred".into(),
        target: Target::Nats {
            url: with_creds.clone(),
            subject_prefix: prefix.into(),
        },
        filter: Filter {
            types: vec![],
            prefixes: vec!["pool/".into()],
        },
        start: "start".into(),
        batch_max: 16,
        max_attempts: 3,
        retry: None,
        credentials: false,
    };
    // Through the appender alone there is nowhere to keep them: refused.
    let err = config::create(&appender, &sink).await.unwrap_err();
    assert!(err.to_string().contains("kept apart from the log"), "{err}");
    config::create_in(&mut client, &sink).await.unwrap();
    let recorded: String = client
        .query_one(
            "SELECT payload::text FROM strata.events WHERE stream = 'sink/cred'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !recorded.contains("s3cr3t-pw") && !recorded.contains("alice"),
        "{recorded}"
    );
    assert!(recorded.contains("\"credentials\": true"), "{recorded}");
    let listed = config::list(&client).await.unwrap();
    assert_eq!(
        listed[0].config.url(),
        format!("nats://127.0.0.1:{}", nats.port)
    );

    // The sinks process puts them back to connect, and delivers.
    append(&appender, "pool/a", 5).await;
    let mut rc = ReaderConfig::new(format!("sink_c_{}", std::process::id()));
    rc.temporary = true;
    let reader = Reader::start(cfg.clone(), rc);
    let sinks = Sinks::start(
        cfg.clone(),
        reader.clone(),
        SinksConfig {
            poll: Duration::from_millis(200),
            ..SinksConfig::default()
        },
    )
    .unwrap();
    let js = async_nats::jetstream::new(
        async_nats::ConnectOptions::with_user_and_password("alice".into(), "s3cr3t-pw".into())
            .connect(format!("127.0.0.1:{}", nats.port))
            .await
            .unwrap(),
    );
    let mut stream = js.get_stream("credtest").await.unwrap();
    let mut polls = 0;
    while stream.info().await.unwrap().state.messages < 5 && polls < 300 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        polls += 1;
    }
    assert_eq!(stream.info().await.unwrap().state.messages, 5);
    sinks.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_never_answers_holds_up_no_other_sink() {
    std::env::set_var("STRATA_SINK_SECRET_TEST", SECRET);
    let url_db = testkit::migrated_database(testkit::shared_cluster()).await;
    let cfg: tokio_postgres::Config = url_db.parse().unwrap();
    let mut client = events::db::connect(&cfg, "test").await.unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    // A receiver that takes connections and never answers.
    let stalled = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stalled_url = format!("http://{}/hook", stalled.local_addr().unwrap());
    let accepted = Arc::new(AtomicU32::new(0));
    let held = {
        let accepted = accepted.clone();
        tokio::spawn(async move {
            let mut sockets = Vec::new();
            while let Ok((s, _)) = stalled.accept().await {
                accepted.fetch_add(1, Ordering::Relaxed);
                sockets.push(s);
            }
        })
    };
    append(&appender, "pool/a", 3).await;
    let stall = webhook_sink(
        "stall",
        &stalled_url,
        "STRATA_SINK_SECRET_TEST",
        "pool/",
        10,
        10,
    );
    config::create(&appender, &stall).await.unwrap();
    let reader = temporary_reader(&cfg, "stall");
    let sc = SinksConfig {
        poll: Duration::from_millis(200),
        backoff_base: Duration::from_millis(10),
        backoff_cap: Duration::from_millis(50),
        request_timeout: Duration::from_secs(30),
        ..SinksConfig::default()
    };
    let sinks = Sinks::start(cfg.clone(), reader.clone(), sc).unwrap();
    testkit::eventually(20, "the stalled receiver is being posted to", || async {
        accepted.load(Ordering::Relaxed) >= 1
    })
    .await;
    // Pausing it stops its worker mid-delivery, and the runner goes on: a
    // new sink starts and delivers at once.
    let paused = std::time::Instant::now();
    assert!(
        config::apply(&client, &appender, "stall", sinks::catalog::SINK_PAUSED)
            .await
            .unwrap()
    );
    let (url, rx) = receiver().await;
    let with_credentials = url.replacen("http://", "http://bob:pw@", 1);
    let next = webhook_sink(
        "next",
        &with_credentials,
        "STRATA_SINK_SECRET_TEST",
        "pool/",
        10,
        3,
    );
    config::create_in(&mut client, &next).await.unwrap();
    testkit::eventually(10, "the new sink delivers", || async {
        rx.positions.lock().unwrap().len() == 3
    })
    .await;
    assert!(
        paused.elapsed() < Duration::from_secs(8),
        "{:?}",
        paused.elapsed()
    );
    // The URL's credentials went as Basic authentication ("bob:pw").
    assert_eq!(
        rx.authorization.lock().unwrap().as_deref(),
        Some("Basic Ym9iOnB3")
    );
    testkit::eventually(10, "only the new sink's worker runs", || async {
        sinks.stats.workers.load(Ordering::Relaxed) == 1
    })
    .await;
    sinks.stop().await;
    held.abort();
}
