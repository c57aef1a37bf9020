//! CDI (Container Device Interface) specs for a node's bindings: what a
//! container runtime (Podman, Docker 25+, containerd with CDI enabled) reads
//! to hand a reservation's GPUs to a container, as
//! `--device strata.dev/reservation=<name>`.
//!
//! One spec file per binding, `strata-reservation-<name>.json` in the CDI
//! folder, holding one device named after the reservation: its GPUs' device
//! nodes, the node-wide ones every GPU workload needs, and the environment
//! (`NVIDIA_VISIBLE_DEVICES` with the GPUs' UUIDs, `STRATA_RESERVATION`).
//! A file is written whole or not at all (a temporary file renamed over
//! it), visible to runtimes at once. It is not flushed: a spec is derived
//! from its binding, which is, and a daemon that starts checks every spec
//! against its binding and writes again any a power cut lost or emptied.
//! [`reconcile`] removes the specs of bindings that are gone.
//!
//! The spec's types are the subset of the CDI JSON format Strata writes,
//! checked here against the format's naming rules and, in the tests, by a
//! real runtime reading them.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The CDI kind of every binding: `vendor/class`.
pub const KIND: &str = "strata.dev/reservation";
/// The CDI format version written: the oldest that has everything these
/// specs use is 0.3.0, and 0.5.0 is the newest that Podman 4.3 (Debian 12)
/// reads: it refuses a 0.6.0 spec as unresolvable. Every newer runtime
/// reads 0.5.0.
pub const VERSION: &str = "0.5.0";
/// The folder runtimes read specs from unless told otherwise.
pub const DEFAULT_DIR: &str = "/var/run/cdi";
/// How spec files of bindings are named: this, the device name, `.json`.
const FILE_PREFIX: &str = "strata-reservation-";

/// A CDI spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
}

/// One device of a spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

/// What a runtime adds to a container that asks for a device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
}

/// A device node: `path` in the container, `host_path` on the node (the
/// same when absent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
}

/// One bound GPU: its UUID and its device nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundGpu {
    pub uuid: String,
    pub nodes: Vec<DeviceNode>,
}

/// Whether `name` is a valid CDI device name: ASCII letters and digits,
/// with `-`, `_`, `.` and `:` inside (never first or last).
pub fn valid_device_name(name: &str) -> bool {
    let b = name.as_bytes();
    let inner = |c: &u8| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b':');
    match (b.first(), b.last()) {
        (Some(f), Some(l)) => {
            f.is_ascii_alphanumeric() && l.is_ascii_alphanumeric() && b.iter().all(inner)
        }
        _ => false,
    }
}

/// The CDI device name of a reservation: its id where the id is a valid
/// device name without `_`; otherwise every byte outside letters, digits,
/// `-`, `.` and `:` (and a leading or trailing `-`, `.` or `:`) is written
/// `_XX` (its hex), and a name that would then start with `_` is prefixed
/// `Z_`. Two ids never share a name: `_` appears only as an escape (then
/// two hex digits follow) or in the prefix (then `_` follows).
pub fn device_name(reservation: &str) -> String {
    let bytes = reservation.as_bytes();
    let last = bytes.len().saturating_sub(1);
    let mut out = String::with_capacity(bytes.len() + 8);
    for (i, &c) in bytes.iter().enumerate() {
        let plain =
            c.is_ascii_alphanumeric() || (matches!(c, b'-' | b'.' | b':') && i != 0 && i != last);
        if plain {
            out.push(c as char);
        } else {
            out.push_str(&format!("_{c:02X}"));
        }
    }
    if out.starts_with('_') || out.is_empty() {
        out.insert_str(0, "Z_");
        if out.len() == 2 {
            // The empty id: no reservation has it, but the name stays valid.
            out.push('0');
        }
    }
    out
}

/// The fully qualified name a runtime is given: `strata.dev/reservation=<name>`.
pub fn qualified_name(reservation: &str) -> String {
    format!("{KIND}={}", device_name(reservation))
}

/// The spec of one binding: the GPUs' nodes (for a MIG instance, its GPU's
/// and its capability devices) and `node_wide` ones (the driver's control
/// devices), each once, and the environment a workload needs.
pub fn spec(reservation: &str, gpus: &[BoundGpu], node_wide: &[DeviceNode]) -> Spec {
    let uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
    // Once each: MIG instances of one GPU share its device node.
    let mut device_nodes: Vec<DeviceNode> = Vec::new();
    for n in gpus.iter().flat_map(|g| &g.nodes).chain(node_wide) {
        if !device_nodes.iter().any(|d| d.path == n.path) {
            device_nodes.push(n.clone());
        }
    }
    Spec {
        cdi_version: VERSION.into(),
        kind: KIND.into(),
        devices: vec![Device {
            name: device_name(reservation),
            container_edits: ContainerEdits {
                env: vec![
                    format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(",")),
                    format!("STRATA_RESERVATION={reservation}"),
                ],
                device_nodes,
            },
        }],
    }
}

/// Where the spec of `reservation` is, in `dir`.
pub fn spec_path(dir: &Path, reservation: &str) -> PathBuf {
    dir.join(format!("{FILE_PREFIX}{}.json", device_name(reservation)))
}

/// Checks a spec before it is written: the kind, and every device name.
fn check(spec: &Spec) -> std::io::Result<()> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    if spec.kind != KIND {
        return Err(bad(format!("CDI kind {:?} is not {KIND}", spec.kind)));
    }
    for d in &spec.devices {
        if !valid_device_name(&d.name) {
            return Err(bad(format!("{:?} is not a valid CDI device name", d.name)));
        }
        for n in &d.container_edits.device_nodes {
            if !n.path.starts_with('/') {
                return Err(bad(format!(
                    "device node {:?} is not an absolute path",
                    n.path
                )));
            }
        }
    }
    Ok(())
}

/// Writes the spec of `reservation` into `dir` whole or not at all (a
/// temporary file in the same folder, renamed over the spec; not flushed,
/// see the module's documentation); returns its path.
pub fn write(dir: &Path, reservation: &str, spec: &Spec) -> std::io::Result<PathBuf> {
    check(spec)?;
    std::fs::create_dir_all(dir)?;
    let path = spec_path(dir, reservation);
    let tmp = dir.join(format!(".{FILE_PREFIX}{}.tmp", device_name(reservation)));
    let body = serde_json::to_vec_pretty(spec).map_err(std::io::Error::other)?;
    crate::durable::replace(&path, &tmp, &body)?;
    Ok(path)
}

/// The spec of `reservation` in `dir`, if there is one that parses.
pub fn read(dir: &Path, reservation: &str) -> Option<Spec> {
    let text = std::fs::read(spec_path(dir, reservation)).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Removes the spec of `reservation`; whether there was one.
pub fn remove(dir: &Path, reservation: &str) -> std::io::Result<bool> {
    match std::fs::remove_file(spec_path(dir, reservation)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes from `dir` every binding spec (and half-written temporary
/// file) of a reservation not in `bound` (those bound on this node);
/// returns the device names of the specs removed. Files of other kinds are
/// left alone. (Which bindings lack a spec, or have a wrong one, the
/// bindings say: see `Bindings::reconcile`.)
pub fn reconcile(dir: &Path, bound: &BTreeSet<String>) -> std::io::Result<Vec<String>> {
    let mut removed = Vec::new();
    let names: BTreeSet<String> = bound.iter().map(|r| device_name(r)).collect();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let file = entry.file_name().to_string_lossy().into_owned();
        if file.starts_with(&format!(".{FILE_PREFIX}")) && file.ends_with(".tmp") {
            std::fs::remove_file(entry.path())?;
            continue;
        }
        let Some(name) = file
            .strip_prefix(FILE_PREFIX)
            .and_then(|f| f.strip_suffix(".json"))
        else {
            continue;
        };
        if !names.contains(name) {
            std::fs::remove_file(entry.path())?;
            removed.push(name.to_string());
        }
    }
    removed.sort();
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reservation_id_gets_a_valid_name_and_no_two_share_one() {
        let ids = [
            "train-7",
            "r~1",
            "r~12",
            "a_b",
            "a_5F",
            "Z__7E",
            "~",
            ".x",
            "x.",
            "-",
            "a:b",
            "a.b",
            "über",
            "0",
            "r-18c-00ab12",
            "x~",
            "_",
            "__",
            "Z_",
            "",
            "a b",
        ];
        let mut seen = std::collections::HashMap::new();
        for id in ids {
            let name = device_name(id);
            assert!(valid_device_name(&name), "{id:?} gave {name:?}");
            if let Some(other) = seen.insert(name.clone(), id) {
                panic!("{id:?} and {other:?} share {name:?}");
            }
        }
        assert_eq!(device_name("train-7"), "train-7");
        assert_eq!(device_name("r~1"), "r_7E1");
        assert_eq!(device_name("a_b"), "a_5Fb");
        assert_eq!(device_name("~"), "Z__7E");
        assert_eq!(qualified_name("train-7"), "strata.dev/reservation=train-7");
        for bad in ["", "-a", "a-", "a b", "a/b", "_a"] {
            assert!(!valid_device_name(bad), "{bad:?}");
        }
    }

    fn gpu(i: u32) -> BoundGpu {
        BoundGpu {
            uuid: format!("GPU-{i}"),
            nodes: vec![DeviceNode {
                path: format!("/dev/nvidia{i}"),
                host_path: None,
            }],
        }
    }

    #[test]
    fn a_spec_holds_the_gpus_nodes_the_node_wide_ones_and_the_environment() {
        let ctl = DeviceNode {
            path: "/dev/nvidiactl".into(),
            host_path: None,
        };
        let s = spec("r~1", &[gpu(0), gpu(3)], &[ctl]);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["cdiVersion"], VERSION);
        assert_eq!(v["kind"], KIND);
        assert_eq!(v["devices"][0]["name"], "r_7E1");
        let edits = &v["devices"][0]["containerEdits"];
        assert_eq!(
            edits["env"],
            serde_json::json!([
                "NVIDIA_VISIBLE_DEVICES=GPU-0,GPU-3",
                "STRATA_RESERVATION=r~1"
            ])
        );
        let paths: Vec<&str> = edits["deviceNodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["path"].as_str().unwrap())
            .collect();
        assert_eq!(paths, ["/dev/nvidia0", "/dev/nvidia3", "/dev/nvidiactl"]);
        assert!(edits["deviceNodes"][0].get("hostPath").is_none());
        let back: Spec = serde_json::from_value(v).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn specs_are_written_whole_removed_and_reconciled_with_the_bindings() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("cdi");
        let path = write(&d, "a", &spec("a", &[gpu(0)], &[])).unwrap();
        assert_eq!(path, d.join("strata-reservation-a.json"));
        let read: Spec = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(read.devices[0].name, "a");
        write(&d, "r~1", &spec("r~1", &[gpu(1)], &[])).unwrap();
        // A half-written file of a daemon that died mid-write, and another
        // vendor's spec, which is not Strata's to touch.
        std::fs::write(d.join(".strata-reservation-b.tmp"), b"{").unwrap();
        std::fs::write(d.join("nvidia.com-gpu.json"), b"{}").unwrap();
        let bound: BTreeSet<String> = ["r~1".to_string(), "c".to_string()].into();
        let removed = reconcile(&d, &bound).unwrap();
        assert_eq!(removed, vec!["a".to_string()]);
        let mut left: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            ["nvidia.com-gpu.json", "strata-reservation-r_7E1.json"]
        );
        assert!(remove(&d, "r~1").unwrap());
        assert!(!remove(&d, "r~1").unwrap());
        // A spec that breaks the format's rules never reaches the folder.
        let mut bad = spec("x", &[gpu(0)], &[]);
        bad.devices[0].name = "-x".into();
        assert!(write(&d, "x", &bad).is_err());
        assert!(!spec_path(&d, "x").exists());
        assert!(reconcile(&dir.path().join("none"), &bound)
            .unwrap()
            .is_empty());
    }
}
