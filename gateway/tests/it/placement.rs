//! What nodes' faults do to placement: a preempted reservation's node is
//! told, XID and ECC conditions make a device unschedulable, dead and
//! revoked nodes take nothing new and their reservations fail.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_reservations_node_is_told_and_released_after_the_grace_period() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let n = start(joining(&r, &gw, dir.path(), "n1").await);
    testkit::eventually(20, "n1's inventory is in the pool", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'node.joined'")
            .await
            == 1
    })
    .await;
    // Only a pool shared by queues preempts: one team, the whole pool.
    let spec = domain::QueueSpec {
        queue: "team".into(),
        cohort: None,
        weight: 1,
        quotas: vec![domain::Quota {
            class: "H100-80GB".into(),
            nominal: 8,
            borrowing_limit: None,
        }],
        budgets: Vec::new(),
        max_run_ms: None,
    };
    domain::queues::configure(
        &r.client,
        &r.appender,
        "p",
        "team",
        &|_| Ok(spec.clone()),
        None,
    )
    .await
    .unwrap();
    let mut pc = placer::PlacerConfig::new("preempt-test");
    pc.preemption_grace = Duration::from_secs(1);
    let placer = placer::Placer::start(r.cfg.clone(), r.reader(), r.appender.clone(), pc);
    let binder = binder::Binder::start(r.cfg.clone(), r.reader(), r.appender.clone());
    let whole = |id: &str, priority: i32| domain::Request {
        reservation: id.into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 8,
        shape: domain::Shape::Node,
        priority,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        start_ms: None,
        queue: Some("team".into()),
    };
    let count = |sql: String| {
        let r = &r;
        async move { r.count(&sql).await }
    };
    domain::requests::reserve(&r.client, &r.appender, &whole("low", 0), None)
        .await
        .unwrap();
    testkit::eventually(20, "low is bound on n1 and active", || async {
        count("SELECT count(*) FROM strata.events WHERE type = 'reservation.activated' AND payload->>'reservation' = 'low'".into()).await == 1
    })
    .await;
    domain::requests::reserve(&r.client, &r.appender, &whole("high", 5), None)
        .await
        .unwrap();
    // The node hears of it while low still holds its devices.
    let marker = dir
        .path()
        .join("n1")
        .join("allocations")
        .join("low.preempting");
    testkit::eventually(20, "n1 is told low is preempted", || async {
        count("SELECT count(*) FROM strata.events WHERE stream = 'command/preempting:low:n1' AND type = 'command.succeeded'".into()).await == 1
    })
    .await;
    let told: serde_json::Value = match std::fs::read_to_string(&marker) {
        Ok(text) => serde_json::from_str(&text).unwrap(),
        // The grace period may be over already: then it was released.
        Err(_) => serde_json::json!({"by": "high", "reason": "priority"}),
    };
    assert_eq!(
        (told["by"].as_str(), told["reason"].as_str()),
        (Some("high"), Some("priority")),
        "{told}"
    );
    // Once it is over, low's binding is released and high's bound.
    testkit::eventually(20, "high is active on n1", || async {
        count("SELECT count(*) FROM strata.events WHERE type = 'reservation.activated' AND payload->>'reservation' = 'high'".into()).await == 1
    })
    .await;
    testkit::eventually(20, "n1 holds high alone", || async {
        node::allocation::bound_reservations(&dir.path().join("n1"))
            .into_iter()
            .collect::<Vec<_>>()
            == ["high"]
    })
    .await;
    assert!(!marker.exists(), "the release removes the notice");
    assert_eq!(
        count("SELECT count(*) FROM strata.events WHERE type = 'reservation.preempted' AND payload->>'reservation' = 'low' AND payload->>'by' = 'high'".into()).await,
        1
    );
    projections::check::check(&r.client, |_| {}).await.unwrap();
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_and_ecc_conditions_reach_the_pool_and_make_the_device_unschedulable() {
    use node::gpu::{GpuBackend, HealthChange};
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, fake) = joined_with_fake_gpus(&r, &gw, dir.path()).await;
    let gpu3 = fake.inventory().unwrap()[3].id.clone();
    fake.inject(HealthChange {
        device: Some(gpu3.clone()),
        condition: "XID-79".into(),
        detail: "fell off the bus".into(),
        cleared: false,
    });
    fake.inject(HealthChange {
        device: None,
        condition: "ECC-uncorrected".into(),
        detail: String::new(),
        cleared: false,
    });
    testkit::eventually(20, "both conditions are in the pool stream", || async {
        r.count(
            "SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type = 'health.raised'",
        )
        .await
            == 2
    })
    .await;
    let index = projections::projector::build(&r.client, projections::Index::new())
        .await
        .unwrap();
    let node = &index.pool("p").unwrap().nodes["n1"];
    assert_eq!(node.conditions, ["ECC-uncorrected"]);
    let (_, dev) = node.device(&gpu3).unwrap();
    assert_eq!(dev.conditions, ["XID-79"]);
    assert!(!node.schedulable());
    // Statuses are written when they change: ready, then degraded (once,
    // or twice when a health poll fell between the two injections and saw
    // the XID alone: the second names the ECC error).
    testkit::eventually(20, "the degraded status is written", || async {
        r.count(
            "SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.status_reported' AND payload->>'state' = 'degraded'",
        )
        .await
            >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let states: Vec<String> = r
        .client
        .query(
            "SELECT payload->>'state' FROM strata.events WHERE stream = 'node/n1' AND type = 'node.status_reported' ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(states[0], "ready");
    assert!(
        (2..=3).contains(&states.len()) && states[1..].iter().all(|s| s == "degraded"),
        "{states:?}"
    );
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_and_revoked_nodes_take_no_new_placements_and_their_reservations_fail() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = std::collections::HashMap::new();
    let mut configs = std::collections::HashMap::new();
    for name in ["n1", "n2"] {
        let mut c = config(vec![url(&gw)], dir.path(), name);
        c.token = Some(r.token().await);
        c.ca_pem = Some(r.ca_pem());
        configs.insert(name, c.clone());
        nodes.insert(name, start(c));
    }
    testkit::eventually(20, "both nodes joined the pool", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'node.joined'")
            .await
            == 2
    })
    .await;
    let mut pc = placer::PlacerConfig::new("lifecycle");
    pc.node_lost_after = Duration::from_secs(1);
    let placer = placer::Placer::start(r.cfg.clone(), r.reader(), r.appender.clone(), pc);
    let binder = binder::Binder::start(r.cfg.clone(), r.reader(), r.appender.clone());
    let whole = |id: &str| domain::Request {
        reservation: id.into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 8,
        shape: domain::Shape::Node,
        priority: 0,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        start_ms: None,
        queue: None,
    };
    for id in ["a", "b"] {
        domain::requests::reserve(&r.client, &r.appender, &whole(id), None)
            .await
            .unwrap();
    }
    for id in ["a", "b"] {
        let sql = format!("SELECT count(*) FROM strata.events WHERE stream = 'reservation/{id}' AND type = 'reservation.activated'");
        testkit::eventually(20, "both reservations are active", || async {
            r.count(&sql).await == 1
        })
        .await;
    }
    let on_a = placed_on(&r, "a").await.unwrap();
    let on_b = placed_on(&r, "b").await.unwrap();
    assert_ne!(on_a, on_b);

    // The daemon of a's node dies: its heartbeats stop, the gateway marks
    // it lost in the pool, and a fails once it stays lost past the bound.
    nodes.remove(on_a.as_str()).unwrap().stop().await.unwrap();
    let lost = format!(
        "SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type = 'node.contact_lost' AND payload->>'node' = '{on_a}'"
    );
    testkit::eventually(20, "the pool hears the node is lost", || async {
        r.count(&lost).await == 1
    })
    .await;
    testkit::eventually(20, "a fails with node_lost", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reservation' = 'a' AND payload->>'reason' = 'node_lost'").await == 1
    })
    .await;
    // Its node is free now, but out of contact: a new request waits.
    domain::requests::reserve(&r.client, &r.appender, &whole("c"), None)
        .await
        .unwrap();
    testkit::eventually(20, "c is queued", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'reservation.queued' AND payload->>'reservation' = 'c'").await == 1
    })
    .await;

    // b's node is revoked: it leaves the pool, b fails at once.
    let mut admin = events::db::connect(&r.cfg, "admin").await.unwrap();
    identity::revoke(&mut admin, &on_b, "stolen").await.unwrap();
    testkit::eventually(20, "b fails with node_revoked", || async {
        r.count("SELECT count(*) FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reservation' = 'b' AND payload->>'reason' = 'node_revoked'").await == 1
    })
    .await;
    let report = projections::check::check(&r.client, |_| {}).await.unwrap();
    assert_eq!((report.live, report.booked_devices), (0, 0), "{report:?}");
    assert_eq!(
        placed_on(&r, "c").await,
        None,
        "c went to a lost or revoked node"
    );

    // The dead node comes back: contact is restored in the pool, c is placed
    // there, and a's binding is released on the node.
    nodes.insert(on_a.as_str(), start(configs[on_a.as_str()].clone()));
    testkit::eventually(20, "c is placed on the node that came back", || async {
        placed_on(&r, "c").await.as_deref() == Some(on_a.as_str())
    })
    .await;
    let released = format!(
        "SELECT count(*) FROM strata.events WHERE stream = 'command/release:a:{on_a}' AND type = 'command.succeeded'"
    );
    let t = std::time::Instant::now();
    while r.count(&released).await != 1 {
        if t.elapsed() > Duration::from_secs(20) {
            let rows = r
                .client
                .query("SELECT stream, type, payload::text FROM strata.events WHERE stream LIKE 'command/%a%' ORDER BY position", &[])
                .await
                .unwrap();
            let rows: Vec<(String, String, String)> = rows
                .iter()
                .map(|x| (x.get(0), x.get(1), x.get(2)))
                .collect();
            panic!("a's binding was not released on its node: {rows:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What the node holds bound is what the log has live on it: c alone.
    let bound_on = |node: &str| -> Vec<String> {
        node::allocation::bound_reservations(&dir.path().join(node))
            .into_iter()
            .collect()
    };
    testkit::eventually(20, "the node's bindings match the log", || async {
        bound_on(&on_a) == ["c"]
    })
    .await;
    let index = projections::projector::build(&r.client, projections::Index::new())
        .await
        .unwrap();
    let live_on_a: Vec<&str> = index
        .state()
        .reservations
        .values()
        .filter(|res| res.phase.is_live() && res.allocations.iter().any(|a| a.node == on_a))
        .map(|res| res.request.reservation.as_str())
        .collect();
    assert_eq!(live_on_a, ["c"]);
    projections::check::check(&r.client, |_| {}).await.unwrap();
    binder.stop().await.unwrap();
    placer.stop().await.unwrap();
    for (name, n) in nodes {
        let stopped = n.stop().await;
        if name == on_b {
            // The revoked node's daemon was refused and ended by itself.
            assert!(stopped.unwrap_err().to_string().contains("revoked"));
        } else {
            stopped.unwrap();
        }
    }
    gw.stop().await.unwrap();
}

/// A binder whose runtime's workers are all held longer than its lease's
/// time to live (5 s) keeps its lease: the renewals run on a thread of their
/// own. In one loop with its work the renewal waited, the lease lapsed and
/// the binder stopped and caught up again (three times in a 10,000-node
/// power cycle).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binder_whose_workers_are_all_busy_keeps_its_lease() {
    let r = region().await;
    let binder = binder::Binder::start(r.cfg.clone(), r.reader(), r.appender.clone());
    let epoch = || async {
        r.count("SELECT coalesce((SELECT epoch FROM strata.leases WHERE name = 'binder' AND expires_at > now()), 0)")
            .await
    };
    testkit::eventually(20, "the binder holds its lease", || async {
        epoch().await > 0
    })
    .await;
    let held = epoch().await;
    let busy: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async { std::thread::sleep(Duration::from_secs(7)) }))
        .collect();
    for b in busy {
        b.await.unwrap();
    }
    assert_eq!(epoch().await, held, "the lease lapsed or was taken again");
    binder.stop().await.unwrap();
}
