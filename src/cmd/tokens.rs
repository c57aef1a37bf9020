//! `strata tokens`: one-time join tokens for nodes.

use crate::cli::connect;
use crate::cli::DbArgs;
use anyhow::Result;
use clap::Subcommand;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum TokensCmd {
    /// Issue a one-time join token for a pool and the node ids it admits (printed once; only its hash is stored)
    #[command(group(clap::ArgGroup::new("admits").required(true).args(["node", "nodes"])))]
    Create {
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        pool: String,
        /// How long it can be used
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
        /// Only this node may join with it (the only way back for a revoked node)
        #[arg(long)]
        node: Option<String>,
        /// Node ids it admits, `*` standing for any characters: gpu-rack7-*, or '*' for any id not taken
        #[arg(long)]
        nodes: Option<String>,
    },
    /// List join tokens (their ids, never the tokens): pool, what they admit, valid, used or expired
    List {
        #[command(flatten)]
        db: DbArgs,
        /// One JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// Revoke an unspent token by its id (from `tokens create` or `tokens list`): joins with it are refused from now on
    Revoke {
        #[command(flatten)]
        db: DbArgs,
        /// 16 hex digits
        id: String,
    },
}

pub(crate) async fn tokens(cmd: TokensCmd) -> Result<ExitCode> {
    match cmd {
        TokensCmd::Create {
            db,
            pool,
            ttl,
            node,
            nodes,
        } => {
            let client = connect(&db).await?;
            if !domain::pools::pool_exists(&client, &pool).await? {
                return Err(crate::exit::not_found(format!(
                    "pool {pool:?} does not exist (see `strata pools`)"
                )));
            }
            let admits = node.as_deref().or(nodes.as_deref()).unwrap_or_default();
            let token = gateway::identity::create_token(&client, &pool, ttl, admits).await?;
            let only = match (&node, &nodes) {
                (Some(n), _) => format!(" and node {n} alone"),
                (None, Some(p)) if p == "*" => " and any node id not taken".to_string(),
                (None, Some(p)) => format!(" and a node id matching {p}"),
                (None, None) => String::new(),
            };
            eprintln!(
                "a one-time token for pool {pool}{only}, valid for {} (id {}, for `strata tokens revoke`); it is not shown again:",
                humantime::format_duration(ttl),
                gateway::identity::token_id(&token)
            );
            println!("{token}");
        }
        TokensCmd::List { db, json } => {
            let client = connect(&db).await?;
            let tokens = gateway::identity::list_tokens(&client).await?;
            if json || crate::exit::json() {
                for t in &tokens {
                    println!("{}", serde_json::to_string(t)?);
                }
            } else {
                println!(
                    "{:<16}  {:<16}  {:<16}  {:<7}  {:<20}  USED BY",
                    "ID", "POOL", "ADMITS", "STATE", "EXPIRES"
                );
                for t in &tokens {
                    println!(
                        "{:<16}  {:<16}  {:<16}  {:<7}  {:<20}  {}",
                        t.id,
                        t.pool,
                        t.admits.as_deref().unwrap_or("*"),
                        t.state,
                        t.expires_at,
                        t.used_by.as_deref().unwrap_or("-")
                    );
                }
            }
        }
        TokensCmd::Revoke { db, id } => {
            let client = connect(&db).await?;
            use gateway::identity::TokenRevoked;
            match gateway::identity::revoke_token(&client, &id).await? {
                TokenRevoked::Revoked => println!("revoked token {id}: joins with it are refused"),
                TokenRevoked::AlreadyUnusable => {
                    println!("token {id} was already spent or expired; nothing to do")
                }
                TokenRevoked::NotFound => {
                    return Err(crate::exit::not_found(format!(
                        "no join token with id {id} (see `strata tokens list`)"
                    )))
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
