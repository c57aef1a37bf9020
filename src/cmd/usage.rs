//! `strata usage report|weights`: who used what, from the usage rollups
//! the `usage` role keeps, and the billing weights reports apply.

use crate::cli::{appender, asked_by, connect, DbArgs};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use projections::usage::{By, Query};
use std::process::ExitCode;
use std::time::SystemTime;

#[derive(Subcommand, Debug)]
pub(crate) enum UsageCmd {
    /// GPU-hours over a period, grouped (e.g. --by queue,owner,class): active hours (from each reservation's activation to its end), held hours apart (placed, not active yet or never), billed hours at the billing weights in force, reservations ended and still running. Exact from the log up to the position printed; a period runs from whole hour to whole hour. `--output json` prints one object, `--output csv` a table for spreadsheets
    Report {
        #[command(flatten)]
        db: DbArgs,
        /// Start: a time (2026-12-01T09:00:00Z), a day (2026-12-01, at 00:00 UTC) or how long ago (7d, 12h); default the start of this month
        #[arg(long)]
        since: Option<String>,
        /// End, in the same forms (default now)
        #[arg(long)]
        until: Option<String>,
        /// Group by any of pool, queue, owner, class, node (comma-separated; node goes with pool and class only); none: one total
        #[arg(long, default_value = "pool,queue,owner,class")]
        by: String,
        /// Only these pools (repeatable)
        #[arg(long)]
        pool: Vec<String>,
        /// Only this owner's reservations (the operator who asked, or the user a command line ran as)
        #[arg(long)]
        owner: Option<String>,
    },
    /// Show the billing weights (what an hour of each GPU class counts for in billed hours; a class without one counts 1), or set some: CLASS=WEIGHT (0 to 1000), CLASS=- to remove one. Setting writes `usage.weights_set` with the whole table
    Weights {
        #[command(flatten)]
        db: DbArgs,
        /// CLASS=WEIGHT, e.g. H100-80GB=2 'H100-80GB/1g.10gb=0.25'
        set: Vec<String>,
    },
}

pub(crate) async fn usage(cmd: UsageCmd) -> Result<ExitCode> {
    match cmd {
        UsageCmd::Report {
            db,
            since,
            until,
            by,
            pool,
            owner,
        } => {
            let now = SystemTime::now();
            let since = match since {
                Some(s) => {
                    projections::usage::report::parse_time(&s, now).map_err(anyhow::Error::msg)?
                }
                None => projections::usage::report::month_start(now),
            };
            let until = match until {
                Some(s) => {
                    projections::usage::report::parse_time(&s, now).map_err(anyhow::Error::msg)?
                }
                None => now,
            };
            if until < since {
                bail!("--until is before --since");
            }
            let by = By::parse_list(&by).map_err(anyhow::Error::msg)?;
            let mut client = connect(&db).await?;
            let q = Query {
                since_ms: projections::usage::unix_ms(since),
                until_ms: projections::usage::unix_ms(until),
                by,
                pools: (!pool.is_empty()).then_some(pool),
                owner,
                now_ms: projections::usage::unix_ms(now),
            };
            let r = projections::usage::report::report(&mut client, &q)
                .await
                .context("read the usage rollups")?;
            print_report(&r)?;
            Ok(ExitCode::SUCCESS)
        }
        UsageCmd::Weights { db, set } => {
            let client = connect(&db).await?;
            let mut weights = domain::usage::weights(&client).await?;
            if !set.is_empty() {
                weights = domain::usage::edit(&weights, &set).map_err(anyhow::Error::msg)?;
                let appender = appender(&db)?;
                domain::usage::set_weights(&appender, &weights, Some(&asked_by())).await?;
            }
            if crate::exit::json() {
                crate::exit::print_json(&serde_json::json!({ "weights": weights }));
            } else if weights.is_empty() {
                println!("no billing weights: every class counts 1");
            } else {
                println!("{:<32} WEIGHT", "CLASS");
                for (class, w) in &weights {
                    println!("{class:<32} {w}");
                }
                println!("(any other class counts 1)");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_report(r: &projections::usage::Report) -> Result<()> {
    let names: Vec<&str> = r.by.iter().map(|b| b.name()).collect();
    if crate::exit::json() {
        crate::exit::print_json(&serde_json::to_value(r)?);
        return Ok(());
    }
    let figures = projections::usage::report::figures;
    if crate::exit::csv() {
        let out = projections::usage::report::csv(r);
        crate::exit::print_line(format_args!("{}", out.trim_end()));
        return Ok(());
    }
    match r.position {
        Some(p) => println!(
            "usage from {} to {} (exact up to position {p}{})",
            r.since,
            r.until,
            if r.behind > 0 {
                format!("; {} later events not counted yet", r.behind)
            } else {
                String::new()
            }
        ),
        None => println!(
            "usage from {} to {}: no usage is kept yet (run a process with `serve --roles usage`)",
            r.since, r.until
        ),
    }
    let widths: Vec<usize> = (0..names.len())
        .map(|i| {
            r.rows
                .iter()
                .map(|row| row.keys[i].len().max(1))
                .chain(std::iter::once(names[i].len()))
                .max()
                .unwrap_or(4)
                .min(40)
        })
        .collect();
    let mut head = String::new();
    for (n, w) in names.iter().zip(&widths) {
        head.push_str(&format!("{:<w$}  ", n.to_uppercase(), w = w));
    }
    println!(
        "{head}{:>12} {:>12} {:>12} {:>7} {:>8}",
        "GPU-HOURS", "HELD GPU-H", "BILLED", "ENDED", "RUNNING"
    );
    let line = |keys: &[String], f: [String; 5]| {
        let mut s = String::new();
        for (k, w) in keys.iter().zip(&widths) {
            let k = if k.is_empty() { "-" } else { k };
            s.push_str(&format!("{k:<w$}  ", w = w));
        }
        println!(
            "{s}{:>12} {:>12} {:>12} {:>7} {:>8}",
            f[0], f[1], f[2], f[3], f[4]
        );
    };
    for row in &r.rows {
        line(&row.keys, figures(row));
    }
    if !names.is_empty() && r.rows.len() > 1 {
        let mut keys = vec![String::new(); names.len()];
        keys[0] = "TOTAL".into();
        line(&keys, figures(&r.total));
    }
    Ok(())
}
