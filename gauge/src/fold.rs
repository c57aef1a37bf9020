//! The index fold: the world's whole log (its pool, demand and every
//! batch's outcome) folded into an empty index, counting only the fold.

use crate::world::{plan_batch, World};
use events::Event;
use projections::Index;

/// Folds the world's log; returns the index's position after it.
pub fn run() -> u64 {
    let mut world = World::pool();
    world.script(plan_batch);
    let index = gauge_measured_fold(world.events());
    index.position()
}

/// The measured region (callgrind's `--toggle-collect`).
#[inline(never)]
fn gauge_measured_fold(events: &[Event]) -> Index {
    let mut index = Index::new();
    for e in events {
        index.apply(e).expect("the world's log folds");
    }
    index
}
