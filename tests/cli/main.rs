//! The `strata` binary end to end: real processes against a private Postgres.

mod ahead;
mod audit;
mod backfill;
mod config;
mod console;
mod containers;
mod deploy;
mod doctor;
mod faults;
mod gateway;
mod liveness;
mod maintenance;
mod mig;
mod one_node;
mod placement;
mod pooler;
mod queues;
mod region;
mod share;
mod sinks;
mod structure;
mod topology;
mod upgrade;
mod usage;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .env_remove("STRATA_DATABASE_URL")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run strata")
}

fn ok(args: &[&str]) -> String {
    let out = strata(args);
    assert!(
        out.status.success(),
        "strata {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A long-running `strata` process (e.g. `serve`) at `RUST_LOG=info`, its
/// stderr in `log`.
/// A process (a PostgreSQL backend, a `strata` process) stopped with
/// SIGSTOP until this is dropped (SIGCONT).
pub(crate) struct Held(String);
impl Held {
    pub(crate) fn stop(pid: String) -> Held {
        let held = Held(pid);
        assert!(held.signal("-STOP"), "kill -STOP {}", held.0);
        held
    }
    fn signal(&self, sig: &str) -> bool {
        std::process::Command::new("kill")
            .args([sig, &self.0])
            .status()
            .is_ok_and(|s| s.success())
    }
}
impl Drop for Held {
    fn drop(&mut self) {
        self.signal("-CONT");
    }
}

fn spawn(args: &[&str], log: &std::path::Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// Runs and expects failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = strata(args);
    assert!(!out.status.success(), "strata {args:?} should have failed");
    String::from_utf8(out.stderr).unwrap()
}

fn database() -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = rt.block_on(testkit::fresh_database(testkit::shared_cluster()));
    ok(&["migrate", "--database-url", &url]);
    url
}

/// Pool `gpu` with `nodes` simulated nodes of 8 H100-80GB GPUs.
fn seeded_pool(url: &str, nodes: u32) {
    ok(&["pool", "create", "gpu", "--database-url", url]);
    let nodes = nodes.to_string();
    ok(&[
        "pool",
        "seed",
        "gpu",
        "--nodes",
        &nodes,
        "--gpus",
        "8",
        "--database-url",
        url,
    ]);
}

/// `strata events append` arguments for one event, plus `extra`.
fn append_args<'a>(
    url: &'a str,
    stream: &'a str,
    event_type: &'a str,
    data: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "events",
        "append",
        "--database-url",
        url,
        "--stream",
        stream,
        "--type",
        event_type,
        "--data",
        data,
    ];
    args.extend_from_slice(extra);
    args
}

/// `strata reserve` in pool `gpu` for H100-80GB, plus `extra`.
fn reserve_args<'a>(url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "reserve",
        "--database-url",
        url,
        "--pool",
        "gpu",
        "--class",
        "H100-80GB",
    ];
    args.extend_from_slice(extra);
    args
}

/// `strata events tail` arguments, plus `extra`.
fn tail_args<'a>(url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["events", "tail", "--database-url", url];
    args.extend_from_slice(extra);
    args
}

fn lines(s: &str) -> Vec<serde_json::Value> {
    s.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

#[test]
fn migrate_reports_and_is_idempotent() {
    let url = database();
    assert_eq!(
        ok(&["migrate", "--database-url", &url]).trim(),
        "schema is up to date"
    );
}

#[test]
fn append_then_tail_prints_one_json_object_per_event() {
    let url = database();
    let out = ok(&append_args(
        &url,
        "pool/p1",
        "pool.created",
        r#"{"name":"p1"}"#,
        &["--expect", "0"],
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["version"].as_u64(), v["position"].as_u64()),
        (Some(1), Some(1))
    );
    ok(&append_args(
        &url,
        "pool/p1",
        "pool.updated",
        r#"{"gpus":8}"#,
        &["--expect", "1"],
    ));
    let tail = ok(&tail_args(&url, &["--from", "start", "--limit", "2"]));
    let evs = lines(&tail);
    assert_eq!(evs.len(), 2);
    assert_eq!(evs[0]["stream"], "pool/p1");
    assert_eq!(evs[0]["type"], "pool.created");
    assert_eq!(evs[0]["data"]["name"], "p1");
    assert_eq!(evs[1]["version"], 2);
    assert_eq!(evs[1]["position"], 2);
    assert!(evs[1]["recorded_at"].as_str().unwrap().ends_with('Z'));
    // A stale expectation is refused and says why.
    let err = fails(&append_args(&url, "pool/p1", "t", "{}", &["--expect", "1"]));
    assert!(
        err.contains("version conflict on stream \"pool/p1\": expected 1, actual 2"),
        "{err}"
    );
    // The environment variable works as well as the flag.
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["events", "tail", "--from", "1", "--limit", "1"])
        .env("STRATA_DATABASE_URL", &url)
        .output()
        .unwrap();
    assert_eq!(
        lines(&String::from_utf8(out.stdout).unwrap())[0]["position"],
        2
    );
}

#[test]
fn a_tail_subscription_resumes_where_it_acknowledged() {
    let url = database();
    for i in 0..5 {
        ok(&append_args(
            &url,
            "s",
            "t",
            &format!(r#"{{"i":{i}}}"#),
            &[],
        ));
    }
    let first = lines(&ok(&[
        "events",
        "tail",
        "--database-url",
        &url,
        "--subscription",
        "cli",
        "--from",
        "start",
        "--limit",
        "2",
    ]));
    assert_eq!(
        first
            .iter()
            .map(|e| e["position"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [1, 2]
    );
    let second = lines(&ok(&[
        "events",
        "tail",
        "--database-url",
        &url,
        "--subscription",
        "cli",
        "--limit",
        "3",
    ]));
    assert_eq!(
        second
            .iter()
            .map(|e| e["position"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [3, 4, 5]
    );
}

#[test]
fn a_tail_killed_with_sigkill_resumes_without_a_gap() {
    let url = database();
    // One large transaction to be killed in the middle of.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let a = events::Appender::start(
            url.parse::<events::db::Database>().unwrap(),
            events::AppenderConfig::default(),
        );
        a.append(
            "big",
            events::ExpectedVersion::Any,
            (0..5000)
                .map(|i| events::NewEvent::new("t", &serde_json::json!({ "i": i })))
                .collect(),
        )
        .await
        .unwrap();
    });
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "events",
            "tail",
            "--database-url",
            &url,
            "--subscription",
            "killed",
            "--from",
            "start",
            "--lease-ttl",
            "2s",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = Vec::new();
    let mut line = String::new();
    while seen.len() < 2500 {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "tail ended early");
        seen.push(
            serde_json::from_str::<serde_json::Value>(&line).unwrap()["position"]
                .as_u64()
                .unwrap(),
        );
    }
    // Let an acknowledgement reach the database, then kill without warning.
    std::thread::sleep(Duration::from_millis(400));
    Command::new("kill")
        .args(["-9", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap();
    // What it wrote before dying is still in the pipe.
    for l in out.lines() {
        let l = l.unwrap();
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) {
            seen.push(v["position"].as_u64().unwrap());
        }
    }
    assert_eq!(
        seen,
        (1..=seen.len() as u64).collect::<Vec<_>>(),
        "printed in order without gaps"
    );
    // The dead tail's lease runs out (2 s); the new one waits for it, says so,
    // and then whatever was printed after the last stored ack comes again:
    // nothing is skipped.
    let out = strata(&[
        "events",
        "tail",
        "--database-url",
        &url,
        "--subscription",
        "killed",
        "--limit",
        "1",
        "--lease-ttl",
        "2s",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is in use by"),
        "the second tail should say what it waits for"
    );
    let rest = lines(&String::from_utf8(out.stdout).unwrap());
    let resumed_at = rest[0]["position"].as_u64().unwrap();
    assert!(
        resumed_at > 1,
        "the acknowledgement before the kill was stored"
    );
    assert!(
        resumed_at <= seen.len() as u64 + 1,
        "resumed at {resumed_at}, after {} printed: a gap",
        seen.len()
    );
}

#[test]
fn partitions_and_slots_commands_print_tables() {
    let url = database();
    let out = ok(&[
        "partitions",
        "ensure",
        "--database-url",
        &url,
        "--months-ahead",
        "5",
    ]);
    assert!(out.contains("5 month(s) ahead are in place"), "{out}");
    let out = ok(&["partitions", "list", "--database-url", &url]);
    assert!(out.starts_with("PARTITION"), "{out}");
    assert!(out.lines().count() >= 7, "this month and 5 ahead:\n{out}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let slot = format!("cli_orphan_{}", std::process::id());
    rt.block_on(async {
        let c = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t")
            .await
            .unwrap();
        c.execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();
    });
    let out = ok(&["slots", "list", "--database-url", &url]);
    let row = out
        .lines()
        .find(|l| l.starts_with(&slot))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(row.contains("STALE"), "{row}");
    assert_eq!(
        ok(&["slots", "drop", "--database-url", &url, &slot]).trim(),
        format!("dropped slot {slot}")
    );
    assert!(!ok(&["slots", "list", "--database-url", &url]).contains(&slot));
}

#[test]
fn bad_input_gets_a_clear_error_and_writes_nothing() {
    let url = database();
    let base = [
        "events",
        "append",
        "--database-url",
        url.as_str(),
        "--stream",
        "s",
        "--type",
        "t",
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    // `commands issue` of diag.nvml to n1, plus `extra`.
    let issue = |extra: &[&str]| -> Vec<String> {
        [
            "commands",
            "issue",
            "--database-url",
            url.as_str(),
            "--node",
            "n1",
            "--kind",
            "diag.nvml",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            with(&["--data", "{oops"]),
            "invalid --data: payload is not valid JSON",
        ),
        (with(&["--data", "[1,2]"]), "must be a JSON object"),
        (
            with(&["--data", "{}", "--expect", "soon"]),
            "invalid --expect \"soon\"",
        ),
        (with(&["--data", r#"{"a":"\u0000"}"#]), "NUL character"),
        (
            vec![
                "events".into(),
                "tail".into(),
                "--database-url".into(),
                url.clone(),
                "--from".into(),
                "banana".into(),
            ],
            "invalid start \"banana\"",
        ),
        (
            vec![
                "partitions".into(),
                "ensure".into(),
                "--database-url".into(),
                url.clone(),
                "--months-ahead".into(),
                "500".into(),
            ],
            "between 0 and 120",
        ),
        (
            vec![
                "slots".into(),
                "drop".into(),
                "--database-url".into(),
                url.clone(),
                "nope".into(),
            ],
            "no replication slot named \"nope\"",
        ),
        (
            issue(&["--id", "bind:r1:n1"]),
            "only the binder issues there",
        ),
        (
            issue(&["--args", &format!("{{\"x\": \"{}\"}}", "a".repeat(70_000))]),
            "at most 65536",
        ),
        (
            vec![
                "migrate".into(),
                "--database-url".into(),
                "not a url".into(),
            ],
            "parse the database URL",
        ),
        (
            vec![
                "migrate".into(),
                "--database-url".into(),
                "postgres://postgres@127.0.0.1:1/x".into(),
            ],
            "connect to postgres",
        ),
        (vec!["migrate".into()], "--database-url"),
        (
            vec!["events".into(), "explode".into()],
            "unrecognized subcommand",
        ),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = fails(&args);
        assert!(
            err.contains(want),
            "strata {args:?}: {err:?} should contain {want:?}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    let tail = ok(&tail_args(&url, &["--from", "start", "--limit", "0"]));
    assert!(tail.is_empty());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let n: i64 = rt.block_on(async {
        let c = events::db::connect(&url.parse::<tokio_postgres::Config>().unwrap(), "t")
            .await
            .unwrap();
        c.query_one("SELECT count(*) FROM strata.events", &[])
            .await
            .unwrap()
            .get(0)
    });
    assert_eq!(n, 0, "nothing was written");
}

#[test]
fn help_explains_every_command() {
    let out = ok(&["--help"]);
    for cmd in [
        "dev",
        "serve",
        "migrate",
        "partitions",
        "events",
        "slots",
        "reserve",
        "release",
        "pools",
        "pool",
        "replay",
        "ca",
        "tokens",
        "nodes",
        "commands",
        "node",
        "fleet",
        "sinks",
        "grants",
        "roles",
    ] {
        assert!(
            out.contains(&format!("\n  {cmd} ")),
            "{cmd} missing from: {out}"
        );
    }
    let out = ok(&["serve", "--help"]);
    for role in ["maintenance", "placer", "gateway", "binder", "sinks"] {
        assert!(out.contains(role), "{out}");
    }
    let out = ok(&["node", "--help"]);
    assert!(
        out.contains("--fake-gpus") && out.contains("STRATA_JOIN_TOKEN"),
        "{out}"
    );
    let out = ok(&["events", "tail", "--help"]);
    assert!(
        out.contains("--subscription") && out.contains("STRATA_DATABASE_URL"),
        "{out}"
    );
    for args in [vec!["--help"], vec!["reserve", "--help"]] {
        let out = ok(&args);
        assert!(
            out.contains("Exit codes") && out.contains("4 timed out waiting"),
            "{out}"
        );
    }
}

/// Exit codes a script can tell apart: a conflict, a name that does not
/// exist, and clap's usage error, each its own.
#[test]
fn exit_codes_say_what_happened() {
    let url = database();
    let code = |args: &[&str]| strata(args).status.code();
    ok(&append_args(
        &url,
        "ex/1",
        "test.appended",
        "{}",
        &["--expect", "0"],
    ));
    assert_eq!(
        code(&append_args(
            &url,
            "ex/1",
            "test.appended",
            "{}",
            &["--expect", "0"]
        )),
        Some(5)
    );
    assert_eq!(
        code(&["pool", "show", "no-such-pool", "--database-url", &url]),
        Some(6)
    );
    assert_eq!(
        code(&["sinks", "show", "no-such-sink", "--database-url", &url]),
        Some(6)
    );
    assert_eq!(code(&["pool", "show"]), Some(2));
    assert_eq!(
        code(&["pools", "--database-url", "postgres://nobody@127.0.0.1:1/x"]),
        Some(1)
    );
}

#[test]
fn dev_starts_a_private_postgres_shows_the_log_and_stops() {
    let dir = std::env::temp_dir().join(format!("strata-dev-test-{}", std::process::id()));
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "dev",
            "--duration",
            "5s",
            "--rate",
            "100",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(&dir)
        .env_remove("STRATA_DATABASE_URL")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("psql 'postgres://postgres@127.0.0.1:"),
        "{stdout}"
    );
    // The audit endpoint runs, with a dev auditor.
    assert!(
        stdout.contains("audit:     PGPASSWORD='") && stdout.contains("user=dev dbname=audit"),
        "{stdout}"
    );
    let report = stdout
        .lines()
        .find(|l| l.starts_with("appended"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        report.contains("delivered") && report.contains("lag p50"),
        "{report}"
    );
    // Simulated nodes join the demo pool through the gateway; the demo
    // workload is placed, bound on the nodes and active.
    assert!(stderr.contains("16 simulated nodes"), "{stderr}");
    let last = |what: &str| -> u64 {
        stdout
            .lines()
            .filter(|l| l.starts_with("appended"))
            .filter_map(|l| {
                l.split(what)
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .max()
            .unwrap_or(0)
    };
    assert_eq!(last("| nodes "), 16, "{stdout}");
    assert!(
        last(" placed ") > 0,
        "the demo workload was placed: {stdout}"
    );
    assert!(last(" active ") > 0, "placements became active: {stdout}");
    assert!(stderr.contains("postgres stopped"), "{stderr}");
    // The console runs, with a link to sign in; the roles' logs are in the
    // file the banner names, not between the status lines.
    assert!(
        stdout.contains("console:   https://localhost:") && stdout.contains("/login?token="),
        "{stdout}"
    );
    let log = dir.join("strata.log");
    assert!(
        stdout.contains(&format!("logs:      {}", log.display())),
        "{stdout}"
    );
    assert!(!stderr.contains(" INFO "), "{stderr}");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains(" INFO ") && logged.contains("joined"),
        "{logged}"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(&dir);
}

pub(crate) mod otlp {
    //! A real OTLP/gRPC receiver, to check what `strata` exports.
    use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
        MetricsService, MetricsServiceServer,
    };
    use opentelemetry_proto::tonic::collector::metrics::v1::{
        ExportMetricsServiceRequest, ExportMetricsServiceResponse,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    pub struct Received {
        pub spans: Arc<Mutex<Vec<String>>>,
        /// (span name, trace id in hex) of every span.
        pub traces: Arc<Mutex<Vec<(String, String)>>>,
        pub metrics: Arc<Mutex<Vec<String>>>,
        pub services: Arc<Mutex<Vec<String>>>,
    }

    fn service_names(attrs: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> Vec<String> {
        attrs
            .iter()
            .filter(|kv| kv.key == "service.name")
            .map(|kv| format!("{:?}", kv.value))
            .collect()
    }

    #[tonic::async_trait]
    impl TraceService for Received {
        async fn export(
            &self,
            req: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            for rs in req.into_inner().resource_spans {
                if let Some(r) = &rs.resource {
                    self.services
                        .lock()
                        .unwrap()
                        .extend(service_names(&r.attributes));
                }
                for ss in rs.scope_spans {
                    self.traces.lock().unwrap().extend(ss.spans.iter().map(|s| {
                        let hex: String = s.trace_id.iter().map(|b| format!("{b:02x}")).collect();
                        (s.name.clone(), hex)
                    }));
                    self.spans
                        .lock()
                        .unwrap()
                        .extend(ss.spans.into_iter().map(|s| s.name));
                }
            }
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }

    #[tonic::async_trait]
    impl MetricsService for Received {
        async fn export(
            &self,
            req: tonic::Request<ExportMetricsServiceRequest>,
        ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
            for rm in req.into_inner().resource_metrics {
                for sm in rm.scope_metrics {
                    self.metrics
                        .lock()
                        .unwrap()
                        .extend(sm.metrics.into_iter().map(|m| m.name));
                }
            }
            Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
        }
    }

    /// Serves OTLP on a free loopback port; returns the port.
    pub fn serve(rt: &tokio::runtime::Runtime, received: Received) -> u16 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = ([127, 0, 0, 1], port).into();
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(received.clone()))
                .add_service(MetricsServiceServer::new(received))
                .serve(addr),
        );
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        port
    }
}

#[test]
fn spans_and_metrics_are_exported_over_otlp_when_an_endpoint_is_set() {
    let url = database();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let received = otlp::Received::default();
    let port = otlp::serve(&rt, received.clone());
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(append_args(&url, "s", "t", "{}", &[]))
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{port}"),
        )
        .env("OTEL_SERVICE_NAME", "strata-eu-1")
        .env("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let spans = received.spans.lock().unwrap().clone();
    assert!(
        spans.iter().any(|s| s == "append"),
        "spans received: {spans:?}"
    );
    let services = received.services.lock().unwrap().clone();
    // OTEL_SERVICE_NAME is honoured (it used to be always `strata`).
    assert!(
        services.iter().any(|s| s.contains("strata-eu-1")),
        "{services:?}"
    );
    // The same registry as /metrics: counters, gauges and histograms.
    let metrics = received.metrics.lock().unwrap().clone();
    for name in [
        "strata.append.events",
        "strata.append.duration.seconds.count",
        "strata.append.duration.seconds.sum",
        "strata.replication.lag.bytes",
    ] {
        assert!(
            metrics.iter().any(|m| m == name),
            "{name} not among the metrics received: {metrics:?}"
        );
    }
}

/// `strata nodes list | head` and the like: the reader is gone before the
/// first line is written. The command ends quietly with 0, where it used to
/// panic with exit code 101.
#[test]
fn a_closed_pipe_ends_a_listing_quietly() {
    let url = database();
    ok(&append_args(&url, "pool/p", "pool.created", "{}", &[]));
    for args in [
        vec!["nodes", "list"],
        vec!["commands", "list"],
        vec!["replay", "stream", "pool/p"],
        vec!["pools"],
        vec!["events", "tail", "--from", "start", "--limit", "1"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(&args)
            .args(["--database-url", &url])
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "strata {args:?}: {:?} {stderr}",
            out.status
        );
        assert!(stderr.is_empty(), "strata {args:?}: {stderr}");
    }
}

/// An HTTP GET on a process's operations endpoint: the status code and
/// the body.
fn http_get(at: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    // Not listening yet: no answer, code 0.
    let Ok(mut s) = std::net::TcpStream::connect(at) else {
        return (0, String::new());
    };
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {at}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let code = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (code, body.to_string())
}

/// `strata events check`: every event in the test's log has a type the
/// reference (`docs/events.md`) declares, on its stream, with its fields;
/// `written` names the types the test appended itself. Returns the count of
/// each declared type checked.
fn events_conform(url: &str, written: &[&str]) -> serde_json::Map<String, serde_json::Value> {
    let out = strata(&[
        "events",
        "check",
        "--json",
        "--allow-unknown",
        "--database-url",
        url,
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "events check: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        out.status.success() && report["ok"] == true,
        "the log does not match the event reference: {report:#}"
    );
    for t in report["unknown_types"].as_object().unwrap().keys() {
        assert!(
            written.contains(&t.as_str()),
            "{t} is in the log but not in the event reference: {report:#}"
        );
    }
    report["types"].as_object().unwrap().clone()
}

/// Scrapes `/metrics` at `at` once `/readyz` says ready, checks the text
/// with Prometheus' own linter (`promtool check metrics`, Debian's
/// `prometheus` package) and that every family in `families` is there.
/// Returns the text.
fn scrape_and_lint(at: &str, families: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body) = http_get(at, "/readyz");
        if code == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "/readyz stayed {code}: {body}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(http_get(at, "/healthz").0, 200);
    let (code, text) = http_get(at, "/metrics");
    assert_eq!(code, 200, "{text}");
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package) runs");
    {
        use std::io::Write;
        lint.stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let out = lint.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for f in families {
        assert!(
            text.lines().any(|l| l.starts_with(f)),
            "{f} missing from:\n{text}"
        );
    }
    // No label value made up by a process: they would change at every
    // restart.
    assert!(!text.contains("ephemeral-"), "{text}");
    text
}

/// `--output json` on every list and show: one JSON object per line for a
/// list, one object for a show, nothing else on stdout.
#[test]
fn every_list_and_show_prints_json_when_asked() {
    let url = database();
    ok(&["pool", "create", "p", "--database-url", &url]);
    ok(&[
        "pool",
        "seed",
        "p",
        "--nodes",
        "3",
        "--gpus",
        "4",
        "--database-url",
        &url,
    ]);
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
    ]);
    let cases: &[(&[&str], usize)] = &[
        (&["pools"], 1),
        (&["pool", "show", "p", "--nodes"], 1),
        (&["nodes", "list"], 0),
        (&["commands", "list"], 0),
        (&["sinks", "list"], 1),
        (&["sinks", "show", "h1"], 1),
        (&["sinks", "parked", "list", "h1"], 0),
        (&["ca", "revoked"], 0),
        (&["audit", "users", "list"], 0),
        (&["partitions", "list"], 2),
        (&["slots", "list"], 0),
        (&["tokens", "list"], 0),
        (&["grants", "list"], 0),
        (&["roles", "list"], 0),
    ];
    for (args, at_least) in cases {
        let mut full: Vec<&str> = args.to_vec();
        full.extend(["--database-url", &url, "--output", "json"]);
        let out = ok(&full);
        let objects = lines(&out);
        assert!(objects.len() >= *at_least, "{args:?}: {out}");
        assert_eq!(
            objects.len(),
            out.lines().count(),
            "{args:?}: only JSON lines: {out}"
        );
        for o in &objects {
            assert!(o.is_object(), "{args:?}: {o}");
        }
    }
    let show = lines(&ok(&[
        "pool",
        "show",
        "p",
        "--nodes",
        "--database-url",
        &url,
        "--output",
        "json",
    ]));
    assert_eq!(show[0]["nodes"], 3);
    assert_eq!(show[0]["classes"][0]["gpus"], 12);
    assert_eq!(show[0]["node_list"].as_array().unwrap().len(), 3);
    let sinks = lines(&ok(&[
        "sinks",
        "list",
        "--database-url",
        &url,
        "--output",
        "json",
    ]));
    assert_eq!(sinks[0]["name"], "h1");
    assert_eq!(sinks[0]["paused"], false);
    // The text tables are still the default.
    assert!(ok(&["pools", "--database-url", &url]).starts_with("POOL"));
}
