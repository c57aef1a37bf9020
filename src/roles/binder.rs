//! The `binder` role: a binder holding the binder lease as this process.

use events::db::Database;
use events::{Appender, AppenderConfig, Reader};

/// Starts a binder; `holder` names this process in its lease.
pub(crate) fn start(cfg: &Database, reader: Reader, holder: &str) -> binder::Binder {
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    binder::Binder::start_as(cfg.clone(), reader, appender, holder.to_string())
}
