//! The usage tables (`strata.usage_open`, `strata.usage_rollups`,
//! `strata.usage_node_rollups`): the open reservations read back, a
//! [`Delta`](super::fold::Delta) written, and both as they stand, read in one
//! snapshot. Times cross the wire as whole Unix milliseconds and are turned
//! into `timestamptz` (and back) exactly in SQL.

use super::fold::{AccountKey, Amounts, Delta, Fold, NodeGpus, NodeKey, Open, Period};
use events::db::Sql;
use std::collections::HashMap;
use tokio_postgres::GenericClient;

/// The durable subscription the tables are kept from.
pub const SUBSCRIPTION: &str = "usage";

/// Whole Unix milliseconds of a `timestamptz` column, exactly (rounded
/// down, as the keeper rounds the times it decodes).
pub(crate) fn ms_of(column: &str) -> String {
    format!("floor(extract(epoch FROM {column}) * 1000)::int8")
}
/// `timestamptz` from an SQL expression of whole Unix milliseconds, exactly.
pub(crate) fn at(expr: &str) -> String {
    format!("(timestamptz 'epoch' + {expr} * interval '1 millisecond')")
}

/// Open reservations matching `filter` (SQL over `strata.usage_open`'s
/// columns, with `params`).
pub async fn open_where<C: GenericClient + Sync>(
    db: &C,
    filter: &str,
    params: &[&dyn events::db::Param],
) -> Result<Vec<Open>, tokio_postgres::Error> {
    let sql = format!(
        "SELECT reservation, pool, queue, owner, class, {}, {}, {}, allocations::text
           FROM strata.usage_open WHERE {filter}",
        ms_of("requested_at"),
        ms_of("placed_at"),
        ms_of("activated_at")
    );
    let rows = db.rows(&sql, params).await?;
    Ok(rows
        .iter()
        .map(|r| Open {
            reservation: r.get(0),
            pool: r.get(1),
            queue: r.get(2),
            owner: r.get(3),
            class: r.get(4),
            requested_ms: r.get(5),
            placed_ms: r.get(6),
            activated_ms: r.get(7),
            allocations: serde_json::from_str::<Vec<NodeGpus>>(&r.get::<_, String>(8))
                .unwrap_or_default(),
        })
        .collect())
}

/// Every open reservation.
pub async fn load_open<C: GenericClient + Sync>(
    db: &C,
) -> Result<Vec<Open>, tokio_postgres::Error> {
    open_where(db, "true", &[]).await
}

/// A read-only transaction in one snapshot (repeatable read), in which the
/// tables and the subscription's cursor agree.
pub async fn snapshot(
    client: &mut tokio_postgres::Client,
) -> Result<tokio_postgres::Transaction<'_>, tokio_postgres::Error> {
    client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
}

/// Where the tables stand in the log: the `usage` subscription's cursor
/// (`None`: the role never ran).
pub async fn position<C: GenericClient + Sync>(
    db: &C,
) -> Result<Option<u64>, tokio_postgres::Error> {
    events::stored_cursor(db, SUBSCRIPTION).await
}

/// Writes what `delta` changed, inside the caller's transaction: the
/// rollups' increments, and the open rows as `fold` now holds them.
pub async fn write<C: GenericClient + Sync>(
    tx: &C,
    fold: &Fold,
    delta: &Delta,
) -> Result<(), tokio_postgres::Error> {
    if !delta.ended.is_empty() {
        let ended: Vec<&str> = delta.ended.iter().map(String::as_str).collect();
        tx.exec(
            "DELETE FROM strata.usage_open WHERE reservation = ANY($1)",
            &[&ended],
        )
        .await?;
    }
    let open: Vec<&Open> = delta
        .touched
        .iter()
        .filter_map(|id| fold.open.get(id))
        .collect();
    if !open.is_empty() {
        let col = |f: fn(&Open) -> String| open.iter().map(|o| f(o)).collect::<Vec<String>>();
        let (ids, pools, queues, owners, classes) = (
            col(|o| o.reservation.clone()),
            col(|o| o.pool.clone()),
            col(|o| o.queue.clone()),
            col(|o| o.owner.clone()),
            col(|o| o.class.clone()),
        );
        let allocations = col(|o| serde_json::to_string(&o.allocations).unwrap_or_default());
        let requested: Vec<i64> = open.iter().map(|o| o.requested_ms).collect();
        let placed: Vec<Option<i64>> = open.iter().map(|o| o.placed_ms).collect();
        let activated: Vec<Option<i64>> = open.iter().map(|o| o.activated_ms).collect();
        let sql = format!(
            "INSERT INTO strata.usage_open
                 (reservation, pool, queue, owner, class, requested_at, placed_at, activated_at, allocations)
             SELECT id, pool, queue, owner, class, {}, {}, {}, allocations::jsonb
               FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                           $6::int8[], $7::int8[], $8::int8[], $9::text[])
                    AS u(id, pool, queue, owner, class, requested, placed, activated, allocations)
             ON CONFLICT (reservation) DO UPDATE SET
                 pool = EXCLUDED.pool, queue = EXCLUDED.queue, owner = EXCLUDED.owner,
                 class = EXCLUDED.class, requested_at = EXCLUDED.requested_at,
                 placed_at = EXCLUDED.placed_at, activated_at = EXCLUDED.activated_at,
                 allocations = EXCLUDED.allocations",
            at("requested"),
            at("placed"),
            at("activated")
        );
        tx.exec(
            &sql,
            &[
                &ids,
                &pools,
                &queues,
                &owners,
                &classes,
                &requested,
                &placed,
                &activated,
                &allocations,
            ],
        )
        .await?;
    }
    let accounts: Vec<_> = delta.accounts.iter().collect();
    let keys =
        |f: fn(&AccountKey) -> &str| accounts.iter().map(|(k, _)| f(k).to_string()).collect();
    upsert(
        tx,
        "strata.usage_rollups",
        &["pool", "queue", "owner", "class"],
        [
            keys(|k| &k.pool),
            keys(|k| &k.queue),
            keys(|k| &k.owner),
            keys(|k| &k.class),
        ],
        accounts.iter().map(|(k, a)| (k.period, k.start_ms, **a)),
    )
    .await?;
    let nodes: Vec<_> = delta.nodes.iter().collect();
    let keys = |f: fn(&NodeKey) -> &str| nodes.iter().map(|(k, _)| f(k).to_string()).collect();
    upsert(
        tx,
        "strata.usage_node_rollups",
        &["pool", "node", "class"],
        [keys(|k| &k.pool), keys(|k| &k.node), keys(|k| &k.class)],
        nodes.iter().map(|(k, a)| (k.period, k.start_ms, **a)),
    )
    .await?;
    Ok(())
}

/// Adds rows' amounts to a rollup table: `names` its key columns besides
/// the bucket, `keys` their values (one vector per column), `amounts` each
/// row's bucket and amounts (`ended` only where the table has it).
async fn upsert<C: GenericClient + Sync, const N: usize>(
    tx: &C,
    table: &str,
    names: &[&str; N],
    keys: [Vec<String>; N],
    amounts: impl Iterator<Item = (Period, i64, Amounts)>,
) -> Result<(), tokio_postgres::Error> {
    let (mut periods, mut starts, mut active, mut held, mut ended) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (p, s, a) in amounts {
        periods.push(p.name().to_string());
        starts.push(s);
        active.push(a.active_gpu_ms);
        held.push(a.held_gpu_ms);
        ended.push(a.ended);
    }
    if periods.is_empty() {
        return Ok(());
    }
    let has_ended = table == "strata.usage_rollups";
    let cols = names.join(", ");
    let arrays: Vec<String> = (0..N).map(|i| format!("${}::text[]", i + 6)).collect();
    let sql = format!(
        "INSERT INTO {table} (period, start, {cols}, active_gpu_ms, held_gpu_ms{e})
         SELECT period, {at}, {cols}, active, held{e}
           FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], {arrays})
                AS u(period, start, active, held, ended, {cols})
         ON CONFLICT (period, start, {cols}) DO UPDATE SET
             active_gpu_ms = {table}.active_gpu_ms + EXCLUDED.active_gpu_ms,
             held_gpu_ms = {table}.held_gpu_ms + EXCLUDED.held_gpu_ms{e_set}",
        e = if has_ended { ", ended" } else { "" },
        e_set = if has_ended {
            format!(", ended = {table}.ended + EXCLUDED.ended")
        } else {
            String::new()
        },
        at = at("start"),
        arrays = arrays.join(", "),
    );
    let mut params: Vec<&dyn events::db::Param> = vec![&periods, &starts, &active, &held, &ended];
    params.extend(keys.iter().map(|k| k as &dyn events::db::Param));
    tx.exec(&sql, &params).await?;
    Ok(())
}

/// Everything the usage tables hold, for comparing with a fold of the log.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Tables {
    pub open: Vec<Open>,
    pub accounts: HashMap<AccountKey, Amounts>,
    pub nodes: HashMap<NodeKey, Amounts>,
}

/// Reads every usage table (call inside one snapshot).
pub async fn read_all<C: GenericClient + Sync>(db: &C) -> Result<Tables, tokio_postgres::Error> {
    let open = load_open(db).await?;
    let period = |s: String| Period::from_name(&s).unwrap_or(Period::Hour);
    let sql = format!(
        "SELECT period, {}, pool, queue, owner, class, active_gpu_ms, held_gpu_ms, ended
           FROM strata.usage_rollups",
        ms_of("start")
    );
    let accounts = db
        .rows(&sql, &[])
        .await?
        .into_iter()
        .map(|r| {
            (
                AccountKey {
                    period: period(r.get(0)),
                    start_ms: r.get(1),
                    pool: r.get(2),
                    queue: r.get(3),
                    owner: r.get(4),
                    class: r.get(5),
                },
                Amounts {
                    active_gpu_ms: r.get(6),
                    held_gpu_ms: r.get(7),
                    ended: r.get(8),
                },
            )
        })
        .collect();
    let sql = format!(
        "SELECT period, {}, pool, node, class, active_gpu_ms, held_gpu_ms
           FROM strata.usage_node_rollups",
        ms_of("start")
    );
    let nodes = db
        .rows(&sql, &[])
        .await?
        .into_iter()
        .map(|r| {
            (
                NodeKey {
                    period: period(r.get(0)),
                    start_ms: r.get(1),
                    pool: r.get(2),
                    node: r.get(3),
                    class: r.get(4),
                },
                Amounts {
                    active_gpu_ms: r.get(5),
                    held_gpu_ms: r.get(6),
                    ended: 0,
                },
            )
        })
        .collect();
    Ok(Tables {
        open,
        accounts,
        nodes,
    })
}
