//! Integration tests of the placer against a real Postgres: placements
//! through the log, live and rebuilt indexes, snapshots, two placers on one
//! pool, stale indexes.

use events::{Appender, AppenderConfig, ExpectedVersion, Reader, ReaderConfig};
use placer::client::{self, Outcome};
use placer::{plan, Placer, PlacerConfig};
use projections::domain::pool_stream;
use projections::requests::RequestError;
use projections::{check, projector, Fact, Index, Projector, Request, Shape, SnapshotStore};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio_postgres::{Client, Config};

const C: &str = "H100-80GB";

async fn db() -> (Config, Client) {
    let url = schema::testing::migrated_database(schema::testing::shared_cluster()).await;
    let cfg: Config = url.parse().unwrap();
    let client = events::db::connect(&cfg, "test").await.unwrap();
    (cfg, client)
}

static SLOT: AtomicU32 = AtomicU32::new(0);

fn reader(cfg: &Config) -> Reader {
    let mut rc = ReaderConfig::new(format!(
        "pt_{}_{}",
        std::process::id(),
        SLOT.fetch_add(1, Ordering::Relaxed)
    ));
    rc.temporary = true;
    rc.status_interval = Duration::from_millis(100);
    Reader::start(cfg.clone(), rc)
}

async fn pool(appender: &Appender, name: &str, nodes: u32) {
    client::create_pool(appender, name, "test pool")
        .await
        .unwrap();
    let fleet = client::uniform_fleet(&format!("{name}-n"), nodes, C, 8, 4);
    client::join_nodes(appender, name, fleet, |_| {})
        .await
        .unwrap();
}

fn request(id: &str, pool: &str, gpus: u32, shape: Shape) -> Request {
    Request {
        reservation: id.into(),
        pool: pool.into(),
        class: C.into(),
        gpus,
        shape,
        priority: 0,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        queue: None,
    }
}

/// The next outcome of a reservation, within 30 s.
async fn wait_for(sub: &mut events::Subscription, id: &str) -> Outcome {
    tokio::time::timeout(Duration::from_secs(30), client::wait(sub, id, |_| {}))
        .await
        .expect("an outcome in time")
        .unwrap()
}

async fn head(client: &Client) -> u64 {
    events::read::head(client).await.unwrap().0
}

/// Steps a projector until it has applied `position`.
async fn follow(p: &mut Projector, position: u64) {
    tokio::time::timeout(Duration::from_secs(30), async {
        while p.index.position() < position {
            p.step().await.unwrap();
        }
    })
    .await
    .expect("the projector caught up");
}

/// Waits until the log's check shows `n` reservations no longer pending.
async fn settled(client: &Client, live: usize, pending: usize) -> check::Report {
    let mut last = None;
    for _ in 0..300 {
        let r = check::check(client, |_| {}).await.unwrap();
        if r.live == live && r.pending == pending {
            return r;
        }
        last = Some(r);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never settled at {live} live and {pending} pending: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_flow_through_the_log_and_rebuilt_indexes_match() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "p1", 4).await;
    let reader = reader(&cfg);
    let dir = tempfile::tempdir().unwrap();
    let store = SnapshotStore::new(dir.path());
    let mut live = Projector::start(&reader, Some(store.clone()))
        .await
        .unwrap();
    let placer = Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        PlacerConfig::new("a"),
    );

    // A client waits for its reservation through a subscription.
    let mut sub = reader
        .subscribe_ephemeral(events::Start::Now)
        .await
        .unwrap();
    client::reserve(&client, &appender, &request("first", "p1", 8, Shape::Node))
        .await
        .unwrap();
    let outcome = wait_for(&mut sub, "first").await;
    let Outcome::Placed(allocs) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(allocs.len(), 1);
    assert_eq!(allocs[0].devices.len(), 8);

    // A mix of shapes; 4 nodes x 8 = 32 GPUs, 8 taken.
    let shapes = [
        (2, Shape::Any),
        (4, Shape::Island),
        (
            4,
            Shape::Gang {
                nodes: 2,
                gpus_per_node: 2,
            },
        ),
        (1, Shape::Node),
    ];
    for (i, (gpus, shape)) in shapes.iter().enumerate() {
        client::reserve(
            &client,
            &appender,
            &request(&format!("m{i}"), "p1", *gpus, *shape),
        )
        .await
        .unwrap();
    }
    // Asking for more than the pool has is refused at once by the placer.
    client::reserve(&client, &appender, &request("huge", "p1", 33, Shape::Any))
        .await
        .unwrap();
    settled(&client, 5, 0).await;
    live.snapshot().unwrap().expect("a snapshot was written");
    let snap_at = live.index.position();

    // Releases free devices; a waiting reservation then places.
    client::reserve(&client, &appender, &request("big", "p1", 16, Shape::Any))
        .await
        .unwrap();
    let r = settled(&client, 5, 1).await;
    assert_eq!(r.booked_devices, 19);
    client::release(&appender, "first", "done").await.unwrap();
    client::release(&appender, "m1", "done").await.unwrap();
    settled(&client, 4, 0).await;
    let err = client::release(&appender, "never-made", "")
        .await
        .unwrap_err();
    assert!(
        matches!(err, client::ClientError::Request(RequestError::NotFound(_))),
        "{err}"
    );
    let err = client::reserve(&client, &appender, &request("x", "nope", 1, Shape::Any))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            client::ClientError::Request(RequestError::NoSuchPool(_))
        ),
        "{err}"
    );

    let end = head(&client).await;
    follow(&mut live, end).await;
    assert_eq!(live.violations, 0);
    // Rebuilt from the whole log, and from the snapshot plus what followed.
    let rebuilt = projector::build(&client, Index::new()).await.unwrap();
    assert_eq!(rebuilt.position(), end);
    assert!(rebuilt == live.index, "a rebuilt index equals the live one");
    assert!(live.index.derived_is_consistent());
    let mut resumed = Projector::start(&reader, Some(store.clone()))
        .await
        .unwrap();
    assert_eq!(resumed.started_at, snap_at);
    follow(&mut resumed, end).await;
    assert!(
        resumed.index == live.index,
        "snapshot + stream equals the live index"
    );

    let stats = placer.stats().view();
    assert_eq!(stats.placed, 6, "{stats:?}");
    assert_eq!(stats.unschedulable, 1, "{stats:?}");
    assert_eq!(stats.released, 2, "{stats:?}");
    assert!(stats.queued >= 1, "{stats:?}");
    placer.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_placers_forced_onto_one_pool_never_double_book() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "hot", 6).await;
    let mut placers = Vec::new();
    for name in ["x", "y"] {
        let mut config = PlacerConfig::new(name);
        config.unleased = true;
        config.max_batch = 8;
        // Each placer has its own reader, so their indexes lag differently.
        placers.push(Placer::start(
            cfg.clone(),
            reader(&cfg),
            appender.clone(),
            config,
        ));
    }
    // Both are following the pool before the requests come.
    let at = head(&client).await;
    for _ in 0..300 {
        if placers
            .iter()
            .all(|p| p.stats().view().pools_held == 1 && p.stats().view().position >= at)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // 48 GPUs; 100 one-GPU requests and 10 two-GPU gangs, concurrently.
    let mut tasks = Vec::new();
    for i in 0..110 {
        let (client_cfg, appender) = (cfg.clone(), appender.clone());
        tasks.push(tokio::spawn(async move {
            let c = events::db::connect(&client_cfg, "t").await.unwrap();
            let r = if i < 100 {
                request(&format!("r{i}"), "hot", 1, Shape::Any)
            } else {
                request(
                    &format!("g{i}"),
                    "hot",
                    2,
                    Shape::Gang {
                        nodes: 2,
                        gpus_per_node: 1,
                    },
                )
            };
            client::reserve(&c, &appender, &r).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Every GPU is booked once, and the rest wait.
    let mut report = None;
    for _ in 0..300 {
        let r = check::check(&client, |_| {})
            .await
            .expect("no invariant is violated");
        if r.booked_devices == 48 && r.live + r.pending == 110 && r.pending > 0 {
            let queued: i64 = client
                .query_one(
                    "SELECT count(*) FROM strata.events WHERE type = 'reservation.queued'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if queued as usize == r.pending {
                report = Some(r);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = report.expect("the pool filled up and the rest was queued");
    let placed: i64 = client
        .query_one(
            "SELECT count(*) FROM strata.events WHERE type = 'reservation.placed'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(placed as usize, report.live, "no reservation placed twice");
    let conflicts: u64 = placers.iter().map(|p| p.stats().view().conflicts).sum();
    let batches: Vec<u64> = placers.iter().map(|p| p.stats().view().batches).collect();
    eprintln!("conflicts {conflicts}, batches {batches:?}");
    assert!(conflicts > 0, "the placers contended (batches {batches:?})");
    for p in placers {
        p.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_index_costs_a_conflict_not_a_double_booking() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "s", 1).await;
    client::reserve(&client, &appender, &request("a", "s", 8, Shape::Node))
        .await
        .unwrap();
    client::reserve(&client, &appender, &request("b", "s", 8, Shape::Node))
        .await
        .unwrap();
    // Two copies of the same index: one placer commits from the first...
    let mut fresh = projector::build(&client, Index::new()).await.unwrap();
    let mut stale = fresh.clone();
    let version = fresh.pool("s").unwrap().version;
    let commit = |index: &mut Index, id: &str| {
        let plan = plan::plan_batch(index, "s", &[id.to_string()], 0);
        let (reservation, allocations) = plan.placed.into_iter().next().expect("fits");
        Fact::ReservationPlaced {
            reservation,
            allocations,
        }
        .to_event()
    };
    let e = commit(&mut fresh, "a");
    appender
        .append(&pool_stream("s"), ExpectedVersion::Exact(version), vec![e])
        .await
        .unwrap();
    // ...and the stale one, which still sees the node free, is refused.
    let e = commit(&mut stale, "b");
    let err = appender
        .append(&pool_stream("s"), ExpectedVersion::Exact(version), vec![e])
        .await
        .unwrap_err();
    assert!(
        matches!(err, events::AppendError::VersionConflict { actual, .. } if actual == version + 1),
        "{err}"
    );
    // Refreshed, it sees the node is full and places nothing.
    let mut refreshed = projector::build(&client, stale.clone()).await.unwrap();
    let plan = plan::plan_batch(&mut refreshed, "s", &["b".to_string()], 0);
    assert!(plan.placed.is_empty() && plan.queued.len() == 1, "{plan:?}");
    check::check(&client, |_| {}).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_finds_a_double_booking_in_the_log() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "bad", 1).await;
    for id in ["a", "b"] {
        client::reserve(&client, &appender, &request(id, "bad", 1, Shape::Any))
            .await
            .unwrap();
    }
    // Written around the placer and its fence, as a buggy writer would.
    for id in ["a", "b"] {
        let fact = Fact::ReservationPlaced {
            reservation: id.into(),
            allocations: vec![projections::Allocation {
                node: "bad-n00000".into(),
                devices: vec!["gpu0".into()],
            }],
        };
        appender
            .append(
                &pool_stream("bad"),
                ExpectedVersion::Any,
                vec![fact.to_event()],
            )
            .await
            .unwrap();
    }
    let err = check::check(&client, |_| {}).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("double booking") && text.contains("by reservation \"a\""),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_expire_after_their_ttl_and_free_their_devices() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "ttl", 1).await;
    let reader = reader(&cfg);
    let placer = Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        PlacerConfig::new("t"),
    );
    let mut sub = reader
        .subscribe_ephemeral(events::Start::Now)
        .await
        .unwrap();
    let mut r = request("short", "ttl", 8, Shape::Node);
    r.ttl_ms = Some(300);
    client::reserve(&client, &appender, &r).await.unwrap();
    assert!(matches!(
        wait_for(&mut sub, "short").await,
        Outcome::Placed(_)
    ));
    let placed_at = std::time::Instant::now();
    assert_eq!(wait_for(&mut sub, "short").await, Outcome::Expired);
    assert!(
        placed_at.elapsed() >= Duration::from_millis(150),
        "not before its time"
    );
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.booked_devices, report.live), (0, 0));
    assert_eq!(placer.stats().view().expired, 1);
    placer.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_activation_racing_a_release_or_an_expiry_conflicts_instead_of_landing_after_the_end() {
    // A binder activates a reservation at the version of its stream that it
    // has seen. If the reservation was released (or expired) in between, its
    // end must have moved that version, so the late activation conflicts
    // instead of landing after the end.
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "fence", 2).await;
    let reader = reader(&cfg);
    let placer = Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        PlacerConfig::new("fence"),
    );
    let mut sub = reader
        .subscribe_ephemeral(events::Start::Now)
        .await
        .unwrap();
    let activate = |id: &str, seen: u64| {
        let appender = appender.clone();
        let id = id.to_string();
        async move {
            appender
                .append(
                    &projections::domain::reservation_stream(&id),
                    ExpectedVersion::Exact(seen),
                    vec![Fact::ReservationActive { reservation: id }.to_event()],
                )
                .await
        }
    };

    // Released: the binder saw the release request, not yet the release.
    client::reserve(&client, &appender, &request("rel", "fence", 8, Shape::Node))
        .await
        .unwrap();
    assert!(matches!(
        wait_for(&mut sub, "rel").await,
        Outcome::Placed(_)
    ));
    // The version a binder has seen: the one the release request made.
    let seen = appender
        .append(
            "reservation/rel",
            ExpectedVersion::StreamExists,
            vec![Fact::ReleaseRequested {
                reservation: "rel".into(),
                reason: "done".into(),
            }
            .to_event()],
        )
        .await
        .unwrap()
        .version;
    assert_eq!(wait_for(&mut sub, "rel").await, Outcome::Released);
    let late = activate("rel", seen).await;
    assert!(
        matches!(late, Err(events::AppendError::VersionConflict { .. })),
        "an activation after the release was accepted: {late:?}"
    );

    // Expired: the binder saw the request only.
    let mut r = request("ttl", "fence", 8, Shape::Node);
    r.ttl_ms = Some(200);
    client::reserve(&client, &appender, &r).await.unwrap();
    assert!(matches!(
        wait_for(&mut sub, "ttl").await,
        Outcome::Placed(_)
    ));
    // The binder saw the request: version 1.
    let seen = 1;
    assert_eq!(wait_for(&mut sub, "ttl").await, Outcome::Expired);
    let late = activate("ttl", seen).await;
    assert!(
        matches!(late, Err(events::AppendError::VersionConflict { .. })),
        "an activation after the expiry was accepted: {late:?}"
    );

    // The log's own check agrees, and each end is on the reservation's stream.
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (0, 0));
    let ended: Vec<String> = client
        .query(
            "SELECT payload->>'outcome' FROM strata.events WHERE type = 'reservation.ended' ORDER BY position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ended, ["released", "expired"]);
    placer.stop().await.unwrap();
}

/// Answers every `allocation.bind` as its node would (through the command's
/// log), retrying through database restarts: the node's side of a bind,
/// which these tests do not exercise.
fn answer_binds(reader: Reader, appender: Appender) -> tokio::task::JoinHandle<()> {
    answer_binds_with(reader, appender, |_| projections::commands::SUCCEEDED)
}

/// [`answer_binds`] with the outcome `answer` picks for each command id:
/// `command.succeeded`, `command.failed` (the node refused it) or
/// `command.expired` (as the gateway records a command the node never
/// answered).
fn answer_binds_with(
    reader: Reader,
    appender: Appender,
    answer: impl Fn(&str) -> &'static str + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut sub = reader
            .subscribe_ephemeral(events::Start::Beginning)
            .await
            .unwrap();
        loop {
            let Ok(e) = sub.next().await else { return };
            sub.ack(e.position);
            if e.event_type != projections::commands::ISSUED
                || !e.payload.contains("allocation.bind")
            {
                continue;
            }
            let id = e.stream.trim_start_matches("command/").to_string();
            let outcome = answer(&id);
            for _ in 0..100 {
                match projections::commands::transition(
                    &appender,
                    &id,
                    e.version,
                    outcome,
                    &serde_json::json!({"detail": "device gpu9 is not on this node"}),
                )
                .await
                {
                    Ok(_) | Err(events::AppendError::VersionConflict { .. }) => break,
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }
    })
}

/// Events of `event_type` on `stream`, counted on a fresh connection (the
/// server may have restarted since the last one).
async fn count_on(cfg: &Config, stream: &str, event_type: &str) -> Option<i64> {
    let client = events::db::connect(cfg, "test-count").await.ok()?;
    client
        .query_one(
            "SELECT count(*) FROM strata.events WHERE stream = $1 AND type = $2",
            &[&stream, &event_type],
        )
        .await
        .ok()
        .map(|r| r.get(0))
}

/// Waits until `stream` has an event of `event_type`; the time it took.
async fn until_on(cfg: &Config, stream: &str, event_type: &str, secs: u64) -> Duration {
    let t = std::time::Instant::now();
    while count_on(cfg, stream, event_type).await.unwrap_or(0) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "no {event_type} on {stream} within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placer_and_binder_survive_a_postgres_crash_restart() {
    let mut cluster = schema::testing::temp_cluster(&[]).unwrap();
    let url = schema::testing::migrated_database(&cluster).await;
    let cfg: Config = url.parse().unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "crash", 2).await;
    let reader = reader(&cfg);
    let mut pc = PlacerConfig::new("crash-placer");
    pc.lease_ttl = Duration::from_secs(2);
    let placer = Placer::start(cfg.clone(), reader.clone(), appender.clone(), pc);
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    let node = answer_binds(reader.clone(), appender.clone());
    let client = events::db::connect(&cfg, "test").await.unwrap();
    client::reserve(
        &client,
        &appender,
        &request("before", "crash", 8, Shape::Node),
    )
    .await
    .unwrap();
    until_on(&cfg, "reservation/before", "reservation.activated", 30).await;

    // A crash: every server process ends at once, then crash recovery.
    tokio::task::block_in_place(|| {
        cluster.crash();
        cluster.restart()
    })
    .unwrap();
    let back = std::time::Instant::now();
    loop {
        let Ok(client) = events::db::connect(&cfg, "test").await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        match client::reserve(
            &client,
            &appender,
            &request("after", "crash", 8, Shape::Node),
        )
        .await
        {
            Ok(()) => break,
            Err(e) => {
                assert!(
                    back.elapsed() < Duration::from_secs(30),
                    "no reservation after the restart: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    until_on(&cfg, "reservation/after", "reservation.activated", 30).await;
    let recovered = back.elapsed();
    eprintln!("placed and active again {recovered:?} after the restart");

    // Both leases are renewed again, as the table has them: the placer's
    // pool and the binder's (neither holder kept working on a dead
    // connection, nor stopped).
    let restarted_at: std::time::SystemTime = events::db::connect(&cfg, "test")
        .await
        .unwrap()
        .query_one("SELECT pg_postmaster_start_time()", &[])
        .await
        .unwrap()
        .get(0);
    let t = std::time::Instant::now();
    loop {
        let client = events::db::connect(&cfg, "test").await.unwrap();
        let renewed: i64 = client
            .query_one(
                "SELECT count(*) FROM strata.leases
                  WHERE name IN ('binder', 'pool/crash') AND renewed_at > $1 AND expires_at > now()",
                &[&restarted_at],
            )
            .await
            .unwrap()
            .get(0);
        if renewed == 2 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the leases were not renewed after the restart: {:?}",
            client
                .query(
                    "SELECT name, holder, renewed_at::text, expires_at::text FROM strata.leases",
                    &[]
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (
                    r.get::<_, String>(0),
                    r.get::<_, String>(1),
                    r.get::<_, String>(2),
                    r.get::<_, String>(3)
                ))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!placer.is_finished(), "the placer stopped");
    assert!(!binder.is_finished(), "the binder stopped");
    let client = events::db::connect(&cfg, "test").await.unwrap();
    // And placement goes on after them: a release, then a new reservation.
    client::release(&appender, "before", "done").await.unwrap();
    until_on(&cfg, "reservation/before", "reservation.ended", 30).await;
    client::reserve(
        &client,
        &appender,
        &request("later", "crash", 8, Shape::Node),
    )
    .await
    .unwrap();
    until_on(&cfg, "reservation/later", "reservation.activated", 30).await;
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (2, 16));
    node.abort();
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binder_started_after_releases_sends_them_to_the_nodes() {
    // Reservations released (or expired) while no binder runs: the next
    // binder finds their bindings in the log and releases them on the node.
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "leak", 2).await;
    let reader = reader(&cfg);
    let placer = Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        PlacerConfig::new("leak"),
    );
    let node = answer_binds(reader.clone(), appender.clone());
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    let mut sub = reader
        .subscribe_ephemeral(events::Start::Now)
        .await
        .unwrap();
    for id in ["l1", "l2"] {
        client::reserve(&client, &appender, &request(id, "leak", 8, Shape::Node))
            .await
            .unwrap();
        until_on(
            &cfg,
            &format!("reservation/{id}"),
            "reservation.activated",
            30,
        )
        .await;
    }
    binder.stop().await.unwrap();
    // No binder runs while both are released.
    client::release(&appender, "l1", "done").await.unwrap();
    client::release(&appender, "l2", "done").await.unwrap();
    for id in ["l1", "l2"] {
        loop {
            if wait_for(&mut sub, id).await == Outcome::Released {
                break;
            }
        }
    }
    let releases = "SELECT count(*) FROM strata.events WHERE stream LIKE 'command/release:%' AND type = 'command.issued'";
    let issued: i64 = client.query_one(releases, &[]).await.unwrap().get(0);
    assert_eq!(issued, 0, "no binder ran");
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    let t = std::time::Instant::now();
    loop {
        let issued: i64 = client.query_one(releases, &[]).await.unwrap().get(0);
        if issued == 2 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the new binder issued {issued} of 2 releases"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    node.abort();
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_bind_is_tried_again_and_a_refused_one_releases_its_reservation() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "binds", 2).await;
    let reader = reader(&cfg);
    let placer = Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        PlacerConfig::new("binds"),
    );
    let node = answer_binds_with(reader.clone(), appender.clone(), |id| {
        if id.starts_with("bind:slow:") {
            projections::commands::EXPIRED
        } else if id.starts_with("bind:bad:") {
            projections::commands::FAILED
        } else {
            projections::commands::SUCCEEDED
        }
    });
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    for id in ["slow", "bad"] {
        client::reserve(&client, &appender, &request(id, "binds", 8, Shape::Node))
            .await
            .unwrap();
    }
    // The first bind expired; the second attempt bound it.
    until_on(&cfg, "reservation/slow", "reservation.activated", 30).await;
    let retried: i64 = client
        .query_one(
            "SELECT count(*) FROM strata.events WHERE stream LIKE 'command/rebind:1:slow:%' AND type = 'command.succeeded'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(retried, 1);
    // The node refused the other: it is released, and says why.
    until_on(&cfg, "reservation/bad", "reservation.ended", 30).await;
    let reason: String = client
        .query_one(
            "SELECT payload->>'reason' FROM strata.events WHERE stream = 'reservation/bad' AND type = 'reservation.release_requested'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        reason.contains("could not bind it: device gpu9"),
        "{reason}"
    );
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (1, 8));

    // A binder started now reads the attempts from the log: slow is bound.
    binder.stop().await.unwrap();
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    let activated: i64 = client
        .query_one(
            "SELECT count(*) FROM strata.events WHERE stream = 'reservation/slow' AND type = 'reservation.activated'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(activated, 1);
    node.abort();
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_then_release_races_never_activate_after_the_end() {
    // Clients release right after placement while the binder activates: the
    // end and the activation race, many at a time.
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "race", 8).await;
    let reader = reader(&cfg);
    let placer = Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        PlacerConfig::new("race"),
    );
    let node = answer_binds(reader.clone(), appender.clone());
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    let mut clients = Vec::new();
    for c in 0..16 {
        let (cfg, appender, reader) = (cfg.clone(), appender.clone(), reader.clone());
        clients.push(tokio::spawn(async move {
            let client = events::db::connect(&cfg, "race-client").await.unwrap();
            let mut sub = reader
                .subscribe_ephemeral(events::Start::Now)
                .await
                .unwrap();
            for i in 0..25 {
                let id = format!("race-{c}-{i}");
                client::reserve(&client, &appender, &request(&id, "race", 2, Shape::Any))
                    .await
                    .unwrap();
                loop {
                    if matches!(wait_for(&mut sub, &id).await, Outcome::Placed(_)) {
                        break;
                    }
                }
                // Released 0 to 100 ms after placement: some activations win
                // the race, some lose it.
                tokio::time::sleep(Duration::from_micros(fastrand::u64(0..100_000))).await;
                client::release(&appender, &id, "done").await.unwrap();
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    // Every reservation ends; then nothing of any lands after its end.
    let t = std::time::Instant::now();
    loop {
        let ended: i64 = client
            .query_one(
                "SELECT count(*) FROM strata.events WHERE type = 'reservation.released'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if ended == 400 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{ended} of 400 ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
    node.abort();
    let late: i64 = client
        .query_one(
            "SELECT count(*) FROM strata.events a JOIN strata.events e
                ON e.type = 'reservation.released' AND e.payload->>'reservation' = substr(a.stream, 13)
             WHERE a.type = 'reservation.activated' AND a.position > e.position",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    if late > 0 {
        let rows = client
            .query(
                "SELECT a.stream FROM strata.events a JOIN strata.events e
                    ON e.type = 'reservation.released' AND e.payload->>'reservation' = substr(a.stream, 13)
                 WHERE a.type = 'reservation.activated' AND a.position > e.position",
                &[],
            )
            .await
            .unwrap();
        let stream: String = rows[0].get(0);
        let id = stream.trim_start_matches("reservation/").to_string();
        let history: Vec<String> = client
            .query(
                "SELECT position::text || ' ' || stream || ' v' || version::text || ' ' || type || ' ' || payload::text
                   FROM strata.events WHERE stream = $1 OR payload->>'reservation' = $2
                      OR payload->'args'->>'reservation' = $2 ORDER BY position",
                &[&stream, &id],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        panic!(
            "activations after their reservation's end: {late}\n{}",
            history.join("\n")
        );
    }
    let activated: i64 = client
        .query_one(
            "SELECT count(*) FROM strata.events WHERE type = 'reservation.activated'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    eprintln!("400 reserve-then-release cycles: {activated} activated before their end, 0 after");
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_that_asked_is_placed_again_when_its_node_fails() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "again", 3).await;
    let reader = reader(&cfg);
    let placer = Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        PlacerConfig::new("again"),
    );
    let mut sub = reader
        .subscribe_ephemeral(events::Start::Now)
        .await
        .unwrap();
    let mut keep = request("keep", "again", 8, Shape::Node);
    keep.replace_on_failure = true;
    client::reserve(&client, &appender, &keep).await.unwrap();
    let Outcome::Placed(first) = wait_for(&mut sub, "keep").await else {
        panic!("keep was not placed");
    };
    client::reserve(
        &client,
        &appender,
        &request("plain", "again", 8, Shape::Node),
    )
    .await
    .unwrap();
    let Outcome::Placed(plain_on) = wait_for(&mut sub, "plain").await else {
        panic!("plain was not placed");
    };
    // Both nodes leave the pool.
    for node in [&first[0].node, &plain_on[0].node] {
        appender
            .append(
                &pool_stream("again"),
                ExpectedVersion::StreamExists,
                vec![Fact::NodeLeft {
                    node: node.clone(),
                    reason: String::new(),
                }
                .to_event()],
            )
            .await
            .unwrap();
    }
    assert_eq!(
        wait_for(&mut sub, "keep").await,
        Outcome::Failed("node_left; placed again as keep~1".into())
    );
    let Outcome::Placed(second) = wait_for(&mut sub, "keep~1").await else {
        panic!("the replacement was not placed");
    };
    assert_ne!(
        second[0].node, first[0].node,
        "placed again on the node that left"
    );
    assert_ne!(second[0].node, plain_on[0].node);
    // The other did not ask: it only ends (its failure may have come in the
    // same batch as keep's, before the replacement's placement: the table
    // says).
    until_on(&cfg, "reservation/plain", "reservation.ended", 30).await;
    let reason: String = client
        .query_one(
            "SELECT payload->>'reason' || coalesce(payload->>'replaced_by', '') FROM strata.events
              WHERE type = 'reservation.failed' AND payload->>'reservation' = 'plain'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(reason, "node_left");
    let replaces: String = client
        .query_one(
            "SELECT payload->>'replaces' FROM strata.events WHERE stream = 'reservation/keep~1' AND version = 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(replaces, "keep");
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (1, 8));
    // A client that releases what it asked for releases its replacement.
    client::release(&appender, "keep", "done").await.unwrap();
    assert_eq!(wait_for(&mut sub, "keep~1").await, Outcome::Released);
    let index = projector::build(&client, Index::new()).await.unwrap();
    assert!(
        index.state().replaced_by.is_empty(),
        "{:?}",
        index.state().replaced_by
    );
    assert_eq!(index.state().reservations.len(), 0);
    // Ids with '~' are the placer's.
    let err = client::reserve(
        &client,
        &appender,
        &request("mine~1", "again", 1, Shape::Any),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("may not contain '~'"), "{err}");
    placer.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placer_that_cannot_renew_its_lease_stops_placing_before_it_expires() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "stall", 2).await;
    let reader = reader(&cfg);
    let mut pc = PlacerConfig::new("stall");
    pc.lease_ttl = Duration::from_millis(1500);
    let placer = Placer::start(cfg.clone(), reader.clone(), appender.clone(), pc);
    let stats = placer.stats();
    let t = std::time::Instant::now();
    while stats.view().pools_held != 1 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the pool was never taken"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Another session holds the lease row locked: the placer's renewals
    // block (the database is up, the lease just cannot be renewed).
    let mut blocker = events::db::connect(&cfg, "blocker").await.unwrap();
    let tx = blocker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM strata.leases WHERE name = 'pool/stall' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let blocked = std::time::Instant::now();
    while stats.view().pools_held != 0 {
        assert!(
            blocked.elapsed() < Duration::from_millis(1500),
            "still placing {:?} after its last renewal could start",
            blocked.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopped = blocked.elapsed();
    let expires_in: f64 = client
        .query_one(
            "SELECT extract(epoch FROM expires_at - now())::float8 FROM strata.leases WHERE name = 'pool/stall'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(expires_in > 0.0, "it stopped only after the lease ran out");
    eprintln!("stopped placing {stopped:?} after renewals stalled, {expires_in:.2} s before the lease expired");
    // Renewals go through again: the placer takes the pool back and places.
    tx.rollback().await.unwrap();
    let t = std::time::Instant::now();
    while stats.view().pools_held != 1 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the pool was never taken again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut sub = reader
        .subscribe_ephemeral(events::Start::Now)
        .await
        .unwrap();
    client::reserve(
        &client,
        &appender,
        &request("after-stall", "stall", 8, Shape::Node),
    )
    .await
    .unwrap();
    assert!(matches!(
        wait_for(&mut sub, "after-stall").await,
        Outcome::Placed(_)
    ));
    placer.stop().await.unwrap();
}
