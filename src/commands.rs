//! The one-shot commands and `serve`: each connects, calls into the crates and
//! prints the result.

use crate::{Db, EventsCmd, PartitionsCmd, ServeArgs, SlotsCmd};
use anyhow::{bail, Context, Result};
use events::db::Sql;
use events::{Appender, AppenderConfig, ExpectedVersion, NewEvent, Reader, ReaderConfig, Start};
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

/// The database the command names: libpq's URL or `key=value` string, TLS
/// settings (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`) included.
pub fn config(db: &Db) -> Result<events::db::Database> {
    let main = events::db::Database::parse(&db.database_url)
        .map_err(anyhow::Error::msg)
        .context("parse the database URL (expected e.g. postgres://user@host:5432/dbname or 'host=db dbname=strata')")?;
    let cfg = match &db.database_direct_url {
        Some(direct) => main.through_pooler(
            events::db::Database::parse(direct)
                .map_err(anyhow::Error::msg)
                .context("parse --database-direct-url")?,
        ),
        None => main,
    };
    Ok(cfg.with_statement_timeout(Some(db.statement_timeout)))
}

/// A connection to PostgreSQL itself (`--database-direct-url` when the
/// main URL goes through a pooler): for the migration lock and the checks
/// of the server.
pub async fn connect_direct(db: &Db) -> Result<tokio_postgres::Client> {
    let cfg = config(db)?;
    events::db::connect(cfg.direct(), "cli-direct-connection")
        .await
        .context("connect to postgres (directly)")
}

/// A connection to PostgreSQL itself whose statements may take as long as
/// they need: migrations (an index over a big table), exports.
pub async fn connect_long(db: &Db) -> Result<tokio_postgres::Client> {
    let cfg = config(db)?.with_statement_timeout(None);
    events::db::connect(cfg.direct(), "cli-long-connection")
        .await
        .context("connect to postgres (directly)")
}

pub async fn connect(db: &Db) -> Result<tokio_postgres::Client> {
    let cfg = config(db)?;
    events::db::connect(&cfg, "cli-connection")
        .await
        .context("connect to postgres")
}

pub async fn migrate(args: &crate::MigrateArgs) -> Result<ExitCode> {
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

fn print_plan(plan: &schema::migrate::Plan) {
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

pub async fn partitions(cmd: PartitionsCmd) -> Result<ExitCode> {
    match cmd {
        PartitionsCmd::Ensure { db, months_ahead } => {
            if !(0..=120).contains(&months_ahead) {
                bail!("--months-ahead must be between 0 and 120");
            }
            let client = connect(&db).await?;
            let n = schema::partitions::ensure(&client, months_ahead, SystemTime::now())
                .await
                .context("ensure partitions")?;
            println!("created {n} partition(s); {months_ahead} month(s) ahead are in place");
        }
        PartitionsCmd::Export { db, month, out } => {
            let client = connect_long(&db).await?;
            let (bytes, rows) = ::replay::archive::export(&client, &month).await?;
            let tmp = out.with_extension("tmp");
            std::fs::write(&tmp, &bytes).with_context(|| format!("write {}", tmp.display()))?;
            std::fs::rename(&tmp, &out).with_context(|| format!("write {}", out.display()))?;
            ::replay::archive::record_export(&client, &month, &out, rows, &bytes).await?;
            println!(
                "exported {rows} rows of {month} to {} ({} bytes)",
                out.display(),
                bytes.len()
            );
        }
        PartitionsCmd::Retire {
            db,
            older_than,
            dry_run,
        } => {
            let months: u32 = older_than
                .strip_suffix("mo")
                .and_then(|m| m.parse().ok())
                .filter(|m| *m >= 1)
                .with_context(|| {
                    format!("--older-than {older_than:?}: a number of months such as 13mo")
                })?;
            let client = connect_long(&db).await?;
            let done = ::replay::archive::retire(&client, months, dry_run).await?;
            let mut refused = 0;
            for r in &done {
                match &r.refused {
                    None if dry_run => println!("{}: would be dropped", r.partition),
                    None => println!("{}: detached and dropped", r.partition),
                    Some(why) => {
                        refused += 1;
                        println!("{}: kept, {why}", r.partition);
                    }
                }
            }
            if done.is_empty() {
                println!("no month is older than {months} months");
            }
            if refused > 0 {
                return Ok(ExitCode::from(1));
            }
        }
        PartitionsCmd::Seal { db, month } => {
            let client = connect(&db).await?;
            let s = ::replay::seal::seal(&client, &month).await?;
            println!(
                "sealed {}: {} rows (positions {} to {}), chain {}",
                s.partition,
                s.rows,
                s.first_position.map_or("-".into(), |p| p.to_string()),
                s.last_position.map_or("-".into(), |p| p.to_string()),
                s.chain
            );
        }
        PartitionsCmd::List { db } => {
            let client = connect(&db).await?;
            let parts = schema::partitions::list(&client)
                .await
                .context("list partitions")?;
            if crate::exit::json() {
                for p in &parts {
                    crate::exit::print_json(&serde_json::json!({
                        "partition": p.name, "rows": p.rows, "bytes": p.bytes, "bounds": p.bounds,
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!("{:<18} {:>12} {:>12}  BOUNDS", "PARTITION", "ROWS", "SIZE");
            for p in parts {
                println!(
                    "{:<18} {:>12} {:>12}  {}",
                    p.name,
                    p.rows,
                    human_bytes(p.bytes),
                    p.bounds
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn human_bytes(b: i64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v.abs() >= 1024.0 && i < units.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

fn parse_expect(s: &str) -> Result<ExpectedVersion> {
    Ok(match s {
        "any" => ExpectedVersion::Any,
        "none" | "new" => ExpectedVersion::NoStream,
        "exists" => ExpectedVersion::StreamExists,
        n => ExpectedVersion::Exact(n.parse().with_context(|| {
            format!("invalid --expect {n:?}: use a version number, `any`, `none` or `exists`")
        })?),
    })
}

pub async fn events(cmd: EventsCmd) -> Result<ExitCode> {
    match cmd {
        EventsCmd::Types { json, markdown } => return crate::catalog::types(json, markdown),
        EventsCmd::Check {
            db,
            after,
            allow_unknown,
            json,
        } => return crate::catalog::check(&db, after, allow_unknown, json).await,
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

async fn tail(
    db: &Db,
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

/// `strata doctor`: the database's findings, as text or JSON; exit 1 on a
/// problem.
pub async fn doctor(db: &Db, json: bool, stale_after: Duration) -> Result<ExitCode> {
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

pub async fn slots(cmd: SlotsCmd) -> Result<ExitCode> {
    match cmd {
        SlotsCmd::List { db, stale_after } => {
            let client = connect(&db).await?;
            let slots = events::slots::list(&client, stale_after)
                .await
                .context("list replication slots")?;
            if crate::exit::json() {
                for s in &slots {
                    crate::exit::print_json(&serde_json::json!({
                        "slot": s.name,
                        "plugin": s.plugin,
                        "active": s.active,
                        "temporary": s.temporary,
                        "owner": s.owner,
                        "owner_seen_seconds": s.owner_seen_secs,
                        "lag_bytes": s.lag_bytes,
                        "retained_bytes": s.retained_bytes,
                        "wal_status": s.wal_status,
                        "stale": s.stale,
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{:<28} {:<7} {:<34} {:>10} {:>12} {:>12} {:<10}",
                "SLOT", "ACTIVE", "OWNER", "SEEN", "LAG", "RETAINED", "WAL"
            );
            for s in slots {
                println!(
                    "{:<28} {:<7} {:<34} {:>10} {:>12} {:>12} {:<10}{}",
                    s.name,
                    if s.active { "yes" } else { "no" },
                    s.owner.as_deref().unwrap_or("-"),
                    s.owner_seen_secs
                        .map_or("-".into(), |v| format!("{v:.0}s ago")),
                    s.lag_bytes.map_or("-".into(), human_bytes),
                    s.retained_bytes.map_or("-".into(), human_bytes),
                    s.wal_status.as_deref().unwrap_or("-"),
                    if s.stale {
                        "  STALE: owner gone; `strata slots drop` frees its WAL"
                    } else {
                        ""
                    },
                );
            }
        }
        SlotsCmd::Drop { db, name, force } => {
            let client = connect(&db).await?;
            events::slots::drop_slot(&client, &name, force).await?;
            println!("dropped slot {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Migrates, keeps partitions ahead, runs the replication reader and serves
/// metrics until Ctrl-C.
pub async fn serve(args: ServeArgs) -> Result<ExitCode> {
    let cfg = config(&args.db)?;
    let mut client = connect_long(&args.db).await?;
    schema::migrate(&mut client).await.context("migrate")?;
    let me = Registration::start(&cfg, &args.roles.join(","));
    // Not fatal: a long-running reader can hold creation off (it gives up
    // after a lock timeout), and the reader keeps months ahead from now on.
    if let Err(e) = schema::partitions::ensure(
        &client,
        schema::partitions::DEFAULT_MONTHS_AHEAD,
        SystemTime::now(),
    )
    .await
    {
        tracing::warn!(error = %format!("{e:#}"), "could not create the coming months' partitions now; retrying in the background");
    }
    if let Some(addr) = args.metrics_listen {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen for metrics on {addr}"))?;
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
        ops::task::spawn("metrics", ops::http::serve(l));
    }
    // Not ready until every role has started.
    let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let started = started.clone();
        ops::http::ready_when("roles", move || {
            if started.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("starting".into())
            }
        });
    }
    let slot = slot_name(args.slot.as_deref());
    if slot.is_empty()
        || slot.len() > 63
        || !slot
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        bail!("--slot {slot:?}: a slot name is 1 to 63 lower-case letters, digits and underscores");
    }
    let mut rc = ReaderConfig::new(slot);
    rc.owner = "strata serve".into();
    rc.subscription_lease_ttl = args.subscription_lease_ttl;
    // Only the roles that follow the log stream it: a process of
    // maintenance or the audit endpoint alone holds no slot and costs
    // PostgreSQL no walsender (each decodes all of the WAL).
    let follows = ["placer", "gateway", "binder", "sinks"];
    let reader = args
        .roles
        .iter()
        .any(|r| follows.contains(&r.as_str()))
        .then(|| Reader::start(cfg.clone(), rc));
    let follower = reader.clone();
    let reader = || {
        reader
            .clone()
            .expect("the reader is started for every role that follows the log")
    };
    let placer = if args.roles.iter().any(|r| r == "placer") {
        let mut pc = placer::PlacerConfig::new(
            args.holder
                .clone()
                .unwrap_or_else(events::lease::default_holder),
        );
        pc.max_batch = args.max_batch.max(1);
        pc.lease_ttl = args.lease_ttl;
        pc.node_lost_after = args.node_lost_after;
        pc.preemption_grace = args.preemption_grace;
        if !args.pools.is_empty() {
            pc.pools = Some(args.pools.iter().cloned().collect());
        }
        pc.snapshots = args
            .snapshot_dir
            .clone()
            .map(projections::SnapshotStore::new);
        tracing::info!(holder = %pc.holder, max_batch = pc.max_batch, lease_ttl = ?pc.lease_ttl, "starting the placer");
        let appender = Appender::start(cfg.clone(), AppenderConfig::default());
        Some(placer::Placer::start(cfg.clone(), reader(), appender, pc))
    } else {
        None
    };
    let holder = args
        .holder
        .clone()
        .unwrap_or_else(events::lease::default_holder);
    let gateway = if args.roles.iter().any(|r| r == "gateway") {
        let mut gc = gateway::server::GatewayConfig::new(
            args.gateway_id.clone().unwrap_or_else(|| holder.clone()),
            args.listen,
            &args.ca_dir,
        );
        gc.names = args.tls_names.clone();
        gc.max_streams = args.max_streams;
        gc.handshakes_per_second = args.handshakes_per_second;
        gc.max_pending_hellos = args.max_pending_hellos;
        gc.joins_per_second = args.joins_per_second;
        gc.handshake_timeout = args.handshake_timeout;
        gc.idle_timeout = args.idle_timeout;
        gc.max_idle_connections = args.max_idle_connections;
        gc.node_messages_per_second = args.node_messages_per_second;
        gc.serving_validity = args.serving_validity;
        gc.heartbeat = args.heartbeat;
        let appender = Appender::start(cfg.clone(), AppenderConfig::default());
        let g = gateway::server::start(cfg.clone(), reader(), appender, gc)
            .await
            .context("start the gateway")?;
        eprintln!("gateway listening on {}", g.addr);
        Some(g)
    } else {
        None
    };
    let binder = if args.roles.iter().any(|r| r == "binder") {
        let appender = Appender::start(cfg.clone(), AppenderConfig::default());
        Some(binder::Binder::start_as(
            cfg.clone(),
            reader(),
            appender,
            holder.clone(),
        ))
    } else {
        None
    };
    let sink_role = if args.roles.iter().any(|r| r == "sinks") {
        let sinks = sinks::Sinks::start(
            cfg.clone(),
            reader(),
            sinks::SinksConfig {
                webhook_ca: args.webhook_ca.clone(),
                region: args.region.clone(),
                ..sinks::SinksConfig::default()
            },
        )
        .map_err(anyhow::Error::msg)
        .context("--webhook-ca")?;
        Some(sinks)
    } else {
        None
    };
    if args.roles.iter().any(|r| r == "maintenance") {
        spawn_sealer(cfg.clone(), args.seal_every, args.seal_grace);
        ops::task::spawn(
            "slot-metrics",
            events::slots::watch(cfg.clone(), Duration::from_secs(5)),
        );
    }
    let audit = if args.roles.iter().any(|r| r == "audit") {
        Some(start_audit(&args, &cfg).await?)
    } else {
        None
    };
    if let Some(r) = follower {
        ops::http::ready_when("replication", move || {
            if r.streaming() {
                Ok(())
            } else {
                Err("no replication session is streaming (connecting, or reconnecting after a failure)".into())
            }
        });
    }
    started.store(true, Ordering::Relaxed);
    tracing::info!(roles = %args.roles.join(","), "every role started");
    let mut report = tokio::time::interval(Duration::from_secs(10));
    report.tick().await;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listen for SIGTERM")?;
    loop {
        tokio::select! {
            r = &mut ctrl_c => { r.context("wait for Ctrl-C")?; break; }
            _ = term.recv() => break,
            _ = report.tick() => {
                if gateway.as_ref().is_some_and(|g| g.is_finished())
                    || binder.as_ref().is_some_and(|b| b.is_finished())
                    || audit.as_ref().is_some_and(|a| a.is_finished())
                {
                    break;
                }
                if let Some(g) = &gateway {
                    let s = &g.stats;
                    tracing::info!(sessions = s.sessions.load(Ordering::Relaxed),
                        opened = s.sessions_opened.load(Ordering::Relaxed),
                        refused_admission = s.refused_rate.load(Ordering::Relaxed)
                            + s.refused_full.load(Ordering::Relaxed)
                            + s.refused_pending.load(Ordering::Relaxed),
                        refused_identity = s.refused_identity.load(Ordering::Relaxed),
                        events = s.events_written.load(Ordering::Relaxed),
                        commands = s.commands_dispatched.load(Ordering::Relaxed), "gateway");
                }
                if let Some(p) = &placer {
                    if p.is_finished() {
                        break;
                    }
                    let s = p.stats().view();
                    tracing::info!(pools = s.pools_held, placed = s.placed, queued = s.queued,
                        unschedulable = s.unschedulable, released = s.released, expired = s.expired,
                        batches = s.batches, conflicts = s.conflicts, position = s.position, "placer");
                }
            }
        }
    }
    tracing::info!("stopping");
    me.stop().await;
    if let Some(a) = audit {
        a.stop();
    }
    if let Some(g) = gateway {
        g.stop().await.context("the gateway failed")?;
    }
    if let Some(b) = binder {
        b.stop().await.context("the binder failed")?;
    }
    if let Some(s) = sink_role {
        s.stop().await;
    }
    if let Some(p) = placer {
        p.stop().await.context("the placer failed")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Seals months once they have closed (and nothing that began before the
/// end is still running) and takes running checkpoints of the open month,
/// every `every`. Several processes may run it; one at a time does the work.
pub fn spawn_sealer(cfg: events::db::Database, every: Duration, grace: Duration) {
    // Sealing a month reads all of it in one statement.
    let cfg = cfg.with_statement_timeout(None);
    ops::task::spawn("sealer", async move {
        let mut tick = tokio::time::interval(every.max(Duration::from_secs(1)));
        let mut client = None;
        loop {
            tick.tick().await;
            if client
                .as_ref()
                .is_none_or(|c: &tokio_postgres::Client| c.is_closed())
            {
                // Sealing holds a session lock: PostgreSQL itself, never
                // through a pooler.
                match events::db::connect(cfg.direct(), "strata-sealer").await {
                    Ok(c) => client = Some(c),
                    Err(e) => {
                        tracing::warn!(error = %e, "sealer: cannot connect; trying again later");
                        continue;
                    }
                }
            }
            let Some(c) = client.as_ref() else { continue };
            match ::replay::seal::maintain(c, grace).await {
                Ok(done) => {
                    for s in &done.sealed {
                        tracing::info!(partition = %s.partition, rows = s.rows, chain = %s.chain, "sealed a closed month");
                    }
                    if let Some(cp) = &done.checkpoint {
                        tracing::debug!(
                            position = cp.last_position,
                            rows = cp.rows,
                            "checkpoint of the open month"
                        );
                    }
                    for (month, why) in &done.refused {
                        tracing::error!(%month, %why, "NOT sealing a closed month: it changed after a checkpoint");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "sealing or checkpointing failed; trying again later")
                }
            }
        }
    });
}

/// The audit endpoint, with TLS from the CA folder when there is one.
async fn start_audit(
    args: &ServeArgs,
    cfg: &events::db::Database,
) -> Result<::replay::audit::Endpoint> {
    let mut ac = ::replay::audit::AuditConfig::new(cfg.clone());
    ::replay::audit::setup::check_role(&args.audit_role)?;
    ac.role = args.audit_role.clone();
    ac.backend = match &args.audit_database_url {
        Some(u) => events::db::Database::parse(u)
            .map_err(anyhow::Error::msg)
            .context("--audit-database-url")?,
        // Each auditor's session is a login of its own, with its settings.
        None => cfg.direct().clone(),
    };
    ac.statement_timeout = args.audit_statement_timeout;
    ac.idle_in_transaction = args.audit_idle_in_transaction;
    ac.max_transaction_age = args.audit_max_transaction_age;
    ac.max_result_bytes = args.audit_max_result_mib.max(1) << 20;
    ac.max_sessions = args.audit_max_sessions;
    if gateway::ca::exists(&args.ca_dir) {
        let ca = gateway::ca::Ca::load(&args.ca_dir)?;
        let (cert_pem, key_pem) = ca.server_identity_for(&args.tls_names, args.serving_validity)?;
        ac.tls = Some(::replay::audit::TlsFiles {
            cert_pem,
            key_pem,
            client_ca_pem: Some(ca.cert_pem().to_string()),
        });
    } else {
        tracing::warn!(ca_dir = %args.ca_dir.display(),
            "audit: no CA there, so no TLS: auditors log in with SCRAM passwords over plain TCP, and certificates are not available");
    }
    let tls = ac.tls.is_some();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let endpoint = ::replay::audit::start(args.audit_listen, ac, appender)
        .await
        .context("start the audit endpoint")?;
    if let Some(renewer) = endpoint.renewer() {
        let (dir, names, validity) = (
            args.ca_dir.clone(),
            args.tls_names.clone(),
            args.serving_validity,
        );
        ops::task::spawn(
            "audit-serving-cert",
            gateway::ca::keep_renewed(dir, names, validity, "audit", move |cert, key| {
                renewer.renew(cert, key).map_err(|e| e.to_string())
            }),
        );
    }
    eprintln!(
        "audit endpoint listening on {} ({}); connect with: psql \"host={} port={} user=<auditor> dbname=audit{}\"",
        endpoint.addr,
        if tls { "TLS" } else { "no TLS" },
        endpoint.addr.ip(),
        endpoint.addr.port(),
        if tls { " sslmode=require" } else { "" }
    );
    Ok(endpoint)
}

/// This process's row in `strata.processes`, refreshed while it runs: a
/// contracting migration waits while a process that knows an older schema
/// is live.
struct Registration {
    host: String,
    started_at: SystemTime,
    task: tokio::task::JoinHandle<()>,
    cfg: events::db::Database,
}

impl Registration {
    fn start(cfg: &events::db::Database, roles: &str) -> Registration {
        let host = hostname().unwrap_or_else(|| "local".into());
        let started_at = SystemTime::now();
        let (h, roles, db) = (
            host.clone(),
            roles.to_string(),
            events::db::Db::new(cfg.clone()),
        );
        let task = ops::task::spawn("process-registration", async move {
            let mut backoff =
                ops::task::Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
            loop {
                let result = match db.get().await {
                    Ok(c) => schema::migrate::register(
                        &c,
                        &h,
                        started_at,
                        env!("CARGO_PKG_VERSION"),
                        &roles,
                    )
                    .await
                    .map_err(|e| e.to_string()),
                    Err(e) => Err(format!("connect: {e}")),
                };
                match result {
                    Ok(()) => {
                        backoff.reset();
                        tokio::time::sleep(schema::migrate::PROCESS_REFRESH).await;
                    }
                    Err(e) => {
                        db.reset().await;
                        let wait = backoff.next_delay();
                        tracing::warn!(error = %e, retry_in = ?wait, "could not record this process in strata.processes");
                        tokio::time::sleep(wait).await;
                    }
                }
            }
        });
        Registration {
            host,
            started_at,
            task,
            cfg: cfg.clone(),
        }
    }

    async fn stop(self) {
        self.task.abort();
        if let Ok(c) = events::db::connect(&self.cfg, "process-registration").await {
            if let Err(e) = schema::migrate::unregister(&c, &self.host, self.started_at).await {
                tracing::warn!(error = %e, "could not remove this process from strata.processes");
            }
        }
    }
}

/// This machine's host name, if it can be read.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
}

/// `strata_<host>` in the characters a slot name allows.
pub fn default_slot() -> String {
    format!("strata_{}", host_token())
}

/// `--slot` with `{host}` read as this host's name in slot characters, so
/// one configuration file serves every host: `strata_{host}_control`.
pub fn slot_name(given: Option<&str>) -> String {
    match given {
        Some(s) => s.replace("{host}", &host_token()),
        None => default_slot(),
    }
}

/// The host name in the characters a slot name may hold.
fn host_token() -> String {
    let host = hostname().unwrap_or_else(|| "local".into());
    host.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(40)
        .collect()
}
