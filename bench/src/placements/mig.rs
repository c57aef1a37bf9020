//! `bench placements`, the MIG phase: the same load placed on a pool of
//! whole GPUs (the baseline) and on a pool of as many nodes where a tenth
//! of the GPUs are split into MIG instances (GPUs 0 to 3 of every fifth
//! node, `1g.10gb` x 7 each), a tenth of its requests asking for an
//! instance. Rounds alternate between the two pools (plain, split, plain,
//! split, ...) so drift of the machine falls on both; the measure is the
//! ratio of the split pool's median rate to the plain pool's.

use anyhow::Result;
use domain::{DeviceSpec, Request, Shape};
use events::Appender;
use std::sync::atomic::Ordering;

use super::{flood, Seen, CLASS};

/// The pools.
pub const PLAIN: &str = "mig-plain";
pub const SPLIT: &str = "mig-split";
/// The profile of the split GPUs, and how many instances each has.
pub const PROFILE: &str = "1g.10gb";
pub const PER_GPU: u32 = 7;
/// Every `EVERY`th node of the split pool has `GPUS_SPLIT` GPUs split: a
/// tenth of the pool's GPUs.
const EVERY: u32 = 5;
const GPUS_SPLIT: usize = 4;

/// Both pools' rounds.
pub struct Mig {
    pub nodes: u32,
    pub split_gpus: u64,
    pub instances: u64,
    /// Placements per second, per round, of each pool.
    pub plain: Vec<f64>,
    pub split: Vec<f64>,
    /// Requests per round, and of them those asking for an instance.
    pub per_round: u64,
    pub mig_requests_per_round: u64,
    pub placed: u64,
}

/// The nodes of a pool: 8 whole GPUs each, and for `split` GPUs 0 to 3 of
/// every fifth node split into instances.
pub fn fleet(pool: &str, nodes: u32, split: bool) -> Vec<(String, Vec<DeviceSpec>)> {
    let mut fleet = domain::pools::uniform_fleet(&format!("{pool}-n"), nodes, CLASS, 8, 8);
    if split {
        for (i, (_, devices)) in fleet.iter_mut().enumerate() {
            if (i as u32).is_multiple_of(EVERY) {
                domain::pools::split_mig(devices, GPUS_SPLIT, PROFILE, PER_GPU);
            }
        }
    }
    fleet
}

fn requests(pool: &str, round: usize, n: u64, mig: bool) -> Vec<Request> {
    let class = domain::mig_class(CLASS, PROFILE);
    (0..n)
        .map(|i| {
            let mut r = super::request(format!("{pool}-{round}-{i}"), pool, 1, Shape::Any);
            if mig && i % 10 == 9 {
                r.class = class.clone();
            }
            r
        })
        .collect()
}

/// Places `rounds` rounds of `per_round` 1-GPU requests on each pool, the
/// pools taking turns.
pub async fn run(
    appender: &Appender,
    seen: &Seen,
    nodes: u32,
    clients: usize,
    per_round: u64,
    rounds: usize,
) -> Result<Mig> {
    let mut out = Mig {
        nodes,
        split_gpus: u64::from(nodes.div_ceil(EVERY)) * GPUS_SPLIT as u64,
        instances: u64::from(nodes.div_ceil(EVERY)) * (GPUS_SPLIT as u64) * u64::from(PER_GPU),
        plain: Vec::new(),
        split: Vec::new(),
        per_round,
        mig_requests_per_round: per_round / 10,
        placed: 0,
    };
    for round in 0..rounds {
        for (pool, mig) in [(PLAIN, false), (SPLIT, true)] {
            let placed_before = seen.placed.load(Ordering::Relaxed);
            let (secs, _) = flood(
                appender,
                seen,
                requests(pool, round, per_round, mig),
                clients,
            )
            .await?;
            let placed = seen.placed.load(Ordering::Relaxed) - placed_before;
            out.placed += placed;
            let rate = per_round as f64 / secs;
            eprintln!("mig: round {round}, {pool}: {per_round} decided in {secs:.2} s = {rate:.0}/s ({placed} placed)");
            if mig {
                out.split.push(rate);
            } else {
                out.plain.push(rate);
            }
        }
    }
    Ok(out)
}
