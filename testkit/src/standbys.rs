//! A primary's physical standby in tests and drills: found by the name it
//! streams under, made the synchronous one, cut off from the primary and
//! let back. Each step waits (with a deadline) until the servers say it
//! took effect.

use std::time::Duration;
use tokio::time::Instant;
use tokio_postgres::Client;

/// The physical standbys streaming from the primary `admin` is connected
/// to, by their WAL receivers' `application_name` (replication readers'
/// logical walsenders left out).
const PHYSICAL_STANDBYS_SQL: &str = "SELECT application_name FROM pg_stat_replication r
  WHERE state = 'streaming' AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s
                 WHERE s.active_pid = r.pid AND s.slot_type = 'logical')";

/// How long each step may take.
const DEADLINE: Duration = Duration::from_secs(30);

async fn until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + DEADLINE;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The name the primary's physical standby streams under, once it streams.
pub async fn physical_name(admin: &Client) -> String {
    physical_name_within(admin, DEADLINE)
        .await
        .unwrap()
        .expect("the standby never streamed")
}

/// The name the primary's physical standby streams under, once it streams;
/// `None` if none streams within `within`.
pub async fn physical_name_within(
    admin: &Client,
    within: Duration,
) -> Result<Option<String>, tokio_postgres::Error> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(r) = admin.query_opt(PHYSICAL_STANDBYS_SQL, &[]).await? {
            return Ok(Some(r.get(0)));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Names the physical standby in `synchronous_standby_names` (by name: `'*'`
/// would match the replication readers too) and waits until it is
/// synchronous. Returns its name.
pub async fn make_synchronous(admin: &Client) -> String {
    let name = physical_name(admin).await;
    admin
        .batch_execute(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '\"{name}\"'"
        ))
        .await
        .unwrap();
    admin
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    until("the standby is synchronous", || async {
        admin
            .query_opt(
                "SELECT 1 FROM pg_stat_replication WHERE application_name = $1 AND sync_state = 'sync'",
                &[&name],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;
    name
}

/// Points the standby `on_standby` is connected to at a port where nothing
/// listens and waits until its WAL receiver stopped: it receives nothing
/// more. Returns the `primary_conninfo` it had, for [`receive_again`].
pub async fn stop_receiving(on_standby: &Client) -> String {
    let conninfo: String = on_standby
        .query_one("SHOW primary_conninfo", &[])
        .await
        .unwrap()
        .get(0);
    set_conninfo(on_standby, "host=127.0.0.1 port=1").await;
    until("the standby stopped receiving", || async {
        on_standby
            .query_opt(
                "SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming'",
                &[],
            )
            .await
            .unwrap()
            .is_none()
    })
    .await;
    conninfo
}

/// Points the standby back at its primary (`conninfo` from
/// [`stop_receiving`]).
pub async fn receive_again(on_standby: &Client, conninfo: &str) {
    set_conninfo(on_standby, conninfo).await;
}

async fn set_conninfo(on_standby: &Client, conninfo: &str) {
    on_standby
        .batch_execute(&format!(
            "ALTER SYSTEM SET primary_conninfo = '{}'",
            conninfo.replace('\'', "''")
        ))
        .await
        .unwrap();
    on_standby
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
}
