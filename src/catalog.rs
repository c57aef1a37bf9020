//! `strata events types` and `strata events check`: the event reference
//! (every crate's `EVENTS`, see `events::catalog`) printed as a table, JSON
//! or the Markdown of `docs/events.md`, and a stored log checked against it.

use crate::Db;
use anyhow::{Context, Result};
use events::catalog::{conforms, req, EventSpec, Ty};
use events::db::Sql;
use std::collections::BTreeMap;
use std::process::ExitCode;

/// What `strata dev`'s demonstration writer appends.
const DEV: &[EventSpec] = &[EventSpec {
    event_type: "demo.ticked",
    stream: "demo/<writer>",
    written_by: "`strata dev` (its demonstration writer)",
    about: "One tick of the demonstration workload; nothing reads it.",
    fields: &[
        req("n", Ty::Integer, "The tick's number."),
        req("writer", Ty::Integer, "The writer's number."),
    ],
    formerly: &["demo.tick"],
}];

/// Every event type Strata writes.
pub fn all() -> Vec<EventSpec> {
    [
        projections::catalog::EVENTS,
        gateway::catalog::EVENTS,
        sinks::catalog::EVENTS,
        replay::catalog::EVENTS,
        DEV,
    ]
    .concat()
}

/// `strata events types`.
pub fn types(json: bool, markdown: bool) -> Result<ExitCode> {
    let all = all();
    if markdown {
        print!("{}", events::catalog::markdown(&all));
    } else if json || crate::exit::json() {
        for spec in events::catalog::json(&all) {
            println!("{spec}");
        }
    } else {
        let mut sorted: Vec<_> = all.iter().collect();
        sorted.sort_by_key(|s| s.event_type);
        println!("{:<32} {:<24} FIELDS", "TYPE", "STREAM");
        for s in sorted {
            let fields: Vec<String> = s
                .fields
                .iter()
                .map(|f| format!("{}{}", f.name, if f.optional { "?" } else { "" }))
                .collect();
            let stream = s.stream.split(' ').next().unwrap_or(s.stream);
            println!("{:<32} {:<24} {}", s.event_type, stream, fields.join(" "));
        }
    }
    std::io::Write::flush(&mut std::io::stdout()).ok();
    Ok(ExitCode::SUCCESS)
}

/// `strata events check`: every stored event (from `after`) against the
/// reference. Exits 1 when one does not conform.
pub async fn check(db: &Db, after: i64, allow_unknown: bool, json: bool) -> Result<ExitCode> {
    let client = crate::commands::connect(db).await?;
    let all = all();
    let mut checked = 0u64;
    let mut by_type: BTreeMap<String, u64> = BTreeMap::new();
    let mut unknown: BTreeMap<String, u64> = BTreeMap::new();
    let mut problems: Vec<serde_json::Value> = Vec::new();
    let mut from = after;
    loop {
        let rows = client
            .rows(
                "SELECT position, stream, type, payload::text FROM strata.events
                  WHERE position > $1 ORDER BY position LIMIT 10000",
                &[&from],
            )
            .await
            .context("read the log")?;
        let Some(last) = rows.last() else { break };
        from = last.get(0);
        for r in &rows {
            let position: i64 = r.get(0);
            let stream: &str = r.get(1);
            let t: &str = r.get(2);
            let payload: serde_json::Value =
                serde_json::from_str(r.get(3)).unwrap_or(serde_json::Value::Null);
            checked += 1;
            if !all
                .iter()
                .any(|s| s.event_type == t || s.formerly.contains(&t))
            {
                *unknown.entry(t.to_string()).or_default() += 1;
                continue;
            }
            *by_type.entry(t.to_string()).or_default() += 1;
            if let Err(e) = conforms(&all, t, stream, &payload) {
                if problems.len() < 100 {
                    problems.push(serde_json::json!({"position": position, "problem": e}));
                }
            }
        }
    }
    let failed = !problems.is_empty() || (!allow_unknown && !unknown.is_empty());
    if json || crate::exit::json() {
        println!(
            "{}",
            serde_json::json!({
                "ok": !failed,
                "checked": checked,
                "types": by_type,
                "unknown_types": unknown,
                "problems": problems,
            })
        );
    } else {
        for p in &problems {
            println!(
                "position {}: {}",
                p["position"],
                p["problem"].as_str().unwrap_or("")
            );
        }
        for (t, n) in &unknown {
            println!(
                "{n} event(s) of type {t}, which is not in the reference{}",
                if allow_unknown { " (allowed)" } else { "" }
            );
        }
        println!(
            "checked {checked} events of {} known types: {} problem(s)",
            by_type.len(),
            problems.len()
        );
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
