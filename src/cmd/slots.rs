//! `strata slots`: the replication slots, listed and dropped.

use crate::cli::connect;
use crate::cli::human_bytes;
use crate::cli::DbArgs;
use anyhow::Context;
use anyhow::Result;
use clap::Subcommand;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum SlotsCmd {
    /// List replication slots with owner, lag and retained WAL
    List {
        #[command(flatten)]
        db: DbArgs,
        /// Flag slots whose owner has not been seen for longer than this
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        stale_after: std::time::Duration,
    },
    /// Drop a replication slot
    Drop {
        #[command(flatten)]
        db: DbArgs,
        /// The slot's name
        name: String,
        /// End the connection using it first
        #[arg(long)]
        force: bool,
    },
}

pub(crate) async fn slots(cmd: SlotsCmd) -> Result<ExitCode> {
    match cmd {
        SlotsCmd::List { db, stale_after } => {
            let client = connect(&db).await?;
            let slots = events::slots::list(&client, stale_after)
                .await
                .context("list replication slots")?;
            if crate::exit::json() {
                for s in &slots {
                    crate::exit::print_json(&serde_json::json!({
                        "slot": s.name,
                        "plugin": s.plugin,
                        "active": s.active,
                        "temporary": s.temporary,
                        "owner": s.owner,
                        "owner_seen_seconds": s.owner_seen_secs,
                        "lag_bytes": s.lag_bytes,
                        "retained_bytes": s.retained_bytes,
                        "wal_status": s.wal_status,
                        "stale": s.stale,
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<28} {:<7} {:<34} {:>10} {:>12} {:>12} {:<10}",
                "SLOT", "ACTIVE", "OWNER", "SEEN", "LAG", "RETAINED", "WAL"
            );
            for s in slots {
                println!(
                    "{:<28} {:<7} {:<34} {:>10} {:>12} {:>12} {:<10}{}",
                    s.name,
                    if s.active { "yes" } else { "no" },
                    s.owner.as_deref().unwrap_or("-"),
                    s.owner_seen_secs
                        .map_or("-".into(), |v| format!("{v:.0}s ago")),
                    s.lag_bytes.map_or("-".into(), human_bytes),
                    s.retained_bytes.map_or("-".into(), human_bytes),
                    s.wal_status.as_deref().unwrap_or("-"),
                    if s.stale {
                        "  STALE: owner gone; `strata slots drop` frees its WAL"
                    } else {
                        ""
                    },
                );
            }
        }
        SlotsCmd::Drop { db, name, force } => {
            let client = connect(&db).await?;
            events::slots::drop_slot(&client, &name, force).await?;
            println!("dropped slot {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
