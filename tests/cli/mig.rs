//! MIG with a real node daemon, placer and binder: a node whose GPU 0 is
//! split into seven instances reports each as a device of class
//! `H100-80GB/1g.10gb`; a reservation of instances gets a CDI spec with its
//! GPU's device node once and each instance's capability devices; the GPU
//! is never booked whole while an instance is (a request for every whole
//! GPU waits); `strata nodes mig` refuses an uncordoned node and a GPU
//! that is held, then makes the GPU whole once it is free, the node
//! reports its new devices, and the waiting request takes the GPU. A
//! restarted daemon finds the GPU as it was left.

use super::ok;
use super::one_node::{region, Region};

const SLICE: &str = "H100-80GB/1g.10gb";

/// The node's present devices of `class`.
fn devices_of(r: &Region, class: &str) -> Vec<serde_json::Value> {
    r.node_shown()["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["class"] == class && g["present"] == true)
        .cloned()
        .collect()
}

/// `nodes mig`'s error, when it fails as it should.
fn mig_refused(r: &Region, profiles: &str) -> String {
    let out = mig(r, profiles);
    assert!(!out.status.success(), "nodes mig {profiles} went through");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn mig(r: &Region, profiles: &str) -> std::process::Output {
    super::strata(&[
        "nodes",
        "mig",
        "n1",
        "--gpu",
        "0",
        "--profiles",
        profiles,
        "--database-url",
        &r.url,
        "--wait",
        "30s",
    ])
}

#[test]
fn a_mig_instance_and_its_gpu_are_never_booked_together_and_a_free_gpu_is_made_whole() {
    let r = region();
    let spec = "2xH100-80GB:mig=1g.10gb*7@0";
    let daemon = r.node_of(spec, &[], &[]);
    r.wait_for_gpus();
    assert_eq!(devices_of(&r, SLICE).len(), 7);
    let gpu0 = "GPU-fake-n1-0";
    assert!(devices_of(&r, SLICE).iter().all(|d| d["mig_of"] == gpu0));

    // Three instances: a CDI spec with GPU 0's node once, and two
    // capability devices per instance.
    r.reserve_class("slices", SLICE, 3, &[]);
    r.wait_until(60, "slices is active", || r.phase("slices") == "active");
    let shown = r.show("slices");
    let cdi = shown["cdi_device"].as_str().unwrap().to_string();
    let name = cdi.rsplit('=').next().unwrap();
    let spec_file = r.cdi().join(format!("strata-reservation-{name}.json"));
    let spec_json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_file).unwrap()).unwrap();
    let edits = &spec_json["devices"][0]["containerEdits"];
    let paths: Vec<&str> = edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths.iter().filter(|p| **p == "/dev/nvidia0").count(),
        1,
        "{paths:?}"
    );
    assert_eq!(
        paths
            .iter()
            .filter(|p| p.starts_with("/dev/nvidia-caps/"))
            .count(),
        6,
        "{paths:?}"
    );
    let env = edits["env"].to_string();
    assert!(
        env.contains("NVIDIA_VISIBLE_DEVICES=MIG-fake-n1-0-"),
        "{env}"
    );

    // Both whole GPUs asked for: only GPU 1 is whole and free, so it waits.
    r.reserve_class("whole", "H100-80GB", 2, &[]);
    r.wait_until(30, "whole waits", || r.phase("whole") == "queued");
    let gpus = r.node_shown()["gpus"].as_array().unwrap().clone();
    let booked_gpu0 = gpus.iter().find(|g| g["id"] == gpu0).unwrap()["booked_by"].clone();
    assert!(
        booked_gpu0.is_null(),
        "GPU 0 booked under its instances: {booked_gpu0}"
    );

    // Repartitioning: refused on a node still taking work, and while held.
    let refused = mig_refused(&r, "none");
    assert!(
        refused.contains("cordon or drain node n1 first"),
        "{refused}"
    );
    ok(&["nodes", "cordon", "n1", "--database-url", &r.url]);
    let refused = mig_refused(&r, "none");
    assert!(refused.contains("held by slices"), "{refused}");
    let refused = mig_refused(&r, "4g.40gb*2");
    assert!(refused.contains("compute slices"), "{refused}");

    // Released, GPU 0 is made whole: its instances go from the pool.
    ok(&["release", "slices", "--database-url", &r.url]);
    r.wait_until(30, "slices ends", || r.phase("slices") == "ended");
    let out = mig(&r, "none");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("whole (MIG off)"), "{stdout}");
    r.wait_until(30, "the instances leave the pool", || {
        devices_of(&r, SLICE).is_empty()
    });
    ok(&["nodes", "uncordon", "n1", "--database-url", &r.url]);
    r.wait_until(60, "whole is active", || r.phase("whole") == "active");
    let devices = r.show("whole")["allocations"][0]["devices"].to_string();
    assert!(devices.contains(gpu0), "{devices}");

    // A restarted daemon keeps the layout it was given, not its spec's.
    drop(daemon);
    let _daemon = r.node_of(spec, &[], &[]);
    r.wait_until(60, "the node is back", || {
        r.node_shown()["schedulable"] == true && devices_of(&r, SLICE).is_empty()
    });
    assert_eq!(r.phase("whole"), "active");
}
