//! Private clusters for tests: one shared per test process, others on
//! demand (durable, standbys, behind a PgBouncer), a fresh and migrated
//! database per test, and a next release's migrations to upgrade to.

use crate::bouncer::{Bouncer, BouncerOptions};
use schema::{Change, Cluster, ClusterError, ClusterOptions, Migration, MIGRATIONS};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// The test process's shared cluster: fsync off, on a free port, stopped and
/// deleted when the process exits (however it exits).
pub fn shared_cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| temp_cluster(&[]).expect("start the test cluster"))
}

/// A new private cluster in a temporary folder with extra settings.
pub fn temp_cluster(settings: &[(&str, &str)]) -> Result<Cluster, ClusterError> {
    temp_cluster_with(false, settings)
}

/// A new private cluster; `durable` keeps fsync and synchronous commit on,
/// for tests that crash the server and count what survived.
pub fn temp_cluster_with(
    durable: bool,
    settings: &[(&str, &str)],
) -> Result<Cluster, ClusterError> {
    let base = std::env::temp_dir().join(format!(
        "strata-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let mut opts = ClusterOptions::new(base.join("pg"));
    opts.fsync = durable;
    opts.remove_on_exit = Some(base);
    opts.settings = settings
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Cluster::start(opts)
}

/// A streaming standby of `primary`, in a folder of its own removed with it.
pub fn temp_standby(primary: &Cluster) -> Result<Cluster, ClusterError> {
    let base = std::env::temp_dir().join(format!(
        "strata-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let mut opts = ClusterOptions::new(base.join("standby"));
    opts.fsync = false;
    opts.remove_on_exit = Some(base);
    primary.standby(opts)
}

/// A PgBouncer in transaction mode in front of `cluster`, its files in a
/// temporary folder removed with it.
pub fn temp_bouncer(cluster: &Cluster) -> Result<Bouncer, ClusterError> {
    let dir = std::env::temp_dir().join(format!(
        "strata-test-{}-{}-bouncer",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    Bouncer::start(cluster, &dir, &BouncerOptions::default()).map(Bouncer::remove_on_drop)
}

/// The next release's migrations as this build's tests picture them: one
/// that expands (a nullable column on the event table, a table), and one
/// that contracts (drops what the expansion replaced), needing binaries
/// that know the expansion.
pub fn next_release(contract: bool) -> Vec<Migration> {
    let known = schema::migrate::known();
    let mut m = MIGRATIONS.to_vec();
    m.push(Migration {
        version: known + 1,
        name: "next_expand",
        sql: "ALTER TABLE strata.events ADD COLUMN trace_context text;
              CREATE TABLE strata.next_release (id bigint PRIMARY KEY);",
        change: Change::Expand,
    });
    if contract {
        m.push(Migration {
            version: known + 2,
            name: "next_contract",
            sql: "ALTER TABLE strata.processes DROP COLUMN roles;",
            change: Change::Contract { needs: known + 1 },
        });
    }
    m
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Creates an empty database on `cluster` and returns its URL. The name is
/// unique within the process.
pub async fn fresh_database(cluster: &Cluster) -> String {
    let name = format!(
        "t{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let (client, conn) = tokio_postgres::connect(&cluster.url("postgres"), tokio_postgres::NoTls)
        .await
        .expect("connect to the test cluster");
    tokio::spawn(conn);
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create a test database");
    cluster.url(&name)
}

/// A fresh database with Strata's schema applied.
pub async fn migrated_database(cluster: &Cluster) -> String {
    let url = fresh_database(cluster).await;
    let (mut client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect to the test database");
    tokio::spawn(conn);
    schema::migrate(&mut client)
        .await
        .expect("migrate the test database");
    url
}
