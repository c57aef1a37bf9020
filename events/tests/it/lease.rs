use crate::db;
use events::lease::{Lease, LeaseError};
use std::time::Duration;

#[tokio::test]
async fn a_lease_has_one_holder_until_it_expires_and_the_next_epoch_fences_the_old() {
    let (cfg, client) = db().await;
    let ttl = Duration::from_millis(300);
    let a = Lease::acquire(&client, "pool/p1", "placer-a", ttl)
        .await
        .unwrap()
        .expect("free lease");
    assert_eq!(a.epoch, 1);
    assert!(
        Lease::acquire(&client, "pool/p1", "placer-b", ttl)
            .await
            .unwrap()
            .is_none(),
        "held by a"
    );
    a.renew(&client).await.unwrap();
    // a stalls past its TTL; b takes over with a new epoch.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let b = Lease::acquire(&client, "pool/p1", "placer-b", ttl)
        .await
        .unwrap()
        .expect("expired lease");
    assert_eq!(b.epoch, 2);
    let err = a.renew(&client).await.unwrap_err();
    assert!(matches!(err, LeaseError::Lost { epoch: 1, .. }), "{err}");
    assert_eq!(err.kind(), events::ErrorKind::Definite);
    // a's fenced write is refused; b's goes through.
    let mut c = events::db::connect(&cfg, "writer").await.unwrap();
    let tx = c.transaction().await.unwrap();
    assert!(matches!(a.fence(&tx).await, Err(LeaseError::Lost { .. })));
    drop(tx);
    let tx = c.transaction().await.unwrap();
    b.fence(&tx).await.unwrap();
    tx.commit().await.unwrap();
    // Releasing lets the next holder in at once.
    b.release(&client).await.unwrap();
    let c2 = Lease::acquire(&client, "pool/p1", "placer-c", ttl)
        .await
        .unwrap()
        .expect("released lease");
    assert_eq!(c2.epoch, 3);
}

#[tokio::test]
async fn a_fenced_transaction_holds_off_a_takeover_until_it_ends() {
    let (cfg, client) = db().await;
    let ttl = Duration::from_millis(200);
    let a = Lease::acquire(&client, "sink/s", "worker-a", ttl)
        .await
        .unwrap()
        .unwrap();
    let mut c = events::db::connect(&cfg, "writer").await.unwrap();
    let tx = c.transaction().await.unwrap();
    a.fence(&tx).await.unwrap();
    // The lease expires while a's transaction is open; b's takeover waits
    // for it rather than overlapping a's write.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cfg2 = cfg.clone();
    let takeover = tokio::spawn(async move {
        let other = events::db::connect(&cfg2, "other").await.unwrap();
        Lease::acquire(&other, "sink/s", "worker-b", Duration::from_secs(5))
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !takeover.is_finished(),
        "the takeover must wait for the fenced transaction"
    );
    tx.commit().await.unwrap();
    let b = takeover
        .await
        .unwrap()
        .expect("taken over after the commit");
    assert_eq!(b.epoch, 2);
}

#[tokio::test]
async fn a_statement_stuck_behind_a_lock_is_cancelled_by_the_server_and_the_next_try_succeeds() {
    let (cfg, client) = db().await;
    let bounded =
        events::db::Database::from(&cfg).with_statement_timeout(Some(Duration::from_millis(300)));
    let c = events::db::connect(&bounded, "bounded").await.unwrap();
    // An operator's session holds the lease table.
    let mut holder = events::db::connect(&cfg, "holder").await.unwrap();
    let tx = holder.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE strata.leases IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        Lease::acquire(&c, "pool/p", "placer-a", Duration::from_secs(5)),
    )
    .await
    .expect("the statement must not wait for the lock for ever")
    .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let LeaseError::Database { source, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(
        source.code(),
        Some(&tokio_postgres::error::SqlState::QUERY_CANCELED),
        "{err}"
    );
    // Retryable, and the connection is still good once the lock is gone.
    assert_eq!(err.kind(), events::ErrorKind::Transient);
    tx.rollback().await.unwrap();
    let lease = Lease::acquire(&c, "pool/p", "placer-a", Duration::from_secs(5))
        .await
        .unwrap()
        .expect("free lease");
    assert_eq!(lease.epoch, 1);
    // The limit is the connection's own: others keep the default.
    assert_eq!(shown(&c).await, "300ms");
    assert_eq!(shown(&client).await, "30s");
    let unbounded = events::db::Database::from(&cfg).with_statement_timeout(None);
    let u = events::db::connect(&unbounded, "unbounded").await.unwrap();
    assert_eq!(shown(&u).await, "0");
}

async fn shown(c: &tokio_postgres::Client) -> String {
    c.query_one("SHOW statement_timeout", &[])
        .await
        .unwrap()
        .get::<_, String>(0)
}

/// No holder can renew while the server is down, so that time does not
/// count: a lease that ran out during an outage is held until a TTL after
/// the server is back, for its holder to renew at the same epoch. A lease
/// released before the outage gets no such grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_ran_out_while_the_server_was_down_is_still_its_holders() {
    let cluster = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let cfg: tokio_postgres::Config = url.parse().unwrap();
    let ttl = Duration::from_secs(2);
    let client = events::db::connect(&cfg, "lease-a").await.unwrap();
    let a = Lease::acquire(&client, "gateway/gw-a", "gw-a", ttl)
        .await
        .unwrap()
        .expect("free lease");
    let gone = Lease::acquire(&client, "pool/p", "placer-a", ttl)
        .await
        .unwrap()
        .expect("free lease");
    gone.release(&client).await.unwrap();
    Lease::acquire(&client, "binder", "binder-a", ttl)
        .await
        .unwrap()
        .expect("free lease");
    drop(client);

    // The server goes down and stays down longer than the TTL.
    let mut cluster = cluster;
    tokio::task::block_in_place(|| cluster.stop());
    let down = std::time::Instant::now();
    let client = loop {
        // Refused while it is down: that is what a holder sees.
        let err = events::db::connect(&cfg, "lease-a").await.unwrap_err();
        assert!(events::server_down(&err), "{err}");
        if down.elapsed() > ttl * 2 {
            tokio::task::block_in_place(|| cluster.restart()).unwrap();
            break events::db::connect(&cfg, "lease-a").await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Past its expiry on the database's clock, yet no one else takes it ...
    let expired: bool = client
        .query_one(
            "SELECT expires_at < now() FROM strata.leases WHERE name = 'gateway/gw-a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(expired, "the outage was longer than the lease");
    assert!(
        Lease::acquire(&client, "gateway/gw-a", "gw-b", ttl)
            .await
            .unwrap()
            .is_none(),
        "taken over right after the restart"
    );
    // ... its holder's writes are fenced in, and it renews at the same epoch.
    let mut c = events::db::connect(&cfg, "writer").await.unwrap();
    let tx = c.transaction().await.unwrap();
    a.fence(&tx).await.unwrap();
    tx.commit().await.unwrap();
    a.renew(&client).await.unwrap();
    // The released one was free at once.
    let next = Lease::acquire(&client, "pool/p", "placer-b", ttl)
        .await
        .unwrap()
        .expect("a lease released before the outage is free after it");
    assert_eq!(next.epoch, 2);
    // A holder that does not come back loses it a TTL after the restart.
    let back = std::time::Instant::now();
    let taken = loop {
        if let Some(l) = Lease::acquire(&client, "binder", "binder-b", ttl)
            .await
            .unwrap()
        {
            break l;
        }
        assert!(
            back.elapsed() < ttl * 3,
            "still held {:?} after the restart",
            back.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(taken.epoch, 2);
}
