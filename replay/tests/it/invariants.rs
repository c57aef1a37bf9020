//! The invariant checker against a real log: a clean one passes, and each
//! kind of breakage (a double booking, an activation after the end, a
//! command ended twice, a position gap) is named with its positions.

use super::*;
use replay::invariants;

fn ev(t: &str, payload: serde_json::Value) -> NewEvent {
    NewEvent::new(t, &payload)
}

/// A client of a fresh database of the shared cluster, and an appender.
async fn fresh_log() -> (tokio_postgres::Client, Appender) {
    let url = testkit::migrated_database(testkit::shared_cluster()).await;
    let db = connect(&url).await;
    let a = Appender::start(
        url.parse::<tokio_postgres::Config>().unwrap(),
        AppenderConfig::default(),
    );
    (db, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_passes_a_clean_log_and_names_each_violation() {
    let (db, a) = fresh_log().await;
    let placed = |r: &str, devices: &[&str]| {
        ev(
            "reservation.placed",
            serde_json::json!({ "reservation": r, "allocations": [{ "node": "n1", "devices": devices }] }),
        )
    };
    a.append(
        "pool/p",
        ExpectedVersion::NoStream,
        vec![ev("pool.created", serde_json::json!({ "description": "" }))],
    )
    .await
    .unwrap();
    a.append(
        "pool/p",
        ExpectedVersion::Any,
        vec![placed("r1", &["g0", "g1"])],
    )
    .await
    .unwrap();
    a.append(
        "pool/p",
        ExpectedVersion::Any,
        vec![ev(
            "reservation.released",
            serde_json::json!({ "reservation": "r1" }),
        )],
    )
    .await
    .unwrap();
    // g1 is free again: placing it is fine.
    a.append("pool/p", ExpectedVersion::Any, vec![placed("r2", &["g1"])])
        .await
        .unwrap();
    let c = domain::commands::Command {
        id: "c1".into(),
        node: "n1".into(),
        kind: "diag.nvml".into(),
        args: serde_json::json!({}),
        deadline_ms: u64::MAX / 2,
        issued_by: "cli:test".into(),
    };
    domain::commands::issue(&a, &c).await.unwrap();
    a.append(
        "command/c1",
        ExpectedVersion::Any,
        vec![ev(domain::commands::SUCCEEDED, serde_json::json!({}))],
    )
    .await
    .unwrap();
    let clean = invariants::check(&db).await.unwrap();
    assert_eq!(clean.violations, [], "{clean:?}");
    assert_eq!(clean.placements, 2);

    // A device booked twice: r3 takes g1 while r2 holds it.
    a.append("pool/p", ExpectedVersion::Any, vec![placed("r3", &["g1"])])
        .await
        .unwrap();
    // A reservation activated after its end.
    a.append(
        "reservation/r4",
        ExpectedVersion::Any,
        vec![
            ev(
                "reservation.ended",
                serde_json::json!({ "reservation": "r4", "outcome": "released" }),
            ),
            ev(
                "reservation.activated",
                serde_json::json!({ "reservation": "r4" }),
            ),
        ],
    )
    .await
    .unwrap();
    // A command that ended twice.
    a.append(
        "command/c1",
        ExpectedVersion::Any,
        vec![ev(domain::commands::FAILED, serde_json::json!({}))],
    )
    .await
    .unwrap();
    // A row written past the appender, leaving a gap.
    let max: i64 = db
        .query_one("SELECT max(position) FROM strata.events", &[])
        .await
        .unwrap()
        .get(0);
    db.execute(
        "INSERT INTO strata.events (position, stream, version, type, payload) VALUES ($1, 'forged', 1, 'x', '{}')",
        &[&(max + 5)],
    )
    .await
    .unwrap();
    let report = invariants::check(&db).await.unwrap();
    let kinds: Vec<&str> = report.violations.iter().map(|v| v.invariant).collect();
    assert_eq!(
        kinds,
        [
            "positions",
            "double_booking",
            "active_after_end",
            "commands"
        ],
        "{report:#?}"
    );
    let of = |k: &str| {
        report
            .violations
            .iter()
            .find(|v| v.invariant == k)
            .unwrap()
            .clone()
    };
    assert_eq!(of("positions").positions, [max + 5]);
    let positions = |stream: &str, t: &str| {
        let (db, stream, t) = (&db, stream.to_string(), t.to_string());
        async move {
            db.query(
                "SELECT position FROM strata.events WHERE stream = $1 AND type = $2 ORDER BY position",
                &[&stream, &t],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<_, i64>(0))
            .collect::<Vec<i64>>()
        }
    };
    let placed_at = positions("pool/p", "reservation.placed").await;
    assert_eq!(of("double_booking").positions, [placed_at[1], placed_at[2]]);
    assert!(
        of("double_booking").detail.contains("r3"),
        "{:?}",
        of("double_booking")
    );
    let ended = positions("reservation/r4", "reservation.ended").await;
    let active = positions("reservation/r4", "reservation.activated").await;
    assert_eq!(of("active_after_end").positions, [ended[0], active[0]]);
    let succeeded = positions("command/c1", domain::commands::SUCCEEDED).await;
    let failed = positions("command/c1", domain::commands::FAILED).await;
    assert_eq!(of("commands").positions, [succeeded[0], failed[0]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_folded_in_steps_agree_with_one_fold_of_the_whole_log() {
    let (db, a) = fresh_log().await;
    let placed = |r: &str, node: &str, devices: &[&str]| {
        ev(
            "reservation.placed",
            serde_json::json!({ "reservation": r, "allocations": [{ "node": node, "devices": devices }] }),
        )
    };
    let live = |p: &invariants::Placements| {
        p.live()
            .into_iter()
            .map(|(n, rs)| (n, rs.into_iter().collect::<Vec<_>>()))
            .collect::<Vec<_>>()
    };
    a.append(
        "pool/p",
        ExpectedVersion::NoStream,
        vec![placed("r1", "n1", &["g0", "g1"])],
    )
    .await
    .unwrap();
    let mut steps = invariants::Placements::default();
    steps.catch_up(&db).await.unwrap();
    assert_eq!(live(&steps), [("n1".to_string(), vec!["r1".to_string()])]);
    // The release comes after the fold that saw the placement: the fold
    // remembers what r1 held.
    a.append(
        "pool/p",
        ExpectedVersion::Any,
        vec![
            ev(
                "reservation.released",
                serde_json::json!({ "reservation": "r1" }),
            ),
            placed("r2", "n2", &["g0"]),
        ],
    )
    .await
    .unwrap();
    steps.catch_up(&db).await.unwrap();
    assert_eq!(live(&steps), [("n2".to_string(), vec!["r2".to_string()])]);
    let whole = invariants::live_allocations(&db).await.unwrap();
    assert_eq!(steps.live(), whole);
    // Nothing new: a further step changes nothing.
    steps.catch_up(&db).await.unwrap();
    assert_eq!(steps.live(), whole);
}
