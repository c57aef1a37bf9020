//! Two operators and more through the client API: each may do only what
//! its role is for, the refusals say why, and the log records who asked.

use super::*;
use gateway::api_proto::*;
use gateway::roles::{self, Role};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_act_only_within_their_roles_and_the_log_records_who_asked() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (n, placer) = n1_and_a_placer(&r, &gw, dir.path()).await;
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let connect = |name: &str| {
        let (cert, key) = ca.issue_operator(name, 1).unwrap();
        api_as(&r, &gw, cert, key)
    };
    role(&r, "alice", Role::Operator, &["p"]).await;
    role(&r, "bob", Role::Operator, &["p"]).await;
    role(&r, "erin", Role::Operator, &["q"]).await;
    role(&r, "carol", Role::Viewer, &[]).await;
    role(&r, "root", Role::Admin, &[]).await;
    let (mut alice, mut bob, mut erin, mut carol, mut dave, mut root) = (
        connect("alice").await,
        connect("bob").await,
        connect("erin").await,
        connect("carol").await,
        connect("dave").await,
        connect("root").await,
    );
    let denied = |e: tonic::Status, says: &str| {
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains(says), "{e:?}");
    };
    let placed = alice
        .reserve(ReserveRequest {
            id: "r-alice".into(),
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
    // Bob cannot release Alice's reservation.
    let release = |id: &str| ReleaseRequest {
        id: id.into(),
        reason: "mine now".into(),
    };
    denied(
        bob.release(release("r-alice")).await.unwrap_err(),
        "operator alice",
    );
    // Nobody issues Strata's own command kinds, not even an admin.
    for (who, api) in [("bob", &mut bob), ("root", &mut root)] {
        for kind in ["allocation.bind", "allocation.release"] {
            let e = api
                .issue_command(IssueCommandRequest {
                    node: "n1".into(),
                    kind: kind.into(),
                    args_json: r#"{"reservation": "r-alice", "devices": ["GPU-0"]}"#.into(),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(
                e.code(),
                tonic::Code::PermissionDenied,
                "{who} {kind}: {e:?}"
            );
        }
        // Nor takes an id in the binder's id spaces, whatever the kind.
        for id in [
            "bind:r-alice:n1",
            "rebind:1:r-alice:n1",
            "release:r-alice:n1",
            "preempting:r-alice:n1",
        ] {
            let e = api
                .issue_command(IssueCommandRequest {
                    id: id.into(),
                    node: "n1".into(),
                    kind: "diag.nvml".into(),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{who} {id}: {e:?}");
            assert!(e.message().contains("only the binder"), "{e:?}");
        }
    }
    // A viewer reads and does nothing else; no role, nothing at all.
    carol.list_pools(ListPoolsRequest {}).await.unwrap();
    denied(
        carol
            .reserve(ReserveRequest {
                pool: "p".into(),
                class: "H100-80GB".into(),
                gpus: 1,
                ..Default::default()
            })
            .await
            .unwrap_err(),
        "viewer",
    );
    denied(
        dave.list_pools(ListPoolsRequest {}).await.unwrap_err(),
        "has no role",
    );
    // An operator of another pool cannot touch this one's nodes.
    let standing = NodeStandingRequest {
        node: "n1".into(),
        reason: "mine".into(),
        ..Default::default()
    };
    denied(
        erin.cordon_node(standing.clone()).await.unwrap_err(),
        "not in \"p\"",
    );
    denied(
        erin.issue_command(IssueCommandRequest {
            node: "n1".into(),
            kind: "diag.nvml".into(),
            ..Default::default()
        })
        .await
        .unwrap_err(),
        "not in \"p\"",
    );
    // What they may do, they do, and the log says who asked.
    bob.cordon_node(standing.clone()).await.unwrap();
    bob.uncordon_node(standing).await.unwrap();
    let done = bob
        .issue_command(IssueCommandRequest {
            id: "c-bob".into(),
            node: "n1".into(),
            kind: "diag.nvml".into(),
            wait_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.state, "succeeded", "{done:?}");
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'command/c-bob' AND type = 'command.issued' AND payload->>'issued_by' = 'operator:bob'")
            .await,
        1
    );
    alice.release(release("r-alice")).await.unwrap();
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'reservation/r-alice' AND type = 'reservation.release_requested' AND metadata->>'operator' = 'alice'")
            .await,
        1
    );
    // Nothing bob or root tried reached the node as a command.
    assert_eq!(
        r.count("SELECT count(*) FROM strata.events WHERE type = 'command.issued' AND payload->>'kind' LIKE 'allocation.%' AND payload->>'issued_by' <> 'strata:binder'")
            .await,
        0
    );
    // An admin may release anyone's; a removed role takes everything away.
    let theirs = bob
        .reserve(ReserveRequest {
            id: "r-bob".into(),
            pool: "p".into(),
            class: "H100-80GB".into(),
            gpus: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(theirs.id, "r-bob");
    root.release(release("r-bob")).await.unwrap();
    roles::remove(&r.appender, "bob").await.unwrap();
    denied(
        bob.list_pools(ListPoolsRequest {}).await.unwrap_err(),
        "has no role",
    );
    let listed: Vec<(String, Role)> = roles::list(&r.client)
        .await
        .unwrap()
        .into_iter()
        .map(|(n, a)| (n, a.role))
        .collect();
    assert_eq!(
        listed,
        [
            ("alice".to_string(), Role::Operator),
            ("carol".into(), Role::Viewer),
            ("erin".into(), Role::Operator),
            ("root".into(), Role::Admin)
        ]
    );
    // A certificate the issuing intermediate signed (a gateway's key, were
    // it stolen) names no operator, whatever role the name has.
    role(&r, "mallory", Role::Admin, &[]).await;
    let (cert, key) = minted_with_issuing_key(r.ca_dir.path(), "mallory");
    let mut mallory = api_as(&r, &gw, cert, key).await;
    denied(
        mallory.list_pools(ListPoolsRequest {}).await.unwrap_err(),
        "root CA",
    );
    placer.stop().await.unwrap();
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

/// An operator-shaped certificate signed with the issuing intermediate's
/// key, as whoever held a gateway's CA folder could make one.
fn minted_with_issuing_key(dir: &std::path::Path, name: &str) -> (String, String) {
    use rcgen::{CertificateParams, ExtendedKeyUsagePurpose, Issuer, KeyPair, SanType};
    let issuing = std::fs::read_to_string(dir.join(gateway::ca::ISSUING_CERT)).unwrap();
    let issuing_key =
        KeyPair::from_pem(&std::fs::read_to_string(dir.join(gateway::ca::ISSUING_KEY)).unwrap())
            .unwrap();
    let issuer = Issuer::from_ca_cert_pem(&issuing, issuing_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.subject_alt_names = vec![SanType::URI(
        format!("urn:strata:operator:{name}").try_into().unwrap(),
    )];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &issuer).unwrap();
    (cert.pem() + &issuing, key.serialize_pem())
}
