use crate::{appender, db, ev, reader, reader_config, table_positions, take};
use events::{ExpectedVersion, Reader, Start, StreamAppend};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[tokio::test]
async fn delivers_history_then_the_live_stream_in_order() {
    let (cfg, _client) = db().await;
    let a = appender(&cfg);
    for i in 0..10 {
        a.append_batch(vec![StreamAppend {
            stream: format!("h/{}", i % 3),
            expected: ExpectedVersion::Any,
            events: (0..10).map(|j| ev(i * 10 + j)).collect(),
        }])
        .await
        .unwrap();
    }
    let r = reader(&cfg);
    let mut sub = r
        .subscribe("history-then-live", Start::Beginning)
        .await
        .unwrap();
    assert_eq!(take(&mut sub, 100).await, (1..=100).collect::<Vec<_>>());
    for i in 0..50 {
        a.append("live", ExpectedVersion::Any, vec![ev(i)])
            .await
            .unwrap();
    }
    assert_eq!(take(&mut sub, 50).await, (101..=150).collect::<Vec<_>>());
    assert!(
        sub.is_live(),
        "caught-up subscription should follow the slot"
    );
}

#[tokio::test]
async fn start_now_and_after_a_position() {
    let (cfg, _client) = db().await;
    let a = appender(&cfg);
    for i in 0..5 {
        a.append("p", ExpectedVersion::Any, vec![ev(i)])
            .await
            .unwrap();
    }
    let r = reader(&cfg);
    let mut after3 = r
        .subscribe_ephemeral(Start::After(events::Position(3)))
        .await
        .unwrap();
    let mut now = r.subscribe_ephemeral(Start::Now).await.unwrap();
    a.append("p", ExpectedVersion::Any, vec![ev(6)])
        .await
        .unwrap();
    assert_eq!(take(&mut after3, 3).await, [4, 5, 6]);
    assert_eq!(take(&mut now, 1).await, [6]);
}

#[tokio::test]
async fn a_subscription_created_under_concurrent_writes_sees_exactly_the_committed_sequence() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&a, 8, &stop);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Created while the writers run.
    let r = reader(&cfg);
    let mut sub = r.subscribe("under-load", Start::Beginning).await.unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < deadline {
        got.push(sub.next().await.unwrap().position.0);
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    assert_rest_is_committed_sequence(&mut sub, got, &client).await;
    assert!(sub.is_live());
}

/// `n` writers appending one to four events at a time to streams `w/<i>`
/// until `stop`.
fn spawn_writers(
    a: &events::Appender,
    n: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|w| {
            let (a, stop) = (a.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let n = 1 + (i % 4) as usize;
                    a.append(
                        &format!("w/{w}"),
                        ExpectedVersion::Any,
                        (0..n).map(|k| ev(i + k as u64)).collect(),
                    )
                    .await
                    .unwrap();
                    i += 1;
                }
            })
        })
        .collect()
}

/// Takes the rest from `sub` and checks that, after `got`, it delivered
/// exactly the table's positions: nothing lost, nothing twice.
async fn assert_rest_is_committed_sequence(
    sub: &mut events::Subscription,
    mut got: Vec<u64>,
    client: &tokio_postgres::Client,
) {
    let table = table_positions(client).await;
    while got.len() < table.len() {
        let e = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .expect("caught up in time")
            .unwrap();
        got.push(e.position.0);
    }
    assert_eq!(
        got, table,
        "delivered sequence must equal the committed sequence"
    );
}

#[tokio::test]
async fn a_named_subscription_resumes_after_its_durable_ack() {
    let (cfg, _client) = db().await;
    let a = appender(&cfg);
    for i in 0..20 {
        a.append("r", ExpectedVersion::Any, vec![ev(i)])
            .await
            .unwrap();
    }
    let r = reader(&cfg);
    {
        let mut sub = r.subscribe("resumable", Start::Beginning).await.unwrap();
        let got = take(&mut sub, 12).await;
        sub.ack(events::Position(got[9]));
        sub.flush_acks().await.unwrap();
        assert_eq!(sub.durable(), events::Position(10));
    }
    // The start argument is ignored for an existing subscription.
    let mut sub = r.subscribe("resumable", Start::Now).await.unwrap();
    assert_eq!(
        take(&mut sub, 10).await,
        (11..=20).collect::<Vec<_>>(),
        "unacknowledged events come again"
    );
}

#[tokio::test]
async fn acks_are_stored_in_the_background() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    a.append("bg", ExpectedVersion::Any, vec![ev(1), ev(2)])
        .await
        .unwrap();
    let r = reader(&cfg);
    let mut sub = r
        .subscribe("background-ack", Start::Beginning)
        .await
        .unwrap();
    let got = take(&mut sub, 2).await;
    sub.ack(events::Position(got[1]));
    testkit::eventually(5, "the condition", || async {
        let p: i64 = client
            .query_one(
                "SELECT position FROM strata.subscriptions WHERE name = 'background-ack'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        p == 2
    })
    .await;
}

#[tokio::test]
async fn a_slow_subscriber_does_not_stall_others_and_catches_up_from_the_table() {
    let (cfg, _client) = db().await;
    let mut rc = reader_config();
    rc.subscriber_buffer = 4;
    let r = Reader::start(cfg.clone(), rc);
    let mut fast = r.subscribe("fast", Start::Beginning).await.unwrap();
    let mut slow = r.subscribe("slow", Start::Beginning).await.unwrap();
    // Let both reach the live stream before the writes start.
    let a = appender(&cfg);
    a.append("warm", ExpectedVersion::Any, vec![ev(0)])
        .await
        .unwrap();
    assert_eq!(take(&mut fast, 1).await, [1]);
    assert_eq!(take(&mut slow, 1).await, [1]);
    let total = 400u64;
    let writer = {
        let a = a.clone();
        tokio::spawn(async move {
            for i in 0..total {
                a.append(&format!("s/{}", i % 7), ExpectedVersion::Any, vec![ev(i)])
                    .await
                    .unwrap();
            }
        })
    };
    let fast_task = tokio::spawn(async move {
        let got = take(&mut fast, total as usize).await;
        (got, Instant::now())
    });
    let slow_task = tokio::spawn(async move {
        let mut got = Vec::new();
        for _ in 0..total {
            let e = slow.next().await.unwrap();
            got.push(e.position.0);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (got, Instant::now(), slow.attachments())
    });
    writer.await.unwrap();
    let (fast_got, fast_done) = fast_task.await.unwrap();
    let (slow_got, slow_done, attachments) = slow_task.await.unwrap();
    let want: Vec<u64> = (2..=total + 1).collect();
    assert_eq!(fast_got, want);
    assert_eq!(
        slow_got, want,
        "the slow subscriber still gets everything, in order"
    );
    assert!(fast_done < slow_done, "the fast subscriber finished first");
    assert!(
        attachments > 1,
        "the slow subscriber was detached and caught up from the table"
    );
}

#[tokio::test]
async fn wal_held_for_a_subscriber_that_never_acks_is_bounded() {
    let (cfg, client) = db().await;
    let mut rc = reader_config();
    rc.max_retained_wal = 64 * 1024;
    let slot = rc.slot.clone();
    let r = Reader::start(cfg.clone(), rc);
    let mut stuck = r.subscribe("never-acks", Start::Beginning).await.unwrap();
    let a = appender(&cfg);
    a.append("w", ExpectedVersion::Any, vec![ev(0)])
        .await
        .unwrap();
    assert_eq!(take(&mut stuck, 1).await, [1]);
    let big = serde_json::json!({ "pad": "x".repeat(2000) });
    for i in 0..300 {
        a.append(
            "w",
            ExpectedVersion::Any,
            vec![events::NewEvent::new("pad", &big), ev(i)],
        )
        .await
        .unwrap();
    }
    // The slot moves past every append although the subscriber acknowledged
    // nothing (its WAL would otherwise be retained).
    let end: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    testkit::eventually(20, "the condition", || async {
        client
            .query_one(
                "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot, &end],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    // And the subscriber still receives every event, from the table.
    let got = take(&mut stuck, 600).await;
    assert_eq!(got, (2..=601).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_consumer_killed_mid_transaction_applies_every_event_exactly_once() {
    let (cfg, client) = db().await;
    client
        .batch_execute("CREATE TABLE applied (position bigint NOT NULL)")
        .await
        .unwrap();
    let a = appender(&cfg);
    let rc = reader_config();
    // One large transaction and some small ones.
    a.append_batch(vec![StreamAppend {
        stream: "big".into(),
        expected: ExpectedVersion::Any,
        events: (0..3000).map(ev).collect(),
    }])
    .await
    .unwrap();
    for i in 0..20 {
        a.append("small", ExpectedVersion::Any, vec![ev(i)])
            .await
            .unwrap();
    }
    let total = 3020i64;

    async fn consume(
        cfg: tokio_postgres::Config,
        rc: events::ReaderConfig,
        limit: Option<usize>,
    ) -> usize {
        let r = Reader::start(cfg.clone(), rc);
        let mut sub = r.subscribe("exactly-once", Start::Beginning).await.unwrap();
        let mut c = events::db::connect(&cfg, "consumer").await.unwrap();
        let mut n = 0;
        loop {
            if limit.is_some_and(|l| n >= l) {
                return n;
            }
            let e = match tokio::time::timeout(Duration::from_secs(2), sub.next()).await {
                Ok(e) => e.unwrap(),
                Err(_) => return n,
            };
            let tx = c.transaction().await.unwrap();
            tx.execute("INSERT INTO applied VALUES ($1)", &[&(e.position.0 as i64)])
                .await
                .unwrap();
            sub.ack_in(&tx, e.position).await.unwrap();
            tx.commit().await.unwrap();
            sub.committed(e.position);
            n += 1;
        }
    }
    // Killed after 1,200 of the big transaction's 3,000 events.
    let first = tokio::spawn(consume(cfg.clone(), rc.clone(), Some(1200)));
    let n1 = first.await.unwrap();
    assert_eq!(n1, 1200);
    // Restarted: same slot, same subscription.
    let n2 = consume(cfg.clone(), rc, None).await;
    assert_eq!(n1 + n2, total as usize);
    let row = client
        .query_one(
            "SELECT count(*), count(DISTINCT position), min(position), max(position) FROM applied",
            &[],
        )
        .await
        .unwrap();
    let (count, distinct, min, max): (i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        (count, distinct, min, max),
        (total, total, 1, total),
        "each event applied exactly once"
    );
}

#[tokio::test]
async fn a_named_subscription_is_held_by_one_reader_at_a_time() {
    let (cfg, _client) = db().await;
    let a = appender(&cfg);
    a.append("x", ExpectedVersion::Any, vec![ev(1), ev(2)])
        .await
        .unwrap();
    let first = reader(&cfg);
    let second = reader(&cfg);
    let mut held = first
        .subscribe("exclusive", Start::Beginning)
        .await
        .unwrap();
    let err = match second.subscribe("exclusive", Start::Beginning).await {
        Err(e) => e,
        Ok(_) => panic!("two readers held one subscription"),
    };
    assert!(matches!(err, events::SubscribeError::InUse { .. }), "{err}");
    assert!(err.to_string().contains("is in use by"), "{err}");
    assert_eq!(take(&mut held, 1).await, [1]);
    held.ack(events::Position(1));
    held.flush_acks().await.unwrap();
    drop(held);
    // Dropping releases the lease: the other reader takes over where the
    // first acknowledged.
    let mut taken = second
        .subscribe_waiting(
            "exclusive",
            Start::Beginning,
            Duration::from_secs(10),
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(take(&mut taken, 1).await, [2]);
}

#[tokio::test]
async fn a_second_open_of_a_held_name_in_the_same_process_is_refused() {
    // One process (a gateway) serves two callers asking for the same name:
    // the second is refused, and the first keeps its lease and its cursor.
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    a.append("x", ExpectedVersion::Any, vec![ev(1), ev(2)])
        .await
        .unwrap();
    let r = reader(&cfg);
    let mut held = r.subscribe("twice", Start::Beginning).await.unwrap();
    let err = match r.subscribe("twice", Start::Beginning).await {
        Err(e) => e,
        Ok(_) => panic!("the same name was opened twice in one process"),
    };
    assert!(matches!(err, events::SubscribeError::InUse { .. }), "{err}");
    assert_eq!(take(&mut held, 2).await, [1, 2]);
    held.ack(events::Position(2));
    held.flush_acks().await.unwrap();
    let cursor: i64 = client
        .query_one(
            "SELECT position FROM strata.subscriptions WHERE name = 'twice'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(cursor, 2, "the first holder's cursor was stored");
    held.close().await.unwrap();
    // Closed: the name is free again.
    let again = r.subscribe("twice", Start::Beginning).await.unwrap();
    again.close().await.unwrap();
}

/// Polls `fut` at most `polls` times, with a short sleep between polls so
/// that its I/O can progress, and drops it unfinished after that.
async fn poll_at_most<F: Future>(fut: F, polls: usize) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx))).await;
        if let std::task::Poll::Ready(out) = polled {
            return Some(out);
        }
        tokio::time::sleep(Duration::from_micros(300)).await;
    }
    None
}

#[tokio::test]
async fn next_dropped_at_any_await_loses_and_repeats_nothing() {
    let (cfg, client) = db().await;
    let a = appender(&cfg);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&a, 4, &stop);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // History, the hand-off to the live stream and the live stream itself,
    // with `next` dropped after one to four polls most of the time: at a
    // table read, a gap fill, a wait for the live stream.
    let r = reader(&cfg);
    let mut sub = r.subscribe("cancelled", Start::Beginning).await.unwrap();
    let mut got = Vec::new();
    let mut dropped = 0u32;
    let deadline = Instant::now() + Duration::from_millis(2000);
    let mut k = 0usize;
    while Instant::now() < deadline {
        k += 1;
        match poll_at_most(sub.next(), 1 + k % 4).await {
            Some(e) => got.push(e.unwrap().position.0),
            None => dropped += 1,
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    assert!(dropped > 10, "only {dropped} calls were dropped unfinished");
    assert_rest_is_committed_sequence(&mut sub, got, &client).await;
}

#[tokio::test]
async fn a_table_read_cut_short_by_a_timer_goes_on_where_it_was() {
    // A consumer that polls `next` beside a timer (a select! loop) drops the
    // call whenever the timer fires first. A page read of the table that
    // takes longer than the timer's period must still finish: were it begun
    // again on every call, the consumer would never get past the backlog.
    let (cfg, _client) = db().await;
    let a = appender(&cfg);
    let pad = "x".repeat(2000);
    let total = 12_000u64;
    for b in 0..total / 500 {
        let events = (0..500)
            .map(|j| {
                events::NewEvent::new(
                    "test.event",
                    &serde_json::json!({ "n": b * 500 + j, "pad": pad }),
                )
            })
            .collect();
        a.append_batch(vec![StreamAppend {
            stream: format!("big/{b}"),
            expected: ExpectedVersion::Any,
            events,
        }])
        .await
        .unwrap();
    }
    let r = reader(&cfg);
    let mut sub = r.subscribe_ephemeral(Start::Beginning).await.unwrap();
    let mut got = 0u64;
    let mut dropped = 0u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while got < total && Instant::now() < deadline {
        // Two polls, well under a millisecond: far shorter than reading a
        // page of 5,000 events of 2 KB.
        match poll_at_most(sub.next(), 2).await {
            Some(e) => {
                got += 1;
                assert_eq!(e.unwrap().position.0, got, "delivered in order, once");
            }
            None => dropped += 1,
        }
    }
    assert_eq!(
        got, total,
        "a backlog read by calls cut short after two polls each ({dropped} cut)"
    );
    assert!(
        dropped > 0,
        "no call was cut short: the test proves nothing"
    );
}
