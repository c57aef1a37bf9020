//! Rolling upgrades: this binary against the schema of the next release
//! (migrations a newer binary applied: one that expands, then one that
//! contracts), and `strata migrate --check`.

use crate::{append_args, ok, reserve_args, spawn, strata, tail_args};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Applies these migrations as a newer binary would.
fn migrate_as_newer(url: &str, migrations: Vec<schema::Migration>) -> Vec<i32> {
    rt().block_on(async {
        let mut c = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t")
            .await
            .unwrap();
        schema::migrate::migrate_with(&mut c, &migrations)
            .await
            .unwrap()
    })
}

fn json(args: &[&str]) -> (i32, serde_json::Value) {
    let out = strata(args);
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

#[test]
fn this_binary_runs_against_the_next_releases_expanded_schema_and_refuses_a_contracted_one() {
    let url = rt().block_on(testkit::fresh_database(testkit::shared_cluster()));
    let known = schema::migrate::known();
    // Only up to the previous schema: --check says what migrating would do.
    migrate_as_newer(
        &url,
        schema::MIGRATIONS[..schema::MIGRATIONS.len() - 1].to_vec(),
    );
    let (code, plan) = json(&["migrate", "--check", "--json", "--database-url", &url]);
    assert_eq!(code, 0, "{plan}");
    assert_eq!(plan["pending"][0]["version"], known);
    assert_eq!(plan["pending"][0]["change"], "expand");
    let last = schema::MIGRATIONS.last().unwrap();
    assert_eq!(plan["pending"][0]["name"], last.name, "{plan}");
    let first = plan["pending"][0]["statements"][0].as_str().unwrap();
    assert!(
        last.sql.contains(first) && !first.starts_with("--"),
        "{plan}"
    );
    ok(&["migrate", "--database-url", &url]);

    // The next release expands the schema: a column on the event table
    // and a table. This binary keeps working against it: it appends, its
    // reader decodes rows with the extra column, a placer places.
    let next = testkit::next_release(false);
    assert_eq!(migrate_as_newer(&url, next), [known + 1]);
    let out = ok(&["migrate", "--database-url", &url]);
    assert_eq!(out.trim(), "schema is up to date");
    let (code, plan) = json(&["migrate", "--check", "--json", "--database-url", &url]);
    assert_eq!(
        (code, plan["runnable"].clone()),
        (0, serde_json::json!(true)),
        "{plan}"
    );
    assert_eq!(plan["unknown"][0]["version"], known + 1);
    for i in 0..3 {
        ok(&append_args(
            &url,
            "upgrade/s",
            "test.appended",
            &format!(r#"{{"i":{i}}}"#),
            &[],
        ));
    }
    let tail = ok(&tail_args(&url, &["--from", "start", "--limit", "3"]));
    assert_eq!(tail.lines().count(), 3, "{tail}");
    ok(&["pool", "create", "gpu", "--database-url", &url]);
    ok(&[
        "pool",
        "seed",
        "gpu",
        "--database-url",
        &url,
        "--nodes",
        "1",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("placer.log");
    let mut placer = spawn(
        &[
            "serve",
            "--roles",
            "placer",
            "--database-url",
            &url,
            "--slot",
            "upgrade_placer",
        ],
        &log,
    );
    let out = ok(&reserve_args(
        &url,
        &[
            "--gpus",
            "8",
            "--shape",
            "node",
            "--id",
            "r1",
            "--wait",
            "--timeout",
            "60s",
        ],
    ));
    assert!(
        out.starts_with("placed r1"),
        "{out}\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    // The running placer is listed with the schema it knows.
    let (_, plan) = json(&["migrate", "--check", "--json", "--database-url", &url]);
    let procs = plan["processes"].as_array().unwrap();
    assert!(
        procs
            .iter()
            .any(|p| p["roles"] == "placer" && p["schema_known"] == known),
        "{plan}"
    );
    let _ = placer.kill();
    let _ = placer.wait();

    // The release after contracts what the expansion replaced: this binary
    // knows too little now and refuses the database, saying why, before it
    // writes anything.
    // (the placer's row is live still; a newer binary would wait for it)
    rt().block_on(async {
        let c = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t")
            .await
            .unwrap();
        c.batch_execute("DELETE FROM strata.processes")
            .await
            .unwrap();
    });
    assert_eq!(
        migrate_as_newer(&url, testkit::next_release(true)),
        [known + 2]
    );
    let out = strata(&[
        "serve",
        "--roles",
        "placer",
        "--database-url",
        &url,
        "--slot",
        "upgrade_refused",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("contracts the schema") && err.contains("upgrade strata"),
        "{err}"
    );
    let (code, plan) = json(&["migrate", "--check", "--json", "--database-url", &url]);
    assert_eq!(
        (code, plan["runnable"].clone()),
        (1, serde_json::json!(false)),
        "{plan}"
    );
}
