//! GPU faults injected into a real node daemon from outside it
//! (`strata fault`), acted on by a real placer: a double-bit ECC error on
//! one GPU of a busy node quarantines that GPU and ends its reservation
//! while the others run, a harmless XID takes nothing out of service, an
//! operator's clear brings the GPU back, a flood of faults across the
//! pool stops at the circuit breaker, and a node failing its acceptance
//! check (on a re-check, or when its daemon starts again) takes no work
//! until one passes, and a re-check brings back no node that left.

use super::ok;
use super::one_node::region;

/// The node's acceptance checks in the log, oldest first.
fn acceptance_reports(r: &super::one_node::Region) -> Vec<serde_json::Value> {
    r.pool_events(&["node.acceptance_reported"])
        .into_iter()
        .map(|(_, p)| p)
        .collect()
}

/// The GPU index of `id`'s first device (`GPU-fake-n1-3` is 3).
fn gpu_of(r: &super::one_node::Region, id: &str) -> String {
    let shown = r.show(id);
    let d = shown["allocations"][0]["devices"][0]
        .as_str()
        .unwrap()
        .to_string();
    d.rsplit('-').next().unwrap().to_string()
}

fn metric(at: &str, name: &str) -> f64 {
    let (_, body) = super::http_get(at, "/metrics");
    body.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_double_bit_ecc_error_quarantines_one_gpu_of_a_busy_node_and_ends_only_its_reservation() {
    let r = region();
    let _node = r.node(&[]);
    r.wait_for_gpus();
    r.reserve_with("a", 2, &["--replace-on-failure"]);
    for id in ["b", "c", "d"] {
        r.reserve(id, 2);
    }
    for id in ["a", "b", "c", "d"] {
        r.wait_until(60, &format!("{id} is active"), || r.phase(id) == "active");
    }
    let (bad, harmless) = (gpu_of(&r, "a"), gpu_of(&r, "b"));
    let bad_id = format!("GPU-fake-n1-{bad}");

    // An application's fault on b's GPU: recorded, nothing taken out.
    r.fault(&["--gpu", &harmless, "--xid", "13"]);
    // A double-bit ECC error on a's.
    r.fault(&["--gpu", &bad, "--xid", "48"]);
    r.wait_until(30, "a ends", || r.phase("a") == "ended");
    let quarantined = r.pool_events(&["device.quarantined"]);
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert_eq!(quarantined[0].1["device"], bad_id.as_str());
    assert_eq!(quarantined[0].1["condition"], "XID-48");
    assert_eq!(quarantined[0].1["action"], "reset_gpu");
    let raised = r.pool_events(&["health.raised"]);
    let classified: Vec<(String, String)> = raised
        .iter()
        .map(|(_, p)| {
            (
                p["condition"].as_str().unwrap().to_string(),
                p["action"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(classified.contains(&("XID-13".into(), "restart_workload".into())));
    assert!(classified.contains(&("XID-48".into(), "reset_gpu".into())));
    let failed = super::gateway::query(
        &r.url,
        "SELECT payload->>'reason', payload->>'replaced_by' FROM strata.events WHERE type = 'reservation.failed' AND payload->>'reservation' = 'a'",
    );
    assert_eq!(failed, [["gpu_fault".to_string(), "a~1".to_string()]]);
    // The others keep running, b's harmless fault notwithstanding; a's
    // binding and CDI spec go with it.
    for id in ["b", "c", "d"] {
        assert_eq!(r.phase(id), "active", "{id}");
    }
    r.wait_until(30, "a's binding and spec go", || {
        !node::allocation::bound_reservations(&r.node_dir()).contains("a")
            && !r.specs().iter().any(|s| s == "strata-reservation-a.json")
    });
    // Its replacement waits: 2 GPUs asked, 1 in service and free.
    r.wait_until(30, "a~1 waits", || r.phase("a~1") == "queued");

    let shown = r.node_shown();
    let gpu = |id: &str| {
        shown["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(gpu(&bad_id)["quarantined_for"], "XID-48");
    let b_gpu = gpu(&format!("GPU-fake-n1-{harmless}"));
    assert_eq!(b_gpu["quarantined_for"], serde_json::Value::Null);
    assert_eq!(b_gpu["conditions"][0]["action"], "restart_workload");
    assert!(shown["history"].as_array().unwrap().len() >= 3);
    let pool: serde_json::Value = serde_json::from_str(&ok(&[
        "pool",
        "show",
        "p",
        "--database-url",
        &r.url,
        "--output",
        "json",
    ]))
    .unwrap();
    assert_eq!(pool["faults"]["out_of_service"], 1);
    assert_eq!(
        pool["faults"]["quarantined"],
        serde_json::json!([format!("n1/{bad_id} (XID-48)")])
    );
    assert_eq!(metric(&r.metrics, "strata_placer_quarantined_total"), 1.0);

    // An operator clears it: the GPU is back and the replacement runs.
    ok(&[
        "nodes",
        "clear-health",
        "n1",
        "--device",
        &bad_id,
        "--condition",
        "XID-48",
        "--database-url",
        &r.url,
    ]);
    r.wait_until(60, "a~1 is active on the restored GPU", || {
        r.phase("a~1") == "active"
    });
    assert_eq!(r.pool_events(&["device.restored"]).len(), 1);
}

#[test]
fn a_gpu_quarantined_for_a_reset_comes_back_by_itself_once_its_fault_clears_and_a_diagnostic_passes(
) {
    let r = region();
    let _node = r.node(&[]);
    r.wait_for_gpus();
    r.reserve_with("all", 8, &["--replace-on-failure"]);
    r.wait_until(60, "all is active", || r.phase("all") == "active");
    let bad = "GPU-fake-n1-3";
    r.fault(&["--gpu", "3", "--xid", "48"]);
    r.wait_until(30, "all ends", || r.phase("all") == "ended");
    r.wait_until(30, "all~1 waits", || r.phase("all~1") == "queued");
    let checks = || r.pool_events(&["node.acceptance_reported"]).len();

    // The fault clears (the GPU was reset), but its diagnostic fails: the
    // daemon checks at once and reports it; the quarantine stays.
    r.fault(&[
        "--gpu",
        "3",
        "--diag",
        "fail",
        "--detail",
        "row remap pending",
    ]);
    let before = checks();
    r.fault(&["--gpu", "3", "--xid", "48", "--clear"]);
    r.wait_until(30, "the daemon's check after the clear", || {
        checks() > before
    });
    let last = r
        .pool_events(&["node.acceptance_reported"])
        .pop()
        .unwrap()
        .1;
    assert_eq!(last["failed_devices"], serde_json::json!([bad]));
    assert!(r.pool_events(&["device.restored"]).is_empty());
    assert_eq!(r.phase("all~1"), "queued");

    // Raised and cleared again with the diagnostic passing: the placer
    // restores the GPU and the replacement runs.
    r.fault(&["--gpu", "3", "--diag", "pass"]);
    r.fault(&["--gpu", "3", "--xid", "48"]);
    r.fault(&["--gpu", "3", "--xid", "48", "--clear"]);
    r.wait_until(60, "all~1 is active on the restored GPU", || {
        r.phase("all~1") == "active"
    });
    let restored = r.pool_events(&["device.restored"]);
    assert_eq!(restored.len(), 1, "{restored:?}");
    assert_eq!(restored[0].1["device"], bad);
    assert!(
        restored[0].1["reason"]
            .as_str()
            .unwrap()
            .contains("XID-48 is gone and a diagnostic passed"),
        "{restored:?}"
    );
    assert_eq!(metric(&r.metrics, "strata_placer_restored_total"), 1.0);
}

#[test]
fn a_flood_of_faults_across_the_pool_stops_at_the_circuit_breaker() {
    let r = region();
    let _node = r.node(&[]);
    r.wait_for_gpus();
    let policy = ok(&[
        "pool",
        "policy",
        "p",
        "--max-quarantined",
        "25",
        "--database-url",
        &r.url,
    ]);
    assert!(
        policy.contains("circuit breaker 25% (2 of 8 GPUs)"),
        "{policy}"
    );
    r.reserve("busy", 8);
    r.wait_until(60, "busy is active", || r.phase("busy") == "active");
    // Every GPU reports a double-bit ECC error at once (a bad driver
    // update, say): two are quarantined, the rest reported and kept.
    for g in 0..8 {
        r.fault(&["--gpu", &g.to_string(), "--xid", "48"]);
    }
    r.wait_until(30, "every fault is answered", || {
        r.pool_events(&["device.quarantined", "device.quarantine_withheld"])
            .len()
            == 8
    });
    assert_eq!(r.pool_events(&["device.quarantined"]).len(), 2);
    let withheld = r.pool_events(&["device.quarantine_withheld"]);
    assert_eq!(withheld.len(), 6);
    assert!(
        withheld[0].1["reason"]
            .as_str()
            .unwrap()
            .contains("circuit breaker open: 2 of 8"),
        "{withheld:?}"
    );
    r.wait_until(30, "the withheld count is on /metrics", || {
        metric(&r.metrics, "strata_placer_quarantine_withheld_total") == 6.0
    });
    // The process's runtime is watched (sampled every 100 ms).
    assert!(metric(&r.metrics, "strata_runtime_lag_seconds_count") > 0.0);
    // The one reservation on the quarantined GPUs ends; the six withheld
    // GPUs take work again.
    r.wait_until(30, "busy ends", || r.phase("busy") == "ended");
    r.reserve("after", 6);
    r.wait_until(60, "six GPUs are placed again", || {
        r.phase("after") == "active"
    });

    // An advisory pool quarantines nothing at all.
    ok(&[
        "pool",
        "policy",
        "p",
        "--faults",
        "advisory",
        "--database-url",
        &r.url,
    ]);
    ok(&[
        "nodes",
        "clear-health",
        "n1",
        "--device",
        "GPU-fake-n1-0",
        "--condition",
        "XID-48",
        "--database-url",
        &r.url,
    ]);
    let before = r.pool_events(&["device.quarantine_withheld"]).len();
    r.fault(&["--gpu", "0", "--clear", "--xid", "48"]);
    r.fault(&["--gpu", "0", "--xid", "48"]);
    r.wait_until(30, "the fault is reported, not acted on", || {
        r.pool_events(&["device.quarantine_withheld"]).len() == before + 1
    });
    assert_eq!(r.pool_events(&["device.quarantined"]).len(), 2);
}

#[test]
fn a_node_failing_its_acceptance_check_never_gets_a_placement() {
    let r = region();
    let acceptance = || acceptance_reports(&r);
    let mut daemon = r.node_with(&[], &["--recheck-every", "1s"]);
    r.wait_for_gpus();
    r.wait_until(30, "the first check is reported", || {
        !acceptance().is_empty()
    });
    assert_eq!(acceptance()[0]["passed"], true, "{:?}", acceptance());

    // Every GPU starts failing its diagnostic: the next re-check says so,
    // and nothing is placed on the node.
    r.fault(&["--diag", "fail", "--detail", "memory test failed"]);
    r.wait_until(30, "the failed re-check is reported", || {
        acceptance().last().is_some_and(|a| a["passed"] == false)
    });
    let failed = acceptance().last().cloned().unwrap();
    assert_eq!(failed["failed_devices"].as_array().unwrap().len(), 8);
    assert!(failed["reason"]
        .as_str()
        .unwrap()
        .contains("GPU-fake-n1-0: memory test failed"));
    r.reserve("waits", 1);
    r.wait_until(30, "the request waits", || r.phase("waits") == "queued");
    let placed = || r.pool_events(&["reservation.placed"]).len();
    assert_eq!(placed(), 0);
    let shown = ok(&["pool", "show", "p", "--nodes", "--database-url", &r.url]);
    assert!(
        shown.contains("GPU-fake-n1-0 failed its acceptance check"),
        "{shown}"
    );

    // It passes again: the request is placed.
    r.fault(&["--diag", "pass"]);
    r.wait_until(60, "the request is placed once the check passes", || {
        r.phase("waits") == "active"
    });
    assert_eq!(acceptance().last().unwrap()["passed"], true);
    ok(&["release", "waits", "--database-url", &r.url]);
    r.wait_until(30, "waits is released", || r.phase("waits") == "ended");

    // The daemon stops; its GPUs fail while it is down; it starts again
    // (a reboot): its first session reports the failed check with its
    // devices, and the node takes no work.
    drop(daemon);
    r.fault(&["--diag", "fail", "--gpu", "5"]);
    r.fault(&["--diag", "fail", "--detail", "after the reboot"]);
    daemon = r.node_with(&[], &["--recheck-every", "0s"]);
    r.wait_until(30, "the check after the restart is reported", || {
        acceptance().last().is_some_and(|a| {
            a["passed"] == false
                && a["reason"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("after the reboot")
        })
    });
    let before = placed();
    r.reserve("after-reboot", 1);
    r.wait_until(30, "the request waits", || {
        r.phase("after-reboot") == "queued"
    });
    assert_eq!(placed(), before);
    drop(daemon);
}

#[test]
fn a_recheck_reports_the_check_alone_and_brings_back_no_node_that_left() {
    // A re-check's result is the check, not a join: a node an operator took
    // out of its pool stays out while its daemon goes on checking, and the
    // log is not told again of devices it already has.
    let r = region();
    let acceptance = || acceptance_reports(&r);
    let joined = || r.pool_events(&["node.joined"]).len();
    let _daemon = r.node_with(&[], &["--recheck-every", "1s"]);
    r.wait_for_gpus();
    r.wait_until(30, "the first check is reported", || {
        !acceptance().is_empty()
    });
    assert_eq!(joined(), 1);
    ok(&[
        "nodes",
        "leave",
        "n1",
        "--reason",
        "decommissioned",
        "--database-url",
        &r.url,
    ]);
    r.wait_until(30, "the node is out of its pool", || {
        r.node_shown()["state"] == "left (decommissioned)"
    });
    for (diag, passed) in [
        (&["--diag", "fail"][..], false),
        (&["--diag", "pass"], true),
    ] {
        r.fault(diag);
        r.wait_until(30, "the re-check is reported", || {
            acceptance().last().is_some_and(|a| a["passed"] == passed)
        });
    }
    assert_eq!(joined(), 1, "a re-check's result was written as a join");
    let shown = r.node_shown();
    assert_eq!(shown["state"], "left (decommissioned)", "{shown}");
    assert_eq!(shown["schedulable"], false, "{shown}");
}

/// A stand-in `dcgmi` in a folder of its own: it records its arguments in
/// `calls` there and passes, or fails while `fail` exists beside it.
fn fake_dcgmi(dir: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("dcgm-bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = format!(
        "#!/bin/sh\necho \"$@\" >> {calls}\nif [ -e {fail} ]; then echo '{{\"result\":\"fail\"}}'; exit 1; fi\necho '{{\"result\":\"pass\"}}'\n",
        calls = bin.join("calls").display(),
        fail = bin.join("fail").display(),
    );
    let path = bin.join("dcgmi");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

#[test]
fn a_pools_dcgm_level_reaches_its_nodes_checks_and_a_failing_diag_keeps_the_node_out() {
    let r = region();
    let bin = fake_dcgmi(r.dir.path());
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let shown = ok(&[
        "pool",
        "policy",
        "p",
        "--dcgm-level",
        "3",
        "--database-url",
        &r.url,
        "--output",
        "json",
    ]);
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["dcgm_level"], 3);
    // The node runs DCGM (its own level 1); the pool's 3 is told when its
    // session opens, and it checks again at it.
    let env = [("PATH", path.as_str())];
    let node = r.node_with(&env, &["--dcgm-level", "1"]);
    let checked_at = |level: u32| {
        r.pool_events(&["node.acceptance_reported"])
            .iter()
            .any(|(_, p)| p["report"]["dcgm_level"] == level)
    };
    r.wait_until(60, "a check at the pool's level reaches the log", || {
        checked_at(3)
    });
    let calls = std::fs::read_to_string(bin.join("calls")).unwrap();
    assert_eq!(calls.lines().next(), Some("diag -r 1 -j"), "{calls}");
    assert!(calls.lines().any(|l| l == "diag -r 3 -j"), "{calls}");
    assert_eq!(r.node_shown()["schedulable"], true);

    // DCGM fails from now on; the daemon restarts and checks at the level it
    // was last told (kept in its data dir): the node takes no work.
    drop(node);
    std::fs::write(bin.join("fail"), b"").unwrap();
    let before = r.pool_events(&["node.acceptance_reported"]).len();
    let _node = r.node_with(&env, &["--dcgm-level", "1"]);
    r.wait_until(60, "the failing check reaches the log", || {
        r.pool_events(&["node.acceptance_reported"]).len() > before
    });
    let last = r
        .pool_events(&["node.acceptance_reported"])
        .pop()
        .unwrap()
        .1;
    assert_eq!(last["passed"], false);
    assert_eq!(last["reason"], "dcgmi diag -r 3 failed");
    let calls = std::fs::read_to_string(bin.join("calls")).unwrap();
    assert_eq!(calls.lines().last(), Some("diag -r 3 -j"), "{calls}");
    r.reserve("waits", 1);
    r.wait_until(30, "the request waits", || r.phase("waits") == "queued");
    assert_eq!(r.node_shown()["schedulable"], false);
}
