//! A pool's DCGM level: the `dcgmi diag` level its nodes' acceptance checks
//! run at (`strata pool policy --dcgm-level`), as `pool.dcgm_level_set` on
//! `dcgm-level/<pool>` (a stream of its own, so a gateway reads the newest
//! with one indexed lookup when a node opens a session), told to each node
//! in its Welcome. A node that does not run DCGM at all (`--dcgm-level 0`,
//! simulated GPUs) ignores it.

use events::{AppendError, Appender, ExpectedVersion, NewEvent};

/// The most thorough level `dcgmi diag -r` takes (extended).
pub const MAX_LEVEL: u32 = 4;

fn stream(pool: &str) -> String {
    format!("dcgm-level/{pool}")
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Set {
    pool: String,
    level: u32,
}

/// Sets `pool`'s level (1 quick to 4 extended; 0: DCGM is not run).
pub async fn set(
    appender: &Appender,
    pool: &str,
    level: u32,
    metadata: Option<&serde_json::Value>,
) -> Result<(), AppendError> {
    domain::valid_name("pool", pool).map_err(AppendError::Invalid)?;
    if level > MAX_LEVEL {
        return Err(AppendError::Invalid(format!(
            "a DCGM level is 0 (not run) to {MAX_LEVEL} (extended), not {level}"
        )));
    }
    let payload = serde_json::to_value(Set {
        pool: pool.to_string(),
        level,
    })
    .expect("levels serialize");
    let mut event = NewEvent::new(crate::catalog::POOL_DCGM_LEVEL_SET, &payload);
    if let Some(m) = metadata {
        event = event.with_metadata(m);
    }
    appender
        .append(&stream(pool), ExpectedVersion::Any, vec![event])
        .await
        .map(|_| ())
}

/// `pool`'s level, if one was set.
pub async fn level(
    client: &tokio_postgres::Client,
    pool: &str,
) -> Result<Option<u32>, tokio_postgres::Error> {
    let set: Option<Set> =
        crate::latest::current(client, &stream(pool), crate::catalog::POOL_DCGM_LEVEL_SET).await?;
    Ok(set.map(|s| s.level))
}
