//! The log share: a follower's subscriptions fed by another reader's
//! stream over a Unix socket, with no slot of its own; a share gone silent
//! or away is left within its deadline for a temporary slot of the
//! follower's own, and left for the share again once it answers.

use crate::{appender, db, ev, reader, reader_config, table_positions, take};
use events::share::{bind, serve, ShareConfig};
use events::{ExpectedVersion, Reader, Start};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn share_config() -> ShareConfig {
    ShareConfig {
        keepalive: Duration::from_millis(200),
        write_timeout: Duration::from_secs(5),
    }
}

/// A reader following the share at `path`.
fn follower(cfg: &tokio_postgres::Config, path: &std::path::Path) -> (Reader, String) {
    let mut rc = reader_config();
    rc.share_from = Some(path.to_path_buf());
    rc.share_silence = Duration::from_secs(2);
    let slot = rc.slot.clone();
    (Reader::start(cfg.clone(), rc), slot)
}

/// Appends `n` events to `stream`, one transaction each (`ev(from)` on).
async fn append_singles(a: &events::Appender, stream: &str, from: u64, n: u64) {
    for i in from..from + n {
        a.append(stream, ExpectedVersion::Any, vec![ev(i)])
            .await
            .unwrap();
    }
}

async fn walsenders_named(client: &tokio_postgres::Client, slot: &str) -> (i64, i64) {
    let senders: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_replication WHERE application_name = $1",
            &[&format!("strata-reader-{slot}")],
        )
        .await
        .unwrap()
        .get(0);
    let slots: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    (senders, slots)
}

#[tokio::test]
async fn a_follower_delivers_the_committed_sequence_without_a_slot_of_its_own() {
    let (cfg, client) = db().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.sock");
    let sharer = reader(&cfg);
    let listener = bind(&path).await.unwrap();
    let served = tokio::spawn(serve(sharer.clone(), listener, share_config()));
    // Only this user may connect: a follower reads every event.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the share's socket mode is {mode:o}");
    // A second sharer on a socket that a live one answers on is refused.
    let err = bind(&path).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");

    let (f, slot) = follower(&cfg, &path);
    let mut sub = f.subscribe("shared", Start::Beginning).await.unwrap();
    let a = appender(&cfg);
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..3)
        .map(|w| {
            let (a, stop) = (a.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) && i < 300 {
                    a.append(
                        &format!("w/{w}"),
                        ExpectedVersion::Any,
                        (0..1 + i % 3).map(|k| ev(i + k)).collect(),
                    )
                    .await
                    .unwrap();
                    i += 1;
                }
            })
        })
        .collect();
    let first = take(&mut sub, 200).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let table = table_positions(&client).await;
    let mut got = first;
    got.extend(take(&mut sub, table.len() - got.len()).await);
    assert_eq!(got, table, "the follower delivered the committed sequence");
    assert!(
        sub.is_live(),
        "caught up, the subscription follows the share"
    );
    assert!(f.streaming(), "the follower's session streams");
    assert_eq!(
        walsenders_named(&client, &slot).await,
        (0, 0),
        "a follower has neither a walsender nor a slot"
    );
    served.abort();
}

#[tokio::test]
async fn a_silent_share_is_left_within_its_deadline_for_a_slot_of_the_followers_own() {
    let (cfg, client) = db().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.sock");
    // A share that greets and then says nothing more, as a sharer whose
    // process froze after it accepted.
    let frozen = tokio::net::UnixListener::bind(&path).unwrap();
    let accepted = Arc::new(AtomicU32::new(0));
    let held = {
        let accepted = accepted.clone();
        tokio::spawn(async move {
            let mut kept = Vec::new();
            loop {
                let (mut s, _) = frozen.accept().await.unwrap();
                let mut hello = Vec::new();
                events::share::wire::encode(
                    &events::share::wire::Frame::Hello {
                        version: events::share::wire::VERSION,
                    },
                    &mut hello,
                );
                tokio::io::AsyncWriteExt::write_all(&mut s, &hello)
                    .await
                    .unwrap();
                accepted.fetch_add(1, Ordering::SeqCst);
                kept.push(s);
            }
        })
    };
    let (f, slot) = follower(&cfg, &path);
    let mut sub = f.subscribe("across", Start::Beginning).await.unwrap();
    testkit::eventually(10, "the follower greeted", || async { f.streaming() }).await;
    let greeted = Instant::now();
    let a = appender(&cfg);
    append_singles(&a, "missed", 0, 50).await;
    // Left after its 2 s of silence, for a temporary slot of its own, which
    // delivers what the share did not.
    testkit::eventually(15, "the follower's own walsender streams", || async {
        walsenders_named(&client, &slot).await == (1, 1)
    })
    .await;
    let left = greeted.elapsed();
    assert_eq!(take(&mut sub, 50).await, (1..=50).collect::<Vec<_>>());
    assert!(
        left >= Duration::from_millis(1900) && left < Duration::from_secs(8),
        "own slot after {left:?} (silence allowed: 2 s)"
    );
    // Greeting alone does not bring the follower back: it is still on its
    // own slot after the share was tried again.
    let tries = accepted.load(Ordering::SeqCst);
    testkit::eventually(15, "the share tried again", || async {
        accepted.load(Ordering::SeqCst) >= tries + 2
    })
    .await;
    assert_eq!(walsenders_named(&client, &slot).await, (1, 1));
    held.abort();
    let _ = held.await;
    // A real sharer takes the socket over: the follower goes back to it,
    // and what was committed meanwhile reaches it in order.
    let sharer = reader(&cfg);
    let served = tokio::spawn(serve(sharer, bind(&path).await.unwrap(), share_config()));
    testkit::eventually(15, "the follower's slot gone", || async {
        walsenders_named(&client, &slot).await == (0, 0)
    })
    .await;
    append_singles(&a, "live", 0, 50).await;
    assert_eq!(take(&mut sub, 50).await, (51..=100).collect::<Vec<_>>());
    assert_eq!(table_positions(&client).await.len(), 100);
    assert!(sub.is_live(), "the subscription follows the new share");
    served.abort();
}

#[tokio::test]
async fn a_follower_decodes_the_log_itself_while_its_share_is_gone_and_goes_back_to_it() {
    let (cfg, client) = db().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.sock");
    let sharer = reader(&cfg);
    let served = tokio::spawn(serve(
        sharer.clone(),
        bind(&path).await.unwrap(),
        share_config(),
    ));
    let (f, slot) = follower(&cfg, &path);
    let mut sub = f.subscribe("through", Start::Beginning).await.unwrap();
    let a = appender(&cfg);
    append_singles(&a, "s", 0, 20).await;
    assert_eq!(take(&mut sub, 20).await, (1..=20).collect::<Vec<_>>());
    assert_eq!(walsenders_named(&client, &slot).await, (0, 0));

    // The share goes away (its feeds with it): after 2 s of silence the
    // follower streams through a temporary slot of its own.
    served.abort();
    let _ = served.await;
    let gone = Instant::now();
    testkit::eventually(15, "the follower's own walsender streams", || async {
        walsenders_named(&client, &slot).await == (1, 1)
    })
    .await;
    let own = gone.elapsed();
    append_singles(&a, "s", 20, 20).await;
    assert_eq!(take(&mut sub, 20).await, (21..=40).collect::<Vec<_>>());
    let temporary: bool = client
        .query_one(
            "SELECT temporary FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(temporary, "the follower's own slot is temporary");

    // A share answers again: the follower leaves its slot, which goes.
    let served = tokio::spawn(serve(sharer, bind(&path).await.unwrap(), share_config()));
    testkit::eventually(15, "the follower's slot gone", || async {
        walsenders_named(&client, &slot).await == (0, 0)
    })
    .await;
    testkit::eventually(15, "the follower streams from the share", || async {
        f.streaming()
    })
    .await;
    append_singles(&a, "s", 40, 20).await;
    assert_eq!(take(&mut sub, 20).await, (41..=60).collect::<Vec<_>>());
    assert!(
        own < Duration::from_secs(8),
        "streaming through its own slot {own:?} after the share went (silence: 2 s)"
    );
    served.abort();
}
