//! Running commands on the node, each id at most once.
//!
//! Every command id is written to `commands.log` under the data dir as
//! `started` before it runs and `done` (with its result) after. A command
//! seen again is not run again: its recorded result is reported, or, if it
//! was started and never finished (the daemon died while running it), it is
//! reported failed as interrupted. The log keeps the newest 10,000 ids.
//!
//! Bindings: `allocation.bind` writes `allocations/<reservation>.json`,
//! `allocation.release` removes it and leaves `<reservation>.released`, so a
//! bind that arrives after its reservation's release (the daemon runs each
//! command in its own task, and the two can cross) is refused instead of
//! binding devices the log has freed. Both hold one lock while they touch
//! the folder. Tombstones older than two days are pruned: by then the bind
//! has long expired.
//!
//! Preemption: `allocation.preempting` writes `<reservation>.preempting`
//! (who preempts it, and when its grace period ends) beside the binding,
//! for the workload's runtime to see and checkpoint before the release
//! comes; the release removes it.

use crate::gpu::GpuBackend;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};

const KEEP: usize = 10_000;

/// Bind and release of the same reservation never interleave.
static BINDINGS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// How long a release's tombstone is kept.
const TOMBSTONE_AGE: std::time::Duration = std::time::Duration::from_secs(2 * 24 * 3600);

fn tombstone(allocations: &Path, reservation: &str) -> PathBuf {
    allocations.join(format!("{reservation}.released"))
}

/// Removes tombstones older than [`TOMBSTONE_AGE`].
fn prune_tombstones(allocations: &Path) {
    let Ok(entries) = std::fs::read_dir(allocations) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > TOMBSTONE_AGE);
        if old && path.extension().is_some_and(|x| x == "released") {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A command's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    pub ok: bool,
    pub detail: String,
    pub output: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    outcome: Option<Outcome>,
}

/// Executed ids and their results, persisted.
pub struct Executor {
    path: PathBuf,
    dir: PathBuf,
    seen: HashMap<String, Option<Outcome>>,
    order: VecDeque<String>,
    lines: usize,
}

/// What to do with a command.
pub enum Decision {
    /// Not seen before: run it (it is now recorded as started).
    Run,
    /// Seen: report this again, do not run.
    Known(Outcome),
}

impl Executor {
    pub fn open(dir: &Path) -> std::io::Result<Executor> {
        let path = dir.join("commands.log");
        let mut ex = Executor {
            path: path.clone(),
            dir: dir.to_path_buf(),
            seen: HashMap::new(),
            order: VecDeque::new(),
            lines: 0,
        };
        if let Ok(text) = std::fs::read_to_string(&path) {
            for line in text.lines() {
                // A torn last line (a crash mid-write) is skipped.
                if let Ok(r) = serde_json::from_str::<Record>(line) {
                    ex.remember(r.id, r.outcome);
                    ex.lines += 1;
                }
            }
        }
        Ok(ex)
    }

    fn remember(&mut self, id: String, outcome: Option<Outcome>) {
        if !self.seen.contains_key(&id) {
            self.order.push_back(id.clone());
        }
        self.seen.insert(id, outcome);
        while self.order.len() > KEEP {
            if let Some(old) = self.order.pop_front() {
                self.seen.remove(&old);
            }
        }
    }

    fn append(&mut self, r: &Record) -> std::io::Result<()> {
        if self.lines > 2 * KEEP {
            self.compact()?;
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        writeln!(
            f,
            "{}",
            serde_json::to_string(r).expect("records serialize")
        )?;
        f.sync_data()?;
        self.lines += 1;
        Ok(())
    }

    fn compact(&mut self) -> std::io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        for id in &self.order {
            let r = Record {
                id: id.clone(),
                outcome: self.seen.get(id).cloned().flatten(),
            };
            writeln!(
                f,
                "{}",
                serde_json::to_string(&r).expect("records serialize")
            )?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        self.lines = self.order.len();
        Ok(())
    }

    /// Decides about a command and, if it is to run, records it as started
    /// (durably) first.
    pub fn begin(&mut self, id: &str) -> std::io::Result<Decision> {
        match self.seen.get(id) {
            Some(Some(outcome)) => return Ok(Decision::Known(outcome.clone())),
            Some(None) => {
                return Ok(Decision::Known(Outcome {
                    ok: false,
                    detail: "interrupted: the daemon stopped while running it; not run again"
                        .into(),
                    output: serde_json::Value::Null,
                }))
            }
            None => {}
        }
        self.append(&Record {
            id: id.to_string(),
            outcome: None,
        })?;
        self.remember(id.to_string(), None);
        Ok(Decision::Run)
    }

    /// Records a command's result (durably).
    pub fn finish(&mut self, id: &str, outcome: &Outcome) -> std::io::Result<()> {
        self.append(&Record {
            id: id.to_string(),
            outcome: Some(outcome.clone()),
        })?;
        self.remember(id.to_string(), Some(outcome.clone()));
        Ok(())
    }

    /// Where `allocation.bind` writes bound devices.
    pub fn allocations_dir(&self) -> PathBuf {
        self.dir.join("allocations")
    }

    /// Runs a command (blocking: NVML calls and file writes).
    pub fn run(
        allocations: &Path,
        backend: &dyn GpuBackend,
        kind: &str,
        args: &serde_json::Value,
    ) -> Outcome {
        let fail = |detail: String| Outcome {
            ok: false,
            detail,
            output: serde_json::Value::Null,
        };
        match kind {
            "diag.nvml" => match backend.diagnose() {
                Ok(report) => {
                    let all_ok = report["gpus"]
                        .as_array()
                        .is_some_and(|g| g.iter().all(|g| g["ok"] == true));
                    Outcome {
                        ok: all_ok,
                        detail: if all_ok {
                            "all GPUs pass".into()
                        } else {
                            "a GPU failed its check".into()
                        },
                        output: report,
                    }
                }
                Err(e) => fail(e.to_string()),
            },
            "allocation.bind" => {
                let Some(reservation) = args["reservation"].as_str().filter(|r| valid_file_name(r))
                else {
                    return fail("allocation.bind needs a reservation".into());
                };
                let Some(devices) = args["devices"].as_array() else {
                    return fail("allocation.bind needs devices".into());
                };
                let inventory = match backend.inventory() {
                    Ok(i) => i,
                    Err(e) => return fail(e.to_string()),
                };
                let mut bound = Vec::new();
                for d in devices {
                    let Some(id) = d.as_str() else {
                        return fail("device ids are strings".into());
                    };
                    // Ids from the log are the inventory's ids; indexes work too.
                    let found = inventory
                        .iter()
                        .enumerate()
                        .find(|(i, g)| g.id == id || format!("gpu{i}") == id);
                    match found {
                        Some((_, g)) => {
                            bound.push(serde_json::json!({"id": id, "uuid": g.id, "pci": g.pci}))
                        }
                        None => return fail(format!("device {id} is not on this node")),
                    }
                }
                let dir = allocations;
                let _held = BINDINGS.lock().unwrap_or_else(|e| e.into_inner());
                if tombstone(dir, reservation).exists() {
                    return fail(format!(
                        "reservation {reservation} was released before its bind arrived; nothing bound"
                    ));
                }
                let body = serde_json::json!({"reservation": reservation, "devices": bound});
                let written = std::fs::create_dir_all(dir).and_then(|_| {
                    std::fs::write(dir.join(format!("{reservation}.json")), body.to_string())
                });
                match written {
                    Ok(()) => Outcome {
                        ok: true,
                        detail: format!("bound {} devices", bound.len()),
                        output: body,
                    },
                    Err(e) => fail(format!("write the allocation: {e}")),
                }
            }
            "allocation.release" => {
                let Some(reservation) = args["reservation"].as_str().filter(|r| valid_file_name(r))
                else {
                    return fail("allocation.release needs a reservation".into());
                };
                let _held = BINDINGS.lock().unwrap_or_else(|e| e.into_inner());
                // The tombstone first: from now on no bind of it lands.
                let marked = std::fs::create_dir_all(allocations)
                    .and_then(|_| std::fs::write(tombstone(allocations, reservation), b""));
                if let Err(e) = marked {
                    return fail(format!("record the release: {e}"));
                }
                prune_tombstones(allocations);
                let _ = std::fs::remove_file(allocations.join(format!("{reservation}.preempting")));
                let path = allocations.join(format!("{reservation}.json"));
                match std::fs::remove_file(&path) {
                    Ok(()) => Outcome {
                        ok: true,
                        detail: "released".into(),
                        output: serde_json::Value::Null,
                    },
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Outcome {
                        ok: true,
                        detail: "nothing was bound".into(),
                        output: serde_json::Value::Null,
                    },
                    Err(e) => fail(format!("remove the allocation: {e}")),
                }
            }
            "allocation.preempting" => {
                let Some(reservation) = args["reservation"].as_str().filter(|r| valid_file_name(r))
                else {
                    return fail("allocation.preempting needs a reservation".into());
                };
                let _held = BINDINGS.lock().unwrap_or_else(|e| e.into_inner());
                if !allocations.join(format!("{reservation}.json")).exists() {
                    return Outcome {
                        ok: true,
                        detail: format!("reservation {reservation} is not bound here"),
                        output: serde_json::Value::Null,
                    };
                }
                let written = std::fs::write(
                    allocations.join(format!("{reservation}.preempting")),
                    args.to_string(),
                );
                match written {
                    Ok(()) => Outcome {
                        ok: true,
                        detail: format!(
                            "reservation {reservation} is preempted by {}; it keeps its devices until {}",
                            args["by"].as_str().unwrap_or("another request"),
                            args["deadline_ms"]
                        ),
                        output: args.clone(),
                    },
                    Err(e) => fail(format!("record the preemption: {e}")),
                }
            }
            other => fail(format!("unknown command kind {other:?}")),
        }
    }
}

/// The reservations bound on the node whose data dir is `data_dir`, as
/// `allocation.bind` left them on its disk.
pub fn bound_reservations(data_dir: &Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(data_dir.join("allocations"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_suffix(".json")
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn valid_file_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 200 && !s.contains(['/', '\0']) && s != "." && s != ".."
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::FakeGpus;

    #[test]
    fn a_command_runs_at_most_once_across_restarts() {
        let dir = std::env::temp_dir().join(format!("strata-exec-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let gpus = FakeGpus::parse("8xH100-80GB", "n").unwrap();
        let mut ex = Executor::open(&dir).unwrap();
        assert!(matches!(ex.begin("c1").unwrap(), Decision::Run));
        let args = serde_json::json!({"reservation": "r1", "devices": ["gpu0", "gpu1"]});
        let out = Executor::run(&ex.allocations_dir(), &gpus, "allocation.bind", &args);
        assert!(out.ok, "{out:?}");
        assert!(dir.join("allocations/r1.json").exists());
        ex.finish("c1", &out).unwrap();
        // Started but never finished before a "crash".
        assert!(matches!(ex.begin("c2").unwrap(), Decision::Run));
        drop(ex);
        let mut ex = Executor::open(&dir).unwrap();
        match ex.begin("c1").unwrap() {
            Decision::Known(o) => assert_eq!(o, out),
            Decision::Run => panic!("c1 ran twice"),
        }
        match ex.begin("c2").unwrap() {
            Decision::Known(o) => assert!(!o.ok && o.detail.contains("interrupted")),
            Decision::Run => panic!("c2 ran twice"),
        }
        let bad = Executor::run(
            &ex.allocations_dir(),
            &gpus,
            "allocation.bind",
            &serde_json::json!({"reservation": "../x", "devices": []}),
        );
        assert!(!bad.ok);
        let missing = Executor::run(
            &ex.allocations_dir(),
            &gpus,
            "allocation.bind",
            &serde_json::json!({"reservation": "r2", "devices": ["gpu9"]}),
        );
        assert!(!missing.ok && missing.detail.contains("not on this node"));
        assert!(
            Executor::run(
                &ex.allocations_dir(),
                &gpus,
                "allocation.release",
                &serde_json::json!({"reservation": "r1"})
            )
            .ok
        );
        assert!(!dir.join("allocations/r1.json").exists());
        assert!(
            Executor::run(
                &ex.allocations_dir(),
                &gpus,
                "diag.nvml",
                &serde_json::Value::Null
            )
            .ok
        );
        assert!(
            !Executor::run(
                &ex.allocations_dir(),
                &gpus,
                "reboot",
                &serde_json::Value::Null
            )
            .ok
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bind_that_arrives_after_its_release_is_refused() {
        // The daemon runs each command in its own task, so a reservation's
        // release can run before its bind: the bind must not leave a
        // binding behind.
        let dir = std::env::temp_dir().join(format!("strata-exec-order-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let gpus = FakeGpus::parse("8xH100-80GB", "n").unwrap();
        let allocations = dir.join("allocations");
        let release = Executor::run(
            &allocations,
            &gpus,
            "allocation.release",
            &serde_json::json!({"reservation": "r9"}),
        );
        assert!(release.ok, "{release:?}");
        let bind = Executor::run(
            &allocations,
            &gpus,
            "allocation.bind",
            &serde_json::json!({"reservation": "r9", "devices": ["gpu0"]}),
        );
        assert!(!bind.ok && bind.detail.contains("released"), "{bind:?}");
        assert!(!allocations.join("r9.json").exists());
        // Another reservation binds as usual.
        let other = Executor::run(
            &allocations,
            &gpus,
            "allocation.bind",
            &serde_json::json!({"reservation": "r10", "devices": ["gpu0"]}),
        );
        assert!(other.ok, "{other:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
