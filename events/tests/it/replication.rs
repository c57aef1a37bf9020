use crate::{appender, db, ev, reader_config, table_positions, take};
use events::{AppendError, ExpectedVersion, Reader, Start};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Client;

async fn wal_status(client: &Client, slot: &str) -> Option<String> {
    client
        .query_one(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
}

async fn slot_active(client: &Client, slot: &str) -> Option<bool> {
    client
        .query_opt(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

#[tokio::test]
async fn slots_list_shows_owner_lag_and_retained_wal_and_flags_stale_slots() {
    let (cfg, client) = db().await;
    let rc = reader_config();
    let slot = rc.slot.clone();
    let r = Reader::start(cfg.clone(), rc);
    let _sub = r.subscribe_ephemeral(Start::Now).await.unwrap();
    testkit::eventually(20, "the condition", || async {
        slot_active(&client, &slot).await == Some(true)
    })
    .await;
    let orphan = format!("{slot}_orphan");
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&orphan],
        )
        .await
        .unwrap();
    // The reader may be between replication sessions for a moment on a busy
    // machine: list until its slot shows active.
    let mut slots = Vec::new();
    for _ in 0..100 {
        slots = events::slots::list(&client, Duration::from_secs(600))
            .await
            .unwrap();
        if slots.iter().any(|s| s.name == slot && s.active) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mine = slots
        .iter()
        .find(|s| s.name == slot)
        .expect("reader's slot listed");
    assert!(mine.active && !mine.stale, "{mine:?}");
    assert!(
        mine.owner.as_deref().is_some_and(|o| o.contains("pid")),
        "{mine:?}"
    );
    assert!(mine.retained_bytes.is_some() && mine.lag_bytes.is_some());
    let lost = slots
        .iter()
        .find(|s| s.name == orphan)
        .expect("orphan listed");
    assert!(lost.stale && lost.owner.is_none(), "{lost:?}");
    // Dropping: the orphan goes; the active one needs --force.
    events::slots::drop_slot(&client, &orphan, false)
        .await
        .unwrap();
    let err = events::slots::drop_slot(&client, &slot, false)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
    let err = events::slots::drop_slot(&client, "no_such_slot", false)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("no replication slot named"),
        "{err}"
    );
    drop(_sub);
    drop(r);
    testkit::eventually(20, "the condition", || async {
        slot_active(&client, &slot).await == Some(false)
    })
    .await;
    events::slots::drop_slot(&client, &slot, false)
        .await
        .unwrap();
    assert_eq!(slot_active(&client, &slot).await, None);
}

#[tokio::test]
async fn a_slot_ahead_of_the_resume_point_is_reported_and_filled_from_the_table() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    let rc = reader_config();
    let slot = rc.slot.clone();
    {
        let r = Reader::start(cfg.clone(), rc.clone());
        let mut sub = r.subscribe("ahead", Start::Beginning).await.unwrap();
        for i in 0..10 {
            a.append("x", ExpectedVersion::Any, vec![ev(i)])
                .await
                .unwrap();
        }
        let mut last = 0;
        for _ in 0..10 {
            last = sub.next().await.unwrap().position.0;
        }
        sub.ack(events::Position(last));
        sub.flush_acks().await.unwrap();
    }
    testkit::eventually(20, "the condition", || async {
        slot_active(&client, &slot).await == Some(false)
    })
    .await;
    for i in 10..20 {
        a.append("x", ExpectedVersion::Any, vec![ev(i)])
            .await
            .unwrap();
    }
    // Something moves the slot past events the subscription never saw.
    // The test cluster commits asynchronously; a checkpoint flushes the WAL
    // so the slot can be advanced past the appends.
    client.batch_execute("CHECKPOINT").await.unwrap();
    let moved: bool = client
        .query_one(
            "SELECT end_lsn >= pg_current_wal_lsn() FROM pg_replication_slot_advance($1, pg_current_wal_lsn())",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(moved, "the slot was advanced past the appends");
    let r = Reader::start(cfg.clone(), rc);
    let mut sub = r.subscribe("ahead", Start::Beginning).await.unwrap();
    // Nothing new arrives through the slot: the skipped events must come from
    // the table anyway (regression: a subscription waited on the stream).
    let got = take(&mut sub, 10).await;
    assert_eq!(got, (11..=20).collect::<Vec<_>>(), "nothing skipped");
    a.append("x", ExpectedVersion::Any, vec![ev(20)])
        .await
        .unwrap();
    assert_eq!(take(&mut sub, 1).await, [21]);
    testkit::eventually(10, "the condition", || async {
        r.slot_ahead_reports() >= 1
    })
    .await;
}

#[tokio::test]
async fn an_invalidated_slot_is_reported_recreated_and_the_gap_read_from_the_table() {
    let cluster = testkit::temp_cluster(&[
        ("max_slot_wal_keep_size", "1MB"),
        ("wal_keep_size", "0"),
        ("min_wal_size", "32MB"),
        ("max_wal_size", "64MB"),
    ])
    .unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let cfg: tokio_postgres::Config = url.parse().unwrap();
    let client = events::db::connect(&cfg, "test").await.unwrap();
    let a = appender(&cfg);
    let rc = reader_config();
    let slot = rc.slot.clone();
    {
        let r = Reader::start(cfg.clone(), rc.clone());
        let mut sub = r.subscribe("survivor", Start::Beginning).await.unwrap();
        a.append("x", ExpectedVersion::Any, vec![ev(0)])
            .await
            .unwrap();
        let e = sub.next().await.unwrap();
        sub.ack(e.position);
        sub.flush_acks().await.unwrap();
    }
    testkit::eventually(20, "the condition", || async {
        slot_active(&client, &slot).await == Some(false)
    })
    .await;
    for i in 1..=10 {
        a.append("x", ExpectedVersion::Any, vec![ev(i)])
            .await
            .unwrap();
    }
    // Write and recycle enough WAL that the idle slot loses what it needs.
    client
        .batch_execute("CREATE TABLE junk (t text)")
        .await
        .unwrap();
    let mut lost = false;
    for _ in 0..10 {
        client
            .batch_execute("INSERT INTO junk SELECT repeat('x', 2000) FROM generate_series(1, 20000); SELECT pg_switch_wal(); CHECKPOINT;")
            .await
            .unwrap();
        let status = wal_status(&client, &slot).await;
        if status.as_deref() == Some("lost") {
            lost = true;
            break;
        }
    }
    assert!(lost, "the slot should have been invalidated");
    let r = Reader::start(cfg.clone(), rc);
    let mut sub = r.subscribe("survivor", Start::Beginning).await.unwrap();
    let got = take(&mut sub, 10).await;
    assert_eq!(got, (2..=11).collect::<Vec<_>>());
    testkit::eventually(20, "the condition", || async { r.invalidations() == 1 }).await;
    // The re-created slot carries the live stream again.
    a.append("x", ExpectedVersion::Any, vec![ev(11)])
        .await
        .unwrap();
    assert_eq!(take(&mut sub, 1).await, [12]);
    testkit::eventually(20, "the condition", || async { sub.is_live() }).await;
    let status = wal_status(&client, &slot).await;
    assert_ne!(status.as_deref(), Some("lost"));
}

/// Appends with retries as a careful client would: a transient error is
/// retried; an unknown outcome is resolved by reading the stream back.
async fn append_surely(
    a: &events::Appender,
    cfg: &tokio_postgres::Config,
    stream: &str,
    version: u64,
    id: u64,
) -> u64 {
    loop {
        match a
            .append(stream, ExpectedVersion::Exact(version), vec![ev(id)])
            .await
        {
            Ok(out) => return out.last_position.0,
            Err(AppendError::VersionConflict { .. }) | Err(AppendError::OutcomeUnknown(_)) => {
                // Did our event commit? It is the stream's event at version+1.
                loop {
                    let Ok(c) = events::db::connect(cfg, "check").await else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    let rows = match events::read::stream(&c, stream).await {
                        Ok(rows) => rows,
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    if let Some(e) = rows.get(version as usize) {
                        assert_eq!(
                            e.payload,
                            format!("{{\"n\": {id}}}"),
                            "someone else wrote {stream}"
                        );
                        return e.position.0;
                    }
                    break;
                }
            }
            Err(e) if e.kind() == events::ErrorKind::Transient => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_and_crashed_under_load_loses_nothing() {
    let mut cluster = testkit::temp_cluster_with(true, &[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let cfg: tokio_postgres::Config = url.parse().unwrap();
    let a = appender(&cfg);
    let r = Reader::start(cfg.clone(), reader_config());
    let mut sub = r
        .subscribe("through-restarts", Start::Beginning)
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..8u64 {
        let (a, cfg, stop) = (a.clone(), cfg.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut v = 0;
            while !stop.load(Ordering::Relaxed) {
                acked.push(append_surely(&a, &cfg, &format!("w/{w}"), v, w * 1_000_000 + v).await);
                v += 1;
            }
            acked
        }));
    }
    // The consumer reads until it has the last position committed (told
    // once the writers stop), or gives up after a minute.
    let (last_tx, mut last_rx) = tokio::sync::watch::channel(u64::MAX);
    let consumer = tokio::spawn(async move {
        let mut got: Vec<u64> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if got.last().copied().unwrap_or(0) >= *last_rx.borrow() {
                return got;
            }
            let next = tokio::select! {
                n = tokio::time::timeout_at(deadline, sub.next()) => n,
                _ = last_rx.changed() => continue,
            };
            match next {
                Ok(Ok(e)) => {
                    got.push(e.position.0);
                    sub.ack(e.position);
                }
                Ok(Err(e)) if e.kind() == events::ErrorKind::Transient => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Ok(Err(e)) => panic!("{e}"),
                Err(_) => return got,
            }
        }
    });
    // Each fault comes only once the reader has a session after the last
    // one, so that each is a separate reconnect (on a loaded machine the
    // reader's backoff can outlast a fixed pause).
    let sessions = |n: u64| {
        let r = r.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while r.sessions() < n {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the reader reached {n} sessions (has {})",
                    r.sessions()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    sessions(1).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    tokio::task::block_in_place(|| cluster.restart()).unwrap();
    sessions(2).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    tokio::task::block_in_place(|| {
        cluster.crash();
        cluster.restart()
    })
    .unwrap();
    sessions(3).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.store(true, Ordering::Relaxed);
    let mut acked = Vec::new();
    for w in writers {
        acked.extend(w.await.unwrap());
    }
    let client = events::db::connect(&cfg, "check").await.unwrap();
    let table = table_positions(&client).await;
    let _ = last_tx.send(table.last().copied().unwrap_or(0));
    let got = consumer.await.unwrap();
    acked.sort_unstable();
    assert!(acked.len() > 50, "writers made progress: {}", acked.len());
    assert_eq!(
        table,
        (1..=table.len() as u64).collect::<Vec<_>>(),
        "positions stay gap-free"
    );
    for p in &acked {
        assert!(
            table.binary_search(p).is_ok(),
            "acknowledged position {p} is missing after the crash"
        );
    }
    assert_eq!(
        got, table,
        "the subscription saw exactly the committed sequence"
    );
    assert!(
        r.sessions() >= 3,
        "the reader reconnected after each restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_database_stops_answering_notices_reconnects_and_resumes() {
    let cluster = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let cfg: tokio_postgres::Config = url.parse().unwrap();
    let mut rc = reader_config();
    rc.query_timeout = Duration::from_secs(2);
    let r = Reader::start(cfg.clone(), rc);
    let mut sub = r.subscribe_ephemeral(Start::Now).await.unwrap();
    let a = appender(&cfg);
    a.append("s/1", ExpectedVersion::NoStream, vec![ev(1)])
        .await
        .unwrap();
    assert_eq!(take(&mut sub, 1).await.len(), 1);
    crate::append::signal_cluster(&cluster, "-STOP");
    // Its heartbeat gets no answer: the session ends within the bound
    // instead of waiting for the server for ever.
    let noticed = tokio::time::timeout(Duration::from_secs(20), async {
        while r.timeouts() == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    crate::append::signal_cluster(&cluster, "-CONT");
    noticed.expect("the reader noticed the silent database");
    // Back: the reader connects again and the subscription goes on.
    a.append("s/2", ExpectedVersion::NoStream, vec![ev(2)])
        .await
        .unwrap();
    assert_eq!(take(&mut sub, 1).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_started_while_its_database_is_silent_gives_up_in_time_and_starts_later() {
    let cluster = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let mut cfg: tokio_postgres::Config = url.parse().unwrap();
    cfg.connect_timeout(Duration::from_secs(2));
    let mut rc = reader_config();
    rc.query_timeout = Duration::from_secs(2);
    crate::append::signal_cluster(&cluster, "-STOP");
    // The server accepts TCP (the kernel's backlog) but answers nothing:
    // the start-up exchange itself must be bounded, not only the socket.
    let connect = tokio::time::timeout(
        Duration::from_secs(15),
        events::db::connect(cfg.clone(), "silent"),
    )
    .await;
    let r = Reader::start(cfg.clone(), rc);
    let noticed = tokio::time::timeout(Duration::from_secs(20), async {
        while r.timeouts() == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    crate::append::signal_cluster(&cluster, "-CONT");
    let refused = connect.expect("a connection to a silent server gives up within its bound");
    assert!(refused.is_err(), "no connection to a stopped server");
    noticed.expect("the reader gave up its start against the silent database");
    // Back: the reader starts and a subscription gets what is appended.
    let mut sub = tokio::time::timeout(Duration::from_secs(30), r.subscribe_ephemeral(Start::Now))
        .await
        .expect("the reader started once the database answered")
        .unwrap();
    let a = appender(&cfg);
    a.append("s/1", ExpectedVersion::NoStream, vec![ev(1)])
        .await
        .unwrap();
    assert_eq!(take(&mut sub, 1).await.len(), 1);
}

/// A reader whose database answers every statement late (its connections,
/// the replication one included, over a link that delivers each byte
/// 150 ms after it was sent) keeps receiving the stream: its status rounds
/// (whether standbys are named, the acknowledged LSN recorded) run beside
/// the stream, not in its way. Run in its way, each round held the
/// stream for two round trips, every status interval, and the reader took
/// in about one message a round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_keeps_streaming_when_its_database_answers_late() {
    let (cfg, client) = db().await;
    let (link, far) = testkit::cut::Cut::to_postgres(&cfg).await;
    link.slow(Duration::from_millis(150));
    let a = appender(&cfg);
    let (_reader, mut sub, slot) = attached_to_the_stream(far, &a, "late-first").await;
    const N: u64 = 300;
    for n in 0..N {
        a.append(&format!("late-{n}"), ExpectedVersion::NoStream, vec![ev(n)])
            .await
            .unwrap();
    }
    let t = std::time::Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(30), async {
        let mut got = Vec::new();
        while got.len() < N as usize {
            let e = sub.next().await.unwrap();
            if e.stream.starts_with("late-") && e.stream != "late-first" {
                got.push(e.position.0);
            }
        }
        got
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "the reader did not deliver {N} one-event transactions within 30 s over the slow link"
        )
    });
    eprintln!(
        "{N} transactions delivered over the slow link in {:?}",
        t.elapsed()
    );
    assert!(got.windows(2).all(|w| w[0] < w[1]), "in order");
    // And the acknowledged LSN is recorded, never behind what the slot
    // was told.
    sub.ack(events::Position(*got.last().unwrap()));
    sub.flush_acks().await.unwrap();
    testkit::eventually(30, "the acknowledged LSN is recorded", || async {
        let row = client
            .query_one(
                "SELECT r.acked_lsn >= s.confirmed_flush_lsn, r.acked_position
                   FROM strata.replication_readers r JOIN pg_replication_slots s USING (slot_name)
                  WHERE slot_name = $1",
                &[&slot],
            )
            .await;
        matches!(row, Ok(r) if r.get::<_, bool>(0) && r.get::<_, Option<i64>>(1).is_some_and(|p| p as u64 >= *got.last().unwrap()))
    })
    .await;
}

#[tokio::test]
async fn a_reader_keeps_streaming_while_its_own_record_is_locked() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    let (_reader, mut sub, slot) = attached_to_the_stream(cfg.clone(), &a, "locked-first").await;
    // Another session holds the reader's row: its heartbeat (every 500 ms)
    // waits on the lock, as it would behind any long writer of that table.
    let locker = events::db::connect(&cfg, "locker").await.unwrap();
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM strata.replication_readers WHERE slot_name = '{slot}' FOR UPDATE"
        ))
        .await
        .unwrap();
    testkit::eventually(10, "the reader's heartbeat waits on the lock", || async {
        crate::waiting_on_a_lock(&client, "UPDATE strata.replication_readers SET seen_at%").await
            > 0
    })
    .await;
    const N: usize = 100;
    for n in 0..N {
        a.append(
            &format!("locked-{n}"),
            ExpectedVersion::NoStream,
            vec![ev(n as u64)],
        )
        .await
        .unwrap();
    }
    let t = std::time::Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(10), async {
        let mut got = 0;
        while got < N {
            if sub.next().await.unwrap().stream.starts_with("locked-") {
                got += 1;
            }
        }
    })
    .await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        got.is_ok(),
        "the reader did not deliver {N} transactions within 10 s while its heartbeat waited on a lock"
    );
    eprintln!(
        "{N} transactions delivered while the record was locked, in {:?}",
        t.elapsed()
    );
}

/// A reader on a temporary slot of its own and a subscription attached to
/// its live stream, checked with one event on `first`: what is appended
/// next arrives through the stream, not from the table.
async fn attached_to_the_stream(
    db: tokio_postgres::Config,
    a: &events::Appender,
    first: &str,
) -> (Reader, events::Subscription, String) {
    let mut rc = reader_config();
    rc.temporary = true;
    let slot = rc.slot.clone();
    let reader = Reader::start(db, rc);
    let mut sub = reader.subscribe_ephemeral(Start::Now).await.unwrap();
    a.append(first, ExpectedVersion::NoStream, vec![ev(0)])
        .await
        .unwrap();
    let e = tokio::time::timeout(Duration::from_secs(30), sub.next())
        .await
        .expect("the first event in time")
        .unwrap();
    assert_eq!(e.stream, first);
    assert!(sub.is_live(), "attached to the stream");
    (reader, sub, slot)
}
