//! `GetUsage` through the client API, scoped by role: an admin sees every
//! pool, an operator its pools, a viewer its own reservations; the usage
//! role keeps the rollups in the same process.

use super::*;
use gateway::api_proto::*;
use gateway::roles::Role;

/// Owner to GPU-hours, as `who` sees them.
async fn owners(
    api: &mut api_client::ApiClient<tonic::transport::Channel>,
    pools: &[&str],
) -> Result<Vec<(String, f64)>, tonic::Status> {
    let r = api
        .get_usage(GetUsageRequest {
            since_unix_ms: 0,
            until_unix_ms: 0,
            by: vec!["owner".into()],
            pools: pools.iter().map(|p| p.to_string()).collect(),
        })
        .await?
        .into_inner();
    Ok(r.rows
        .iter()
        .map(|row| (row.keys[0].clone(), row.held_gpu_hours + row.gpu_hours))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_seen_by_each_role_within_its_scope() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let (_n, _placer) = n1_and_a_placer(&r, &gw, dir.path()).await;
    ops::task::spawn(
        "usage",
        projections::usage::keeper::run(r.reader(), r.cfg.clone().into()),
    );
    let ca = Ca::load(r.ca_dir.path()).unwrap();
    let connect = |name: &str| {
        let (cert, key) = ca.issue_operator(name, 1).unwrap();
        api_as(&r, &gw, cert, key)
    };
    role(&r, "alice", Role::Operator, &["p"]).await;
    role(&r, "bob", Role::Operator, &["p"]).await;
    role(&r, "erin", Role::Operator, &["q"]).await;
    role(&r, "root", Role::Admin, &[]).await;
    let (mut alice, mut bob, mut erin, mut dave, mut root) = (
        connect("alice").await,
        connect("bob").await,
        connect("erin").await,
        connect("dave").await,
        connect("root").await,
    );
    for (api, id, gpus) in [(&mut alice, "r-alice", 2), (&mut bob, "r-bob", 1)] {
        let placed = api
            .reserve(ReserveRequest {
                id: id.into(),
                pool: "p".into(),
                class: "H100-80GB".into(),
                gpus,
                wait_ms: 20_000,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(placed.state, "placed", "{placed:?}");
    }
    // Both reservations hold their GPUs from placement on: the rollups'
    // keeper has them once it caught up, counted up to now.
    testkit::eventually(30, "root sees both owners' usage", || {
        let mut root = root.clone();
        async move {
            let seen = owners(&mut root, &[]).await.unwrap();
            seen.len() == 2 && seen.iter().all(|(_, h)| *h > 0.0)
        }
    })
    .await;
    let seen = owners(&mut root, &[]).await.unwrap();
    let names = |v: &[(String, f64)]| v.iter().map(|(o, _)| o.clone()).collect::<Vec<_>>();
    let mut both = names(&seen);
    both.sort();
    assert_eq!(both, ["alice", "bob"]);
    // An operator of the pool sees both; one of another pool nothing, and
    // is refused the pool by name.
    let mut of_p = names(&owners(&mut alice, &[]).await.unwrap());
    of_p.sort();
    assert_eq!(of_p, ["alice", "bob"]);
    assert!(owners(&mut erin, &[]).await.unwrap().is_empty());
    let e = owners(&mut erin, &["p"]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // A viewer sees its own reservations only, and no breakdown by node.
    role(&r, "bob", Role::Viewer, &[]).await;
    assert_eq!(names(&owners(&mut bob, &[]).await.unwrap()), ["bob"]);
    let e = bob
        .get_usage(GetUsageRequest {
            by: vec!["node".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // Without a role, nothing.
    let e = owners(&mut dave, &[]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // Bad grouping is a clear error.
    let e = root
        .get_usage(GetUsageRequest {
            by: vec!["team".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
}
