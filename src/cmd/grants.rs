//! `strata grants`: what an operator certificate may read through the
//! API's Subscribe.

use crate::cli::config;
use crate::cli::connect;
use crate::cli::DbArgs;
use anyhow::bail;
use anyhow::Result;
use clap::Subcommand;
use events::Appender;
use events::AppenderConfig;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum GrantsCmd {
    /// Set (replace) a caller's grant
    Set {
        #[command(flatten)]
        db: DbArgs,
        /// The operator name in the caller's certificate
        caller: String,
        /// Stream prefixes it may read (comma-separated), e.g. pool/,reservation/
        #[arg(long, value_delimiter = ',', required = true)]
        prefixes: Vec<String>,
        /// Event types it may read (comma-separated; default all within the prefixes)
        #[arg(long, value_delimiter = ',')]
        types: Vec<String>,
    },
    /// List every caller's grant
    List {
        #[command(flatten)]
        db: DbArgs,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// Remove a caller's grant: its Subscribe streams get nothing more (exit code 6 if it had none)
    Remove {
        #[command(flatten)]
        db: DbArgs,
        caller: String,
    },
}

pub(crate) async fn grants(cmd: GrantsCmd) -> Result<ExitCode> {
    match cmd {
        GrantsCmd::Set {
            db,
            caller,
            prefixes,
            types,
        } => return grant(&db, &caller, prefixes, types).await,
        GrantsCmd::List { db, json } => {
            let client = connect(&db).await?;
            let grants = gateway::grants::list(&client).await?;
            if json || crate::exit::json() {
                for (caller, g) in &grants {
                    println!(
                        "{}",
                        serde_json::json!({"caller": caller, "stream_prefixes": g.stream_prefixes, "types": g.types})
                    );
                }
            } else {
                println!("{:<24}  {:<40}  TYPES", "CALLER", "STREAM PREFIXES");
                for (caller, g) in &grants {
                    let types = if g.types.is_empty() {
                        "all".to_string()
                    } else {
                        g.types.join(",")
                    };
                    println!("{caller:<24}  {:<40}  {types}", g.stream_prefixes.join(","));
                }
            }
        }
        GrantsCmd::Remove { db, caller } => {
            let client = connect(&db).await?;
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            if gateway::grants::remove(&appender, &client, &caller)
                .await
                .map_err(anyhow::Error::msg)?
            {
                println!("removed {caller}'s grant");
            } else {
                return Err(crate::exit::not_found(format!(
                    "{caller} has no grant (see `strata grants list`)"
                )));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn grant(
    db: &DbArgs,
    caller: &str,
    prefixes: Vec<String>,
    types: Vec<String>,
) -> Result<ExitCode> {
    domain::valid_name("caller", caller).map_err(anyhow::Error::msg)?;
    if prefixes.iter().any(|p| p.is_empty()) {
        bail!("--prefixes: empty prefixes would grant everything; name them");
    }
    let appender = Appender::start(config(db)?, AppenderConfig::default());
    let g = gateway::grants::Grant {
        stream_prefixes: prefixes,
        types,
    };
    gateway::grants::set(&appender, caller, &g).await?;
    println!(
        "{caller} may read {:?}{}",
        g.stream_prefixes,
        if g.types.is_empty() {
            String::new()
        } else {
            format!(" of types {:?}", g.types)
        }
    );
    Ok(ExitCode::SUCCESS)
}
