//! Topology tiers end to end: a seeded fleet labelled in racks, an operator
//! moving a node to another rack, and gangs placed within one rack or
//! spread over racks by a real placer.

use super::placement::{placer, show_reservation};
use super::{database, ok, reserve_args, strata};
use testkit::wait_for;

/// The rack of each node a reservation is on, as `pool show` would say.
fn racks_of(url: &str, id: &str) -> Vec<String> {
    let r = show_reservation(url, id);
    let mut racks: Vec<String> = r["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            // gpu-n0000<i>: racks of two, rack-0000 holds nodes 0 and 1.
            let n: u32 = a["node"].as_str().unwrap()[5..].parse().unwrap();
            format!("rack-{:04}", n / 2)
        })
        .collect();
    racks.sort();
    racks
}

#[test]
fn gangs_are_placed_within_one_rack_or_spread_over_racks() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    ok(&["pool", "create", "gpu", "--database-url", &url]);
    let out = ok(&[
        "pool",
        "seed",
        "gpu",
        "--nodes",
        "4",
        "--gpus",
        "8",
        "--nodes-per-rack",
        "2",
        "--racks-per-block",
        "2",
        "--database-url",
        &url,
    ]);
    assert!(
        out.contains("labelled them in racks of 2, blocks of 2 racks"),
        "{out}"
    );
    let _placer = crate::gateway::Killed(placer(&url, "topology", &dir.path().join("placer.log")));
    // A topology is for gangs.
    let err = strata(&reserve_args(&url, &["--gpus", "8", "--within", "rack"]));
    assert_eq!(err.status.code(), Some(2), "clap: --within needs --nodes");
    // Two nodes in one rack.
    ok(&reserve_args(
        &url,
        &[
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--within",
            "rack",
            "--id",
            "pair",
            "--wait",
        ],
    ));
    let pair = racks_of(&url, "pair");
    assert_eq!(pair[0], pair[1], "one rack: {pair:?}");
    // The other rack has two whole nodes, 16 GPUs: enough for a gang of
    // two spread over two racks, but not where it asks. It waits and says
    // why.
    let waited = strata(&reserve_args(
        &url,
        &[
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--spread",
            "rack",
            "--id",
            "wide",
            "--wait",
            "--timeout",
            "3s",
        ],
    ));
    let said = String::from_utf8_lossy(&waited.stderr);
    assert_eq!(waited.status.code(), Some(4), "{said}");
    assert!(
        said.contains("topology cannot be met now: 16 H100-80GB GPUs are free, but not 2 racks with a node with 8 free"),
        "{said}"
    );
    for id in ["wide", "pair"] {
        ok(&["release", id, "--database-url", &url]);
    }
    wait_for(30, || {
        Some(show_reservation(&url, "pair")).filter(|v| v["phase"] == "ended")
    })
    .expect("pair released");
    // Spread over racks: one node in each.
    ok(&reserve_args(
        &url,
        &[
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--spread",
            "rack",
            "--id",
            "apart",
            "--wait",
        ],
    ));
    let apart = racks_of(&url, "apart");
    assert_ne!(apart[0], apart[1], "two racks: {apart:?}");
    // An operator says where a node is; a bad label is refused.
    let out = ok(&[
        "nodes",
        "topology",
        "gpu-n00003",
        "--rack",
        "rack-9",
        "--block",
        "block-9",
        "--database-url",
        &url,
    ]);
    assert!(out.contains("rack rack-9, block block-9"), "{out}");
    let bad = strata(&[
        "nodes",
        "topology",
        "gpu-n00003",
        "--rack",
        "a/b",
        "--database-url",
        &url,
    ]);
    assert_ne!(bad.status.code(), Some(0));
    let report = super::placement::check_json(&url);
    assert_eq!(report["live"], 1, "{report}");
    crate::events_conform(&url, &[]);
}
