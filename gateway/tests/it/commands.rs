//! Commands to nodes: each runs once across reconnects and a stopping
//! gateway.

use super::*;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn diag(id: &str, node: &str, deadline_ms: u64) -> domain::commands::Command {
    domain::commands::Command {
        id: id.into(),
        node: node.into(),
        kind: "diag.nvml".into(),
        args: serde_json::json!({}),
        deadline_ms,
        issued_by: "cli:test".into(),
    }
}

async fn states(r: &Region, id: &str) -> Vec<String> {
    r.client
        .query(
            "SELECT type FROM strata.events WHERE stream = $1 ORDER BY version",
            &[&format!("command/{id}")],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_run_once_across_reconnects_and_a_stopping_gateway() {
    let r = region().await;
    // Acks held shorter than the slow diagnostics below take, so that a
    // running command is seen acked.
    let short = |c: &mut GatewayConfig| c.ack_hold = Duration::from_millis(300);
    let a = r.gateway("gw-a", short).await;
    let b = r.gateway("gw-b", short).await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![url(&a), url(&b)], dir.path(), "n1");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    daemon::ensure_joined(&c).await.unwrap();
    // Start on a: a is first in the list the daemon tries.
    let mut on_a = c.clone();
    on_a.gateways = vec![url(&a)];
    let n = start(on_a);
    testkit::eventually(20, "the session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;

    // Issued while connected: pushed, succeeded (acked too if the outcome
    // took longer than the hold).
    domain::commands::issue(&r.appender, &diag("c1", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    testkit::eventually(20, "c1 succeeds", || async {
        states(&r, "c1").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;
    assert_eq!(states(&r, "c1").await[0], "command.issued");
    n.stop().await.unwrap();

    // Issued while the node is away: delivered when it comes back.
    domain::commands::issue(&r.appender, &diag("c2", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    // A command for another node is never pushed to this one.
    domain::commands::issue(&r.appender, &diag("other", "n2", now_ms() + 60_000))
        .await
        .unwrap();
    // Slow diagnostics, so a gateway can die while one runs.
    let slow = Arc::new({
        let mut f = FakeGpus::parse("8xH100-80GB", "n1").unwrap();
        f.diag_delay = Duration::from_millis(1500);
        f
    });
    let mut both = c.clone();
    both.backend = slow;
    both.gateways = vec![url(&a), url(&b)];
    let n = start(both);
    testkit::eventually(20, "c2 succeeds after the reconnect", || async {
        states(&r, "c2").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;

    // c3 is acked and running when its gateway stops (a SIGKILLed gateway
    // is the CLI test's drill).
    let holder_is_a = a.stats.sessions.load(Ordering::Relaxed) == 1;
    domain::commands::issue(&r.appender, &diag("c3", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    testkit::eventually(20, "c3 is acked", || async {
        states(&r, "c3").await.len() == 2
    })
    .await;
    let (dead, alive) = if holder_is_a { (a, b) } else { (b, a) };
    dead.stop().await.unwrap();
    testkit::eventually(30, "c3 completes through the other gateway", || async {
        states(&r, "c3").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;
    assert_eq!(
        states(&r, "c3").await,
        ["command.issued", "command.acked", "command.succeeded"],
        "one terminal state"
    );
    // c2 and c3 ran once each on this daemon.
    assert_eq!(n.stats.commands_run.load(Ordering::Relaxed), 2);
    assert_eq!(states(&r, "other").await, ["command.issued"]);

    // Heartbeats go on while a command runs (1 s beats, a 1.5 s command).
    domain::commands::issue(&r.appender, &diag("c4", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    testkit::eventually(20, "c4 is acked", || async {
        states(&r, "c4").await.len() == 2
    })
    .await;
    let beats = n.stats.heartbeats.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(
        n.stats.heartbeats.load(Ordering::Relaxed) > beats,
        "a heartbeat while c4 ran"
    );
    testkit::eventually(20, "c4 succeeds", || async {
        states(&r, "c4").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;

    // A command past its deadline is expired by a gateway, not run.
    n.stop().await.unwrap();
    domain::commands::issue(&r.appender, &diag("late", "n1", now_ms() + 200))
        .await
        .unwrap();
    testkit::eventually(20, "the late command expires", || async {
        states(&r, "late").await.last().map(String::as_str) == Some("command.expired")
    })
    .await;
    alive.stop().await.unwrap();
}

/// A node's ack is written only when the command's outcome does not follow
/// within the gateway's hold: a command that runs at once is recorded
/// issued and succeeded, one that runs longer than the hold issued, acked
/// and succeeded, each state once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_is_written_only_when_the_outcome_does_not_follow_within_the_hold() {
    let r = region().await;
    let long = r
        .gateway("gw-long", |c| c.ack_hold = Duration::from_secs(30))
        .await;
    let short = r
        .gateway("gw-short", |c| c.ack_hold = Duration::from_millis(200))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![url(&long)], dir.path(), "n1");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    daemon::ensure_joined(&c).await.unwrap();
    let n = start(c.clone());
    testkit::eventually(20, "the session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    let ids: Vec<String> = (0..20).map(|i| format!("fast{i}")).collect();
    for id in &ids {
        domain::commands::issue(&r.appender, &diag(id, "n1", now_ms() + 60_000))
            .await
            .unwrap();
    }
    for id in &ids {
        testkit::eventually(20, "a fast command succeeds", || async {
            states(&r, id).await.last().map(String::as_str) == Some("command.succeeded")
        })
        .await;
        assert_eq!(
            states(&r, id).await,
            ["command.issued", "command.succeeded"],
            "{id}: its outcome came within the hold, and alone"
        );
    }
    let gateway: String = r
        .client
        .query_one(
            "SELECT payload->>'gateway' FROM strata.events WHERE stream = 'command/fast0' AND version = 2",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        gateway, "gw-long",
        "the outcome names the gateway that heard it"
    );
    n.stop().await.unwrap();

    // A command longer than the hold: acked while it runs.
    let mut slow = c.clone();
    slow.gateways = vec![url(&short)];
    slow.backend = Arc::new({
        let mut f = FakeGpus::parse("8xH100-80GB", "n1").unwrap();
        f.diag_delay = Duration::from_millis(2000);
        f
    });
    let n = start(slow);
    testkit::eventually(20, "the session opens on the other gateway", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    domain::commands::issue(&r.appender, &diag("slow", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    testkit::eventually(20, "the slow command is acked while it runs", || async {
        states(&r, "slow").await == ["command.issued", "command.acked"]
    })
    .await;
    testkit::eventually(20, "the slow command succeeds", || async {
        states(&r, "slow").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;
    assert_eq!(
        states(&r, "slow").await,
        ["command.issued", "command.acked", "command.succeeded"]
    );
    n.stop().await.unwrap();
    long.stop().await.unwrap();
    short.stop().await.unwrap();
}

/// A daemon writes each command's record durably before it runs it and
/// after; a disk that does not answer holds up neither its heartbeats nor,
/// where daemons share a runtime, anyone else's. Here the daemon runs on a
/// runtime of one thread and its command log is a named pipe that nobody
/// reads until the test does: the record's write blocks until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_log_that_blocks_holds_up_no_heartbeat() {
    let r = region().await;
    let gw = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(vec![url(&gw)], dir.path(), "n1");
    c.token = Some(r.token().await);
    c.ca_pem = Some(r.ca_pem());
    daemon::ensure_joined(&c).await.unwrap();
    let stats = Arc::new(DaemonStats::default());
    let (stop, rx) = watch::channel(false);
    let daemon = {
        let (c, stats) = (c.clone(), stats.clone());
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(daemon::run(c, stats, rx))
        })
    };
    testkit::eventually(20, "the session opens", || async {
        stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    let log = dir.path().join("n1").join("commands.log");
    let _ = std::fs::remove_file(&log);
    let made = std::process::Command::new("mkfifo")
        .arg(&log)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo");
    domain::commands::issue(&r.appender, &diag("c1", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    testkit::eventually(20, "the node receives c1", || async {
        stats.commands_received.load(Ordering::Relaxed) == 1
    })
    .await;
    let beats = stats.heartbeats.load(Ordering::Relaxed);
    testkit::eventually(
        10,
        "heartbeats go on while c1's record waits on the disk",
        || async { stats.heartbeats.load(Ordering::Relaxed) >= beats + 3 },
    )
    .await;
    testkit::eventually(10, "c1 is acked, its outcome not come", || async {
        states(&r, "c1").await == ["command.issued", "command.acked"]
    })
    .await;
    // The disk answers: the pipe is read, the record's flush fails (a pipe
    // cannot be synced), and the command is reported failed, not run.
    let reader = std::thread::spawn(move || std::fs::read_to_string(&log).unwrap());
    testkit::eventually(20, "c1 ends", || async {
        states(&r, "c1").await.last().map(String::as_str) == Some("command.failed")
    })
    .await;
    let detail: String = r
        .client
        .query_one(
            "SELECT payload->>'detail' FROM strata.events WHERE stream = 'command/c1' AND type = 'command.failed'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        detail.contains("could not record the command before running it"),
        "{detail}"
    );
    assert!(reader.join().unwrap().contains("\"c1\""));
    assert_eq!(stats.commands_run.load(Ordering::Relaxed), 0);
    let _ = stop.send(true);
    daemon.join().unwrap().unwrap();
    gw.stop().await.unwrap();
}

/// The open commands a gateway loads (at start, and after its subscription
/// failed) are durable: a command committed on the primary alone, its
/// issue still waiting for the synchronous standby, is not handed out,
/// since the standby's takeover would lose it after a node ran it. It is
/// loaded once the standby has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_a_synchronous_standby_lacks_is_not_loaded_as_open() {
    let primary = testkit::temp_cluster(&[]).unwrap();
    let url = testkit::migrated_database(&primary).await;
    let dbname = url.rsplit('/').next().unwrap().to_string();
    let standby = testkit::temp_standby(&primary).unwrap();
    let db = events::db::Database::parse(&url).unwrap();
    let admin = events::db::connect(&db, "test").await.unwrap();
    let on_standby = events::db::connect(
        &events::db::Database::parse(&standby.url(&dbname)).unwrap(),
        "test",
    )
    .await
    .unwrap();
    testkit::standbys::make_synchronous(&admin).await;
    let conninfo = testkit::standbys::stop_receiving(&on_standby).await;
    let appender = events::Appender::start(&db, events::AppenderConfig::default());
    let issuing = tokio::spawn(async move {
        domain::commands::issue(&appender, &diag("lagging", "n1", now_ms() + 60_000)).await
    });
    testkit::eventually(30, "the command committed on the primary", || async {
        admin
            .query_opt(
                "SELECT 1 FROM strata.events WHERE stream = 'command/lagging'",
                &[],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let loading = tokio::spawn(async move { domain::commands::open(&admin).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !loading.is_finished(),
        "loaded while the standby lacks it: {:?}",
        loading.await.unwrap().map(|open| open
            .iter()
            .map(|t| t.command.id.clone())
            .collect::<Vec<_>>())
    );
    if issuing.is_finished() {
        panic!(
            "the issue did not wait for the standby: {:?}",
            issuing.await.unwrap()
        );
    }
    // The standby receives again: the issue is acknowledged and the
    // command is loaded.
    testkit::standbys::receive_again(&on_standby, &conninfo).await;
    tokio::time::timeout(Duration::from_secs(30), issuing)
        .await
        .expect("acknowledged once the standby has it")
        .unwrap()
        .unwrap();
    let open = tokio::time::timeout(Duration::from_secs(30), loading)
        .await
        .expect("loaded once the standby has it")
        .unwrap()
        .unwrap();
    assert_eq!(
        open.iter()
            .map(|t| t.command.id.as_str())
            .collect::<Vec<_>>(),
        ["lagging"]
    );
}

/// Expiring overdue commands never holds up delivering new ones. Expiry
/// was the dispatcher's own work, one append after another in the loop
/// that pushes new commands to sessions: with thousands due at once (a
/// storm's binds to unreachable nodes), a fresh command waited for all of
/// them, fell due in its turn, and a 10,000-node region stopped
/// delivering commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_expiring_thousands_of_overdue_commands_still_delivers_a_new_one_at_once() {
    let r = region().await;
    let a = r.gateway("gw-a", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let c = joining(&r, &a, dir.path(), "n1").await;
    let n = start(c);
    testkit::eventually(20, "the session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    // Overdue commands for a node that is away.
    const DUE: usize = 5_000;
    let past = now_ms() - 10_000;
    let issues =
        (0..DUE).map(|i| {
            let appender = r.appender.clone();
            async move {
                domain::commands::issue(&appender, &diag(&format!("late-{i}"), "n9", past)).await
            }
        });
    for r in futures_util::future::join_all(issues).await {
        r.unwrap();
    }
    let expired = || async {
        r.client
            .query_one(
                "SELECT count(*) FROM strata.events WHERE type = 'command.expired'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    testkit::eventually(30, "the gateway begins to expire them", || async {
        expired().await > 0
    })
    .await;
    // A new command for the node that is here, while they expire.
    let issued = std::time::Instant::now();
    domain::commands::issue(&r.appender, &diag("fresh", "n1", now_ms() + 60_000))
        .await
        .unwrap();
    testkit::eventually(30, "the fresh command is acknowledged", || async {
        states(&r, "fresh").await.len() >= 2
    })
    .await;
    let took = issued.elapsed();
    let done_by_then = expired().await;
    assert!(
        took < Duration::from_secs(2),
        "acknowledged {took:?} after it was issued ({done_by_then} of {DUE} expired by then)"
    );
    testkit::eventually(60, "every overdue command expires, once", || async {
        expired().await == DUE as i64
    })
    .await;
    n.stop().await.unwrap();
}

/// A node whose command result waits on the database (the command's stream
/// locked here, as a backed-up writer or a slow commit would hold it) keeps
/// sending heartbeats; the gateway, busy with the result, is not reading
/// them, and must not take its own deafness for the node's silence.
/// A node on `gw` whose diagnostics take `delay`, once its session is open.
async fn slow_diagnostics(
    r: &Region,
    gw: &Running,
    dir: &std::path::Path,
    node: &str,
    delay: Duration,
) -> Node {
    let mut c = joining(r, gw, dir, node).await;
    c.backend = Arc::new({
        let mut f = FakeGpus::parse("8xH100-80GB", node).unwrap();
        f.diag_delay = delay;
        f
    });
    let n = start(c);
    testkit::eventually(20, "the session opens", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_not_marked_unreachable_while_its_gateway_waits_on_the_database() {
    let r = region().await;
    // Heartbeats every second: unreachable after three seconds unheard.
    let gw = r
        .gateway("gw-wait", |c| c.ack_hold = Duration::from_secs(60))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let n = slow_diagnostics(&r, &gw, dir.path(), "n-wait", Duration::from_millis(1500)).await;
    domain::commands::issue(&r.appender, &diag("waits", "n-wait", now_ms() + 60_000))
        .await
        .unwrap();
    // While the diagnostics run, the command's stream is locked: recording
    // the result waits until the lock is let go.
    let mut locker = events::db::connect(&r.cfg, "locker").await.unwrap();
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM strata.streams WHERE stream = 'command/waits' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    testkit::eventually(20, "the node ran the command", || async {
        n.stats.commands_run.load(Ordering::Relaxed) == 1
    })
    .await;
    // Held for five heartbeats past the result.
    tokio::time::sleep(Duration::from_secs(5)).await;
    tx.commit().await.unwrap();
    testkit::eventually(20, "the result is recorded", || async {
        states(&r, "waits").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;
    let marked = r
        .count("SELECT count(*) FROM strata.events WHERE stream = 'node/n-wait' AND type = 'node.marked_unreachable'")
        .await;
    assert_eq!(
        marked, 0,
        "the node was marked unreachable while its gateway was not listening"
    );
    assert_eq!(
        n.stats.connects.load(Ordering::Relaxed),
        1,
        "the session ended"
    );
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}

/// A result the database failed to record (the connection recording it
/// was ended) is recorded once the database answers again, on the same
/// session: a restarting database does not end the session of every node
/// that reports a result meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_database_failed_to_record_is_recorded_on_the_same_session() {
    let r = region().await;
    let gw = r
        .gateway("gw-fail", |c| c.ack_hold = Duration::from_secs(60))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let n = slow_diagnostics(&r, &gw, dir.path(), "n-fail", Duration::from_secs(5)).await;
    domain::commands::issue(&r.appender, &diag("fails", "n-fail", now_ms() + 60_000))
        .await
        .unwrap();
    // The command's stream is locked while the diagnostics run (locked
    // once they started: a transaction open before the gateway's
    // replication slot is consistent would hold its dispatch back):
    // recording the result waits for the lock, and its connection is
    // ended there.
    testkit::eventually(20, "the node runs the command", || async {
        n.stats.commands_run.load(Ordering::Relaxed) == 1
    })
    .await;
    let mut locker = events::db::connect(&r.cfg, "locker").await.unwrap();
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM strata.streams WHERE stream = 'command/fails' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(
        states(&r, "fails").await.last().map(String::as_str),
        Some("command.issued"),
        "the result was recorded before the lock"
    );
    testkit::eventually(20, "the result's write is ended while it waits", || async {
        r.count(
            "SELECT count(*) FILTER (WHERE ended) FROM (
               SELECT pg_terminate_backend(pid) AS ended FROM pg_stat_activity
                WHERE wait_event_type = 'Lock' AND datname = current_database()
                  AND pid <> pg_backend_pid()) t",
        )
        .await
            > 0
    })
    .await;
    tx.commit().await.unwrap();
    testkit::eventually(20, "the result is recorded", || async {
        states(&r, "fails").await.last().map(String::as_str) == Some("command.succeeded")
    })
    .await;
    assert_eq!(
        n.stats.connects.load(Ordering::Relaxed),
        1,
        "the session ended over the failed write"
    );
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}
