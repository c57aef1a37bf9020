//! The `usage` role: the usage rollups kept from the log
//! (`projections::usage::keeper`). Several processes may run it; the
//! `usage` subscription's lease makes one the writer and hands the work on
//! when it stops.

use events::db::Database;
use events::Reader;

/// Starts keeping the rollups; it runs until the process ends.
pub(crate) fn start(cfg: &Database, reader: Reader) {
    ops::task::spawn(
        "usage",
        projections::usage::keeper::run(reader, cfg.clone()),
    );
}
