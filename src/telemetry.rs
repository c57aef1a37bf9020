//! Logging setup: `tracing` to stderr, filtered by `RUST_LOG` (default `info`
//! for long-running commands, `warn` for one-shot ones).

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

pub struct Guard;

pub fn init(long_running: bool) -> Guard {
    let default = if long_running { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    Guard
}
