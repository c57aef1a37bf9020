//! A caller's durable subscriptions over the client API: named
//! `api.<caller>.<name>` in `strata.subscriptions`, at most so many per
//! caller, listed and deleted by their caller. The cap is counted in the
//! table once a new subscription's row is made: over it, the new one is
//! closed and forgotten again (two new ones at once may both be refused,
//! never both kept).

use events::db::Sql;
use tonic::Status;

/// The row name of `caller`'s subscription `name`.
pub(crate) fn row_name(caller: &str, name: &str) -> String {
    format!("api.{caller}.{name}")
}

fn prefix(caller: &str) -> String {
    format!("api.{caller}.")
}

fn db(e: tokio_postgres::Error) -> Status {
    Status::unavailable(format!("database: {e}"))
}

/// Whether `caller`'s subscription `name` exists (and so does not count
/// as a new one).
pub(crate) async fn exists(
    client: &tokio_postgres::Client,
    caller: &str,
    name: &str,
) -> Result<bool, Status> {
    Ok(client
        .opt(
            "SELECT 1 FROM strata.subscriptions WHERE name = $1",
            &[&row_name(caller, name)],
        )
        .await
        .map_err(db)?
        .is_some())
}

/// How many subscriptions `caller` holds, if more than `cap`.
pub(crate) async fn over_cap(
    client: &tokio_postgres::Client,
    caller: &str,
    cap: u64,
) -> Result<Option<i64>, Status> {
    let held: i64 = client
        .one(
            "SELECT count(*) FROM strata.subscriptions WHERE left(name, length($1)) = $1",
            &[&prefix(caller)],
        )
        .await
        .map_err(db)?
        .get(0);
    Ok((held as u64 > cap).then_some(held))
}

/// Forgets a new subscription refused over the cap (closed already).
pub(crate) async fn forget(client: &tokio_postgres::Client, caller: &str, name: &str) {
    let row = row_name(caller, name);
    if let Err(e) = client
        .exec("DELETE FROM strata.subscriptions WHERE name = $1", &[&row])
        .await
    {
        tracing::warn!(subscription = %row, error = %e, "could not forget a subscription refused over the cap");
    }
}

/// `caller`'s subscriptions: name (without the prefix), cursor, open now.
pub(crate) async fn list(
    client: &tokio_postgres::Client,
    caller: &str,
) -> Result<Vec<(String, u64, bool)>, Status> {
    let p = prefix(caller);
    let rows = client
        .rows(
            "SELECT substr(s.name, length($1) + 1), s.position,
                    EXISTS (SELECT 1 FROM strata.leases l
                             WHERE l.name = 'subscription/' || s.name
                               AND strata.lease_until(l.expires_at, l.renewed_at) > now())
               FROM strata.subscriptions s WHERE left(s.name, length($1)) = $1 ORDER BY s.name",
            &[&p],
        )
        .await
        .map_err(db)?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get::<_, i64>(1) as u64, r.get(2)))
        .collect())
}

/// Deletes `caller`'s subscription `name`, unless a stream holds it open.
pub(crate) async fn delete(
    client: &tokio_postgres::Client,
    caller: &str,
    name: &str,
) -> Result<(), Status> {
    let row = row_name(caller, name);
    let r = client
        .one(
            "WITH gone AS (
                DELETE FROM strata.subscriptions s WHERE s.name = $1
                   AND NOT EXISTS (SELECT 1 FROM strata.leases l
                                    WHERE l.name = 'subscription/' || s.name
                                      AND strata.lease_until(l.expires_at, l.renewed_at) > now())
                RETURNING 1)
             SELECT (SELECT count(*) FROM gone),
                    (SELECT count(*) FROM strata.subscriptions WHERE name = $1)",
            &[&row],
        )
        .await
        .map_err(db)?;
    let (gone, there): (i64, i64) = (r.get(0), r.get(1));
    match (gone, there) {
        (1, _) => Ok(()),
        (_, 0) => Err(Status::not_found(format!("no subscription {name:?}"))),
        _ => Err(Status::failed_precondition(format!(
            "subscription {name:?} is open on a stream; close it first"
        ))),
    }
}
