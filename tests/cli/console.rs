//! The web console in a real browser (Debian's headless Chromium through
//! ChromeDriver) against a running region: a `serve` process with the
//! placer, binder, gateway and console roles, and a fleet of node daemons
//! joined over mutual TLS. Sign-in by a one-time link, every page, a live
//! update arriving without a reload, actions written with the operator's
//! name, a viewer refused, a forged form refused, and a session ended by
//! removing the role. Screenshots of each page go to
//! `target/console-screenshots/`, or to `docs/console/` with
//! `STRATA_UPDATE_SCREENSHOTS=1`.

use super::gateway::{ca_pool_and_token, free_port, query};
use super::{database, ok, spawn, Held};
use std::path::{Path, PathBuf};
use testkit::browser::Browser;

struct Killed(std::process::Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `query` from inside the browser's runtime (it runs one of its own).
fn q(url: &str, sql: &str) -> Vec<Vec<String>> {
    let (url, sql) = (url.to_string(), sql.to_string());
    std::thread::spawn(move || query(&url, &sql))
        .join()
        .unwrap()
}

/// `curl` against the console with an operator's certificate: the status
/// and the body.
fn curl_with(cert: &Path, ca: &Path, url: &str) -> (String, String) {
    let out = std::process::Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "--cacert"])
        .arg(ca)
        .arg("--cert")
        .arg(cert.join("operator.pem"))
        .arg("--key")
        .arg(cert.join("operator.key"))
        .arg(url)
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    (status.to_string(), body.to_string())
}

/// An operator certificate for `name` from the CA in `ca`, in a folder of
/// its own under `dir` (`operator.pem`, `operator.key`).
fn operator_cert(ca: &Path, name: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}-cert"));
    ok(&[
        "ca",
        "issue-operator",
        "--dir",
        ca.to_str().unwrap(),
        "--name",
        name,
        "--out",
        out.to_str().unwrap(),
    ]);
    out
}

/// One metric's value as the process serves it.
fn metric(port: u16, name: &str) -> f64 {
    let out = std::process::Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .expect("run curl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(-1.0)
}

/// Where the screenshots go: `docs/console/` (the README's) when
/// `STRATA_UPDATE_SCREENSHOTS=1`, else `target/console-screenshots/`, so an
/// ordinary run leaves the tracked pictures as they are.
fn shots() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    match std::env::var("STRATA_UPDATE_SCREENSHOTS").as_deref() {
        Ok("1") => root.join("docs/console"),
        _ => root.join("target/console-screenshots"),
    }
}

fn logs(dir: &Path) {
    for log in ["serve.log", "fleet.log"] {
        let text = std::fs::read_to_string(dir.join(log)).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        eprintln!("--- {log} (newest first)\n{}", tail.join("\n"));
    }
}

/// What an accessibility check finds wrong with the page: controls without
/// a name, images without a text equivalent, data cells without headers, a
/// missing language or main landmark, and nav links the keyboard cannot
/// reach.
const A11Y: &str = r#"
const bad = [];
const name = (e) => (e.getAttribute('aria-label') || e.textContent || e.value || e.title || '').trim();
for (const e of document.querySelectorAll('input:not([type=hidden]), select, textarea')) {
  const labelled = e.closest('label') || (e.id && document.querySelector(`label[for="${e.id}"]`)) || e.getAttribute('aria-label');
  if (!labelled) bad.push('unlabelled ' + e.outerHTML.slice(0, 80));
}
for (const e of document.querySelectorAll('button, a[href]')) if (!name(e)) bad.push('nameless ' + e.outerHTML.slice(0, 80));
for (const e of document.querySelectorAll('svg[role=img], canvas, img')) if (!e.getAttribute('aria-label') && !e.getAttribute('alt')) bad.push('no text for ' + e.tagName);
for (const t of document.querySelectorAll('table')) if (t.rows.length > 1 && !t.querySelector('th')) bad.push('table without headers');
if (!document.documentElement.lang) bad.push('no lang');
if (document.querySelectorAll('main').length !== 1) bad.push('not one main');
if (document.querySelectorAll('h1').length !== 1) bad.push('not one h1');
for (const a of document.querySelectorAll('nav a')) if (a.tabIndex < 0) bad.push('nav link out of the tab order');
return bad;
"#;

#[test]
fn the_console_signs_in_shows_every_page_live_and_refuses_what_a_role_may_not() {
    assert!(
        testkit::browser::available(),
        "the console's tests need Chromium and ChromeDriver: apt-get install chromium chromium-driver"
    );
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    ca_pool_and_token(&url, ca.to_str().unwrap());
    ok(&[
        "roles",
        "set",
        "alice",
        "--role",
        "operator",
        "--pools",
        "p",
        "--database-url",
        &url,
    ]);
    ok(&[
        "roles",
        "set",
        "vic",
        "--role",
        "viewer",
        "--database-url",
        &url,
    ]);
    // Raw events are alice's as far as her grant goes (pool p's stream);
    // vic has none.
    ok(&[
        "grants",
        "set",
        "alice",
        "--prefixes",
        "pool/p",
        "--database-url",
        &url,
    ]);
    let (gw, web, metrics) = (free_port(), free_port(), free_port());
    let db = url.rsplit('/').next().unwrap().to_string();
    let slot = format!("console_{db}");
    let _serve = Killed(spawn(
        &[
            "serve",
            "--roles",
            "placer,binder,gateway,usage,console",
            "--database-url",
            &url,
            "--listen",
            &format!("127.0.0.1:{gw}"),
            "--ca-dir",
            ca.to_str().unwrap(),
            "--console-listen",
            &format!("127.0.0.1:{web}"),
            "--slot",
            &slot,
            "--metrics-listen",
            &format!("127.0.0.1:{metrics}"),
        ],
        &dir.path().join("serve.log"),
    ));
    let listening = || {
        std::fs::read_to_string(dir.path().join("serve.log"))
            .unwrap_or_default()
            .contains("console listening")
    };
    testkit::wait_until(60, "the console listens", listening, || logs(dir.path()));
    let _fleet = Killed(spawn(
        &[
            "fleet",
            "--database-url",
            &url,
            "--nodes",
            "4",
            "--gateway",
            &format!("https://127.0.0.1:{gw}"),
            "--pool",
            "p",
            "--ca",
            ca.join("ca.pem").to_str().unwrap(),
            "--data-dir",
            dir.path().join("fleet").to_str().unwrap(),
            "--prefix",
            "cn",
        ],
        &dir.path().join("fleet.log"),
    ));
    let joined = || query(&url, "SELECT count(*)::text FROM strata.node_sessions")[0][0] == "4";
    testkit::wait_until(60, "four nodes hold sessions", joined, || logs(dir.path()));
    // A pool shared by two queues, with no nodes yet: what its queues hold
    // and who waits in them.
    ok(&["pool", "create", "shared", "--database-url", &url]);
    for (queue, weight) in [("ml", "2"), ("cv", "1")] {
        ok(&[
            "queues",
            "create",
            queue,
            "--pool",
            "shared",
            "--cohort",
            "research",
            "--weight",
            weight,
            "--quota",
            "H100-80GB=8",
            "--database-url",
            &url,
        ]);
    }
    ok(&[
        "pool",
        "seed",
        "shared",
        "--nodes",
        "1",
        "--gpus",
        "8",
        "--database-url",
        &url,
    ]);
    for (id, wait) in [("ml-holds", true), ("ml-waits", false)] {
        let mut args = vec![
            "reserve",
            "--database-url",
            &url,
            "--pool",
            "shared",
            "--class",
            "H100-80GB",
            "--gpus",
            "8",
            "--queue",
            "ml",
            "--id",
            id,
        ];
        if wait {
            args.push("--wait");
        }
        ok(&args);
    }
    // Everything free is booked, so the browser's request waits.
    ok(&[
        "reserve",
        "--database-url",
        &url,
        "--pool",
        "p",
        "--class",
        "H100-80GB",
        "--gpus",
        "32",
        "--id",
        "filler",
        "--wait",
    ]);
    let base = format!("https://127.0.0.1:{web}");
    // An operator's certificate signs in without a link, until revoked.
    let certs = operator_cert(&ca, "alice", dir.path());
    let (status, body) = curl_with(&certs, &ca.join("ca.pem"), &format!("{base}/"));
    assert_eq!(status, "200", "{body}");
    assert!(body.contains("alice") && body.contains("Pools"), "{body}");
    ok(&[
        "ca",
        "revoke",
        "--database-url",
        &url,
        "--cert",
        certs.join("operator.pem").to_str().unwrap(),
    ]);
    testkit::wait_until(
        10,
        "the revoked certificate is refused",
        || curl_with(&certs, &ca.join("ca.pem"), &format!("{base}/")).0 == "403",
        || {},
    );
    // Another site's page may not sign a browser in, even with a good link.
    let link = ok(&[
        "console",
        "login",
        "--operator",
        "alice",
        "--url",
        &base,
        "--database-url",
        &url,
    ]);
    let token = link.trim().rsplit('=').next().unwrap().to_string();
    let cross = std::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "POST",
            "-H",
            "Origin: https://elsewhere.example",
        ])
        .args([
            "--cacert",
            ca.join("ca.pem").to_str().unwrap(),
            "-d",
            &format!("token={token}"),
        ])
        .arg(format!("{base}/login"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&cross.stdout), "403");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let b = Browser::start().await;
        // Nobody signed in: told how to.
        b.goto(&format!("{base}/")).await;
        let t = b.page_text().await;
        assert!(t.contains("strata console login"), "{t}");

        // A one-time link signs alice in, once.
        let link = ok(&["console", "login", "--operator", "alice", "--url", &base, "--database-url", &url]);
        let link = link.trim();
        b.goto(link).await;
        b.click(&b.find("#sign-in").await.expect("a sign-in button")).await;
        let t = b.wait_text("the region page", 20, |t| t.contains("Pools") && t.contains("alice")).await;
        assert!(t.contains("operator of p"), "{t}");
        b.wait_text("the stream is live", 20, |t| t.contains("live")).await;
        assert!(metric(metrics, "strata_console_streams") >= 1.0);
        let bad = b.run(A11Y, vec![]).await;
        assert_eq!(bad, serde_json::json!([]), "accessibility of the region page");
        b.screenshot(&shots().join("region.png")).await;

        // The pool: a grid of four nodes on one canvas, a search, the form.
        b.goto(&format!("{base}/pools/p")).await;
        b.wait_text("the pool page", 20, |t| t.contains("Nodes and GPUs")).await;
        let cells = b.run("return document.body.dataset.gridCells;", vec![]).await;
        assert_eq!(cells, "4");
        assert_eq!(b.run(A11Y, vec![]).await, serde_json::json!([]), "accessibility of the pool page");
        b.screenshot(&shots().join("pool.png")).await;

        // Alice reserves 8 GPUs while the process's replication stream is
        // held (its walsender stopped): the page says the request is in
        // the log and not yet seen here, then, the stream resumed, that it
        // waits, and why.
        let walsender = q(
            &url,
            &format!("SELECT pid::text FROM pg_stat_replication WHERE application_name = 'strata-reader-{slot}'"),
        );
        assert_eq!(walsender.len(), 1, "one walsender for the serve process: {walsender:?}");
        let held = Held::stop(walsender[0][0].clone());
        let gpus = b.find("input[name=gpus]").await.expect("the GPUs field");
        b.clear_and_type(&gpus, "8").await;
        b.click(&b.find("#reserve").await.expect("a reserve button")).await;
        b.wait_text("the request is recorded, not yet seen", 30, |t| t.contains("not caught up")).await;
        drop(held);
        b.wait_text("the reservation waits", 30, |t| t.contains("Why it waits")).await;
        let here = b.url().await;
        let id = here.rsplit('/').next().unwrap().to_string();
        assert!(id.starts_with('r'), "{here}");
        let requested = q(
            &url,
            &format!("SELECT metadata->>'operator', metadata->>'via' FROM strata.events WHERE stream = 'reservation/{id}' AND version = 1"),
        );
        assert_eq!(requested, [["alice", "console"]]);
        // Released from the command line, the filler makes room: the page
        // turns active without a reload.
        b.run("window.__kept = 42;", vec![]).await;
        ok(&["release", "--database-url", &url, "filler"]);
        let t = b.wait_text("the reservation turns active live", 30, |t| t.contains("active")).await;
        assert_eq!(b.run("return window.__kept;", vec![]).await, 42, "the page was not reloaded");
        assert!(t.contains("reservation.requested") && t.contains("by operator alice"), "{t}");
        assert!(t.contains("reservation.activated") && t.contains("CDI device"), "{t}");
        assert_eq!(b.run(A11Y, vec![]).await, serde_json::json!([]), "accessibility of the reservation page");
        b.screenshot(&shots().join("reservation.png")).await;

        // A node: cordoned from its page, written with alice's name.
        b.goto(&format!("{base}/nodes/cn00001")).await;
        b.wait_text("the node page", 20, |t| t.contains("GPUs") && t.contains("Commands")).await;
        b.click(&b.find("#cordon").await.expect("a cordon button")).await;
        b.wait_text("the node is cordoned", 20, |t| t.contains("cordoned")).await;
        let cordoned = q(
            &url,
            "SELECT metadata->>'operator' FROM strata.events WHERE type = 'node.cordoned' AND payload->>'node' = 'cn00001'",
        );
        assert_eq!(cordoned, [["alice"]]);
        assert_eq!(b.run(A11Y, vec![]).await, serde_json::json!([]), "accessibility of the node page");
        b.screenshot(&shots().join("node.png")).await;

        // A forged form (its CSRF token changed) is refused, and writes nothing.
        b.run("document.querySelector('form[action$=\"/uncordon\"] input[name=csrf]').value = 'forged';", vec![])
            .await;
        b.click(&b.find("#uncordon").await.expect("an uncordon button")).await;
        let t = b.wait_text("the forged form is refused", 20, |t| t.contains("CSRF")).await;
        assert!(t.contains("Not allowed"), "{t}");
        let uncordoned = q(&url, "SELECT count(*)::text FROM strata.events WHERE type = 'node.uncordoned'");
        assert_eq!(uncordoned, [["0"]]);

        // The events tail takes new events without a reload.
        b.goto(&format!("{base}/events?stream=pool/p")).await;
        b.wait_text("the events page", 20, |t| t.contains("node.cordoned")).await;
        b.run("window.__kept = 7;", vec![]).await;
        ok(&["nodes", "uncordon", "cn00001", "--database-url", &url]);
        b.wait_text("a new event in the tail", 20, |t| t.contains("node.uncordoned")).await;
        assert_eq!(b.run("return window.__kept;", vec![]).await, 7, "the page was not reloaded");
        b.screenshot(&shots().join("events.png")).await;

        b.goto(&format!("{base}/queues?pool=shared")).await;
        let t = b
            .wait_text("the queues page", 20, |t| t.contains("Who waits") && t.contains("ml-waits"))
            .await;
        assert!(t.contains("research") && t.contains("cv") && t.contains("Nobody waits"), "{t}");
        assert!(["waiting for capacity", "behind", "over quota"].iter().any(|w| t.contains(w)), "the reason: {t}");
        assert_eq!(b.run(A11Y, vec![]).await, serde_json::json!([]), "accessibility of the queues page");
        b.screenshot(&shots().join("queues.png")).await;

        // Usage, once the usage role has counted: a table, and its CSV.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            b.goto(&format!("{base}/usage?since=1h&by=pool,owner")).await;
            let t = b.wait_text("the usage page", 20, |t| t.contains("GPU-hours by group")).await;
            if t.contains("exact up to position") && t.contains("alice") {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "usage never counted alice's reservation: {t}");
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
        let csv = b
            .run_async(
                "const done = arguments[arguments.length - 1];
                 fetch('/usage.csv?since=1h&by=pool,owner').then((r) => r.text()).then(done);",
            )
            .await;
        let csv = csv.as_str().unwrap_or_default();
        assert!(csv.starts_with("pool,owner,gpu_hours,") && csv.contains("\r\np,alice,"), "{csv}");
        assert_eq!(b.run(A11Y, vec![]).await, serde_json::json!([]), "accessibility of the usage page");
        b.screenshot(&shots().join("usage.png")).await;

        // Signed out, the cookie opens nothing.
        b.click(&b.find("header button").await.expect("a sign-out button")).await;
        // The click only starts the form's POST: a navigation before its
        // answer (the sign-in page) would cancel it.
        b.wait_text("signed out", 20, |t| t.contains("Sign in") && !t.contains("Sign out")).await;
        b.goto(&format!("{base}/")).await;
        let t = b.page_text().await;
        assert!(t.contains("Sign in") && !t.contains("Pools"), "{t}");

        // A viewer sees, but may not act: no buttons, and a forged POST
        // with its own token is refused by the server.
        let link = ok(&["console", "login", "--operator", "vic", "--url", &base, "--database-url", &url]);
        b.goto(link.trim()).await;
        b.click(&b.find("#sign-in").await.expect("a sign-in button")).await;
        b.wait_text("vic signed in", 20, |t| t.contains("vic")).await;
        b.goto(&format!("{base}/nodes/cn00002")).await;
        let t = b.wait_text("the node page for a viewer", 20, |t| t.contains("GPUs")).await;
        assert!(t.contains("You may not change this node") && t.contains("viewer"), "{t}");
        assert!(b.find("#cordon").await.is_none());
        let status = b
            .run_async(
                "const done = arguments[arguments.length - 1];
                 const csrf = document.querySelector('header input[name=csrf]').value;
                 fetch('/nodes/cn00002/cordon', {method: 'POST', body: new URLSearchParams({csrf, reason: 'x'})})
                   .then((r) => done(r.status));",
            )
            .await;
        assert_eq!(status, 403);
        let cordons = q(&url, "SELECT count(*)::text FROM strata.events WHERE type = 'node.cordoned' AND payload->>'node' = 'cn00002'");
        assert_eq!(cordons, [["0"]]);

        // Removing vic's role ends the session, live stream included. The
        // tail shows vic no raw event: it has no grant.
        b.goto(&format!("{base}/events")).await;
        assert!(b.find("#no-grant").await.is_some(), "{}", b.page_text().await);
        assert_eq!(b.run("return document.querySelectorAll('#tail tr').length;", vec![]).await, 0);
        b.wait_text("the stream is live", 20, |t| t.contains("live")).await;
        ok(&["roles", "remove", "vic", "--database-url", &url]);
        b.wait_text("the session ends", 15, |t| t.contains("Signed out") && t.contains("no role")).await;
        assert!(metric(metrics, "strata_console_streams_ended_total") >= 1.0);
        assert!(metric(metrics, "strata_console_position") > 0.0);
        b.goto(&format!("{base}/")).await;
        assert!(b.page_text().await.contains("Sign in"));
    });
}

/// With `--snapshot-dir`, a console starts from the newest pool index
/// snapshot there and folds only the log after it: a node that joined
/// after the snapshot is on its pool page with the others.
#[test]
fn a_console_starts_from_the_newest_snapshot_and_folds_what_followed() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    ok(&["ca", "init", "--dir", ca.to_str().unwrap()]);
    ok(&[
        "roles",
        "set",
        "ada",
        "--role",
        "admin",
        "--database-url",
        &url,
    ]);
    ok(&["pool", "create", "p", "--database-url", &url]);
    ok(&[
        "pool",
        "seed",
        "p",
        "--nodes",
        "3",
        "--gpus",
        "8",
        "--database-url",
        &url,
    ]);
    let head: u64 = query(&url, "SELECT last_position::text FROM strata.log_head")[0][0]
        .parse()
        .unwrap();
    let snaps = dir.path().join("snapshots");
    std::fs::create_dir_all(&snaps).unwrap();
    let snap = snaps.join(format!("index-{head:020}.snap"));
    ok(&[
        "replay",
        "run",
        "--projection",
        "pool-index",
        "--snapshot-out",
        snap.to_str().unwrap(),
        "--database-url",
        &url,
    ]);
    ok(&[
        "pool",
        "seed",
        "p",
        "--nodes",
        "1",
        "--gpus",
        "8",
        "--prefix",
        "late",
        "--database-url",
        &url,
    ]);
    let web = free_port();
    let db = url.rsplit('/').next().unwrap().to_string();
    let log = dir.path().join("serve.log");
    let _serve = Killed(spawn(
        &[
            "serve",
            "--roles",
            "console",
            "--database-url",
            &url,
            "--ca-dir",
            ca.to_str().unwrap(),
            "--console-listen",
            &format!("127.0.0.1:{web}"),
            "--snapshot-dir",
            snaps.to_str().unwrap(),
            "--slot",
            &format!("console_snap_{db}"),
        ],
        &log,
    ));
    let certs = operator_cert(&ca, "ada", dir.path());
    let page = format!("https://127.0.0.1:{web}/pools/p");
    testkit::wait_until(
        30,
        "the console shows the snapshot's nodes and the one after it",
        || {
            curl_with(&certs, &ca.join("ca.pem"), &page)
                .1
                .contains("4 nodes.")
        },
        || eprintln!("{}", std::fs::read_to_string(&log).unwrap_or_default()),
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("loaded from a snapshot") && text.contains(snap.to_str().unwrap()),
        "{text}"
    );
    let (_, body) = curl_with(&certs, &ca.join("ca.pem"), &page);
    assert!(body.contains("late00000"), "{body}");
}
