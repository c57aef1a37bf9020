//! `strata doctor`: what a database needs to carry Strata, checked from the
//! server's own views, each finding with what to do about it.
//!
//! | check | a problem (exit 1) | a warning |
//! | --- | --- | --- |
//! | `schema` | not migrated, or older than this binary | |
//! | `wal_level` | not `logical` | |
//! | `publication` | `strata_events` missing or without `strata.events` | |
//! | `replication_slots`, `wal_senders` | none left | two or fewer left |
//! | `max_slot_wal_keep_size` | | unlimited (a stalled slot can fill the disk) |
//! | `slots` | a slot whose WAL was removed (`lost`) | a stale slot; one past its WAL budget (`unreserved`) |
//! | `partitions` | none for this month | fewer than the months kept ahead |
//! | `tls` | | this connection is in the clear |
//! | `synchronous_standby` | named but none connected (commits wait); a replication reader is one (the setting matches it) | none named (a failover may lose acknowledged events); a streaming reader does not hold for them yet |
//! | `standby_lag` | | a standby more than 10 s behind |
//! | `takeovers` | | (reported, not judged: where takeovers cut the log) |

use schema::sql::Sql;
use serde::Serialize;
use std::time::Duration;
use tokio_postgres::Client;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    Warning,
    Problem,
}

/// One check's finding.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it (empty when nothing is to be done).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub advice: String,
}

impl Finding {
    fn ok(check: &'static str, detail: impl Into<String>) -> Finding {
        Finding {
            check,
            status: Status::Ok,
            detail: detail.into(),
            advice: String::new(),
        }
    }

    fn bad(
        check: &'static str,
        status: Status,
        detail: impl Into<String>,
        advice: impl Into<String>,
    ) -> Finding {
        Finding {
            check,
            status,
            detail: detail.into(),
            advice: advice.into(),
        }
    }
}

async fn setting(client: &Client, name: &str) -> Result<String, tokio_postgres::Error> {
    Ok(client
        .one("SELECT current_setting($1)", &[&name])
        .await?
        .get(0))
}

/// Examines the database `client` is connected to. `stale_after`: a slot
/// whose owner has not been seen this long (and that is not in use) is
/// stale.
pub async fn examine(
    client: &Client,
    stale_after: Duration,
) -> Result<Vec<Finding>, tokio_postgres::Error> {
    let mut out = Vec::new();
    let migrated = schema_version(client, &mut out).await?;
    decoding(client, &mut out).await?;
    slots_and_senders(client, stale_after, &mut out).await?;
    if migrated {
        partitions(client, &mut out).await?;
    }
    tls(client, &mut out).await?;
    standbys(client, &mut out).await?;
    takeovers(client, &mut out).await?;

    Ok(out)
}

/// The schema: migrated, and to this binary's latest. Whether there is a schema at all.
async fn schema_version(
    client: &Client,
    out: &mut Vec<Finding>,
) -> Result<bool, tokio_postgres::Error> {
    let migrated: bool = client
        .one(
            "SELECT to_regclass('strata.schema_migrations') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    let latest = schema::MIGRATIONS
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap_or(0);
    if !migrated {
        out.push(Finding::bad(
            "schema",
            Status::Problem,
            "no Strata schema in this database",
            "run `strata migrate`",
        ));
    } else {
        let have: i64 = client
            .one(
                "SELECT coalesce(max(version), 0)::bigint FROM strata.schema_migrations",
                &[],
            )
            .await?
            .get(0);
        if (have as u64) < latest as u64 {
            out.push(Finding::bad(
                "schema",
                Status::Problem,
                format!("migrated to {have}, this binary has {latest}"),
                "run `strata migrate`",
            ));
        } else {
            out.push(Finding::ok("schema", format!("migrated to {have}")));
        }
    }
    Ok(migrated)
}

/// Logical decoding: `wal_level` and the publication.
async fn decoding(client: &Client, out: &mut Vec<Finding>) -> Result<(), tokio_postgres::Error> {
    let wal_level = setting(client, "wal_level").await?;
    out.push(if wal_level == "logical" {
        Finding::ok("wal_level", "logical")
    } else {
        Finding::bad(
            "wal_level",
            Status::Problem,
            format!("wal_level is {wal_level}: no replication slot can decode the log"),
            "set wal_level = logical in postgresql.conf and restart the server",
        )
    });
    let publication: Option<bool> = client
        .opt(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                             WHERE pubname = 'strata_events' AND schemaname = 'strata' AND tablename = 'events')
               FROM pg_publication WHERE pubname = 'strata_events'",
            &[],
        )
        .await?
        .map(|r| r.get(0));
    out.push(match publication {
        Some(true) => Finding::ok("publication", "strata_events publishes strata.events"),
        Some(false) => Finding::bad(
            "publication",
            Status::Problem,
            "the publication strata_events does not include strata.events",
            "ALTER PUBLICATION strata_events ADD TABLE strata.events",
        ),
        None => Finding::bad(
            "publication",
            Status::Problem,
            "no publication strata_events: readers receive nothing",
            "run `strata migrate` (it creates the publication)",
        ),
    });
    Ok(())
}

/// Replication slots and WAL senders: room left, WAL kept, stale or lost slots.
async fn slots_and_senders(
    client: &Client,
    stale_after: Duration,
    out: &mut Vec<Finding>,
) -> Result<(), tokio_postgres::Error> {
    let row = client
        .one(
            "SELECT current_setting('max_replication_slots')::int,
                    (SELECT count(*) FROM pg_replication_slots)::int,
                    current_setting('max_wal_senders')::int,
                    (SELECT count(*) FROM pg_stat_replication)::int",
            &[],
        )
        .await?;
    let (max_slots, slots_used, max_senders, senders_used): (i32, i32, i32, i32) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    for (check, max, used, setting_name) in [
        (
            "replication_slots",
            max_slots,
            slots_used,
            "max_replication_slots",
        ),
        ("wal_senders", max_senders, senders_used, "max_wal_senders"),
    ] {
        let left = max - used;
        let detail = format!("{used} of {max} in use");
        out.push(if left <= 0 {
            Finding::bad(
                check,
                Status::Problem,
                detail,
                format!("raise {setting_name} (a restart) or drop unused slots: every Strata process that follows the log needs one"),
            )
        } else if left <= 2 {
            Finding::bad(
                check,
                Status::Warning,
                detail,
                format!("raise {setting_name}: only {left} left for new processes"),
            )
        } else {
            Finding::ok(check, detail)
        });
    }
    let keep = setting(client, "max_slot_wal_keep_size").await?;
    out.push(if keep == "-1" {
        Finding::bad(
            "max_slot_wal_keep_size",
            Status::Warning,
            "unlimited: a slot whose reader stalls keeps WAL until the disk is full",
            "set max_slot_wal_keep_size (e.g. 4GB); a reader whose slot loses WAL re-creates it and reads the gap from the table",
        )
    } else {
        Finding::ok("max_slot_wal_keep_size", keep)
    });
    let slots = crate::slots::list(client, stale_after).await?;
    let mut slot_findings = 0;
    for s in &slots {
        let retained = s
            .retained_bytes
            .map(|b| format!(", {} MB of WAL kept", b / 1_000_000))
            .unwrap_or_default();
        if s.wal_status.as_deref() == Some("lost") {
            slot_findings += 1;
            out.push(Finding::bad(
                "slots",
                Status::Problem,
                format!("slot {} lost WAL it needed", s.name),
                "its reader re-creates it when it starts; if none owns it: `strata slots drop` it",
            ));
        } else if s.stale {
            slot_findings += 1;
            out.push(Finding::bad(
                "slots",
                Status::Warning,
                format!(
                    "slot {} is not in use and its owner ({}) has not been seen for {}{retained}",
                    s.name,
                    s.owner.as_deref().unwrap_or("none registered"),
                    s.owner_seen_secs
                        .map(|x| format!("{x:.0} s"))
                        .unwrap_or_else(|| "ever".into()),
                ),
                format!(
                    "if its process is gone for good: `strata slots drop {}`",
                    s.name
                ),
            ));
        } else if s.wal_status.as_deref() == Some("unreserved") {
            slot_findings += 1;
            out.push(Finding::bad(
                "slots",
                Status::Warning,
                format!("slot {} is past max_slot_wal_keep_size{retained}", s.name),
                "its reader is behind; it will lose WAL and read the gap from the table",
            ));
        }
    }
    if slot_findings == 0 {
        out.push(Finding::ok(
            "slots",
            format!("{} slots, none stale", slots.len()),
        ));
    }
    Ok(())
}

/// This month's partition and the coming months'.
async fn partitions(client: &Client, out: &mut Vec<Finding>) -> Result<(), tokio_postgres::Error> {
    let row = client
        .one(
            "SELECT to_regclass(format('strata.%I', strata.partition_name(now()))) IS NOT NULL,
                    (SELECT count(*) FROM generate_series(1, $1::int) k
                      WHERE to_regclass(format('strata.%I',
                              strata.partition_name(now() + make_interval(months => k)))) IS NOT NULL)::int",
            &[&schema::partitions::DEFAULT_MONTHS_AHEAD],
        )
        .await?;
    let (this_month, ahead): (bool, i32) = (row.get(0), row.get(1));
    let want = schema::partitions::DEFAULT_MONTHS_AHEAD;
    out.push(if !this_month {
        Finding::bad(
            "partitions",
            Status::Problem,
            "no partition for this month",
            "run `strata partitions ensure` (appends create it too, at the cost of a lock)",
        )
    } else if ahead < want {
        Finding::bad(
            "partitions",
            Status::Warning,
            format!("{ahead} of the {want} coming months have a partition"),
            "run `strata partitions ensure`, or keep a `strata serve` process running (each keeps them ahead)",
        )
    } else {
        Finding::ok("partitions", format!("this month and {ahead} ahead"))
    });
    Ok(())
}

/// TLS on this connection.
async fn tls(client: &Client, out: &mut Vec<Finding>) -> Result<(), tokio_postgres::Error> {
    let ssl: Option<bool> = client
        .opt(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await?
        .map(|r| r.get(0));
    out.push(match ssl {
        Some(true) => Finding::ok("tls", "this connection is encrypted"),
        _ => Finding::bad(
            "tls",
            Status::Warning,
            "this connection is in the clear",
            "serve TLS (ssl = on, hostssl rules) and connect with sslmode=verify-full sslrootcert=<CA file>",
        ),
    });
    Ok(())
}

/// Standbys: a synchronous one named and connected, and how far each lags.
async fn standbys(client: &Client, out: &mut Vec<Finding>) -> Result<(), tokio_postgres::Error> {
    let names = setting(client, "synchronous_standby_names").await?;
    let standbys = client
        .rows(
            "SELECT application_name, sync_state, extract(epoch FROM coalesce(replay_lag, '0'))::float8
               FROM pg_stat_replication WHERE state = 'streaming'
                AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = pg_stat_replication.pid AND s.slot_type = 'logical')",
            &[],
        )
        .await?;
    let readers_synchronous: i64 = client
        .one(
            "SELECT count(*) FROM pg_stat_replication r
               JOIN pg_replication_slots s ON s.active_pid = r.pid AND s.slot_type = 'logical'
              WHERE r.sync_state IN ('sync', 'quorum')",
            &[],
        )
        .await?
        .get(0);
    if readers_synchronous > 0 {
        out.push(Finding::bad(
            "synchronous_standby",
            Status::Problem,
            format!("synchronous_standby_names = '{names}' makes {readers_synchronous} replication reader(s) synchronous standbys: commits wait for Strata's own readers, and those readers cannot hold back what the physical standbys lack"),
            "name the physical standbys (their application_name) in synchronous_standby_names, not '*'",
        ));
    }
    let sync_connected = standbys
        .iter()
        .any(|r| matches!(r.get::<_, String>(1).as_str(), "sync" | "quorum"));
    out.push(if names.trim().is_empty() {
        Finding::bad(
            "synchronous_standby",
            Status::Warning,
            format!(
                "none named ({} streaming standby(s)): a failover may lose the last acknowledged events",
                standbys.len()
            ),
            "set synchronous_standby_names so that every acknowledged event is on a standby too",
        )
    } else if !sync_connected {
        Finding::bad(
            "synchronous_standby",
            Status::Problem,
            format!("synchronous_standby_names = '{names}' but no synchronous standby is connected: every commit waits"),
            "start the standby, or clear synchronous_standby_names",
        )
    } else {
        Finding::ok("synchronous_standby", format!("'{names}', connected"))
    });
    if !names.trim().is_empty() {
        readers_not_holding(client, out).await?;
    }
    for r in &standbys {
        let (name, lag): (String, f64) = (r.get(0), r.get(2));
        if lag > 10.0 {
            out.push(Finding::bad(
                "standby_lag",
                Status::Warning,
                format!("standby {name} replays {lag:.1} s behind"),
                "a failover to it now would wait for it to catch up",
            ));
        }
    }
    Ok(())
}

/// Streaming readers that do not yet hold back what the synchronous
/// standbys lack (each reads the setting once per status interval): until
/// they do, a takeover may lose commits they delivered.
async fn readers_not_holding(
    client: &Client,
    out: &mut Vec<Finding>,
) -> Result<(), tokio_postgres::Error> {
    let slots = crate::slots::not_holding_for_standbys(client).await?;
    if !slots.is_empty() {
        out.push(Finding::bad(
            "synchronous_standby",
            Status::Warning,
            format!(
                "{} streaming reader(s) do not hold back yet what the standbys lack ({}): a takeover now may lose commits they delivered",
                slots.len(),
                slots.join(", ")
            ),
            "each reader reads synchronous_standby_names once per status interval (strata.replication_readers.holds_for_standbys); wait for them before relying on the standby",
        ));
    }
    Ok(())
}

/// Where takeovers cut the log (`strata.log_epochs`): a timeline's first
/// position, and the head the standby had when it took over.
async fn takeovers(client: &Client, out: &mut Vec<Finding>) -> Result<(), tokio_postgres::Error> {
    let has_epochs: bool = client
        .one("SELECT to_regclass('strata.log_epochs') IS NOT NULL", &[])
        .await?
        .get(0);
    if has_epochs {
        let rows = client
            .rows(
                "SELECT timeline, previous_head, first_position, started_at::text
                   FROM strata.log_epochs ORDER BY first_position",
                &[],
            )
            .await?;
        out.push(Finding::ok(
            "takeovers",
            if rows.is_empty() {
                "none recorded: the log is one epoch".to_string()
            } else {
                rows.iter()
                    .map(|r| {
                        format!(
                            "timeline {} began after position {} at {}, its positions from {}",
                            r.get::<_, i32>(0),
                            r.get::<_, i64>(1),
                            r.get::<_, String>(3),
                            r.get::<_, i64>(2)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            },
        ));
    }
    Ok(())
}
