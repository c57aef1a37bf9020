//! Backfill end to end: a gang waiting for two whole nodes, a real placer,
//! and smaller requests behind it that may use only what the gang will not
//! need, or what they give back before its start.

use super::placement::{check_json, placer, rt, show_reservation};
use super::{database, ok, reserve_args};
use testkit::wait_for;

/// Every placement and expiry in the log, in commit order: (position,
/// type, reservation, recorded at in Unix ms).
fn outcomes(url: &str) -> Vec<(i64, String, String, f64)> {
    rt().block_on(async {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
            .query(
                "SELECT position, type, payload->>'reservation',
                        extract(epoch FROM recorded_at)::float8 * 1000
                   FROM strata.events
                  WHERE type IN ('reservation.placed', 'reservation.expired')
                  ORDER BY position",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect()
    })
}

#[test]
fn a_waiting_gang_starts_when_the_ttls_run_out_whatever_arrives_behind_it() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    crate::seeded_pool(&url, 3);
    let _placer = crate::gateway::Killed(placer(&url, "backfill", &dir.path().join("placer.log")));
    let show = |id: &str| show_reservation(&url, id);
    let node = |id: &str| {
        show(id)["allocations"][0]["node"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let reserve = |extra: &[&str]| ok(&reserve_args(&url, extra));
    // One node full for 6 s, one half full for 10 s, one nearly full for
    // good: a gang of two whole nodes starts when the second TTL runs out.
    reserve(&[
        "--gpus", "8", "--shape", "node", "--ttl", "6s", "--id", "a", "--wait",
    ]);
    reserve(&[
        "--gpus", "4", "--shape", "node", "--ttl", "10s", "--id", "b", "--wait",
    ]);
    reserve(&["--gpus", "7", "--shape", "node", "--id", "c", "--wait"]);
    let (na, nb, nc) = (node("a"), node("b"), node("c"));
    assert!(na != nb && nb != nc && na != nc, "{na} {nb} {nc}");
    reserve(&["--nodes", "2", "--gpus-per-node", "8", "--id", "gang"]);
    let gang = wait_for(30, || Some(show("gang")).filter(|v| v["phase"] == "queued"))
        .expect("the gang waits");
    assert_eq!(
        gang["waiting"]["earliest_start"],
        show("b")["expires_at"],
        "{gang}"
    );
    // Behind it: s fits on b's node now and never ends, u ends long before
    // b, v fits on c's node, which the gang does not need.
    reserve(&["--gpus", "2", "--shape", "node", "--id", "s"]);
    reserve(&[
        "--gpus", "2", "--shape", "node", "--ttl", "1s", "--id", "u", "--wait",
    ]);
    reserve(&["--gpus", "1", "--shape", "node", "--id", "v", "--wait"]);
    assert_eq!(node("u"), nb, "u is gone before the gang starts");
    assert_eq!(node("v"), nc);
    let s = wait_for(30, || Some(show("s")).filter(|v| v["phase"] == "queued")).expect("s waits");
    let reason = s["waiting"]["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("held back: ") && reason.contains("kept for gang"),
        "{s}"
    );
    assert!(
        s["waiting"]["why"]
            .as_str()
            .unwrap()
            .contains("behind 1 request"),
        "{s}"
    );
    // The gang starts on a's and b's nodes once b's TTL is up; s is never
    // placed before it.
    let placed = wait_for(30, || Some(show("gang")).filter(|v| v["phase"] != "queued"))
        .expect("the gang is placed");
    assert_eq!(placed["phase"], "placed", "{placed}");
    let mut nodes: Vec<String> = placed["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["node"].as_str().unwrap().to_string())
        .collect();
    nodes.sort();
    let mut want = vec![na, nb];
    want.sort();
    assert_eq!(nodes, want);
    let log = outcomes(&url);
    let at = |ty: &str, id: &str| {
        log.iter()
            .find(|(_, t, r, _)| t == ty && r == id)
            .map(|(p, _, _, ms)| (*p, *ms))
    };
    let (gang_pos, gang_ms) = at("reservation.placed", "gang").unwrap();
    let (b_pos, b_ms) = at("reservation.expired", "b").expect("b expired");
    assert!(b_pos < gang_pos);
    assert!(
        gang_ms - b_ms < 5_000.0,
        "the gang starts as b's TTL runs out: {}ms after",
        gang_ms - b_ms
    );
    assert!(
        at("reservation.placed", "s").is_none_or(|(p, _)| p > gang_pos),
        "{log:?}"
    );
    assert_eq!(show("s")["phase"], "queued");
    // The check replays the log clean: c, v and the gang live, s waiting.
    let report = check_json(&url);
    assert_eq!(
        (&report["live"], &report["pending"]),
        (&3.into(), &1.into()),
        "{report}"
    );
    crate::events_conform(&url, &[]);
}
