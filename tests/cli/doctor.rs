//! `strata doctor` against a real PostgreSQL: a healthy database, then one
//! with problems made on purpose.

use super::{database, strata};

fn doctor_json(url: &str) -> (bool, serde_json::Value) {
    let out = strata(&["doctor", "--json", "--database-url", url]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), v)
}

fn status_of<'a>(v: &'a serde_json::Value, check: &str) -> Vec<&'a str> {
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["check"] == check)
        .map(|f| f["status"].as_str().unwrap())
        .collect()
}

fn sql(url: &str, statement: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t")
            .await
            .unwrap();
        c.batch_execute(statement).await.unwrap();
    });
}

#[test]
fn doctor_reports_what_a_database_lacks_and_fails_on_a_problem() {
    let url = database();
    let (ok, v) = doctor_json(&url);
    assert!(ok, "a migrated test database has no problem: {v}");
    assert_eq!(v["ok"], true);
    for check in [
        "schema",
        "wal_level",
        "publication",
        "partitions",
        "max_slot_wal_keep_size",
    ] {
        assert_eq!(status_of(&v, check), vec!["ok"], "{check}: {v}");
    }
    // The test cluster serves no TLS and has no standby: warnings, with advice.
    assert_eq!(status_of(&v, "tls"), vec!["warning"], "{v}");
    assert_eq!(status_of(&v, "synchronous_standby"), vec!["warning"], "{v}");
    let takeovers = |v: &serde_json::Value| -> String {
        v["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["check"] == "takeovers")
            .map(|f| f["detail"].as_str().unwrap().to_string())
            .unwrap_or_else(|| panic!("{v}"))
    };
    assert!(takeovers(&v).contains("none recorded"), "{v}");
    // Where a takeover cut the log is reported (not a problem).
    sql(
        &url,
        "INSERT INTO strata.log_epochs (first_position, previous_head, timeline)
         VALUES (1099511627777, 3, 2)",
    );
    let (ok, v) = doctor_json(&url);
    assert!(ok, "{v}");
    assert!(
        takeovers(&v).contains("timeline 2 began after position 3")
            && takeovers(&v).contains("positions from 1099511627777"),
        "{v}"
    );

    // Problems made on purpose: the publication gone, a slot nobody owns.
    let slot = format!("doctor_orphan_{}", std::process::id());
    sql(&url, "DROP PUBLICATION strata_events");
    sql(
        &url,
        &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"),
    );
    let (ok, v) = doctor_json(&url);
    assert!(!ok, "a missing publication fails the check: {v}");
    assert_eq!(status_of(&v, "publication"), vec!["problem"], "{v}");
    let stale = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "slots" && f["detail"].as_str().unwrap().contains(&slot))
        .unwrap_or_else(|| panic!("the orphan slot is reported: {v}"));
    assert_eq!(stale["status"], "warning");
    assert!(stale["advice"]
        .as_str()
        .unwrap()
        .contains("strata slots drop"));
    // The text form says the same, with what to do, and exits 1.
    let out = strata(&["doctor", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("PROBLEM") && text.contains("publication"),
        "{text}"
    );
    assert!(text.contains("-> run `strata migrate`"), "{text}");
    sql(&url, &format!("SELECT pg_drop_replication_slot('{slot}')"));

    // A database never migrated: the schema is the problem.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let bare = rt.block_on(testkit::fresh_database(testkit::shared_cluster()));
    let (ok, v) = doctor_json(&bare);
    assert!(!ok);
    assert_eq!(status_of(&v, "schema"), vec!["problem"], "{v}");
}
