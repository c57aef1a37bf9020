//! Gateways that die or freeze, as real processes: a gateway killed with
//! SIGKILL together with the nodes on it (a rack losing power) has those
//! nodes marked lost by the other gateway once its lease lapses, and their
//! reservations end; a gateway stopped with SIGSTOP loses its nodes to the
//! other gateway within seconds (they stop getting answers to their pings),
//! and once woken it writes nothing stale for them.

use super::gateway::{ca_pool_and_token, free_port, gateway, query, Killed};
use super::{database, ok, spawn};
use std::path::Path;

/// A region of two gateways (`gw-a`, `gw-b`) and one placer and binder
/// (nodes lost after 3 s), pool `p`.
struct Two {
    url: String,
    /// The gateways' ids (unique per test: their replication slots are the
    /// cluster's).
    id_a: String,
    id_b: String,
    dir: tempfile::TempDir,
    a: Killed,
    _b: Killed,
    _roles: Killed,
    addr_a: String,
    addr_b: String,
}

fn two() -> Two {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    let ca_s = ca.to_str().unwrap();
    ca_pool_and_token(&url, ca_s);
    let (pa, pb) = (free_port(), free_port());
    let db = url.rsplit('/').next().unwrap().to_string();
    let (id_a, id_b) = (format!("a-{db}"), format!("b-{db}"));
    let a = Killed(gateway(&url, &id_a, pa, ca_s, &dir.path().join("a.log")));
    let b = Killed(gateway(&url, &id_b, pb, ca_s, &dir.path().join("b.log")));
    let listening = |log: &str| {
        std::fs::read_to_string(dir.path().join(log))
            .unwrap_or_default()
            .contains("gateway listening")
    };
    let logs = dir.path().to_path_buf();
    testkit::wait_until(
        30,
        "both gateways listen",
        || listening("a.log") && listening("b.log"),
        move || tail_logs(&logs),
    );
    let slot = format!("liveness_{db}");
    let roles = Killed(spawn(
        &[
            "serve",
            "--roles",
            "placer,binder",
            "--database-url",
            &url,
            "--slot",
            &slot,
            "--node-lost-after",
            "3s",
        ],
        &dir.path().join("roles.log"),
    ));
    Two {
        url,
        id_a,
        id_b,
        a,
        _b: b,
        _roles: roles,
        addr_a: format!("https://127.0.0.1:{pa}"),
        addr_b: format!("https://127.0.0.1:{pb}"),
        dir,
    }
}

impl Two {
    /// A fleet of `n` simulated nodes named `<prefix>N` on `gateways`.
    fn fleet(&self, prefix: &str, n: u32, gateways: &str) -> Killed {
        let data = self.dir.path().join(prefix);
        let n = n.to_string();
        Killed(spawn(
            &[
                "fleet",
                "--database-url",
                &self.url,
                "--nodes",
                &n,
                "--gateway",
                gateways,
                "--pool",
                "p",
                "--ca",
                self.dir.path().join("ca/ca.pem").to_str().unwrap(),
                "--data-dir",
                data.to_str().unwrap(),
                "--prefix",
                prefix,
            ],
            &self.dir.path().join(format!("{prefix}.log")),
        ))
    }

    fn wait_until(&self, secs: u64, what: &str, f: impl FnMut() -> bool) {
        let logs = self.dir.path().to_path_buf();
        testkit::wait_until(secs, what, f, move || tail_logs(&logs));
    }

    /// Nodes whose newest session is on `gateway`.
    fn on(&self, gateway: &str) -> Vec<String> {
        query(
            &self.url,
            &format!(
                "SELECT node FROM strata.node_sessions WHERE gateway = '{gateway}' ORDER BY node"
            ),
        )
        .into_iter()
        .map(|r| r[0].clone())
        .collect()
    }

    /// How many events of `types` the log holds for `node`.
    fn count(&self, node: &str, types: &str) -> usize {
        query(
            &self.url,
            &format!(
                "SELECT count(*)::text FROM strata.events WHERE payload->>'node' = '{node}' AND type IN ({types})"
            ),
        )[0][0]
            .parse()
            .unwrap()
    }
}

fn tail_logs(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(12).collect();
            eprintln!("--- {} (newest first)\n{}", p.display(), tail.join("\n"));
        }
    }
}

#[test]
fn a_gateway_killed_with_its_nodes_has_them_marked_lost_and_their_gpus_freed() {
    let mut r = two();
    let rack = r.fleet("rack-", 3, &r.addr_a);
    let other = r.fleet("other-", 1, &r.addr_b);
    r.wait_until(60, "every node has a session", || {
        r.on(&r.id_a).len() == 3 && r.on(&r.id_b).len() == 1
    });
    for i in 0..4 {
        let id = format!("r{i}");
        ok(&[
            "reserve",
            "--database-url",
            &r.url,
            "--pool",
            "p",
            "--class",
            "H100-80GB",
            "--gpus",
            "8",
            "--shape",
            "node",
            "--id",
            &id,
        ]);
    }
    let phase = |id: &str| -> String {
        let shown = ok(&[
            "reservations",
            "show",
            id,
            "--database-url",
            &r.url,
            "--output",
            "json",
        ]);
        let v: serde_json::Value = serde_json::from_str(&shown).unwrap();
        v["phase"].as_str().unwrap_or_default().to_string()
    };
    r.wait_until(60, "every reservation is active", || {
        (0..4).all(|i| phase(&format!("r{i}")) == "active")
    });

    // The rack loses power: its gateway and its nodes die at once.
    let mut rack = rack;
    rack.0.kill().unwrap();
    r.a.0.kill().unwrap();
    let _ = (rack.0.wait(), r.a.0.wait());
    let started = std::time::Instant::now();
    let rack_nodes: Vec<String> = (0..3).map(|i| format!("rack-{i:05}")).collect();
    r.wait_until(30, "the other gateway marks the rack's nodes lost", || {
        rack_nodes
            .iter()
            .all(|n| r.count(n, "'node.session_expired'") == 1)
    });
    let detected = started.elapsed();
    for n in &rack_nodes {
        let by = query(
            &r.url,
            &format!("SELECT payload->>'by', payload->>'gateway' FROM strata.events WHERE type = 'node.session_expired' AND payload->>'node' = '{n}'"),
        );
        assert_eq!(by, [[r.id_b.clone(), r.id_a.clone()]]);
        assert_eq!(r.count(n, "'node.contact_lost'"), 1, "{n}");
    }
    // Their reservations end as any lost node's (after the 3 s bound); the
    // other gateway's node keeps its own.
    r.wait_until(30, "the rack's reservations end", || {
        query(
            &r.url,
            "SELECT count(*)::text FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reason' = 'node_lost'",
        )[0][0]
            == "3"
    });
    eprintln!(
        "rack marked lost {:.1} s and its GPUs freed {:.1} s after the power cut",
        detected.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(r.count("other-00000", "'node.contact_lost'"), 0);
    let live = (0..4)
        .filter(|i| phase(&format!("r{i}")) == "active")
        .count();
    assert_eq!(live, 1, "the other node's reservation runs on");

    // A node that dies alone is marked lost once, at its disconnect, not
    // again when its heartbeats stay away (three intervals of 1 s).
    drop(other);
    r.wait_until(30, "the other node is marked lost", || {
        r.count("other-00000", "'node.contact_lost'") == 1
    });
    std::thread::sleep(std::time::Duration::from_secs(5));
    assert_eq!(r.count("other-00000", "'node.contact_lost'"), 1);
}

#[test]
fn a_frozen_gateway_loses_its_nodes_within_seconds_and_writes_nothing_stale_when_it_wakes() {
    let r = two();
    let gateways = format!("{},{}", r.addr_a, r.addr_b);
    let _fleet = r.fleet("f-", 6, &gateways);
    // Nodes that found their home gateway busy come back to it within 45 s.
    r.wait_until(90, "every node has a session, some on gw-a", || {
        let on_a = r.on(&r.id_a).len();
        on_a > 0 && on_a + r.on(&r.id_b).len() == 6
    });
    let frozen: Vec<String> = r.on(&r.id_a);
    assert!(!frozen.is_empty(), "no node chose gw-a as its home");
    let pid = r.a.0.id() as i32;
    let stop = |sig: &str| {
        let out = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(out.success());
    };
    stop("-STOP");
    let started = std::time::Instant::now();
    r.wait_until(30, "gw-a's nodes move to gw-b", || r.on(&r.id_a).is_empty());
    let moved = started.elapsed();
    assert!(moved < std::time::Duration::from_secs(15), "took {moved:?}");
    let before: Vec<(String, usize)> = frozen
        .iter()
        .map(|n| {
            (
                n.clone(),
                r.count(
                    n,
                    "'node.marked_unreachable','node.disconnected','node.contact_lost'",
                ),
            )
        })
        .collect();
    // Woken past its lease: it finds the lease lapsed, and whatever its
    // sweeps try for the sessions it held is refused.
    std::thread::sleep(std::time::Duration::from_secs(8));
    stop("-CONT");
    r.wait_until(30, "gw-a notices its lease lapsed", || {
        std::fs::read_to_string(r.dir.path().join("a.log"))
            .unwrap_or_default()
            .contains("lease lapsed")
    });
    // Three heartbeat intervals and more: a stale sweep would have run.
    std::thread::sleep(std::time::Duration::from_secs(5));
    for (n, count) in before {
        assert_eq!(
            r.count(
                &n,
                "'node.marked_unreachable','node.disconnected','node.contact_lost'"
            ),
            count,
            "gw-a wrote for {n} after it woke"
        );
    }
    let schedulable = query(
        &r.url,
        "SELECT count(*)::text FROM strata.node_sessions WHERE in_contact",
    );
    assert_eq!(schedulable[0][0], "6");
    eprintln!(
        "gw-a's nodes moved {:.1} s after it froze",
        moved.as_secs_f64()
    );
}
