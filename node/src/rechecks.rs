//! When a session runs the node's acceptance check again, off its loop (a
//! DCGM diagnostic takes minutes): on the operator's schedule
//! (`--recheck-every`), whose result is sent when it changed; and when a
//! GPU's condition clears (after a reset), whose result is sent even when
//! unchanged, because it is the diagnostic a GPU quarantined for a reset
//! waits for. One check runs at a time; a condition that clears while one
//! runs asks for one more after it.
//!
//! [`DcgmLevel`] is the `dcgmi diag` level the checks run at: the pool's
//! (told in each session's Welcome, kept in the data dir so the check at
//! the next start runs at it too) where the node runs DCGM at all (its own
//! `--dcgm-level` above 0), else none.

use crate::acceptance::{self, Report};
use crate::config::DaemonConfig;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

/// The level of `dcgmi diag` in the node's checks.
pub(crate) struct DcgmLevel {
    level: AtomicU32,
    /// 0: the node never runs DCGM, whatever its pool says.
    own: u32,
    file: PathBuf,
}

impl DcgmLevel {
    /// The node's level: the pool's last told, kept in the data dir, or
    /// its own.
    pub(crate) fn load(config: &DaemonConfig) -> Arc<DcgmLevel> {
        let file = config.data_dir.join("dcgm-level");
        let kept = std::fs::read_to_string(&file)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .filter(|l| *l <= 4);
        let own = config.dcgm_level;
        Arc::new(DcgmLevel {
            level: AtomicU32::new(if own == 0 { 0 } else { kept.unwrap_or(own) }),
            own,
            file,
        })
    }

    pub(crate) fn get(&self) -> u32 {
        self.level.load(Ordering::Relaxed)
    }

    /// The pool's level, as a Welcome says it (`None`: the pool sets none,
    /// the node's own). Whether the level changed (a check at the new level
    /// is due).
    pub(crate) fn told(&self, pool: Option<u32>) -> bool {
        if self.own == 0 {
            return false;
        }
        let level = pool.filter(|l| *l <= 4).unwrap_or(self.own);
        let before = self.level.swap(level, Ordering::Relaxed);
        let kept = match pool {
            Some(_) => std::fs::write(&self.file, level.to_string()),
            None => std::fs::remove_file(&self.file).or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            }),
        };
        if let Err(e) = kept {
            tracing::warn!(error = %e, file = %self.file.display(), "cannot keep the pool's DCGM level; the next start checks at the node's own");
        }
        before != level
    }
}

pub(crate) struct Rechecks {
    level: Arc<DcgmLevel>,
    done_tx: mpsc::Sender<(Report, bool)>,
    done: mpsc::Receiver<(Report, bool)>,
    schedule: Option<tokio::time::Interval>,
    running: bool,
    again: bool,
}

impl Rechecks {
    pub(crate) fn new(config: &DaemonConfig, level: Arc<DcgmLevel>) -> Rechecks {
        let (done_tx, done) = mpsc::channel(1);
        let schedule = (!config.recheck.is_zero()).then(|| {
            tokio::time::interval_at(tokio::time::Instant::now() + config.recheck, config.recheck)
        });
        Rechecks {
            level,
            done_tx,
            done,
            schedule,
            running: false,
            again: false,
        }
    }

    fn start(&mut self, config: &DaemonConfig, forced: bool) {
        self.running = true;
        let (backend, level, done) = (
            config.backend.clone(),
            self.level.get(),
            self.done_tx.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let _ = done.blocking_send((acceptance::check(backend.as_ref(), level), forced));
        });
    }

    /// A GPU's condition cleared, or the pool's DCGM level changed: a
    /// check now, or after the one running; its result is sent.
    pub(crate) fn cleared(&mut self, config: &DaemonConfig) {
        if self.running {
            self.again = true;
        } else {
            self.start(config, true);
        }
    }

    /// Waits for the next thing to do: starts a scheduled check when one
    /// is due (`None`), or answers a finished check's result and whether
    /// it must be sent even when unchanged (starting the check a clear
    /// asked for meanwhile).
    pub(crate) async fn next(&mut self, config: &DaemonConfig) -> Option<(Report, bool)> {
        let due = async {
            match (&mut self.schedule, self.running) {
                (Some(i), false) => {
                    i.tick().await;
                }
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = due => {
                self.start(config, false);
                None
            }
            done = self.done.recv() => {
                self.running = false;
                if std::mem::take(&mut self.again) {
                    self.start(config, true);
                }
                // This struct holds a sender: the channel never closes.
                done
            }
        }
    }
}
