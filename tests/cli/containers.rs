//! Containers on reservations, through real Podman reading the CDI specs a
//! real node daemon writes: a container given a reservation's CDI device
//! sees exactly its GPUs' device nodes and environment, and is refused once
//! the reservation is released; a daemon killed between a bind and its spec
//! converges when it starts again.
//!
//! Podman 4.3 (Debian 12) reads specs only from `/etc/cdi` and `/run/cdi`,
//! so each run binds the daemon's CDI folder over `/run/cdi` in a mount
//! namespace of its own (`unshare --mount`): tests running side by side
//! never see each other's specs.

use super::ok;
use super::one_node::{region, Region};
use super::strata;
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// The test image: a folder holding Debian's static busybox, imported
/// (no registry is reachable).
fn image() -> &'static str {
    static IMAGE: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    IMAGE.get_or_init(|| {
        const NAME: &str = "localhost/strata-test-busybox:latest";
        let busybox = Path::new("/bin/busybox");
        assert!(
            busybox.exists() && which("podman") && which("runc"),
            "these tests need Podman, runc and a static busybox: apt-get install podman runc busybox-static"
        );
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("root/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::copy(busybox, bin.join("busybox")).unwrap();
        for tool in ["sh", "ls", "env", "cat"] {
            std::os::unix::fs::symlink("busybox", bin.join(tool)).unwrap();
        }
        let tar = dir.path().join("root.tar");
        run_ok(
            Command::new("tar")
                .arg("-C")
                .arg(dir.path().join("root"))
                .arg("-cf")
                .arg(&tar)
                .arg("."),
        );
        run_ok(Command::new("podman").arg("import").arg(&tar).arg(NAME));
        NAME
    })
}

fn which(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn run_ok(c: &mut Command) -> Output {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `script` in a container given CDI device `device`, Podman reading
/// the specs in `cdi`, as these machines run Podman.
fn podman(cdi: &Path, device: &str, script: &str) -> Output {
    let image = image();
    Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mkdir -p /run/cdi && mount --bind "$0" /run/cdi && exec podman "$@""#)
        .arg(cdi)
        .args([
            "--runtime",
            "runc",
            "--cgroup-manager=cgroupfs",
            "run",
            "--rm",
            "--network=none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
            "--device",
            device,
            image,
            "sh",
            "-c",
            script,
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// What a container given `device` sees: its `/dev/nvidia*` device nodes
/// (sorted) and its `NVIDIA_VISIBLE_DEVICES` and `STRATA_RESERVATION`.
fn seen_by_container(cdi: &Path, device: &str) -> (Vec<String>, Vec<String>) {
    let out = podman(cdi, device, "ls /dev; echo ---; env");
    assert!(
        out.status.success(),
        "podman run --device {device}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let (devs, env) = text.split_once("---").unwrap();
    let mut nodes: Vec<String> = devs
        .split_whitespace()
        .filter(|d| d.starts_with("nvidia"))
        .map(|d| format!("/dev/{d}"))
        .collect();
    nodes.sort();
    let mut vars: Vec<String> = env
        .lines()
        .filter(|l| l.starts_with("NVIDIA_") || l.starts_with("STRATA_"))
        .map(str::to_string)
        .collect();
    vars.sort();
    (nodes, vars)
}

/// The device nodes and environment a container on reservation `id` must
/// see, from its allocation in the log.
fn expected(r: &Region, id: &str) -> (Vec<String>, Vec<String>) {
    let shown = r.show(id);
    let devices: Vec<String> = shown["allocations"][0]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect();
    let mut nodes: Vec<String> = devices
        .iter()
        .map(|d| {
            let index = d.rsplit('-').next().unwrap();
            format!("/dev/nvidia{index}")
        })
        .chain(
            ["nvidia-uvm", "nvidia-uvm-tools", "nvidiactl"]
                .iter()
                .map(|n| format!("/dev/{n}")),
        )
        .collect();
    nodes.sort();
    let vars = vec![
        format!("NVIDIA_VISIBLE_DEVICES={}", devices.join(",")),
        format!("STRATA_RESERVATION={id}"),
    ];
    (nodes, vars)
}

#[test]
fn a_container_sees_exactly_its_reservations_gpus_and_loses_them_at_release() {
    let r = region();
    let _node = r.node(&[]);
    r.wait_for_gpus();
    // An id that is not a valid CDI name as it stands.
    r.reserve("train@a", 2);
    r.reserve("b", 3);
    for id in ["train@a", "b"] {
        r.wait_until(60, &format!("{id} is active"), || r.phase(id) == "active");
    }
    let a = r.show("train@a");
    assert_eq!(a["cdi_device"], "strata.dev/reservation=train_40a");
    let b_device = r.show("b")["cdi_device"].as_str().unwrap().to_string();
    assert_eq!(
        r.specs(),
        [
            "strata-reservation-b.json",
            "strata-reservation-train_40a.json"
        ]
    );
    let text = ok(&["reservations", "show", "train@a", "--database-url", &r.url]);
    assert!(
        text.contains("CDI device: strata.dev/reservation=train_40a"),
        "{text}"
    );

    for (id, device) in [
        ("train@a", "strata.dev/reservation=train_40a"),
        ("b", b_device.as_str()),
    ] {
        let seen = seen_by_container(&r.cdi(), device);
        assert_eq!(seen, expected(&r, id), "what a container on {id} sees");
    }

    let released = strata(&[
        "release",
        "train@a",
        "--database-url",
        &r.url,
        "--reason",
        "done",
    ]);
    assert!(released.status.success());
    r.wait_until(60, "train@a's spec is removed", || {
        r.specs() == ["strata-reservation-b.json"]
    });
    let refused = podman(&r.cdi(), "strata.dev/reservation=train_40a", "true");
    assert!(!refused.status.success(), "a released reservation's device");
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("unresolvable CDI devices"), "{why}");
    // The other reservation keeps its GPUs.
    assert_eq!(seen_by_container(&r.cdi(), &b_device), expected(&r, "b"));
    assert_eq!(
        node::allocation::bound_reservations(&r.node_dir()),
        ["b".to_string()].into()
    );
}

#[test]
fn a_daemon_killed_between_a_bind_and_its_spec_converges_when_it_starts_again() {
    let r = region();
    let mut crashing = r.node(&[(
        node::allocation::CRASH_AT_ENV,
        node::allocation::CRASH_AFTER_BINDING,
    )]);
    r.wait_for_gpus();
    r.reserve("cut", 1);
    r.wait_until(60, "the daemon crashes in the bind", || {
        crashing.0.try_wait().unwrap().is_some()
    });
    // What the crash left: the binding without its spec; and the spec of a
    // binding that is gone (as a crash inside a release would leave).
    assert_eq!(
        node::allocation::bound_reservations(&r.node_dir()),
        ["cut".to_string()].into()
    );
    assert!(r.specs().is_empty());
    std::fs::create_dir_all(r.cdi()).unwrap();
    std::fs::write(
        r.cdi().join("strata-reservation-ghost.json"),
        br#"{"cdiVersion":"0.5.0","kind":"strata.dev/reservation","devices":[{"name":"ghost","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia7","hostPath":"/dev/null"}]}}]}"#,
    )
    .unwrap();
    assert!(podman(&r.cdi(), "strata.dev/reservation=ghost", "true")
        .status
        .success());

    let _node = r.node(&[]);
    // The interrupted bind is reported failed (it is never run twice), so
    // the binder ends the reservation and its release takes the binding.
    r.wait_until(60, "the cut reservation ends and its binding goes", || {
        r.show("cut")["phase"] == "ended"
            && node::allocation::bound_reservations(&r.node_dir()).is_empty()
    });
    assert!(r.specs().is_empty(), "{:?}", r.specs());
    let log = std::fs::read_to_string(r.dir.path().join("node.log")).unwrap();
    assert!(
        log.contains("made them agree") && log.contains("specs_removed=[\"ghost\"]"),
        "{log}"
    );
    assert!(!podman(&r.cdi(), "strata.dev/reservation=ghost", "true")
        .status
        .success());
    // And the node binds as before.
    r.reserve("next", 2);
    r.wait_until(60, "next is active", || r.phase("next") == "active");
    assert_eq!(r.specs(), ["strata-reservation-next.json"]);
    assert_eq!(
        seen_by_container(&r.cdi(), "strata.dev/reservation=next"),
        expected(&r, "next")
    );
}
