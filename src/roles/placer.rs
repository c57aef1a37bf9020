//! The `placer` role: a placer configured from `serve`'s flags.

use crate::roles::ServeArgs;
use events::db::Database;
use events::{Appender, AppenderConfig, Reader};

/// Starts a placer on the pools of `--pools` (every pool when none).
pub(crate) fn start(args: &ServeArgs, cfg: &Database, reader: Reader) -> placer::Placer {
    let mut pc = placer::PlacerConfig::new(
        args.holder
            .clone()
            .unwrap_or_else(events::lease::default_holder),
    );
    pc.max_batch = args.max_batch.max(1);
    pc.lease_ttl = args.lease_ttl;
    pc.node_lost_after = args.node_lost_after;
    pc.preemption_grace = args.preemption_grace;
    if !args.pools.is_empty() {
        pc.pools = Some(args.pools.iter().cloned().collect());
    }
    pc.snapshots = args
        .snapshot_dir
        .clone()
        .map(projections::SnapshotStore::new);
    tracing::info!(holder = %pc.holder, max_batch = pc.max_batch, lease_ttl = ?pc.lease_ttl, "starting the placer");
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    placer::Placer::start(cfg.clone(), reader, appender, pc)
}

/// Logs the placer's counters.
pub(crate) fn report(p: &placer::Placer) {
    let s = p.stats().view();
    tracing::info!(
        pools = s.pools_held,
        placed = s.placed,
        queued = s.queued,
        rejected = s.rejected,
        released = s.released,
        expired = s.expired,
        batches = s.batches,
        conflicts = s.conflicts,
        position = s.position,
        "placer"
    );
}
