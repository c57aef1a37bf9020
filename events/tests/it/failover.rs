//! A standby takes over: a primary and a streaming standby (private
//! clusters), appends and a subscription under way, the primary killed and
//! the standby promoted. The appender and the reader reach the new primary
//! through the multi-host URL by themselves; the slot, which the standby
//! does not have, is made again and the subscription fills the gap from the
//! table.

use crate::{ev, reader_config};
use events::db::Database;
use events::{Appender, AppenderConfig, ExpectedVersion, Reader, Start, SubscribeError};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_synchronous_standby_takes_over_and_no_acknowledged_event_is_lost() {
    let lost = takeover(true).await;
    assert!(lost.is_empty(), "acknowledged and lost: {lost:?}");
}

/// Without a synchronous standby a commit does not wait for it: what the
/// primary acknowledged in the last moment before it died may be lost.
/// Measured (printed), not asserted; the subscription still delivers
/// everything the new primary has, once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_standby_takes_over_and_the_loss_window_is_measured() {
    let lost = takeover(false).await;
    eprintln!(
        "asynchronous standby: {} acknowledged appends lost",
        lost.len()
    );
}

/// The primary, then the standby, as every role is given them: whichever
/// takes writes.
fn both(primary: &schema::Cluster, standby: &schema::Cluster, dbname: &str) -> Database {
    Database::parse(&format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres dbname={dbname} \
         target_session_attrs=read-write connect_timeout=2",
        primary.port(),
        standby.port()
    ))
    .unwrap()
}

/// The drill; returns the acknowledged appends the new primary lacks.
async fn takeover(synchronous: bool) -> Vec<u64> {
    let mut primary = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&primary).await;
    let dbname = url.rsplit('/').next().unwrap().to_string();
    let standby = testkit::temp_standby(&primary).unwrap();
    // A synchronous standby: a commit waits until the standby has it.
    let admin = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "test")
        .await
        .unwrap();
    let sync = if synchronous { "sync" } else { "async" };
    if synchronous {
        // The physical standby by name: '*' would match the readers'
        // replication connections too.
        testkit::standbys::make_synchronous(&admin).await;
    }
    testkit::eventually(30, "the condition", || async {
        admin
            .query_opt(
                "SELECT 1 FROM pg_stat_replication WHERE sync_state = $1",
                &[&sync],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let db = both(&primary, &standby, &dbname);
    let rc = reader_config();
    let slot = rc.slot.clone();
    let reader = Reader::start(&db, rc);
    let mut sub = reader.subscribe_ephemeral(Start::Now).await.unwrap();
    let appender = Appender::start(&db, AppenderConfig::default());

    // One writer, one stream per append; what it was told is acknowledged.
    // It goes on until 30 appends were acknowledged after the primary died.
    let acked: Arc<Mutex<Vec<(u64, Instant)>>> = Arc::default();
    let died_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let writer = {
        let (acked, appender, died_at) = (acked.clone(), appender.clone(), died_at.clone());
        tokio::spawn(async move {
            for i in 0u64.. {
                match appender
                    .append(&format!("fo/{i}"), ExpectedVersion::NoStream, vec![ev(i)])
                    .await
                {
                    Ok(_) => acked.lock().unwrap().push((i, Instant::now())),
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
                let died = *died_at.lock().unwrap();
                if let Some(died) = died {
                    let after = acked
                        .lock()
                        .unwrap()
                        .iter()
                        .filter(|(_, at)| *at > died)
                        .count();
                    if after >= 30 {
                        return;
                    }
                }
            }
        })
    };
    testkit::eventually(30, "the condition", || async {
        acked.lock().unwrap().len() >= 30
    })
    .await;
    primary.crash();
    let died = Instant::now();
    *died_at.lock().unwrap() = Some(died);
    standby.promote().unwrap();
    tokio::time::timeout(Duration::from_secs(120), writer)
        .await
        .expect("appends go on against the new primary")
        .unwrap();
    let acked = acked.lock().unwrap().clone();
    let first_after = acked
        .iter()
        .find(|(_, at)| *at > died)
        .map(|(_, at)| at.duration_since(died))
        .expect("an append acknowledged after the primary died");
    eprintln!("{sync} standby: the primary died; first append acknowledged by the new primary after {first_after:?}");

    // Every acknowledged append is on the new primary.
    let promoted = events::db::connect(&db, "test").await.unwrap();
    let have: BTreeSet<String> = promoted
        .query(
            "SELECT stream FROM strata.events WHERE stream LIKE 'fo/%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let lost: Vec<u64> = acked
        .iter()
        .map(|(i, _)| *i)
        .filter(|i| !have.contains(&format!("fo/{i}")))
        .collect();

    // The subscription delivers every one of them, in position order, once.
    let mut seen = BTreeSet::new();
    let mut last = 0u64;
    let want: BTreeSet<String> = acked
        .iter()
        .map(|(i, _)| format!("fo/{i}"))
        .filter(|s| have.contains(s))
        .collect();
    while !want.is_subset(&seen) {
        let e = match tokio::time::timeout(Duration::from_secs(60), sub.next())
            .await
            .expect("the subscription goes on after the takeover")
        {
            Ok(e) => e,
            // It had delivered appends the standby never got (the loss
            // window); said once, then it goes on.
            Err(SubscribeError::Diverged { .. }) if !synchronous => continue,
            Err(e) => panic!("{e}"),
        };
        assert!(
            e.position.0 > last,
            "position {} after {last}",
            e.position.0
        );
        last = e.position.0;
        assert!(
            seen.insert(e.stream.clone()),
            "{} delivered twice",
            e.stream
        );
    }
    // The reader made its slot again on the new primary (slots are not
    // replicated to a standby, so it can only be there if the reader made
    // it). The subscription may have read every event from the table before
    // the reader's replication connection came back: checked in the table,
    // with a deadline, not at that moment.
    testkit::eventually(
        60,
        "the reader made its slot again on the promoted standby",
        || async {
            promoted
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .unwrap()
                .is_some()
        },
    )
    .await;
    drop(standby);
    lost
}

/// Reads of the table need no write on a standby: its head and its events
/// are the primary's, as far as it has replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_reads_from_a_standby_without_writing() {
    let primary = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&primary).await;
    let dbname = url.rsplit('/').next().unwrap().to_string();
    let standby = testkit::temp_standby(&primary).unwrap();
    let on_primary: tokio_postgres::Config = url.parse().unwrap();
    let appender = Appender::start(&on_primary, AppenderConfig::default());
    for i in 0..20 {
        appender
            .append(&format!("sb/{i}"), ExpectedVersion::NoStream, vec![ev(i)])
            .await
            .unwrap();
    }
    let primary_client = events::db::connect(&on_primary, "test").await.unwrap();
    let head = events::read::head(&primary_client).await.unwrap();
    let on_standby = Database::parse(&standby.url(&dbname)).unwrap();
    let client = events::db::connect(&on_standby, "test").await.unwrap();
    let in_recovery: bool = client
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(in_recovery, "the standby is a standby");
    testkit::eventually(30, "the condition", || async {
        events::read::head(&client).await.unwrap() == head
    })
    .await;
    let events = events::read::after(&client, events::Position(0), 100)
        .await
        .unwrap();
    let streams: BTreeSet<String> = events
        .iter()
        .filter(|e| e.stream.starts_with("sb/"))
        .map(|e| e.stream.clone())
        .collect();
    assert_eq!(streams.len(), 20, "every event, read on the standby");
}

/// An asynchronous standby that missed the primary's last commits takes
/// over. The subscription had already delivered those (from the old
/// primary); they are lost, and the new primary's next events must not take
/// their positions, or every consumer that saw the lost ones would skip the
/// new ones as already seen (and a sink's receiver would drop them as
/// duplicates). Deterministic: the standby is pointed away from the primary before
/// the events it must miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_primary_never_reuses_a_position_the_old_one_handed_out() {
    let mut primary = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&primary).await;
    let dbname = url.rsplit('/').next().unwrap().to_string();
    let standby = testkit::temp_standby(&primary).unwrap();
    let db = both(&primary, &standby, &dbname);
    let on_standby = events::db::connect(&Database::parse(&standby.url(&dbname)).unwrap(), "t")
        .await
        .unwrap();
    let reader = Reader::start(&db, reader_config());
    let mut sub = reader.subscribe_ephemeral(Start::Now).await.unwrap();
    let appender = Appender::start(&db, AppenderConfig::default());
    let append = |stream: String| {
        let appender = appender.clone();
        async move {
            appender
                .append(&stream, ExpectedVersion::NoStream, vec![ev(0)])
                .await
                .unwrap()
                .last_position
                .0
        }
    };
    for i in 0..3 {
        append(format!("kept/{i}")).await;
    }
    crate::take(&mut sub, 3).await;
    let head = events::read::head(&events::db::connect(&db, "t").await.unwrap())
        .await
        .unwrap();
    testkit::eventually(30, "the condition", || async {
        events::read::head(&on_standby).await.unwrap() == head
    })
    .await;
    // The standby is pointed at a port where nothing listens: its WAL
    // receiver ends and receives nothing more; the primary goes on alone.
    testkit::standbys::stop_receiving(&on_standby).await;
    let mut lost = Vec::new();
    for i in 0..5 {
        lost.push(append(format!("lost/{i}")).await);
    }
    let delivered = crate::take(&mut sub, 5).await;
    assert_eq!(delivered, lost);
    primary.crash();
    standby.promote().unwrap();

    // New events on the new primary: every one is delivered, at a position
    // no lost event had.
    let mut new = Vec::new();
    for i in 0..8 {
        let p = loop {
            match appender
                .append(&format!("new/{i}"), ExpectedVersion::NoStream, vec![ev(0)])
                .await
            {
                Ok(out) => break out.last_position.0,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        new.push(p);
    }
    let max_lost = *lost.iter().max().unwrap();
    assert!(
        new.iter().all(|p| *p > max_lost),
        "new positions {new:?} reuse the lost {lost:?}"
    );
    // Once, before them: what it delivered that the log no longer has.
    let mut streams = Vec::new();
    let mut diverged = Vec::new();
    while streams.len() < 8 {
        match tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .expect("the new primary's events are delivered")
        {
            Ok(e) => {
                assert!(
                    e.stream.starts_with("new/"),
                    "{} at {}",
                    e.stream,
                    e.position
                );
                assert_eq!(diverged.len(), 1, "said before the first new event");
                streams.push(e.stream.clone());
            }
            Err(SubscribeError::Diverged { from, to, timeline }) => {
                diverged.push((from.0, to.0, timeline))
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(diverged, vec![(4, 8, 2)]);
    // The log on the new primary holds the kept and the new events, and
    // says where the takeover cut it.
    let promoted = events::db::connect(&db, "t").await.unwrap();
    let rows = promoted
        .query("SELECT stream FROM strata.events ORDER BY position", &[])
        .await
        .unwrap();
    let all: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(all.len(), 11, "{all:?}");
    assert!(all.iter().all(|s| !s.starts_with("lost/")), "{all:?}");
    // The new timeline's epoch starts after everything the old primary
    // could have handed out, and the log says where it was cut.
    assert_eq!(new[0], events::EPOCH_SIZE + 1, "{new:?}");
    let epoch = promoted
        .query_one(
            "SELECT first_position, previous_head, timeline FROM strata.log_epochs",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            epoch.get::<_, i64>(0),
            epoch.get::<_, i64>(1),
            epoch.get::<_, i32>(2)
        ),
        (events::EPOCH_SIZE as i64 + 1, 3, 2)
    );
    // The subscription knows what it delivered that is gone.
    assert_eq!(sub.lost_in_takeovers(), 5);
    drop(standby);
}

/// A synchronous standby stops receiving (it is pointed away from the
/// primary): commits go on on the primary, and their acknowledgements wait
/// for the standby. The primary's logical decoding sends them at once, but
/// a reader must hold them back: a consumer that acted on one (a gateway
/// handing a node its command) would act on what the standby's takeover
/// then loses. The primary dies and the standby takes over: the
/// subscription delivered none of the lost commits and has no divergence
/// to report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_delivers_nothing_a_synchronous_standby_lacks() {
    let mut primary = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&primary).await;
    let dbname = url.rsplit('/').next().unwrap().to_string();
    let standby = testkit::temp_standby(&primary).unwrap();
    let admin = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "test")
        .await
        .unwrap();
    testkit::standbys::make_synchronous(&admin).await;
    let db = both(&primary, &standby, &dbname);
    let rc = reader_config();
    let slot = rc.slot.clone();
    let reader = Reader::start(&db, rc);
    let mut sub = reader.subscribe_ephemeral(Start::Now).await.unwrap();
    let appender = Appender::start(&db, AppenderConfig::default());
    for i in 0..3 {
        appender
            .append(&format!("kept/{i}"), ExpectedVersion::NoStream, vec![ev(i)])
            .await
            .unwrap();
    }
    crate::take(&mut sub, 3).await;
    testkit::eventually(30, "the reader records that it holds for the standby", || async {
        admin
            .query_opt(
                "SELECT 1 FROM strata.replication_readers WHERE slot_name = $1 AND holds_for_standbys",
                &[&slot],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;

    // The standby is pointed at a port where nothing listens.
    let on_standby = events::db::connect(&Database::parse(&standby.url(&dbname)).unwrap(), "t")
        .await
        .unwrap();
    testkit::standbys::stop_receiving(&on_standby).await;
    // Five appends; those the appender's connections commit are on the
    // primary alone (each connection then waits for the standby, before
    // the acknowledgement), and none is acknowledged.
    let waiting: Vec<_> = (0..5)
        .map(|i| {
            let appender = appender.clone();
            tokio::spawn(async move {
                appender
                    .append(&format!("lost/{i}"), ExpectedVersion::NoStream, vec![ev(i)])
                    .await
            })
        })
        .collect();
    testkit::eventually(30, "the lost appends committed on the primary", || async {
        admin
            .query_one(
                "SELECT count(*) FROM strata.events WHERE stream LIKE 'lost/%'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
    })
    .await;
    // Decoded and sent to the reader's walsender's client: everything
    // written so far went out.
    let written: String = admin
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    testkit::eventually(30, "the reader was sent the lost appends", || async {
        admin
            .query_opt(
                "SELECT 1 FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
                  WHERE s.slot_type = 'logical' AND r.sent_lsn >= $1::text::pg_lsn",
                &[&written],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;
    if let Ok(e) = tokio::time::timeout(Duration::from_secs(3), sub.next()).await {
        panic!(
            "delivered while the synchronous standby lacks it: {:?}",
            e.map(|e| (e.stream.clone(), e.position))
        );
    }
    assert!(
        waiting.iter().all(|w| !w.is_finished()),
        "none acknowledged"
    );

    primary.crash();
    standby.promote().unwrap();
    for w in waiting {
        w.abort();
    }
    for i in 0..3 {
        loop {
            match appender
                .append(&format!("new/{i}"), ExpectedVersion::NoStream, vec![ev(i)])
                .await
            {
                Ok(_) => break,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    // Appends still queued in the appender when the primary died may
    // commit on the new one: delivered then, as any event of the new log.
    // Whatever is delivered is in the new primary's log, at its position.
    let promoted = events::db::connect(&db, "t").await.unwrap();
    let mut new = Vec::new();
    while new.len() < 3 {
        let e = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .expect("the new primary's events are delivered")
            .unwrap_or_else(|e| panic!("nothing delivered was lost, so no divergence: {e}"));
        let there = promoted
            .query_opt(
                "SELECT 1 FROM strata.events WHERE stream = $1 AND position = $2",
                &[&e.stream, &(e.position.0 as i64)],
            )
            .await
            .unwrap();
        assert!(
            there.is_some(),
            "{} at {} was delivered but is not in the new primary's log",
            e.stream,
            e.position
        );
        if e.stream.starts_with("new/") {
            new.push(e.stream.clone());
        }
    }
    assert_eq!(new, ["new/0", "new/1", "new/2"]);
    assert_eq!(sub.lost_in_takeovers(), 0);
    drop(standby);
}

/// `synchronous_standby_names = '*'` with no physical standby: the server
/// makes the reader's own replication connection the synchronous standby.
/// A reader that waited for the standbys would wait for itself; it delivers
/// instead (and says why), commits go on, and `doctor` names the problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_made_a_synchronous_standby_itself_still_delivers_and_doctor_says_so() {
    let cluster = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let db = Database::parse(&url).unwrap();
    let admin = events::db::connect(&db, "test").await.unwrap();
    let rc = reader_config();
    let slot = rc.slot.clone();
    let reader = Reader::start(&db, rc);
    let mut sub = reader.subscribe_ephemeral(Start::Now).await.unwrap();
    // Named once the reader streams (a slot made while '*' names no one
    // streaming waits for ever: its snapshot's flush barrier is a
    // synchronous commit).
    testkit::eventually(30, "the reader streams", || async { reader.streaming() }).await;
    for sql in [
        "ALTER SYSTEM SET synchronous_standby_names = '*'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    testkit::eventually(30, "the reader is the synchronous standby", || async {
        admin
            .query_opt(
                "SELECT 1 FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
                  WHERE s.slot_name = $1 AND r.sync_state = 'sync'",
                &[&slot],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;
    // Each commit waits for the reader to acknowledge it, so the events
    // are taken (and acknowledged) while they are appended.
    let appender = Appender::start(&db, AppenderConfig::default());
    let appends = tokio::spawn(async move {
        for i in 0..5 {
            tokio::time::timeout(
                Duration::from_secs(20),
                appender.append(&format!("self/{i}"), ExpectedVersion::NoStream, vec![ev(i)]),
            )
            .await
            .expect("acknowledged in time")
            .unwrap();
        }
    });
    for _ in 0..5 {
        let e = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .expect("delivered in time")
            .unwrap();
        sub.ack(e.position);
    }
    appends.await.unwrap();
    let held: bool = admin
        .query_one(
            "SELECT holds_for_standbys FROM strata.replication_readers WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!held, "a reader cannot hold for itself");
    let findings = events::doctor::examine(&admin, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        findings.iter().any(|f| f.check == "synchronous_standby"
            && f.status == events::doctor::Status::Problem
            && f.detail.contains("replication reader")),
        "{findings:?}"
    );
}

/// A reader reads `synchronous_standby_names` once per status interval:
/// until it has found the standby named, it delivers what a takeover may
/// lose, and `doctor` says which readers that is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_names_the_readers_that_do_not_hold_for_a_newly_named_standby_yet() {
    let primary = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&primary).await;
    let _standby = testkit::temp_standby(&primary).unwrap();
    let db = Database::parse(&url).unwrap();
    let admin = events::db::connect(&db, "test").await.unwrap();
    // It reads the setting at its start, then not for a minute.
    let mut rc = reader_config();
    rc.status_interval = Duration::from_secs(60);
    let slot = rc.slot.clone();
    let reader = Reader::start(&db, rc);
    testkit::eventually(30, "the reader streams", || async { reader.streaming() }).await;
    testkit::standbys::make_synchronous(&admin).await;
    let findings = events::doctor::examine(&admin, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        findings.iter().any(|f| f.check == "synchronous_standby"
            && f.status == events::doctor::Status::Warning
            && f.detail.contains(&slot)),
        "{findings:?}"
    );
}
