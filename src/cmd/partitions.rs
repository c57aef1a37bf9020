//! `strata partitions`: the monthly partitions of the event table.

use crate::cli::connect;
use crate::cli::connect_long;
use crate::cli::human_bytes;
use crate::cli::DbArgs;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Subcommand;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::SystemTime;

#[derive(Subcommand, Debug)]
pub(crate) enum PartitionsCmd {
    /// Create the partitions for this month and the months ahead
    Ensure {
        #[command(flatten)]
        db: DbArgs,
        /// How many months past the current one to create
        #[arg(long, default_value_t = schema::partitions::DEFAULT_MONTHS_AHEAD)]
        months_ahead: i32,
    },
    /// List the partitions with their row counts and sizes
    List {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Export a month's rows as an rkyv archive with a checksum (replay it with `replay run --archive`)
    Export {
        #[command(flatten)]
        db: DbArgs,
        /// The month, e.g. 2026-11
        month: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Detach and drop months older than a bound, only those sealed and exported
    Retire {
        #[command(flatten)]
        db: DbArgs,
        /// e.g. 13mo: months that ended more than 13 months ago
        #[arg(long)]
        older_than: String,
        /// Only say what would be dropped or kept, and why
        #[arg(long)]
        dry_run: bool,
    },
    /// Seal a month: a hash chain over its rows in position order, stored for `strata audit verify`
    Seal {
        #[command(flatten)]
        db: DbArgs,
        /// The month, e.g. 2026-11
        month: String,
    },
}

pub(crate) async fn partitions(cmd: PartitionsCmd) -> Result<ExitCode> {
    match cmd {
        PartitionsCmd::Ensure { db, months_ahead } => {
            if !(0..=120).contains(&months_ahead) {
                bail!("--months-ahead must be between 0 and 120");
            }
            let client = connect(&db).await?;
            let n = schema::partitions::ensure(&client, months_ahead, SystemTime::now())
                .await
                .context("ensure partitions")?;
            println!("created {n} partition(s); {months_ahead} month(s) ahead are in place");
        }
        PartitionsCmd::Export { db, month, out } => {
            let client = connect_long(&db).await?;
            let (bytes, rows) = ::replay::archive::export(&client, &month).await?;
            let tmp = out.with_extension("tmp");
            std::fs::write(&tmp, &bytes).with_context(|| format!("write {}", tmp.display()))?;
            std::fs::rename(&tmp, &out).with_context(|| format!("write {}", out.display()))?;
            ::replay::archive::record_export(&client, &month, &out, rows, &bytes).await?;
            println!(
                "exported {rows} rows of {month} to {} ({} bytes)",
                out.display(),
                bytes.len()
            );
        }
        PartitionsCmd::Retire {
            db,
            older_than,
            dry_run,
        } => {
            let months: u32 = older_than
                .strip_suffix("mo")
                .and_then(|m| m.parse().ok())
                .filter(|m| *m >= 1)
                .with_context(|| {
                    format!("--older-than {older_than:?}: a number of months such as 13mo")
                })?;
            let client = connect_long(&db).await?;
            let done = ::replay::archive::retire(&client, months, dry_run).await?;
            let mut refused = 0;
            for r in &done {
                match &r.refused {
                    None if dry_run => println!("{}: would be dropped", r.partition),
                    None => println!("{}: detached and dropped", r.partition),
                    Some(why) => {
                        refused += 1;
                        println!("{}: kept, {why}", r.partition);
                    }
                }
            }
            if done.is_empty() {
                println!("no month is older than {months} months");
            }
            if refused > 0 {
                return Ok(ExitCode::from(1));
            }
        }
        PartitionsCmd::Seal { db, month } => {
            let client = connect(&db).await?;
            let s = ::replay::seal::seal(&client, &month).await?;
            println!(
                "sealed {}: {} rows (positions {} to {}), chain {}",
                s.partition,
                s.rows,
                s.first_position.map_or("-".into(), |p| p.to_string()),
                s.last_position.map_or("-".into(), |p| p.to_string()),
                s.chain
            );
        }
        PartitionsCmd::List { db } => {
            let client = connect(&db).await?;
            let parts = schema::partitions::list(&client)
                .await
                .context("list partitions")?;
            if crate::exit::json() {
                for p in &parts {
                    crate::exit::print_json(&serde_json::json!({
                        "partition": p.name, "rows": p.rows, "bytes": p.bytes, "bounds": p.bounds,
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!("{:<18} {:>12} {:>12}  BOUNDS", "PARTITION", "ROWS", "SIZE");
            for p in parts {
                println!(
                    "{:<18} {:>12} {:>12}  {}",
                    p.name,
                    p.rows,
                    human_bytes(p.bytes),
                    p.bounds
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
