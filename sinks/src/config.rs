//! Sink definitions, kept as events on `sink/<name>` (`sink.created`,
//! `sink.paused`, `sink.resumed`, `sink.deleted`), so every change to a sink
//! is in the log like everything else.

use events::db::Sql;
use events::{AppendError, Appender, Event, ExpectedVersion, NewEvent};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A webhook's secret is read from a variable of the sinks process whose name
/// starts with this, so a sink cannot be pointed at any other variable of
/// that process (its database URL, say) and hand it to the receiver as a key.
pub const SECRET_ENV_PREFIX: &str = "STRATA_SINK_SECRET_";

/// Whether `name` may hold a webhook's secret: the prefix, then at least one
/// of `A-Z`, `0-9` or `_`.
pub fn check_secret_env(name: &str) -> Result<(), String> {
    match name.strip_prefix(SECRET_ENV_PREFIX) {
        Some(rest)
            if !rest.is_empty()
                && rest
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_') =>
        {
            Ok(())
        }
        _ => Err(format!(
            "secret variable {name:?}: a webhook's secret must be in a variable named \
             {SECRET_ENV_PREFIX}<NAME> (A-Z, 0-9, _), so no other variable of the sinks \
             process can become a key"
        )),
    }
}

pub fn sink_stream(name: &str) -> String {
    format!("sink/{name}")
}

/// Which events a sink takes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Filter {
    /// Event types; all when empty.
    #[serde(default)]
    pub types: Vec<String>,
    /// Stream prefixes such as `pool/`; all when empty.
    #[serde(default)]
    pub prefixes: Vec<String>,
}

impl Filter {
    pub fn matches(&self, e: &Event) -> bool {
        (self.types.is_empty() || self.types.contains(&e.event_type))
            && (self.prefixes.is_empty() || self.prefixes.iter().any(|p| e.stream.starts_with(p)))
    }
}

/// Where a sink delivers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Target {
    /// Batches POSTed as JSON, signed with HMAC-SHA256 using the secret in
    /// the sinks process's environment variable `secret_env`, whose name
    /// starts with [`SECRET_ENV_PREFIX`] (the secret itself is never in the
    /// log).
    Webhook { url: String, secret_env: String },
    /// Published to NATS JetStream, one message per event, on the subject
    /// `<subject_prefix>.<stream's segments>.<noun>.<verb>` (each token
    /// escaped, see `nats::subject_of`), with `<region>:<sink>:<position>`
    /// as `Nats-Msg-Id`, so a publish retried within the stream's duplicate
    /// window is stored once.
    Nats { url: String, subject_prefix: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkConfig {
    pub name: String,
    pub target: Target,
    #[serde(default)]
    pub filter: Filter,
    /// `start`, `now` or a position.
    #[serde(default = "default_start")]
    pub start: String,
    #[serde(default = "default_batch")]
    pub batch_max: usize,
    /// Attempts before a batch is parked.
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
    /// The waits between attempts; absent, the sinks process's defaults
    /// (`Retry::default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<Retry>,
    /// The target's URL had credentials, kept apart from the log (see
    /// [`crate::credentials`]); the URL here is without them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub credentials: bool,
}

/// Backoff between a batch's attempts: before attempt n+1 a wait drawn
/// between half and all of `min(base * 2^n, cap)` (jitter that keeps the
/// waits from collapsing to nothing). With the defaults (500 ms, 10 s) and
/// 8 attempts a batch is retried for 22 s to 45 s before it is parked, so
/// a receiver's restart does not park it, let alone pause the sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retry {
    pub base_ms: u64,
    pub cap_ms: u64,
}

impl Default for Retry {
    fn default() -> Self {
        Retry {
            base_ms: 500,
            cap_ms: 10_000,
        }
    }
}

impl Retry {
    pub fn base(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.base_ms)
    }
    pub fn cap(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.cap_ms)
    }
    /// The shortest and the longest a batch is retried for in all, over
    /// `attempts` attempts.
    pub fn bounds(&self, attempts: u32) -> (std::time::Duration, std::time::Duration) {
        let mut most = std::time::Duration::ZERO;
        for n in 1..attempts.max(1) {
            most += crate::webhook::ceiling(self.base(), self.cap(), n);
        }
        (most / 2, most)
    }
}

fn default_start() -> String {
    "start".into()
}
fn default_batch() -> usize {
    500
}
fn default_attempts() -> u32 {
    8
}

impl SinkConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty()
            || self.name.len() > 100
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(format!(
                "sink name {:?}: 1 to 100 letters, digits, '-' or '_'",
                self.name
            ));
        }
        self.start.parse::<events::Start>()?;
        if let Some(r) = &self.retry {
            if r.base_ms == 0 || r.cap_ms < r.base_ms || r.cap_ms > 3_600_000 {
                return Err(format!(
                    "retry backoff {}ms to {}ms: the base must be above 0 and at most the cap, the cap at most an hour",
                    r.base_ms, r.cap_ms
                ));
            }
        }
        if self.batch_max == 0 || self.batch_max > 10_000 {
            return Err("batch size must be 1 to 10,000".into());
        }
        if self.max_attempts == 0 || self.max_attempts > 100 {
            return Err("attempts must be 1 to 100".into());
        }
        match &self.target {
            Target::Nats {
                url,
                subject_prefix,
            } => {
                if !url.starts_with("nats://") {
                    return Err(format!("NATS url {url:?}: use nats://host:port"));
                }
                if subject_prefix.is_empty()
                    || subject_prefix.contains([' ', '*', '>'])
                    || subject_prefix.starts_with('.')
                    || subject_prefix.ends_with('.')
                {
                    return Err(format!(
                        "subject prefix {subject_prefix:?}: a NATS subject without wildcards"
                    ));
                }
            }
            Target::Webhook { url, secret_env } => {
                match url.parse::<hyper::Uri>() {
                    Ok(u)
                        if matches!(u.scheme_str(), Some("http" | "https"))
                            && u.host().is_some() => {}
                    _ => {
                        return Err(format!(
                            "webhook url {url:?}: use http://host[:port]/path or https://host[:port]/path"
                        ))
                    }
                }
                check_secret_env(secret_env)?;
            }
        }
        Ok(())
    }
}

impl SinkConfig {
    /// The target's URL.
    pub fn url(&self) -> &str {
        match &self.target {
            Target::Webhook { url, .. } | Target::Nats { url, .. } => url,
        }
    }

    fn url_mut(&mut self) -> &mut String {
        match &mut self.target {
            Target::Webhook { url, .. } | Target::Nats { url, .. } => url,
        }
    }

    /// This config as the log keeps it, with its URL's credentials (if any)
    /// taken out.
    pub fn without_credentials(&self) -> (SinkConfig, Option<String>) {
        let mut c = self.clone();
        let (bare, userinfo) = crate::credentials::split(c.url());
        *c.url_mut() = bare;
        c.credentials = c.credentials || userinfo.is_some();
        (c, userinfo)
    }

    /// This config as it may be printed: credentials in its URL (a sink
    /// recorded before they were kept apart) hidden.
    pub fn printable(&self) -> SinkConfig {
        let mut c = self.clone();
        *c.url_mut() = crate::credentials::redact(c.url());
        c
    }

    /// This config with its URL's credentials put back from the database,
    /// to connect with (never to print or record).
    pub async fn with_credentials(
        &self,
        client: &(impl tokio_postgres::GenericClient + Sync),
    ) -> Result<SinkConfig, SinkError> {
        let mut c = self.clone();
        if c.credentials {
            match crate::credentials::load(client, &c.name).await? {
                Some(u) => *c.url_mut() = crate::credentials::join(c.url(), &u),
                None => {
                    tracing::warn!(sink = %c.name, "the sink's URL had credentials, and none are kept for it now; connecting without")
                }
            }
        }
        Ok(c)
    }
}

/// A sink as the log has it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SinkState {
    pub config: SinkConfig,
    pub paused: bool,
    pub deleted: bool,
    /// The sink stream's version.
    pub version: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("invalid sink: {0}")]
    Invalid(String),
    #[error("sink {0:?} already exists")]
    Exists(String),
    #[error("sink {0:?} does not exist")]
    NotFound(String),
    #[error(transparent)]
    Append(#[from] AppendError),
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
}

/// Records a sink whose URL has no credentials (a URL with some is
/// refused: [`create_in`] keeps them apart from the log).
pub async fn create(appender: &Appender, config: &SinkConfig) -> Result<(), SinkError> {
    config.validate().map_err(SinkError::Invalid)?;
    if config.without_credentials().1.is_some() {
        return Err(SinkError::Invalid(
            "this URL has credentials, which are kept apart from the log: create the sink with `strata sinks create`".into(),
        ));
    }
    let payload = serde_json::to_value(config).expect("configs serialize");
    match appender
        .append(
            &sink_stream(&config.name),
            ExpectedVersion::NoStream,
            vec![NewEvent::new(crate::catalog::SINK_CREATED, &payload)],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(AppendError::VersionConflict { .. }) => Err(SinkError::Exists(config.name.clone())),
        Err(e) => Err(e.into()),
    }
}

/// Appends `sink.paused`, `sink.resumed` or `sink.deleted`.
pub async fn change(appender: &Appender, name: &str, event_type: &str) -> Result<(), SinkError> {
    match appender
        .append(
            &sink_stream(name),
            ExpectedVersion::StreamExists,
            vec![NewEvent::new(
                event_type,
                &serde_json::json!({ "name": name }),
            )],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(AppendError::VersionConflict { .. }) => Err(SinkError::NotFound(name.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// Every sink, folded from its stream.
pub async fn list(client: &tokio_postgres::Client) -> Result<Vec<SinkState>, SinkError> {
    Ok(fold(client, None)
        .await?
        .into_iter()
        .filter(|s| !s.deleted)
        .collect())
}

/// One sink as its stream has it now, deleted or not; `None` for a name
/// never used.
pub async fn state(
    client: &(impl tokio_postgres::GenericClient + Sync),
    name: &str,
) -> Result<Option<SinkState>, SinkError> {
    Ok(fold(client, Some(name)).await?.pop())
}

/// Creates a sink, or defines a deleted sink's name again. The new sink
/// starts where its definition says, with none of the old one's cursor or
/// parked events: they go in the same transaction as its `sink.created`,
/// which is appended at the deleted stream's exact version, so two
/// creators cannot both win. Refused while a worker of the deleted sink
/// still holds its subscription.
pub async fn create_in(
    client: &mut tokio_postgres::Client,
    config: &SinkConfig,
) -> Result<(), SinkError> {
    config.validate().map_err(SinkError::Invalid)?;
    let name = &config.name;
    let tx = client.transaction().await?;
    let expected = match state(&tx, name).await? {
        None => ExpectedVersion::NoStream,
        Some(s) if !s.deleted => return Err(SinkError::Exists(name.clone())),
        Some(s) => {
            let subscription = format!("sink.{name}");
            if worker_holds(&tx, name).await? {
                return Err(SinkError::Invalid(format!(
                    "the deleted sink {name:?} is still being stopped; try again in a moment"
                )));
            }
            tx.exec(
                "DELETE FROM strata.subscriptions WHERE name = $1",
                &[&subscription],
            )
            .await?;
            tx.exec("DELETE FROM strata.sink_parked WHERE sink = $1", &[name])
                .await?;
            ExpectedVersion::Exact(s.version)
        }
    };
    // Credentials in the URL go to their own table, in this transaction;
    // the event says only that they exist.
    let (recorded, userinfo) = config.without_credentials();
    crate::credentials::store(&tx, name, userinfo.as_deref()).await?;
    let payload = serde_json::to_value(&recorded).expect("configs serialize");
    let event = NewEvent::new(crate::catalog::SINK_CREATED, &payload);
    match events::append::append_one_in(&tx, sink_stream(name), expected, vec![event]).await {
        Ok(_) => {}
        Err(AppendError::VersionConflict { .. }) => return Err(SinkError::Exists(name.clone())),
        Err(e) => return Err(e.into()),
    }
    tx.commit().await?;
    Ok(())
}

/// Pauses, resumes or deletes a sink (`sink.paused`, `sink.resumed`,
/// `sink.deleted`) at the version its state was read at. `Ok(false)` when
/// there is nothing to do: deleting a deleted sink, pausing a paused one,
/// resuming a running one. A name never used, or a deleted sink paused or
/// resumed, is `NotFound`.
pub async fn apply(
    client: &tokio_postgres::Client,
    appender: &Appender,
    name: &str,
    event_type: &str,
) -> Result<bool, SinkError> {
    let s = state(client, name)
        .await?
        .ok_or_else(|| SinkError::NotFound(name.to_string()))?;
    let nothing_to_do = match event_type {
        crate::catalog::SINK_DELETED => s.deleted,
        _ if s.deleted => return Err(SinkError::NotFound(name.to_string())),
        crate::catalog::SINK_PAUSED => s.paused,
        crate::catalog::SINK_RESUMED => !s.paused,
        other => {
            return Err(SinkError::Invalid(format!(
                "{other} is not a change of a sink"
            )))
        }
    };
    if nothing_to_do {
        return Ok(false);
    }
    match appender
        .append(
            &sink_stream(name),
            ExpectedVersion::Exact(s.version),
            vec![NewEvent::new(
                event_type,
                &serde_json::json!({ "name": name }),
            )],
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(AppendError::VersionConflict { .. }) => Err(SinkError::Invalid(format!(
            "sink {name:?} changed meanwhile; look at it again and retry"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// Whether a worker still holds sink `name`'s subscription (its lease has
/// not run out or been given back).
async fn worker_holds(
    client: &(impl tokio_postgres::GenericClient + Sync),
    name: &str,
) -> Result<bool, SinkError> {
    Ok(client
        .opt(
            "SELECT 1 FROM strata.leases WHERE name = $1 AND strata.lease_until(expires_at, renewed_at) > now()",
            &[&format!("subscription/sink.{name}")],
        )
        .await?
        .is_some())
}

/// Sinks folded from their streams (one sink's with `only`), in name order.
async fn fold(
    client: &(impl tokio_postgres::GenericClient + Sync),
    only: Option<&str>,
) -> Result<Vec<SinkState>, SinkError> {
    let rows = match only {
        Some(name) => {
            client
                .query(
                    "SELECT stream, version, type, payload::text FROM strata.events
                      WHERE stream = $1 ORDER BY position",
                    &[&sink_stream(name)],
                )
                .await?
        }
        None => {
            client
                .query(
                    "SELECT stream, version, type, payload::text FROM strata.events
                      WHERE stream LIKE 'sink/%' ORDER BY position",
                    &[],
                )
                .await?
        }
    };
    let mut sinks: BTreeMap<String, SinkState> = BTreeMap::new();
    for r in rows {
        let stream: String = r.get(0);
        let version = r.get::<_, i64>(1) as u64;
        let t: &str = r.get(2);
        let payload: &str = r.get(3);
        if t == crate::catalog::SINK_CREATED {
            if let Ok(config) = serde_json::from_str::<SinkConfig>(payload) {
                sinks.insert(
                    stream,
                    SinkState {
                        config,
                        paused: false,
                        deleted: false,
                        version,
                    },
                );
            }
            continue;
        }
        if let Some(s) = sinks.get_mut(&stream) {
            s.version = version;
            match t {
                crate::catalog::SINK_PAUSED => s.paused = true,
                crate::catalog::SINK_RESUMED => s.paused = false,
                crate::catalog::SINK_DELETED => s.deleted = true,
                _ => {}
            }
        }
    }
    Ok(sinks.into_values().collect())
}

/// Moves a paused sink's cursor: it delivers again from the event after
/// `to` when resumed (backwards replays history, forwards skips). Refused
/// while the sink runs, or while its last worker still holds the
/// subscription. The cursor and its `sink.reset` event commit together, and
/// only if the sink's stream is still at the version found paused.
pub async fn reset(
    client: &mut tokio_postgres::Client,
    name: &str,
    to: u64,
) -> Result<(), SinkError> {
    let sink = list(client)
        .await?
        .into_iter()
        .find(|s| s.config.name == name)
        .ok_or_else(|| SinkError::NotFound(name.to_string()))?;
    if !sink.paused {
        return Err(SinkError::Invalid(format!(
            "pause sink {name:?} before resetting it"
        )));
    }
    let subscription = format!("sink.{name}");
    if worker_holds(client, name).await? {
        return Err(SinkError::Invalid(format!(
            "sink {name:?} is still being stopped; try again in a moment"
        )));
    }
    let tx = client.transaction().await?;
    tx.exec(
        "INSERT INTO strata.subscriptions (name, position) VALUES ($1, $2)
         ON CONFLICT (name) DO UPDATE SET position = $2, updated_at = now()",
        &[&subscription, &(to as i64)],
    )
    .await?;
    let event = NewEvent::new(
        crate::catalog::SINK_RESET,
        &serde_json::json!({ "name": name, "to": to }),
    );
    let expected = ExpectedVersion::Exact(sink.version);
    match events::append::append_one_in(&tx, sink_stream(name), expected, vec![event]).await {
        Ok(_) => {}
        Err(AppendError::VersionConflict { .. }) => {
            return Err(SinkError::Invalid(format!(
                "sink {name:?} changed while it was being reset; look at it again and retry"
            )))
        }
        Err(e) => return Err(e.into()),
    }
    tx.commit().await?;
    Ok(())
}

/// The position a sink stands at (its last acknowledged event), if it ever
/// started.
pub async fn cursor(client: &tokio_postgres::Client, name: &str) -> Result<Option<u64>, SinkError> {
    Ok(events::stored_cursor(client, &format!("sink.{name}")).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default backoff retries a batch for longer than a receiver takes
    /// to restart (the 20 s that used to pause a sink: the old full jitter
    /// could retry all 8 attempts within milliseconds), and never waits
    /// longer than the cap once the receiver is back.
    #[test]
    fn the_default_backoff_rides_out_a_receiver_restart() {
        let (least, most) = Retry::default().bounds(default_attempts());
        assert!(least >= std::time::Duration::from_secs(20), "{least:?}");
        assert!(most <= std::time::Duration::from_secs(60), "{most:?}");
    }
}
