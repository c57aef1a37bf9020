//! The steady load the reference sizes for a region: reservations at a
//! rate (some with a TTL, the rest released after a while), commands to
//! random nodes, and status drift (a GPU condition raised or cleared on a
//! random node). Open loop: each item is its own task, so a slow append
//! does not slow the offer; in flight is bounded, and what could not be
//! offered is counted, not hidden.
//!
//! Every reservation whose request the log acknowledged is kept, for the
//! checker: it must be in the table.

use super::fleet::{Fleet, CLASS};
use domain::commands::{self, Command};
use domain::{Fact, Request, Shape};
use events::{AppendError, Appender, ExpectedVersion};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Offered rates, per second.
#[derive(Debug, Clone, Copy)]
pub struct Rates {
    pub placements: f64,
    pub commands: f64,
    pub drift: f64,
}

/// What the load generator did and saw.
#[derive(Default)]
pub struct LoadStats {
    pub requested: AtomicU64,
    pub releases: AtomicU64,
    pub commands: AtomicU64,
    pub drift: AtomicU64,
    /// Appends that failed and were retried (a database restarting, say).
    pub retries: AtomicU64,
    /// Items not offered because too many were in flight.
    pub not_offered: AtomicU64,
    /// Appends given up after two minutes of failures.
    pub gave_up: AtomicU64,
    /// Request acknowledgement latencies, while `measuring`.
    pub ack: Mutex<Vec<Duration>>,
    pub measuring: AtomicBool,
    /// Reservation ids the log acknowledged.
    pub acked: Mutex<Vec<String>>,
}

/// The running load.
pub struct Load {
    pub stats: Arc<LoadStats>,
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Appends until the log says yes, retrying what may be transient (a
/// restarting database) for up to two minutes. A conflict on a retry means
/// an earlier try was committed.
async fn surely<F, Fut>(stats: &LoadStats, mut f: F) -> bool
where
    F: FnMut(bool) -> Fut,
    Fut: std::future::Future<Output = Result<(), AppendError>>,
{
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut retried = false;
    loop {
        match f(retried).await {
            Ok(()) => return true,
            Err(AppendError::VersionConflict { .. }) if retried => return true,
            Err(AppendError::VersionConflict { .. }) | Err(AppendError::Invalid(_)) => {
                return false
            }
            Err(e) => {
                if Instant::now() > deadline {
                    stats.gave_up.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "an append kept failing for two minutes");
                    return false;
                }
                stats.retries.fetch_add(1, Ordering::Relaxed);
                retried = true;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

impl Load {
    pub fn start(appender: Appender, fleet: &Fleet, pools: Vec<String>, rates: Rates) -> Load {
        let stats = Arc::new(LoadStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let nodes = fleet.nodes.clone();
        let drifting: Arc<Mutex<std::collections::HashSet<usize>>> = Arc::default();
        let fleet_drift = {
            let nodes = nodes.clone();
            move |i: usize, raise: bool| {
                let n = &nodes[i];
                n.gpus.inject(node::gpu::HealthChange {
                    device: Some(format!("GPU-fake-{}-0", n.id)),
                    condition: "clocks-throttled".into(),
                    detail: "thermal slowdown".into(),
                    cleared: !raise,
                });
            }
        };
        let (s, st, pa) = (stats.clone(), stop.clone(), paused.clone());
        let task = tokio::spawn(async move {
            let in_flight = Arc::new(Semaphore::new(4096));
            let tick = Duration::from_millis(5);
            let mut interval = tokio::time::interval(tick);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Offered time: it does not advance while paused, so a pause
            // is not made up for with a burst afterwards.
            let mut offered = Duration::ZERO;
            let mut last = Instant::now();
            let (mut placed, mut cmds, mut drifted) = (0u64, 0u64, 0u64);
            let run = fastrand::u32(..);
            while !st.load(Ordering::Relaxed) {
                interval.tick().await;
                let now = Instant::now();
                if !pa.load(Ordering::Relaxed) {
                    offered += now - last;
                }
                last = now;
                let secs = offered.as_secs_f64();
                while (placed as f64) < secs * rates.placements {
                    placed += 1;
                    let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                        s.not_offered.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let id = format!("rr{run:08x}-{placed}");
                    let pool = pools[fastrand::usize(..pools.len())].clone();
                    let (a, s, st) = (appender.clone(), s.clone(), st.clone());
                    tokio::spawn(async move {
                        reservation(&a, &s, &st, id, pool).await;
                        drop(permit);
                    });
                }
                while (cmds as f64) < secs * rates.commands {
                    cmds += 1;
                    let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                        s.not_offered.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let node = nodes[fastrand::usize(..nodes.len())].id.clone();
                    let (a, s) = (appender.clone(), s.clone());
                    let id = format!("rc{run:08x}-{cmds}");
                    tokio::spawn(async move {
                        let c = Command {
                            id,
                            node,
                            kind: "diag.nvml".into(),
                            args: serde_json::json!({}),
                            deadline_ms: crate::gateway::now_ms() + 120_000,
                            issued_by: "cli:region-drill".into(),
                        };
                        if surely(&s, |_| commands::issue(&a, &c)).await {
                            s.commands.fetch_add(1, Ordering::Relaxed);
                        }
                        drop(permit);
                    });
                }
                while (drifted as f64) < secs * rates.drift {
                    drifted += 1;
                    let i = fastrand::usize(..nodes.len());
                    let raise = drifting.lock().expect("drift lock").insert(i);
                    if !raise {
                        drifting.lock().expect("drift lock").remove(&i);
                    }
                    fleet_drift(i, raise);
                    s.drift.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Load {
            stats,
            stop,
            paused,
            task: Some(task),
        }
    }

    /// Stops offering for a while (`true`) or goes on (`false`).
    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
    }

    /// Stops offering (what is in flight finishes on its own).
    pub async fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

/// One reservation: requested; released after 2 to 10 s unless it has a TTL
/// (one in three, 3 to 8 s) or the load stops first.
async fn reservation(a: &Appender, s: &LoadStats, stop: &AtomicBool, id: String, pool: String) {
    let gpus = [1u32, 1, 1, 2, 2, 4, 8][fastrand::usize(..7)];
    let ttl = fastrand::u32(..3) == 0;
    let request = Request {
        reservation: id.clone(),
        pool,
        class: CLASS.into(),
        gpus,
        shape: if gpus == 8 { Shape::Node } else { Shape::Any },
        priority: 0,
        ttl_ms: ttl.then(|| fastrand::u64(3_000..8_000)),
        replace_on_failure: false,
        replaces: None,
        topology: None,
        requeue_on_preemption: false,
        start_ms: None,
        queue: None,
    };
    let event = Fact::ReservationRequested(request)
        .to_event()
        .with_metadata(&serde_json::json!({"cli": "region-drill"}));
    let t = Instant::now();
    let stream = domain::reservation_stream(&id);
    let ok = surely(s, |_| {
        let (stream, event) = (stream.clone(), event.clone());
        async move {
            a.append(&stream, ExpectedVersion::NoStream, vec![event])
                .await
                .map(|_| ())
        }
    })
    .await;
    if !ok {
        return;
    }
    if s.measuring.load(Ordering::Relaxed) {
        s.ack.lock().expect("ack lock").push(t.elapsed());
    }
    s.requested.fetch_add(1, Ordering::Relaxed);
    s.acked.lock().expect("acked lock").push(id.clone());
    if ttl {
        return;
    }
    tokio::time::sleep(Duration::from_millis(fastrand::u64(2_000..10_000))).await;
    if stop.load(Ordering::Relaxed) {
        return;
    }
    let released = surely(s, |_| async {
        match domain::requests::release(a, &id, "done", None).await {
            Ok(()) => Ok(()),
            Err(domain::requests::RequestError::Append(e)) => Err(e),
            Err(e) => Err(AppendError::Invalid(e.to_string())),
        }
    })
    .await;
    if released {
        s.releases.fetch_add(1, Ordering::Relaxed);
    }
}
