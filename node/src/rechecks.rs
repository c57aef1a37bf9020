//! When a session runs the node's acceptance check again, off its loop (a
//! DCGM diagnostic takes minutes): on the operator's schedule
//! (`--recheck-every`), whose result is sent when it changed; and when a
//! GPU's condition clears (after a reset), whose result is sent even when
//! unchanged, because it is the diagnostic a GPU quarantined for a reset
//! waits for. One check runs at a time; a condition that clears while one
//! runs asks for one more after it.

use crate::acceptance::{self, Report};
use crate::config::DaemonConfig;
use tokio::sync::mpsc;

pub(crate) struct Rechecks {
    done_tx: mpsc::Sender<(Report, bool)>,
    done: mpsc::Receiver<(Report, bool)>,
    schedule: Option<tokio::time::Interval>,
    running: bool,
    again: bool,
}

impl Rechecks {
    pub(crate) fn new(config: &DaemonConfig) -> Rechecks {
        let (done_tx, done) = mpsc::channel(1);
        let schedule = (!config.recheck.is_zero()).then(|| {
            tokio::time::interval_at(tokio::time::Instant::now() + config.recheck, config.recheck)
        });
        Rechecks {
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
            config.dcgm_level,
            self.done_tx.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let _ = done.blocking_send((acceptance::check(backend.as_ref(), level), forced));
        });
    }

    /// A GPU's condition cleared: a check now, or after the one running.
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
