//! The command line and `strata serve` through a real PgBouncer in
//! transaction mode, with `--database-direct-url` for what needs the server
//! itself.

use crate::{append_args, ok, reserve_args, spawn};

#[test]
fn appends_reservations_and_a_placer_work_through_pgbouncer() {
    let cluster = testkit::shared_cluster();
    let url = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(testkit::fresh_database(cluster));
    let name = url.rsplit('/').next().unwrap().to_string();
    let bouncer = testkit::temp_bouncer(cluster).unwrap();
    let pooled = bouncer.url(&name);
    let db = |extra: &[&'static str]| -> Vec<String> {
        let mut v: Vec<String> = vec![
            "--database-url".into(),
            pooled.clone(),
            "--database-direct-url".into(),
            url.clone(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let run = |args: &[&str], more: Vec<String>| -> String {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend(more);
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        ok(&refs)
    };
    run(&["migrate"], db(&[]));

    // The second of these failed with `prepared statement "s0" already
    // exists`: the first client's statement was left on the server
    // connection PgBouncer lent the second.
    for i in 0..4 {
        let data = format!(r#"{{"n":{i}}}"#);
        let out = ok(&append_args(
            &pooled,
            "through/pgbouncer",
            "test.appended",
            &data,
            &["--database-direct-url", &url],
        ));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["version"].as_u64(), Some(i + 1), "{out}");
    }
    let read = run(
        &["events", "tail", "--from", "start", "--limit", "4"],
        db(&[]),
    );
    assert_eq!(read.lines().count(), 4, "{read}");

    // A placer whose every connection but the replication stream goes
    // through PgBouncer places reservations made through it too.
    run(&["pool", "create", "gpu"], db(&[]));
    run(&["pool", "seed", "gpu"], db(&["--nodes", "2"]));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("placer.log");
    let mut args = vec![
        "serve",
        "--roles",
        "placer,maintenance",
        "--slot",
        "pooled_placer",
    ];
    let more = db(&[]);
    args.extend(more.iter().map(String::as_str));
    let mut placer = spawn(&args, &log);
    for id in ["one", "two"] {
        let out = ok(&reserve_args(
            &pooled,
            &[
                "--database-direct-url",
                &url,
                "--gpus",
                "8",
                "--shape",
                "node",
                "--id",
                id,
                "--wait",
                "--timeout",
                "60s",
            ],
        ));
        assert!(
            out.starts_with(&format!("placed {id}")),
            "{out}\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    let check = run(
        &["replay", "check", "--json"],
        vec!["--database-url".into(), pooled.clone()],
    );
    let v: serde_json::Value = serde_json::from_str(&check).unwrap();
    assert_eq!(v["live"], 2, "{check}");
    let _ = placer.kill();
    let _ = placer.wait();
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!log.contains("prepared statement"), "{log}");
    drop(bouncer);
}
