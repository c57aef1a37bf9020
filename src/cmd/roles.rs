//! `strata roles`: what an operator may do through the client API.

use crate::cli::config;
use crate::cli::connect;
use crate::cli::DbArgs;
use anyhow::Result;
use clap::Subcommand;
use events::Appender;
use events::AppenderConfig;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum RolesCmd {
    /// Give an operator a role (replacing the one it had); recorded as an event on role/<name>
    Set {
        #[command(flatten)]
        db: DbArgs,
        /// The operator name in its certificate (urn:strata:operator:<name>)
        operator: String,
        /// admin: everything; operator: reserve, release its own reservations, change nodes' standing and issue commands in its pools; viewer: read only
        #[arg(long)]
        role: String,
        /// The pools an operator acts in (comma-separated); only for --role operator
        #[arg(long, value_delimiter = ',')]
        pools: Vec<String>,
    },
    /// Every operator with a role
    List {
        #[command(flatten)]
        db: DbArgs,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// Take an operator's role away (it may then do nothing through the API)
    Remove {
        #[command(flatten)]
        db: DbArgs,
        operator: String,
    },
}

pub(crate) async fn roles(cmd: RolesCmd) -> Result<ExitCode> {
    use gateway::roles::{self, Assignment};
    match cmd {
        RolesCmd::Set {
            db,
            operator,
            role,
            pools,
        } => {
            let role = role.parse().map_err(anyhow::Error::msg)?;
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            let a = Assignment { role, pools };
            roles::set(&appender, &operator, &a).await?;
            match a.pools.is_empty() {
                true => println!("{operator} is {}", a.role),
                false => println!("{operator} is {} in pools {}", a.role, a.pools.join(", ")),
            }
        }
        RolesCmd::List { db, json } => {
            let client = connect(&db).await?;
            for (name, a) in roles::list(&client).await? {
                if json || crate::exit::json() {
                    println!(
                        "{}",
                        serde_json::json!({ "operator": name, "role": a.role, "pools": a.pools })
                    );
                } else {
                    println!("{name:<24} {:<9} {}", a.role.to_string(), a.pools.join(","));
                }
            }
        }
        RolesCmd::Remove { db, operator } => {
            let appender = Appender::start(config(&db)?, AppenderConfig::default());
            roles::remove(&appender, &operator)
                .await
                .map_err(|e| match e {
                    events::AppendError::VersionConflict { .. } => {
                        anyhow::anyhow!("{operator} has no role")
                    }
                    e => e.into(),
                })?;
            // A grant to read events is apart from the role: say so.
            let client = crate::cli::connect(&db).await?;
            match gateway::grants::get(&client, &operator).await? {
                Some(g) => println!(
                    "{operator} has no role now: it may do nothing through the API but read the events its grant allows (Subscribe to streams {}); `strata grants remove {operator}` ends that too",
                    g.stream_prefixes.join(", ")
                ),
                None => println!("{operator} has no role now: it may do nothing through the API"),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
