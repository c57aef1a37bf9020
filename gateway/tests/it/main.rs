//! The gateway and the node daemon against a real Postgres, over real mutual
//! TLS: joins, identity refusals, admission pushback, inventory, heartbeat
//! transitions, session fencing, malformed messages.

use events::{Appender, AppenderConfig, ExpectedVersion};
use gateway::ca::{self, Ca};
use gateway::identity;
use gateway::server::{self, GatewayConfig, Running};
use node::daemon::{self, DaemonConfig, DaemonStats};
use node::gpu::FakeGpus;
use projections::Fact;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_postgres::{Client, Config};

mod authz;
mod cut;
mod limits;
mod renewal;
mod topology;

struct Region {
    cfg: Config,
    client: Client,
    appender: Appender,
    ca_dir: tempfile::TempDir,
}

async fn region() -> Region {
    region_on(schema::testing::shared_cluster()).await
}

/// A region on a cluster of the test's own (one it may crash).
async fn region_on(cluster: &schema::Cluster) -> Region {
    let url = schema::testing::migrated_database(cluster).await;
    let cfg: Config = url.parse().unwrap();
    let client = events::db::connect(&cfg, "test").await.unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let fact = Fact::PoolCreated {
        description: String::new(),
    };
    appender
        .append("pool/p", ExpectedVersion::NoStream, vec![fact.to_event()])
        .await
        .unwrap();
    let ca_dir = tempfile::tempdir().unwrap();
    ca::init(ca_dir.path(), "test").unwrap();
    Region {
        cfg,
        client,
        appender,
        ca_dir,
    }
}

impl Region {
    async fn gateway(&self, id: &str, tweak: impl FnOnce(&mut GatewayConfig)) -> Running {
        let mut c = GatewayConfig::new(id, "127.0.0.1:0".parse().unwrap(), self.ca_dir.path());
        c.heartbeat = Duration::from_secs(1);
        tweak(&mut c);
        server::start(self.cfg.clone(), self.reader(), self.appender.clone(), c)
            .await
            .unwrap()
    }

    fn reader(&self) -> events::Reader {
        static SLOT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let mut rc = events::ReaderConfig::new(format!(
            "gw_{}_{}",
            std::process::id(),
            SLOT.fetch_add(1, Ordering::Relaxed)
        ));
        rc.temporary = true;
        events::Reader::start(self.cfg.clone(), rc)
    }

    async fn token(&self) -> String {
        identity::create_token(&self.client, "p", Duration::from_secs(600), "*")
            .await
            .unwrap()
    }

    fn ca_pem(&self) -> String {
        std::fs::read_to_string(self.ca_dir.path().join(ca::CA_CERT)).unwrap()
    }

    async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.unwrap().get(0)
    }
}

/// A daemon's configuration for `node`, with a join token and the CA.
async fn joining(r: &Region, gw: &Running, dir: &std::path::Path, node: &str) -> DaemonConfig {
    let mut c = config(vec![url(gw)], dir, node);
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    c
}

/// Node n1 started and in its pool, and a placer.
async fn n1_and_a_placer(
    r: &Region,
    gw: &Running,
    dir: &std::path::Path,
) -> (Node, placer::Placer) {
    let n = start(joining(r, gw, dir, "n1").await);
    eventually(20, "n1's inventory is in the pool", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'node.joined'")
            .await
            == 1
    })
    .await;
    let placer = placer::Placer::start(
        r.cfg.clone(),
        r.reader(),
        r.appender.clone(),
        placer::PlacerConfig::new("api-test"),
    );
    (n, placer)
}

/// A mutual-TLS channel to the gateway with a node's credentials.
async fn node_channel(
    gw: &Running,
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_shared(url(gw))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca_pem))
                .identity(tonic::transport::Identity::from_pem(cert_pem, key_pem))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
}

/// A certificate signing request for a new key.
fn new_csr() -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    rcgen::CertificateParams::new(Vec::<String>::new())
        .unwrap()
        .serialize_request(&key)
        .unwrap()
        .pem()
        .unwrap()
}

/// A client-API connection with this certificate.
async fn api_as(
    r: &Region,
    gw: &Running,
    cert: String,
    key: String,
) -> gateway::api_proto::api_client::ApiClient<tonic::transport::Channel> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(r.ca_pem()))
        .identity(Identity::from_pem(cert, key))
        .domain_name("localhost");
    let ep = Endpoint::from_shared(url(gw))
        .unwrap()
        .tls_config(tls)
        .unwrap();
    gateway::api_proto::api_client::ApiClient::new(ep.connect().await.unwrap())
}

/// Gives `operator` the admin role.
async fn admin(r: &Region, operator: &str) {
    gateway::roles::set(
        &r.appender,
        operator,
        &gateway::roles::Assignment {
            role: gateway::roles::Role::Admin,
            pools: vec![],
        },
    )
    .await
    .unwrap();
}

fn url(gw: &Running) -> String {
    format!("https://{}", gw.addr)
}

struct Node {
    stats: Arc<DaemonStats>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), daemon::DaemonError>>,
}

impl Node {
    async fn stop(self) -> Result<(), daemon::DaemonError> {
        let _ = self.stop.send(true);
        self.task.await.unwrap()
    }
}

fn config(gateways: Vec<String>, dir: &std::path::Path, node: &str) -> DaemonConfig {
    let backend = Arc::new(FakeGpus::parse("8xH100-80GB", node).unwrap());
    let mut c = DaemonConfig::new(gateways, dir.join(node), node, backend);
    c.backoff_base = Duration::from_millis(50);
    c.backoff_cap = Duration::from_millis(500);
    c
}

fn start(c: DaemonConfig) -> Node {
    let stats = Arc::new(DaemonStats::default());
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(daemon::run(c, stats.clone(), rx));
    Node { stats, stop, task }
}

async fn eventually<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_holds_a_session_and_sends_only_changed_inventory() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![url(&gw)], dir.path(), "n1");
    // Without a token there is nothing to join with.
    let err = daemon::ensure_joined(&c).await.err().unwrap();
    assert!(matches!(err, daemon::DaemonError::NeedsJoin), "{err}");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    let n = start(c.clone());
    eventually(20, "the session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    eventually(20, "the inventory reaches the pool stream", || async {
        r.count(
            "SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type = 'node.joined'",
        )
        .await
            == 1
    })
    .await;
    let payload: serde_json::Value = r
        .client
        .query_one(
            "SELECT payload FROM strata.events WHERE type = 'node.joined'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(payload["devices"].as_array().unwrap().len(), 8);
    assert_eq!(payload["node"], "n1");
    for t in ["node.certificate_issued", "node.session_opened"] {
        let n: i64 = r
            .client
            .query_one(
                "SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = $1",
                &[&t],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1, "{t}");
    }
    // The key is the node's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path().join("n1/node.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // The token is spent.
    let again = daemon::ensure_joined(&{
        let mut c2 = config(vec![url(&gw)], dir.path(), "n2");
        c2.token = c.token.clone();
        c2.ca_pem = Some(r.ca_pem());
        c2
    })
    .await
    .err()
    .unwrap();
    assert!(
        again
            .to_string()
            .contains("unknown, already used or expired"),
        "{again}"
    );

    // Restarted, it keeps its certificate and the unchanged inventory does
    // not travel again.
    n.stop().await.unwrap();
    let mut restarted = config(vec![url(&gw)], dir.path(), "n1");
    restarted.token = None;
    let n = start(restarted);
    eventually(20, "the second session opens", || async {
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.session_opened'").await == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE type = 'node.joined'")
            .await,
        1,
        "an unchanged section is not sent again"
    );
    let opened_at = r
        .count("SELECT max(version) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.session_opened'")
        .await;
    assert_eq!(
        n.stats.epoch.load(Ordering::Relaxed),
        opened_at as u64,
        "epoch = the node stream's version at the session's opening"
    );
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_ca_revoked_and_impersonating_nodes_are_refused() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();

    // A certificate from another CA: the TLS handshake itself fails.
    let other = tempfile::tempdir().unwrap();
    ca::init(other.path(), "elsewhere").unwrap();
    let (cert, key) = Ca::load(other.path())
        .unwrap()
        .client_identity("n9")
        .unwrap();
    let ndir = dir.path().join("n9");
    std::fs::create_dir_all(&ndir).unwrap();
    std::fs::write(ndir.join("node.pem"), cert).unwrap();
    std::fs::write(ndir.join("node.key"), key).unwrap();
    std::fs::write(ndir.join("ca.pem"), r.ca_pem()).unwrap();
    let n = start(config(vec![url(&gw)], dir.path(), "n9"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(n.stats.sessions.load(Ordering::Relaxed), 0);
    assert!(
        n.stats.connects.load(Ordering::Relaxed) == 0
            || gw.stats.sessions_opened.load(Ordering::Relaxed) == 0
    );
    let _ = n.stop().await;

    // A certificate from this CA that was never recorded: refused.
    let (cert, key) = Ca::load(r.ca_dir.path())
        .unwrap()
        .client_identity("n8")
        .unwrap();
    let ndir = dir.path().join("n8");
    std::fs::create_dir_all(&ndir).unwrap();
    std::fs::write(ndir.join("node.pem"), cert).unwrap();
    std::fs::write(ndir.join("node.key"), key).unwrap();
    std::fs::write(ndir.join("ca.pem"), r.ca_pem()).unwrap();
    let n = start(config(vec![url(&gw)], dir.path(), "n8"));
    let err = tokio::time::timeout(Duration::from_secs(20), n.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("not issued to a node of this region"),
        "{err}"
    );

    // A joined node, then revoked: its next session is refused for good.
    let mut c = config(vec![url(&gw)], dir.path(), "n1");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    let n = start(c.clone());
    eventually(20, "n1's session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    // Revoked while connected: the live session ends and the daemon stops.
    let mut own = events::db::connect(&r.cfg, "revoke").await.unwrap();
    let revoked = identity::revoke(&mut own, "n1", "test").await.unwrap();
    assert_eq!(revoked, 1);
    let err = tokio::time::timeout(Duration::from_secs(20), n.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("revoked"), "{err}");
    // And a new session is refused.
    let n = start(c.clone());
    let err = tokio::time::timeout(Duration::from_secs(20), n.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("revoked"), "{err}");
    assert!(gw.stats.refused_identity.load(Ordering::Relaxed) >= 2);

    // n2's certificate speaking for n3 in its Hello: refused.
    let mut c2 = config(vec![url(&gw)], dir.path(), "n2");
    c2.token = Some(r.token().await);
    c2.ca_pem = Some(r.ca_pem());
    daemon::ensure_joined(&c2).await.unwrap();
    std::fs::create_dir_all(dir.path().join("n3")).unwrap();
    for f in ["node.pem", "node.key", "ca.pem", "pool"] {
        std::fs::copy(dir.path().join("n2").join(f), dir.path().join("n3").join(f)).unwrap();
    }
    let n = start(config(vec![url(&gw)], dir.path(), "n3"));
    let err = tokio::time::timeout(Duration::from_secs(20), n.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(
        err.to_string().contains("may not speak for \"n3\""),
        "{err}"
    );
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n3'")
            .await,
        0,
        "nothing was written for the impersonated node"
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_refusals_carry_pushback_and_daemons_wait() {
    let r = region().await;
    let gw = r
        .gateway("gw-a", |c| {
            c.max_streams = 2;
        })
        .await;
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = Vec::new();
    for i in 0..3 {
        let mut c = config(vec![url(&gw)], dir.path(), &format!("n{i}"));
        c.token = Some(r.token().await);
        c.ca_pem = Some(r.ca_pem());
        daemon::ensure_joined(&c).await.unwrap();
        nodes.push(start(c));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    eventually(20, "two sessions open", || async {
        gw.stats.sessions.load(Ordering::Relaxed) == 2
    })
    .await;
    eventually(20, "the third was pushed back", || async {
        nodes[2].stats.pushbacks.load(Ordering::Relaxed) >= 1
    })
    .await;
    let third = &nodes[2].stats;
    assert_eq!(third.sessions.load(Ordering::Relaxed), 0);
    // It waits what it was told (5 s, jittered to at least 2.5 s), not its
    // own 50 ms backoff.
    assert!(
        third.pushback_wait_ms.load(Ordering::Relaxed) >= 2500,
        "{third:?}"
    );
    let refused = gw.stats.refused_full.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        gw.stats.refused_full.load(Ordering::Relaxed),
        refused,
        "no retry storm while pushed back"
    );
    // When one leaves, the third gets in.
    nodes.remove(0).stop().await.unwrap();
    eventually(30, "the third session opens", || async {
        nodes[1].stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    for n in nodes {
        n.stop().await.unwrap();
    }
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_become_transitions_and_a_newer_session_fences_the_older() {
    let r = region().await;
    let a = r.gateway("gw-a", |_| {}).await;
    let b = r.gateway("gw-b", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![url(&a)], dir.path(), "n1");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    let n = start(c.clone());
    eventually(20, "the session on a opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    // Heartbeats every second are not written.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(n.stats.heartbeats.load(Ordering::Relaxed) >= 2);
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type LIKE 'node.%reachable'").await,
        0
    );
    // The node moves to b (a is still up): b's session is newer.
    n.stop().await.unwrap();
    let mut moved = c.clone();
    moved.gateways = vec![url(&b)];
    let n = start(moved);
    eventually(20, "the session on b opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    // a notices the missed heartbeats; its write is refused by the fence.
    eventually(20, "a is fenced", || async {
        a.stats.fenced.load(Ordering::Relaxed) >= 1
    })
    .await;
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.marked_unreachable'").await,
        0,
        "the fenced owner wrote nothing"
    );
    // b writes the transition when the node goes quiet.
    n.stop().await.unwrap();
    eventually(20, "b marks n1 unreachable", || async {
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.marked_unreachable'").await == 1
    })
    .await;
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_messages_get_errors_and_the_gateway_stays_up() {
    use node::proto::{node_message, session_client::SessionClient, Hello, NodeMessage};
    let r = region().await;
    let gw = r
        .gateway("gw-a", |c| {
            c.max_message_bytes = 64 * 1024;
        })
        .await;
    let dir = tempfile::tempdir().unwrap();
    let c = joining(&r, &gw, dir.path(), "n1").await;
    let creds = daemon::ensure_joined(&c).await.unwrap();
    let channel = node_channel(&gw, &creds.ca_pem, &creds.cert_pem, &creds.key_pem)
        .await
        .unwrap();

    // Bytes that are not a NodeMessage.
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let garbage =
        futures_util::stream::iter(vec![Raw(vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01])]);
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/strata.node.v1.Session/Open");
    let resp = grpc
        .streaming::<_, Raw, Raw, RawCodec>(tonic::Request::new(garbage), path, RawCodec)
        .await;
    let status = match resp {
        Err(s) => s,
        Ok(r) => r
            .into_inner()
            .message()
            .await
            .err()
            .expect("an error, not a message"),
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("malformed"), "{status:?}");

    // An oversized Hello.
    let big = NodeMessage {
        body: Some(node_message::Body::Hello(Hello {
            node_id: "n1".into(),
            agent_version: "x".repeat(100 * 1024),
            ..Hello::default()
        })),
    };
    let mut client = SessionClient::new(channel.clone());
    let status = match client.open(futures_util::stream::iter(vec![big])).await {
        Err(s) => s,
        Ok(r) => r.into_inner().message().await.expect_err("an error"),
    };
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");

    // A session that starts with something other than Hello.
    let hb = NodeMessage {
        body: Some(node_message::Body::Heartbeat(Default::default())),
    };
    let status = match client.open(futures_util::stream::iter(vec![hb])).await {
        Err(s) => s,
        Ok(r) => r.into_inner().message().await.expect_err("an error"),
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");

    // And the gateway still serves a good node.
    let n = start(c);
    eventually(20, "a good session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    assert!(!gw.is_finished());
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

/// Raw bytes through gRPC framing.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Raw;
    type Decode = Raw;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Raw;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Raw,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item.0);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Raw;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Raw>, tonic::Status> {
        use bytes::Buf;
        let v = src.copy_to_bytes(src.remaining()).to_vec();
        Ok(Some(Raw(v)))
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn diag(id: &str, node: &str, deadline_ms: u64) -> projections::commands::Command {
    projections::commands::Command {
        id: id.into(),
        node: node.into(),
        kind: "diag.nvml".into(),
        args: serde_json::json!({}),
        deadline_ms,
        issued_by: "cli:test".into(),
    }
}

async fn states(r: &Region, id: &str) -> Vec<String> {
    r.client
        .query(
            "SELECT type FROM strata.events WHERE stream = $1 ORDER BY version",
            &[&format!("command/{id}")],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_run_once_across_reconnects_and_a_stopping_gateway() {
    let r = region().await;
    let a = r.gateway("gw-a", |_| {}).await;
    let b = r.gateway("gw-b", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![url(&a), url(&b)], dir.path(), "n1");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    daemon::ensure_joined(&c).await.unwrap();
    // Start on a: a is first in the list the daemon tries.
    let mut on_a = c.clone();
    on_a.gateways = vec![url(&a)];
    let n = start(on_a);
    eventually(20, "the session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;

    // Issued while connected: pushed, acked, succeeded.
    projections::commands::issue(&r.appender, &diag("c1", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    eventually(20, "c1 succeeds", || async {
        states(&r, "c1").await == ["command.issued", "command.acked", "command.succeeded"]
    })
    .await;
    n.stop().await.unwrap();

    // Issued while the node is away: delivered when it comes back.
    projections::commands::issue(&r.appender, &diag("c2", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    // A command for another node is never pushed to this one.
    projections::commands::issue(&r.appender, &diag("other", "n2", now_ms() + 60_000))
        .await
        .unwrap();
    // Slow diagnostics, so a gateway can die while one runs.
    let slow = Arc::new({
        let mut f = FakeGpus::parse("8xH100-80GB", "n1").unwrap();
        f.diag_delay = Duration::from_millis(1500);
        f
    });
    let mut both = c.clone();
    both.backend = slow;
    both.gateways = vec![url(&a), url(&b)];
    let n = start(both);
    eventually(20, "c2 succeeds after the reconnect", || async {
        states(&r, "c2").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;

    // c3 is acked and running when its gateway stops (a SIGKILLed gateway
    // is the CLI test's drill).
    let holder_is_a = a.stats.sessions.load(Ordering::Relaxed) == 1;
    projections::commands::issue(&r.appender, &diag("c3", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    eventually(20, "c3 is acked", || async {
        states(&r, "c3").await.len() == 2
    })
    .await;
    let (dead, alive) = if holder_is_a { (a, b) } else { (b, a) };
    dead.stop().await.unwrap();
    eventually(30, "c3 completes through the other gateway", || async {
        states(&r, "c3").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;
    assert_eq!(
        states(&r, "c3").await,
        ["command.issued", "command.acked", "command.succeeded"],
        "one terminal state"
    );
    // c2 and c3 ran once each on this daemon.
    assert_eq!(n.stats.commands_run.load(Ordering::Relaxed), 2);
    assert_eq!(states(&r, "other").await, ["command.issued"]);

    // Heartbeats go on while a command runs (1 s beats, a 1.5 s command).
    projections::commands::issue(&r.appender, &diag("c4", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    eventually(20, "c4 is acked", || async {
        states(&r, "c4").await.len() == 2
    })
    .await;
    let beats = n.stats.heartbeats.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(
        n.stats.heartbeats.load(Ordering::Relaxed) > beats,
        "a heartbeat while c4 ran"
    );
    eventually(20, "c4 succeeds", || async {
        states(&r, "c4").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;

    // A command past its deadline is expired by a gateway, not run.
    n.stop().await.unwrap();
    projections::commands::issue(&r.appender, &diag("late", "n1", now_ms() + 200))
        .await
        .unwrap();
    eventually(20, "the late command expires", || async {
        states(&r, "late").await.last().map(String::as_str) == Some("command.expired")
    })
    .await;
    alive.stop().await.unwrap();
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
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(r.ca_pem()))
        .domain_name("localhost");
    let channel = Endpoint::from_shared(url(gw))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    JoinClient::new(channel)
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
    let csr = |k: &rcgen::KeyPair| {
        rcgen::CertificateParams::new(Vec::<String>::new())
            .unwrap()
            .serialize_request(k)
            .unwrap()
            .pem()
            .unwrap()
    };
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
    let proxy = cut::Cut::to(gw.addr).await;
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
    eventually(20, "the join waits on the lock", || async {
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
    eventually(
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
    eventually(30, "the node joins and opens a session", || async {
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
    eventually(20, "the session opens at home", || async {
        home.stats.sessions.load(Ordering::Relaxed) == 1
    })
    .await;
    // Home goes away: the node moves to the other gateway.
    home.stop().await.unwrap();
    eventually(20, "the node moves to the other gateway", || async {
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
    eventually(20, "the node is home again", || async {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_configure_queues_through_the_api_and_requests_wait_by_their_quota() {
    use gateway::api_proto::*;
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, placer) = n1_and_a_placer(&r, &gw, dir.path()).await;
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let (cert, key) = ca.issue_operator("alice", 1).unwrap();
    admin(&r, "alice").await;
    let mut alice = api_as(&r, &gw, cert, key).await;
    let (cert, key) = ca.issue_operator("bob", 1).unwrap();
    gateway::roles::set(
        &r.appender,
        "bob",
        &gateway::roles::Assignment {
            role: gateway::roles::Role::Operator,
            pools: vec!["p".into()],
        },
    )
    .await
    .unwrap();
    let mut bob = api_as(&r, &gw, cert, key).await;
    let team = |nominal: u32, create_only: bool| ConfigureQueueRequest {
        spec: Some(QueueSpec {
            pool: "p".into(),
            queue: "team".into(),
            cohort: String::new(),
            weight: 1,
            quotas: vec![Quota {
                class: "H100-80GB".into(),
                nominal,
                borrowing_limit: None,
            }],
        }),
        create_only,
    };
    // An operator of the pool may reserve in it, not set its quotas.
    let err = bob.configure_queue(team(4, true)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("only an admin"), "{err:?}");
    alice.configure_queue(team(4, true)).await.unwrap();
    let err = alice.configure_queue(team(4, true)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    let mut bad = team(4, false);
    bad.spec.as_mut().unwrap().weight = 5000;
    let err = alice.configure_queue(bad).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    let ask = |id: &str, gpus: u32, queue: &str, wait_ms: u32| ReserveRequest {
        id: id.into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus,
        queue: queue.into(),
        wait_ms,
        ..Default::default()
    };
    // The pool is shared by queues now: a request names one.
    let err = bob.reserve(ask("none", 1, "", 0)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    let err = bob.reserve(ask("typo", 1, "typo", 0)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    let placed = bob
        .reserve(ask("t-1", 4, "team", 20_000))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(placed.state, "placed", "{placed:?}");
    // Four more GPUs are free, but the team holds its whole quota.
    bob.reserve(ask("t-2", 2, "team", 0)).await.unwrap();
    let mut got = None;
    for _ in 0..200 {
        let g = bob
            .get_reservation(GetReservationRequest { id: "t-2".into() })
            .await
            .unwrap()
            .into_inner();
        if g.state == "queued" {
            got = Some(g);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let got = got.expect("t-2 queued");
    assert!(got.reason.starts_with("over quota"), "{got:?}");
    let w = got.waiting.expect("it waits");
    assert_eq!(w.queue, "team");
    assert!(w.why.contains("queue team holds 4 of its 4"), "{w:?}");
    let shares = bob
        .list_queues(ListQueuesRequest { pool: "p".into() })
        .await
        .unwrap()
        .into_inner()
        .queues;
    assert_eq!(shares.len(), 1, "{shares:?}");
    let s = &shares[0];
    assert_eq!(
        (s.queue.as_str(), s.nominal, s.used, s.waiting, s.fair),
        ("team", 4, 4, 2, 4),
        "{s:?}"
    );
    // More quota: the waiting request is placed without being asked again.
    alice.configure_queue(team(8, false)).await.unwrap();
    eventually(20, "t-2 placed under the new quota", || async {
        let mut bob = bob.clone();
        bob.get_reservation(GetReservationRequest { id: "t-2".into() })
            .await
            .is_ok_and(|g| g.into_inner().state == "placed")
    })
    .await;
    assert_eq!(
        r.count(
            "SELECT count(*) FROM strata.events WHERE type = 'queue.configured'
               AND metadata->>'operator' = 'alice'"
        )
        .await,
        2
    );
    placer.stop().await.unwrap();
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_reservations_node_is_told_and_released_after_the_grace_period() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let n = start(joining(&r, &gw, dir.path(), "n1").await);
    eventually(20, "n1's inventory is in the pool", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'node.joined'")
            .await
            == 1
    })
    .await;
    // Only a pool shared by queues preempts: one team, the whole pool.
    let spec = projections::QueueSpec {
        queue: "team".into(),
        cohort: None,
        weight: 1,
        quotas: vec![projections::Quota {
            class: "H100-80GB".into(),
            nominal: 8,
            borrowing_limit: None,
        }],
    };
    projections::queues::configure(
        &r.client,
        &r.appender,
        "p",
        "team",
        &|_| Ok(spec.clone()),
        None,
    )
    .await
    .unwrap();
    let mut pc = placer::PlacerConfig::new("preempt-test");
    pc.preemption_grace = Duration::from_secs(1);
    let placer = placer::Placer::start(r.cfg.clone(), r.reader(), r.appender.clone(), pc);
    let binder = binder::Binder::start(r.cfg.clone(), r.reader(), r.appender.clone());
    let whole = |id: &str, priority: i32| projections::Request {
        reservation: id.into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 8,
        shape: projections::Shape::Node,
        priority,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        queue: Some("team".into()),
    };
    let count = |sql: String| {
        let r = &r;
        async move { r.count(&sql).await }
    };
    placer::client::reserve(&r.client, &r.appender, &whole("low", 0))
        .await
        .unwrap();
    eventually(20, "low is bound on n1 and active", || async {
        count("SELECT count(*) FROM strata.events WHERE type = 'reservation.activated' AND payload->>'reservation' = 'low'".into()).await == 1
    })
    .await;
    placer::client::reserve(&r.client, &r.appender, &whole("high", 5))
        .await
        .unwrap();
    // The node hears of it while low still holds its devices.
    let marker = dir
        .path()
        .join("n1")
        .join("allocations")
        .join("low.preempting");
    eventually(20, "n1 is told low is preempted", || async {
        count("SELECT count(*) FROM strata.events WHERE stream = 'command/preempting:low:n1' AND type = 'command.succeeded'".into()).await == 1
    })
    .await;
    let told: serde_json::Value = match std::fs::read_to_string(&marker) {
        Ok(text) => serde_json::from_str(&text).unwrap(),
        // The grace period may be over already: then it was released.
        Err(_) => serde_json::json!({"by": "high", "reason": "priority"}),
    };
    assert_eq!(
        (told["by"].as_str(), told["reason"].as_str()),
        (Some("high"), Some("priority")),
        "{told}"
    );
    // Once it is over, low's binding is released and high's bound.
    eventually(20, "high is active on n1", || async {
        count("SELECT count(*) FROM strata.events WHERE type = 'reservation.activated' AND payload->>'reservation' = 'high'".into()).await == 1
    })
    .await;
    eventually(20, "n1 holds high alone", || async {
        node::executor::bound_reservations(&dir.path().join("n1"))
            .into_iter()
            .collect::<Vec<_>>()
            == ["high"]
    })
    .await;
    assert!(!marker.exists(), "the release removes the notice");
    assert_eq!(
        count("SELECT count(*) FROM strata.events WHERE type = 'reservation.preempted' AND payload->>'reservation' = 'low' AND payload->>'by' = 'high'".into()).await,
        1
    );
    projections::check::check(&r.client, |_| {}).await.unwrap();
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_api_serves_operators_only() {
    use gateway::api_proto::*;
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, placer) = n1_and_a_placer(&r, &gw, dir.path()).await;
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let client = |cert: String, key: String| api_as(&r, &gw, cert, key);
    // A node's certificate is not an operator's.
    let (cert, key) = ca.client_identity("n7").unwrap();
    let err = client(cert, key)
        .await
        .list_pools(ListPoolsRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");

    let (cert, key) = ca.issue_operator("alice", 1).unwrap();
    let alice = gateway::revocation::presented_pem(&cert).unwrap();
    admin(&r, "alice").await;
    let mut api = client(cert, key).await;
    let placed = api
        .reserve(ReserveRequest {
            id: "api-1".into(),
            pool: "p".into(),
            class: "H100-80GB".into(),
            gpus: 2,
            wait_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(placed.state, "placed", "{placed:?}");
    assert_eq!(placed.allocations[0].node, "n1");
    assert_eq!(placed.allocations[0].devices.len(), 2);
    // GetReservation says why one waits: 8 GPUs asked for, 6 free, nothing
    // with a time limit to free more.
    api.reserve(ReserveRequest {
        id: "api-wait".into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 8,
        ..Default::default()
    })
    .await
    .unwrap();
    let get = |id: &str| GetReservationRequest { id: id.into() };
    let mut waits = None;
    for _ in 0..200 {
        let got = api
            .get_reservation(get("api-wait"))
            .await
            .unwrap()
            .into_inner();
        if got.state == "queued" {
            waits = Some(got);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waits = waits.expect("api-wait queued");
    let w = waits
        .waiting
        .clone()
        .expect("a waiting reservation says why");
    assert_eq!((w.position, w.ahead, w.waiting), (1, 0, 1), "{w:?}");
    assert_eq!(w.free_now, 6);
    assert_eq!(w.earliest_start_ms, 0, "nothing live has a time limit");
    assert!(!waits.reason.is_empty(), "{waits:?}");
    let live = api
        .get_reservation(get("api-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(live.state, "placed");
    assert!(live.waiting.is_none());
    api.release(ReleaseRequest {
        id: "api-wait".into(),
        reason: "not needed".into(),
    })
    .await
    .unwrap();
    eventually(20, "api-wait released", || async {
        let mut api = api.clone();
        api.get_reservation(get("api-wait"))
            .await
            .is_ok_and(|g| g.into_inner().state == "released")
    })
    .await;
    let err = api.get_reservation(get("nope")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    // Two binders, started after the placement (so the one that takes the
    // lease finds it while starting up, with its stream's version): one
    // holds the lease and works, the other waits.
    let binders: Vec<_> = (0..2)
        .map(|_| binder::Binder::start(r.cfg.clone(), r.reader(), r.appender.clone()))
        .collect();
    let err = api
        .reserve(ReserveRequest {
            pool: "nope".into(),
            class: "H100-80GB".into(),
            gpus: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    let err = api
        .reserve(ReserveRequest {
            pool: "p".into(),
            class: "H100-80GB".into(),
            gpus: 1,
            shape: "ring".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    let pools = api
        .list_pools(ListPoolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .pools;
    assert_eq!(pools.len(), 1);
    assert_eq!(pools[0].classes[0].total, 8);
    assert_eq!(pools[0].live, 1);
    // The next call reads only what was appended since: a new pool.
    r.appender
        .append(
            "pool/q",
            ExpectedVersion::NoStream,
            vec![Fact::PoolCreated {
                description: String::new(),
            }
            .to_event()],
        )
        .await
        .unwrap();
    let again = api
        .list_pools(ListPoolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .pools;
    let names: Vec<&str> = again.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["p", "q"]);
    assert_eq!((again[0].classes[0].total, again[0].live), (8, 1));
    let nodes = api
        .list_nodes(ListNodesRequest { pool: "p".into() })
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert_eq!(nodes.len(), 1);
    assert!(nodes[0].session_here && !nodes[0].revoked, "{nodes:?}");
    // A node's standing: cordoned and uncordoned, the operator recorded.
    let standing = |node: &str| NodeStandingRequest {
        node: node.into(),
        reason: "firmware".into(),
        ..Default::default()
    };
    let done = api.cordon_node(standing("n1")).await.unwrap().into_inner();
    assert_eq!(done.pool, "p");
    api.uncordon_node(standing("n1")).await.unwrap();
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type IN ('node.cordoned', 'node.uncordoned') AND metadata->>'operator' = 'alice'")
            .await,
        2
    );
    let err = api.drain_node(standing("nowhere")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");

    let done = api
        .issue_command(IssueCommandRequest {
            id: "api-c1".into(),
            node: "n1".into(),
            kind: "diag.nvml".into(),
            wait_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.state, "succeeded", "{done:?}");
    assert!(done.outcome_json.contains("all GPUs pass"), "{done:?}");
    let got = api
        .get_command(GetCommandRequest {
            id: "api-c1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.state, "succeeded");
    let err = api
        .get_command(GetCommandRequest { id: "nope".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);

    // The placement is bound on n1 and becomes active once, by one binder.
    eventually(20, "api-1 becomes active", || async {
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'reservation/api-1' AND type = 'reservation.activated'").await == 1
    })
    .await;
    let activated: Vec<u64> = binders
        .iter()
        .map(|b| b.stats.activated.load(Ordering::Relaxed))
        .collect();
    assert_eq!(activated.iter().sum::<u64>(), 1, "{activated:?}");
    projections::check::check(&r.client, |_| {}).await.unwrap();
    for b in binders {
        b.stop().await.unwrap();
    }
    api.release(ReleaseRequest {
        id: "api-1".into(),
        reason: "done".into(),
    })
    .await
    .unwrap();
    let err = api
        .release(ReleaseRequest {
            id: "never".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);

    // A revoked operator certificate is refused on the connection already
    // open, within the reload interval; another certificate of the same
    // operator is not affected.
    let (cert2, key2) = ca.issue_operator("alice", 1).unwrap();
    let mut api2 = client(cert2, key2).await;
    use gateway::revocation::Target;
    let mut own = events::db::connect(&r.cfg, "revoke").await.unwrap();
    assert!(
        gateway::revocation::revoke(&mut own, Target::Certificate(&alice), "laptop lost")
            .await
            .unwrap()
    );
    assert!(
        !gateway::revocation::revoke(&mut own, Target::Serial(&alice.serial), "again")
            .await
            .unwrap()
    );
    let refused = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match api.list_pools(ListPoolsRequest {}).await {
                Err(e) => break e,
                Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    })
    .await
    .expect("the revoked certificate is refused within 10 s");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("revoked"), "{refused:?}");
    api2.list_pools(ListPoolsRequest {}).await.unwrap();
    let listed = gateway::revocation::list(&r.client).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].kind.as_deref(),
            listed[0].name.as_deref(),
            listed[0].reason.as_str()
        ),
        (Some("operator"), Some("alice"), "laptop lost")
    );
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'operator/alice' AND type = 'certificate.revoked'")
            .await,
        1
    );
    placer.stop().await.unwrap();
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_and_ecc_conditions_reach_the_pool_and_make_the_device_unschedulable() {
    use node::gpu::{GpuBackend, HealthChange};
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, fake) = joined_with_fake_gpus(&r, &gw, dir.path()).await;
    let gpu3 = fake.inventory().unwrap()[3].id.clone();
    fake.inject(HealthChange {
        device: Some(gpu3.clone()),
        condition: "XID-79".into(),
        detail: "fell off the bus".into(),
        cleared: false,
    });
    fake.inject(HealthChange {
        device: None,
        condition: "ECC-uncorrected".into(),
        detail: String::new(),
        cleared: false,
    });
    eventually(20, "both conditions are in the pool stream", || async {
        r.count(
            "SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type = 'health.raised'",
        )
        .await
            == 2
    })
    .await;
    let index = projections::projector::build(&r.client, projections::Index::new())
        .await
        .unwrap();
    let node = &index.pool("p").unwrap().nodes["n1"];
    assert_eq!(node.conditions, ["ECC-uncorrected"]);
    let (_, dev) = node.device(&gpu3).unwrap();
    assert_eq!(dev.conditions, ["XID-79"]);
    assert!(!node.schedulable());
    // Statuses are written when they change: ready, then degraded.
    eventually(20, "the degraded status is written", || async {
        r.count(
            "SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.status_reported'",
        )
        .await
            == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let states: Vec<String> = r
        .client
        .query(
            "SELECT payload->>'state' FROM strata.events WHERE stream = 'node/n1' AND type = 'node.status_reported' ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(states, ["ready", "degraded"]);
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_over_the_api_respect_grants_and_resume_after_acks() {
    use gateway::api_proto::{
        api_client::ApiClient, subscribe_message, SubscribeAck, SubscribeMessage, SubscribeStart,
    };
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    for i in 0..5 {
        for stream in ["pool/p", "other/x"] {
            r.appender
                .append(
                    stream,
                    ExpectedVersion::Any,
                    vec![events::NewEvent::new("t.x", &serde_json::json!({ "i": i }))],
                )
                .await
                .unwrap();
        }
    }
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let connect_as = |cert: String, key: String| {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(r.ca_pem()))
            .identity(Identity::from_pem(cert, key))
            .domain_name("localhost");
        let ep = Endpoint::from_shared(url(&gw))
            .unwrap()
            .tls_config(tls)
            .unwrap();
        async move { ApiClient::new(ep.connect().await.unwrap()) }
    };
    let connect = |name: &str| {
        let (cert, key) = ca.issue_operator(name, 1).unwrap();
        connect_as(cert, key)
    };
    let start =
        |name: &str, prefixes: Vec<String>| {
            let (tx, rx) = tokio::sync::mpsc::channel::<SubscribeMessage>(16);
            let first = SubscribeMessage {
                body: Some(subscribe_message::Body::Start(SubscribeStart {
                    name: name.into(),
                    types: vec![],
                    stream_prefixes: prefixes,
                    from: "start".into(),
                })),
            };
            tx.try_send(first).unwrap();
            let out = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|m| (m, rx))
            });
            (tx, out)
        };
    // No grant, no events.
    let mut bob = connect("bob").await;
    let (_tx, out) = start("s", vec![]);
    let err = match bob.subscribe(out).await {
        Err(s) => s,
        Ok(resp) => resp.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");

    gateway::grants::set(
        &r.appender,
        "alice",
        &gateway::grants::Grant {
            stream_prefixes: vec!["pool/".into()],
            types: vec![],
        },
    )
    .await
    .unwrap();
    let mut alice = connect("alice").await;
    // Asking outside the grant is refused.
    let (_tx, out) = start("s", vec!["other/".into()]);
    let err = match alice.subscribe(out).await {
        Err(s) => s,
        Ok(resp) => resp.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");

    // Within it: pool/ events only, in order; ack the third and leave.
    let (tx, out) = start("s", vec![]);
    let mut events = alice.subscribe(out).await.unwrap().into_inner();
    let mut got = Vec::new();
    while got.len() < 6 {
        let e = tokio::time::timeout(Duration::from_secs(20), events.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(e.stream.starts_with("pool/"), "{e:?}");
        got.push(e.position);
    }
    assert!(got.windows(2).all(|w| w[0] < w[1]));
    // A second caller stream under the same name, while this one is open,
    // is refused: events are never delivered to two streams at once.
    let (_second_tx, out) = start("s", vec![]);
    let err = match alice.subscribe(out).await {
        Err(s) => s,
        Ok(resp) => resp.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    tx.send(SubscribeMessage {
        body: Some(subscribe_message::Body::Ack(SubscribeAck {
            position: got[2],
        })),
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(tx);
    drop(events);
    // Back: it resumes after the acknowledged event.
    let mut again = None;
    for _ in 0..50 {
        let (tx, out) = start("s", vec![]);
        match alice.subscribe(out).await {
            Ok(resp) => {
                let mut s = resp.into_inner();
                match tokio::time::timeout(Duration::from_secs(20), s.message())
                    .await
                    .unwrap()
                {
                    Ok(Some(e)) => {
                        again = Some(e.position);
                        drop(tx);
                        break;
                    }
                    Ok(None) => {}
                    Err(st) if st.code() == tonic::Code::AlreadyExists => {}
                    Err(st) => panic!("{st:?}"),
                }
            }
            Err(st) if st.code() == tonic::Code::AlreadyExists => {}
            Err(st) => panic!("{st:?}"),
        }
        // The previous connection's subscription is still closing.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(again, Some(got[3]), "resumed after the last ack");

    // Revoking an operator's certificate ends the stream it has open.
    gateway::grants::set(
        &r.appender,
        "carol",
        &gateway::grants::Grant {
            stream_prefixes: vec!["pool/".into()],
            types: vec![],
        },
    )
    .await
    .unwrap();
    let (cert, key) = ca.issue_operator("carol", 1).unwrap();
    let carol_cert = gateway::revocation::presented_pem(&cert).unwrap();
    let mut carol = connect_as(cert, key).await;
    let (_tx, out) = start("c", vec![]);
    let mut stream = carol.subscribe(out).await.unwrap().into_inner();
    let first = tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .unwrap()
        .unwrap();
    assert!(first.is_some());
    let mut own = events::db::connect(&r.cfg, "revoke").await.unwrap();
    gateway::revocation::revoke(
        &mut own,
        gateway::revocation::Target::Certificate(&carol_cert),
        "left",
    )
    .await
    .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without saying why"),
                Err(status) => break status,
            }
        }
    })
    .await
    .expect("the revoked operator's stream ends within 10 s");
    assert_eq!(ended.code(), tonic::Code::PermissionDenied, "{ended:?}");
    assert!(ended.message().contains("revoked"), "{ended:?}");
    gw.stop().await.unwrap();
}

/// Node n1 on fake GPUs whose health the test injects (polled every 100
/// ms), joined through `gw`.
async fn joined_with_fake_gpus(
    r: &Region,
    gw: &Running,
    dir: &std::path::Path,
) -> (Node, Arc<FakeGpus>) {
    let fake = Arc::new(FakeGpus::parse("8xH100-80GB", "n1").unwrap());
    let mut c = config(vec![url(gw)], dir, "n1");
    c.backend = fake.clone();
    c.health_poll = Duration::from_millis(100);
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    let n = start(c);
    eventually(20, "n1's inventory is in the pool", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'node.joined'")
            .await
            == 1
    })
    .await;
    (n, fake)
}

/// The node a reservation was placed on, once it is (from the table).
async fn placed_on(r: &Region, id: &str) -> Option<String> {
    r.client
        .query_opt(
            "SELECT payload->'allocations'->0->>'node' FROM strata.events
              WHERE type = 'reservation.placed' AND payload->>'reservation' = $1",
            &[&id],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// A node whose connection is gone (a power cut, a crash) is out of
/// contact at once, not three heartbeats later: requests made meanwhile
/// wait for a node that is there instead of being bound to one that is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_connection_is_gone_takes_no_placements_until_it_is_back() {
    let r = region().await;
    // Heartbeats every 30 s: the sweeper marks nothing within the test.
    let gw = r
        .gateway("gw-a", |c| c.heartbeat = Duration::from_secs(30))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let (n, placer) = n1_and_a_placer(&r, &gw, dir.path()).await;
    n.stop().await.unwrap();
    eventually(10, "the pool hears contact with n1 is lost", || async {
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type = 'node.contact_lost'").await == 1
    })
    .await;
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.disconnected'").await,
        1
    );
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.marked_unreachable'").await,
        0,
        "not marked unreachable: its heartbeats are not overdue yet"
    );
    let whole = projections::Request {
        reservation: "w".into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 8,
        shape: projections::Shape::Node,
        priority: 0,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        queue: None,
    };
    placer::client::reserve(&r.client, &r.appender, &whole)
        .await
        .unwrap();
    eventually(20, "w is queued", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'reservation.queued' AND payload->>'reservation' = 'w'").await == 1
    })
    .await;
    assert_eq!(
        placed_on(&r, "w").await,
        None,
        "w went to a node that is gone"
    );
    // Back (joined already: its credentials are on disk): its new session
    // restores contact and w is placed there.
    let n = start(config(vec![url(&gw)], dir.path(), "n1"));
    eventually(20, "w is placed on n1, back", || async {
        placed_on(&r, "w").await.as_deref() == Some("n1")
    })
    .await;
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type = 'node.contact_restored'").await,
        1
    );
    n.stop().await.unwrap();
    placer.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_and_revoked_nodes_take_no_new_placements_and_their_reservations_fail() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = std::collections::HashMap::new();
    let mut configs = std::collections::HashMap::new();
    for name in ["n1", "n2"] {
        let mut c = config(vec![url(&gw)], dir.path(), name);
        c.token = Some(r.token().await);
        c.ca_pem = Some(r.ca_pem());
        configs.insert(name, c.clone());
        nodes.insert(name, start(c));
    }
    eventually(20, "both nodes joined the pool", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'node.joined'")
            .await
            == 2
    })
    .await;
    let mut pc = placer::PlacerConfig::new("lifecycle");
    pc.node_lost_after = Duration::from_secs(1);
    let placer = placer::Placer::start(r.cfg.clone(), r.reader(), r.appender.clone(), pc);
    let binder = binder::Binder::start(r.cfg.clone(), r.reader(), r.appender.clone());
    let whole = |id: &str| projections::Request {
        reservation: id.into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 8,
        shape: projections::Shape::Node,
        priority: 0,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        queue: None,
    };
    for id in ["a", "b"] {
        placer::client::reserve(&r.client, &r.appender, &whole(id))
            .await
            .unwrap();
    }
    for id in ["a", "b"] {
        let sql = format!("SELECT count(*) FROM strata.events WHERE stream = 'reservation/{id}' AND type = 'reservation.activated'");
        eventually(20, "both reservations are active", || async {
            r.count(&sql).await == 1
        })
        .await;
    }
    let on_a = placed_on(&r, "a").await.unwrap();
    let on_b = placed_on(&r, "b").await.unwrap();
    assert_ne!(on_a, on_b);

    // The daemon of a's node dies: its heartbeats stop, the gateway marks
    // it lost in the pool, and a fails once it stays lost past the bound.
    nodes.remove(on_a.as_str()).unwrap().stop().await.unwrap();
    let lost = format!(
        "SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type = 'node.contact_lost' AND payload->>'node' = '{on_a}'"
    );
    eventually(20, "the pool hears the node is lost", || async {
        r.count(&lost).await == 1
    })
    .await;
    eventually(20, "a fails with node_lost", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reservation' = 'a' AND payload->>'reason' = 'node_lost'").await == 1
    })
    .await;
    // Its node is free now, but out of contact: a new request waits.
    placer::client::reserve(&r.client, &r.appender, &whole("c"))
        .await
        .unwrap();
    eventually(20, "c is queued", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'reservation.queued' AND payload->>'reservation' = 'c'").await == 1
    })
    .await;

    // b's node is revoked: it leaves the pool, b fails at once.
    let mut admin = events::db::connect(&r.cfg, "admin").await.unwrap();
    identity::revoke(&mut admin, &on_b, "stolen").await.unwrap();
    eventually(20, "b fails with node_revoked", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reservation' = 'b' AND payload->>'reason' = 'node_revoked'").await == 1
    })
    .await;
    let report = projections::check::check(&r.client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (0, 0), "{report:?}");
    assert_eq!(
        placed_on(&r, "c").await,
        None,
        "c went to a lost or revoked node"
    );

    // The dead node comes back: contact is restored in the pool, c is placed
    // there, and a's binding is released on the node.
    nodes.insert(on_a.as_str(), start(configs[on_a.as_str()].clone()));
    eventually(20, "c is placed on the node that came back", || async {
        placed_on(&r, "c").await.as_deref() == Some(on_a.as_str())
    })
    .await;
    let released = format!(
        "SELECT count(*) FROM strata.events WHERE stream = 'command/release:a:{on_a}' AND type = 'command.succeeded'"
    );
    let t = std::time::Instant::now();
    while r.count(&released).await != 1 {
        if t.elapsed() > Duration::from_secs(20) {
            let rows = r
                .client
                .query("SELECT stream, type, payload::text FROM strata.events WHERE stream LIKE 'command/%a%' ORDER BY position", &[])
                .await
                .unwrap();
            let rows: Vec<(String, String, String)> = rows
                .iter()
                .map(|x| (x.get(0), x.get(1), x.get(2)))
                .collect();
            panic!("a's binding was not released on its node: {rows:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What the node holds bound is what the log has live on it: c alone.
    let bound_on = |node: &str| -> Vec<String> {
        node::executor::bound_reservations(&dir.path().join(node))
            .into_iter()
            .collect()
    };
    eventually(20, "the node's bindings match the log", || async {
        bound_on(&on_a) == ["c"]
    })
    .await;
    let index = projections::projector::build(&r.client, projections::Index::new())
        .await
        .unwrap();
    let live_on_a: Vec<&str> = index
        .state()
        .reservations
        .values()
        .filter(|res| res.phase.is_live() && res.allocations.iter().any(|a| a.node == on_a))
        .map(|res| res.request.reservation.as_str())
        .collect();
    assert_eq!(live_on_a, ["c"]);
    projections::check::check(&r.client, |_| {}).await.unwrap();
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
    for (name, n) in nodes {
        let stopped = n.stop().await;
        if name == on_b {
            // The revoked node's daemon was refused and ended by itself.
            assert!(stopped.unwrap_err().to_string().contains("revoked"));
        } else {
            stopped.unwrap();
        }
    }
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_events_sent_while_postgres_is_down_are_written_once_it_is_back() {
    use node::gpu::{GpuBackend, HealthChange};
    let mut cluster = schema::testing::temp_cluster(&[]).unwrap();
    let r = region_on(&cluster).await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, fake) = joined_with_fake_gpus(&r, &gw, dir.path()).await;
    let gpus: Vec<String> = fake
        .inventory()
        .unwrap()
        .iter()
        .map(|d| d.id.clone())
        .collect();

    // Postgres dies; the node reports five conditions meanwhile.
    tokio::task::block_in_place(|| cluster.crash());
    let sent = n.stats.health_reports.load(Ordering::Relaxed);
    for gpu in &gpus[..5] {
        fake.inject(HealthChange {
            device: Some(gpu.clone()),
            condition: "XID-79".into(),
            detail: "fell off the bus".into(),
            cleared: false,
        });
    }
    eventually(20, "the node sent its reports", || async {
        n.stats.health_reports.load(Ordering::Relaxed) >= sent + 5
    })
    .await;
    eventually(20, "the gateway's writer is retrying them", || async {
        gw.stats.write_retries.load(Ordering::Relaxed) >= 1
    })
    .await;

    // Back: every report is written, none twice, nothing counted as lost.
    tokio::task::block_in_place(|| cluster.restart()).unwrap();
    let count = || async {
        let Ok(client) = events::db::connect(&r.cfg, "test-count").await else {
            return -1;
        };
        client
            .query_one(
                "SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type = 'health.raised'",
                &[],
            )
            .await
            .map_or(-1, |row| row.get::<_, i64>(0))
    };
    eventually(30, "all five conditions are in the pool stream", || async {
        count().await == 5
    })
    .await;
    assert_eq!(gw.stats.write_errors.load(Ordering::Relaxed), 0);
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_node_writes_a_handful_of_health_events_and_placements_keep_flowing() {
    use node::gpu::{GpuBackend, HealthChange};
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, fake) = joined_with_fake_gpus(&r, &gw, dir.path()).await;
    // Four more nodes, so placements have room beside the flapping one.
    let fleet = placer::client::uniform_fleet("sim", 4, "H100-80GB", 8, 8);
    placer::client::join_nodes(&r.appender, "p", fleet, |_| {})
        .await
        .unwrap();
    let placer = placer::Placer::start(
        r.cfg.clone(),
        r.reader(),
        r.appender.clone(),
        placer::PlacerConfig::new("flap"),
    );
    let health =
        "SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type LIKE 'health.%'";
    let before = r.count(health).await;
    // GPU 3 toggles every 100 ms for 4 s, while reservations are placed.
    let gpu3 = fake.inventory().unwrap()[3].id.clone();
    let flapper = {
        let fake = fake.clone();
        tokio::spawn(async move {
            for i in 0..40 {
                fake.inject(HealthChange {
                    device: Some(gpu3.clone()),
                    condition: "XID-79".into(),
                    detail: String::new(),
                    cleared: i % 2 == 1,
                });
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let mut sub = r
        .reader()
        .subscribe_ephemeral(events::Start::Now)
        .await
        .unwrap();
    // Place and release one GPU after another until the flapping ends.
    let started = std::time::Instant::now();
    let (mut placed, mut slowest) = (0, Duration::ZERO);
    while !flapper.is_finished() {
        let id = format!("flap-{placed}");
        let req = projections::Request {
            reservation: id.clone(),
            pool: "p".into(),
            class: "H100-80GB".into(),
            gpus: 1,
            shape: projections::Shape::Any,
            priority: 0,
            ttl_ms: None,
            replace_on_failure: false,
            replaces: None,
            topology: None,
            requeue_on_preemption: false,
            queue: None,
        };
        let asked = std::time::Instant::now();
        placer::client::reserve(&r.client, &r.appender, &req)
            .await
            .unwrap();
        let outcome = tokio::time::timeout(
            Duration::from_secs(10),
            placer::client::wait(&mut sub, &id, |_| {}),
        )
        .await
        .expect("placed while the node flaps")
        .unwrap();
        assert!(
            matches!(outcome, placer::client::Outcome::Placed(_)),
            "{outcome:?}"
        );
        slowest = slowest.max(asked.elapsed());
        placer::client::release(&r.appender, &id, "next")
            .await
            .unwrap();
        placed += 1;
    }
    let placing = started.elapsed();
    flapper.await.unwrap();
    assert!(placed >= 20, "only {placed} placements in {placing:?}");
    eventually(20, "the node sent its reports", || async {
        n.stats.health_reports.load(Ordering::Relaxed) >= 40
    })
    .await;
    let written = r.count(health).await - before;
    eprintln!(
        "{placed} placements in {placing:?} (slowest {slowest:?}) while the node sent 40 health reports; {written} written"
    );
    assert!(written <= 6, "{written} health events written for 40 flaps");
    assert!(gw.stats.health_coalesced.load(Ordering::Relaxed) >= 30);

    // The GPU backend stops answering: raised once, cleared when it is back.
    let unavailable = |t: &'static str| {
        format!("SELECT count(*) FROM strata.events WHERE type = '{t}' AND payload->>'condition' = 'NVML-unavailable'")
    };
    let polls = n.stats.health_reports.load(Ordering::Relaxed);
    fake.fail_polls(true);
    eventually(20, "NVML-unavailable is raised", || async {
        r.count(&unavailable("health.raised")).await == 1
    })
    .await;
    // Polls go on failing (every 100 ms); nothing more is reported.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(n.stats.health_reports.load(Ordering::Relaxed), polls + 1);
    fake.fail_polls(false);
    eventually(20, "NVML-unavailable is cleared", || async {
        r.count(&unavailable("health.cleared")).await == 1
    })
    .await;
    assert_eq!(r.count(&unavailable("health.raised")).await, 1);
    placer.stop().await.unwrap();
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
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
