//! Reservations end to end: placer processes, the client commands, a placer
//! killed with SIGKILL, the replay check, a placer following a promoted
//! standby, operators changing nodes' standing, roles, statement timeouts.

use super::{append_args, database, fails, lines, ok, reserve_args, strata};
use std::process::Child;
use std::time::{Duration, Instant};
use testkit::wait_for;

pub(crate) fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A placer process: `strata serve --roles placer`.
pub(crate) fn placer(url: &str, holder: &str, log: &std::path::Path) -> Child {
    crate::spawn(
        &[
            "serve",
            "--roles",
            "placer",
            "--database-url",
            url,
            "--lease-ttl",
            "2s",
            "--holder",
            holder,
            "--slot",
            &format!("placer_{holder}"),
        ],
        log,
    )
}

/// Pool leases currently held: (pool lease, holder).
async fn holders(client: &tokio_postgres::Client) -> Vec<(String, String)> {
    client
        .query(
            "SELECT name, holder FROM strata.leases WHERE name LIKE 'pool/%' AND expires_at > now() ORDER BY name",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// `strata reservations show ID --output json`, parsed.
pub(crate) fn show_reservation(url: &str, id: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&[
        "reservations",
        "show",
        id,
        "--database-url",
        url,
        "--output",
        "json",
    ]))
    .unwrap()
}

/// `strata replay check --json`, parsed.
pub(crate) fn check_json(url: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&["replay", "check", "--database-url", url, "--json"])).unwrap()
}

#[test]
fn reserve_release_pools_and_the_replay_check() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    ok(&[
        "pool",
        "create",
        "gpu",
        "--database-url",
        &url,
        "--description",
        "the test pool",
    ]);
    let out = ok(&[
        "pool",
        "seed",
        "gpu",
        "--database-url",
        &url,
        "--nodes",
        "3",
        "--per-island",
        "4",
    ]);
    assert!(out.contains("joined 3 nodes"), "{out}");
    let err = fails(&["pool", "create", "gpu", "--database-url", &url]);
    assert!(err.contains("already exists"), "{err}");
    let mut p = placer(&url, "solo", &dir.path().join("solo.log"));

    let out = ok(&reserve_args(
        &url,
        &["--gpus", "8", "--shape", "node", "--id", "whole", "--wait"],
    ));
    assert!(
        out.starts_with("placed whole: 8 GPU(s) on 1 node(s)"),
        "{out}"
    );
    let out = ok(&reserve_args(
        &url,
        &[
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--id",
            "gang",
            "--wait",
        ],
    ));
    assert!(out.contains("8 GPU(s) on 2 node(s)"), "{out}");
    // Cannot ever fit: exit code 3 (never fits, not clap's usage error 2)
    // and the reason.
    let out = strata(&reserve_args(
        &url,
        &["--gpus", "5", "--shape", "island", "--wait"],
    ));
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stdout).contains("largest island has 4"));
    // Does not fit now: stays queued; the wait times out with exit code 4.
    let out = strata(&reserve_args(
        &url,
        &[
            "--gpus",
            "8",
            "--shape",
            "node",
            "--id",
            "later",
            "--wait",
            "--timeout",
            "2s",
        ],
    ));
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("queued: waiting for capacity"));

    let pools = ok(&["pools", "--database-url", &url]);
    let row = pools.lines().find(|l| l.starts_with("gpu ")).expect(&pools);
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cols[1..],
        ["3", "3", "H100-80GB", "24", "8", "16", "2", "1"],
        "{pools}"
    );
    let show = ok(&["pool", "show", "gpu", "--database-url", &url, "--nodes"]);
    assert!(show.contains("later 8 x H100-80GB (node)"), "{show}");
    assert!(show.contains("gpu-n00000"), "{show}");

    // Releasing the whole node lets the queued one place.
    // The moment before the release, for the replays below.
    let before_release = {
        let rt = rt();
        let c = rt
            .block_on(events::db::connect(
                &url.parse::<tokio_postgres::Config>().unwrap(),
                "t",
            ))
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let t: String = rt
            .block_on(c.query_one(
                "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
                &[],
            ))
            .unwrap()
            .get(0);
        std::thread::sleep(Duration::from_millis(20));
        t
    };
    ok(&["release", "whole", "--database-url", &url]);
    // The log says who asked, for the request and the release alike.
    {
        let rt = rt();
        let c = rt
            .block_on(events::db::connect(
                &url.parse::<tokio_postgres::Config>().unwrap(),
                "t",
            ))
            .unwrap();
        let asked: i64 = rt
            .block_on(c.query_one(
                "SELECT count(*) FROM strata.events WHERE stream = 'reservation/whole'
                   AND type IN ('reservation.requested', 'reservation.release_requested')
                   AND metadata ? 'cli'",
                &[],
            ))
            .unwrap()
            .get(0);
        assert_eq!(asked, 2);
    }
    let placed = wait_for(20, || {
        let r = check_json(&url);
        (r["pending"] == 0).then_some(r)
    })
    .expect("the queued reservation placed after the release");
    assert_eq!(placed["live"], 2);
    assert_eq!(placed["booked_devices"], 16);
    // The pool as it was before the release: 16 GPUs booked; now 16 again
    // but with `later` in place of `whole`; the stream of `whole` then and now.
    let then = ok(&[
        "replay",
        "state",
        "--pool",
        "gpu",
        "--at",
        &before_release,
        "--database-url",
        &url,
    ]);
    assert!(then.contains("24 GPUs, 8 free, 16 booked"), "{then}");
    assert!(
        then.contains("later 8 x H100-80GB"),
        "later was waiting then: {then}"
    );
    let stream = ok(&[
        "replay",
        "stream",
        "reservation/whole",
        "--database-url",
        &url,
    ]);
    // Requested, release requested, and its end, committed with the release.
    assert_eq!(stream.lines().count(), 3, "{stream}");
    assert!(
        stream
            .lines()
            .last()
            .is_some_and(|l| l.contains("reservation.ended") && l.contains("released")),
        "{stream}"
    );
    let stream = ok(&[
        "replay",
        "stream",
        "reservation/whole",
        "--at",
        &before_release,
        "--database-url",
        &url,
    ]);
    assert_eq!(stream.lines().count(), 1, "{stream}");
    assert!(stream.contains("reservation.requested"));
    let snap = dir.path().join("index.snap");
    let run = ok(&[
        "replay",
        "run",
        "--database-url",
        &url,
        "--compare-live",
        "--snapshot-out",
        snap.to_str().unwrap(),
    ]);
    assert!(
        run.contains("the live projection equals the replayed one"),
        "{run}"
    );
    let state = projections::snapshot::decode(&std::fs::read(&snap).unwrap()).unwrap();
    assert!(state.pools.contains_key("gpu"));
    // The other projections, compared with their live builds.
    let nodes = ok(&[
        "replay",
        "run",
        "--projection",
        "nodes",
        "--compare-live",
        "--json",
        "--database-url",
        &url,
    ]);
    let rows: Vec<serde_json::Value> = nodes
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3, "{nodes}");
    assert!(
        rows.iter().all(|r| r["pool"] == "gpu" && r["devices"] == 8),
        "{nodes}"
    );
    assert!(
        nodes.contains("the live projection equals the replayed one"),
        "{nodes}"
    );
    let res = ok(&[
        "replay",
        "run",
        "--projection",
        "reservations",
        "--compare-live",
        "--database-url",
        &url,
    ]);
    assert!(res.contains("equals the replayed one"), "{res}");
    assert!(
        res.lines()
            .any(|l| l.starts_with("released") && l.ends_with(" 1")),
        "{res}"
    );
    // A window: the state before it from the snapshot written above would be
    // after it, so that is refused; from the log, the window's events by type.
    let window = ok(&[
        "replay",
        "run",
        "--from",
        &before_release,
        "--database-url",
        &url,
    ]);
    assert!(window.contains("reservation.released"), "{window}");
    assert!(
        !window.contains("node.joined"),
        "joins were before the window: {window}"
    );
    let err = fails(&[
        "replay",
        "run",
        "--from",
        "1",
        "--snapshot-in",
        snap.to_str().unwrap(),
        "--database-url",
        &url,
    ]);
    assert!(err.contains("after --from 1"), "{err}");
    let resumed = ok(&[
        "replay",
        "run",
        "--snapshot-in",
        snap.to_str().unwrap(),
        "--compare-live",
        "--database-url",
        &url,
    ]);
    assert!(resumed.contains("equals the replayed one"), "{resumed}");
    let err = fails(&[
        "replay",
        "state",
        "--pool",
        "gpu",
        "--at",
        "yesterday",
        "--database-url",
        &url,
    ]);
    assert!(err.contains("a time such as"), "{err}");
    let err = fails(&["release", "nothing-here", "--database-url", &url]);
    assert!(err.contains("does not exist"), "{err}");
    p.kill().unwrap();
    p.wait().unwrap();

    // A placement written around the placer onto a booked device.
    let bad = serde_json::json!({
        "reservation": "gang",
        "allocations": [{"node": "gpu-n00000", "devices": ["gpu0"]}],
    })
    .to_string();
    ok(&[
        "events",
        "append",
        "--database-url",
        &url,
        "--stream",
        "pool/gpu",
        "--type",
        "reservation.placed",
        "--data",
        &bad,
    ]);
    let out = strata(&["replay", "check", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("violation") && text.contains("placed while placed"),
        "{text}"
    );
    ok(&[
        "slots",
        "drop",
        "placer_solo",
        "--database-url",
        &url,
        "--force",
    ]);
    super::events_conform(&url, &[]);
}

#[test]
fn placers_split_pools_and_a_killed_one_hands_them_over() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let pools = ["p0", "p1", "p2", "p3"];
    for p in pools {
        ok(&["pool", "create", p, "--database-url", &url]);
        ok(&["pool", "seed", p, "--database-url", &url, "--nodes", "4"]);
    }
    let mut a = placer(&url, "a", &dir.path().join("a.log"));
    let mut b = placer(&url, "b", &dir.path().join("b.log"));
    let rt = rt();
    let client = rt
        .block_on(events::db::connect(
            &url.parse::<tokio_postgres::Config>().unwrap(),
            "t",
        ))
        .unwrap();
    let split = wait_for(30, || {
        let h = rt.block_on(holders(&client));
        let of = |who: &str| h.iter().filter(|(_, x)| x == who).count();
        (of("a") == 2 && of("b") == 2).then_some(h)
    });
    assert!(
        split.is_some(),
        "the placers split the pools: {:?}",
        rt.block_on(holders(&client))
    );

    // Requests keep coming while `a` is killed.
    let _entered = rt.enter();
    let appender = events::Appender::start(
        url.parse::<events::db::Database>().unwrap(),
        events::AppenderConfig::default(),
    );
    let request = |i: usize| domain::Request {
        reservation: format!("r{i}"),
        pool: pools[i % 4].into(),
        class: "H100-80GB".into(),
        gpus: 1,
        shape: domain::Shape::Any,
        priority: 0,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        start_ms: None,
        queue: None,
    };
    let total = 120;
    for i in 0..total / 2 {
        rt.block_on(domain::requests::reserve(
            &client,
            &appender,
            &request(i),
            None,
        ))
        .unwrap();
    }
    a.kill().unwrap();
    a.wait().unwrap();
    let killed = Instant::now();
    for i in total / 2..total {
        rt.block_on(domain::requests::reserve(
            &client,
            &appender,
            &request(i),
            None,
        ))
        .unwrap();
    }
    let moved = wait_for(30, || {
        let h = rt.block_on(holders(&client));
        (h.len() == 4 && h.iter().all(|(_, x)| x == "b")).then_some(killed.elapsed())
    })
    .expect("b took all pools");
    // The lease lives 2 s; b looks every 2/3 s (and a busy machine gets a
    // second of slack).
    assert!(
        moved < Duration::from_millis(3700),
        "pools moved after {moved:?}"
    );
    let report = wait_for(30, || {
        let r = check_json(&url);
        (r["live"] == total).then_some(r)
    })
    .unwrap_or_else(|| panic!("every reservation placed: {}", check_json(&url)));
    assert_eq!(report["pending"], 0);
    let placed: i64 = rt
        .block_on(client.query_one(
            "SELECT count(*) FROM strata.events WHERE type = 'reservation.placed'",
            &[],
        ))
        .unwrap()
        .get(0);
    assert_eq!(placed, total as i64, "none placed twice, none lost");
    eprintln!("pools moved {moved:?} after the kill");
    b.kill().unwrap();
    b.wait().unwrap();
    for s in ["placer_a", "placer_b"] {
        ok(&["slots", "drop", s, "--database-url", &url, "--force"]);
    }
}

#[test]
fn operators_cordon_drain_uncordon_and_clear_health() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    ok(&["pool", "create", "gpu", "--database-url", &url]);
    ok(&[
        "pool",
        "seed",
        "gpu",
        "--database-url",
        &url,
        "--nodes",
        "2",
    ]);
    let mut p = placer(&url, "ops", &dir.path().join("ops.log"));
    let rt = rt();
    let client = rt
        .block_on(events::db::connect(
            &url.parse::<tokio_postgres::Config>().unwrap(),
            "t",
        ))
        .unwrap();
    let count = |sql: &str| -> i64 { rt.block_on(client.query_one(sql, &[])).unwrap().get(0) };
    let nodes = |url: &str| ok(&["pool", "show", "gpu", "--nodes", "--database-url", url]);

    // Cordoned: nothing new goes there.
    let out = ok(&[
        "nodes",
        "cordon",
        "gpu-n00000",
        "--reason",
        "maintenance",
        "--database-url",
        &url,
    ]);
    assert!(
        out.contains("cordoned node gpu-n00000 in pool gpu"),
        "{out}"
    );
    assert!(nodes(&url).contains("cordoned maintenance"));
    let out = ok(&reserve_args(
        &url,
        &["--gpus", "8", "--shape", "node", "--id", "first", "--wait"],
    ));
    assert!(out.contains("gpu-n00001"), "{out}");
    let out = strata(&reserve_args(
        &url,
        &[
            "--gpus",
            "8",
            "--shape",
            "node",
            "--id",
            "second",
            "--wait",
            "--timeout",
            "2s",
        ],
    ));
    assert_eq!(
        out.status.code(),
        Some(4),
        "second waits: the only free node is cordoned"
    );

    // Uncordoned: the waiting one is placed there.
    let out = ok(&[
        "nodes",
        "uncordon",
        "gpu-n00000",
        "--json",
        "--database-url",
        &url,
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["pool"].as_str(), v["change"].as_str()),
        (Some("gpu"), Some("uncordoned"))
    );
    wait_for(20, || {
        (count("SELECT count(*) FROM strata.events WHERE type = 'reservation.placed' AND payload->>'reservation' = 'second'") == 1).then_some(())
    })
    .expect("second was placed once the node was uncordoned");

    // Drained: its live reservation fails, and the pool says why.
    ok(&[
        "nodes",
        "drain",
        "gpu-n00001",
        "--reason",
        "rma",
        "--database-url",
        &url,
    ]);
    wait_for(20, || {
        (count("SELECT count(*) FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reservation' = 'first' AND payload->>'reason' = 'node_drained'") == 1).then_some(())
    })
    .expect("first failed with node_drained");
    assert!(nodes(&url).contains("drained rma"));
    // A drain with a wait lets the live reservation run until then.
    let out = ok(&[
        "nodes",
        "drain",
        "gpu-n00000",
        "--wait",
        "1h",
        "--database-url",
        &url,
    ]);
    assert!(out.contains("end in 1h"), "{out}");
    assert!(nodes(&url).contains("draining"), "{}", nodes(&url));
    // The same drain in payload version 2 (an RFC 3339 deadline, as the
    // next release writes it) is read as the same fact, by this command and
    // by the running placer, which does not end the reservation early.
    ok(&append_args(
        &url,
        "pool/gpu",
        "node.drained",
        r#"{"node":"gpu-n00000","reason":"rma-v2","deadline":"2099-01-01T00:00:00.000Z"}"#,
        &["--metadata", r#"{"payload_version":2}"#],
    ));
    let shown = nodes(&url);
    assert!(
        shown.contains("draining rma-v2 (live reservations end at 2099-01-01T00:00:00Z)"),
        "{shown}"
    );
    let err = fails(&append_args(
        &url,
        "pool/gpu",
        "node.drained",
        "{}",
        &["--metadata", "[2]"],
    ));
    assert!(err.contains("--metadata"), "{err}");
    assert_eq!(count("SELECT count(*) FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reservation' = 'second'"), 0);

    // A GPU fault written before faults were classified (no action in the
    // payload) is classified when read: the running placer quarantines the
    // GPU, and an operator's clear brings it back.
    ok(&["nodes", "uncordon", "gpu-n00001", "--database-url", &url]);
    ok(&append_args(
        &url,
        "pool/gpu",
        "health.raised",
        r#"{"node":"gpu-n00001","device":"gpu2","condition":"XID-48"}"#,
        &[],
    ));
    wait_for(20, || {
        nodes(&url)
            .contains("gpu2 quarantined (XID-48)")
            .then_some(())
    })
    .unwrap_or_else(|| panic!("{}", nodes(&url)));
    ok(&[
        "nodes",
        "clear-health",
        "gpu-n00001",
        "--device",
        "gpu2",
        "--condition",
        "XID-48",
        "--database-url",
        &url,
    ]);
    let shown = nodes(&url);
    let line = shown.lines().find(|l| l.contains("gpu-n00001")).unwrap();
    assert!(line.ends_with("ready"), "{shown}");
    // Who asked is in the log.
    assert_eq!(count("SELECT count(*) FROM strata.events WHERE type = 'node.cordoned' AND metadata ? 'operator'"), 1);

    let err = fails(&["nodes", "cordon", "no-such-node", "--database-url", &url]);
    assert!(err.contains("is in no pool"), "{err}");
    // Named with another pool: refused, nothing written there.
    ok(&["pool", "create", "other", "--database-url", &url]);
    let err = fails(&[
        "nodes",
        "drain",
        "gpu-n00001",
        "--pool",
        "other",
        "--database-url",
        &url,
    ]);
    assert!(
        err.contains("node gpu-n00001 is in pool gpu, not other"),
        "{err}"
    );
    assert_eq!(
        count("SELECT count(*) FROM strata.events WHERE stream = 'pool/other' AND type = 'node.drained'"),
        0
    );
    assert_eq!(check_json(&url)["live"], 1);
    // A node taken out of the pool: its live reservation ends at once (the
    // drain's wait no longer applies), and the pool says why.
    ok(&[
        "nodes",
        "leave",
        "gpu-n00000",
        "--reason",
        "decommissioned",
        "--database-url",
        &url,
    ]);
    wait_for(20, || {
        (count("SELECT count(*) FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reservation' = 'second' AND payload->>'reason' = 'node_left'") == 1).then_some(())
    })
    .expect("second failed with node_left");
    assert!(
        nodes(&url).contains("left (decommissioned)"),
        "{}",
        nodes(&url)
    );
    assert_eq!(check_json(&url)["live"], 0);
    p.kill().unwrap();
    p.wait().unwrap();
    ok(&[
        "slots",
        "drop",
        "placer_ops",
        "--database-url",
        &url,
        "--force",
    ]);
    super::events_conform(&url, &[]);
}

#[test]
fn roles_are_set_listed_and_removed_and_bad_ones_refused() {
    let url = database();
    let err = fails(&[
        "roles",
        "set",
        "alice",
        "--role",
        "root",
        "--database-url",
        &url,
    ]);
    assert!(err.contains("admin, operator or viewer"), "{err}");
    let err = fails(&[
        "roles",
        "set",
        "alice",
        "--role",
        "operator",
        "--database-url",
        &url,
    ]);
    assert!(err.contains("--pools"), "{err}");
    let err = fails(&[
        "roles",
        "set",
        "alice",
        "--role",
        "viewer",
        "--pools",
        "p",
        "--database-url",
        &url,
    ]);
    assert!(err.contains("--pools is for the operator role"), "{err}");
    let out = ok(&[
        "roles",
        "set",
        "alice",
        "--role",
        "operator",
        "--pools",
        "p,q",
        "--database-url",
        &url,
    ]);
    assert!(out.contains("alice is operator in pools p, q"), "{out}");
    ok(&[
        "roles",
        "set",
        "root",
        "--role",
        "admin",
        "--database-url",
        &url,
    ]);
    let listed = lines(&ok(&["roles", "list", "--json", "--database-url", &url]));
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0]["operator"], "alice");
    assert_eq!(listed[0]["pools"], serde_json::json!(["p", "q"]));
    assert_eq!(listed[1]["role"], "admin");
    ok(&[
        "grants",
        "set",
        "alice",
        "--prefixes",
        "pool/p",
        "--database-url",
        &url,
    ]);
    let out = ok(&["roles", "remove", "alice", "--database-url", &url]);
    assert!(
        out.contains("but read the events its grant allows (Subscribe to streams pool/p)"),
        "{out}"
    );
    let out = ok(&["roles", "remove", "root", "--database-url", &url]);
    assert!(
        out.contains("it may do nothing through the API\n")
            || out
                .trim_end()
                .ends_with("it may do nothing through the API"),
        "{out}"
    );
    let err = fails(&["roles", "remove", "nobody", "--database-url", &url]);
    assert!(err.contains("nobody has no role"), "{err}");
    let listed = lines(&ok(&["roles", "list", "--json", "--database-url", &url]));
    assert_eq!(listed.len(), 0, "{listed:?}");
    super::events_conform(&url, &[]);
}

/// A placer process and the CLI against a primary and its streaming
/// standby through one multi-host URL: the primary is killed, the standby
/// promoted, and the same running placer places the next reservation there.
#[test]
fn a_placer_process_follows_a_promoted_standby() {
    let mut primary = testkit::temp_cluster(&[]).unwrap();
    let url = rt().block_on(testkit::migrated_database(&primary));
    let dbname = url.rsplit('/').next().unwrap().to_string();
    let standby = testkit::temp_standby(&primary).unwrap();
    let both = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{dbname}?target_session_attrs=read-write&connect_timeout=2",
        primary.port(),
        standby.port()
    );
    let dir = tempfile::tempdir().unwrap();
    ok(&["pool", "create", "gpu", "--database-url", &both]);
    ok(&[
        "pool",
        "seed",
        "gpu",
        "--database-url",
        &both,
        "--nodes",
        "2",
    ]);
    let log = dir.path().join("placer.log");
    let mut p = placer(&both, "failover", &log);
    let out = ok(&reserve_args(
        &both,
        &["--gpus", "8", "--shape", "node", "--id", "before", "--wait"],
    ));
    assert!(out.starts_with("placed before"), "{out}");
    // The placer's reader has recorded where it reads, and the standby has
    // that record: only then can the reader tell, on the promoted standby,
    // that its slot is missing rather than new.
    let on_standby = standby.url(&dbname);
    wait_for(30, || {
        rt().block_on(async {
            let c = events::db::connect(&on_standby.parse::<tokio_postgres::Config>().ok()?, "t")
                .await
                .ok()?;
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM strata.replication_readers WHERE slot_name = 'placer_failover'",
                    &[],
                )
                .await
                .ok()?
                .get(0);
            (n > 0).then_some(())
        })
    })
    .expect("the reader's record reaches the standby");

    primary.crash();
    standby.promote().unwrap();
    let out = ok(&reserve_args(
        &both,
        &[
            "--gpus",
            "8",
            "--shape",
            "node",
            "--id",
            "after",
            "--wait",
            "--timeout",
            "60s",
        ],
    ));
    assert!(
        out.starts_with("placed after"),
        "{out}\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    // Both are in the promoted standby's log, on different nodes.
    let placed: Vec<String> = rt().block_on(async {
        let c = events::db::connect(
            &standby
                .url(&dbname)
                .parse::<tokio_postgres::Config>()
                .unwrap(),
            "t",
        )
        .await
        .unwrap();
        c.query(
            "SELECT payload->'allocations'->0->>'node' FROM strata.events
              WHERE type = 'reservation.placed' ORDER BY position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
    });
    assert_eq!(placed.len(), 2, "{placed:?}");
    assert_ne!(placed[0], placed[1], "one node booked twice: {placed:?}");
    let _ = p.kill();
    let _ = p.wait();
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        log.contains("replication slot missing on this server"),
        "the placer's reader said its slot was gone:\n{log}"
    );
}

#[test]
fn a_command_behind_a_held_lock_fails_after_the_statement_timeout_and_says_why() {
    let url = database();
    let rt = rt();
    let holder = rt.block_on(async {
        let cfg = url.parse::<tokio_postgres::Config>().unwrap();
        let c = events::db::connect(&cfg, "holder").await.unwrap();
        c.batch_execute("BEGIN; LOCK TABLE strata.node_certificates IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        c
    });
    let started = Instant::now();
    let err = fails(&[
        "nodes",
        "list",
        "--database-url",
        &url,
        "--statement-timeout",
        "500ms",
    ]);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(err.contains("statement timeout"), "{err}");
    rt.block_on(holder.batch_execute("ROLLBACK")).unwrap();
    ok(&["nodes", "list", "--database-url", &url]);
    let help = ok(&["nodes", "list", "--help"]);
    assert!(help.contains("--statement-timeout"), "{help}");
}

/// `strata reservations show` says why a reservation waits: how many
/// requests are ahead of it, what the placer said, and its earliest start
/// from the live reservations' expiries; then that it was placed, and how
/// an ended one ended.
#[test]
fn reservations_show_why_one_waits_and_where_it_stands() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    crate::seeded_pool(&url, 1);
    // Higher priorities wait here rather than preempt.
    ok(&[
        "pool",
        "policy",
        "gpu",
        "--database-url",
        &url,
        "--preemption",
        "off",
    ]);
    let _placer = crate::gateway::Killed(placer(&url, "w1", &dir.path().join("placer.log")));
    let show = |id: &str| show_reservation(&url, id);
    // The node is full for an hour.
    ok(&reserve_args(
        &url,
        &["--gpus", "8", "--id", "big", "--ttl", "1h", "--wait"],
    ));
    let big = show("big");
    assert_eq!(big["phase"], "placed", "{big}");
    assert_eq!(
        big["allocations"][0]["devices"].as_array().unwrap().len(),
        8
    );
    // Two wait behind it, the higher priority first.
    ok(&reserve_args(
        &url,
        &["--gpus", "4", "--id", "second", "--priority", "0"],
    ));
    ok(&reserve_args(
        &url,
        &["--gpus", "6", "--id", "first", "--priority", "5"],
    ));
    let queued = |id: &str| wait_for(30, || Some(show(id)).filter(|v| v["phase"] == "queued"));
    let first = queued("first").expect("first is queued");
    let second = queued("second").expect("second is queued");
    assert_eq!(first["waiting"]["position"], 1, "{first}");
    assert_eq!(first["waiting"]["ahead"], 0);
    assert_eq!(second["waiting"]["position"], 2, "{second}");
    assert_eq!(second["waiting"]["ahead"], 1);
    assert_eq!(second["waiting"]["ahead_gpus"], 6);
    assert!(
        second["waiting"]["why"]
            .as_str()
            .unwrap()
            .contains("behind 1 request"),
        "{second}"
    );
    assert!(
        !first["waiting"]["reason"].as_str().unwrap().is_empty(),
        "the placer's words: {first}"
    );
    assert_eq!(first["waiting"]["free_now"], 0);
    // The first can start when the big one's hour is up; the second not
    // even then (the first takes 6 of the 8), and nothing else ends.
    assert_eq!(
        first["waiting"]["earliest_start"], big["expires_at"],
        "{first} {big}"
    );
    assert_eq!(
        second["waiting"]["earliest_start"],
        serde_json::Value::Null,
        "{second}"
    );
    // A third, asked for with --wait, says where it stands when its wait
    // runs out.
    let third = strata(&reserve_args(
        &url,
        &["--gpus", "1", "--id", "third", "--wait", "--timeout", "3s"],
    ));
    let said = String::from_utf8_lossy(&third.stderr);
    assert_eq!(third.status.code(), Some(4), "{said}");
    assert!(
        said.contains("behind 2 request(s)") && said.contains("position 3 of 3"),
        "{said}"
    );
    ok(&["release", "third", "--database-url", &url]);
    wait_for(30, || Some(show("third")).filter(|v| v["phase"] == "ended"))
        .expect("third cancelled");
    let text = ok(&["reservations", "show", "second", "--database-url", &url]);
    assert!(
        text.contains("behind 1 request") && text.contains("earliest start"),
        "{text}"
    );
    let list = lines(&ok(&[
        "reservations",
        "list",
        "--database-url",
        &url,
        "--output",
        "json",
    ]));
    let order: Vec<&str> = list
        .iter()
        .map(|r| r["reservation"].as_str().unwrap())
        .collect();
    assert_eq!(
        order,
        ["big", "first", "second"],
        "live first, then in the order tried"
    );
    // Released, the big one ends and the first takes its place.
    ok(&["release", "big", "--database-url", &url]);
    let placed = wait_for(30, || {
        Some(show("first")).filter(|v| v["phase"] == "placed")
    });
    assert!(placed.is_some(), "first placed after the release");
    let ended =
        wait_for(30, || Some(show("big")).filter(|v| v["phase"] == "ended")).expect("big ended");
    assert_eq!(ended["outcome"], "released");
    let out = strata(&["reservations", "show", "nope", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(6));
}

/// A pool without queues and a real placer: a request of higher priority
/// ends the lower one after the grace period and takes its GPUs; with the
/// pool's preemption turned off, the next one waits.
#[test]
fn a_pool_without_queues_preempts_for_a_higher_priority_unless_told_not_to() {
    let url = database();
    super::seeded_pool(&url, 1);
    let dir = tempfile::tempdir().unwrap();
    let db = url.rsplit('/').next().unwrap().to_string();
    let _placer = crate::gateway::Killed(super::spawn(
        &[
            "serve",
            "--roles",
            "placer",
            "--database-url",
            &url,
            "--preemption-grace",
            "1s",
            "--slot",
            &format!("preempt_{db}"),
        ],
        &dir.path().join("placer.log"),
    ));
    let out = ok(&reserve_args(
        &url,
        &["--gpus", "8", "--id", "low", "--wait"],
    ));
    assert!(out.starts_with("placed low"), "{out}");
    let out = ok(&reserve_args(
        &url,
        &[
            "--gpus",
            "8",
            "--id",
            "high",
            "--priority",
            "5",
            "--wait",
            "--timeout",
            "60s",
        ],
    ));
    assert!(out.starts_with("placed high"), "{out}");
    let ended = crate::gateway::query(
        &url,
        "SELECT payload->>'outcome' FROM strata.events
          WHERE stream = 'reservation/low' AND type = 'reservation.ended'",
    );
    assert_eq!(ended, [["preempted"]]);
    let out = ok(&[
        "pool",
        "policy",
        "gpu",
        "--database-url",
        &url,
        "--preemption",
        "off",
    ]);
    assert!(out.contains("preemption off"), "{out}");
    let out = strata(&reserve_args(
        &url,
        &[
            "--gpus",
            "8",
            "--id",
            "top",
            "--priority",
            "9",
            "--wait",
            "--timeout",
            "3s",
        ],
    ));
    assert_eq!(out.status.code(), Some(4), "it waits");
    let scheduled = crate::gateway::query(
        &url,
        "SELECT count(*)::text FROM strata.events WHERE type = 'reservation.preemption_scheduled'",
    );
    assert_eq!(scheduled, [["1"]], "only low was preempted");
}
