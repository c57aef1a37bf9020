//! The log share between the processes of a host, with real processes: a
//! placer following a maintenance process's share places with no walsender
//! of its own; with the sharer stopped (SIGSTOP) or killed (SIGKILL) it
//! places through a temporary slot of its own, and goes back to the share
//! once it answers again. Outcomes are read from the tables.

use super::gateway::free_port;
use super::placement::{check_json, rt};
use super::{database, http_get, ok, reserve_args, seeded_pool, spawn, Held};
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};
use testkit::wait_until;

fn sharer(url: &str, sock: &Path, log: &Path) -> Child {
    spawn(
        &[
            "serve",
            "--roles",
            "maintenance",
            "--log-share",
            &sock.display().to_string(),
            "--slot",
            "host_share",
            "--database-url",
            url,
        ],
        log,
    )
}

/// Whether a walsender streams the slot `slot` now.
fn streams(rt: &tokio::runtime::Runtime, client: &tokio_postgres::Client, slot: &str) -> bool {
    rt.block_on(client.query_one(
        "SELECT count(*) FROM pg_stat_replication WHERE application_name = $1",
        &[&format!("strata-reader-{slot}")],
    ))
    .unwrap()
    .get::<_, i64>(0)
        > 0
}

/// Reserves one GPU as `id` and waits for its placement; the time it took.
fn placed(url: &str, id: &str) -> Duration {
    let t = Instant::now();
    let out = ok(&reserve_args(
        url,
        &["--gpus", "1", "--id", id, "--wait", "--timeout", "60s"],
    ));
    assert!(out.starts_with(&format!("placed {id}")), "{out}");
    t.elapsed()
}

#[test]
fn a_placer_following_a_share_places_through_its_own_slot_while_the_sharer_is_stopped_or_dead() {
    let url = database();
    seeded_pool(&url, 2);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("log.sock");
    let rt = rt();
    let cfg: tokio_postgres::Config = url.parse().unwrap();
    let client = rt.block_on(events::db::connect(&cfg, "test")).unwrap();
    let logs = |what: &str| {
        for f in ["sharer.log", "sharer-2.log", "placer.log"] {
            let text = std::fs::read_to_string(dir.path().join(f)).unwrap_or_default();
            eprintln!("--- {f} ({what})\n{text}");
        }
    };
    let mut a = sharer(&url, &sock, &dir.path().join("sharer.log"));
    wait_until(
        30,
        "the sharer streams",
        || streams(&rt, &client, "host_share"),
        || logs("sharer"),
    );
    let metrics = format!("127.0.0.1:{}", free_port());
    // Whether the follower says it decodes the log itself.
    let fallback = || {
        let (code, text) = http_get(&metrics, "/metrics");
        assert_eq!(code, 200, "{text}");
        text.lines().any(|l| l == "strata_log_share_fallback 1")
    };
    let mut b = spawn(
        &[
            "serve",
            "--roles",
            "placer",
            "--metrics-listen",
            &metrics,
            "--log-from",
            &sock.display().to_string(),
            "--log-share-silence",
            "2s",
            "--slot",
            "host_placer",
            "--lease-ttl",
            "2s",
            "--holder",
            "b",
            "--database-url",
            &url,
        ],
        &dir.path().join("placer.log"),
    );
    placed(&url, "r1");
    assert!(
        !streams(&rt, &client, "host_placer"),
        "the follower has no walsender"
    );
    assert!(!fallback(), "the follower follows its share");

    // Stopped: the follower hears nothing for 2 s and decodes the log itself.
    let held = Held::stop(a.id().to_string());
    let took = placed(&url, "r2");
    assert!(
        streams(&rt, &client, "host_placer"),
        "the follower streams its own slot"
    );
    assert!(fallback(), "the follower says it decodes the log itself");
    drop(held);
    wait_until(
        30,
        "the follower back on the share",
        || !streams(&rt, &client, "host_placer"),
        || logs("back"),
    );
    wait_until(
        30,
        "the follower no longer says it decodes the log itself",
        || !fallback(),
        || logs("metric"),
    );
    let back = placed(&url, "r3");

    // Killed, then started again on the same socket.
    a.kill().unwrap();
    a.wait().unwrap();
    let took_dead = placed(&url, "r4");
    assert!(streams(&rt, &client, "host_placer"));
    let mut a = sharer(&url, &sock, &dir.path().join("sharer-2.log"));
    wait_until(
        30,
        "the follower back on the restarted share",
        || !streams(&rt, &client, "host_placer"),
        || logs("restarted"),
    );
    placed(&url, "r5");

    let temporary: i64 = rt
        .block_on(client.query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'host_placer'",
            &[],
        ))
        .unwrap()
        .get(0);
    assert_eq!(temporary, 0, "the follower's slot went with its session");
    let report = check_json(&url);
    assert_eq!(report["live"], 5, "{report}");
    assert_eq!(report["pending"], 0, "{report}");
    let placements: i64 = rt
        .block_on(client.query_one(
            "SELECT count(*) FROM strata.events WHERE type = 'reservation.placed'",
            &[],
        ))
        .unwrap()
        .get(0);
    assert_eq!(placements, 5, "none placed twice, none lost");
    eprintln!("placed with the sharer stopped in {took:?}, dead in {took_dead:?}; back on the share: {back:?}");
    for c in [&mut a, &mut b] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
}
