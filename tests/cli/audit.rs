//! `strata serve --roles audit` as a real process, with auditors managed by
//! `strata audit users` and `strata ca issue-auditor`, and psql as the client.

use super::{database, fails, ok};
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn add_with_password(url: &str, name: &str, password: &str) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "audit",
            "users",
            "add",
            name,
            "--password-stdin",
            "--database-url",
            url,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "{password}").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("SCRAM-SHA-256"));
}

fn psql(conninfo: &str, sql: &str, password: Option<&str>) -> (bool, String, String) {
    let bindir = testkit::shared_cluster().bindir().to_path_buf();
    let mut cmd = Command::new(bindir.join("psql"));
    cmd.arg(conninfo)
        .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .env_remove("PGPASSWORD");
    if let Some(p) = password {
        cmd.env("PGPASSWORD", p);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `strata serve --roles audit` on `port`, once it accepts connections.
fn serve_with(url: &str, port: u16, ca: &Path, log: &Path, extra: &[&str]) -> Server {
    let listen = format!("127.0.0.1:{port}");
    let server = Server(
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args([
                "serve",
                "--roles",
                "audit",
                "--database-url",
                url,
                "--audit-listen",
                &listen,
                "--ca-dir",
                ca.to_str().unwrap(),
                "--slot",
                "audit_cli",
            ])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "the audit endpoint did not start: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

#[test]
fn serve_audit_with_psql_passwords_certificates_and_revocation() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    ok(&["ca", "init", "--dir", ca.to_str().unwrap()]);
    add_with_password(&url, "dana", "dana pass 1");
    ok(&[
        "audit",
        "users",
        "add",
        "erin",
        "--certificate-only",
        "--database-url",
        &url,
    ]);
    let erin = dir.path().join("erin");
    let out = ok(&[
        "ca",
        "issue-auditor",
        "--dir",
        ca.to_str().unwrap(),
        "--name",
        "erin",
        "--out",
        erin.to_str().unwrap(),
    ]);
    assert!(out.contains("sslcert="), "{out}");
    assert!(
        out.contains(&format!("serial {}", out_issue_serial(&erin))),
        "{out}"
    );
    let list = ok(&["audit", "users", "list", "--database-url", &url]);
    assert!(
        list.lines()
            .any(|l| l.starts_with("dana") && l.contains("yes")),
        "{list}"
    );
    assert!(
        list.lines()
            .any(|l| l.starts_with("erin") && l.contains("no")),
        "{list}"
    );

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = dir.path().join("audit.log");
    let metrics_at = format!(
        "127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    );
    let _server = serve_with(&url, port, &ca, &log, &["--metrics-listen", &metrics_at]);
    let tls = format!(
        "host=127.0.0.1 port={port} dbname=audit sslmode=verify-full sslrootcert={}",
        ca.join("ca.pem").display()
    );
    let (okay, out, err) = psql(
        &format!("{tls} user=dana"),
        "SELECT count(*) >= 0 FROM strata.events",
        Some("dana pass 1"),
    );
    assert!(okay, "{err}");
    assert_eq!(out.trim(), "t");
    let (okay, out, err) = psql(
        &format!(
            "{tls} user=erin sslcert={} sslkey={}",
            erin.join("auditor.pem").display(),
            erin.join("auditor.key").display()
        ),
        "SELECT auditor, auth FROM audit.queries ORDER BY position",
        None,
    );
    assert!(okay, "{err}");
    // dana's query, then erin's own (recorded before it ran).
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        vec!["dana|scram", "erin|certificate"]
    );
    let (okay, _, err) = psql(
        &format!("{tls} user=dana"),
        "TRUNCATE strata.events",
        Some("dana pass 1"),
    );
    assert!(!okay);
    assert!(
        err.contains("permission denied") || err.contains("read-only"),
        "{err}"
    );

    ok(&["audit", "users", "revoke", "dana", "--database-url", &url]);
    let (okay, _, err) = psql(&format!("{tls} user=dana"), "SELECT 1", Some("dana pass 1"));
    assert!(!okay);
    assert!(err.contains("password authentication failed"), "{err}");

    // Revoking erin's certificate (not her account) refuses its logins.
    assert!(out_issue_serial(&erin).len() >= 2);
    let cert = erin.join("auditor.pem");
    let out = ok(&[
        "ca",
        "revoke",
        "--cert",
        cert.to_str().unwrap(),
        "--reason",
        "key leaked",
        "--database-url",
        &url,
    ]);
    assert!(out.contains("revoked the auditor erin"), "{out}");
    let out = ok(&[
        "ca",
        "revoke",
        "--serial",
        &out_issue_serial(&erin),
        "--database-url",
        &url,
    ]);
    assert!(out.contains("already revoked"), "{out}");
    let listed = ok(&["ca", "revoked", "--database-url", &url]);
    assert!(
        listed
            .lines()
            .any(|l| l.contains("auditor") && l.contains("erin") && l.ends_with("key leaked")),
        "{listed}"
    );
    let (okay, _, err) = psql(
        &format!(
            "{tls} user=erin sslcert={} sslkey={}",
            cert.display(),
            erin.join("auditor.key").display()
        ),
        "SELECT 1",
        None,
    );
    assert!(!okay);
    assert!(err.contains("is revoked"), "{err}");
    // The endpoint's metrics pass Prometheus' linter and count the above.
    let text = super::scrape_and_lint(
        &metrics_at,
        &[
            "strata_audit_sessions 0",
            "strata_audit_logins_total 3",
            "strata_audit_statements_total",
            "strata_audit_logins_refused_total 2",
        ],
    );
    assert!(!text.contains("strata_subscription_lag"), "{text}");
    let err = fails(&["ca", "revoke", "--serial", "xyz", "--database-url", &url]);
    assert!(err.contains("not 1 to 20 bytes of hex"), "{err}");
    let err = fails(&["ca", "revoke", "--database-url", &url]);
    assert!(err.contains("--cert") && err.contains("--serial"), "{err}");
    let err = fails(&[
        "ca",
        "revoke",
        "--cert",
        ca.join("ca.pem").to_str().unwrap(),
        "--database-url",
        &url,
    ]);
    assert!(
        err.contains("not an operator's or an auditor's certificate"),
        "{err}"
    );
    // The audit endpoint does not follow the log: its process, up through
    // all of the above, holds no replication slot (each one in use is a
    // walsender decoding all of the WAL).
    let (okay, out, err) = psql(
        &url,
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'audit_cli'",
        None,
    );
    assert!(okay, "{err}");
    assert_eq!(out.trim(), "0", "the audit-only process made a slot");
    super::events_conform(&url, &[]);
}

/// The serial of the certificate under `dir`, as `strata ca revoked` prints it.
fn out_issue_serial(dir: &Path) -> String {
    let pem = std::fs::read_to_string(dir.join("auditor.pem")).unwrap();
    ::gateway::revocation::presented_pem(&pem).unwrap().serial
}

#[test]
fn the_audit_endpoint_serves_a_renewed_certificate_before_its_own_expires() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let gw_ca = dir.path().join("audit-host");
    let ca = dir.path().join("ca");
    ok(&["ca", "init", "--dir", ca.to_str().unwrap()]);
    // The audit host holds the issuing intermediate only.
    ok(&[
        "ca",
        "export-issuing",
        "--dir",
        ca.to_str().unwrap(),
        "--out",
        gw_ca.to_str().unwrap(),
    ]);
    assert!(!gw_ca.join("root.key").exists());
    add_with_password(&url, "dana", "dana pass 1");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = dir.path().join("audit.log");
    let _server = serve_with(&url, port, &gw_ca, &log, &["--serving-validity", "6s"]);
    let started = Instant::now();
    // verify-full checks the expiry; channel binding binds to the cert served.
    let tls = format!(
        "host=127.0.0.1 port={port} user=dana dbname=audit sslmode=verify-full sslrootcert={} channel_binding=require",
        ca.join("ca.pem").display()
    );
    let (okay, out, err) = psql(&tls, "SELECT 1", Some("dana pass 1"));
    assert!(okay, "{err}");
    assert_eq!(out.trim(), "1");
    std::thread::sleep(Duration::from_secs(9).saturating_sub(started.elapsed()));
    let (okay, out, err) = psql(&tls, "SELECT 2", Some("dana pass 1"));
    assert!(
        okay,
        "{err}\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(out.trim(), "2");
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(log.contains("serving certificate renewed"), "{log}");
}

/// An auditor's statement that catches every cancel.
const ENDLESS: &str = "DO $$ BEGIN LOOP BEGIN PERFORM pg_sleep(5); EXCEPTION WHEN query_canceled THEN NULL; END; END LOOP; END $$";

/// Auditors' PostgreSQL processes on `url`'s database.
fn auditor_backends(url: &str) -> usize {
    super::gateway::query(
        url,
        "SELECT count(*)::text FROM pg_stat_activity WHERE datname = current_database() AND usename LIKE 'strata_audit\\_%'",
    )[0][0]
        .parse()
        .unwrap()
}

#[test]
fn an_auditors_statement_that_catches_every_cancel_still_ends_and_leaves_no_backend() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    ok(&["ca", "init", "--dir", ca.to_str().unwrap()]);
    add_with_password(&url, "fred", "fred pass 1");
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let conninfo = |port: u16| {
        format!(
            "host=127.0.0.1 port={port} dbname=audit sslmode=verify-full sslrootcert={} user=fred",
            ca.join("ca.pem").display()
        )
    };

    // Past the 2 s limit the endpoint cancels; the statement swallows it,
    // so the endpoint ends the session and its PostgreSQL process goes.
    let port = free();
    let server = serve_with(
        &url,
        port,
        &ca,
        &dir.path().join("audit.log"),
        &["--audit-statement-timeout", "2s"],
    );
    let started = Instant::now();
    let (okay, _, err) = psql(&conninfo(port), ENDLESS, Some("fred pass 1"));
    assert!(!okay);
    assert!(
        err.contains("ran past the audit endpoint's limit of 2s"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    testkit::wait_until(
        10,
        "the auditor's PostgreSQL process ends",
        || auditor_backends(&url) == 0,
        || {},
    );
    drop(server);

    // The endpoint killed while such a statement runs: its process ends as
    // soon as PostgreSQL sees the endpoint's connection gone.
    let port = free();
    let mut server = serve_with(
        &url,
        port,
        &ca,
        &dir.path().join("audit2.log"),
        &["--audit-statement-timeout", "60s"],
    );
    let bindir = testkit::shared_cluster().bindir().to_path_buf();
    let mut client = Command::new(bindir.join("psql"))
        .arg(conninfo(port))
        .args(["-X", "-c", ENDLESS])
        .env("PGPASSWORD", "fred pass 1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    testkit::wait_until(
        20,
        "the statement runs",
        || auditor_backends(&url) == 1,
        || {},
    );
    server.0.kill().unwrap();
    let _ = server.0.wait();
    testkit::wait_until(
        10,
        "the orphaned PostgreSQL process ends",
        || auditor_backends(&url) == 0,
        || {},
    );
    let _ = client.kill();
    let _ = client.wait();
}

/// A free port on the loopback.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// psql as `user` over verified TLS to the endpoint on `port`.
fn conninfo(ca: &Path, port: u16, user: &str) -> String {
    format!(
        "host=127.0.0.1 port={port} dbname=audit sslmode=verify-full sslrootcert={} user={user}",
        ca.join("ca.pem").display()
    )
}

/// psql running `sql` in the background, its output thrown away.
fn psql_child(conninfo: &str, sql: Option<&str>, password: &str) -> Child {
    let bindir = testkit::shared_cluster().bindir().to_path_buf();
    let mut cmd = Command::new(bindir.join("psql"));
    cmd.arg(conninfo).arg("-X");
    if let Some(sql) = sql {
        cmd.args(["-c", sql]);
    }
    cmd.env("PGPASSWORD", password)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// An endpoint with one password auditor, as `serve_with` starts it.
struct Endpoint {
    url: String,
    dir: tempfile::TempDir,
    port: u16,
    _server: Server,
}

impl Endpoint {
    fn start(auditors: &[(&str, &str)], extra: &[&str]) -> Endpoint {
        let url = database();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca");
        ok(&["ca", "init", "--dir", ca.to_str().unwrap()]);
        for (name, password) in auditors {
            add_with_password(&url, name, password);
        }
        let port = free_port();
        let server = serve_with(&url, port, &ca, &dir.path().join("audit.log"), extra);
        Endpoint {
            url,
            dir,
            port,
            _server: server,
        }
    }

    fn conninfo(&self, user: &str) -> String {
        conninfo(&self.dir.path().join("ca"), self.port, user)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("audit.log")).unwrap()
    }
}

#[test]
fn audit_sessions_are_capped_per_auditor_idle_ones_close_and_revocation_ends_open_ones() {
    let e = Endpoint::start(
        &[("gina", "gina pass 1"), ("hank", "hank pass 1")],
        &[
            "--audit-max-sessions-per-auditor",
            "2",
            "--audit-idle-session-timeout",
            "3s",
        ],
    );
    let url = &e.url;

    // Two busy sessions are gina's limit; hank is not held up by them.
    let mut busy: Vec<Child> = (0..2)
        .map(|_| {
            psql_child(
                &e.conninfo("gina"),
                Some("SELECT pg_sleep(60)"),
                "gina pass 1",
            )
        })
        .collect();
    testkit::wait_until(
        20,
        "gina's two statements run",
        || auditor_backends(url) == 2,
        || {},
    );
    let (okay, _, err) = psql(&e.conninfo("gina"), "SELECT 1", Some("gina pass 1"));
    assert!(!okay);
    assert!(err.contains("holds its limit of 2 sessions"), "{err}");
    let (okay, out, err) = psql(&e.conninfo("hank"), "SELECT 1", Some("hank pass 1"));
    assert!(okay && out.trim() == "1", "{err}");

    // Revoking gina ends both running statements within seconds.
    let revoked = Instant::now();
    ok(&["audit", "users", "revoke", "gina", "--database-url", url]);
    testkit::wait_until(
        10,
        "gina's sessions end",
        || busy.iter_mut().all(|c| c.try_wait().unwrap().is_some()),
        || {},
    );
    testkit::wait_until(
        5,
        "gina's PostgreSQL processes end",
        || auditor_backends(url) == 0,
        || {},
    );
    assert!(
        revoked.elapsed() < Duration::from_secs(8),
        "{:?}",
        revoked.elapsed()
    );
    for mut c in busy {
        assert!(!c.wait().unwrap().success());
    }

    // A statement longer than the idle limit is not idle ...
    let (okay, _, err) = psql(
        &e.conninfo("hank"),
        "SELECT pg_sleep(4)",
        Some("hank pass 1"),
    );
    assert!(okay, "{err}");
    // ... but a session that sends nothing is closed.
    let mut idle = psql_child(&e.conninfo("hank"), None, "hank pass 1");
    testkit::wait_until(
        20,
        "hank's session opens",
        || auditor_backends(url) == 1,
        || {},
    );
    let opened = Instant::now();
    testkit::wait_until(
        10,
        "hank's idle session is closed",
        || auditor_backends(url) == 0,
        || {},
    );
    assert!(
        opened.elapsed() >= Duration::from_secs(2),
        "closed after {:?}, before its idle limit",
        opened.elapsed()
    );
    let _ = idle.kill();
    let _ = idle.wait();
    let log = e.log();
    assert!(
        log.contains("reason=\"revoked\"") || log.contains("reason=revoked"),
        "{log}"
    );
    assert!(
        log.contains("reason=\"idle\"") || log.contains("reason=idle"),
        "{log}"
    );
}

#[test]
fn failed_audit_logins_slow_down_further_tries_even_with_the_right_password() {
    let e = Endpoint::start(&[("iris", "iris pass 1")], &[]);
    let info = e.conninfo("iris");
    // Ten failures that were checked (tries refused unchecked do not count):
    // the lockout after the tenth is several seconds.
    let (mut failed, mut throttled) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    while failed < 10 {
        assert!(
            Instant::now() < deadline,
            "{failed} failures, {throttled} throttled"
        );
        let (okay, _, err) = psql(&info, "SELECT 1", Some("wrong"));
        assert!(!okay);
        if err.contains("too many failed logins") {
            throttled += 1;
        } else {
            assert!(err.contains("password authentication failed"), "{err}");
            failed += 1;
        }
    }
    assert!(throttled > 0, "no try was refused unchecked");
    let (okay, _, err) = psql(&info, "SELECT 1", Some("iris pass 1"));
    assert!(!okay, "the right password went through a lockout");
    assert!(err.contains("too many failed logins"), "{err}");
    testkit::wait_until(
        40,
        "the lockout passes and the right password works",
        || psql(&info, "SELECT 1", Some("iris pass 1")).0,
        || {},
    );
    assert!(e.log().contains("too many failed logins just before"));
}

#[test]
fn audit_results_count_rows_and_memory_settings_are_the_endpoints() {
    let e = Endpoint::start(
        &[("jude", "jude pass 1")],
        &["--audit-max-result-mib", "1", "--audit-work-mem-mib", "8"],
    );
    let info = e.conninfo("jude");
    let run = |sql: &str| psql(&info, sql, Some("jude pass 1"));
    // 400,000 rows of no columns are 800 KB on the wire and far more in memory.
    let (okay, _, err) = run("SELECT FROM generate_series(1, 400000)");
    assert!(!okay);
    assert!(
        err.contains("larger than the audit endpoint's limit"),
        "{err}"
    );

    let (okay, out, err) = run("SHOW work_mem");
    assert!(okay && out.trim() == "8MB", "{out}{err}");
    let (okay, out, err) = run("SHOW hash_mem_multiplier");
    assert!(okay && out.trim() == "1", "{out}{err}");
    let (okay, _, err) = run("SET work_mem = '1GB'");
    assert!(
        !okay && err.contains("fixed by the audit endpoint"),
        "{err}"
    );
    let (okay, out, err) = run(
        "BEGIN; SELECT set_config('work_mem', '1GB', false); SHOW work_mem; SELECT set_config('hash_mem_multiplier', '100', false); SHOW hash_mem_multiplier; COMMIT",
    );
    assert!(okay, "{err}");
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| !["BEGIN", "COMMIT", "ROLLBACK"].contains(l))
        .collect();
    assert_eq!(lines, ["1GB", "8MB", "100", "1"], "{out}");
    // Temporary files are limited on the auditor's role, which cannot raise it.
    let (okay, out, err) = run("SHOW temp_file_limit");
    assert!(okay && out.trim() == "1GB", "{out}{err}");
    let (okay, _, err) = run("SELECT set_config('temp_file_limit', '-1', false)");
    assert!(!okay && err.contains("permission denied"), "{err}");
}

#[test]
fn auditors_read_usage_with_sql_through_the_endpoint_and_not_the_tables_behind_it() {
    let ep = Endpoint::start(&[("finance", "s3cret-finance")], &[]);
    super::seeded_pool(&ep.url, 1);
    let _region = super::usage::placer_and_usage(&ep.url, "audited", ep.dir.path());
    ok(&super::reserve_args(
        &ep.url,
        &["--gpus", "2", "--ttl", "1s", "--id", "billed"],
    ));
    let ci = ep.conninfo("finance");
    let mut rows = String::new();
    testkit::wait_until(
        60,
        "the auditor sees the reservation's GPU time",
        || {
            let (good, out, err) = psql(
                &ci,
                "SELECT period, pool, class, sum(reservations_ended), sum(gpu_hours + held_gpu_hours) > 0
                   FROM audit.usage GROUP BY 1, 2, 3 ORDER BY period",
                Some("s3cret-finance"),
            );
            assert!(good, "{err}");
            rows = out;
            rows.lines().count() == 3
        },
        || eprintln!("{}", ep.log()),
    );
    assert_eq!(
        rows.lines().collect::<Vec<_>>(),
        [
            "day|gpu|H100-80GB|1|t",
            "hour|gpu|H100-80GB|1|t",
            "month|gpu|H100-80GB|1|t"
        ]
    );
    let (good, out, _) = psql(
        &ci,
        "SELECT count(DISTINCT period) FROM audit.usage_by_node WHERE node <> ''",
        Some("s3cret-finance"),
    );
    assert!(good && out.trim() == "2", "{out}");
    // The views, not the tables the usage role writes.
    let (good, _, err) = psql(
        &ci,
        "SELECT count(*) FROM strata.usage_rollups",
        Some("s3cret-finance"),
    );
    assert!(!good && err.contains("permission denied"), "{err}");
}
