//! `strata sinks`: deliver events to consumers' webhooks and NATS.

use crate::cli::config;
use crate::cli::connect;
use crate::cli::DbArgs;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Subcommand;
use events::Appender;
use events::AppenderConfig;
use sinks::config::{self, Filter, SinkConfig, Target};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tokio_postgres::Client;

#[derive(Subcommand, Debug)]
pub(crate) enum SinksCmd {
    /// Define a sink: a webhook (--webhook) or NATS JetStream (--nats); processes running the sinks role deliver it
    Create {
        #[command(flatten)]
        db: DbArgs,
        name: String,
        /// A webhook: the receiver's URL (http:// or https://)
        #[arg(long, conflicts_with = "nats", requires = "secret_env")]
        webhook: Option<String>,
        /// The environment variable (in the sinks processes) holding the webhook's HMAC secret; its name must start with STRATA_SINK_SECRET_
        #[arg(long)]
        secret_env: Option<String>,
        /// NATS JetStream: the server's URL (nats://host:port)
        #[arg(long, requires = "subject_prefix")]
        nats: Option<String>,
        /// NATS: subjects are PREFIX.<stream's segments>.<noun>.<verb>, e.g. PREFIX.pool.p1.reservation.placed (a '.', '*', '>', '%' or space inside a token is written %XX)
        #[arg(long)]
        subject_prefix: Option<String>,
        /// NATS: create the JetStream stream for PREFIX.> when none stores it (named after the prefix); without it, a missing stream is an error here rather than parked batches later
        #[arg(long, requires = "nats")]
        create_stream: bool,
        /// Only these event types (comma-separated; default all)
        #[arg(long, value_delimiter = ',')]
        types: Vec<String>,
        /// Only streams starting with these prefixes (comma-separated; default all)
        #[arg(long, value_delimiter = ',')]
        prefixes: Vec<String>,
        /// Where to start: start, now or a position
        #[arg(long, default_value = "start")]
        from: String,
        /// Most events in one POST
        #[arg(long, default_value_t = 500)]
        batch: usize,
        /// Attempts before a batch is parked
        #[arg(long, default_value_t = 8)]
        attempts: u32,
        /// The first wait between attempts; each later one doubles, up to --retry-cap, and is drawn between half and all of that (default 500ms: with 8 attempts a batch is retried for 22 s to 45 s)
        #[arg(long, value_parser = humantime::parse_duration)]
        retry_base: Option<std::time::Duration>,
        /// The longest wait between attempts (default 10s)
        #[arg(long, value_parser = humantime::parse_duration)]
        retry_cap: Option<std::time::Duration>,
    },
    /// List sinks with their state and lag
    List {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Stop delivering (the cursor stays)
    Pause {
        #[command(flatten)]
        db: DbArgs,
        name: String,
    },
    /// Deliver again from where it stopped
    Resume {
        #[command(flatten)]
        db: DbArgs,
        name: String,
    },
    /// Remove a sink; deleting a deleted sink does nothing (exit 0), and its name can be used again by `create`
    Delete {
        #[command(flatten)]
        db: DbArgs,
        name: String,
    },
    /// Show a sink's definition, state, cursor and lag
    Show {
        #[command(flatten)]
        db: DbArgs,
        name: String,
    },
    /// Move a paused sink's cursor: deliver again after a position, or from a time (RFC 3339)
    Reset {
        #[command(flatten)]
        db: DbArgs,
        name: String,
        /// A position, or a time such as 2026-11-30T10:00:00Z
        #[arg(long)]
        to: String,
    },
    /// Parked events: list them, or deliver them again
    #[command(subcommand)]
    Parked(ParkedCmd),
}

#[derive(Subcommand, Debug)]
pub(crate) enum ParkedCmd {
    List {
        #[command(flatten)]
        db: DbArgs,
        name: String,
    },
    /// Deliver a sink's parked events again, in order (the secret is read from the sink's environment variable here)
    Replay {
        #[command(flatten)]
        db: DbArgs,
        name: String,
        /// PEM certificates to trust for an https:// webhook besides the system's roots
        #[arg(long, env = "STRATA_WEBHOOK_CA", value_name = "FILE")]
        webhook_ca: Option<PathBuf>,
        /// The region's name, as `strata serve --region` has it (NATS message ids)
        #[arg(long, env = "STRATA_REGION", default_value = "default")]
        region: String,
    },
}

pub(crate) async fn sinks(cmd: SinksCmd) -> Result<ExitCode> {
    match cmd {
        SinksCmd::Create {
            db,
            name,
            webhook,
            secret_env,
            nats,
            subject_prefix,
            types,
            prefixes,
            from,
            batch,
            attempts,
            create_stream,
            retry_base,
            retry_cap,
        } => {
            let target = match (webhook, nats) {
                (Some(url), None) => Target::Webhook {
                    url,
                    secret_env: secret_env.unwrap_or_default(),
                },
                (None, Some(url)) => Target::Nats {
                    url,
                    subject_prefix: subject_prefix.unwrap_or_default(),
                },
                _ => bail!("say where the sink delivers: --webhook URL --secret-env VAR, or --nats URL --subject-prefix P"),
            };
            let c = SinkConfig {
                name,
                target,
                filter: Filter { types, prefixes },
                start: from,
                batch_max: batch,
                max_attempts: attempts,
                retry: (retry_base.is_some() || retry_cap.is_some()).then(|| {
                    let d = config::Retry::default();
                    config::Retry {
                        base_ms: retry_base.map_or(d.base_ms, |b| b.as_millis() as u64),
                        cap_ms: retry_cap.map_or(d.cap_ms, |c| c.as_millis() as u64),
                    }
                }),
                credentials: false,
            };
            create(&db, c, create_stream).await?;
        }
        SinksCmd::List { db } => list(&db).await?,
        SinksCmd::Pause { db, name } => match change(&db, name, sinks::catalog::SINK_PAUSED).await?
        {
            (name, true) => println!("paused {name}"),
            (name, false) => println!("{name} was paused already"),
        },
        SinksCmd::Resume { db, name } => {
            match change(&db, name, sinks::catalog::SINK_RESUMED).await? {
                (name, true) => println!("resumed {name}"),
                (name, false) => println!("{name} was not paused"),
            }
        }
        SinksCmd::Delete { db, name } => {
            match change(&db, name, sinks::catalog::SINK_DELETED).await? {
                (name, true) => println!("deleted {name}"),
                (name, false) => println!("{name} was deleted already"),
            }
        }
        SinksCmd::Show { db, name } => show(&db, &name).await?,
        SinksCmd::Reset { db, name, to } => reset(&db, &name, &to).await?,
        SinksCmd::Parked(ParkedCmd::List { db, name }) => parked_list(&db, &name).await?,
        SinksCmd::Parked(ParkedCmd::Replay {
            db,
            name,
            webhook_ca,
            region,
        }) => parked_replay(&db, &name, webhook_ca.as_deref(), &region).await?,
    }
    Ok(ExitCode::SUCCESS)
}

/// A sink by name, or "not found".
async fn find(client: &Client, name: &str) -> Result<config::SinkState> {
    config::list(client)
        .await?
        .into_iter()
        .find(|s| s.config.name == name)
        .ok_or_else(|| crate::exit::not_found(format!("sink {name:?} does not exist")))
}

/// Pauses, resumes or deletes a sink: its name, and whether it changed.
async fn change(db: &DbArgs, name: String, t: &'static str) -> Result<(String, bool)> {
    let client = connect(db).await?;
    let appender = Appender::start(config(db)?, AppenderConfig::default());
    match config::apply(&client, &appender, &name, t).await {
        Ok(changed) => Ok((name, changed)),
        Err(config::SinkError::NotFound(n)) => {
            Err(crate::exit::not_found(format!("sink {n:?} does not exist")))
        }
        Err(e) => Err(e.into()),
    }
}

/// `strata sinks create`: checks the sink, makes sure a NATS target has its
/// stream, and records it.
async fn create(db: &DbArgs, c: SinkConfig, create_stream: bool) -> Result<()> {
    c.validate().map_err(anyhow::Error::msg)?;
    if let Target::Nats {
        url,
        subject_prefix,
    } = &c.target
    {
        let (stream, created) = sinks::nats::ensure_stream(url, subject_prefix, create_stream)
            .await
            .map_err(anyhow::Error::msg)?;
        if created {
            eprintln!("created the JetStream stream {stream} for {subject_prefix}.>");
        } else {
            eprintln!("JetStream stream {stream} stores {subject_prefix}.>");
        }
    }
    let mut client = connect(db).await?;
    config::create_in(&mut client, &c).await?;
    println!(
        "created sink {}; processes running `serve --roles sinks` deliver it",
        c.name
    );
    Ok(())
}

/// `strata sinks list`: every sink with its lag and parked events.
async fn list(db: &DbArgs) -> Result<()> {
    let client = connect(db).await?;
    let head = events::read::head(&client).await?.0;
    if !crate::exit::json() {
        println!(
            "{:<20} {:<8} {:>12} {:>10} {:>8}  TARGET",
            "SINK", "STATE", "LAG EVENTS", "LAG S", "PARKED"
        );
    }
    for mut s in config::list(&client).await? {
        s.config = s.config.printable();
        let cursor = config::cursor(&client, &s.config.name).await?;
        let parked = sinks::parked::count(&client, &s.config.name).await?;
        let url = match &s.config.target {
            Target::Webhook { url, .. } => url.clone(),
            Target::Nats {
                url,
                subject_prefix,
            } => format!("{url} {subject_prefix}.>"),
        };
        // The age of the oldest event the sink has not acknowledged.
        let lag_s: Option<f64> = match cursor {
            Some(c) if c < head => events::read::age(&client, events::Position(c + 1)).await?,
            Some(_) => Some(0.0),
            None => None,
        };
        let lag_events = cursor.map(|c| head.saturating_sub(c));
        if crate::exit::json() {
            crate::exit::print_json(&serde_json::json!({
                "name": s.config.name,
                "paused": s.paused,
                "cursor": cursor,
                "lag_events": lag_events,
                "lag_seconds": lag_s,
                "parked": parked,
                "target": url,
                "config": s.config,
            }));
            continue;
        }
        println!(
            "{:<20} {:<8} {:>12} {:>10} {:>8}  {url}",
            s.config.name,
            if s.paused { "paused" } else { "active" },
            lag_events.map_or("not started".into(), |l| l.to_string()),
            lag_s.map_or("-".into(), |l| format!("{l:.1}")),
            parked
        );
    }
    Ok(())
}

/// `strata sinks show`.
async fn show(db: &DbArgs, name: &str) -> Result<()> {
    let client = connect(db).await?;
    let s = find(&client, name).await?;
    let head = events::read::head(&client).await?.0;
    let cursor = config::cursor(&client, name).await?;
    let parked = sinks::parked::count(&client, name).await?;
    let shown = serde_json::json!({
            "config": s.config.printable(),
            "paused": s.paused,
            "cursor": cursor,
            "lag_events": cursor.map(|c| head.saturating_sub(c)),
            "parked": parked,
    });
    if crate::exit::json() {
        crate::exit::print_json(&shown);
    } else {
        println!("{}", serde_json::to_string_pretty(&shown)?);
    }
    Ok(())
}

/// `strata sinks reset`: moves a sink to a position, or to just before a time.
async fn reset(db: &DbArgs, name: &str, to: &str) -> Result<()> {
    let mut client = connect(db).await?;
    let position = match to.parse::<u64>() {
        Ok(p) => p,
        Err(_) => {
            let t = humantime::parse_rfc3339_weak(to).map_err(|_| {
                anyhow::anyhow!("--to {to:?}: a position (a whole number) or a time such as 2026-11-30T10:00:00Z")
            })?;
            events::read::position_before(&client, t).await?.0
        }
    };
    config::reset(&mut client, name, position).await?;
    println!(
        "sink {name} now stands at position {position}; it delivers what follows when resumed"
    );
    Ok(())
}

/// `strata sinks parked list`.
async fn parked_list(db: &DbArgs, name: &str) -> Result<()> {
    let client = connect(db).await?;
    let list = sinks::parked::list(&client, name).await?;
    if crate::exit::json() {
        for p in &list {
            crate::exit::print_json(&serde_json::to_value(p)?);
        }
        return Ok(());
    }
    println!(
        "{:>10} {:<24} {:<24} {:>8}  ERROR",
        "POSITION", "STREAM", "TYPE", "ATTEMPTS"
    );
    for p in list {
        println!(
            "{:>10} {:<24} {:<24} {:>8}  {}",
            p.position, p.stream, p.event_type, p.attempts, p.error
        );
    }
    Ok(())
}

/// `strata sinks parked replay`: delivers a sink's parked events again.
async fn parked_replay(
    db: &DbArgs,
    name: &str,
    webhook_ca: Option<&Path>,
    region: &str,
) -> Result<()> {
    let client = connect(db).await?;
    let sink = find(&client, name).await?;
    let config = sink.config.with_credentials(&client).await?;
    let n = match &config.target {
        Target::Webhook { url, secret_env } => {
            sinks::config::check_secret_env(secret_env).map_err(anyhow::Error::msg)?;
            let secret = std::env::var(secret_env)
                .with_context(|| format!("the sink's secret: set {secret_env} here"))?;
            let http = sinks::webhook::client(webhook_ca).map_err(anyhow::Error::msg)?;
            sinks::parked::replay(&client, &http, name, url, secret.as_bytes()).await
        }
        Target::Nats {
            url,
            subject_prefix,
        } => sinks::parked::replay_nats(&client, name, region, url, subject_prefix).await,
    }
    .map_err(anyhow::Error::msg)?;
    println!("delivered {n} parked event(s) of {name}");
    Ok(())
}
