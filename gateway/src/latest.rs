//! State held as the newest event of a named stream (`role/<operator>`,
//! `grant/<caller>`): in force when that event is of the type that sets it
//! (`role.set`, `grant.set`), gone when it is any other (`role.removed`,
//! `grant.revoked`).

use events::db::Sql;
use serde::de::DeserializeOwned;

/// The payload of `stream`'s newest event when it is of type `set`.
pub async fn current<T: DeserializeOwned>(
    client: &tokio_postgres::Client,
    stream: &str,
    set: &str,
) -> Result<Option<T>, tokio_postgres::Error> {
    let row = client
        .opt(
            "SELECT type, payload::text FROM strata.events WHERE stream = $1
              ORDER BY version DESC LIMIT 1",
            &[&stream],
        )
        .await?;
    Ok(row.and_then(|r| {
        (r.get::<_, &str>(0) == set)
            .then(|| serde_json::from_str(r.get(1)).ok())
            .flatten()
    }))
}

/// For every stream under `prefix` (which ends in `/`), its name after the
/// prefix and the payload of its newest event when that is of type `set`.
pub async fn all<T: DeserializeOwned>(
    client: &tokio_postgres::Client,
    prefix: &str,
    set: &str,
) -> Result<Vec<(String, T)>, tokio_postgres::Error> {
    debug_assert!(prefix.ends_with('/'));
    // A range on the (stream, version) index: '0' follows '/'.
    let end = format!("{}0", &prefix[..prefix.len() - 1]);
    let rows = client
        .rows(
            "SELECT DISTINCT ON (stream) stream, type, payload::text FROM strata.events
              WHERE stream >= $1 AND stream < $2 ORDER BY stream, version DESC",
            &[&prefix, &end],
        )
        .await?;
    Ok(rows
        .iter()
        .filter(|r| r.get::<_, &str>(1) == set)
        .filter_map(|r| {
            let name = r.get::<_, &str>(0).strip_prefix(prefix)?.to_string();
            Some((name, serde_json::from_str(r.get(2)).ok()?))
        })
        .collect())
}
