//! Usage from the log: a real region (gateway, placer, binder and the usage
//! role in one `serve`, a real node daemon) runs reservations that are
//! released, expire, are preempted and are lost with their node; the usage
//! report must equal a computation by hand from the events' times, and
//! `replay check` must find the rollups equal to a fold of the raw log.

use super::gateway::{query, Killed};
use super::one_node::{region_with, Region};
use super::{database, ok, reserve_args, seeded_pool, spawn, strata};
use std::collections::BTreeMap;
use std::process::Command;

/// `strata reserve` run as operating-system user `user` (who the log
/// records as having asked).
fn reserve_as(r: &Region, user: &str, id: &str, gpus: u32, extra: &[&str]) {
    let gpus = gpus.to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "reserve",
            "--database-url",
            &r.url,
            "--pool",
            "p",
            "--class",
            "H100-80GB",
            "--gpus",
            &gpus,
            "--id",
            id,
            "--queue",
            "research",
        ])
        .args(extra)
        .env("USER", user)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "reserve {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn outcome(r: &Region, id: &str) -> Option<String> {
    query(
        &r.url,
        &format!(
            "SELECT payload->>'outcome' FROM strata.events
              WHERE stream = 'reservation/{id}' AND type = 'reservation.ended'"
        ),
    )
    .into_iter()
    .next()
    .map(|row| row[0].clone())
}

fn wait_ended(r: &Region, id: &str, outcome_is: &str) {
    r.wait_until(90, &format!("{id} ended {outcome_is}"), || {
        outcome(r, id).as_deref() == Some(outcome_is)
    });
}

/// (active, held) GPU-milliseconds by (queue, owner, class).
type Usage = BTreeMap<(String, String, String), (i64, i64)>;

/// GPU-milliseconds by (queue, owner, class): (active, held), computed from
/// the events' `recorded_at` alone.
fn by_hand(url: &str) -> Usage {
    let rows = query(
        url,
        "SELECT type, payload->>'reservation',
                floor(extract(epoch FROM recorded_at) * 1000)::int8::text,
                payload::text, coalesce(metadata->>'operator', metadata->>'cli', '')
           FROM strata.events
          WHERE type IN ('reservation.requested', 'reservation.placed',
                         'reservation.activated', 'reservation.ended')
          ORDER BY position",
    );
    #[derive(Default)]
    struct Life {
        key: (String, String, String),
        gpus: i64,
        placed: Option<i64>,
        active: Option<i64>,
        ended: Option<i64>,
    }
    let mut lives: BTreeMap<String, Life> = BTreeMap::new();
    for row in rows {
        let at: i64 = row[2].parse().unwrap();
        let payload: serde_json::Value = serde_json::from_str(&row[3]).unwrap();
        let life = lives.entry(row[1].clone()).or_default();
        match row[0].as_str() {
            "reservation.requested" => {
                life.key = (
                    payload["queue"].as_str().unwrap_or_default().to_string(),
                    row[4].clone(),
                    payload["class"].as_str().unwrap().to_string(),
                );
            }
            "reservation.placed" => {
                life.placed = Some(at);
                life.gpus = payload["allocations"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a["devices"].as_array().unwrap().len() as i64)
                    .sum();
            }
            "reservation.activated" => life.active = Some(at),
            _ => life.ended = Some(at),
        }
    }
    let mut out = BTreeMap::new();
    for life in lives.values() {
        let (Some(placed), Some(ended)) = (life.placed, life.ended) else {
            continue;
        };
        let e: &mut (i64, i64) = out.entry(life.key.clone()).or_default();
        match life.active {
            Some(a) => {
                e.0 += life.gpus * (ended - a);
                e.1 += life.gpus * (a - placed);
            }
            None => e.1 += life.gpus * (ended - placed),
        }
    }
    out
}

/// The report by queue, owner and class as (active, held) GPU-ms, and
/// whether it holds every event of the log.
fn shown(url: &str) -> (Usage, bool) {
    let rep = report(url, &["--by", "queue,owner,class"]);
    let rows = rep["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            let k = row["keys"].as_array().unwrap();
            let s = |i: usize| k[i].as_str().unwrap().to_string();
            (
                (s(0), s(1), s(2)),
                (
                    row["active_gpu_ms"].as_i64().unwrap(),
                    row["held_gpu_ms"].as_i64().unwrap(),
                ),
            )
        })
        .collect();
    (rows, rep["behind"] == 0)
}

/// Waits until the usage report of `url` equals the computation by hand
/// from its events, with every event counted, and `replay check` agrees.
fn wait_exact(url: &str, on_timeout: impl FnOnce()) {
    let mut last = (BTreeMap::new(), BTreeMap::new());
    testkit::wait_until(
        60,
        "the usage report equals the events",
        || {
            let (rows, caught_up) = shown(url);
            last = (rows.clone(), by_hand(url));
            caught_up && last.0 == last.1 && !rows.is_empty()
        },
        on_timeout,
    );
    let out = ok(&["replay", "check", "--database-url", url]);
    assert!(out.contains("ok: usage rollups at position"), "{out}");
}

fn ended(url: &str) -> usize {
    query(
        url,
        "SELECT count(*)::text FROM strata.events WHERE type = 'reservation.ended'",
    )[0][0]
        .parse()
        .unwrap()
}

/// `serve --roles placer,usage` named `name`, with short leases.
pub(crate) fn placer_and_usage(url: &str, name: &str, dir: &std::path::Path) -> Killed {
    let db = url.rsplit('/').next().unwrap().split('?').next().unwrap();
    Killed(spawn(
        &[
            "serve",
            "--roles",
            "placer,usage",
            "--database-url",
            url,
            "--lease-ttl",
            "2s",
            "--subscription-lease-ttl",
            "3s",
            "--holder",
            name,
            "--slot",
            &format!("usage_{name}_{db}"),
        ],
        &dir.join(format!("{name}.log")),
    ))
}

fn print_logs(dir: &std::path::Path) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        eprintln!("--- {:?} (newest first)\n{}", e.path(), tail.join("\n"));
    }
}

#[test]
fn the_rollups_stay_exact_when_the_usage_role_and_the_placer_are_taken_over() {
    let url = database();
    seeded_pool(&url, 4);
    let dir = tempfile::tempdir().unwrap();
    let a = placer_and_usage(&url, "a", dir.path());
    testkit::wait_until(
        30,
        "a holds the usage subscription and the pool",
        || {
            query(
                &url,
                "SELECT holder FROM strata.leases WHERE expires_at > now()
                  AND (name = 'subscription/usage' OR name = 'pool/gpu') ORDER BY name",
            )
            .iter()
            .filter(|r| r[0] == "a" || r[0].starts_with("usage_a_"))
            .count()
                == 2
        },
        || print_logs(dir.path()),
    );
    let _b = placer_and_usage(&url, "b", dir.path());
    for i in 0..6 {
        ok(&reserve_args(
            &url,
            &["--gpus", "2", "--ttl", "1s", "--id", &format!("r{i}")],
        ));
    }
    // SIGKILL: b takes both over when their leases run out.
    drop(a);
    for i in 6..12 {
        ok(&reserve_args(
            &url,
            &["--gpus", "2", "--ttl", "1s", "--id", &format!("r{i}")],
        ));
    }
    testkit::wait_until(
        60,
        "every reservation expired",
        || ended(&url) == 12,
        || print_logs(dir.path()),
    );
    wait_exact(&url, || print_logs(dir.path()));
    let holder = query(
        &url,
        "SELECT holder FROM strata.leases WHERE name = 'subscription/usage'",
    );
    assert!(holder[0][0].starts_with("usage_b_"), "{holder:?}");
}

/// The usage role and a placer against a primary and its streaming standby
/// through one multi-host URL: the primary crashes, the standby is
/// promoted (its log's positions jump to a new epoch), and the rollups on
/// it stay equal to its own log.
#[test]
fn the_rollups_follow_a_promoted_standby() {
    let mut primary = testkit::temp_cluster(&[]).unwrap();
    let url = super::placement::rt().block_on(testkit::migrated_database(&primary));
    let dbname = url.rsplit('/').next().unwrap().to_string();
    let standby = testkit::temp_standby(&primary).unwrap();
    let both = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{dbname}?target_session_attrs=read-write&connect_timeout=2",
        primary.port(),
        standby.port()
    );
    let on_standby = standby.url(&dbname);
    seeded_pool(&both, 2);
    let dir = tempfile::tempdir().unwrap();
    let _p = placer_and_usage(&both, "failover", dir.path());
    for i in 0..3 {
        ok(&reserve_args(
            &both,
            &["--gpus", "4", "--ttl", "1s", "--id", &format!("before{i}")],
        ));
    }
    testkit::wait_until(
        60,
        "the first three expired",
        || ended(&both) == 3,
        || print_logs(dir.path()),
    );
    wait_exact(&both, || print_logs(dir.path()));
    // The standby has the rollups as far as the primary has them.
    let cursor = |u: &str| {
        query(
            u,
            "SELECT position::text FROM strata.subscriptions WHERE name = 'usage'",
        )
    };
    let at = cursor(&both);
    testkit::wait_until(
        30,
        "the standby has the rollups",
        || cursor(&on_standby) == at,
        || {},
    );
    primary.crash();
    standby.promote().unwrap();
    for i in 0..3 {
        ok(&reserve_args(
            &on_standby,
            &["--gpus", "4", "--ttl", "1s", "--id", &format!("after{i}")],
        ));
    }
    testkit::wait_until(
        90,
        "the next three expired",
        || ended(&on_standby) == 6,
        || print_logs(dir.path()),
    );
    wait_exact(&on_standby, || print_logs(dir.path()));
}

fn report(url: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "usage",
        "report",
        "--database-url",
        url,
        "--since",
        "1d",
        "--until",
        "2099-01-01",
        "--output",
        "json",
    ];
    args.extend_from_slice(extra);
    serde_json::from_str(&ok(&args)).unwrap()
}

#[test]
fn a_usage_report_equals_a_hand_computation_from_the_events_of_a_real_run() {
    let r = region_with(
        "gateway,placer,binder,usage",
        &["--node-lost-after", "2s", "--preemption-grace", "1s"],
    );
    let node = r.node(&[]);
    r.wait_for_gpus();
    ok(&[
        "queues",
        "create",
        "research",
        "--database-url",
        &r.url,
        "--pool",
        "p",
        "--quota",
        "H100-80GB=8",
    ]);
    // Released by its owner.
    reserve_as(&r, "ana", "rel", 2, &[]);
    r.wait_until(60, "rel is active", || r.phase("rel") == "active");
    ok(&["release", "--database-url", &r.url, "rel"]);
    wait_ended(&r, "rel", "released");
    // Expired.
    reserve_as(&r, "bo", "ttl", 2, &["--ttl", "3s"]);
    wait_ended(&r, "ttl", "expired");
    // Preempted by a request of higher priority in its queue.
    reserve_as(&r, "ana", "low", 8, &[]);
    r.wait_until(60, "low is active", || r.phase("low") == "active");
    reserve_as(&r, "bo", "high", 4, &["--priority", "10"]);
    wait_ended(&r, "low", "preempted");
    r.wait_until(60, "high is active", || r.phase("high") == "active");
    // Lost with its node.
    drop(node);
    wait_ended(&r, "high", "failed");
    // Never placed (the node is gone), then cancelled.
    reserve_as(&r, "ana", "never", 1, &[]);
    ok(&["release", "--database-url", &r.url, "never"]);
    wait_ended(&r, "never", "released");

    let hand = by_hand(&r.url);
    assert_eq!(hand.len(), 2, "two owners in one queue and class: {hand:?}");
    // The report equals it, and replay check agrees.
    wait_exact(&r.url, || print_logs(r.dir.path()));
    for (key, (active, held)) in &hand {
        assert!(
            *active > 0 && *held > 0,
            "{key:?}: {active} active, {held} held"
        );
    }
    // The same hours by node, and in total, and as CSV.
    let rep = report(&r.url, &["--by", "node"]);
    let total: i64 = hand.values().map(|(a, _)| a).sum();
    assert_eq!(rep["rows"][0]["keys"][0], "n1");
    assert_eq!(rep["rows"][0]["active_gpu_ms"].as_i64().unwrap(), total);
    let rep = report(&r.url, &["--by", ""]);
    assert_eq!(rep["total"]["active_gpu_ms"].as_i64().unwrap(), total);
    assert_eq!(rep["total"]["reservations_ended"].as_i64().unwrap(), 5);
    // Billing weights: H100 hours count double.
    ok(&["usage", "weights", "--database-url", &r.url, "H100-80GB=2"]);
    let rep = report(&r.url, &["--by", "class"]);
    let billed = rep["rows"][0]["billed_hours"].as_f64().unwrap();
    let hours = rep["rows"][0]["gpu_hours"].as_f64().unwrap();
    assert!(
        (billed - 2.0 * hours).abs() < 1e-9,
        "{billed} vs 2 x {hours}"
    );
    let out = strata(&[
        "usage",
        "report",
        "--database-url",
        &r.url,
        "--since",
        "1d",
        "--by",
        "owner",
        "--output",
        "csv",
    ]);
    let csv = String::from_utf8(out.stdout).unwrap();
    assert!(csv.starts_with("owner,gpu_hours,"), "{csv}");
    assert_eq!(csv.lines().count(), 3, "{csv}");
    // Auditors' SQL sees the same hours.
    let rows = query(
        &r.url,
        "SELECT sum(gpu_hours)::text FROM audit.usage WHERE period = 'month'",
    );
    let audit_hours: f64 = rows[0][0].parse().unwrap();
    assert!((audit_hours - total as f64 / 3.6e6).abs() < 1e-6);
}
