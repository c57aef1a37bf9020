//! What the append scenarios share with their baselines: the payload every
//! writer appends, and the timed window that turns a set of writer tasks
//! into a measured [`Phase`] (events per second and the CPU it used).

use crate::util;
use anyhow::Result;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The event every append scenario writes: about 60 bytes of JSON.
pub(crate) fn payload(i: u64) -> serde_json::Value {
    serde_json::json!({ "node": format!("n-{}", i % 10_000), "gpu": i % 8, "seq": i })
}

/// A measured phase: events per second and the CPU it used.
pub(crate) struct Phase {
    pub rate: f64,
    pub cpu: util::CpuUse,
}

impl Phase {
    /// Microseconds of CPU per event: the whole machine, and this process.
    pub(crate) fn cpu_per_event(&self) -> (f64, f64) {
        let per = |cores: f64| {
            if self.rate > 0.0 {
                cores * 1e6 / self.rate
            } else {
                0.0
            }
        };
        (per(self.cpu.busy_cores), per(self.cpu.own_cores))
    }
}

/// Lets `tasks` run for `secs` after a short warm-up (`measuring`, if
/// given, is set when the measured window opens), prints the rate and the
/// cores busy (`label` before it, `own` naming this process's share) and
/// returns the phase with what each task returned.
pub(crate) async fn timed<T>(
    count: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    measuring: Option<&AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Result<T>>>,
    secs: Duration,
    label: &str,
    own: &str,
) -> Result<(Phase, Vec<T>)> {
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Some(m) = measuring {
        m.store(true, Ordering::Relaxed);
    }
    let (c0, t0) = (count.load(Ordering::Relaxed), Instant::now());
    let cpu = util::CpuMeter::start();
    tokio::time::sleep(secs).await;
    let (c1, t1) = (count.load(Ordering::Relaxed), Instant::now());
    let used = cpu.stop();
    stop.store(true, Ordering::Relaxed);
    let rate = (c1 - c0) as f64 / (t1 - t0).as_secs_f64();
    eprintln!(
        "  {label}{rate:.0}/s, cores busy {:.2} ({own} {:.2})",
        used.busy_cores, used.own_cores
    );
    let mut outs = Vec::with_capacity(tasks.len());
    for t in tasks {
        outs.push(t.await??);
    }
    Ok((Phase { rate, cpu: used }, outs))
}
