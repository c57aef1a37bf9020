//! Faults injected into a running daemon's fake device set from outside
//! it, for drills, tests and `strata dev`: `strata fault` writes one file
//! per fault into the `faults/` folder of the daemon's data dir (whole or
//! not at all), and the fake backend takes each file (reads it, then
//! removes it) at its next look, within a fraction of a second.
//!
//! A fault raises or clears a health condition on a GPU (by index or id)
//! or on the whole node, or makes the GPU's diagnostic fail or pass.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The folder under a daemon's data dir that faults are written into.
pub const DIR: &str = "faults";

/// One injected fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    /// The GPU: its index (`3`) or id; absent: the whole node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    #[serde(flatten)]
    pub what: What,
}

/// What an injected fault does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum What {
    /// A condition appears, e.g. `XID-48`, `ECC-uncorrected`.
    Raise {
        condition: String,
        #[serde(default)]
        detail: String,
    },
    /// A condition is over.
    Clear {
        condition: String,
    },
    /// The GPU's diagnostic fails (with why) until told to pass.
    DiagnosticFails {
        reason: String,
    },
    DiagnosticPasses,
}

/// Writes `fault` for the daemon whose data dir is `data_dir`; returns
/// the file. The daemon takes it at its next look.
pub fn inject(data_dir: &Path, fault: &Fault) -> std::io::Result<PathBuf> {
    let dir = data_dir.join(DIR);
    std::fs::create_dir_all(&dir)?;
    // Named by time, so the daemon takes faults in the order written.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let name = format!("{now:024}-{:08x}", fastrand::u32(..));
    let path = dir.join(format!("{name}.json"));
    let body = serde_json::to_vec(fault).map_err(std::io::Error::other)?;
    crate::durable::write(&path, &dir.join(format!(".{name}.tmp")), &body)?;
    Ok(path)
}

/// Whether faults wait in `dir`.
pub(crate) fn waiting(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| {
        d.any(|e| {
            e.is_ok_and(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.ends_with(".json") && !n.starts_with('.'))
            })
        })
    })
}

/// Takes the faults waiting in `dir`, oldest first: each file is read and
/// removed. A file that does not parse is removed with a warning.
pub(crate) fn take(dir: &Path) -> Vec<Fault> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with('.'))
        })
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let parsed = std::fs::read(&f)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<Fault>(&b).map_err(|e| e.to_string()));
        let _ = std::fs::remove_file(&f);
        match parsed {
            Ok(fault) => out.push(fault),
            Err(e) => {
                tracing::warn!(file = %f.display(), error = %e, "an injected fault that does not parse; dropped")
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_taken_once_in_the_order_written() {
        let dir = tempfile::tempdir().unwrap();
        let a = Fault {
            gpu: Some("3".into()),
            what: What::Raise {
                condition: "XID-48".into(),
                detail: "drill".into(),
            },
        };
        let b = Fault {
            gpu: None,
            what: What::DiagnosticPasses,
        };
        inject(dir.path(), &a).unwrap();
        inject(dir.path(), &b).unwrap();
        let folder = dir.path().join(DIR);
        std::fs::write(folder.join("zz-bad.json"), b"{").unwrap();
        assert!(waiting(&folder));
        assert_eq!(take(&folder), vec![a, b]);
        assert!(!waiting(&folder));
        assert!(take(&folder).is_empty());
    }
}
