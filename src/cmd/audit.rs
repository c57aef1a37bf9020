//! `strata audit verify|users`: sealed history verified, and the
//! auditors of the audit endpoint.

use crate::cli::connect;
use crate::cli::connect_long;
use crate::cli::DbArgs;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Subcommand;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum AuditCmd {
    /// Recompute a sealed month and name the first altered, inserted or deleted row (exit 1 if any)
    Verify {
        #[command(flatten)]
        db: DbArgs,
        /// The month, e.g. 2026-11
        month: String,
    },
    /// Auditors who may connect to the audit endpoint (`serve --roles audit`)
    #[command(subcommand)]
    Users(AuditUsersCmd),
}

#[derive(Subcommand, Debug)]
pub(crate) enum AuditUsersCmd {
    /// Add an auditor, or set a new password and lift a revocation
    Add {
        #[command(flatten)]
        db: DbArgs,
        name: String,
        /// Read the password from standard input (one line); only its SCRAM-SHA-256 verifier is stored
        #[arg(long, conflicts_with = "certificate_only")]
        password_stdin: bool,
        /// No password: the auditor logs in with a certificate from `strata ca issue-auditor`
        #[arg(long)]
        certificate_only: bool,
    },
    /// List auditors
    List {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Refuse an auditor's new connections from now on
    Revoke {
        #[command(flatten)]
        db: DbArgs,
        name: String,
    },
}

pub(crate) async fn audit_users(cmd: AuditUsersCmd) -> Result<ExitCode> {
    match cmd {
        AuditUsersCmd::Add {
            db,
            name,
            password_stdin,
            certificate_only,
        } => {
            if !password_stdin && !certificate_only {
                bail!("give --password-stdin (a password login) or --certificate-only (log in with `strata ca issue-auditor`)");
            }
            let password = if password_stdin {
                let mut line = String::new();
                std::io::stdin()
                    .read_line(&mut line)
                    .context("read the password from standard input")?;
                let p = line.trim_end_matches(['\r', '\n']).to_string();
                if p.is_empty() {
                    bail!("the password read from standard input is empty");
                }
                Some(p)
            } else {
                None
            };
            let client = connect(&db).await?;
            audit::accounts::add(&client, &name, password.as_deref()).await?;
            println!(
                "auditor {name} can connect to the audit endpoint ({})",
                if password.is_some() {
                    "SCRAM-SHA-256 password"
                } else {
                    "certificate"
                }
            );
        }
        AuditUsersCmd::List { db } => {
            let client = connect(&db).await?;
            let list = audit::accounts::list(&client).await?;
            if crate::exit::json() {
                for a in &list {
                    crate::exit::print_json(&serde_json::json!({
                        "name": a.name,
                        "password": a.has_password,
                        "created_at": crate::exit::time(a.created_at),
                        "revoked_at": a.revoked_at.map(crate::exit::time),
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!("{:<24} {:<9} {:<20} REVOKED", "NAME", "PASSWORD", "CREATED");
            for a in list {
                println!(
                    "{:<24} {:<9} {:<20} {}",
                    a.name,
                    if a.has_password { "yes" } else { "no" },
                    humantime::format_rfc3339_seconds(a.created_at),
                    a.revoked_at
                        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
                        .unwrap_or_else(|| "-".into())
                );
            }
        }
        AuditUsersCmd::Revoke { db, name } => {
            let client = connect(&db).await?;
            audit::accounts::revoke(&client, &name).await?;
            println!("auditor {name} revoked: new connections are refused, and their open sessions at every audit endpoint end within seconds");
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn audit_verify(db: &DbArgs, month: &str) -> Result<ExitCode> {
    // Recomputing a month's chain reads all of it in one statement.
    let client = connect_long(db).await?;
    let finding = ::replay::seal::verify(&client, month).await?;
    println!("{finding}");
    Ok(match finding {
        ::replay::seal::Finding::Intact { .. }
        | ::replay::seal::Finding::CheckpointsIntact { .. } => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    })
}
