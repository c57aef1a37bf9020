//! `strata console`: signing a browser in to the web console (a one-time
//! link) and signing an operator's browsers out.

use crate::cli::connect;
use crate::cli::DbArgs;
use anyhow::{bail, Result};
use clap::Subcommand;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum ConsoleCmd {
    /// Print a link that signs a browser in to the console as OPERATOR, once, within --ttl; the operator needs a role (`strata roles set`)
    Login {
        #[command(flatten)]
        db: DbArgs,
        /// The operator the browser acts as
        #[arg(long)]
        operator: String,
        /// The console's address as the browser reaches it
        #[arg(
            long,
            env = "STRATA_CONSOLE_URL",
            default_value = "https://127.0.0.1:7480"
        )]
        url: String,
        /// How long the link stays valid (it is used up by its sign-in)
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
        /// Print a JSON object instead of the link alone
        #[arg(long)]
        json: bool,
    },
    /// End every console session of OPERATOR now (its browsers must sign in again)
    SignOut {
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        operator: String,
    },
}

/// A sign-in link for `operator`, who must have a role.
pub(crate) async fn login_link(
    client: &tokio_postgres::Client,
    operator: &str,
    url: &str,
    ttl: std::time::Duration,
) -> Result<String> {
    if gateway::roles::get(client, operator).await?.is_none() {
        bail!("operator {operator} has no role, so the console would let it do nothing: give one first with `strata roles set {operator} --role viewer|operator|admin`");
    }
    let token = console::auth::issue_link(client, operator, ttl).await?;
    Ok(format!("{}/login?token={token}", url.trim_end_matches('/')))
}

pub(crate) async fn console(cmd: ConsoleCmd) -> Result<ExitCode> {
    match cmd {
        ConsoleCmd::Login {
            db,
            operator,
            url,
            ttl,
            json,
        } => {
            let client = connect(&db).await?;
            let link = login_link(&client, &operator, &url, ttl).await?;
            if json || crate::exit::json() {
                println!(
                    "{}",
                    serde_json::json!({ "operator": operator, "url": link, "valid_for_s": ttl.as_secs() })
                );
            } else {
                println!("{link}");
                eprintln!(
                    "(signs one browser in as {operator}; valid for {})",
                    humantime::format_duration(ttl)
                );
            }
        }
        ConsoleCmd::SignOut { db, operator } => {
            let client = connect(&db).await?;
            let n = console::auth::end_all(&client, &operator).await?;
            println!("ended {n} console session(s) of {operator}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
