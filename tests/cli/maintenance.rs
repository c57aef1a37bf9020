//! The log's months: partitions sealed and verified by audit, retired only
//! when sealed and exported, and the maintenance role that seals closed
//! months and checkpoints the open one.

use super::placement::*;
use super::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use testkit::wait_for;

#[test]
fn partitions_seal_and_audit_verify() {
    let url = database();
    for i in 0..20 {
        let data = format!("{{\"i\":{i}}}");
        ok(&[
            "events",
            "append",
            "--database-url",
            &url,
            "--stream",
            "a/1",
            "--type",
            "t",
            "--data",
            &data,
        ]);
    }
    let rt = rt();
    let client = rt
        .block_on(events::db::connect(
            &url.parse::<tokio_postgres::Config>().unwrap(),
            "t",
        ))
        .unwrap();
    let month: String = rt
        .block_on(client.query_one("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM')", &[]))
        .unwrap()
        .get(0);
    let out = ok(&["partitions", "seal", &month, "--database-url", &url]);
    assert!(out.contains("20 rows"), "{out}");
    let err = fails(&["partitions", "seal", &month, "--database-url", &url]);
    assert!(err.contains("already sealed"), "{err}");
    assert!(ok(&["audit", "verify", &month, "--database-url", &url]).contains("intact: 20 rows"));
    // An archive of the month replays to the same position; a damaged one is refused.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.archive");
    let out = ok(&[
        "partitions",
        "export",
        &month,
        "--database-url",
        &url,
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(out.contains("exported 20 rows"), "{out}");
    let run = ok(&[
        "replay",
        "run",
        "--database-url",
        &url,
        "--archive",
        file.to_str().unwrap(),
    ]);
    assert!(
        run.contains("replayed 20 events from 1 archive(s) to position 20"),
        "{run}"
    );
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let err = fails(&[
        "replay",
        "run",
        "--database-url",
        &url,
        "--archive",
        file.to_str().unwrap(),
    ]);
    assert!(err.contains("checksum"), "{err}");
    rt.block_on(client.execute(
        "UPDATE strata.events SET payload = '{\"i\": 99}' WHERE position = 7",
        &[],
    ))
    .unwrap();
    let out = strata(&["audit", "verify", &month, "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("position 7 was altered"));
    let err = fails(&["audit", "verify", "2026-13", "--database-url", &url]);
    assert!(err.contains("YYYY-MM"), "{err}");
}

#[test]
fn partitions_retire_only_sealed_and_exported_months() {
    let url = database();
    let rt = rt();
    let client = rt
        .block_on(events::db::connect(
            &url.parse::<tokio_postgres::Config>().unwrap(),
            "t",
        ))
        .unwrap();
    // An old month with one row in it.
    rt.block_on(client.batch_execute(
        "SELECT strata.ensure_partition('2024-01-15T00:00:00Z');
         INSERT INTO strata.events (position, stream, version, type, payload, metadata, recorded_at, xid)
         VALUES (1, 'old/x', 1, 't', '{}', '{}', '2024-01-15T00:00:00Z', pg_current_xact_id());",
    ))
    .unwrap();
    let retire = |extra: &[&str]| {
        let mut args = vec![
            "partitions",
            "retire",
            "--database-url",
            &url,
            "--older-than",
            "13mo",
        ];
        args.extend_from_slice(extra);
        strata(&args)
    };
    let out = retire(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("events_2024_01: kept, not sealed"));
    ok(&["partitions", "seal", "2024-01", "--database-url", &url]);
    let out = retire(&[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("kept, not exported"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("2024-01.archive");
    ok(&[
        "partitions",
        "export",
        "2024-01",
        "--database-url",
        &url,
        "--out",
        file.to_str().unwrap(),
    ]);
    let out = retire(&["--dry-run"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("events_2024_01: would be dropped"));
    assert!(ok(&["partitions", "list", "--database-url", &url]).contains("events_2024_01"));
    // A reader (an auditor's open transaction) holds the event table: the
    // detach waits for it without holding up the statements queued behind
    // it (it gives its place up after a lock timeout and tries again), and
    // goes through once the reader is gone.
    let (reader, others) = rt.block_on(async {
        let cfg = url.parse::<tokio_postgres::Config>().unwrap();
        let reader = events::db::connect(&cfg, "reader").await.unwrap();
        reader
            .batch_execute("BEGIN; SELECT count(*) FROM strata.events")
            .await
            .unwrap();
        (reader, events::db::connect(&cfg, "others").await.unwrap())
    });
    let retiring = {
        let url = url.clone();
        std::thread::spawn(move || {
            strata(&[
                "partitions",
                "retire",
                "--database-url",
                &url,
                "--older-than",
                "13mo",
            ])
        })
    };
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    while started.elapsed() < Duration::from_secs(5) {
        let t = Instant::now();
        rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                others.query_one("SELECT count(*) FROM strata.events", &[]),
            )
            .await
        })
        .expect("a statement queued behind the detach, which waits for the reader")
        .unwrap();
        slowest = slowest.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        slowest < Duration::from_secs(3),
        "a statement waited {slowest:?} behind the detach"
    );
    assert!(!retiring.is_finished(), "the detach went past the reader");
    rt.block_on(reader.batch_execute("ROLLBACK")).unwrap();
    let out = retiring.join().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("events_2024_01: detached and dropped"));
    assert!(!ok(&["partitions", "list", "--database-url", &url]).contains("events_2024_01"));
    // The archive still replays what was dropped.
    let run = ok(&[
        "replay",
        "run",
        "--database-url",
        &url,
        "--archive",
        file.to_str().unwrap(),
    ]);
    assert!(run.contains("replayed 1 events from 1 archive(s)"), "{run}");
    // An archive needs no database.
    let run = ok(&[
        "replay",
        "run",
        "--projection",
        "reservations",
        "--archive",
        file.to_str().unwrap(),
    ]);
    assert!(run.contains("replayed 1 events from 1 archive(s)"), "{run}");
    let err = fails(&[
        "partitions",
        "retire",
        "--database-url",
        &url,
        "--older-than",
        "13",
    ]);
    assert!(err.contains("13mo"), "{err}");
}

#[test]
fn the_maintenance_role_seals_closed_months_and_checkpoints_the_open_one() {
    let url = database();
    let rt = rt();
    let month: String = rt.block_on(async {
        let c = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t")
            .await
            .unwrap();
        // A row in a month long closed, written as a late appender would.
        c.batch_execute(
            "SELECT strata.ensure_partition('2024-01-15T00:00:00Z');
             UPDATE strata.log_head SET last_position = 1;
             INSERT INTO strata.events (position, stream, version, type, payload, recorded_at)
             VALUES (1, 'old/x', 1, 't', '{}', '2024-01-15T00:00:00Z');",
        )
        .await
        .unwrap();
        c.query_one("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM')", &[])
            .await
            .unwrap()
            .get(0)
    });
    for i in 0..3 {
        ok(&append_args(
            &url,
            "now/x",
            "t",
            &format!("{{\"i\":{i}}}"),
            &[],
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("m.log");
    let mut server = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "serve",
            "--roles",
            "maintenance",
            "--database-url",
            &url,
            "--seal-every",
            "1s",
            "--seal-grace",
            "0s",
            "--slot",
            "sealer_cli",
        ])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let sealed = wait_for(60, || {
        let out = strata(&["audit", "verify", "2024-01", "--database-url", &url]);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    let open = wait_for(30, || {
        let out = strata(&["audit", "verify", &month, "--database-url", &url]);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    server.kill().unwrap();
    server.wait().unwrap();
    let logs = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        sealed
            .as_deref()
            .is_some_and(|s| s.contains("intact: 1 rows")),
        "{sealed:?}\n{logs}"
    );
    assert!(logs.contains("sealed a closed month"), "{logs}");
    assert!(
        open.as_deref()
            .is_some_and(|s| s.contains("3 rows match its 1 running checkpoint")),
        "{open:?}\n{logs}"
    );
}
