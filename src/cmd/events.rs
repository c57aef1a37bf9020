//! `strata events`: append an event, follow the log, and the event
//! reference (`types`, `check`) from every crate's catalog.

use crate::cli::config;
use crate::cli::connect;
use crate::cli::DbArgs;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Subcommand;
use events::catalog::conforms;
use events::catalog::req;
use events::catalog::EventSpec;
use events::catalog::Ty;
use events::db::Sql;
use events::Appender;
use events::AppenderConfig;
use events::ExpectedVersion;
use events::NewEvent;
use events::Reader;
use events::ReaderConfig;
use events::Start;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Subcommand, Debug)]
pub(crate) enum EventsCmd {
    /// The event reference: every event type Strata writes, its stream and its payload's fields (docs/events.md is `--markdown`)
    Types {
        /// One JSON object per type: {type, stream, written_by, about, formerly, fields: [{name, type, optional, about}]}
        #[arg(long, conflicts_with = "markdown")]
        json: bool,
        /// The reference page in Markdown
        #[arg(long)]
        markdown: bool,
    },
    /// Check the stored log against the event reference: every event's type is known, it is on the stream its type goes to, and its payload has the fields its type declares, of their types. Exits 1 on a problem
    Check {
        #[command(flatten)]
        db: DbArgs,
        /// Only events after this position
        #[arg(long, default_value_t = 0)]
        after: i64,
        /// Types the reference does not know (appended with `events append`, say) are counted, not a problem
        #[arg(long)]
        allow_unknown: bool,
        /// One JSON object: {ok, checked, types: {type: n}, unknown_types: {type: n}, problems: [{position, problem}]}
        #[arg(long)]
        json: bool,
    },
    /// Append one event to a stream
    Append {
        #[command(flatten)]
        db: DbArgs,
        /// The stream, e.g. pool/p1
        #[arg(long)]
        stream: String,
        /// The event type, e.g. pool.created
        #[arg(long = "type")]
        event_type: String,
        /// The payload: a JSON object
        #[arg(long)]
        data: String,
        /// The event's metadata: a JSON object, e.g. '{"operator":"ana"}' or '{"payload_version":2}' for a payload in a newer version of its type's shape
        #[arg(long)]
        metadata: Option<String>,
        /// Expected stream version: a number (0 = new stream), `any`, or `exists`
        #[arg(long, default_value = "any")]
        expect: String,
    },
    /// Print events as JSON lines: history, then live
    Tail {
        #[command(flatten)]
        db: DbArgs,
        /// Where to start: `start`, `now` or a position (ignored when a named subscription already exists)
        #[arg(long, default_value = "now")]
        from: String,
        /// A durable subscription: resumes after its last acknowledged event
        #[arg(long)]
        subscription: Option<String>,
        /// Exit after printing this many events
        #[arg(long)]
        limit: Option<u64>,
        /// How long a subscription held by a tail that died stays unavailable
        #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
        lease_ttl: std::time::Duration,
    },
}

pub(crate) fn parse_expect(s: &str) -> Result<ExpectedVersion> {
    Ok(match s {
        "any" => ExpectedVersion::Any,
        "none" | "new" => ExpectedVersion::NoStream,
        "exists" => ExpectedVersion::StreamExists,
        n => ExpectedVersion::Exact(n.parse().with_context(|| {
            format!("invalid --expect {n:?}: use a version number, `any`, `none` or `exists`")
        })?),
    })
}

pub(crate) async fn events(cmd: EventsCmd) -> Result<ExitCode> {
    match cmd {
        EventsCmd::Types { json, markdown } => return types(json, markdown),
        EventsCmd::Check {
            db,
            after,
            allow_unknown,
            json,
        } => return check(&db, after, allow_unknown, json).await,
        EventsCmd::Append {
            db,
            stream,
            event_type,
            data,
            metadata,
            expect,
        } => {
            let expected = parse_expect(&expect)?;
            let mut event = NewEvent::from_json(event_type, &data)
                .map_err(|e| anyhow::anyhow!("invalid --data: {e}"))?;
            if let Some(m) = metadata {
                let m: serde_json::Value =
                    serde_json::from_str(&m).context("invalid --metadata: not JSON")?;
                if !m.is_object() {
                    bail!("invalid --metadata: a JSON object, e.g. '{{\"operator\":\"ana\"}}'");
                }
                event = event.with_metadata(&m);
            }
            let appender = Appender::start(
                config(&db)?,
                AppenderConfig {
                    connections: 1,
                    ..AppenderConfig::default()
                },
            );
            let out = appender.append(&stream, expected, vec![event]).await?;
            println!(
                "{}",
                serde_json::json!({"stream": out.stream, "version": out.version, "position": out.last_position.0})
            );
        }
        EventsCmd::Tail {
            db,
            from,
            subscription,
            limit,
            lease_ttl,
        } => {
            let start: Start = from.parse().map_err(|e: String| anyhow::anyhow!(e))?;
            tail(&db, start, subscription.as_deref(), limit, lease_ttl).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn tail(
    db: &DbArgs,
    start: Start,
    subscription: Option<&str>,
    limit: Option<u64>,
    lease_ttl: Duration,
) -> Result<()> {
    let cfg = config(db)?;
    // Check the connection and schema up front for a clear error.
    let client = connect(db).await?;
    client
        .one("SELECT 1 FROM strata.log_head", &[])
        .await
        .context("read the log (has `strata migrate` been run?)")?;
    let mut rc = ReaderConfig::new(format!("strata_tail_{}", std::process::id()));
    rc.temporary = true;
    rc.owner = "strata events tail".into();
    rc.subscription_lease_ttl = lease_ttl;
    let reader = Reader::start(cfg, rc);
    let mut sub = match subscription {
        Some(name) => {
            // Another tail may hold it, or one that died may still hold it
            // until its lease runs out: wait for it, and say so.
            let mut told = false;
            reader
                .subscribe_waiting(name, start, lease_ttl * 4, |e| {
                    if !told {
                        eprintln!("waiting: {e}");
                        told = true;
                    }
                })
                .await?
        }
        None => reader.subscribe_ephemeral_as("events-tail", start).await?,
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut printed = 0u64;
    let mut last = None;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        if limit.is_some_and(|l| printed >= l) {
            break;
        }
        let next = tokio::select! {
            e = sub.next() => match e {
                // Lines already printed came from a primary that died before
                // its standby had them: say so and go on with the new one.
                Err(e @ events::SubscribeError::Diverged { .. }) => {
                    out.flush().context("write to stdout")?;
                    eprintln!("warning: {e}");
                    continue;
                }
                e => e?,
            },
            _ = &mut ctrl_c => break,
            // Flush what is printed while waiting for more.
            _ = tokio::time::sleep(Duration::from_millis(50)), if last.is_some() => {
                out.flush().context("write to stdout")?;
                if let Some(p) = last.take() { sub.ack(p); }
                continue;
            }
        };
        writeln!(out, "{}", next.to_json_line()).context("write to stdout")?;
        printed += 1;
        last = Some(next.position);
        // Acknowledge only what reached stdout: flush, then ack, in steps.
        if printed.is_multiple_of(256) {
            out.flush().context("write to stdout")?;
            sub.ack(next.position);
            last = None;
        }
    }
    out.flush().context("write to stdout")?;
    if let Some(p) = last {
        sub.ack(p);
    }
    sub.close().await?;
    Ok(())
}

/// `demo.ticked`: see [`DEV`].
pub(crate) const DEMO_TICKED: &str = "demo.ticked";

/// What `strata dev`'s demonstration writer appends.
pub(crate) const DEV: &[EventSpec] = &[EventSpec {
    event_type: DEMO_TICKED,
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
pub(crate) fn all() -> Vec<EventSpec> {
    [
        domain::fact::EVENTS,
        domain::commands::EVENTS,
        domain::usage::EVENTS,
        gateway::catalog::EVENTS,
        sinks::catalog::EVENTS,
        audit::catalog::EVENTS,
        DEV,
    ]
    .concat()
}

/// `strata events types`.
pub(crate) fn types(json: bool, markdown: bool) -> Result<ExitCode> {
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
pub(crate) async fn check(
    db: &DbArgs,
    after: i64,
    allow_unknown: bool,
    json: bool,
) -> Result<ExitCode> {
    let client = connect(db).await?;
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
