use crate::{appender, db, ev, table_positions};
use events::{
    AppendError, Appender, AppenderConfig, ErrorKind, ExpectedVersion, NewEvent, StreamAppend,
};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[tokio::test]
async fn append_assigns_versions_and_gap_free_positions() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    let first = a
        .append("s/1", ExpectedVersion::NoStream, vec![ev(1), ev(2), ev(3)])
        .await
        .unwrap();
    assert_eq!(
        (first.version, first.first_position.0, first.last_position.0),
        (3, 1, 3)
    );
    let second = a
        .append("s/1", ExpectedVersion::Exact(3), vec![ev(4), ev(5)])
        .await
        .unwrap();
    assert_eq!(
        (
            second.version,
            second.first_position.0,
            second.last_position.0
        ),
        (5, 4, 5)
    );
    let other = a
        .append("s/2", ExpectedVersion::Any, vec![ev(6)])
        .await
        .unwrap();
    assert_eq!((other.version, other.last_position.0), (1, 6));
    let rows = events::read::stream(&client, "s/1").await.unwrap();
    let versions: Vec<u64> = rows.iter().map(|e| e.version).collect();
    assert_eq!(versions, [1, 2, 3, 4, 5]);
    assert_eq!(rows[3].payload, r#"{"n": 4}"#);
    assert_eq!(table_positions(&client).await, [1, 2, 3, 4, 5, 6]);
}

#[tokio::test]
async fn version_conflict_names_the_stream_and_both_versions() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    a.append("pool/p1", ExpectedVersion::Any, vec![ev(1), ev(2)])
        .await
        .unwrap();
    let err = a
        .append("pool/p1", ExpectedVersion::Exact(1), vec![ev(3)])
        .await
        .unwrap_err();
    match &err {
        AppendError::VersionConflict {
            stream,
            expected,
            actual,
        } => {
            assert_eq!(stream, "pool/p1");
            assert_eq!(*expected, ExpectedVersion::Exact(1));
            assert_eq!(*actual, 2);
        }
        other => panic!("expected a conflict, got {other}"),
    }
    assert_eq!(err.kind(), ErrorKind::Definite);
    assert_eq!(
        err.to_string(),
        "version conflict on stream \"pool/p1\": expected 1, actual 2"
    );
    let err = a
        .append("pool/p1", ExpectedVersion::NoStream, vec![ev(3)])
        .await
        .unwrap_err();
    assert!(
        matches!(err, AppendError::VersionConflict { actual: 2, .. }),
        "{err}"
    );
    let err = a
        .append("pool/none", ExpectedVersion::StreamExists, vec![ev(3)])
        .await
        .unwrap_err();
    assert!(
        matches!(err, AppendError::VersionConflict { actual: 0, .. }),
        "{err}"
    );
    assert_eq!(
        table_positions(&client).await.len(),
        2,
        "nothing written by refused appends"
    );
}

#[tokio::test]
async fn a_batch_across_streams_is_all_or_nothing() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    a.append("b", ExpectedVersion::Any, vec![ev(1)])
        .await
        .unwrap();
    let batch = vec![
        StreamAppend {
            stream: "a".into(),
            expected: ExpectedVersion::NoStream,
            events: vec![ev(2)],
        },
        StreamAppend {
            stream: "b".into(),
            expected: ExpectedVersion::Exact(0),
            events: vec![ev(3)],
        },
    ];
    let err = a.append_batch(batch).await.unwrap_err();
    assert!(
        matches!(&err, AppendError::VersionConflict { stream, .. } if stream == "b"),
        "{err}"
    );
    assert!(events::read::stream(&client, "a").await.unwrap().is_empty());
    let batch = vec![
        StreamAppend {
            stream: "a".into(),
            expected: ExpectedVersion::NoStream,
            events: vec![ev(2), ev(3)],
        },
        StreamAppend {
            stream: "b".into(),
            expected: ExpectedVersion::Exact(1),
            events: vec![ev(4)],
        },
    ];
    let out = a.append_batch(batch).await.unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(
        (
            out[0].first_position.0,
            out[0].last_position.0,
            out[1].last_position.0
        ),
        (2, 3, 4)
    );
    // One transaction: all three rows carry the same xid.
    let xids: i64 = client
        .query_one(
            "SELECT count(DISTINCT xid::text) FROM strata.events WHERE position >= 2",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(xids, 1);
}

#[tokio::test]
async fn malformed_and_oversized_events_are_refused_before_anything_is_written() {
    let (cfg, client) = db().await;
    let a = events::Appender::start(
        cfg.clone(),
        AppenderConfig {
            max_payload_bytes: 64,
            ..AppenderConfig::default()
        },
    );
    let big = NewEvent::new("t", &serde_json::json!({ "x": "y".repeat(100) }));
    let cases: Vec<(&str, Vec<NewEvent>, &str)> = vec![
        ("s", vec![big], "exceeds the limit of 64 bytes"),
        (
            "s",
            vec![NewEvent::new("t", &serde_json::json!([1, 2]))],
            "must be a JSON object",
        ),
        (
            "s",
            vec![NewEvent::new("t", &serde_json::json!({ "x": "a\u{0}b" }))],
            "NUL character",
        ),
        (
            "s",
            vec![NewEvent::new("bad type!", &serde_json::json!({}))],
            "may use only ASCII",
        ),
        (
            "s",
            vec![NewEvent::new("", &serde_json::json!({}))],
            "event type must be 1 to 128 bytes",
        ),
        ("", vec![ev(1)], "stream name must be 1 to 256 bytes"),
        ("a b", vec![ev(1)], "whitespace or control characters"),
        ("s", vec![], "no events for stream"),
    ];
    for (stream, evs, want) in cases {
        let err = a
            .append(stream, ExpectedVersion::Any, evs)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains(want),
            "{err} should mention {want:?}"
        );
        assert_eq!(err.kind(), ErrorKind::Definite);
    }
    assert!(NewEvent::from_json("t", "{not json")
        .unwrap_err()
        .contains("not valid JSON"));
    // One bad event refuses the whole batch.
    let err = a
        .append_batch(vec![
            StreamAppend {
                stream: "ok".into(),
                expected: ExpectedVersion::Any,
                events: vec![ev(1)],
            },
            StreamAppend {
                stream: "ok2".into(),
                expected: ExpectedVersion::Any,
                events: vec![NewEvent::new("t", &serde_json::json!(3))],
            },
        ])
        .await
        .unwrap_err();
    assert!(matches!(err, AppendError::Invalid(_)), "{err}");
    assert!(table_positions(&client).await.is_empty());
    let streams: i64 = client
        .query_one("SELECT count(*) FROM strata.streams", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(streams, 0);
}

#[tokio::test]
async fn group_commit_coalesces_64_concurrent_writers() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    let per_writer = 40u64;
    let mut tasks = Vec::new();
    for w in 0..64u64 {
        let a = a.clone();
        let cfg = cfg.clone();
        tasks.push(tokio::spawn(async move {
            let check = events::db::connect(&cfg, "check").await.unwrap();
            let stream = format!("writer/{w}");
            let mut positions = Vec::new();
            for i in 0..per_writer {
                let out = a
                    .append(&stream, ExpectedVersion::Exact(i), vec![ev(w * 1000 + i)])
                    .await
                    .unwrap();
                assert_eq!(out.version, i + 1);
                // Answered only after commit: a new snapshot already sees it.
                if i % 8 == 0 {
                    let seen: i64 = check
                        .query_one(
                            "SELECT count(*) FROM strata.events WHERE position = $1",
                            &[&(out.last_position.0 as i64)],
                        )
                        .await
                        .unwrap()
                        .get(0);
                    assert_eq!(seen, 1, "acknowledged append not visible");
                }
                positions.push(out.last_position.0);
            }
            positions
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let total = 64 * per_writer;
    all.sort_unstable();
    assert_eq!(
        all,
        (1..=total).collect::<Vec<_>>(),
        "every position handed out once, no gaps"
    );
    assert_eq!(table_positions(&client).await, all);
    let txns: i64 = client
        .query_one("SELECT count(DISTINCT xid::text) FROM strata.events", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        (txns as u64) < total / 2,
        "{txns} transactions for {total} appends: group commit did not coalesce"
    );
}

/// Appends that come a few milliseconds apart, none waiting on another,
/// share transactions when the appender has a group delay: the first after
/// a quiet goes at once, the ones after it wait for company.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_coming_close_together_share_a_transaction_within_the_group_delay() {
    let (cfg, client) = db().await;
    async fn spaced(a: &events::Appender, prefix: &str) {
        let mut tasks = Vec::new();
        for i in 0..20 {
            let (a, stream) = (a.clone(), format!("{prefix}-{i}"));
            tasks.push(tokio::spawn(async move {
                a.append(&stream, ExpectedVersion::NoStream, vec![ev(i)])
                    .await
                    .unwrap()
            }));
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        for t in tasks {
            t.await.unwrap();
        }
    }
    let transactions = |prefix: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT count(DISTINCT xid::text) FROM strata.events WHERE stream LIKE $1",
                    &[&format!("{prefix}-%")],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    let plain = events::Appender::start(cfg.clone(), AppenderConfig::default());
    spaced(&plain, "plain").await;
    let grouped = events::Appender::start(
        cfg.clone(),
        AppenderConfig {
            group_delay: Duration::from_millis(200),
            ..AppenderConfig::default()
        },
    );
    spaced(&grouped, "grouped").await;
    let (plain, grouped) = (transactions("plain").await, transactions("grouped").await);
    // Without the delay, how many the same appends took depends on how
    // long each commit takes on this machine (a busy flusher's batch waits
    // for its share): told, not asserted.
    assert!(
        grouped <= 3,
        "20 appends 3 ms apart with a 200 ms group delay took {grouped} transactions (without it: {plain})"
    );
}

#[tokio::test]
async fn a_flusher_waiting_for_its_share_does_not_wait_on_a_stuck_one() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    a.append("held", ExpectedVersion::NoStream, vec![ev(0)])
        .await
        .unwrap();
    // Another session holds the stream's row: the batch appending to it
    // stays in its flusher, which counts as busy, with 50 events in flight.
    let mut locker = events::db::connect(&cfg, "locker").await.unwrap();
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM strata.streams WHERE stream = 'held' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let held = {
        let a = a.clone();
        tokio::spawn(async move {
            a.append(
                "held",
                ExpectedVersion::Exact(1),
                (1..=50).map(ev).collect(),
            )
            .await
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%strata.streams%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the batch for the held stream never blocked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A one-event append is far below half of the 51 events in flight; it
    // must still be committed by the other flusher, not wait for the stuck
    // one.
    for v in 0..3u64 {
        let out = tokio::time::timeout(
            Duration::from_secs(5),
            a.append("free", ExpectedVersion::Exact(v), vec![ev(100 + v)]),
        )
        .await
        .expect("an append waited for a stuck flusher")
        .unwrap();
        assert_eq!(out.version, v + 1);
    }
    assert!(
        !held.is_finished(),
        "the held stream's row was released early"
    );
    tx.rollback().await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("the held batch was not committed after the lock was released")
        .unwrap()
        .unwrap();
    assert_eq!(out.version, 51);
}

#[tokio::test]
async fn racing_writers_on_one_stream_never_fork_it() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    let mut tasks = Vec::new();
    for w in 0..16u64 {
        let a = a.clone();
        tasks.push(tokio::spawn(async move {
            let (mut done, mut conflicts, mut expected) = (0, 0, 0u64);
            while done < 10 {
                match a
                    .append("hot", ExpectedVersion::Exact(expected), vec![ev(w)])
                    .await
                {
                    Ok(out) => {
                        expected = out.version;
                        done += 1;
                    }
                    Err(AppendError::VersionConflict { actual, .. }) => {
                        expected = actual;
                        conflicts += 1;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            conflicts
        }));
    }
    let mut conflicts = 0;
    for t in tasks {
        conflicts += t.await.unwrap();
    }
    assert!(conflicts > 0, "16 racing writers should have conflicted");
    let versions: Vec<u64> = events::read::stream(&client, "hot")
        .await
        .unwrap()
        .iter()
        .map(|e| e.version)
        .collect();
    assert_eq!(versions, (1..=160).collect::<Vec<_>>());
}

/// Midnight UTC at the start of 2031-02-01.
const FEB_2031: u64 = 1_927_670_400;

#[tokio::test]
async fn appends_roll_over_a_month_boundary_into_the_next_partition() {
    let (cfg, client) = db().await;
    let after = Arc::new(AtomicBool::new(false));
    let flag = after.clone();
    let clock: events::append::Clock = Arc::new(move || {
        let base = UNIX_EPOCH + Duration::from_secs(FEB_2031);
        if flag.load(Ordering::SeqCst) {
            base + Duration::from_micros(1)
        } else {
            base - Duration::from_micros(1)
        }
    });
    // Nothing was created for 2031: the appender makes the month on demand.
    let a = events::Appender::start(
        cfg.clone(),
        AppenderConfig {
            clock: Some(clock),
            ..AppenderConfig::default()
        },
    );
    a.append("roll", ExpectedVersion::Any, vec![ev(1)])
        .await
        .unwrap();
    after.store(true, Ordering::SeqCst);
    a.append("roll", ExpectedVersion::Exact(1), vec![ev(2)])
        .await
        .unwrap();
    let parts = schema::partitions::list(&client).await.unwrap();
    let rows = |n: &str| parts.iter().find(|p| p.name == n).map(|p| p.rows);
    assert_eq!(rows("events_2031_01"), Some(1), "{parts:?}");
    assert_eq!(rows("events_2031_02"), Some(1), "{parts:?}");
    // Read across partitions: one log, in position order.
    let reader = crate::reader(&cfg);
    let mut sub = reader
        .subscribe_ephemeral(events::Start::Beginning)
        .await
        .unwrap();
    let first = sub.next().await.unwrap();
    let second = sub.next().await.unwrap();
    assert_eq!((first.version, second.version), (1, 2));
    assert!(first.recorded_at < UNIX_EPOCH + Duration::from_secs(FEB_2031));
    assert!(second.recorded_at > UNIX_EPOCH + Duration::from_secs(FEB_2031));
    assert!(first.recorded_at < SystemTime::now() + Duration::from_secs(10 * 365 * 86400));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_database_is_a_transient_error_and_the_appender_recovers() {
    let cluster = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let cfg: tokio_postgres::Config = url.parse().unwrap();
    let a = appender(&cfg);
    a.append("x", ExpectedVersion::Any, vec![ev(1)])
        .await
        .unwrap();
    let mut cluster = cluster;
    tokio::task::block_in_place(|| cluster.stop());
    let err = a
        .append("x", ExpectedVersion::Any, vec![ev(2)])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    tokio::task::block_in_place(|| cluster.restart()).unwrap();
    let out = a
        .append("x", ExpectedVersion::Exact(1), vec![ev(2)])
        .await
        .unwrap();
    assert_eq!(out.version, 2);
    let seen: HashSet<u64> = [out.last_position.0].into_iter().collect();
    assert!(seen.contains(&2));
}

/// Regression: the first barrier only took a transaction id; Postgres does not
/// flush WAL for a transaction that wrote none, so acknowledged appends could
/// be lost in a crash.
#[tokio::test]
async fn the_flush_barrier_returns_only_after_earlier_commits_are_flushed() {
    let (_cfg, client) = db().await;
    client
        .batch_execute("CREATE TABLE scratch (t text)")
        .await
        .unwrap();
    for _ in 0..20 {
        client
            .batch_execute(
                "BEGIN; SET LOCAL synchronous_commit TO off;
                 INSERT INTO scratch SELECT repeat('x', 100) FROM generate_series(1, 100);
                 COMMIT",
            )
            .await
            .unwrap();
        let before: String = client
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        events::read::flush_barrier(&client).await.unwrap();
        let flushed: bool = client
            .query_one(
                "SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn",
                &[&before],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            flushed,
            "WAL written before the barrier is not flushed after it"
        );
    }
}

#[tokio::test]
async fn append_in_commits_and_rolls_back_with_the_callers_transaction() {
    let (cfg, mut client) = db().await;
    let a = appender(&cfg);
    let limits = AppenderConfig::default();
    a.append("s/a", ExpectedVersion::NoStream, vec![ev(1)])
        .await
        .unwrap();
    client
        .batch_execute("CREATE TABLE side (x int)")
        .await
        .unwrap();
    let two = |stream: &str, expected, n| StreamAppend {
        stream: stream.into(),
        expected,
        events: (0..n).map(ev).collect(),
    };

    // Rolled back: neither the row nor the events nor the version bumps stay,
    // and the next append takes the next position, leaving no gap.
    let tx = client.transaction().await.unwrap();
    tx.batch_execute("INSERT INTO side VALUES (1)")
        .await
        .unwrap();
    let out = events::append::append_in(
        &tx,
        vec![
            two("s/b", ExpectedVersion::NoStream, 2),
            two("s/a", ExpectedVersion::Exact(1), 1),
        ],
        &limits,
    )
    .await
    .unwrap();
    assert_eq!(
        out.iter()
            .map(|o| (
                o.stream.as_str(),
                o.version,
                o.first_position.0,
                o.last_position.0
            ))
            .collect::<Vec<_>>(),
        [("s/b", 2, 2, 3), ("s/a", 2, 4, 4)]
    );
    tx.rollback().await.unwrap();
    let next = a
        .append("s/a", ExpectedVersion::Exact(1), vec![ev(2)])
        .await
        .unwrap();
    assert_eq!((next.version, next.last_position.0), (2, 2));

    // A conflict undoes only that call: the transaction goes on and commits
    // its row with the events of a second call.
    let tx = client.transaction().await.unwrap();
    let err =
        events::append::append_in(&tx, vec![two("s/a", ExpectedVersion::Exact(5), 1)], &limits)
            .await
            .unwrap_err();
    assert!(
        matches!(&err, AppendError::VersionConflict { stream, actual: 2, .. } if stream == "s/a"),
        "{err:?}"
    );
    let err = events::append::append_in(&tx, vec![two("s/c", ExpectedVersion::Any, 0)], &limits)
        .await
        .unwrap_err();
    assert!(matches!(err, AppendError::Invalid(_)), "{err:?}");
    tx.batch_execute("INSERT INTO side VALUES (2)")
        .await
        .unwrap();
    let out =
        events::append::append_in(&tx, vec![two("s/a", ExpectedVersion::Exact(2), 1)], &limits)
            .await
            .unwrap();
    assert_eq!((out[0].version, out[0].last_position.0), (3, 3));
    tx.commit().await.unwrap();

    let side: Vec<i32> = client
        .query("SELECT x FROM side ORDER BY x", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(side, [2]);
    let versions: Vec<u64> = events::read::stream(&client, "s/a")
        .await
        .unwrap()
        .iter()
        .map(|e| e.version)
        .collect();
    assert_eq!(versions, [1, 2, 3]);
    assert!(events::read::stream(&client, "s/b")
        .await
        .unwrap()
        .is_empty());
    assert_eq!(table_positions(&client).await, [1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_left_in_an_open_transaction_does_not_stall_appends_behind_partition_creation() {
    // An auditor's `BEGIN; SELECT count(*) FROM strata.events;` left idle:
    // creating next months' partitions must give up rather than queue a
    // lock on the event table that every append then queues behind.
    let (cfg, _client) = db().await;
    let a = appender(&cfg);
    a.append("before", ExpectedVersion::Any, vec![ev(1)])
        .await
        .unwrap();
    let mut reader = events::db::connect(&cfg, "idle-reader").await.unwrap();
    let tx = reader.transaction().await.unwrap();
    tx.query_one("SELECT count(*) FROM strata.events", &[])
        .await
        .unwrap();
    let maintenance = events::db::connect(&cfg, "maintenance").await.unwrap();
    let started = std::time::Instant::now();
    let ensure = tokio::spawn(async move {
        // Twelve months ahead: months that do not exist yet.
        schema::partitions::ensure(&maintenance, 12, SystemTime::now()).await
    });
    // Appends go on meanwhile, each in well under a second.
    for i in 0..20u64 {
        let t = std::time::Instant::now();
        tokio::time::timeout(
            Duration::from_secs(5),
            a.append("during", ExpectedVersion::Any, vec![ev(i)]),
        )
        .await
        .expect("an append waited behind the partition creation")
        .unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "an append took {:?}",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The creation gave up (it will be tried again), within its lock timeout.
    let outcome = tokio::time::timeout(Duration::from_secs(10), ensure)
        .await
        .expect("the partition creation waited on the reader")
        .unwrap();
    let err = outcome.unwrap_err();
    // lock_not_available (55P03): the lock timeout, not another failure.
    assert!(format!("{err:?}").contains("55P03"), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Once the reader is gone, it succeeds.
    tx.rollback().await.unwrap();
    let maintenance = events::db::connect(&cfg, "maintenance").await.unwrap();
    assert!(
        schema::partitions::ensure(&maintenance, 12, SystemTime::now())
            .await
            .unwrap()
            > 0
    );
}

/// Every process of the cluster stopped (SIGSTOP) or resumed (SIGCONT): a
/// database that accepts TCP and answers nothing.
pub(crate) fn signal_cluster(cluster: &schema::Cluster, sig: &str) {
    let pm = cluster.postmaster_pid().expect("the postmaster's pid");
    let mut pids = vec![pm];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let after = stat.rsplit(')').next().unwrap_or("");
        if after.split_whitespace().nth(1) == Some(&pm.to_string()) {
            pids.push(pid);
        }
    }
    for pid in pids {
        let _ = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_stops_answering_fails_appends_in_bounded_time_and_they_resume() {
    let cluster = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let db = events::db::Database::parse(&url).unwrap();
    assert_eq!(
        db.config.get_connect_timeout(),
        Some(&events::db::DEFAULT_CONNECT_TIMEOUT),
        "a URL without connect_timeout gets the default"
    );
    let appender = Appender::start(
        &db,
        AppenderConfig {
            attempt_timeout: Duration::from_secs(2),
            ..AppenderConfig::default()
        },
    );
    appender
        .append("stop/1", ExpectedVersion::NoStream, vec![ev(1)])
        .await
        .unwrap();
    signal_cluster(&cluster, "-STOP");
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        appender.append("stop/2", ExpectedVersion::NoStream, vec![ev(2)]),
    )
    .await;
    let waited = started.elapsed();
    signal_cluster(&cluster, "-CONT");
    let r = r.expect("the append returned instead of hanging");
    assert!(matches!(r, Err(AppendError::OutcomeUnknown(_))), "{r:?}");
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
    // The database is back: the same appender goes on, and the append whose
    // outcome was unknown is found by retrying it with its expected version.
    let mut tries = 0;
    loop {
        match appender
            .append("stop/2", ExpectedVersion::NoStream, vec![ev(2)])
            .await
        {
            Ok(_) | Err(AppendError::VersionConflict { .. }) => break,
            Err(e) => {
                tries += 1;
                assert!(tries < 100, "never resumed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    appender
        .append("stop/3", ExpectedVersion::NoStream, vec![ev(3)])
        .await
        .unwrap();
}

/// An appender cut off from the server inside its transaction (the link
/// silent, no reset ever sent) leaves its backend idle in the transaction,
/// holding the row locks of its streams. The server ends that transaction
/// once it has waited as long as the appender waits for a batch, so the
/// stream's other writers go on: without it they waited until the server's
/// TCP keepalive gave up on the link, hours later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_appender_cut_off_inside_its_transaction_does_not_hold_its_streams() {
    let (cfg, client) = db().await;
    let direct = appender(&cfg);
    direct
        .append("held/1", ExpectedVersion::NoStream, vec![ev(1)])
        .await
        .unwrap();
    // The appender to be cut off reaches the server through a proxy.
    let host = match &cfg.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        other => panic!("a TCP host, not {other:?}"),
    };
    let upstream: std::net::SocketAddr = format!("{host}:{}", cfg.get_ports()[0]).parse().unwrap();
    let proxy = testkit::cut::Cut::to(upstream).await;
    let via: tokio_postgres::Config = format!(
        "postgres://{}@{}/{}",
        cfg.get_user().unwrap(),
        proxy.addr,
        cfg.get_dbname().unwrap()
    )
    .parse()
    .unwrap();
    let limit = Duration::from_secs(2);
    let cut_off = Appender::start(
        via,
        AppenderConfig {
            attempt_timeout: limit,
            ..AppenderConfig::default()
        },
    );
    // Its stream bump waits on the stream's row, locked here ...
    let mut locker = events::db::connect(&cfg, "locker").await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM strata.streams WHERE stream = 'held/1' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let stuck = tokio::spawn(async move {
        cut_off
            .append("held/1", ExpectedVersion::Any, vec![ev(2)])
            .await
    });
    testkit::eventually(
        20,
        "the cut-off appender's bump waiting on the row lock",
        || {
            let client = &client;
            async move { crate::waiting_on_a_lock(client, "%INSERT INTO strata.streams%").await == 1 }
        },
    )
    .await;
    // ... then the link goes silent and the lock is let go: the bump takes
    // the row, and its answer never reaches the appender.
    proxy.hold();
    lock.commit().await.unwrap();
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        direct.append("held/1", ExpectedVersion::Any, vec![ev(3)]),
    )
    .await;
    assert!(
        matches!(r, Ok(Ok(_))),
        "the stream's other writer went on: {r:?} after {:?}",
        started.elapsed()
    );
    assert!(
        started.elapsed() < limit + Duration::from_secs(5),
        "within the appender's own limit: {:?}",
        started.elapsed()
    );
    let out = stuck.await.unwrap();
    assert!(out.is_err(), "the cut-off append did not commit: {out:?}");
    let versions: Vec<u64> = events::read::stream(&client, "held/1")
        .await
        .unwrap()
        .iter()
        .map(|e| e.version)
        .collect();
    assert_eq!(versions, [1, 2], "the cut-off event is not in the log");
}
