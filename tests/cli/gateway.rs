//! Gateways and node daemons as real processes: a gateway killed with
//! SIGKILL while a command runs; its node re-homes and the command completes
//! exactly once.

use super::{database, ok, spawn};
use std::process::Child;
use std::time::Instant;

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub(crate) fn gateway(url: &str, id: &str, port: u16, ca: &str, log: &std::path::Path) -> Child {
    let listen = format!("127.0.0.1:{port}");
    spawn(
        &[
            "serve",
            "--roles",
            "gateway",
            "--database-url",
            url,
            "--listen",
            &listen,
            "--ca-dir",
            ca,
            "--gateway-id",
            id,
            "--heartbeat",
            "1s",
            "--ack-hold",
            "500ms",
            "--slot",
            &slot(id),
        ],
        log,
    )
}

/// A region CA in `ca`, pool `p` and a join token for any node of it.
pub(crate) fn ca_pool_and_token(url: &str, ca: &str) -> String {
    ok(&["ca", "init", "--dir", ca]);
    ok(&["pool", "create", "p", "--database-url", url]);
    ok(&[
        "tokens",
        "create",
        "--pool",
        "p",
        "--nodes",
        "*",
        "--database-url",
        url,
    ])
    .trim()
    .to_string()
}

fn slot(gateway: &str) -> String {
    format!("gw_{}", gateway.replace('-', "_"))
}

pub(crate) fn query(url: &str, sql: &str) -> Vec<Vec<String>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t")
            .await
            .unwrap();
        c.query(sql, &[])
            .await
            .unwrap()
            .iter()
            .map(|r| {
                (0..r.len())
                    .map(|i| r.get::<_, Option<String>>(i).unwrap_or_default())
                    .collect()
            })
            .collect()
    })
}

fn wait_until(secs: u64, what: &str, logs: &std::path::Path, f: impl FnMut() -> bool) {
    testkit::wait_until(secs, what, f, || {
        for log in ["a.log", "b.log", "node.log"] {
            let text = std::fs::read_to_string(logs.join(log)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            eprintln!("--- {log} (last lines, newest first)\n{}", tail.join("\n"));
        }
    })
}

#[test]
fn a_gateway_killed_mid_command_hands_its_node_over_and_the_command_runs_once() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    let ca_s = ca.to_str().unwrap();
    let token = ca_pool_and_token(&url, ca_s);
    let (pa, pb) = (free_port(), free_port());
    let mut gws = vec![
        (
            "gw-a",
            gateway(&url, "gw-a", pa, ca_s, &dir.path().join("a.log")),
        ),
        (
            "gw-b",
            gateway(&url, "gw-b", pb, ca_s, &dir.path().join("b.log")),
        ),
    ];
    let gateways = format!("https://127.0.0.1:{pa},https://127.0.0.1:{pb}");
    let ca_pem = ca.join("ca.pem");
    let node_dir = dir.path().join("n1");
    let mut node = spawn(
        &[
            "node",
            "--gateway",
            &gateways,
            "--data-dir",
            node_dir.to_str().unwrap(),
            "--node-id",
            "n1",
            "--token",
            &token,
            "--ca",
            ca_pem.to_str().unwrap(),
            "--fake-gpus",
            "8xH100-80GB",
            "--fake-diag-delay",
            "2s",
        ],
        &dir.path().join("node.log"),
    );
    let holder = || {
        query(
            &url,
            "SELECT payload->>'gateway' FROM strata.events WHERE stream = 'node/n1' AND type = 'node.session_opened' ORDER BY version",
        )
    };
    wait_until(30, "the node's session opens", dir.path(), || {
        !holder().is_empty()
    });
    let first = holder()[0][0].clone();
    wait_until(
        20,
        "the node's inventory is in the pool",
        dir.path(),
        || {
            !query(
                &url,
                "SELECT 1::text FROM strata.events WHERE stream = 'pool/p' AND type = 'node.joined'",
            )
            .is_empty()
        },
    );

    ok(&[
        "commands",
        "issue",
        "--database-url",
        &url,
        "--node",
        "n1",
        "--kind",
        "diag.nvml",
        "--id",
        "c1",
    ]);
    let types = || -> Vec<String> {
        query(
            &url,
            "SELECT type FROM strata.events WHERE stream = 'command/c1' ORDER BY version",
        )
        .into_iter()
        .map(|r| r[0].clone())
        .collect()
    };
    wait_until(20, "c1 is acked", dir.path(), || types().len() == 2);
    // Kill the gateway holding the session while diag.nvml runs (2 s).
    let at = gws.iter().position(|(id, _)| *id == first).unwrap();
    let (_, mut dead) = gws.remove(at);
    dead.kill().unwrap();
    dead.wait().unwrap();
    wait_until(30, "the node re-homes", dir.path(), || holder().len() == 2);
    assert_ne!(
        holder()[1][0],
        first,
        "the second session is on the other gateway"
    );
    wait_until(30, "c1 finishes", dir.path(), || types().len() == 3);
    assert_eq!(
        types(),
        ["command.issued", "command.acked", "command.succeeded"]
    );
    // The node ran it once: one start and one result in its command log.
    let log = std::fs::read_to_string(node_dir.join("commands.log")).unwrap();
    let c1: Vec<&str> = log.lines().filter(|l| l.contains("\"c1\"")).collect();
    assert_eq!(c1.len(), 2, "{log}");
    assert!(
        c1[0].contains("\"id\":\"c1\"") && !c1[0].contains("outcome"),
        "{log}"
    );
    let shown = ok(&["commands", "show", "c1", "--database-url", &url]);
    assert!(shown.contains("\"succeeded\""), "{shown}");
    let listed = ok(&["commands", "list", "--database-url", &url, "--node", "n1"]);
    assert!(
        listed.contains("c1") && listed.contains("succeeded"),
        "{listed}"
    );
    let nodes = ok(&["nodes", "list", "--database-url", &url]);
    assert!(
        nodes.contains("n1") && nodes.contains("valid until"),
        "{nodes}"
    );

    node.kill().unwrap();
    node.wait().unwrap();
    for (id, mut g) in gws {
        g.kill().unwrap();
        g.wait().unwrap();
        ok(&[
            "slots",
            "drop",
            &slot(id),
            "--database-url",
            &url,
            "--force",
        ]);
    }
    ok(&[
        "slots",
        "drop",
        &slot(&first),
        "--database-url",
        &url,
        "--force",
    ]);
    super::events_conform(&url, &[]);
}

/// The sum of `strata_task_restarts_total` on a process's metrics endpoint.
fn restarts(at: &str) -> f64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(at).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {at}\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.lines()
        .filter(|l| l.starts_with("strata_task_restarts_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A child process killed when dropped, so a failed test leaves none behind.
pub(crate) struct Killed(pub(crate) Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_role_survives_a_postgres_crash_restart() {
    // Its own cluster: this test crashes it.
    let mut cluster = testkit::temp_cluster(&[]).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = rt.block_on(testkit::fresh_database(&cluster));
    ok(&["migrate", "--database-url", &url]);
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    let ca_s = ca.to_str().unwrap();
    let token = ca_pool_and_token(&url, ca_s);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let metrics_at = format!("127.0.0.1:{}", free_port());
    let mut serve = Killed(spawn(
        &[
            "serve",
            "--roles",
            "gateway,placer,binder,maintenance,sinks",
            "--database-url",
            &url,
            "--listen",
            &listen,
            "--metrics-listen",
            &metrics_at,
            "--ca-dir",
            ca_s,
            "--heartbeat",
            "1s",
            "--lease-ttl",
            "2s",
            "--slot",
            "all_roles",
        ],
        &dir.path().join("a.log"),
    ));
    let ca_pem = ca.join("ca.pem");
    let mut node = Killed(spawn(
        &[
            "node",
            "--gateway",
            &format!("https://{listen}"),
            "--data-dir",
            dir.path().join("n1").to_str().unwrap(),
            "--node-id",
            "n1",
            "--token",
            &token,
            "--ca",
            ca_pem.to_str().unwrap(),
            "--fake-gpus",
            "8xH100-80GB",
        ],
        &dir.path().join("node.log"),
    ));
    let active = |id: &str| {
        let sql = format!(
            "SELECT 1::text FROM strata.events WHERE stream = 'reservation/{id}' AND type = 'reservation.activated'"
        );
        let url = url.clone();
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let Ok(c) =
                    events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t").await
                else {
                    return false;
                };
                c.query(&sql, &[]).await.is_ok_and(|rows| !rows.is_empty())
            })
        }
    };
    let reserve = |id: &str| {
        super::strata(&[
            "reserve",
            "--database-url",
            &url,
            "--pool",
            "p",
            "--class",
            "H100-80GB",
            "--gpus",
            "4",
            "--id",
            id,
        ])
    };
    // A request before the node's inventory would be rejected (nothing fits).
    wait_until(
        30,
        "the node's inventory is in the pool",
        dir.path(),
        || {
            !query(
            &url,
            "SELECT 1::text FROM strata.events WHERE stream = 'pool/p' AND type = 'node.joined'",
        )
        .is_empty()
        },
    );
    assert!(reserve("before").status.success());
    wait_until(
        30,
        "the first reservation is active",
        dir.path(),
        active("before"),
    );
    // Every role's metrics pass Prometheus' linter, with stable labels.
    let text = super::scrape_and_lint(
        &metrics_at,
        &[
            "strata_append_events_total",
            "strata_subscription_lag_events{subscription=\"projector\"}",
            "strata_subscription_lag_seconds",
            "strata_placer_placed_total 1",
            "strata_placer_pools_held 1",
            "strata_binder_binds_total 1",
            "strata_binder_activated_total 1",
            "strata_gateway_sessions 1",
            "strata_gateway_handshakes_total{result=\"ok\"}",
            "strata_gateway_refused_total{reason=\"identity\"}",
            "strata_gateway_rpcs_total{code=\"Ok\",method=\"Join\",service=\"strata.node.v1.Join\"}",
            "strata_gateway_command_dispatch_seconds_count",
            "strata_sink_workers 0",
            "strata_replication_lag_bytes",
            "strata_slot_retained_wal_bytes{slot=\"all_roles\"}",
            "strata_slot_active{slot=\"all_roles\"} 1",
            "strata_serving_certificate_expiry_timestamp_seconds{server=\"gateway\"}",
        ],
    );
    assert!(!text.contains("holder="), "{text}");

    // PostgreSQL crashes (every server process ends at once) and stays
    // away for a while: the roles say so in their log and metrics and keep
    // trying, and neither serve nor the node exits.
    let restarts_before = restarts(&metrics_at);
    cluster.crash();
    let log = dir.path().join("a.log");
    let said = |what: &str| std::fs::read_to_string(&log).unwrap().matches(what).count();
    let warned_before = said("task failed; starting it again");
    wait_until(30, "serve reports the database away", dir.path(), || {
        said("task failed; starting it again") >= warned_before + 3
    });
    assert!(
        restarts(&metrics_at) > restarts_before,
        "strata_task_restarts_total counts it"
    );
    assert!(serve.0.try_wait().unwrap().is_none(), "strata serve exited");
    cluster.restart().unwrap();
    let back = Instant::now();
    wait_until(30, "a reservation is accepted again", dir.path(), || {
        reserve("after").status.success()
    });
    wait_until(
        30,
        "placed and active after the restart",
        dir.path(),
        active("after"),
    );
    eprintln!("placed and active {:?} after the restart", back.elapsed());
    // The binder's and the pool's leases are renewed again after the
    // restart (neither holder kept a dead connection, nor exited).
    wait_until(
        30,
        "both leases renewed after the restart",
        dir.path(),
        || {
            query(
                &url,
                "SELECT count(*)::text FROM strata.leases
              WHERE name IN ('binder', 'pool/p') AND expires_at > now()
                AND renewed_at > pg_postmaster_start_time()",
            )[0][0]
                == "2"
        },
    );
    assert!(serve.0.try_wait().unwrap().is_none(), "strata serve exited");
    assert!(
        node.0.try_wait().unwrap().is_none(),
        "the node daemon exited"
    );
    // And placement goes on past them.
    ok(&["release", "before", "--database-url", &url]);
    wait_until(30, "a third reservation is accepted", dir.path(), || {
        reserve("later").status.success()
    });
    wait_until(30, "the third is active", dir.path(), active("later"));
    let check: serde_json::Value =
        serde_json::from_str(&ok(&["replay", "check", "--database-url", &url, "--json"])).unwrap();
    assert_eq!(check["live"], 2, "{check}");
    // And against the tables themselves, past every crash.
    let inv: serde_json::Value = serde_json::from_str(&ok(&[
        "replay",
        "invariants",
        "--database-url",
        &url,
        "--json",
    ]))
    .unwrap();
    assert_eq!(inv["violations"], serde_json::json!([]), "{inv}");
    assert!(inv["placements"].as_u64().unwrap() >= 3, "{inv}");
    super::events_conform(&url, &[]);
}

/// `strata tokens list|revoke` and `strata grants list|remove`, for scripts
/// as for people.
#[test]
fn tokens_and_grants_are_listed_and_taken_back() {
    let url = database();
    ok(&["pool", "create", "p", "--database-url", &url]);
    let out = super::strata(&[
        "tokens",
        "create",
        "--pool",
        "p",
        "--nodes",
        "gpu-*",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    let id = said
        .split("(id ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("{said}"))
        .to_string();
    let token = String::from_utf8(out.stdout).unwrap();
    let listed = ok(&["tokens", "list", "--json", "--database-url", &url]);
    let rows = super::lines(&listed);
    assert_eq!(rows.len(), 1, "{listed}");
    assert_eq!(rows[0]["id"], id.as_str());
    assert_eq!(rows[0]["state"], "valid");
    assert_eq!(rows[0]["admits"], "gpu-*");
    assert!(
        !listed.contains(token.trim()),
        "the token itself is never shown"
    );
    let out = ok(&["tokens", "revoke", &id, "--database-url", &url]);
    assert!(out.contains("revoked"), "{out}");
    let table = ok(&["tokens", "list", "--database-url", &url]);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&id) && l.contains("expired")),
        "{table}"
    );
    let out = ok(&["tokens", "revoke", &id, "--database-url", &url]);
    assert!(out.contains("nothing to do"), "{out}");
    let out = super::strata(&[
        "tokens",
        "revoke",
        "00000000000000aa",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(6), "not found");
    let out = super::strata(&["tokens", "revoke", "nope", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("16 hex digits"));

    ok(&[
        "grants",
        "set",
        "alice",
        "--prefixes",
        "pool/,reservation/",
        "--database-url",
        &url,
    ]);
    ok(&[
        "grants",
        "set",
        "bob",
        "--prefixes",
        "sink/",
        "--types",
        "sink.created",
        "--database-url",
        &url,
    ]);
    let rows = super::lines(&ok(&["grants", "list", "--json", "--database-url", &url]));
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["caller"], "alice");
    assert_eq!(
        rows[0]["stream_prefixes"],
        serde_json::json!(["pool/", "reservation/"])
    );
    assert_eq!(rows[1]["types"], serde_json::json!(["sink.created"]));
    ok(&["grants", "remove", "alice", "--database-url", &url]);
    let table = ok(&["grants", "list", "--database-url", &url]);
    assert!(!table.contains("alice") && table.contains("bob"), "{table}");
    let out = super::strata(&["grants", "remove", "alice", "--database-url", &url]);
    assert_eq!(
        out.status.code(),
        Some(6),
        "a grant removed twice is not found"
    );
    super::events_conform(&url, &[]);
}

/// One trace follows a reservation across processes: `strata reserve`
/// stores its span's `traceparent` in `reservation.requested`'s metadata,
/// the placer continues it in `reservation.placed`'s, the binder in
/// `reservation.activated`'s, and every process exports its spans of that
/// trace over OTLP.
#[test]
fn one_trace_follows_a_reservation_from_the_request_to_active() {
    let url = database();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let received = super::otlp::Received::default();
    let otlp = format!(
        "http://127.0.0.1:{}",
        super::otlp::serve(&rt, received.clone())
    );
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    let ca_s = ca.to_str().unwrap();
    let token = ca_pool_and_token(&url, ca_s);
    let listen = format!("127.0.0.1:{}", free_port());
    let traced = |args: &[&str], log: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(args)
            .env("RUST_LOG", "info")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
            .env("OTEL_BSP_SCHEDULE_DELAY", "200")
            .env("STRATA_SINK_SECRET_TRACE", "trace-secret")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join(log)).unwrap())
            .spawn()
            .unwrap()
    };
    // A webhook sink, so that a delivery is traced too.
    let (hook, delivered) = super::sinks::http_receiver();
    ok(&[
        "sinks",
        "create",
        "h",
        "--database-url",
        &url,
        "--webhook",
        &hook,
        "--secret-env",
        "STRATA_SINK_SECRET_TRACE",
        "--prefixes",
        "reservation/",
    ]);
    let _serve = Killed(traced(
        &[
            "serve",
            "--roles",
            "gateway,placer,binder,sinks",
            "--database-url",
            &url,
            "--listen",
            &listen,
            "--ca-dir",
            ca_s,
            "--slot",
            "traced",
        ],
        "a.log",
    ));
    let ca_pem = ca.join("ca.pem");
    let _node = Killed(spawn(
        &[
            "node",
            "--gateway",
            &format!("https://{listen}"),
            "--data-dir",
            dir.path().join("n1").to_str().unwrap(),
            "--node-id",
            "n1",
            "--token",
            &token,
            "--ca",
            ca_pem.to_str().unwrap(),
            "--fake-gpus",
            "8xH100-80GB",
        ],
        &dir.path().join("node.log"),
    ));
    wait_until(60, "the node's GPUs are in the pool", dir.path(), || {
        query(
            &url,
            "SELECT 1::text FROM strata.events WHERE stream = 'pool/p' AND type = 'node.joined'",
        )
        .len()
            == 1
    });
    let reserve = traced(
        &[
            "reserve",
            "--database-url",
            &url,
            "--pool",
            "p",
            "--class",
            "H100-80GB",
            "--gpus",
            "2",
            "--id",
            "r1",
            "--wait",
            "--timeout",
            "60s",
        ],
        "reserve.log",
    )
    .wait_with_output()
    .unwrap();
    assert!(
        reserve.status.success(),
        "{}",
        std::fs::read_to_string(dir.path().join("reserve.log")).unwrap()
    );
    let trace_of = |stream: &str, t: &str| -> Option<String> {
        let rows = query(
            &url,
            &format!(
                "SELECT metadata->>'traceparent' FROM strata.events WHERE stream = '{stream}' AND type = '{t}'"
            ),
        );
        rows.first()
            .map(|r| r[0].clone())
            .filter(|tp| !tp.is_empty())
    };
    wait_until(60, "the reservation is active", dir.path(), || {
        trace_of("reservation/r1", "reservation.activated").is_some()
    });
    // A simulated node given no --cdi-dir keeps its specs in its data dir.
    assert!(dir
        .path()
        .join("n1/cdi/strata-reservation-r1.json")
        .exists());
    let requested =
        trace_of("reservation/r1", "reservation.requested").expect("the request's traceparent");
    let placed = trace_of("pool/p", "reservation.placed").expect("the placement's traceparent");
    let activated = trace_of("reservation/r1", "reservation.activated").unwrap();
    let trace = events::trace::trace_id(&requested)
        .expect("a W3C traceparent")
        .to_string();
    assert_eq!(
        events::trace::trace_id(&placed),
        Some(trace.as_str()),
        "{requested} {placed}"
    );
    assert_eq!(
        events::trace::trace_id(&activated),
        Some(trace.as_str()),
        "{activated}"
    );
    assert_ne!(requested, placed, "each step is a span of its own");
    // The spans of that trace, from both processes, reach the collector.
    let want = [
        "reservation.request",
        "reservation.place",
        "reservation.bind",
        "reservation.activate",
    ];
    wait_until(30, "every step's span is exported", dir.path(), || {
        let got = received.traces.lock().unwrap();
        want.iter()
            .all(|w| got.iter().any(|(n, t)| n == w && *t == trace))
    });
    wait_until(
        30,
        "the sink delivered the reservation's events",
        dir.path(),
        || delivered.lock().unwrap().len() >= 2,
    );
    // The node's Join was a unary call on the gateway: a span of its own;
    // the sink's deliveries are spans too.
    wait_until(30, "a sink.deliver span is exported", dir.path(), || {
        received
            .spans
            .lock()
            .unwrap()
            .iter()
            .any(|n| n == "sink.deliver")
    });
    let names = received.spans.lock().unwrap().clone();
    for name in ["placement.batch", "rpc", "sink.deliver"] {
        assert!(names.iter().any(|n| n == name), "{name}: {names:?}");
    }
}
