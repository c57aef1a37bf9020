//! Through a real PgBouncer in transaction mode (Debian's 1.18, which keeps
//! no prepared statement across transactions), with fewer server
//! connections than clients: appends from two appenders at once, reads,
//! leases, a durable subscription whose cursor is stored through the pooler
//! (its replication stream goes to the server itself), and the server's
//! connections left without a prepared statement or a changed setting.

use crate::{ev, reader_config, take};
use events::db::{Database, Sql};
use events::lease::Lease;
use events::{Appender, AppenderConfig, ExpectedVersion, Position, Reader, Start};
use std::time::Duration;

/// A migrated database, the URL through a PgBouncer in front of it, and
/// the PgBouncer (dropping it stops it).
async fn pooled() -> (Database, Database, testkit::Bouncer) {
    let cluster = testkit::shared_cluster();
    let url = testkit::migrated_database(cluster).await;
    let bouncer = testkit::temp_bouncer(cluster).expect("start pgbouncer");
    let name = url.rsplit('/').next().unwrap().to_string();
    let direct = Database::parse(&url).unwrap();
    let through = Database::parse(&bouncer.url(&name)).unwrap();
    (through.through_pooler(direct.clone()), direct, bouncer)
}

#[tokio::test]
async fn appends_reads_leases_and_cursors_work_through_pgbouncer_in_transaction_mode() {
    let (db, direct, _bouncer) = pooled().await;
    assert!(db.pooled() && !direct.pooled());

    // Two appenders (four connections) through four server connections,
    // many batches each: every statement unnamed, nothing left behind.
    let a = Appender::start(db.clone(), AppenderConfig::default());
    let b = Appender::start(db.clone(), AppenderConfig::default());
    let mut tasks = Vec::new();
    for (k, app) in [a.clone(), b.clone()].into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            for i in 0..60u64 {
                app.append(
                    &format!("p-{k}-{}", i % 5),
                    ExpectedVersion::Any,
                    vec![ev(i)],
                )
                .await
                .expect("append through pgbouncer");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Optimistic concurrency holds through the pooler.
    let err = a
        .append("p-0-0", ExpectedVersion::Exact(3), vec![ev(0)])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("version"), "{err}");

    // Reads through the pooler: head (with its flush barrier), pages, one
    // stream; and plain statements from a second client at the same time.
    let c1 = events::db::connect(&db, "pooled-read").await.unwrap();
    let c2 = events::db::connect(&db, "pooled-read-2").await.unwrap();
    for _ in 0..10 {
        let (head, page) = tokio::join!(
            events::read::head(&c1),
            events::read::after(&c2, Position(0), 500)
        );
        assert_eq!(head.unwrap(), Position(120));
        assert_eq!(page.unwrap().len(), 120);
    }
    let s = events::read::stream(&c1, "p-1-3").await.unwrap();
    assert_eq!(
        s.iter().map(|e| e.version).collect::<Vec<_>>(),
        (1..=12).collect::<Vec<_>>()
    );

    // Leases: acquire, a second holder refused, renew, release.
    let lease = Lease::acquire(&c1, "pooled-lease", "one", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("free lease");
    assert!(
        Lease::acquire(&c2, "pooled-lease", "two", Duration::from_secs(30))
            .await
            .unwrap()
            .is_none()
    );
    lease.renew(&c2).await.unwrap();
    lease.release(&c1).await.unwrap();

    // A durable subscription: SQL (catch-up pages, the cursor) through the
    // pooler, the replication stream to the server itself.
    let r = Reader::start(db.clone(), reader_config());
    {
        let mut sub = r.subscribe("pooled", Start::Beginning).await.unwrap();
        let got = take(&mut sub, 120).await;
        assert_eq!(got, (1..=120).collect::<Vec<_>>());
        sub.ack(Position(100));
        sub.flush_acks().await.unwrap();
    }
    a.append("p-live", ExpectedVersion::Any, vec![ev(1)])
        .await
        .unwrap();
    let mut sub = r.subscribe("pooled", Start::Now).await.unwrap();
    assert_eq!(take(&mut sub, 21).await, (101..=121).collect::<Vec<_>>());
    drop(sub);
    drop(r);

    // What the pooler's server connections were left with: no prepared
    // statement, and synchronous_commit as the server has it.
    let server = events::db::connect(&direct, "check").await.unwrap();
    let default: String = server
        .one(
            "SELECT setting FROM pg_settings WHERE name = 'synchronous_commit'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    for _ in 0..8 {
        let row = c1
            .one(
                "SELECT (SELECT count(*) FROM pg_prepared_statements), current_setting('synchronous_commit')",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(
            row.get::<_, i64>(0),
            0,
            "a prepared statement left on a server connection"
        );
        assert_eq!(
            row.get::<_, String>(1),
            default,
            "a session setting left on a server connection"
        );
    }
}

#[tokio::test]
async fn the_command_line_client_works_through_pgbouncer() {
    // What once failed with `prepared statement "s0" already exists`: the
    // same statements again from a new client on a server connection the
    // last one used.
    let (db, _direct, _bouncer) = pooled().await;
    for i in 0..5 {
        let c = events::db::connect(&db, "short-lived").await.unwrap();
        let a = Appender::start(db.clone(), AppenderConfig::default());
        a.append("cli", ExpectedVersion::Any, vec![ev(i)])
            .await
            .expect("append from a new client");
        let head = events::read::head(&c).await.unwrap();
        assert_eq!(head, Position(i + 1));
    }
}
