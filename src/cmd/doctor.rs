//! `strata doctor`: the log's checks of a database, printed with what to
//! do about each.

use crate::cli::connect_direct;
use crate::cli::DbArgs;
use anyhow::Context;
use anyhow::Result;
use std::process::ExitCode;
use std::time::Duration;

/// `strata doctor`: the database's findings, as text or JSON; exit 1 on a
/// problem.
pub(crate) async fn doctor(db: &DbArgs, json: bool, stale_after: Duration) -> Result<ExitCode> {
    use events::doctor::Status;
    let client = connect_direct(db).await?;
    let findings = events::doctor::examine(&client, stale_after)
        .await
        .context("examine the database")?;
    let count = |s: Status| findings.iter().filter(|f| f.status == s).count();
    let (problems, warnings) = (count(Status::Problem), count(Status::Warning));
    if json || crate::exit::json() {
        println!(
            "{}",
            serde_json::json!({
                "ok": problems == 0,
                "problems": problems,
                "warnings": warnings,
                "findings": findings,
            })
        );
    } else {
        for f in &findings {
            let tag = match f.status {
                Status::Ok => "ok",
                Status::Warning => "WARNING",
                Status::Problem => "PROBLEM",
            };
            println!("{tag:<8} {:<24} {}", f.check, f.detail);
            if !f.advice.is_empty() {
                println!("{:<8} {:<24} -> {}", "", "", f.advice);
            }
        }
        println!("{problems} problem(s), {warnings} warning(s)");
    }
    Ok(if problems > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
