//! The conditions in force on this node, as the daemon has reported them:
//! only changes are sent (a condition raised again is not re-raised, a clear
//! of nothing is not sent), a backend that cannot be read raises
//! `NVML-unavailable` once and clears it when it answers again, and the set
//! is kept in `health.json` under the data dir so a restarted daemon knows
//! what it reported before.

use crate::gpu::HealthChange;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The condition raised while the GPU backend cannot be read.
pub const UNAVAILABLE: &str = "NVML-unavailable";

/// (device, condition): the device is empty for the whole node.
type Key = (String, String);

/// Conditions in force, with their detail.
pub struct Conditions {
    path: PathBuf,
    in_force: BTreeMap<Key, String>,
}

impl Conditions {
    /// The record under `dir` (empty when there is none or it does not
    /// parse: conditions are then reported again as the backend sees them).
    pub fn open(dir: &Path) -> Conditions {
        let path = dir.join("health.json");
        let in_force = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Vec<(String, String, String)>>(&b).ok())
            .map(|v| {
                v.into_iter()
                    .map(|(d, c, detail)| ((d, c), detail))
                    .collect()
            })
            .unwrap_or_default();
        Conditions { path, in_force }
    }

    /// What to report after one poll of the backend (`Err` when it could not
    /// be read): only the changes.
    pub fn observe(&mut self, polled: Result<Vec<HealthChange>, String>) -> Vec<HealthChange> {
        let unavailable = (String::new(), UNAVAILABLE.to_string());
        let changes = match polled {
            Err(e) => vec![HealthChange {
                device: None,
                condition: UNAVAILABLE.into(),
                detail: e,
                cleared: false,
            }],
            Ok(mut changes) => {
                if self.in_force.contains_key(&unavailable) {
                    changes.insert(
                        0,
                        HealthChange {
                            device: None,
                            condition: UNAVAILABLE.into(),
                            detail: String::new(),
                            cleared: true,
                        },
                    );
                }
                changes
            }
        };
        let mut out = Vec::new();
        for c in changes {
            let key = (c.device.clone().unwrap_or_default(), c.condition.clone());
            let changed = if c.cleared {
                self.in_force.remove(&key).is_some()
            } else if let std::collections::btree_map::Entry::Vacant(e) = self.in_force.entry(key) {
                e.insert(c.detail.clone());
                true
            } else {
                false
            };
            if changed {
                out.push(c);
            }
        }
        if !out.is_empty() {
            self.save();
        }
        out
    }

    /// Every condition in force, as raises: sent at the start of a session,
    /// so one whose report was lost with the previous session reaches the
    /// region (raising again is harmless).
    pub fn in_force(&self) -> Vec<HealthChange> {
        self.in_force
            .iter()
            .map(|((device, condition), detail)| HealthChange {
                device: (!device.is_empty()).then(|| device.clone()),
                condition: condition.clone(),
                detail: detail.clone(),
                cleared: false,
            })
            .collect()
    }

    fn save(&self) {
        let rows: Vec<(&str, &str, &str)> = self
            .in_force
            .iter()
            .map(|((d, c), detail)| (d.as_str(), c.as_str(), detail.as_str()))
            .collect();
        let body = serde_json::to_vec(&rows).expect("conditions serialize");
        let tmp = self.path.with_extension("tmp");
        let written = std::fs::write(&tmp, body).and_then(|_| std::fs::rename(&tmp, &self.path));
        if let Err(e) = written {
            tracing::warn!(path = %self.path.display(), error = %e, "could not record the node's health conditions");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(device: Option<&str>, condition: &str, cleared: bool) -> HealthChange {
        HealthChange {
            device: device.map(str::to_string),
            condition: condition.into(),
            detail: String::new(),
            cleared,
        }
    }

    #[test]
    fn only_changes_are_reported_and_a_backend_that_answers_again_clears_its_condition() {
        let dir = std::env::temp_dir().join(format!("strata-health-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Conditions::open(&dir);
        // The backend fails on every poll: raised once.
        assert_eq!(c.observe(Err("driver gone".into())).len(), 1);
        assert!(c.observe(Err("driver gone".into())).is_empty());
        assert!(c.observe(Err("driver gone".into())).is_empty());
        // It answers again: cleared, once.
        let out = c.observe(Ok(vec![]));
        assert_eq!(out.len(), 1);
        assert!(out[0].cleared && out[0].condition == UNAVAILABLE);
        assert!(c.observe(Ok(vec![])).is_empty());
        // An XID raised twice is reported once; a clear of nothing is not sent.
        let xid = change(Some("GPU-1"), "XID-79", false);
        assert_eq!(c.observe(Ok(vec![xid.clone(), xid.clone()])).len(), 1);
        assert!(c
            .observe(Ok(vec![change(Some("GPU-2"), "XID-79", true)]))
            .is_empty());
        // A restarted daemon remembers what is in force.
        drop(c);
        let mut c = Conditions::open(&dir);
        assert_eq!(c.in_force().len(), 1);
        assert!(c.observe(Ok(vec![xid])).is_empty());
        assert_eq!(
            c.observe(Ok(vec![change(Some("GPU-1"), "XID-79", true)]))
                .len(),
            1
        );
        assert!(c.in_force().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
