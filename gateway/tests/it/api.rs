//! The client API: queues configured by admins, operators only, and
//! subscriptions that respect grants and resume after acks.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_configure_queues_through_the_api_and_requests_wait_by_their_quota() {
    use gateway::api_proto::*;
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, placer) = n1_and_a_placer(&r, &gw, dir.path()).await;
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let (cert, key) = ca.issue_operator("alice", 1).unwrap();
    admin(&r, "alice").await;
    let mut alice = api_as(&r, &gw, cert, key).await;
    let (cert, key) = ca.issue_operator("bob", 1).unwrap();
    gateway::roles::set(
        &r.appender,
        "bob",
        &gateway::roles::Assignment {
            role: gateway::roles::Role::Operator,
            pools: vec!["p".into()],
        },
    )
    .await
    .unwrap();
    let mut bob = api_as(&r, &gw, cert, key).await;
    let team = |nominal: u32, create_only: bool| ConfigureQueueRequest {
        spec: Some(QueueSpec {
            pool: "p".into(),
            queue: "team".into(),
            cohort: String::new(),
            weight: 1,
            quotas: vec![Quota {
                class: "H100-80GB".into(),
                nominal,
                borrowing_limit: None,
            }],
        }),
        create_only,
    };
    // An operator of the pool may reserve in it, not set its quotas.
    let err = bob.configure_queue(team(4, true)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("only an admin"), "{err:?}");
    alice.configure_queue(team(4, true)).await.unwrap();
    let err = alice.configure_queue(team(4, true)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    let mut bad = team(4, false);
    bad.spec.as_mut().unwrap().weight = 5000;
    let err = alice.configure_queue(bad).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    let ask = |id: &str, gpus: u32, queue: &str, wait_ms: u32| ReserveRequest {
        id: id.into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus,
        queue: queue.into(),
        wait_ms,
        ..Default::default()
    };
    // The pool is shared by queues now: a request names one.
    let err = bob.reserve(ask("none", 1, "", 0)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    let err = bob.reserve(ask("typo", 1, "typo", 0)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    let placed = bob
        .reserve(ask("t-1", 4, "team", 20_000))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(placed.state, "placed", "{placed:?}");
    // Four more GPUs are free, but the team holds its whole quota.
    bob.reserve(ask("t-2", 2, "team", 0)).await.unwrap();
    let mut got = None;
    for _ in 0..200 {
        let g = bob
            .get_reservation(GetReservationRequest { id: "t-2".into() })
            .await
            .unwrap()
            .into_inner();
        if g.state == "queued" {
            got = Some(g);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let got = got.expect("t-2 queued");
    assert!(got.reason.starts_with("over quota"), "{got:?}");
    let w = got.waiting.expect("it waits");
    assert_eq!(w.queue, "team");
    assert!(w.why.contains("queue team holds 4 of its 4"), "{w:?}");
    let shares = bob
        .list_queues(ListQueuesRequest { pool: "p".into() })
        .await
        .unwrap()
        .into_inner()
        .queues;
    assert_eq!(shares.len(), 1, "{shares:?}");
    let s = &shares[0];
    assert_eq!(
        (s.queue.as_str(), s.nominal, s.used, s.waiting, s.fair),
        ("team", 4, 4, 2, 4),
        "{s:?}"
    );
    // More quota: the waiting request is placed without being asked again.
    alice.configure_queue(team(8, false)).await.unwrap();
    testkit::eventually(20, "t-2 placed under the new quota", || async {
        let mut bob = bob.clone();
        bob.get_reservation(GetReservationRequest { id: "t-2".into() })
            .await
            .is_ok_and(|g| g.into_inner().state == "placed")
    })
    .await;
    assert_eq!(
        r.count(
            "SELECT count(*) FROM strata.events WHERE type = 'queue.configured'
               AND metadata->>'operator' = 'alice'"
        )
        .await,
        2
    );
    placer.stop().await.unwrap();
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_api_serves_operators_only() {
    use gateway::api_proto::*;
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, placer) = n1_and_a_placer(&r, &gw, dir.path()).await;
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let client = |cert: String, key: String| api_as(&r, &gw, cert, key);
    // A node's certificate is not an operator's.
    let (cert, key) = ca.client_identity("n7").unwrap();
    let err = client(cert, key)
        .await
        .list_pools(ListPoolsRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");

    let (cert, key) = ca.issue_operator("alice", 1).unwrap();
    let alice = gateway::revocation::presented_pem(&cert).unwrap();
    admin(&r, "alice").await;
    let mut api = client(cert, key).await;
    let placed = api
        .reserve(ReserveRequest {
            id: "api-1".into(),
            pool: "p".into(),
            class: "H100-80GB".into(),
            gpus: 2,
            wait_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(placed.state, "placed", "{placed:?}");
    assert_eq!(placed.allocations[0].node, "n1");
    assert_eq!(placed.allocations[0].devices.len(), 2);
    // GetReservation says why one waits: 8 GPUs asked for, 6 free, nothing
    // with a time limit to free more.
    api.reserve(ReserveRequest {
        id: "api-wait".into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 8,
        ..Default::default()
    })
    .await
    .unwrap();
    let get = |id: &str| GetReservationRequest { id: id.into() };
    let mut waits = None;
    for _ in 0..200 {
        let got = api
            .get_reservation(get("api-wait"))
            .await
            .unwrap()
            .into_inner();
        if got.state == "queued" {
            waits = Some(got);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waits = waits.expect("api-wait queued");
    let w = waits
        .waiting
        .clone()
        .expect("a waiting reservation says why");
    assert_eq!((w.position, w.ahead, w.waiting), (1, 0, 1), "{w:?}");
    assert_eq!(w.free_now, 6);
    assert_eq!(w.earliest_start_ms, 0, "nothing live has a time limit");
    assert!(!waits.reason.is_empty(), "{waits:?}");
    let live = api
        .get_reservation(get("api-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(live.state, "placed");
    assert!(live.waiting.is_none());
    api.release(ReleaseRequest {
        id: "api-wait".into(),
        reason: "not needed".into(),
    })
    .await
    .unwrap();
    testkit::eventually(20, "api-wait released", || async {
        let mut api = api.clone();
        api.get_reservation(get("api-wait"))
            .await
            .is_ok_and(|g| g.into_inner().state == "released")
    })
    .await;
    let err = api.get_reservation(get("nope")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    // Two binders, started after the placement (so the one that takes the
    // lease finds it while starting up, with its stream's version): one
    // holds the lease and works, the other waits.
    let binders: Vec<_> = (0..2)
        .map(|_| binder::Binder::start(r.cfg.clone(), r.reader(), r.appender.clone()))
        .collect();
    let err = api
        .reserve(ReserveRequest {
            pool: "nope".into(),
            class: "H100-80GB".into(),
            gpus: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    let err = api
        .reserve(ReserveRequest {
            pool: "p".into(),
            class: "H100-80GB".into(),
            gpus: 1,
            shape: "ring".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    let pools = api
        .list_pools(ListPoolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .pools;
    assert_eq!(pools.len(), 1);
    assert_eq!(pools[0].classes[0].total, 8);
    assert_eq!(pools[0].live, 1);
    // The next call reads only what was appended since: a new pool.
    r.appender
        .append(
            "pool/q",
            ExpectedVersion::NoStream,
            vec![Fact::PoolCreated {
                description: String::new(),
            }
            .to_event()],
        )
        .await
        .unwrap();
    let again = api
        .list_pools(ListPoolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .pools;
    let names: Vec<&str> = again.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["p", "q"]);
    assert_eq!((again[0].classes[0].total, again[0].live), (8, 1));
    let nodes = api
        .list_nodes(ListNodesRequest { pool: "p".into() })
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert_eq!(nodes.len(), 1);
    assert!(nodes[0].session_here && !nodes[0].revoked, "{nodes:?}");
    // A node's standing: cordoned and uncordoned, the operator recorded.
    let standing = |node: &str| NodeStandingRequest {
        node: node.into(),
        reason: "firmware".into(),
        ..Default::default()
    };
    let done = api.cordon_node(standing("n1")).await.unwrap().into_inner();
    assert_eq!(done.pool, "p");
    api.uncordon_node(standing("n1")).await.unwrap();
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'pool/p' AND type IN ('node.cordoned', 'node.uncordoned') AND metadata->>'operator' = 'alice'")
            .await,
        2
    );
    let err = api.drain_node(standing("nowhere")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");

    let done = api
        .issue_command(IssueCommandRequest {
            id: "api-c1".into(),
            node: "n1".into(),
            kind: "diag.nvml".into(),
            wait_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.state, "succeeded", "{done:?}");
    assert!(done.outcome_json.contains("all GPUs pass"), "{done:?}");
    let got = api
        .get_command(GetCommandRequest {
            id: "api-c1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.state, "succeeded");
    let err = api
        .get_command(GetCommandRequest { id: "nope".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);

    // The placement is bound on n1 and becomes active once, by one binder.
    testkit::eventually(20, "api-1 becomes active", || async {
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'reservation/api-1' AND type = 'reservation.activated'").await == 1
    })
    .await;
    let activated: Vec<u64> = binders
        .iter()
        .map(|b| b.stats.activated.load(Ordering::Relaxed))
        .collect();
    assert_eq!(activated.iter().sum::<u64>(), 1, "{activated:?}");
    projections::check::check(&r.client, |_| {}).await.unwrap();
    for b in binders {
        b.stop().await.unwrap();
    }
    api.release(ReleaseRequest {
        id: "api-1".into(),
        reason: "done".into(),
    })
    .await
    .unwrap();
    let err = api
        .release(ReleaseRequest {
            id: "never".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);

    // A revoked operator certificate is refused on the connection already
    // open, within the reload interval; another certificate of the same
    // operator is not affected.
    let (cert2, key2) = ca.issue_operator("alice", 1).unwrap();
    let mut api2 = client(cert2, key2).await;
    use gateway::revocation::Target;
    let mut own = events::db::connect(&r.cfg, "revoke").await.unwrap();
    assert!(
        gateway::revocation::revoke(&mut own, Target::Certificate(&alice), "laptop lost")
            .await
            .unwrap()
    );
    assert!(
        !gateway::revocation::revoke(&mut own, Target::Serial(&alice.serial), "again")
            .await
            .unwrap()
    );
    let refused = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match api.list_pools(ListPoolsRequest {}).await {
                Err(e) => break e,
                Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    })
    .await
    .expect("the revoked certificate is refused within 10 s");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("revoked"), "{refused:?}");
    api2.list_pools(ListPoolsRequest {}).await.unwrap();
    let listed = gateway::revocation::list(&r.client).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].kind.as_deref(),
            listed[0].name.as_deref(),
            listed[0].reason.as_str()
        ),
        (Some("operator"), Some("alice"), "laptop lost")
    );
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'operator/alice' AND type = 'certificate.revoked'")
            .await,
        1
    );
    placer.stop().await.unwrap();
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_over_the_api_respect_grants_and_resume_after_acks() {
    use gateway::api_proto::{
        api_client::ApiClient, subscribe_message, SubscribeAck, SubscribeMessage, SubscribeStart,
    };
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    for i in 0..5 {
        for stream in ["pool/p", "other/x"] {
            r.appender
                .append(
                    stream,
                    ExpectedVersion::Any,
                    vec![events::NewEvent::new("t.x", &serde_json::json!({ "i": i }))],
                )
                .await
                .unwrap();
        }
    }
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let connect_as = |cert: String, key: String| {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(r.ca_pem()))
            .identity(Identity::from_pem(cert, key))
            .domain_name("localhost");
        let ep = Endpoint::from_shared(url(&gw))
            .unwrap()
            .tls_config(tls)
            .unwrap();
        async move { ApiClient::new(ep.connect().await.unwrap()) }
    };
    let connect = |name: &str| {
        let (cert, key) = ca.issue_operator(name, 1).unwrap();
        connect_as(cert, key)
    };
    let start =
        |name: &str, prefixes: Vec<String>| {
            let (tx, rx) = tokio::sync::mpsc::channel::<SubscribeMessage>(16);
            let first = SubscribeMessage {
                body: Some(subscribe_message::Body::Start(SubscribeStart {
                    name: name.into(),
                    types: vec![],
                    stream_prefixes: prefixes,
                    from: "start".into(),
                })),
            };
            tx.try_send(first).unwrap();
            let out = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|m| (m, rx))
            });
            (tx, out)
        };
    // No grant, no events.
    let mut bob = connect("bob").await;
    let (_tx, out) = start("s", vec![]);
    let err = match bob.subscribe(out).await {
        Err(s) => s,
        Ok(resp) => resp.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");

    gateway::grants::set(
        &r.appender,
        "alice",
        &gateway::grants::Grant {
            stream_prefixes: vec!["pool/".into()],
            types: vec![],
        },
    )
    .await
    .unwrap();
    let mut alice = connect("alice").await;
    // Asking outside the grant is refused.
    let (_tx, out) = start("s", vec!["other/".into()]);
    let err = match alice.subscribe(out).await {
        Err(s) => s,
        Ok(resp) => resp.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");

    // Within it: pool/ events only, in order; ack the third and leave.
    let (tx, out) = start("s", vec![]);
    let mut events = alice.subscribe(out).await.unwrap().into_inner();
    let mut got = Vec::new();
    while got.len() < 6 {
        let e = tokio::time::timeout(Duration::from_secs(20), events.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(e.stream.starts_with("pool/"), "{e:?}");
        got.push(e.position);
    }
    assert!(got.windows(2).all(|w| w[0] < w[1]));
    // A second caller stream under the same name, while this one is open,
    // is refused: events are never delivered to two streams at once.
    let (_second_tx, out) = start("s", vec![]);
    let err = match alice.subscribe(out).await {
        Err(s) => s,
        Ok(resp) => resp.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    tx.send(SubscribeMessage {
        body: Some(subscribe_message::Body::Ack(SubscribeAck {
            position: got[2],
        })),
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(tx);
    drop(events);
    // Back: it resumes after the acknowledged event.
    let mut again = None;
    for _ in 0..50 {
        let (tx, out) = start("s", vec![]);
        match alice.subscribe(out).await {
            Ok(resp) => {
                let mut s = resp.into_inner();
                match tokio::time::timeout(Duration::from_secs(20), s.message())
                    .await
                    .unwrap()
                {
                    Ok(Some(e)) => {
                        again = Some(e.position);
                        drop(tx);
                        break;
                    }
                    Ok(None) => {}
                    Err(st) if st.code() == tonic::Code::AlreadyExists => {}
                    Err(st) => panic!("{st:?}"),
                }
            }
            Err(st) if st.code() == tonic::Code::AlreadyExists => {}
            Err(st) => panic!("{st:?}"),
        }
        // The previous connection's subscription is still closing.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(again, Some(got[3]), "resumed after the last ack");

    // Revoking an operator's certificate ends the stream it has open.
    gateway::grants::set(
        &r.appender,
        "carol",
        &gateway::grants::Grant {
            stream_prefixes: vec!["pool/".into()],
            types: vec![],
        },
    )
    .await
    .unwrap();
    let (cert, key) = ca.issue_operator("carol", 1).unwrap();
    let carol_cert = gateway::revocation::presented_pem(&cert).unwrap();
    let mut carol = connect_as(cert, key).await;
    let (_tx, out) = start("c", vec![]);
    let mut stream = carol.subscribe(out).await.unwrap().into_inner();
    let first = tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .unwrap()
        .unwrap();
    assert!(first.is_some());
    let mut own = events::db::connect(&r.cfg, "revoke").await.unwrap();
    gateway::revocation::revoke(
        &mut own,
        gateway::revocation::Target::Certificate(&carol_cert),
        "left",
    )
    .await
    .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without saying why"),
                Err(status) => break status,
            }
        }
    })
    .await
    .expect("the revoked operator's stream ends within 10 s");
    assert_eq!(ended.code(), tonic::Code::PermissionDenied, "{ended:?}");
    assert!(ended.message().contains("revoked"), "{ended:?}");
    gw.stop().await.unwrap();
}

/// A Subscribe call's first message, and the sender for its acks.
fn subscribe_start(
    name: &str,
) -> (
    tokio::sync::mpsc::Sender<gateway::api_proto::SubscribeMessage>,
    impl futures_util::Stream<Item = gateway::api_proto::SubscribeMessage>,
) {
    use gateway::api_proto::{subscribe_message, SubscribeMessage, SubscribeStart};
    let (tx, rx) = tokio::sync::mpsc::channel::<SubscribeMessage>(16);
    tx.try_send(SubscribeMessage {
        body: Some(subscribe_message::Body::Start(SubscribeStart {
            name: name.into(),
            types: vec![],
            stream_prefixes: vec![],
            from: "now".into(),
        })),
    })
    .unwrap();
    let out =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    (tx, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_holds_at_most_its_cap_of_durable_subscriptions_and_deletes_its_own() {
    use gateway::api_proto::DeleteSubscriptionRequest;
    let r = region().await;
    let gw = r
        .gateway("gw-subs", |c| c.max_subscriptions_per_caller = 2)
        .await;
    gateway::grants::set(
        &r.appender,
        "dora",
        &gateway::grants::Grant {
            stream_prefixes: vec!["pool/".into()],
            types: vec![],
        },
    )
    .await
    .unwrap();
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let (cert, key) = ca.issue_operator("dora", 1).unwrap();
    let mut dora = api_as(&r, &gw, cert, key).await;
    // Two subscriptions made and left.
    for name in ["a", "b"] {
        let (tx, out) = subscribe_start(name);
        let stream = dora.subscribe(out).await.unwrap();
        drop((tx, stream));
    }
    // A third is refused, and leaves nothing behind.
    let (_tx, out) = subscribe_start("c");
    let err = match dora.subscribe(out).await {
        Err(s) => s,
        Ok(resp) => resp.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("DeleteSubscription"), "{err:?}");
    async fn names(
        dora: &mut gateway::api_proto::api_client::ApiClient<tonic::transport::Channel>,
    ) -> Vec<String> {
        dora.list_subscriptions(gateway::api_proto::ListSubscriptionsRequest {})
            .await
            .unwrap()
            .into_inner()
            .subscriptions
            .into_iter()
            .map(|s| s.name)
            .collect()
    }
    assert_eq!(names(&mut dora).await, ["a", "b"]);
    // One still open cannot be deleted; once closed it can, and a new one fits.
    let (tx, out) = subscribe_start("a");
    let open = dora.subscribe(out).await.unwrap();
    let err = dora
        .delete_subscription(DeleteSubscriptionRequest { name: "a".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    drop((tx, open));
    testkit::eventually(20, "the closed subscription is deleted", || {
        let mut dora = dora.clone();
        async move {
            dora.delete_subscription(DeleteSubscriptionRequest { name: "a".into() })
                .await
                .is_ok()
        }
    })
    .await;
    let err = dora
        .delete_subscription(DeleteSubscriptionRequest { name: "a".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    let (_tx, out) = subscribe_start("c");
    let mut c = dora.subscribe(out).await.unwrap().into_inner();
    assert_eq!(names(&mut dora).await, ["b", "c"]);
    // A stopping gateway ends the open stream, so the caller goes to
    // another, and stops without waiting for the caller to leave.
    gw.stop().await.unwrap();
    let err = loop {
        match c.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without a status"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
}
