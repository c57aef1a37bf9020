//! Running commands on the node, each id at most once.
//!
//! Every command id is written to `commands.log` under the data dir as
//! `started` before it runs and `done` (with its result) after. A command
//! seen again is not run again: its recorded result is reported, or, if it
//! was started and never finished (the daemon died while running it), it is
//! reported failed as interrupted. The log keeps the newest 10,000 ids.
//!
//! What each kind of command does is elsewhere: the bindings' kinds in
//! [`crate::allocation`], `gpu.mig` in [`crate::repartition`], `diag.nvml`
//! in the GPU backend.

use crate::allocation::Bindings;
use crate::gpu::GpuBackend;
pub use crate::outcome::Outcome;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};

const KEEP: usize = 10_000;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    outcome: Option<Outcome>,
}

/// Executed ids and their results, persisted.
pub struct Executor {
    path: PathBuf,
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

    /// Runs a command (blocking: NVML calls and file writes).
    pub fn run(
        bindings: &Bindings,
        backend: &dyn GpuBackend,
        kind: &str,
        args: &serde_json::Value,
    ) -> Outcome {
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
                Err(e) => Outcome::failed(e.to_string()),
            },
            "allocation.bind" => bindings.bind(backend, args),
            "allocation.release" => bindings.release(args),
            "allocation.preempting" => bindings.preempting(args),
            "gpu.mig" => crate::repartition::run(bindings, backend, args),
            other => Outcome::failed(format!("unknown command kind {other:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::FakeGpus;

    #[test]
    fn a_command_runs_at_most_once_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let gpus = FakeGpus::parse("8xH100-80GB", "n").unwrap();
        let bindings = Bindings::new(dir.path(), &dir.path().join("cdi"));
        let mut ex = Executor::open(dir.path()).unwrap();
        assert!(matches!(ex.begin("c1").unwrap(), Decision::Run));
        let args = serde_json::json!({"reservation": "r1", "devices": ["gpu0", "gpu1"]});
        let out = Executor::run(&bindings, &gpus, "allocation.bind", &args);
        assert!(out.ok, "{out:?}");
        ex.finish("c1", &out).unwrap();
        // Started but never finished before a "crash".
        assert!(matches!(ex.begin("c2").unwrap(), Decision::Run));
        drop(ex);
        let mut ex = Executor::open(dir.path()).unwrap();
        match ex.begin("c1").unwrap() {
            Decision::Known(o) => assert_eq!(o, out),
            Decision::Run => panic!("c1 ran twice"),
        }
        match ex.begin("c2").unwrap() {
            Decision::Known(o) => assert!(!o.ok && o.detail.contains("interrupted")),
            Decision::Run => panic!("c2 ran twice"),
        }
        assert!(Executor::run(&bindings, &gpus, "diag.nvml", &serde_json::Value::Null).ok);
        let unknown = Executor::run(&bindings, &gpus, "reboot", &serde_json::Value::Null);
        assert!(!unknown.ok && unknown.detail.contains("unknown command kind"));
    }
}
