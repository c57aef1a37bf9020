//! The node's acceptance check: before its GPUs take work (when the daemon
//! starts, which is after every reboot, and at every new session), and
//! again on an operator's schedule. Every GPU must answer, with no
//! uncorrected ECC error and no page pending retirement (the backend's
//! diagnostic), and, where DCGM is installed, `dcgmi diag -r <level>` must
//! pass. The result travels with the `gpus` inventory section (its result is
//! part of the section's hash), so the gateway writes it in the same
//! transaction as the node's devices: a node whose check failed never takes
//! a placement, not even for a moment.

use crate::gpu::GpuBackend;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The result of one check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub passed: bool,
    /// Why it failed (empty when it passed).
    pub reason: String,
    /// The GPUs that failed; empty with `passed` false: the whole node.
    pub failed_devices: Vec<String>,
    /// The checks' own reports.
    pub report: serde_json::Value,
}

impl Report {
    /// What the section's hash covers: the outcome, not the report's
    /// figures (temperatures change; a result that did not is not sent
    /// again).
    pub fn summary(&self) -> String {
        format!(
            "{}|{}|{}",
            self.passed,
            self.reason,
            self.failed_devices.join(",")
        )
    }
}

impl Report {
    /// Why a new bind of `devices` is refused while this is the node's
    /// last check: the whole node failed it, or one of the devices did
    /// (see `Bindings::guarded_by`). The node's own guard; the index keeps
    /// placements off such a node once the report reaches the log.
    pub fn refuses(&self, devices: &[&str]) -> Option<String> {
        if !self.passed && self.failed_devices.is_empty() {
            return Some(format!(
                "the node failed its acceptance check ({}); nothing is bound until one passes",
                self.reason
            ));
        }
        devices
            .iter()
            .find(|d| self.failed_devices.iter().any(|f| f == *d))
            .map(|d| format!("device {d} failed the node's acceptance check; nothing bound"))
    }
}

/// How long `dcgmi diag` may run.
const DCGM_DEADLINE: Duration = Duration::from_secs(900);

/// Runs `dcgmi diag -r <level> -j` where DCGM is installed: `None` where it
/// is not (or `level` is 0), else whether it passed and its output.
fn dcgm(level: u32) -> Option<(bool, serde_json::Value)> {
    if level == 0 {
        return None;
    }
    let mut child = std::process::Command::new("dcgmi")
        .args(["diag", "-r", &level.to_string(), "-j"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    let started = std::time::Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if started.elapsed() < DCGM_DEADLINE => {
                std::thread::sleep(Duration::from_millis(200))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let out = child
        .wait_with_output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
        })
        .unwrap_or_default();
    let report =
        serde_json::from_str(&out).unwrap_or_else(|_| serde_json::json!({ "output": out }));
    Some((status.is_some_and(|s| s.success()), report))
}

/// Runs the check on `backend`, with `dcgmi diag -r dcgm_level` where DCGM
/// is installed (0: not).
pub fn check(backend: &dyn GpuBackend, dcgm_level: u32) -> Report {
    let diag = match backend.acceptance() {
        Ok(d) => d,
        Err(e) => {
            return Report {
                passed: false,
                reason: format!("the GPUs cannot be read: {e}"),
                failed_devices: Vec::new(),
                report: serde_json::Value::Null,
            }
        }
    };
    let mut failed = Vec::new();
    let mut why = Vec::new();
    for g in diag["gpus"].as_array().into_iter().flatten() {
        if g["ok"] != true {
            let id = g["id"].as_str().unwrap_or_default().to_string();
            why.push(format!(
                "{id}: {}",
                g["reason"].as_str().unwrap_or("failed its check")
            ));
            failed.push(id);
        }
    }
    let mut report = serde_json::json!({ "nvml": diag });
    let mut node_failed = None;
    if dcgm_level > 0 {
        report["dcgm_level"] = dcgm_level.into();
    }
    match dcgm(dcgm_level) {
        Some((passed, out)) => {
            report["dcgm"] = out;
            if !passed {
                node_failed = Some(format!("dcgmi diag -r {dcgm_level} failed"));
            }
        }
        None if dcgm_level > 0 => report["dcgm"] = "dcgmi is not installed".into(),
        None => {}
    }
    match node_failed {
        Some(reason) => Report {
            passed: false,
            reason,
            failed_devices: Vec::new(),
            report,
        },
        None => Report {
            passed: failed.is_empty(),
            reason: why.join("; "),
            failed_devices: failed,
            report,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::FakeGpus;

    #[test]
    fn a_failed_check_refuses_new_binds_of_what_failed() {
        let mut r = Report {
            passed: true,
            reason: String::new(),
            failed_devices: Vec::new(),
            report: serde_json::Value::Null,
        };
        assert_eq!(r.refuses(&["GPU-1"]), None);
        r.passed = false;
        r.failed_devices = vec!["GPU-2".into()];
        assert_eq!(r.refuses(&["GPU-1"]), None);
        assert!(r.refuses(&["GPU-1", "GPU-2"]).unwrap().contains("GPU-2"));
        r.failed_devices.clear();
        r.reason = "dcgmi diag -r 3 failed".into();
        assert!(r
            .refuses(&["GPU-1"])
            .unwrap()
            .contains("dcgmi diag -r 3 failed"));
    }

    #[test]
    fn failing_gpus_are_named_and_a_passing_check_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let gpus = FakeGpus::parse("4xH100-80GB", "n")
            .unwrap()
            .with_data_dir(dir.path());
        let ok = check(&gpus, 0);
        assert!(ok.passed && ok.failed_devices.is_empty(), "{ok:?}");
        crate::faults::inject(
            dir.path(),
            &crate::faults::Fault {
                gpu: Some("2".into()),
                what: crate::faults::What::DiagnosticFails {
                    reason: "memory test".into(),
                },
            },
        )
        .unwrap();
        let bad = check(&gpus, 0);
        assert!(!bad.passed);
        assert_eq!(bad.failed_devices, ["GPU-fake-n-2"]);
        assert_eq!(bad.reason, "GPU-fake-n-2: memory test");
        assert_ne!(ok.summary(), bad.summary());
    }
}
