//! The planner: the world's demand planned batch by batch (quota admission,
//! fair share across the queues, preemption, topology), counting only the
//! planning itself.

use crate::world::{plan_batch, World};
use placer::plan::{Ending, Plan};
use projections::Index;

/// Plans the world's demand; returns how many reservations were placed.
pub fn run() -> usize {
    let mut world = World::pool();
    let mut placed = 0;
    world.script(|index, ids, ending| {
        let plan = gauge_measured_plan(index, ids, ending);
        placed += plan.placed.len();
        plan
    });
    placed
}

/// The measured region (callgrind's `--toggle-collect`).
#[inline(never)]
fn gauge_measured_plan(index: &mut Index, ids: &[String], ending: &Ending) -> Plan {
    plan_batch(index, ids, ending)
}
