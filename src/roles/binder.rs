//! The `binder` role: a binder holding the binder lease as this process.

use events::db::Database;
use events::{Appender, AppenderConfig, Reader};
use std::time::Duration;

/// While the binder's appends come thick, each waits up to this for others
/// to share its transaction (`AppenderConfig::group_delay`): its commands
/// and activations are many, independent, and nothing waits on any one of
/// them by the millisecond.
const GROUP_DELAY: Duration = Duration::from_millis(5);

/// Starts a binder; `holder` names this process in its lease.
pub(crate) fn start(cfg: &Database, reader: Reader, holder: &str) -> binder::Binder {
    let appender = Appender::start(
        cfg.clone(),
        AppenderConfig {
            group_delay: GROUP_DELAY,
            ..AppenderConfig::default()
        },
    );
    binder::Binder::start_as(cfg.clone(), reader, appender, holder.to_string())
}
