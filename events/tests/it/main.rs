//! Integration tests of the event log against private Postgres clusters.

mod append;
mod failover;
mod lease;
mod metrics;
mod pooler;
mod replication;
mod share;
mod subscription;
mod tls;

use events::{Appender, AppenderConfig, NewEvent, Reader, ReaderConfig};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio_postgres::{Client, Config};

/// A fresh migrated database on the shared cluster.
pub async fn db() -> (Config, Client) {
    let url = testkit::migrated_database(testkit::shared_cluster()).await;
    let cfg: Config = url.parse().unwrap();
    let client = events::db::connect(&cfg, "test").await.unwrap();
    (cfg, client)
}

pub fn appender(cfg: &Config) -> Appender {
    Appender::start(cfg.clone(), AppenderConfig::default())
}

static SLOT: AtomicU32 = AtomicU32::new(0);

/// A reader with a slot name unique to this test process.
pub fn reader(cfg: &Config) -> Reader {
    Reader::start(cfg.clone(), reader_config())
}

pub fn reader_config() -> ReaderConfig {
    let mut rc = ReaderConfig::new(format!(
        "t_{}_{}",
        std::process::id(),
        SLOT.fetch_add(1, Ordering::Relaxed)
    ));
    rc.status_interval = Duration::from_millis(100);
    rc.heartbeat_interval = Duration::from_millis(500);
    rc
}

pub fn ev(n: u64) -> NewEvent {
    NewEvent::new("test.event", &serde_json::json!({ "n": n }))
}

/// Positions in the table, in order.
pub async fn table_positions(client: &Client) -> Vec<u64> {
    client
        .query("SELECT position FROM strata.events ORDER BY position", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i64>(0) as u64)
        .collect()
}

/// The positions of the next `n` events, each within 30 s.
pub async fn take(sub: &mut events::Subscription, n: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let e = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .expect("event in time")
            .unwrap();
        out.push(e.position.0);
    }
    out
}

/// Backends waiting on a lock whose statement is `LIKE pattern`.
pub async fn waiting_on_a_lock(client: &Client, pattern: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
            &[&pattern],
        )
        .await
        .unwrap()
        .get(0)
}
