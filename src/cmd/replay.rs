//! `strata replay run|state|stream|check`: projections rebuilt from the
//! log or its archive, windows of history, and the invariants checked.

use crate::cli::config;
use crate::cli::connect;
use crate::cli::index_until;
use crate::cli::position_at;
use crate::cli::progress_display;
use crate::cli::stop_display;
use crate::cli::DbArgs;
use crate::cmd::pools::show_pool;
use crate::cmd::pools::show_pool_json;
use ::replay::archive::ArchivedRow;
use ::replay::rebuild;
use ::replay::rebuild::Progress;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Subcommand;
use events::Event;
use events::Reader;
use events::ReaderConfig;
use events::Start;
use projections::views::Parsed;
use projections::ApplyError;
use projections::Index;
use projections::NodesView;
use projections::Projection;
use projections::ReservationsView;
use projections::Violation;
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub(crate) enum ReplayCmd {
    /// Replay the whole log and verify the placement invariants; exits non-zero at the first violation
    Check {
        #[command(flatten)]
        db: DbArgs,
        /// Print the report as JSON
        #[arg(long)]
        json: bool,
    },
    /// Check the log's invariants against the tables themselves (not the projections): positions, versions, double bookings, activations after the end, commands run or ended twice; exits 1 naming the positions of any violation
    Invariants {
        #[command(flatten)]
        db: DbArgs,
        /// Print the report as JSON
        #[arg(long)]
        json: bool,
    },
    /// Rebuild a projection (pool index, nodes, reservations) from history or archives, with progress; optionally a window, a snapshot, a comparison with the live projection
    Run(RunArgs),
    /// Print a pool as it was at a time: nodes, free and booked GPUs by class, what waited
    State {
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        pool: String,
        /// A time such as 2026-11-30T10:00:00Z
        #[arg(long)]
        at: String,
        /// List every node
        #[arg(long)]
        nodes: bool,
    },
    /// Print a stream's events (up to a time), as JSON lines
    Stream {
        #[command(flatten)]
        db: DbArgs,
        stream: String,
        /// Only events recorded at or before this time (RFC 3339)
        #[arg(long)]
        at: Option<String>,
    },
}

pub(crate) async fn replay(cmd: ReplayCmd) -> Result<ExitCode> {
    match cmd {
        ReplayCmd::Run(args) => run(args).await,
        ReplayCmd::State {
            db,
            pool,
            at,
            nodes,
        } => {
            let until = position_at(&db, &at).await?;
            let at_ms = projections::usage::unix_ms(crate::cli::time_arg(&at)?).max(0) as u64;
            let index = index_until(&db, Some(until)).await?;
            if crate::exit::json() {
                show_pool_json(&index, &pool, nodes, at_ms)?;
            } else {
                println!("as of {at} (position {until}):");
                show_pool(&index, &pool, nodes, at_ms)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        ReplayCmd::Stream { db, stream, at } => {
            let until = match &at {
                Some(t) => Some(position_at(&db, t).await?),
                None => None,
            };
            let client = connect(&db).await?;
            let events = events::read::stream(&client, &stream)
                .await
                .context("read the stream")?;
            if events.is_empty() {
                bail!("stream {stream:?} has no events");
            }
            for e in events
                .iter()
                .filter(|e| until.is_none_or(|u| e.position.0 <= u))
            {
                println!("{}", e.to_json_line());
            }
            Ok(ExitCode::SUCCESS)
        }
        ReplayCmd::Invariants { db, json } => {
            let client = connect(&db).await?;
            let r = ::replay::invariants::check(&client)
                .await
                .context("check the log's invariants")?;
            if json || crate::exit::json() {
                println!("{}", serde_json::to_string(&r)?);
            } else if r.violations.is_empty() {
                println!(
                    "ok: {} events in {} streams, {} placements; no violation",
                    r.events, r.streams, r.placements
                );
            }
            for v in &r.violations {
                if !json {
                    println!(
                        "violation ({}): {} at positions {:?}",
                        v.invariant, v.detail, v.positions
                    );
                }
            }
            Ok(if r.violations.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        ReplayCmd::Check { db, json } => {
            let client = connect(&db).await?;
            let tty = std::io::stderr().is_terminal();
            let result = projections::check::check(&client, |p| {
                if tty {
                    eprint!("\rchecked up to position {p}");
                }
            })
            .await;
            if tty {
                eprint!("\r\x1b[K");
            }
            match result {
                Ok(r) => {
                    // The usage rollups against a fold of the raw log.
                    let mut client = client;
                    let usage = projections::usage::verify::verify(
                        &crate::cli::config(&db)?,
                        &mut client,
                        |p| {
                            if tty {
                                eprint!("\rusage checked up to position {p}");
                            }
                        },
                    )
                    .await
                    .context("check the usage rollups")?;
                    if tty {
                        eprint!("\r\x1b[K");
                    }
                    let ok = usage.differences.is_empty();
                    if json || crate::exit::json() {
                        let mut v = serde_json::to_value(&r)?;
                        v["usage"] = serde_json::to_value(&usage)?;
                        println!("{v}");
                    } else {
                        println!(
                            "ok: {} events up to position {}; {} pools, {} nodes, {} devices ({} booked), {} live and {} waiting reservations",
                            r.events, r.position, r.pools, r.nodes, r.devices, r.booked_devices, r.live, r.pending
                        );
                        match usage.position {
                            Some(p) if ok => println!(
                                "ok: usage rollups at position {p} equal a fold of the log's {} reservation events ({} buckets, {} by node, {} open)",
                                usage.events, usage.account_buckets, usage.node_buckets, usage.open
                            ),
                            Some(p) => println!("usage rollups at position {p} differ from the log:"),
                            None => println!("usage: no rollups kept yet (no process runs `serve --roles usage`)"),
                        }
                        for d in &usage.differences {
                            println!("violation: {d}");
                        }
                    }
                    Ok(if ok {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    })
                }
                Err(projections::check::CheckError::Read(e)) => Err(e).context("replay the log"),
                Err(e) => {
                    println!("violation: {e}");
                    Ok(ExitCode::from(1))
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Which {
    /// The pool index the placer plans against
    PoolIndex,
    /// One row per node: pool, devices, cordon, drain, open health conditions
    Nodes,
    /// One row per reservation ever requested, with its state
    Reservations,
}

/// `strata replay run`.
#[derive(clap::Args, Debug)]
pub(crate) struct RunArgs {
    /// PostgreSQL connection string (not needed with --archive)
    #[arg(long, env = "STRATA_DATABASE_URL", value_name = "URL")]
    pub database_url: Option<String>,
    /// What to rebuild
    #[arg(long, value_enum, default_value = "pool-index")]
    pub projection: Which,
    /// Report the window after this position or time (RFC 3339): the state before it is rebuilt first (or taken from --snapshot-in), then the window's events are replayed and counted by type
    #[arg(long)]
    pub from: Option<String>,
    /// Stop after this position or time (RFC 3339); default: everything durable
    #[arg(long)]
    pub to: Option<String>,
    /// pool-index: start from this snapshot (at or before --from)
    #[arg(long)]
    pub snapshot_in: Option<PathBuf>,
    /// pool-index: write the rebuilt index as an rkyv snapshot file
    #[arg(long)]
    pub snapshot_out: Option<PathBuf>,
    /// Also build the projection live, through a subscription, and compare the two (exit 1 if they differ)
    #[arg(long)]
    pub compare_live: bool,
    /// Replay from these partition archives (in order) instead of the database
    #[arg(long, num_args = 1..)]
    pub archive: Vec<PathBuf>,
    /// Print the result as JSON (nodes and reservations: one object per line)
    #[arg(long)]
    pub json: bool,
}

/// Counts what a window of the log held, around any projection.
pub(crate) struct Window<P> {
    inner: P,
    /// Count events only after this position.
    from: u64,
    by_type: BTreeMap<String, u64>,
}

impl<P: Projection> Projection for Window<P> {
    fn apply_parsed(
        &mut self,
        event: &Event,
        parsed: Parsed,
    ) -> Result<Option<Violation>, ApplyError> {
        let fresh = event.position.0 > self.inner.position();
        let r = self.inner.apply_parsed(event, parsed)?;
        if fresh && event.position.0 > self.from {
            match self.by_type.get_mut(&event.event_type) {
                Some(n) => *n += 1,
                None => {
                    self.by_type.insert(event.event_type.clone(), 1);
                }
            }
        }
        Ok(r)
    }

    fn position(&self) -> u64 {
        self.inner.position()
    }
}

/// A position, or the last position recorded at a time (which needs the database).
pub(crate) async fn resolve(
    db: Option<&DbArgs>,
    what: &str,
    v: Option<&str>,
) -> Result<Option<u64>> {
    let Some(v) = v else { return Ok(None) };
    if let Ok(p) = v.parse::<u64>() {
        return Ok(Some(p));
    }
    let db = db.with_context(|| {
        format!("{what} as a time needs --database-url (or STRATA_DATABASE_URL)")
    })?;
    position_at(db, v)
        .await
        .with_context(|| format!("{what} {v:?}: a position or an RFC 3339 time"))
        .map(Some)
}

/// Where a run reads from and what it collects, shared by its phases.
pub(crate) struct Source<'a> {
    db: Option<&'a DbArgs>,
    /// Archive rows, validated once when loaded.
    archives: Vec<&'a [ArchivedRow]>,
    violations: Arc<std::sync::Mutex<Vec<Violation>>>,
}

/// Replays into `projection` from the database or the archives, up to `until`.
pub(crate) async fn replay_into<P: Projection>(
    src: &Source<'_>,
    projection: P,
    until: Option<u64>,
    label: &str,
) -> Result<P> {
    let progress = Arc::new(Progress::default());
    let display = progress_display(label.to_string(), progress.clone());
    let on_violation = {
        let v = src.violations.clone();
        move |x: Violation| {
            let mut v = v.lock().expect("violations");
            if v.len() < 100 {
                v.push(x);
            }
        }
    };
    let result = if src.archives.is_empty() {
        let db = src
            .db
            .context("give --database-url, or --archive files to replay from")?;
        let client = connect(db).await?;
        rebuild::from_postgres(
            &config(db)?,
            &client,
            projection,
            until,
            progress.clone(),
            on_violation,
        )
        .await
        .context("replay from the database")
    } else {
        let mut p = projection;
        let mut f = on_violation;
        let total: u64 = src.archives.iter().map(|r| r.len() as u64).sum();
        progress.start.store(p.position(), Ordering::Relaxed);
        progress.target.store(
            p.position() + total.min(until.unwrap_or(u64::MAX)),
            Ordering::Relaxed,
        );
        for rows in &src.archives {
            p = rebuild::from_archive(p, rows, until, &progress, &mut f)?;
        }
        Ok(p)
    };
    stop_display(display);
    result
}

pub(crate) async fn run(args: RunArgs) -> Result<ExitCode> {
    let db = args.database_url.clone().map(|database_url| DbArgs {
        database_url,
        database_direct_url: None,
        statement_timeout: events::db::DEFAULT_STATEMENT_TIMEOUT,
    });
    let db = db.as_ref();
    let need_db = |what: &str| {
        db.with_context(|| format!("{what} needs --database-url (or STRATA_DATABASE_URL)"))
    };
    let from = resolve(db, "--from", args.from.as_deref()).await?;
    let to = resolve(db, "--to", args.to.as_deref()).await?;
    if let (Some(f), Some(t)) = (from, to) {
        if f > t {
            bail!("--from {f} is after --to {t}");
        }
    }
    if args.compare_live && (to.is_some() || !args.archive.is_empty()) {
        bail!(
            "--compare-live compares the whole log in the database; leave out --to and --archive"
        );
    }
    if args.projection != Which::PoolIndex
        && (args.snapshot_in.is_some() || args.snapshot_out.is_some())
    {
        bail!("--snapshot-in and --snapshot-out are for --projection pool-index");
    }
    let mut loaded = Vec::new();
    for path in &args.archive {
        let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
        let a = ::replay::archive::Archive::open(&bytes)
            .with_context(|| format!("load {}", path.display()))?;
        loaded.push((path, a));
    }
    let mut archives = Vec::new();
    for (path, a) in &loaded {
        let rows = a
            .rows()
            .with_context(|| format!("load {}", path.display()))?;
        archives.push(rows.as_slice());
    }
    let src = Source {
        db,
        archives,
        violations: Arc::new(std::sync::Mutex::new(Vec::new())),
    };
    let label = if src.archives.is_empty() {
        "the log".to_string()
    } else {
        format!("{} archive(s)", src.archives.len())
    };
    let started = Instant::now();
    let exit = match args.projection {
        Which::PoolIndex => {
            let start = match &args.snapshot_in {
                Some(path) => {
                    let bytes =
                        std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
                    let state = projections::snapshot::decode(&bytes)
                        .with_context(|| format!("load {}", path.display()))?;
                    let index = Index::from_state(state);
                    if from.is_some_and(|f| index.position() > f) {
                        bail!(
                            "the snapshot is at position {}, after --from {}",
                            index.position(),
                            from.unwrap_or(0)
                        );
                    }
                    eprintln!(
                        "starting from {} at position {}",
                        path.display(),
                        index.position()
                    );
                    index
                }
                None => Index::new(),
            };
            let w = run_window(&src, start, from, to).await?;
            let index = w.inner;
            report_window(&label, from, index.position(), &w.by_type, started);
            let r = projections::check::verify(&index)?;
            if args.json || crate::exit::json() {
                println!(
                    "{}",
                    serde_json::json!({
                        "projection": "pool-index", "position": index.position(),
                        "pools": r.pools, "nodes": r.nodes, "devices": r.devices,
                        "booked_devices": r.booked_devices, "live": r.live, "pending": r.pending,
                    })
                );
            } else {
                println!(
                    "{} pools, {} nodes, {} devices ({} booked), {} live and {} waiting reservations",
                    r.pools, r.nodes, r.devices, r.booked_devices, r.live, r.pending
                );
            }
            if let Some(path) = &args.snapshot_out {
                std::fs::write(path, projections::snapshot::encode(index.state()))
                    .with_context(|| format!("write {}", path.display()))?;
                println!("wrote {}", path.display());
            }
            if args.compare_live {
                let live = live_index(need_db("--compare-live")?, index.position()).await?;
                compared(live == index, index.position())
            } else {
                ExitCode::SUCCESS
            }
        }
        Which::Nodes => {
            let view: NodesView = view(&src, from, to, &label, started).await?;
            print_nodes(&view, args.json || crate::exit::json());
            compare_view(&args, need_db, view).await?
        }
        Which::Reservations => {
            let view: ReservationsView = view(&src, from, to, &label, started).await?;
            print_reservations(&view, args.json || crate::exit::json());
            compare_view(&args, need_db, view).await?
        }
    };
    let violations = src.violations;
    let v = violations.lock().expect("violations");
    for x in v.iter().take(10) {
        eprintln!("warning: the log breaks an invariant: {x}");
    }
    if v.len() > 10 {
        eprintln!("warning: ... and more ({} kept)", v.len());
    }
    Ok(exit)
}

pub(crate) fn compared(equal: bool, position: u64) -> ExitCode {
    if equal {
        println!("the live projection equals the replayed one at position {position}");
        ExitCode::SUCCESS
    } else {
        println!("the live projection DIFFERS from the replayed one at position {position}");
        ExitCode::from(1)
    }
}

/// Rebuilds up to `from` (if given), then replays the window `(from, to]`,
/// counting its events by type.
pub(crate) async fn run_window<P: Projection>(
    src: &Source<'_>,
    start: P,
    from: Option<u64>,
    to: Option<u64>,
) -> Result<Window<P>> {
    let mut p = start;
    if let Some(f) = from {
        if p.position() < f {
            p = replay_into(src, p, Some(f), "state before --from").await?;
        }
    }
    let w = Window {
        inner: p,
        from: from.unwrap_or(0),
        by_type: BTreeMap::new(),
    };
    replay_into(src, w, to, "replaying").await
}

/// The nodes or reservations view, rebuilt and reported.
pub(crate) async fn view<P: Projection + Default>(
    src: &Source<'_>,
    from: Option<u64>,
    to: Option<u64>,
    label: &str,
    started: Instant,
) -> Result<P> {
    let w = run_window(src, P::default(), from, to).await?;
    report_window(label, from, w.inner.position(), &w.by_type, started);
    Ok(w.inner)
}

/// With `--compare-live`: the view built through a subscription, compared.
pub(crate) async fn compare_view<'a, P: Projection + Default + PartialEq>(
    args: &RunArgs,
    need_db: impl Fn(&str) -> Result<&'a DbArgs>,
    view: P,
) -> Result<ExitCode> {
    if !args.compare_live {
        return Ok(ExitCode::SUCCESS);
    }
    let live = live_view(need_db("--compare-live")?, P::default(), view.position()).await?;
    Ok(compared(live == view, view.position()))
}

pub(crate) fn report_window(
    source: &str,
    from: Option<u64>,
    position: u64,
    by_type: &BTreeMap<String, u64>,
    started: Instant,
) {
    let n: u64 = by_type.values().sum();
    let secs = started.elapsed().as_secs_f64();
    match from {
        Some(f) => println!(
            "replayed {n} events from {source}, positions {} to {position}, in {secs:.2} s",
            f + 1
        ),
        None => println!(
            "replayed {n} events from {source} to position {position} in {secs:.2} s ({:.0} events/s)",
            n as f64 / secs.max(1e-9)
        ),
    }
    if from.is_some() {
        for (t, c) in by_type {
            println!("  {c:>10}  {t}");
        }
    }
}

pub(crate) fn print_nodes(view: &NodesView, json: bool) {
    if json {
        for (name, row) in &view.nodes {
            let mut v = serde_json::to_value(row).unwrap_or_default();
            v["node"] = name.clone().into();
            println!("{v}");
        }
        return;
    }
    let mut by_pool: BTreeMap<&str, (u64, u64, u64, u64)> = BTreeMap::new();
    for row in view.nodes.values() {
        let e = by_pool.entry(row.pool.as_str()).or_default();
        e.0 += u64::from(!row.left);
        e.1 += u64::from(!row.left && (row.cordoned || row.drained));
        e.2 += u64::from(!row.left && !row.conditions.is_empty());
        e.3 += u64::from(row.left);
    }
    println!(
        "{:<24} {:>7} {:>9} {:>9} {:>6}",
        "POOL", "NODES", "CORDONED", "UNHEALTHY", "LEFT"
    );
    for (pool, (n, c, u, l)) in by_pool {
        println!("{pool:<24} {n:>7} {c:>9} {u:>9} {l:>6}");
    }
}

pub(crate) fn print_reservations(view: &ReservationsView, json: bool) {
    if json {
        for (id, row) in &view.reservations {
            let mut v = serde_json::to_value(row).unwrap_or_default();
            v["reservation"] = id.clone().into();
            println!("{v}");
        }
        return;
    }
    println!("{:<14} {:>10}", "STATE", "RESERVATIONS");
    for (state, n) in view.counts() {
        let name = serde_json::to_value(state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        println!("{name:<14} {n:>10}");
    }
}

/// A reader of its own (a temporary slot) for `--compare-live`.
pub(crate) fn live_reader(db: &DbArgs) -> Result<Reader> {
    let mut rc = ReaderConfig::new(format!("strata_replay_{}", std::process::id()));
    rc.temporary = true;
    rc.owner = "strata replay run --compare-live".into();
    Ok(Reader::start(config(db)?, rc))
}

/// The pool index as the placer builds it: through a subscription.
pub(crate) async fn live_index(db: &DbArgs, position: u64) -> Result<Index> {
    let reader = live_reader(db)?;
    let mut live = projections::Projector::start(&reader, None).await?;
    while live.index.position() < position {
        live.step().await?;
    }
    Ok(live.index)
}

/// A view folded from a subscription from the first event.
pub(crate) async fn live_view<P: Projection>(db: &DbArgs, mut view: P, position: u64) -> Result<P> {
    let reader = live_reader(db)?;
    let mut sub = reader
        .subscribe_ephemeral_as("replay", Start::Beginning)
        .await?;
    while view.position() < position {
        let e = sub.next().await?;
        view.apply(&e)?;
        sub.ack(e.position);
    }
    Ok(view)
}
