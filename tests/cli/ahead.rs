//! Time booked ahead, against a real placer process: a reservation in
//! advance promised on a busy pool, lent by backfill only to work that ends
//! before it, placed at its start; a maintenance window that no placement
//! lasts into, and what ran there ended at its start after a notice.

use super::placement::{placer, rt, show_reservation};
use super::queues::events_of;
use super::{database, fails, lines, ok, reserve_args, strata};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The time `after` from now, as `--start` takes it.
fn from_now(after: Duration) -> (String, u64) {
    let t = SystemTime::now() + after;
    let ms = t.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    (humantime::format_rfc3339_millis(t).to_string(), ms)
}

/// Unix ms of the first event of `types` about reservation `id`.
fn recorded_ms(url: &str, id: &str, event_type: &str) -> u64 {
    rt().block_on(async {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let ms: f64 = client
            .query_one(
                "SELECT (extract(epoch FROM min(recorded_at)) * 1000)::float8 FROM strata.events
                  WHERE type = $2 AND payload->>'reservation' = $1",
                &[&id, &event_type],
            )
            .await
            .unwrap()
            .get(0);
        ms as u64
    })
}

#[test]
fn a_reservation_in_advance_starts_on_time_on_a_busy_pool_while_backfill_ran_before_it() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    crate::seeded_pool(&url, 2);
    let _placer = crate::gateway::Killed(placer(&url, "ahead", &dir.path().join("placer.log")));
    // The pool is full for three seconds.
    ok(&reserve_args(
        &url,
        &["--gpus", "16", "--ttl", "3s", "--id", "fill", "--wait"],
    ));
    // The whole pool from 16 s from now, for a minute: promised at once.
    let (start, start_ms) = from_now(Duration::from_secs(16));
    let out = ok(&reserve_args(
        &url,
        &[
            "--gpus",
            "16",
            "--start",
            &start,
            "--duration",
            "60s",
            "--id",
            "ahead",
            "--wait",
        ],
    ));
    assert!(
        out.contains("promised ahead: 16 GPU(s) on 2 node(s) from"),
        "{out}"
    );
    // Another for an overlapping window is refused, with why.
    let (later, _) = from_now(Duration::from_secs(30));
    let refused = strata(&reserve_args(
        &url,
        &[
            "--gpus",
            "1",
            "--start",
            &later,
            "--duration",
            "10s",
            "--id",
            "overlap",
            "--wait",
        ],
    ));
    let said = String::from_utf8_lossy(&refused.stdout);
    assert_eq!(refused.status.code(), Some(3), "{said}");
    assert!(said.contains("cannot promise 1 H100-80GB GPUs"), "{said}");
    let err = fails(&reserve_args(
        &url,
        &[
            "--gpus",
            "1",
            "--start",
            "2020-01-01T00:00:00Z",
            "--duration",
            "1h",
        ],
    ));
    assert!(err.contains("that is past"), "{err}");
    // Backfill: once the fill ends, work that ends well before the start
    // runs; work without an end waits for after the window.
    ok(&reserve_args(
        &url,
        &["--gpus", "4", "--ttl", "1s", "--id", "short", "--wait"],
    ));
    ok(&reserve_args(&url, &["--gpus", "4", "--id", "long"]));
    let future = lines(&ok(&[
        "reservations",
        "list",
        "--future",
        "--output",
        "json",
        "--database-url",
        &url,
    ]));
    assert_eq!(future.len(), 1, "{future:?}");
    assert_eq!(future[0]["id"], "ahead");
    assert_eq!(future[0]["gpus"], 16);
    let long = show_reservation(&url, "long");
    let why = long["waiting"]["reason"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("held back") && why.contains("kept for ahead"),
        "{long}"
    );
    // At its start it is placed, within a second.
    let placed = testkit::wait_for(40, || {
        (show_reservation(&url, "ahead")["phase"] == "placed")
            .then(|| recorded_ms(&url, "ahead", "reservation.placed"))
    })
    .expect("ahead placed");
    assert!(
        placed >= start_ms && placed < start_ms + 1000,
        "placed {} ms after its start",
        placed as i64 - start_ms as i64
    );
    assert_eq!(show_reservation(&url, "long")["phase"], "queued");
    ok(&["replay", "check", "--database-url", &url]);
}

#[test]
fn no_placement_lasts_into_a_maintenance_window_and_what_ran_ends_at_its_start() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    crate::seeded_pool(&url, 1);
    let _placer = crate::gateway::Killed(crate::spawn(
        &[
            "serve",
            "--roles",
            "placer",
            "--database-url",
            &url,
            "--lease-ttl",
            "2s",
            "--holder",
            "window",
            "--slot",
            "window",
            "--preemption-grace",
            "1s",
        ],
        &dir.path().join("placer.log"),
    ));
    ok(&reserve_args(
        &url,
        &["--gpus", "2", "--id", "old", "--wait"],
    ));
    let (start, start_ms) = from_now(Duration::from_secs(3));
    let out = ok(&[
        "nodes",
        "maintenance",
        "gpu-n00000",
        "--start",
        &start,
        "--duration",
        "1h",
        "--reason",
        "firmware",
        "--database-url",
        &url,
    ]);
    assert!(
        out.contains("booked maintenance on node gpu-n00000 in pool gpu"),
        "{out}"
    );
    let err = fails(&[
        "nodes",
        "maintenance",
        "--start",
        &start,
        "--duration",
        "1h",
        "--database-url",
        &url,
    ]);
    assert!(
        err.contains("name the nodes, or give --rack and --pool"),
        "{err}"
    );
    // Nothing without an end goes there now.
    let held = strata(&reserve_args(
        &url,
        &["--gpus", "1", "--id", "long", "--wait", "--timeout", "2s"],
    ));
    let said = String::from_utf8_lossy(&held.stderr);
    assert_eq!(held.status.code(), Some(4), "{said}");
    assert!(said.contains("maintenance of node gpu-n00000"), "{said}");
    // What ran was told, and ends at the window's start.
    let ends = testkit::wait_for(30, || {
        let e = events_of(
            &url,
            "old",
            &["reservation.ending_noticed", "reservation.expired"],
        );
        (e.len() == 2).then_some(e)
    })
    .expect("old noticed and expired");
    assert_eq!(ends[0].2["reason"], "maintenance", "{ends:?}");
    assert_eq!(ends[1].2["reason"], "maintenance", "{ends:?}");
    assert!(recorded_ms(&url, "old", "reservation.expired") >= start_ms);
    let future = lines(&ok(&[
        "reservations",
        "list",
        "--future",
        "--output",
        "json",
        "--database-url",
        &url,
    ]));
    assert_eq!(future[0]["kind"], "maintenance", "{future:?}");
    assert_eq!(future[0]["reason"], "firmware", "{future:?}");
    // The log: no placement on the node lasts into the window.
    let overlapping: i64 = rt().block_on(async {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
            .query_one(
                "WITH w AS (SELECT recorded_at AS booked, (payload->>'start')::timestamptz AS s
                              FROM strata.events WHERE type = 'node.maintenance_scheduled')
                 SELECT count(*) FROM strata.events p, w, strata.events r
                  WHERE p.type = 'reservation.placed' AND p.recorded_at >= w.booked
                    AND p.payload->'allocations' @> '[{\"node\": \"gpu-n00000\"}]'
                    AND r.type = 'reservation.requested'
                    AND r.payload->>'reservation' = p.payload->>'reservation'
                    AND (r.payload->>'ttl_ms' IS NULL
                         OR p.recorded_at + (r.payload->>'ttl_ms')::bigint * interval '1 millisecond' > w.s)",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    });
    assert_eq!(overlapping, 0);
    ok(&["replay", "check", "--database-url", &url]);
}
