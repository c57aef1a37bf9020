//! `strata queues create|set|cohort|list|show`: teams' shares of a pool, and
//! whether a cohort's fair share remembers past usage.

use crate::cli::appender;
use crate::cli::asked_by;
use crate::cli::connect;
use crate::cli::index;
use crate::cli::DbArgs;
use anyhow::bail;
use anyhow::Result;
use clap::Subcommand;
use domain::requests::RequestError;
use domain::QueueSpec;
use domain::Quota;
use projections::quota;
use projections::quota::Share;
use projections::Index;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum QueuesCmd {
    /// Create a queue in a pool. Once a pool has a queue, it places only requests that name one (reserve --queue); each is admitted when its queue stays within its nominal quota, or borrows within its borrowing limit what its cohort leaves unused. Exit 6 if the pool does not exist
    Create {
        #[command(flatten)]
        db: DbArgs,
        /// The queue's name (a team), unique within the pool
        name: String,
        /// The pool it shares
        #[arg(long)]
        pool: String,
        /// The cohort it lends its unused quota to and borrows from (none: it only uses its own)
        #[arg(long)]
        cohort: Option<String>,
        /// Its weight in fair sharing within the cohort (1 to 1000): weight 2 is served as if it held half of what it holds
        #[arg(long, default_value_t = 1)]
        weight: u32,
        /// Its nominal quota of a GPU class, CLASS=GPUS (repeat for more classes): guaranteed to it, lent to its cohort while unused
        #[arg(long, value_name = "CLASS=GPUS")]
        quota: Vec<String>,
        /// The most it may borrow of a class beyond its quota, CLASS=GPUS (default: whatever its cohort has unused)
        #[arg(long, value_name = "CLASS=GPUS")]
        borrowing_limit: Vec<String>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Change a queue: only what is given changes. The change is appended at the pool's version it was read at, so concurrent changes are both kept; waiting requests are tried again under the new quota. Exit 6 if there is no such queue
    Set {
        #[command(flatten)]
        db: DbArgs,
        name: String,
        #[arg(long)]
        pool: String,
        /// Move it to this cohort
        #[arg(long, conflicts_with = "no_cohort")]
        cohort: Option<String>,
        /// Take it out of its cohort: it neither lends nor borrows
        #[arg(long)]
        no_cohort: bool,
        #[arg(long)]
        weight: Option<u32>,
        /// Set the nominal quota of a class, CLASS=GPUS (repeatable)
        #[arg(long, value_name = "CLASS=GPUS")]
        quota: Vec<String>,
        /// Set the borrowing limit of a class, CLASS=GPUS, or CLASS=none for no limit (repeatable)
        #[arg(long, value_name = "CLASS=GPUS")]
        borrowing_limit: Vec<String>,
        /// Remove the quota of a class (repeatable)
        #[arg(long, value_name = "CLASS")]
        remove_quota: Vec<String>,
        #[command(flatten)]
        limits: LimitArgs,
        /// Remove the budget of a period: day, week or month (repeatable)
        #[arg(long, value_name = "PERIOD")]
        remove_budget: Vec<String>,
    },
    /// Make a cohort's fair share remember its queues' past usage (--half-life 7d), or only what they hold now (--half-life off, the default). Remembering, the queues that borrow are served in the order of what they hold beyond their quota plus what they held beyond it in the past, each moment of it weighing half as much one half-life later: a queue that used more yields to one that used less. Past usage is kept while it is off (with a 7-day half-life), so turning it on acts at once. Exit 6 if the pool does not exist
    Cohort {
        #[command(flatten)]
        db: DbArgs,
        /// The cohort (a name its queues were given with --cohort)
        name: String,
        #[arg(long)]
        pool: String,
        /// How long until past usage counts half: 7d, 36h, 90m (a second to 366 days), or off
        #[arg(long, value_name = "DURATION|off")]
        half_life: String,
    },
    /// Every queue per class: its quota, what it holds, what its waiting requests ask for, its fair share (the cohort's quota divided by weight among the queues that want it; where the cohort remembers, counting what each held beyond its quota in the past as given), and what it held on average in the recent past
    List {
        #[command(flatten)]
        db: DbArgs,
        /// Only this pool
        #[arg(long)]
        pool: Option<String>,
    },
    /// One queue: its spec, its waiting requests, its weighted dominant share, and per class what it holds against its quota and fair share. Exit 6 if there is no such queue
    Show {
        #[command(flatten)]
        db: DbArgs,
        name: String,
        #[arg(long)]
        pool: String,
    },
}

/// A queue's budgets and longest run, as `create` and `set` take them.
#[derive(clap::Args, Debug)]
pub(crate) struct LimitArgs {
    /// GPU-hours it may book per UTC day, ISO week or month: PERIOD=HOURS[:wait|reject|soft], e.g. month=20000 or day=0.5:reject (repeatable, one per period). Once spent, its requests wait for the next period (wait, the default) or are rejected (reject), whatever is free; a soft budget only serves its requests after the queues within their budgets. Running reservations go on; the time they are booked counts
    #[arg(long, value_name = "PERIOD=HOURS[:HOW]")]
    budget: Vec<String>,
    /// The longest one of its reservations may run from its placement (e.g. 24h), or none: past it, it ends (expired, max_run_time) after the notice preemption gives its nodes, one preemption grace period ahead. Applies to reservations placed from now on
    #[arg(long, value_name = "DURATION|none")]
    max_run: Option<String>,
}

impl LimitArgs {
    /// The budgets given.
    fn budgets(&self) -> Result<Vec<domain::Budget>> {
        self.budget.iter().map(|s| budget_arg(s)).collect()
    }

    /// The maximum run time given: `Some(None)` for `none`.
    fn max_run(&self) -> Result<Option<Option<u64>>> {
        let Some(s) = &self.max_run else {
            return Ok(None);
        };
        if s == "none" {
            return Ok(Some(None));
        }
        let d = humantime::parse_duration(s)
            .map_err(|e| anyhow::anyhow!("--max-run {s:?}: {e} (write e.g. 24h, 90m, or none)"))?;
        Ok(Some(Some(d.as_millis() as u64)))
    }
}

/// `--budget PERIOD=HOURS[:HOW]`.
fn budget_arg(s: &str) -> Result<domain::Budget> {
    let bad = || {
        anyhow::anyhow!("--budget {s:?}: write PERIOD=HOURS[:wait|reject|soft], e.g. month=20000 or day=0.5:reject")
    };
    let (period, rest) = s.split_once('=').ok_or_else(bad)?;
    let period = domain::BudgetPeriod::from_name(period).ok_or_else(|| {
        anyhow::anyhow!("--budget {s:?}: the period is day, week or month, not {period:?}")
    })?;
    let (hours, how) = rest.split_once(':').unwrap_or((rest, "wait"));
    let hours: f64 = hours.parse().map_err(|_| bad())?;
    if !hours.is_finite() || hours <= 0.0 {
        return Err(anyhow::anyhow!(
            "--budget {s:?}: a budget is more than 0 GPU-hours (remove one with --remove-budget)"
        ));
    }
    let enforce = match how {
        "wait" => domain::Enforce::Wait,
        "reject" => domain::Enforce::Reject,
        "soft" => domain::Enforce::Soft,
        _ => return Err(bad()),
    };
    Ok(domain::Budget {
        period,
        gpu_seconds: (hours * 3600.0).round().max(1.0) as u64,
        enforce,
    })
}

/// `CLASS=N` from `--quota` or `--borrowing-limit` (`none` for no limit).
pub(crate) fn class_value(flag: &str, s: &str) -> Result<(String, Option<u32>)> {
    let Some((class, n)) = s.split_once('=') else {
        bail!("{flag} {s:?}: write CLASS=GPUS, e.g. H100-80GB=64");
    };
    if n == "none" && flag == "--borrowing-limit" {
        return Ok((class.to_string(), None));
    }
    let n: u32 = n
        .parse()
        .map_err(|_| anyhow::anyhow!("{flag} {s:?}: {n:?} is not a number of GPUs"))?;
    Ok((class.to_string(), Some(n)))
}

/// What the flags of `create` or `set` change.
pub(crate) struct Changes {
    cohort: Option<Option<String>>,
    weight: Option<u32>,
    quotas: Vec<(String, u32)>,
    limits: Vec<(String, Option<u32>)>,
    remove: Vec<String>,
    budgets: Vec<domain::Budget>,
    remove_budgets: Vec<domain::BudgetPeriod>,
    max_run: Option<Option<u64>>,
}

impl Changes {
    #[allow(clippy::too_many_arguments)]
    fn parse(
        cohort: Option<String>,
        no_cohort: bool,
        weight: Option<u32>,
        quota: &[String],
        borrowing_limit: &[String],
        remove: Vec<String>,
        limits_arg: &LimitArgs,
        remove_budget: &[String],
    ) -> Result<Changes> {
        let remove_budgets = remove_budget
            .iter()
            .map(|p| {
                domain::BudgetPeriod::from_name(p).ok_or_else(|| {
                    anyhow::anyhow!("--remove-budget {p:?}: the period is day, week or month")
                })
            })
            .collect::<Result<_>>()?;
        let quotas = quota
            .iter()
            .map(|s| class_value("--quota", s).map(|(c, n)| (c, n.expect("a number"))))
            .collect::<Result<_>>()?;
        let limits = borrowing_limit
            .iter()
            .map(|s| class_value("--borrowing-limit", s))
            .collect::<Result<_>>()?;
        Ok(Changes {
            cohort: if no_cohort {
                Some(None)
            } else {
                cohort.map(Some)
            },
            weight,
            quotas,
            limits,
            remove,
            budgets: limits_arg.budgets()?,
            remove_budgets,
            max_run: limits_arg.max_run()?,
        })
    }

    /// The spec these changes make of `spec`.
    fn apply(&self, mut spec: QueueSpec) -> Result<QueueSpec, RequestError> {
        if let Some(c) = &self.cohort {
            spec.cohort = c.clone();
        }
        if let Some(w) = self.weight {
            spec.weight = w;
        }
        for class in &self.remove {
            if spec.quota(class).is_none() {
                return Err(RequestError::Invalid(format!(
                    "queue {} has no quota of {class} to remove",
                    spec.queue
                )));
            }
            spec.quotas.retain(|q| &q.class != class);
        }
        for (class, nominal) in &self.quotas {
            match spec.quotas.iter_mut().find(|q| &q.class == class) {
                Some(q) => q.nominal = *nominal,
                None => spec.quotas.push(Quota {
                    class: class.clone(),
                    nominal: *nominal,
                    borrowing_limit: None,
                }),
            }
        }
        for (class, limit) in &self.limits {
            match spec.quotas.iter_mut().find(|q| &q.class == class) {
                Some(q) => q.borrowing_limit = *limit,
                None => {
                    return Err(RequestError::Invalid(format!(
                        "--borrowing-limit {class}: queue {} has no quota of {class} (give it one with --quota {class}=N)",
                        spec.queue
                    )))
                }
            }
        }
        spec.quotas.sort_by(|a, b| a.class.cmp(&b.class));
        for period in &self.remove_budgets {
            if spec.budget(*period).is_none() {
                return Err(RequestError::Invalid(format!(
                    "queue {} has no budget per {} to remove",
                    spec.queue,
                    period.name()
                )));
            }
            spec.budgets.retain(|b| b.period != *period);
        }
        for b in &self.budgets {
            spec.budgets.retain(|o| o.period != b.period);
            spec.budgets.push(b.clone());
        }
        spec.budgets.sort_by_key(|b| b.period);
        if let Some(m) = self.max_run {
            spec.max_run_ms = m;
        }
        Ok(spec)
    }
}

/// Applies `edit` to queue `name` of `pool` in the log, as who runs this.
pub(crate) async fn write(
    db: &DbArgs,
    pool: &str,
    name: &str,
    edit: &domain::queues::Edit<'_>,
) -> Result<QueueSpec> {
    let client = connect(db).await?;
    domain::queues::configure(&client, &appender(db)?, pool, name, edit, Some(&asked_by()))
        .await
        .map_err(cli_error)
}

/// A request error as the CLI reports it (what does not exist: exit 6).
pub(crate) fn cli_error(e: RequestError) -> anyhow::Error {
    match e {
        RequestError::NoSuchPool(_) | RequestError::NoSuchQueue { .. } => {
            crate::exit::not_found(e.to_string())
        }
        e => e.into(),
    }
}

pub(crate) async fn queues(cmd: QueuesCmd) -> Result<ExitCode> {
    match cmd {
        QueuesCmd::Create {
            db,
            name,
            pool,
            cohort,
            weight,
            quota,
            borrowing_limit,
            limits,
        } => {
            let changes = Changes::parse(
                cohort,
                false,
                Some(weight),
                &quota,
                &borrowing_limit,
                vec![],
                &limits,
                &[],
            )?;
            let edit = |now: Option<&QueueSpec>| {
                domain::queues::refuse_existing(&pool, &name, now)?;
                changes.apply(QueueSpec {
                    queue: name.clone(),
                    cohort: None,
                    weight: 1,
                    quotas: Vec::new(),
                    budgets: Vec::new(),
                    max_run_ms: None,
                })
            };
            let spec = write(&db, &pool, &name, &edit).await?;
            println!("created queue {name} in pool {pool}: {}", describe(&spec));
        }
        QueuesCmd::Set {
            db,
            name,
            pool,
            cohort,
            no_cohort,
            weight,
            quota,
            borrowing_limit,
            remove_quota,
            limits,
            remove_budget,
        } => {
            let changes = Changes::parse(
                cohort,
                no_cohort,
                weight,
                &quota,
                &borrowing_limit,
                remove_quota,
                &limits,
                &remove_budget,
            )?;
            let edit = |now: Option<&QueueSpec>| {
                changes.apply(domain::queues::existing(&pool, &name, now)?.clone())
            };
            let spec = write(&db, &pool, &name, &edit).await?;
            println!("queue {name} in pool {pool}: {}", describe(&spec));
        }
        QueuesCmd::Cohort {
            db,
            name,
            pool,
            half_life,
        } => {
            let half_life_ms = half_life_arg(&half_life)?;
            let client = connect(&db).await?;
            domain::queues::set_decay(
                &client,
                &appender(&db)?,
                &pool,
                &name,
                half_life_ms,
                Some(&asked_by()),
            )
            .await
            .map_err(cli_error)?;
            match half_life_ms {
                Some(h) => println!(
                    "cohort {name} in pool {pool}: fair share remembers past usage, half-life {}",
                    humantime::format_duration(std::time::Duration::from_millis(h))
                ),
                None => println!(
                    "cohort {name} in pool {pool}: fair share counts only what queues hold now"
                ),
            }
        }
        QueuesCmd::List { db, pool } => list(&db, pool).await?,
        QueuesCmd::Show { db, name, pool } => show(&db, &name, &pool).await?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `--half-life`: a duration in ms, or `None` for `off`.
fn half_life_arg(s: &str) -> Result<Option<u64>> {
    if s == "off" {
        return Ok(None);
    }
    let d = humantime::parse_duration(s)
        .map_err(|e| anyhow::anyhow!("--half-life {s:?}: {e} (write e.g. 7d, 36h, 90m, or off)"))?;
    Ok(Some(d.as_millis() as u64))
}

/// A queue's past usage in words, for tables and `show`.
pub(crate) fn past_words(s: &Share) -> String {
    match s.half_life_ms {
        Some(h) => format!(
            "held {:.1} on average in the past (half-life {}), {:.1} GPU-hours decayed",
            s.past_gpus,
            humantime::format_duration(std::time::Duration::from_millis(h)),
            s.past_gpu_hours
        ),
        None => format!(
            "held {:.1} on average in the past (not counted: its cohort does not remember)",
            s.past_gpus
        ),
    }
}

/// A half-life as a table shows it (`off` where its cohort forgets).
fn half_life_cell(s: &Share) -> String {
    s.half_life_ms.map_or("off".into(), |h| {
        humantime::format_duration(std::time::Duration::from_secs(h / 1000)).to_string()
    })
}

/// `strata queues list`: every queue of a pool (or of every pool) with its
/// quota, use and fair share per class.
async fn list(db: &DbArgs, pool: Option<String>) -> Result<()> {
    let index = index(db).await?;
    let pools: Vec<String> = match pool {
        Some(p) => {
            exists(&index, &p)?;
            vec![p]
        }
        None => index.state().pools.keys().cloned().collect(),
    };
    if !crate::exit::json() {
        println!(
            "{:<16} {:<16} {:<12} {:>6} {:<14} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8} {:>10}",
            "POOL",
            "QUEUE",
            "COHORT",
            "WEIGHT",
            "CLASS",
            "NOMINAL",
            "BORROW",
            "USED",
            "WAITING",
            "FAIR",
            "PAST",
            "HALF-LIFE"
        );
    }
    let now = crate::cmd::reservations::now_ms();
    for p in &pools {
        for s in quota::fair_shares(&index, p, now) {
            if crate::exit::json() {
                crate::exit::print_json(&share_json(p, &s));
            } else {
                println!(
                    "{:<16} {:<16} {:<12} {:>6} {:<14} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8.1} {:>10}",
                    p,
                    s.queue,
                    s.cohort.as_deref().unwrap_or("-"),
                    s.weight,
                    s.class,
                    s.nominal,
                    borrow(&s),
                    s.used,
                    s.waiting,
                    s.fair,
                    s.past_gpus,
                    half_life_cell(&s)
                );
            }
        }
    }
    Ok(())
}

/// `strata queues show`: one queue, with what waits in it.
async fn show(db: &DbArgs, name: &str, pool: &str) -> Result<()> {
    let index = index(db).await?;
    exists(&index, pool)?;
    let Some(spec) = index.pool(pool).and_then(|p| p.queues.get(name)) else {
        return Err(crate::exit::not_found(format!(
            "pool {pool:?} has no queue {name:?} (see `strata queues list --pool {pool}`)"
        )));
    };
    let now = crate::cmd::reservations::now_ms();
    let shares: Vec<Share> = quota::fair_shares(&index, pool, now)
        .into_iter()
        .filter(|s| s.queue == name)
        .collect();
    let (pending, queued) = waiting_in(&index, pool, name);
    let share = quota::dominant_share(&index, pool, name, &quota::Batch::default());
    let turn = quota::turn(&index, pool, name, &quota::Batch::default(), now);
    let spent = index.spent(pool, name, now);
    let budgets: Vec<serde_json::Value> = spec
        .budgets
        .iter()
        .map(|b| {
            serde_json::json!({
                "period": b.period.name(),
                "gpu_hours": b.gpu_seconds as f64 / 3600.0,
                "enforce": b.enforce.name(),
                "booked_gpu_hours": spent.of(b.period) as f64 / 3_600_000.0,
                "renews_at": crate::cli::ms_time(b.period.next(now as i64).max(0) as u64),
            })
        })
        .collect();
    if crate::exit::json() {
        crate::exit::print_json(&serde_json::json!({
            "pool": pool,
            "queue": name,
            "cohort": spec.cohort,
            "weight": spec.weight,
            "dominant_share": share,
            "turn": { "over_soft_budget": turn.over_soft, "borrows": turn.borrows, "share": turn.share },
            "budgets": budgets,
            "max_run_ms": spec.max_run_ms,
            "pending": pending,
            "queued": queued,
            "classes": shares.iter().map(|s| share_json(pool, s)).collect::<Vec<_>>(),
        }));
        return Ok(());
    }
    println!("queue {name} in pool {pool}: {}", describe(spec));
    println!(
        "  waiting: {pending} pending, {queued} queued; weighted dominant share {:.3}{}",
        share,
        if !turn.borrows {
            " (short of its quota: served before the queues that borrow)".to_string()
        } else if turn.share != share {
            format!(", {:.3} with its past usage", turn.share)
        } else {
            String::new()
        }
    );
    for b in &budgets {
        println!(
            "  budget per {}: {:.3} of {} GPU-hours booked ({}); renews at {}",
            b["period"].as_str().unwrap_or_default(),
            b["booked_gpu_hours"].as_f64().unwrap_or_default(),
            b["gpu_hours"],
            b["enforce"].as_str().unwrap_or_default(),
            b["renews_at"].as_str().unwrap_or_default()
        );
    }
    for s in &shares {
        println!(
            "  {}: holds {} of its {} nominal (borrows up to {}); waiting requests ask for {}; fair share {}; {}",
            s.class,
            s.used,
            s.nominal,
            borrow(s),
            s.waiting,
            s.fair,
            past_words(s)
        );
    }
    Ok(())
}

pub(crate) fn exists(index: &Index, pool: &str) -> Result<()> {
    if index.pool(pool).is_some_and(|p| p.created) {
        return Ok(());
    }
    Err(crate::exit::not_found(format!(
        "pool {pool:?} does not exist (see `strata pools`)"
    )))
}

/// How many of `queue`'s requests wait: (pending, queued).
pub(crate) fn waiting_in(index: &Index, pool: &str, queue: &str) -> (usize, usize) {
    let Some(q) = index.queues(pool) else {
        return (0, 0);
    };
    let of = |k: &&(std::cmp::Reverse<i32>, u64, String)| {
        index
            .reservation(&k.2)
            .is_some_and(|r| r.request.queue.as_deref() == Some(queue))
    };
    (
        q.pending.iter().filter(of).count(),
        q.queued_by_queue.get(queue).map_or(0, |s| s.len()),
    )
}

/// A borrowing limit as a table shows it.
pub(crate) fn borrow(s: &Share) -> String {
    match (&s.cohort, s.borrowing_limit) {
        (None, _) => "0".into(),
        (Some(_), Some(b)) => b.to_string(),
        (Some(_), None) => "any".into(),
    }
}

pub(crate) fn describe(spec: &QueueSpec) -> String {
    let quotas: Vec<String> = spec
        .quotas
        .iter()
        .map(|q| match (spec.cohort.is_some(), q.borrowing_limit) {
            (true, Some(b)) => format!("{} {} (borrows up to {b})", q.nominal, q.class),
            _ => format!("{} {}", q.nominal, q.class),
        })
        .collect();
    let mut out = format!(
        "{}; cohort {}; weight {}",
        if quotas.is_empty() {
            "no quota".to_string()
        } else {
            quotas.join(", ")
        },
        spec.cohort.as_deref().unwrap_or("none"),
        spec.weight
    );
    for b in &spec.budgets {
        out.push_str(&format!(
            "; {} GPU-hours per {} ({})",
            projections::budget::hours(b.gpu_seconds * 1000),
            b.period.name(),
            enforce_words(b.enforce)
        ));
    }
    if let Some(m) = spec.max_run_ms {
        out.push_str(&format!(
            "; runs at most {}",
            humantime::format_duration(std::time::Duration::from_millis(m))
        ));
    }
    out
}

/// What a spent budget does, in words.
fn enforce_words(e: domain::Enforce) -> &'static str {
    match e {
        domain::Enforce::Wait => "then requests wait",
        domain::Enforce::Reject => "then requests are rejected",
        domain::Enforce::Soft => "soft: then served after the others",
    }
}

pub(crate) fn share_json(pool: &str, s: &Share) -> serde_json::Value {
    serde_json::json!({
        "pool": pool,
        "queue": s.queue,
        "cohort": s.cohort,
        "weight": s.weight,
        "class": s.class,
        "nominal": s.nominal,
        "borrowing_limit": s.borrowing_limit,
        "used": s.used,
        "waiting": s.waiting,
        "fair": s.fair,
        "half_life_ms": s.half_life_ms,
        "past_gpus": s.past_gpus,
        "past_gpu_hours": s.past_gpu_hours,
    })
}
