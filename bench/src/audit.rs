//! `bench audit`: statements per second through the audit endpoint against
//! the same statements sent to PostgreSQL directly, as a ratio, with
//! pgbench and a select-only script (a point lookup of an event by
//! position) on both, in the simple and the extended protocol.
//!
//! Every statement through the endpoint is recorded in the log first (an
//! `audit.query_recorded` append, a durable commit) and runs as the auditor's own
//! read-only role; directly, it runs as the superuser. A third run sends
//! each statement directly after a durable insert of a record of the same
//! size, in a transaction of its own: what recording first costs at the
//! least, without the endpoint. pgbench, the endpoint and PostgreSQL share
//! the same two cores.

use crate::util::{self, round};
use anyhow::{bail, Context, Result};
use events::{Appender, AppenderConfig, ExpectedVersion, NewEvent};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Seconds per pgbench run
    #[arg(long, default_value_t = 20)]
    seconds: u32,
    /// pgbench clients
    #[arg(long, default_value_t = 8)]
    clients: u32,
    /// A short run: 5 s per run
    #[arg(long)]
    quick: bool,
}

const EVENTS: u64 = 10_000;

/// A record the size of the endpoint's for the bench's statement.
const FLOOR_RECORD: &str = r#"{"auditor": "bench", "auth": "password", "client": "127.0.0.1", "session": "0123456789abcdef", "protocol": "extended", "tls": false, "sql": "SELECT position, stream, type FROM strata.events WHERE position = $1", "parameters": ["1234"]}"#;

/// Runs pgbench against `conninfo` for `seconds`; returns its tps.
fn pgbench(
    bindir: &std::path::Path,
    conninfo: &str,
    script: &std::path::Path,
    protocol: &str,
    clients: u32,
    seconds: u32,
    password: Option<&str>,
) -> Result<f64> {
    let mut cmd = std::process::Command::new(bindir.join("pgbench"));
    cmd.args([
        "-n",
        "-M",
        protocol,
        "-c",
        &clients.to_string(),
        "-j",
        "2",
        "-T",
        &seconds.to_string(),
        "-f",
    ])
    .arg(script)
    .arg(conninfo)
    .env_remove("PGPASSWORD");
    if let Some(p) = password {
        cmd.env("PGPASSWORD", p);
    }
    let out = cmd.output().context("run pgbench")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "pgbench failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    text.lines()
        .find_map(|l| {
            l.strip_prefix("tps = ")
                .and_then(|r| r.split_whitespace().next()?.parse::<f64>().ok())
        })
        .with_context(|| format!("no tps in pgbench's output: {text}"))
}

pub async fn run(args: Args) -> Result<()> {
    let seconds = if args.quick { 5 } else { args.seconds };
    eprintln!("starting a private PostgreSQL (fsync on) ...");
    let cluster = tokio::task::spawn_blocking(util::cluster).await??;
    let cfg = util::database(&cluster, "bench").await?;
    let client = events::db::connect(&cfg, "bench").await?;
    let pg_version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    for chunk in 0..EVENTS / 100 {
        let events = (0..100)
            .map(|i| NewEvent::new("bench.event", &serde_json::json!({ "i": chunk * 100 + i })))
            .collect();
        appender
            .append(&format!("bench/{chunk}"), ExpectedVersion::Any, events)
            .await?;
    }
    audit::accounts::add(&client, "bench", Some("bench-secret")).await?;
    let mut ac = audit::AuditConfig::new(cfg.clone());
    ac.max_sessions = u64::from(args.clients) + 4;
    // Every pgbench client is the same auditor.
    ac.max_sessions_per_auditor = u64::from(args.clients);
    let endpoint = audit::start("127.0.0.1:0".parse()?, ac, appender.clone()).await?;
    let dir = tempfile::tempdir()?;
    let lookup = format!(
        "\\set p random(1, {EVENTS})\nSELECT position, stream, type FROM strata.events WHERE position = :p;\n"
    );
    let script = dir.path().join("select.sql");
    std::fs::write(&script, &lookup)?;
    // The least that recording first costs without the endpoint: the same
    // statement, directly, after a durable insert of a record of about the
    // endpoint's size in a transaction of its own.
    client
        .batch_execute(
            "CREATE TABLE public.floor_records (id bigserial PRIMARY KEY, payload jsonb NOT NULL)",
        )
        .await?;
    let floor_script = dir.path().join("floor.sql");
    std::fs::write(
        &floor_script,
        lookup.replacen(
            '\n',
            &format!("\nINSERT INTO public.floor_records (payload) VALUES ('{FLOOR_RECORD}');\n"),
            1,
        ),
    )?;
    let direct = format!(
        "host=127.0.0.1 port={} user=postgres dbname=bench sslmode=disable",
        cluster.port()
    );
    let through = format!(
        "host=127.0.0.1 port={} user=bench dbname=audit sslmode=disable",
        endpoint.addr.port()
    );
    let bindir = cluster.bindir().to_path_buf();
    let mut runs = serde_json::Map::new();
    for protocol in ["simple", "extended"] {
        let (b, s, f, d, t) = (
            bindir.clone(),
            script.clone(),
            floor_script.clone(),
            direct.clone(),
            through.clone(),
        );
        let clients = args.clients;
        let (direct_tps, floor_tps, endpoint_tps) = tokio::task::spawn_blocking(move || {
            let direct = pgbench(&b, &d, &s, protocol, clients, seconds, None)?;
            let floor = pgbench(&b, &d, &f, protocol, clients, seconds, None)?;
            let through = pgbench(&b, &t, &s, protocol, clients, seconds, Some("bench-secret"))?;
            anyhow::Ok((direct, floor, through))
        })
        .await??;
        eprintln!(
            "{protocol}: {direct_tps:.0} statements/s directly, {floor_tps:.0}/s directly each after a durable record, {endpoint_tps:.0}/s through the endpoint ({:.3} of direct, {:.3} of recorded directly)",
            endpoint_tps / direct_tps,
            endpoint_tps / floor_tps
        );
        runs.insert(
            protocol.to_string(),
            serde_json::json!({
                "direct_per_s": round(direct_tps, 1),
                "recorded_directly_per_s": round(floor_tps, 1),
                "endpoint_per_s": round(endpoint_tps, 1),
                "endpoint_over_direct": round(endpoint_tps / direct_tps, 3),
                "recorded_directly_over_direct": round(floor_tps / direct_tps, 3),
                "endpoint_over_recorded_directly": round(endpoint_tps / floor_tps, 3),
            }),
        );
    }
    let recorded: i64 = client
        .query_one(
            "SELECT count(*) FROM strata.events WHERE stream = 'auditor/bench'",
            &[],
        )
        .await?
        .get(0);
    endpoint.stop();
    let result = serde_json::json!({
        "bench": "audit",
        "quick": args.quick,
        "machine": util::machine(&pg_version),
        "seconds_per_run": seconds,
        "clients": args.clients,
        "events": EVENTS,
        "statement": "SELECT position, stream, type FROM strata.events WHERE position = :p (random p)",
        "runs": runs,
        "statements_recorded": recorded,
        "note": "through the endpoint every statement is first recorded as an audit.query_recorded event (a durable append) and runs as the auditor's own read-only role in a read-only transaction; directly it runs as the superuser. 'recorded directly' runs each statement directly after a durable single-row insert of a record of the same size in its own transaction: the least recording first costs without the endpoint. pgbench, the endpoint and PostgreSQL share the same two cores",
    });
    util::finish(if args.quick { "audit-quick" } else { "audit" }, &result)?;
    drop(cluster);
    Ok(())
}
