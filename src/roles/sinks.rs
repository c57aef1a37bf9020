//! The `sinks` role: every sink defined in the log delivered by one of the
//! processes running the role.

use crate::roles::ServeArgs;
use anyhow::{Context, Result};
use events::db::Database;
use events::Reader;

/// Starts the sinks' runner; fails only when `--webhook-ca` cannot be used.
pub(crate) fn start(args: &ServeArgs, cfg: &Database, reader: Reader) -> Result<sinks::Sinks> {
    sinks::Sinks::start(
        cfg.clone(),
        reader,
        sinks::SinksConfig {
            webhook_ca: args.webhook_ca.clone(),
            region: args.region.clone(),
            ..sinks::SinksConfig::default()
        },
    )
    .map_err(anyhow::Error::msg)
    .context("--webhook-ca")
}
