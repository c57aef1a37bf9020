//! Integration tests of the placer against a real Postgres: placements
//! through the log, live and rebuilt indexes, snapshots, two placers on one
//! pool, stale indexes, expiries, replacements, lease loss. The binder's
//! part of a reservation's life, run beside a placer, is in `binding`.

use domain::pool_stream;
use domain::requests::Outcome;
use domain::requests::RequestError;
use domain::{Fact, Request, Shape};
use events::{Appender, AppenderConfig, ExpectedVersion, Reader, ReaderConfig};
use placer::{plan, Placer, PlacerConfig};
use projections::{check, projector, Index, Projector, SnapshotStore};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio_postgres::{Client, Config};

const C: &str = "H100-80GB";

mod binding;

async fn db() -> (Config, Client) {
    let url = testkit::migrated_database(testkit::shared_cluster()).await;
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
    domain::pools::create_pool(appender, name, "test pool")
        .await
        .unwrap();
    let fleet = domain::pools::uniform_fleet(&format!("{name}-n"), nodes, C, 8, 4);
    domain::pools::join_nodes(appender, name, fleet, |_| {})
        .await
        .unwrap();
}

fn request(id: &str, pool: &str, gpus: u32, shape: Shape) -> Request {
    domain::demand::request(id.into(), pool, C, gpus, shape)
}

/// The next outcome of a reservation, within 30 s.
async fn wait_for(sub: &mut events::Subscription, id: &str) -> Outcome {
    tokio::time::timeout(
        Duration::from_secs(30),
        domain::requests::wait(sub, id, |_| {}),
    )
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
    domain::requests::reserve(
        &client,
        &appender,
        &request("first", "p1", 8, Shape::Node),
        None,
    )
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
        domain::requests::reserve(
            &client,
            &appender,
            &request(&format!("m{i}"), "p1", *gpus, *shape),
            None,
        )
        .await
        .unwrap();
    }
    // Asking for more than the pool has is refused at once by the placer.
    domain::requests::reserve(
        &client,
        &appender,
        &request("huge", "p1", 33, Shape::Any),
        None,
    )
    .await
    .unwrap();
    settled(&client, 5, 0).await;
    live.snapshot().unwrap().expect("a snapshot was written");
    let snap_at = live.index.position();

    // Releases free devices; a waiting reservation then places.
    domain::requests::reserve(
        &client,
        &appender,
        &request("big", "p1", 16, Shape::Any),
        None,
    )
    .await
    .unwrap();
    let r = settled(&client, 5, 1).await;
    assert_eq!(r.booked_devices, 19);
    domain::requests::release(&appender, "first", "done", None)
        .await
        .unwrap();
    domain::requests::release(&appender, "m1", "done", None)
        .await
        .unwrap();
    settled(&client, 4, 0).await;
    let err = domain::requests::release(&appender, "never-made", "", None)
        .await
        .unwrap_err();
    assert!(matches!(err, RequestError::NotFound(_)), "{err}");
    let err = domain::requests::reserve(
        &client,
        &appender,
        &request("x", "nope", 1, Shape::Any),
        None,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, RequestError::NoSuchPool(_)), "{err}");

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
    assert_eq!(stats.rejected, 1, "{stats:?}");
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
            domain::requests::reserve(&c, &appender, &r, None)
                .await
                .unwrap();
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
    domain::requests::reserve(&client, &appender, &request("a", "s", 8, Shape::Node), None)
        .await
        .unwrap();
    domain::requests::reserve(&client, &appender, &request("b", "s", 8, Shape::Node), None)
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
        domain::requests::reserve(&client, &appender, &request(id, "bad", 1, Shape::Any), None)
            .await
            .unwrap();
    }
    // Written around the placer and its fence, as a buggy writer would.
    for id in ["a", "b"] {
        let fact = Fact::ReservationPlaced {
            reservation: id.into(),
            allocations: vec![domain::Allocation {
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
    domain::requests::reserve(&client, &appender, &r, None)
        .await
        .unwrap();
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

/// Answers every `allocation.bind` as its node would (through the command's
/// log), retrying through database restarts: the node's side of a bind,
/// which these tests do not exercise.
fn answer_binds(reader: Reader, appender: Appender) -> tokio::task::JoinHandle<()> {
    answer_binds_with(reader, appender, |_| domain::commands::SUCCEEDED)
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
            if e.event_type != domain::commands::ISSUED || !e.payload.contains("allocation.bind") {
                continue;
            }
            let id = e.stream.trim_start_matches("command/").to_string();
            let outcome = answer(&id);
            for _ in 0..100 {
                match domain::commands::transition(
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
    domain::requests::reserve(&client, &appender, &keep, None)
        .await
        .unwrap();
    let Outcome::Placed(first) = wait_for(&mut sub, "keep").await else {
        panic!("keep was not placed");
    };
    domain::requests::reserve(
        &client,
        &appender,
        &request("plain", "again", 8, Shape::Node),
        None,
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
    domain::requests::release(&appender, "keep", "done", None)
        .await
        .unwrap();
    assert_eq!(wait_for(&mut sub, "keep~1").await, Outcome::Released);
    let index = projector::build(&client, Index::new()).await.unwrap();
    assert!(
        index.state().replaced_by.is_empty(),
        "{:?}",
        index.state().replaced_by
    );
    assert_eq!(index.state().reservations.len(), 0);
    // Ids with '~' are the placer's.
    let err = domain::requests::reserve(
        &client,
        &appender,
        &request("mine~1", "again", 1, Shape::Any),
        None,
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
    domain::requests::reserve(
        &client,
        &appender,
        &request("after-stall", "stall", 8, Shape::Node),
        None,
    )
    .await
    .unwrap();
    assert!(matches!(
        wait_for(&mut sub, "after-stall").await,
        Outcome::Placed(_)
    ));
    placer.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placer_keeps_its_lease_while_its_subscription_is_flooded() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "busy", 2).await;
    let mut pc = PlacerConfig::new("busy");
    pc.lease_ttl = Duration::from_secs(1);
    pc.pools = Some(["busy".to_string()].into());
    let placer = Placer::start(cfg.clone(), reader(&cfg), appender.clone(), pc);
    let stats = placer.stats();
    let t = std::time::Instant::now();
    while stats.view().pools_held != 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "never took the pool");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first = lease_epoch(&client, "pool/busy").await;
    // A long backlog for the placer's subscription: events that mean
    // nothing to the pool, appended faster than the placer applies them,
    // for at least four lease lifetimes.
    let flood = std::time::Instant::now();
    let mut b = 0;
    while b < 100 || flood.elapsed() < Duration::from_secs(4) {
        b += 1;
        let appends = (0..10)
            .map(|s| events::StreamAppend {
                stream: format!("noise-{b}-{s}"),
                expected: ExpectedVersion::Any,
                events: (0..100)
                    .map(|i| events::NewEvent::new("test.noise", &serde_json::json!({ "i": i })))
                    .collect(),
            })
            .collect();
        appender.append_batch(appends).await.unwrap();
    }
    let end = head(&client).await;
    eprintln!(
        "flood of {b} batches in {:?}; the placer at {} of {end}",
        flood.elapsed(),
        stats.view().position
    );
    let mut samples = 0;
    while stats.view().position < end {
        let v = stats.view();
        assert_eq!(v.leases_lost, 0, "a lease lost while catching up");
        assert_eq!(v.pools_held, 1, "the pool was given up while catching up");
        samples += 1;
        assert!(
            flood.elapsed() < Duration::from_secs(120),
            "never caught up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let busy = flood.elapsed();
    // The flood kept the placer applying events for several lease
    // lifetimes (four at least, however fast it keeps up), and the lease
    // row was renewed through them: the same epoch, not taken again.
    assert_eq!(
        lease_epoch(&client, "pool/busy").await,
        first,
        "the lease was taken again"
    );
    assert_eq!(stats.view().leases_lost, 0);
    eprintln!("kept the pool's lease through {busy:?} of catching up ({samples} samples)");
    placer.stop().await.unwrap();
}

/// The epoch of lease `name` in the table.
async fn lease_epoch(client: &Client, name: &str) -> i64 {
    client
        .query_one("SELECT epoch FROM strata.leases WHERE name = $1", &[&name])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_can_preempt_nothing_are_not_planned_again_until_capacity_moves() {
    // A pool shared by a queue, full, and more requests waiting than one
    // batch may search victims for: none of them finds any (nothing of a
    // lower priority, no other queue to take back from). Once each has
    // been tried, the placer has nothing to do until capacity moves.
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "stuck", 2).await;
    let spec = domain::QueueSpec {
        queue: "team".into(),
        cohort: None,
        weight: 1,
        quotas: vec![domain::Quota {
            class: C.into(),
            nominal: 16,
            borrowing_limit: None,
        }],
        budgets: Vec::new(),
        max_run_ms: None,
    };
    domain::queues::configure(
        &client,
        &appender,
        "stuck",
        "team",
        &|_| Ok(spec.clone()),
        None,
    )
    .await
    .unwrap();
    let mut pc = PlacerConfig::new("stuck");
    pc.pools = Some(["stuck".to_string()].into());
    let placer = Placer::start(cfg.clone(), reader(&cfg), appender.clone(), pc);
    let stats = placer.stats();
    let waiting = plan::SEARCHES_PER_BATCH as u32 + 36;
    for i in 0..16 + waiting {
        let r = Request {
            queue: Some("team".into()),
            ..request(&format!("s{i}"), "stuck", 1, Shape::Any)
        };
        domain::requests::reserve(&client, &appender, &r, None)
            .await
            .unwrap();
    }
    settled(&client, 16, waiting as usize).await;
    // Every request decided: 16 placed, the rest queued once.
    let t = std::time::Instant::now();
    while stats.view().queued < u64::from(waiting) {
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", stats.view());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Capacity moves once: a reservation released, its GPU taken by the
    // first waiting request, and every other one tried again.
    domain::requests::release(&appender, "s0", "test", None)
        .await
        .unwrap();
    while stats.view().placed < 17 {
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", stats.view());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    settled(&client, 16, waiting as usize - 1).await;
    let before = stats.view();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = stats.view();
    eprintln!(
        "planned in 2 s of nothing to do: {} ({before:?} -> {after:?})",
        after.planned - before.planned
    );
    assert!(
        after.planned - before.planned <= 2,
        "with nothing to do the placer planned {} batches in 2 s ({before:?} -> {after:?})",
        after.planned - before.planned
    );
    assert_eq!(
        after.batches, before.batches,
        "nothing was written meanwhile"
    );
    placer.stop().await.unwrap();
}

/// Two placers under load, and PostgreSQL down for longer than their pool
/// leases: every lease runs out on the placers' clocks, their commits fail
/// meanwhile, and once the server is back every pool is held and placed
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_placers_place_every_pool_again_after_an_outage_longer_than_their_leases() {
    let mut cluster = testkit::temp_cluster_with(true, &[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
    let cfg: Config = url.parse().unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let pools = ["oa", "ob", "oc", "od"];
    for p in pools {
        pool(&appender, p, 8).await;
    }
    let ttl = Duration::from_secs(2);
    let placers: Vec<Placer> = ["outage-1", "outage-2"]
        .into_iter()
        .map(|h| {
            let mut pc = PlacerConfig::new(h);
            pc.lease_ttl = ttl;
            Placer::start(cfg.clone(), reader(&cfg), appender.clone(), pc)
        })
        .collect();
    let held = || {
        placers
            .iter()
            .map(|p| p.stats().pools_held.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let t = std::time::Instant::now();
    while held() < 4 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the pools were never all held"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Requests keep coming, each for a few seconds, through the outage.
    let load = {
        let (cfg, appender) = (cfg.clone(), appender.clone());
        tokio::spawn(async move {
            for i in 0u64.. {
                if let Ok(client) = events::db::connect(&cfg, "load").await {
                    let mut r = request(&format!("load-{i}"), pools[i as usize % 4], 1, Shape::Any);
                    r.ttl_ms = Some(3_000);
                    let _ = domain::requests::reserve(&client, &appender, &r, None).await;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    until_placed(&cfg, "load-40", Duration::from_secs(30)).await;

    tokio::task::block_in_place(|| cluster.crash());
    let down = std::time::Instant::now();
    while held() > 0 {
        assert!(
            down.elapsed() < Duration::from_secs(30),
            "a placer held a pool through the outage"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::task::block_in_place(|| cluster.restart()).unwrap();
    let back = std::time::Instant::now();
    for p in pools {
        let id = format!("after-{p}");
        loop {
            if let Ok(client) = events::db::connect(&cfg, "test").await {
                if domain::requests::reserve(
                    &client,
                    &appender,
                    &request(&id, p, 1, Shape::Any),
                    None,
                )
                .await
                .is_ok()
                {
                    break;
                }
            }
            assert!(
                back.elapsed() < Duration::from_secs(30),
                "no reservation after the restart"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for p in pools {
        until_placed(&cfg, &format!("after-{p}"), Duration::from_secs(30)).await;
    }
    eprintln!(
        "every pool placed again {:?} after the restart",
        back.elapsed()
    );
    load.abort();
    for p in placers {
        p.stop().await.unwrap();
    }
}

/// Waits until reservation `id` is placed (on its pool's stream).
async fn until_placed(cfg: &Config, id: &str, limit: Duration) {
    let t = std::time::Instant::now();
    loop {
        if let Ok(client) = events::db::connect(cfg, "test-placed").await {
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM strata.events WHERE type = 'reservation.placed' AND payload->>'reservation' = $1",
                    &[&id],
                )
                .await
                .map_or(0, |r| r.get(0));
            if n > 0 {
                return;
            }
        }
        assert!(t.elapsed() < limit, "{id} not placed within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reports about other nodes arriving on a pool's stream more often than
/// the placer's view of the log lags, as a region's gateways write them to
/// a loaded region, do not keep a backlog from being placed: a batch that
/// met only reports about nodes it does not name is committed on top of
/// them. Planned again instead, each plan would wait for the view to reach
/// the version that refused it, and meet newer reports again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_is_placed_while_other_nodes_report_into_its_pool_without_pause() {
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "chatty", 300).await;
    // Ten cordoned nodes whose contact comes and goes: nothing is placed
    // on them, so no batch names them.
    let fleet = domain::pools::uniform_fleet("chatty-flap", 10, C, 8, 4);
    domain::pools::join_nodes(&appender, "chatty", fleet, |_| {})
        .await
        .unwrap();
    let nodes: Vec<String> = domain::pools::uniform_fleet("chatty-flap", 10, C, 8, 4)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for n in &nodes {
        let e = Fact::NodeCordoned {
            node: n.clone(),
            reason: "flapping".into(),
        }
        .to_event();
        appender
            .append(
                &pool_stream("chatty"),
                ExpectedVersion::StreamExists,
                vec![e],
            )
            .await
            .unwrap();
    }
    // A backlog of 2,000 one-GPU requests (two full batches and more)
    // before the placer starts.
    const N: usize = 2000;
    const REPORT_GAP_MS: u64 = 20;
    for chunk in (0..N).collect::<Vec<_>>().chunks(200) {
        let appends = chunk
            .iter()
            .map(|i| {
                let id = format!("b{i}");
                events::StreamAppend {
                    stream: domain::reservation_stream(&id),
                    expected: ExpectedVersion::NoStream,
                    events: vec![
                        Fact::ReservationRequested(request(&id, "chatty", 1, Shape::Any))
                            .to_event(),
                    ],
                }
            })
            .collect();
        appender.append_batch(appends).await.unwrap();
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two writers, each appending one report at a time about a flapping
    // node, in turn.
    let reporters: Vec<_> = (0..2)
        .map(|w| {
            let (appender, stop, nodes) = (appender.clone(), stop.clone(), nodes.clone());
            tokio::spawn(async move {
                let mut written = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let node = nodes[(w * 3 + written as usize) % nodes.len()].clone();
                    let fact = match written % 2 {
                        0 => Fact::NodeContactLost { node },
                        _ => Fact::NodeContactRestored { node },
                    };
                    appender
                        .append(
                            &pool_stream("chatty"),
                            ExpectedVersion::StreamExists,
                            vec![fact.to_event()],
                        )
                        .await
                        .unwrap();
                    written += 1;
                    tokio::time::sleep(Duration::from_millis(REPORT_GAP_MS)).await;
                }
                written
            })
        })
        .collect();
    // The placer's replication stream comes over a link that delivers
    // every byte 150 ms late: its view of the pool trails the table by
    // that at least, as a busy placer's does.
    let (link, far) = testkit::cut::Cut::to_postgres(&cfg).await;
    link.slow(Duration::from_millis(150));
    let mut pc = PlacerConfig::new("chatty");
    pc.pools = Some(["chatty".to_string()].into());
    let placer = Placer::start(cfg.clone(), reader(&far), appender.clone(), pc);
    let stats = placer.stats();
    let t = std::time::Instant::now();
    let mut placed = 0;
    while placed < N as i64 && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        placed = count_on(&cfg, "pool/chatty", "reservation.placed")
            .await
            .unwrap_or(0);
    }
    stop.store(true, Ordering::Relaxed);
    let mut written = 0;
    for r in reporters {
        written += r.await.unwrap();
    }
    let v = stats.view();
    eprintln!(
        "{placed} of {N} placed in {:?} with {written} reports written beside; {v:?}",
        t.elapsed()
    );
    assert_eq!(
        placed, N as i64,
        "the backlog was not placed within 30 s: {v:?}"
    );
    check::check(&client, |_| {}).await.unwrap();
    placer.stop().await.unwrap();
}
