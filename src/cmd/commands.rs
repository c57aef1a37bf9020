//! `strata commands issue|list|show`: commands to nodes.

use crate::cli::config;
use crate::cli::connect;
use crate::cli::whoami;
use crate::cli::DbArgs;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Subcommand;
use events::Appender;
use events::AppenderConfig;
use std::process::ExitCode;
use std::time::Duration;
use std::time::SystemTime;
use std::time::UNIX_EPOCH;

#[derive(Subcommand, Debug)]
pub(crate) enum CommandsCmd {
    /// Issue a command to a node
    Issue {
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        node: String,
        /// diag.nvml, gpu.mig (args gpu, profiles; see `strata nodes mig`)
        #[arg(long)]
        kind: String,
        /// Arguments, a JSON object
        #[arg(long, default_value = "{}")]
        args: String,
        /// Not run after this long
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        deadline: std::time::Duration,
        /// The command's id (generated when omitted)
        #[arg(long)]
        id: Option<String>,
        /// Wait for its result and print it
        #[arg(long)]
        wait: bool,
    },
    /// List recent commands with their state
    List {
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        node: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Show one command and its outcome
    Show {
        #[command(flatten)]
        db: DbArgs,
        id: String,
    },
}

pub(crate) fn print_command(t: &domain::commands::Tracked) {
    let outcome = t
        .outcome
        .as_ref()
        .and_then(|o| o["detail"].as_str())
        .unwrap_or("");
    println!(
        "{:<40} {:<20} {:<20} {:<10} {}",
        t.command.id,
        t.command.node,
        t.command.kind,
        serde_json::to_value(t.state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        outcome
    );
}

/// Waits at most `limit` for command `c` to end; `None` if it has not.
pub(crate) async fn wait_for_result(
    client: &tokio_postgres::Client,
    c: &domain::commands::Command,
    limit: Duration,
) -> Result<Option<domain::commands::Tracked>> {
    let until = std::time::Instant::now() + limit;
    loop {
        let found = domain::commands::list(client, Some(&c.node), 1000).await?;
        if let Some(t) = found.into_iter().find(|t| t.command.id == c.id) {
            if t.state.is_terminal() {
                return Ok(Some(t));
            }
        }
        if std::time::Instant::now() > until {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) async fn commands(cmd: CommandsCmd) -> Result<ExitCode> {
    use domain::commands::{self, Command};
    match cmd {
        CommandsCmd::Issue {
            db,
            node,
            kind,
            args,
            deadline,
            id,
            wait,
        } => {
            let args: serde_json::Value =
                serde_json::from_str(&args).context("--args must be a JSON object")?;
            if !args.is_object() {
                bail!("--args must be a JSON object");
            }
            let id = id.unwrap_or_else(|| domain::new_id("c"));
            let deadline_ms = (SystemTime::now() + deadline)
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            let c = Command {
                id: id.clone(),
                node,
                kind,
                args,
                deadline_ms,
                issued_by: format!("cli:{}", whoami()),
            };
            commands::issue(&appender, &c).await.map_err(|e| match e {
                events::AppendError::VersionConflict { .. } => {
                    anyhow::anyhow!("command {id:?} already exists")
                }
                e => e.into(),
            })?;
            println!("issued {id}");
            if wait {
                let client = connect(&db).await?;
                let Some(t) =
                    wait_for_result(&client, &c, deadline + Duration::from_secs(5)).await?
                else {
                    eprintln!("no result before the deadline");
                    return Ok(ExitCode::from(crate::exit::TIMED_OUT));
                };
                print_command(&t);
                if let Some(o) = &t.outcome {
                    println!("{}", serde_json::to_string_pretty(o)?);
                }
                return Ok(if t.state == commands::CommandState::Succeeded {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(crate::exit::FAILURE)
                });
            }
        }
        CommandsCmd::List { db, node, limit } => {
            let client = connect(&db).await?;
            let list = commands::list(&client, node.as_deref(), limit).await?;
            if crate::exit::json() {
                for t in &list {
                    crate::exit::print_json(&serde_json::to_value(t)?);
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<40} {:<20} {:<20} {:<10} DETAIL",
                "ID", "NODE", "KIND", "STATE"
            );
            for t in list {
                print_command(&t);
            }
        }
        CommandsCmd::Show { db, id } => {
            let client = connect(&db).await?;
            let Some(node) = commands::node_of(&client, &id).await? else {
                return Err(crate::exit::not_found(format!(
                    "command {id:?} does not exist"
                )));
            };
            let found = commands::list(&client, Some(&node), 100_000).await?;
            let t = found
                .iter()
                .find(|t| t.command.id == id)
                .context("command not found")?;
            if crate::exit::json() {
                crate::exit::print_json(&serde_json::to_value(t)?);
            } else {
                println!("{}", serde_json::to_string_pretty(t)?);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
