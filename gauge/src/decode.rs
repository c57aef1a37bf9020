//! The pgoutput decoder: the world's log as the replication stream would
//! carry it (a relation message, then transactions of 64 inserts), decoded
//! and assembled into transactions of events, counting only the decoding.

use crate::world::{plan_batch, World};
use events::pgoutput::encode;
use events::{Assembler, Lsn};

/// Events per transaction of the sample.
const PER_TXN: usize = 64;
const RELATION: u32 = 16_384;

/// Decodes the sample; returns how many events came out of it.
pub fn run() -> usize {
    let mut world = World::pool();
    world.script(plan_batch);
    let messages = sample(&world);
    gauge_measured_decode(&messages)
}

/// The world's log as pgoutput messages.
fn sample(world: &World) -> Vec<Vec<u8>> {
    let mut out = vec![encode::relation(&encode::events_relation(RELATION))];
    let mut lsn = 1u64 << 24;
    for (i, txn) in world.events().chunks(PER_TXN).enumerate() {
        let time = i as i64 * 1_000;
        out.push(encode::begin(Lsn(lsn + 4096), time, i as u32 + 1));
        for e in txn {
            out.push(encode::event_insert(RELATION, e));
        }
        out.push(encode::commit(0, Lsn(lsn + 4096), Lsn(lsn + 4104), time));
        lsn += 8192;
    }
    out
}

/// The measured region (callgrind's `--toggle-collect`).
#[inline(never)]
fn gauge_measured_decode(messages: &[Vec<u8>]) -> usize {
    let mut assembler = Assembler::new();
    let mut events = 0;
    for m in messages {
        if let Some(txn) = assembler.push(m).expect("the sample decodes") {
            events += txn.events.len();
        }
    }
    events
}
