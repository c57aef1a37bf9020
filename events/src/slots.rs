//! Listing and dropping replication slots, with the reader that owns each.

use schema::sql::Sql;
use std::time::Duration;
use tokio_postgres::Client;

/// One replication slot as `strata slots list` shows it.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    pub name: String,
    pub plugin: Option<String>,
    pub active: bool,
    pub temporary: bool,
    /// The reader that owns it: `owner@host pid N`, if one registered.
    pub owner: Option<String>,
    /// Seconds since its owner was last seen.
    pub owner_seen_secs: Option<f64>,
    /// WAL between the server's position and what the slot confirmed.
    pub lag_bytes: Option<i64>,
    /// WAL the slot makes the server keep.
    pub retained_bytes: Option<i64>,
    pub wal_status: Option<String>,
    /// The owner has not been seen for longer than the bound (or never was).
    pub stale: bool,
}

/// The active logical slots whose reader does not hold back yet what the
/// synchronous standbys lack (`replication_readers.holds_for_standbys`:
/// each reader reads the setting once per status interval), by name; none
/// on a schema older than that column.
pub async fn not_holding_for_standbys(
    client: &Client,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let recorded: bool = client
        .one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                             WHERE table_schema = 'strata' AND table_name = 'replication_readers'
                               AND column_name = 'holds_for_standbys')",
            &[],
        )
        .await?
        .get(0);
    if !recorded {
        return Ok(Vec::new());
    }
    Ok(client
        .rows(
            "SELECT s.slot_name::text FROM pg_replication_slots s
               JOIN strata.replication_readers r ON r.slot_name = s.slot_name::text
              WHERE s.active AND s.slot_type = 'logical' AND NOT r.holds_for_standbys
              ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Every slot on the server, flagged stale when its owner has not been seen
/// for longer than `stale_after` and the slot is not in use.
pub async fn list(
    client: &Client,
    stale_after: Duration,
) -> Result<Vec<SlotInfo>, tokio_postgres::Error> {
    let readers_exist: bool = client
        .one(
            "SELECT to_regclass('strata.replication_readers') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    let owner_join = if readers_exist {
        "LEFT JOIN strata.replication_readers r ON r.slot_name = s.slot_name"
    } else {
        "LEFT JOIN (SELECT NULL::text AS slot_name, NULL::text AS owner, NULL::text AS host, NULL::int AS pid, NULL::timestamptz AS seen_at) r ON false"
    };
    let rows = client
        .rows(
            &format!(
                "SELECT s.slot_name::text, s.plugin::text, s.active, s.temporary,
                        CASE WHEN r.owner IS NULL THEN NULL ELSE r.owner || '@' || r.host || ' pid ' || r.pid END,
                        extract(epoch FROM now() - r.seen_at)::float8,
                        (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint,
                        (pg_current_wal_lsn() - s.restart_lsn)::bigint,
                        s.wal_status
                   FROM pg_replication_slots s {owner_join}
                  ORDER BY s.slot_name"
            ),
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let active: bool = r.get(2);
            let seen: Option<f64> = r.get(5);
            SlotInfo {
                name: r.get(0),
                plugin: r.get(1),
                active,
                temporary: r.get(3),
                owner: r.get(4),
                owner_seen_secs: seen,
                lag_bytes: r.get(6),
                retained_bytes: r.get(7),
                wal_status: r.get(8),
                stale: !active && seen.is_none_or(|s| s > stale_after.as_secs_f64()),
            }
        })
        .collect())
}

/// Why a slot could not be dropped.
#[derive(Debug, thiserror::Error)]
pub enum DropError {
    #[error("no replication slot named {0:?}")]
    NotFound(String),
    #[error("slot {0:?} is in use by a running reader (pid {1}); stop it first, or pass --force to end its connection")]
    Active(String, i32),
    #[error("drop the slot: {0}")]
    Database(#[from] tokio_postgres::Error),
}

/// Drops a slot and forgets its reader. With `force`, ends the connection
/// using it first.
pub async fn drop_slot(client: &Client, name: &str, force: bool) -> Result<(), DropError> {
    let row = client
        .opt(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&name],
        )
        .await?
        .ok_or_else(|| DropError::NotFound(name.to_string()))?;
    if let Some(pid) = row.get::<_, Option<i32>>(0) {
        if !force {
            return Err(DropError::Active(name.to_string(), pid));
        }
        client
            .exec("SELECT pg_terminate_backend($1)", &[&pid])
            .await?;
        // The walsender releases the slot as it exits.
        for _ in 0..100 {
            let active: Option<i32> = client
                .one(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                    &[&name],
                )
                .await?
                .get(0);
            if active.is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    client
        .exec("SELECT pg_drop_replication_slot($1)", &[&name])
        .await?;
    let _ = client
        .exec(
            "DELETE FROM strata.replication_readers WHERE slot_name = $1",
            &[&name],
        )
        .await;
    Ok(())
}

/// The slots' gauges on `/metrics`, refreshed by [`watch`].
struct SlotGauges {
    retained: prometheus::GaugeVec,
    active: prometheus::GaugeVec,
    stale: prometheus::GaugeVec,
}

fn gauges() -> &'static SlotGauges {
    static G: std::sync::OnceLock<SlotGauges> = std::sync::OnceLock::new();
    G.get_or_init(|| {
        let vec = |name: &str, help: &str| {
            let g = prometheus::GaugeVec::new(prometheus::Opts::new(name, help), &["slot"])
                .expect("valid gauge");
            ops::metrics::register(Box::new(g.clone()));
            g
        };
        SlotGauges {
            retained: vec(
                "strata_slot_retained_wal_bytes",
                "WAL the replication slot makes the server keep (read every few seconds by the maintenance role).",
            ),
            active: vec(
                "strata_slot_active",
                "1 while a connection streams from the replication slot.",
            ),
            stale: vec(
                "strata_slot_stale",
                "1 when the slot is unused and its reader has not been seen for a minute (strata slots list; strata slots drop).",
            ),
        }
    })
}

/// Reads the server's replication slots every `every` and sets their
/// gauges; a slot that is gone is gone from the next scrape. Runs until
/// dropped; a failed read is logged and tried again at the next tick.
pub async fn watch(db: crate::db::Database, every: Duration) {
    let db = crate::db::SharedClient::new(db);
    let g = gauges();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let slots = match db.get().await {
            Ok(c) => list(&c, Duration::from_secs(60)).await,
            Err(e) => {
                tracing::warn!(error = %e, "slot metrics: cannot connect; trying again");
                continue;
            }
        };
        match slots {
            Ok(slots) => {
                g.retained.reset();
                g.active.reset();
                g.stale.reset();
                for s in slots {
                    let l = [s.name.as_str()];
                    g.retained
                        .with_label_values(&l)
                        .set(s.retained_bytes.unwrap_or(0) as f64);
                    g.active
                        .with_label_values(&l)
                        .set(f64::from(u8::from(s.active)));
                    g.stale
                        .with_label_values(&l)
                        .set(f64::from(u8::from(s.stale)));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "slot metrics: could not list the slots; trying again");
                db.reset().await;
            }
        }
    }
}
