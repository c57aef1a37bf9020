//! Integration tests of the schema crate against a private Postgres.

use std::time::{Duration, SystemTime, UNIX_EPOCH};
use testkit::{fresh_database, shared_cluster};

async fn client(url: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c
}

#[tokio::test]
async fn migrations_apply_once_when_two_processes_start_together() {
    let url = fresh_database(shared_cluster()).await;
    let mut a = client(&url).await;
    let mut b = client(&url).await;
    let (ra, rb) = tokio::join!(schema::migrate(&mut a), schema::migrate(&mut b));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    let all: Vec<i32> = schema::MIGRATIONS.iter().map(|m| m.version).collect();
    // One of them applied everything, the other found nothing to do.
    assert!(
        (ra == all && rb.is_empty()) || (rb == all && ra.is_empty()),
        "{ra:?} {rb:?}"
    );
    let n: i64 = a
        .query_one("SELECT count(*) FROM strata.schema_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n as usize, all.len());
    assert!(schema::migrate(&mut a).await.unwrap().is_empty());
}

#[tokio::test]
async fn an_edited_migration_is_refused() {
    let url = fresh_database(shared_cluster()).await;
    let mut c = client(&url).await;
    schema::migrate(&mut c).await.unwrap();
    c.execute(
        "UPDATE strata.schema_migrations SET checksum = 'edited' WHERE version = 1",
        &[],
    )
    .await
    .unwrap();
    let err = schema::migrate(&mut c).await.unwrap_err();
    assert!(
        matches!(err, schema::Error::ChecksumMismatch { version: 1, .. }),
        "{err}"
    );
    assert!(!err.is_transient());
}

#[tokio::test]
async fn a_binary_runs_against_a_newer_schema_that_only_expands() {
    // Before rolling upgrades a binary refused any schema newer than its
    // own ("the database is at migration 15 but this build knows only up
    // to 14").
    let url = fresh_database(shared_cluster()).await;
    let mut c = client(&url).await;
    let applied = schema::migrate::migrate_with(&mut c, &testkit::next_release(false))
        .await
        .unwrap();
    assert_eq!(applied.last(), Some(&(schema::migrate::known() + 1)));
    assert_eq!(schema::migrate(&mut c).await.unwrap(), Vec::<i32>::new());
    let plan = schema::migrate::plan(&c, schema::MIGRATIONS).await.unwrap();
    assert!(plan.runnable && plan.pending.is_empty(), "{plan:?}");
    assert_eq!(plan.unknown.len(), 1);
    assert_eq!(plan.unknown[0].needs, None);
}

#[tokio::test]
async fn a_contracting_migration_waits_for_older_processes_then_refuses_older_binaries() {
    let url = fresh_database(shared_cluster()).await;
    let mut c = client(&url).await;
    schema::migrate(&mut c).await.unwrap();
    // A process of this build is running (it knows one schema less than
    // the contraction needs).
    let started = SystemTime::now();
    schema::migrate::register(&c, "old-host", started, "0.0.0", "placer")
        .await
        .unwrap();
    let next = testkit::next_release(true);
    let plan = schema::migrate::plan(&c, &next).await.unwrap();
    assert_eq!(
        plan.pending.iter().map(|p| p.change).collect::<Vec<_>>(),
        ["expand", "contract"]
    );
    assert!(plan.pending[0].blocked_by.is_empty());
    assert_eq!(plan.pending[1].blocked_by.len(), 1, "{plan:?}");
    assert_eq!(plan.pending[1].blocked_by[0].host, "old-host");
    assert!(plan.pending[1].statements[0].starts_with("ALTER TABLE strata.processes DROP COLUMN"));

    // The expansion is applied; the contraction waits for the old process.
    let applied = schema::migrate::migrate_with(&mut c, &next).await.unwrap();
    assert_eq!(applied, [schema::migrate::known() + 1]);
    // The old binary still runs against it.
    schema::migrate(&mut c).await.unwrap();

    // Once the old process is gone, the contraction is applied, and a
    // binary that knows too little refuses the database, saying why.
    schema::migrate::unregister(&c, "old-host", started)
        .await
        .unwrap();
    let applied = schema::migrate::migrate_with(&mut c, &next).await.unwrap();
    assert_eq!(applied, [schema::migrate::known() + 2]);
    let err = schema::migrate(&mut c).await.unwrap_err();
    assert!(
        matches!(err, schema::Error::TooNew { needs, known, .. } if needs == known + 1),
        "{err}"
    );
    assert!(err.to_string().contains("contracts the schema"), "{err}");
    assert!(!err.is_transient());
}

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

#[tokio::test]
async fn partitions_are_created_ahead_and_listed() {
    let url = fresh_database(shared_cluster()).await;
    let mut c = client(&url).await;
    schema::migrate(&mut c).await.unwrap();
    // 2030-01-15T00:00:00Z
    let jan = at(1_894_665_600);
    let created = schema::partitions::ensure(&c, 2, jan).await.unwrap();
    assert_eq!(created, 3);
    assert_eq!(
        schema::partitions::ensure(&c, 2, jan).await.unwrap(),
        0,
        "idempotent"
    );
    let names: Vec<String> = schema::partitions::list(&c)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    for m in ["events_2030_01", "events_2030_02", "events_2030_03"] {
        assert!(names.contains(&m.to_string()), "{m} missing from {names:?}");
    }
    // A row at the very end of January lands in January, the next
    // microsecond in February.
    c.batch_execute(
        "INSERT INTO strata.events (position, stream, version, type, payload, recorded_at) VALUES
           (1, 's', 1, 't', '{}', '2030-01-31T23:59:59.999999Z'),
           (2, 's', 2, 't', '{}', '2030-02-01T00:00:00Z')",
    )
    .await
    .unwrap();
    let parts = schema::partitions::list(&c).await.unwrap();
    let rows = |n: &str| parts.iter().find(|p| p.name == n).unwrap().rows;
    assert_eq!(rows("events_2030_01"), 1);
    assert_eq!(rows("events_2030_02"), 1);
    assert!(parts.iter().all(|p| p.bytes > 0));
}

#[tokio::test]
async fn concurrent_partition_creation_does_not_fail() {
    let url = fresh_database(shared_cluster()).await;
    let mut c = client(&url).await;
    schema::migrate(&mut c).await.unwrap();
    let far = at(2_000_000_000); // 2033-05
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let c = client(&url).await;
            schema::partitions::ensure(&c, 3, far).await.unwrap()
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert_eq!(total, 4, "each month created exactly once");
}

#[test]
fn missing_server_binaries_are_reported_with_the_package_to_install() {
    let msg = schema::ClusterError::NoServerBinaries.to_string();
    assert!(msg.contains("apt-get install postgresql"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_never_holds_up_the_event_table_behind_a_reader() {
    // A migration that locks the event table, while a reader (an
    // auditor's open transaction) holds it: the migration gives up its
    // place in the lock queue after its lock timeout and tries again, so
    // the statements queued behind it go on, and it is applied once the
    // reader is gone.
    let cluster = testkit::shared_cluster();
    let url = testkit::migrated_database(cluster).await;
    let mut reader = client(&url).await;
    let tx = reader.transaction().await.unwrap();
    tx.query_one("SELECT count(*) FROM strata.events", &[])
        .await
        .unwrap();
    let mut migrator = client(&url).await;
    let mut migrations = schema::migrate::MIGRATIONS.to_vec();
    migrations.push(schema::migrate::Migration {
        version: 9_999,
        name: "probe",
        sql: "ALTER TABLE strata.events ADD COLUMN probe integer",
        change: schema::Change::Expand,
    });
    let migrating =
        tokio::spawn(
            async move { schema::migrate::migrate_with(&mut migrator, &migrations).await },
        );
    // Others keep using the table meanwhile: none waits for the reader.
    let other = client(&url).await;
    let started = std::time::Instant::now();
    let mut slowest = std::time::Duration::ZERO;
    while started.elapsed() < std::time::Duration::from_secs(6) {
        let t = std::time::Instant::now();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            other.query_one("SELECT count(*) FROM strata.events", &[]),
        )
        .await
        .expect("a statement queued behind the migration, which waits for the reader")
        .unwrap();
        slowest = slowest.max(t.elapsed());
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        slowest < std::time::Duration::from_secs(4),
        "a statement waited {slowest:?} behind the migration"
    );
    assert!(
        !migrating.is_finished(),
        "the migration went past the reader"
    );
    tx.rollback().await.unwrap();
    let applied = tokio::time::timeout(std::time::Duration::from_secs(30), migrating)
        .await
        .expect("the migration is applied once the reader is gone")
        .unwrap()
        .unwrap();
    assert_eq!(applied, [9_999]);
}
