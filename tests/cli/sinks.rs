//! Sinks end to end: the commands that define, list, pause and refuse them,
//! and a sinks process killed mid-stream that loses nothing.

use super::placement::*;
use super::*;
use std::process::{Command, Stdio};
use std::time::Duration;
use testkit::wait_for;

#[test]
fn sinks_commands_define_list_pause_and_refuse_bad_input() {
    let url = database();
    let err = fails(&[
        "sinks",
        "create",
        "h1",
        "--database-url",
        &url,
        "--webhook",
        "ftp://x",
        "--secret-env",
        "STRATA_SINK_SECRET_H1",
    ]);
    assert!(err.contains("http://"), "{err}");
    let err = fails(&[
        "serve",
        "--roles",
        "sinks",
        "--database-url",
        &url,
        "--webhook-ca",
        "/nonexistent/ca.pem",
    ]);
    assert!(
        err.contains("--webhook-ca") && err.contains("/nonexistent/ca.pem"),
        "{err}"
    );
    let err = fails(&[
        "sinks",
        "create",
        "bad name",
        "--database-url",
        &url,
        "--webhook",
        "http://127.0.0.1:9/h",
        "--secret-env",
        "STRATA_SINK_SECRET_H1",
    ]);
    assert!(err.contains("sink name"), "{err}");
    ok(&[
        "sinks",
        "create",
        "h1",
        "--database-url",
        &url,
        "--webhook",
        "http://127.0.0.1:9/h",
        "--secret-env",
        "STRATA_SINK_SECRET_H1",
        "--prefixes",
        "pool/",
        "--types",
        "reservation.placed",
    ]);
    let err = fails(&[
        "sinks",
        "create",
        "h1",
        "--database-url",
        &url,
        "--webhook",
        "http://127.0.0.1:9/h",
        "--secret-env",
        "STRATA_SINK_SECRET_H1",
    ]);
    assert!(err.contains("already exists"), "{err}");
    // The secret comes only from a variable meant for it, not, say, from
    // the sinks process's database URL.
    for var in [
        "STRATA_DATABASE_URL",
        "PATH",
        "STRATA_SINK_SECRET_",
        "STRATA_SINK_SECRET_a",
    ] {
        let err = fails(&[
            "sinks",
            "create",
            "h2",
            "--database-url",
            &url,
            "--webhook",
            "http://127.0.0.1:9/h",
            "--secret-env",
            var,
        ]);
        assert!(err.contains("STRATA_SINK_SECRET_<NAME>"), "{var}: {err}");
    }
    let list = ok(&["sinks", "list", "--database-url", &url]);
    assert!(
        list.contains("h1") && list.contains("active") && list.contains("not started"),
        "{list}"
    );
    ok(&["sinks", "pause", "h1", "--database-url", &url]);
    assert!(ok(&["sinks", "list", "--database-url", &url]).contains("paused"));
    ok(&["sinks", "resume", "h1", "--database-url", &url]);
    let parked = ok(&["sinks", "parked", "list", "h1", "--database-url", &url]);
    assert_eq!(parked.lines().count(), 1, "only the header: {parked}");
    // Reset needs the sink paused; then it sets the cursor.
    let err = fails(&["sinks", "reset", "h1", "--database-url", &url, "--to", "3"]);
    assert!(err.contains("pause sink"), "{err}");
    ok(&["sinks", "pause", "h1", "--database-url", &url]);
    ok(&["sinks", "reset", "h1", "--database-url", &url, "--to", "3"]);
    let shown: serde_json::Value =
        serde_json::from_str(&ok(&["sinks", "show", "h1", "--database-url", &url])).unwrap();
    assert_eq!(shown["cursor"], 3, "{shown}");
    assert_eq!(shown["paused"], true);
    ok(&[
        "sinks",
        "reset",
        "h1",
        "--database-url",
        &url,
        "--to",
        "2000-01-01T00:00:00Z",
    ]);
    let shown: serde_json::Value =
        serde_json::from_str(&ok(&["sinks", "show", "h1", "--database-url", &url])).unwrap();
    assert_eq!(shown["cursor"], 0, "from the beginning of time: {shown}");
    let err = fails(&[
        "sinks",
        "reset",
        "h1",
        "--database-url",
        &url,
        "--to",
        "yesterday",
    ]);
    assert!(err.contains("a position"), "{err}");
    ok(&["sinks", "resume", "h1", "--database-url", &url]);
    let err = fails(&["sinks", "pause", "nope", "--database-url", &url]);
    assert!(err.contains("does not exist"), "{err}");
    ok(&["sinks", "delete", "h1", "--database-url", &url]);
    assert!(!ok(&["sinks", "list", "--database-url", &url]).contains("h1"));
    // The definitions are events like everything else.
    let log = ok(&[
        "events",
        "tail",
        "--database-url",
        &url,
        "--from",
        "start",
        "--limit",
        "8",
    ]);
    for t in [
        "sink.created",
        "sink.paused",
        "sink.resumed",
        "sink.reset",
        "sink.deleted",
    ] {
        assert!(log.contains(t), "{t} missing: {log}");
    }
    // Deleting again does nothing and says so; a deleted sink is not there
    // to pause; its name can be used again, from the new definition's start.
    let again = ok(&["sinks", "delete", "h1", "--database-url", &url]);
    assert!(again.contains("deleted already"), "{again}");
    let deleted = super::gateway::query(
        &url,
        "SELECT count(*)::text FROM strata.events WHERE stream = 'sink/h1' AND type = 'sink.deleted'",
    );
    assert_eq!(
        deleted[0][0], "1",
        "one sink.deleted however often it is deleted"
    );
    let out = super::strata(&["sinks", "pause", "h1", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(6), "a deleted sink is not found");
    let err = fails(&[
        "sinks",
        "create",
        "h1",
        "--database-url",
        &url,
        "--webhook",
        "http://127.0.0.1:9/h",
        "--secret-env",
        "STRATA_SINK_SECRET_H1",
        "--retry-base",
        "0s",
    ]);
    assert!(err.contains("retry backoff"), "{err}");
    ok(&[
        "sinks",
        "create",
        "h1",
        "--database-url",
        &url,
        "--webhook",
        "http://127.0.0.1:9/h",
        "--secret-env",
        "STRATA_SINK_SECRET_H1",
        "--from",
        "now",
        "--retry-base",
        "1s",
        "--retry-cap",
        "5s",
    ]);
    let shown: serde_json::Value =
        serde_json::from_str(&ok(&["sinks", "show", "h1", "--database-url", &url])).unwrap();
    assert_eq!(shown["paused"], false, "{shown}");
    assert_eq!(
        shown["cursor"],
        serde_json::Value::Null,
        "none of the old cursor: {shown}"
    );
    assert_eq!(shown["config"]["start"], "now", "{shown}");
    assert_eq!(
        shown["config"]["retry"],
        serde_json::json!({"base_ms": 1000, "cap_ms": 5000})
    );
    let err = fails(&[
        "sinks",
        "create",
        "h1",
        "--database-url",
        &url,
        "--webhook",
        "http://127.0.0.1:9/h",
        "--secret-env",
        "STRATA_SINK_SECRET_H1",
    ]);
    assert!(
        err.contains("already exists"),
        "a live sink's name is taken: {err}"
    );

    // NATS: a stream nobody created is an error at create, unless asked to
    // create it; a second sink on the same subjects finds it.
    let nats_url =
        std::env::var("STRATA_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let prefix = format!("strata_cli_{}", std::process::id());
    let nats = |name: &str, extra: &[&str]| {
        let mut args = vec![
            "sinks",
            "create",
            name,
            "--database-url",
            &url,
            "--nats",
            &nats_url,
            "--subject-prefix",
            &prefix,
        ];
        args.extend_from_slice(extra);
        super::strata(&args)
    };
    let out = nats("n1", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no JetStream stream") && err.contains("--create-stream"),
        "{err}"
    );
    assert!(
        !ok(&["sinks", "list", "--database-url", &url]).contains("n1"),
        "not defined"
    );
    let out = nats("n1", &["--create-stream"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!("created the JetStream stream {prefix}")),
        "{err}"
    );
    let out = nats("n2", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!("JetStream stream {prefix} stores")),
        "{err}"
    );
    super::events_conform(&url, &[]);
}

/// A minimal HTTP/1.1 receiver on a thread: records the positions of every
/// event POSTed to it, in arrival order, and answers 200.
pub(crate) fn http_receiver() -> (String, std::sync::Arc<std::sync::Mutex<Vec<u64>>>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut w = stream.try_clone().unwrap();
                let mut r = BufReader::new(stream);
                loop {
                    let mut len = 0usize;
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0; len];
                    r.read_exact(&mut body).unwrap();
                    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    let mut seen = s.lock().unwrap();
                    for e in v["events"].as_array().unwrap() {
                        seen.push(e["position"].as_u64().unwrap());
                    }
                    drop(seen);
                    if w.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (url, seen)
}

#[test]
fn a_sinks_process_killed_mid_stream_loses_nothing() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let (hook, seen) = http_receiver();
    ok(&[
        "sinks",
        "create",
        "k",
        "--database-url",
        &url,
        "--webhook",
        &hook,
        "--secret-env",
        "STRATA_SINK_SECRET_HOOK",
        "--prefixes",
        "load/",
        "--batch",
        "50",
    ]);
    let rt = rt();
    let _entered = rt.enter();
    let appender = events::Appender::start(
        url.parse::<events::db::Database>().unwrap(),
        events::AppenderConfig::default(),
    );
    let write = |from: usize, n: usize| {
        rt.block_on(async {
            for i in from..from + n {
                let e = events::NewEvent::new("load.tick", &serde_json::json!({ "i": i }));
                appender
                    .append(
                        &format!("load/{}", i % 4),
                        events::ExpectedVersion::Any,
                        vec![e],
                    )
                    .await
                    .unwrap();
            }
        })
    };
    let sinks = |slot: &str, log: &str| {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args([
                "serve",
                "--roles",
                "sinks",
                "--database-url",
                &url,
                "--slot",
                slot,
                "--subscription-lease-ttl",
                "2s",
            ])
            .env("STRATA_SINK_SECRET_HOOK", "s3cret")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join(log)).unwrap())
            .spawn()
            .unwrap()
    };
    // The same events to NATS JetStream: after the kill, stored exactly once.
    let nats_url =
        std::env::var("STRATA_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let prefix = format!("strata_k{}", std::process::id());
    let js_name = format!("STRATA_K{}", std::process::id());
    let js = rt.block_on(async {
        let js = async_nats::jetstream::new(
            async_nats::connect(&nats_url)
                .await
                .expect("a NATS server with JetStream (.ci/run starts one)"),
        );
        let _ = js.delete_stream(&js_name).await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: js_name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: std::time::Duration::from_secs(300),
            ..Default::default()
        })
        .await
        .unwrap();
        js
    });
    ok(&[
        "sinks",
        "create",
        "kn",
        "--database-url",
        &url,
        "--nats",
        &nats_url,
        "--subject-prefix",
        &prefix,
        "--prefixes",
        "load/",
        "--batch",
        "50",
    ]);
    write(0, 1000);
    let mut first = sinks("sinks_a", "a.log");
    wait_for(30, || (seen.lock().unwrap().len() >= 300).then_some(())).expect("delivery started");
    first.kill().unwrap();
    first.wait().unwrap();
    write(1000, 500);
    let mut second = sinks("sinks_b", "b.log");
    let all: Vec<u64> = rt.block_on(async {
        let c = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t")
            .await
            .unwrap();
        c.query(
            "SELECT position FROM strata.events WHERE stream LIKE 'load/%' ORDER BY position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i64>(0) as u64)
        .collect()
    });
    assert_eq!(all.len(), 1500);
    let covered = || {
        let s = seen.lock().unwrap();
        let got: std::collections::BTreeSet<u64> = s.iter().copied().collect();
        all.iter().all(|p| got.contains(p))
    };
    wait_for(60, || covered().then_some(())).unwrap_or_else(|| {
        panic!(
            "every event delivered at least once; {} deliveries so far",
            seen.lock().unwrap().len()
        )
    });
    let stored = || {
        rt.block_on(async {
            js.get_stream(&js_name)
                .await
                .unwrap()
                .info()
                .await
                .unwrap()
                .state
                .messages
        })
    };
    wait_for(60, || (stored() >= 1500).then_some(())).expect("every event in JetStream");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        stored(),
        1500,
        "each event stored exactly once in JetStream"
    );
    // In order: after the takeover the second process starts at the last
    // acknowledgement, so the only repeats are one tail, and what arrives
    // never goes backwards except at that one restart.
    let s = seen.lock().unwrap().clone();
    let backwards = s.windows(2).filter(|w| w[1] <= w[0]).count();
    assert!(
        backwards <= 1,
        "{backwards} steps back in {} deliveries",
        s.len()
    );
    second.kill().unwrap();
    second.wait().unwrap();
    let _ = rt.block_on(js.delete_stream(&js_name));
    for slot in ["sinks_a", "sinks_b"] {
        ok(&["slots", "drop", slot, "--database-url", &url, "--force"]);
    }
    super::events_conform(&url, &["load.tick"]);
}
