//! Creating and changing a pool's queues: `queue.configured` on the pool's
//! stream, and `cohort.decay_set` (whether a cohort's fair share remembers
//! past usage), appended at the version of the pool the change was read from, so
//! two operators changing one queue at once cannot lose either change (the
//! second is read again and applied to the first), and a quota change
//! commits between placements, never inside a batch planned against the old
//! quota. The CLI (`strata queues`) and the client API come through here.

use crate::error::RequestError;
use crate::pools::pool_exists;
use crate::Fact;
use crate::{pool_stream, valid_name, QueueSpec};
use events::db::Sql;
use events::{AppendError, Appender, ExpectedVersion};
use std::collections::BTreeMap;
use tokio_postgres::Client;

/// How many times a change is read again after the pool moved under it
/// (placements move it all the time) before giving up.
const ATTEMPTS: u32 = 50;

/// The queues of `pool` as the log has them, and the pool stream's version
/// they were read at (read first: a change committed between the two reads
/// makes the append conflict, and the change is read again).
pub async fn specs(
    client: &Client,
    pool: &str,
) -> Result<(u64, BTreeMap<String, QueueSpec>), RequestError> {
    let stream = pool_stream(pool);
    let version: Option<i64> = client
        .opt(
            "SELECT version FROM strata.streams WHERE stream = $1",
            &[&stream],
        )
        .await?
        .map(|r| r.get(0));
    let Some(version) = version else {
        return Err(RequestError::NoSuchPool(pool.to_string()));
    };
    let rows = client
        .rows(
            "SELECT payload::text FROM strata.events
              WHERE stream = $1 AND type = 'queue.configured' ORDER BY position",
            &[&stream],
        )
        .await?;
    let mut out = BTreeMap::new();
    for row in rows {
        let payload: String = row.get(0);
        // A malformed spec is skipped, as the index skips it.
        if let Ok(spec) = serde_json::from_str::<QueueSpec>(&payload) {
            out.insert(spec.queue.clone(), spec);
        }
    }
    Ok((version as u64, out))
}

/// What a change does to the spec in force (`None`: the queue does not
/// exist yet): the spec to write, or why not.
pub type Edit<'a> =
    dyn Fn(Option<&QueueSpec>) -> Result<QueueSpec, RequestError> + Send + Sync + 'a;

/// For an edit that creates `queue`: refused if it exists already (`now`).
pub fn refuse_existing(
    pool: &str,
    queue: &str,
    now: Option<&QueueSpec>,
) -> Result<(), RequestError> {
    match now {
        Some(_) => Err(RequestError::QueueExists {
            pool: pool.to_string(),
            queue: queue.to_string(),
        }),
        None => Ok(()),
    }
}

/// For an edit that changes `queue`: the spec in force, or refused if there
/// is none.
pub fn existing<'a>(
    pool: &str,
    queue: &str,
    now: Option<&'a QueueSpec>,
) -> Result<&'a QueueSpec, RequestError> {
    now.ok_or_else(|| RequestError::NoSuchQueue {
        pool: pool.to_string(),
        queue: queue.to_string(),
    })
}

/// Applies `edit` to queue `queue` of `pool` and appends the result, with
/// `metadata` (who asked). Returns the spec written.
pub async fn configure(
    client: &Client,
    appender: &Appender,
    pool: &str,
    queue: &str,
    edit: &Edit<'_>,
    metadata: Option<&serde_json::Value>,
) -> Result<QueueSpec, RequestError> {
    valid_name("queue", queue).map_err(RequestError::Invalid)?;
    let build = |specs: &BTreeMap<String, QueueSpec>| {
        let spec = edit(specs.get(queue))?;
        if spec.queue != queue {
            return Err(RequestError::Invalid(format!(
                "the spec names queue {:?}, not {queue:?}",
                spec.queue
            )));
        }
        spec.validate().map_err(RequestError::Invalid)?;
        Ok((Fact::QueueConfigured(spec.clone()), spec))
    };
    append_at_read(client, appender, pool, &build, metadata).await
}

/// The half-life of past usage that a cohort's fair share forgets with
/// while its decay is off (kept so that turning it on acts at once).
pub const DEFAULT_HALF_LIFE_MS: u64 = 7 * 24 * 3_600_000;

/// The shortest half-life a cohort may have.
pub const MIN_HALF_LIFE_MS: u64 = 1_000;

/// The longest: past this, usage is as good as never forgotten.
pub const MAX_HALF_LIFE_MS: u64 = 366 * 24 * 3_600_000;

/// Turns the decayed fair share of `cohort` in `pool` on with a half-life,
/// or off (`None`): `cohort.decay_set`, appended at the pool's version its
/// queues were read at. Refused when no queue of the pool is in the cohort.
pub async fn set_decay(
    client: &Client,
    appender: &Appender,
    pool: &str,
    cohort: &str,
    half_life_ms: Option<u64>,
    metadata: Option<&serde_json::Value>,
) -> Result<(), RequestError> {
    if let Some(h) = half_life_ms {
        if !(MIN_HALF_LIFE_MS..=MAX_HALF_LIFE_MS).contains(&h) {
            return Err(RequestError::Invalid(format!(
                "a half-life must be between a second and 366 days, not {h} ms"
            )));
        }
    }
    let build = |specs: &BTreeMap<String, QueueSpec>| {
        if !specs.values().any(|s| s.cohort.as_deref() == Some(cohort)) {
            return Err(RequestError::Invalid(format!(
                "no queue of pool {pool} is in cohort {cohort:?} (see `strata queues list --pool {pool}`)"
            )));
        }
        let fact = Fact::CohortDecaySet {
            cohort: cohort.to_string(),
            half_life_ms,
        };
        Ok((fact, ()))
    };
    append_at_read(client, appender, pool, &build, metadata).await
}

/// What a change makes of the pool's queues as read: the fact to append
/// and what to answer, or why not.
type Build<'a, T> =
    dyn Fn(&BTreeMap<String, QueueSpec>) -> Result<(Fact, T), RequestError> + Send + Sync + 'a;

/// Reads the pool's queues, builds a fact from them and appends it at the
/// version they were read at, reading again while the pool moves.
async fn append_at_read<T>(
    client: &Client,
    appender: &Appender,
    pool: &str,
    build: &Build<'_, T>,
    metadata: Option<&serde_json::Value>,
) -> Result<T, RequestError> {
    if !pool_exists(client, pool).await? {
        return Err(RequestError::NoSuchPool(pool.to_string()));
    }
    let mut last = None;
    for attempt in 0..ATTEMPTS {
        let (version, specs) = specs(client, pool).await?;
        let (fact, answer) = build(&specs)?;
        let mut event = fact.to_event();
        if let Some(m) = metadata {
            event = event.with_metadata(m);
        }
        match appender
            .append(
                &pool_stream(pool),
                ExpectedVersion::Exact(version),
                vec![event],
            )
            .await
        {
            Ok(_) => return Ok(answer),
            Err(e @ AppendError::VersionConflict { .. }) => {
                last = Some(e);
                // The pool moved: read it again, a little later each time.
                tokio::time::sleep(std::time::Duration::from_millis(
                    (1 << attempt.min(6)) + fastrand::u64(0..5),
                ))
                .await;
            }
            Err(e) => return Err(RequestError::Append(e)),
        }
    }
    Err(RequestError::Append(last.expect("at least one attempt")))
}
