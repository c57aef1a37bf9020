//! `strata migrate`: the schema migrations a database does not have yet,
//! planned and applied.

use crate::cli::connect_long;
use crate::cli::DbArgs;
use anyhow::Context;
use anyhow::Result;
use clap::Args;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Change nothing: say which migrations would be applied (expand or contract, their statements), which running Strata processes know which schema, and whether they stay compatible. Exits 1 when this binary may not run against the database or a migration would wait
    #[arg(long)]
    check: bool,
    /// With --check: one JSON object {known, database, runnable, refused, unknown, pending: [{version, name, change, needs, statements, blocked_by}], processes}
    #[arg(long, requires = "check")]
    json: bool,
}

pub(crate) async fn migrate(args: &MigrateArgs) -> Result<ExitCode> {
    let mut client = connect_long(&args.db).await?;
    if args.check {
        let plan = schema::migrate::plan(&client, schema::MIGRATIONS)
            .await
            .context("plan the migrations")?;
        let waits = plan.pending.iter().any(|p| !p.blocked_by.is_empty());
        if args.json || crate::exit::json() {
            println!("{}", serde_json::to_string(&plan)?);
        } else {
            print_plan(&plan);
        }
        return Ok(if plan.runnable && !waits {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    let applied = schema::migrate(&mut client).await.context("migrate")?;
    if applied.is_empty() {
        println!("schema is up to date");
    } else {
        println!("applied migrations {applied:?}");
    }
    // What is left waits for older processes: say who.
    let plan = schema::migrate::plan(&client, schema::MIGRATIONS)
        .await
        .context("plan the migrations")?;
    if let Some(p) = plan.pending.first() {
        println!(
            "migration {} ({}) contracts the schema and waits until no running process knows less than schema {}:",
            p.version,
            p.name,
            p.needs.unwrap_or(p.version)
        );
        for proc in &p.blocked_by {
            println!("  {proc}");
        }
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn print_plan(plan: &schema::migrate::Plan) {
    println!(
        "this binary knows schema {}; the database is at {}",
        plan.known, plan.database
    );
    match &plan.refused {
        Some(why) => println!("this binary may NOT run against it: {why}"),
        None => println!("this binary may run against it"),
    }
    for u in &plan.unknown {
        println!(
            "  applied by a newer binary: {} ({}), {}",
            u.version,
            u.name,
            match u.needs {
                Some(n) => format!("contracts: needs binaries that know schema {n}"),
                None => "expands: older binaries keep running".into(),
            }
        );
    }
    if plan.pending.is_empty() {
        println!("nothing to apply");
    }
    for p in &plan.pending {
        let verdict = match (p.needs, p.blocked_by.is_empty()) {
            (None, _) => "expands: the running processes stay compatible".to_string(),
            (Some(n), true) => {
                format!("contracts (needs schema {n}): no running process knows less")
            }
            (Some(n), false) => format!(
                "contracts (needs schema {n}): WAITS for {} running process(es) that know less",
                p.blocked_by.len()
            ),
        };
        println!("would apply {} ({}): {verdict}", p.version, p.name);
        for st in &p.statements {
            println!("    {st}");
        }
        for proc in &p.blocked_by {
            println!("    waits for {proc}");
        }
    }
    if plan.processes.is_empty() {
        println!("running Strata processes: none seen");
    } else {
        println!("running Strata processes:");
        for proc in &plan.processes {
            println!("  {proc}");
        }
    }
}
