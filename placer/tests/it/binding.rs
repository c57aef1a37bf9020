//! The binder beside the placer: a node's binds answered (or not), a
//! crash restart of PostgreSQL under both, releases sent to nodes by a
//! binder started after them, binds tried again or refused, activations
//! that never land after a reservation's end, activations the database
//! refuses for a moment tried again, and a standby binder that follows the
//! log before it takes over.

use super::*;

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
                    &domain::reservation_stream(&id),
                    ExpectedVersion::Exact(seen),
                    vec![Fact::ReservationActivated { reservation: id }.to_event()],
                )
                .await
        }
    };

    // Released: the binder saw the release request, not yet the release.
    domain::requests::reserve(
        &client,
        &appender,
        &request("rel", "fence", 8, Shape::Node),
        None,
    )
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
            vec![Fact::ReservationReleaseRequested {
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
    domain::requests::reserve(&client, &appender, &r, None)
        .await
        .unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placer_and_binder_survive_a_postgres_crash_restart() {
    let mut cluster = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&cluster).await;
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
    domain::requests::reserve(
        &client,
        &appender,
        &request("before", "crash", 8, Shape::Node),
        None,
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
        match domain::requests::reserve(
            &client,
            &appender,
            &request("after", "crash", 8, Shape::Node),
            None,
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
    domain::requests::release(&appender, "before", "done", None)
        .await
        .unwrap();
    until_on(&cfg, "reservation/before", "reservation.ended", 30).await;
    domain::requests::reserve(
        &client,
        &appender,
        &request("later", "crash", 8, Shape::Node),
        None,
    )
    .await
    .unwrap();
    until_on(&cfg, "reservation/later", "reservation.activated", 30).await;
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (2, 16));
    // The binder went on from the index it had: it read the whole log once,
    // at its start, not again after the restart.
    let stat = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        stat(&binder.stats.restarts) > 0,
        "the binder never restarted"
    );
    assert_eq!(
        stat(&binder.stats.folds),
        1,
        "the binder folded the whole log again"
    );
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
        domain::requests::reserve(
            &client,
            &appender,
            &request(id, "leak", 8, Shape::Node),
            None,
        )
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
    domain::requests::release(&appender, "l1", "done", None)
        .await
        .unwrap();
    domain::requests::release(&appender, "l2", "done", None)
        .await
        .unwrap();
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
            domain::commands::EXPIRED
        } else if id.starts_with("bind:bad:") {
            domain::commands::FAILED
        } else {
            domain::commands::SUCCEEDED
        }
    });
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    for id in ["slow", "bad"] {
        domain::requests::reserve(
            &client,
            &appender,
            &request(id, "binds", 8, Shape::Node),
            None,
        )
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
                domain::requests::reserve(
                    &client,
                    &appender,
                    &request(&id, "race", 2, Shape::Any),
                    None,
                )
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
                domain::requests::release(&appender, &id, "done", None)
                    .await
                    .unwrap();
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
async fn an_activation_the_database_refuses_for_a_moment_is_tried_again() {
    // Every node bound the reservation, and the database turns the
    // activation away with a retryable error (a serialization failure)
    // twice: the binder tries again, at the same fence, until it lands,
    // with no restart of its own.
    let (cfg, client) = db().await;
    client
        .batch_execute(
            "CREATE SEQUENCE refused_activations;
             CREATE FUNCTION refuse_activations() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.type = 'reservation.activated' AND nextval('refused_activations') <= 2 THEN
                 RAISE EXCEPTION 'activation refused for a moment' USING ERRCODE = '40001';
               END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_activations BEFORE INSERT ON strata.events
               FOR EACH ROW EXECUTE FUNCTION refuse_activations();",
        )
        .await
        .unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "refused", 2).await;
    let reader = reader(&cfg);
    let placer = Placer::start(
        cfg.clone(),
        reader.clone(),
        appender.clone(),
        PlacerConfig::new("refused"),
    );
    let node = answer_binds(reader.clone(), appender.clone());
    let binder = binder::Binder::start(cfg.clone(), reader.clone(), appender.clone());
    domain::requests::reserve(
        &client,
        &appender,
        &request("r1", "refused", 8, Shape::Node),
        None,
    )
    .await
    .unwrap();
    until_on(&cfg, "reservation/r1", "reservation.activated", 30).await;
    let refused: i64 = client
        .query_one("SELECT last_value FROM refused_activations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(refused, 3, "two refusals, then the activation that landed");
    assert_eq!(
        binder
            .stats
            .restarts
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the binder restarted instead of trying the activation again"
    );
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (1, 8));
    node.abort();
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_binder_follows_the_log_and_takes_over_from_where_it_is() {
    // A second binder stands by while the first binds: it folds the log and
    // follows it before it holds the lease, so a takeover starts from the
    // present instead of reading the whole log first.
    let (cfg, client) = db().await;
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    pool(&appender, "standby", 4).await;
    let reader_a = reader(&cfg);
    let placer = Placer::start(
        cfg.clone(),
        reader_a.clone(),
        appender.clone(),
        PlacerConfig::new("standby"),
    );
    let node = answer_binds(reader_a.clone(), appender.clone());
    let a = binder::Binder::start_as(
        cfg.clone(),
        reader_a.clone(),
        appender.clone(),
        "binder-a".into(),
    );
    let reserve = |id: String| {
        let (client, appender) = (&client, &appender);
        async move {
            domain::requests::reserve(
                client,
                appender,
                &request(&id, "standby", 8, Shape::Node),
                None,
            )
            .await
            .unwrap();
        }
    };
    reserve("s1".into()).await;
    until_on(&cfg, "reservation/s1", "reservation.activated", 30).await;
    let b = binder::Binder::start_as(
        cfg.clone(),
        reader(&cfg),
        appender.clone(),
        "binder-b".into(),
    );
    // Reservations come and go until the standby has followed one of them
    // (it may fold the first ones into its index before it follows).
    let standby = || {
        b.stats
            .standby_events
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    for i in 0.. {
        assert!(
            i < 20,
            "the standby binder applied no event while the other held the lease"
        );
        let id = format!("s2-{i}");
        reserve(id.clone()).await;
        let stream = format!("reservation/{id}");
        until_on(&cfg, &stream, "reservation.activated", 30).await;
        domain::requests::release(&appender, &id, "done", None)
            .await
            .unwrap();
        until_on(&cfg, &stream, "reservation.ended", 30).await;
        if standby() > 0 {
            break;
        }
    }
    assert_eq!(
        b.stats.activated.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the standby activated a reservation without the lease"
    );
    // The first binder stops (its lease is given back): the standby takes
    // over and binds the next reservation.
    a.stop().await.unwrap();
    reserve("s3".into()).await;
    until_on(&cfg, "reservation/s3", "reservation.activated", 30).await;
    assert_eq!(
        b.stats.activated.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let report = check::check(&client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (2, 16));
    node.abort();
    b.stop().await.unwrap();
    placer.stop().await.unwrap();
}
