//! The gateway and the node daemon against a real Postgres, over real mutual
//! TLS. This file is the harness (a region: a database, a CA, gateways,
//! daemons with fake GPUs); the tests are grouped by what they test:
//! `sessions`, `join`, `commands`, `api`, `authz`, `placement`, `topology`,
//! `renewal`, `limits`, `cut`, `usage`.

use domain::Fact;
use events::{Appender, AppenderConfig, ExpectedVersion};
use gateway::ca::{self, Ca};
use gateway::identity;
use gateway::server::{self, GatewayConfig, Running};
use node::daemon::{self, DaemonConfig, DaemonStats};
use node::gpu::FakeGpus;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_postgres::{Client, Config};

mod api;
mod authz;
mod commands;
mod join;
mod limits;
mod placement;
mod renewal;
mod sessions;
mod topology;
mod usage;

struct Region {
    cfg: Config,
    client: Client,
    appender: Appender,
    ca_dir: tempfile::TempDir,
}

async fn region() -> Region {
    region_on(testkit::shared_cluster()).await
}

/// A region on a cluster of the test's own (one it may crash).
async fn region_on(cluster: &schema::Cluster) -> Region {
    let url = testkit::migrated_database(cluster).await;
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

    /// A link to the region's PostgreSQL that the test can silence or take
    /// down, and how to connect through it.
    async fn link_to_postgres(&self) -> (testkit::cut::Cut, Config) {
        testkit::cut::Cut::to_postgres(&self.cfg).await
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
    testkit::eventually(20, "n1's inventory is in the pool", || async {
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

/// Gives `who` a role (and, for an operator, its pools).
async fn role(r: &Region, who: &str, role: gateway::roles::Role, pools: &[&str]) {
    gateway::roles::set(
        &r.appender,
        who,
        &gateway::roles::Assignment {
            role,
            pools: pools.iter().map(|p| p.to_string()).collect(),
        },
    )
    .await
    .unwrap();
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
    testkit::eventually(20, "n1's inventory is in the pool", || async {
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
