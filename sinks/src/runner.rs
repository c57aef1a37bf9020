//! The `sinks` role: every sink defined in the log gets a worker in one of
//! the processes running the role. A worker holds its sink's durable
//! subscription (`sink.<name>`), whose lease makes it the only one; when its
//! process dies, another process's next look takes the subscription over
//! once the lease runs out, and resumes after the last acknowledged event.
//!
//! A worker takes events in batches (up to the sink's batch size, or what
//! arrived within 20 ms), delivers the ones its filter takes, and only then
//! acknowledges the batch: at least once, in log order. A batch that fails
//! all its attempts is parked (`strata sinks parked`) and the sink moves on.

use crate::config::{self, SinkConfig, Target};
pub use crate::metrics::SinkStats;
use crate::webhook;
use bytes::Bytes;
use events::{Reader, SubscribeError, Subscription};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::Instrument as _;

#[derive(Debug, Clone)]
pub struct SinksConfig {
    /// How often the sink definitions are read.
    pub poll: Duration,
    /// The backoff of sinks whose definition has none (`SinkConfig::retry`).
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// After this many batches parked in a row, the sink is paused with a
    /// `sink.alerted` event.
    pub pause_after_parked: u32,
    /// How long a webhook may take to answer before the attempt counts as
    /// failed.
    pub request_timeout: Duration,
    /// PEM certificates trusted for https:// webhooks besides the system's
    /// roots (a private CA).
    pub webhook_ca: Option<std::path::PathBuf>,
    /// The region's name, in every NATS message id (with the sink's name):
    /// regions that feed one JetStream stream must each have their own.
    pub region: String,
}

/// The region's name when none is given.
pub const DEFAULT_REGION: &str = "default";

impl Default for SinksConfig {
    fn default() -> Self {
        SinksConfig {
            poll: Duration::from_secs(1),
            backoff_base: config::Retry::default().base(),
            backoff_cap: config::Retry::default().cap(),
            pause_after_parked: 3,
            request_timeout: Duration::from_secs(10),
            webhook_ca: None,
            region: DEFAULT_REGION.into(),
        }
    }
}

pub struct Sinks {
    pub stats: Arc<SinkStats>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sinks {
    /// Starts delivering. Fails only if `config.webhook_ca` cannot be used.
    pub fn start(
        db: impl Into<events::db::Database>,
        reader: Reader,
        config: SinksConfig,
    ) -> Result<Sinks, String> {
        let db = db.into();
        let http = webhook::client(config.webhook_ca.as_deref())?;
        let stats = Arc::new(SinkStats::default());
        crate::metrics::count(&stats);
        let (stop, rx) = oneshot::channel();
        let task = ops::task::spawn("sinks", run(db, reader, config, http, stats.clone(), rx));
        Ok(Sinks {
            stats,
            stop: Some(stop),
            task,
        })
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
    }
}

struct Worker {
    config: SinkConfig,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn run(
    db: events::db::Database,
    reader: Reader,
    config: SinksConfig,
    http: webhook::HttpClient,
    stats: Arc<SinkStats>,
    mut stop: oneshot::Receiver<()>,
) {
    let store = events::db::SharedClient::new(db);
    let mut workers: HashMap<String, Worker> = HashMap::new();
    // Workers told to stop and not finished yet: the runner does not wait
    // for them (a receiver that never answers would hold up every other
    // sink), but starts no new worker of their sink until they are done.
    let mut stopping: Vec<(String, tokio::task::JoinHandle<()>)> = Vec::new();
    let mut tick = tokio::time::interval(config.poll);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tick.tick() => {}
        }
        let sinks = match store.get().await {
            Ok(c) => match config::list(&c).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the sinks");
                    continue;
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "could not reach the database");
                continue;
            }
        };
        let wanted: HashMap<&str, &SinkConfig> = sinks
            .iter()
            .filter(|s| !s.paused)
            .map(|s| (s.config.name.as_str(), &s.config))
            .collect();
        // Stop workers whose sink was paused, deleted or changed, and forget
        // finished ones.
        let names: Vec<String> = workers.keys().cloned().collect();
        for name in names {
            let keep = wanted
                .get(name.as_str())
                .is_some_and(|c| **c == workers[&name].config)
                && !workers[&name].task.is_finished();
            if !keep {
                if let Some(w) = workers.remove(&name) {
                    let _ = w.stop.send(());
                    stopping.push((name, w.task));
                }
            }
        }
        stopping.retain(|(_, task)| !task.is_finished());
        for (name, cfg) in wanted {
            if workers.contains_key(name) || stopping.iter().any(|(n, _)| n == name) {
                continue;
            }
            // The worker connects with the URL's credentials, kept apart
            // from the log; the runner compares the recorded config.
            let full = match store.get().await {
                Ok(c) => cfg.with_credentials(&*c).await,
                Err(e) => Err(e.into()),
            };
            let full = match full {
                Ok(full) => full,
                Err(e) => {
                    tracing::warn!(sink = %name, error = %e, "could not read the sink's credentials");
                    continue;
                }
            };
            let start = cfg.start.parse().unwrap_or(events::Start::Beginning);
            match reader.subscribe(&format!("sink.{name}"), start).await {
                Ok(sub) => {
                    let (tx, rx) = oneshot::channel();
                    let task = ops::task::spawn(
                        "sink-worker",
                        worker(
                            full,
                            sub,
                            http.clone(),
                            store.config.clone(),
                            config.clone(),
                            stats.clone(),
                            rx,
                        ),
                    );
                    tracing::info!(sink = %name, "sink worker started");
                    workers.insert(
                        name.to_string(),
                        Worker {
                            config: cfg.clone(),
                            stop: tx,
                            task,
                        },
                    );
                }
                Err(SubscribeError::InUse { .. }) => {}
                Err(e) => {
                    tracing::warn!(sink = %name, error = %e, "could not open the sink's subscription")
                }
            }
        }
        stats.workers.store(workers.len() as u64, Ordering::Relaxed);
    }
    for (name, w) in workers.drain() {
        let _ = w.stop.send(());
        stopping.push((name, w.task));
    }
    for (_, task) in stopping {
        let _ = task.await;
    }
    stats.workers.store(0, Ordering::Relaxed);
}

/// The JSON body of a batch.
pub fn body(sink: &str, events: &[&events::Event]) -> Bytes {
    let mut s = format!("{{\"sink\":{},\"events\":[", serde_json::json!(sink));
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&e.to_json_line());
    }
    s.push_str("]}");
    Bytes::from(s)
}

/// Where a sink delivers, connected once.
enum Out {
    Webhook {
        url: String,
        secret: String,
    },
    Nats {
        js: async_nats::jetstream::Context,
        prefix: String,
    },
}

/// Why a sink's worker cannot deliver.
enum Unreachable {
    /// Its secret is not in this process's environment: it waits to be
    /// stopped (another process may have it).
    Secret,
    /// NATS does not answer: nothing acknowledged, nothing lost; the next
    /// look tries again.
    Nats,
}

/// Connects to where the sink delivers.
async fn connect(cfg: &SinkConfig) -> Result<Out, Unreachable> {
    match &cfg.target {
        Target::Webhook { url, secret_env } => match crate::config::check_secret_env(secret_env)
            .and_then(|()| std::env::var(secret_env).map_err(|_| "not set".to_string()))
        {
            Ok(secret) => Ok(Out::Webhook {
                url: url.clone(),
                secret,
            }),
            Err(why) => {
                tracing::error!(sink = %cfg.name, %secret_env, %why, "the sink's secret cannot be read from this process's environment; not delivering");
                Err(Unreachable::Secret)
            }
        },
        Target::Nats {
            url,
            subject_prefix,
        } => match crate::nats::connect(url).await {
            Ok(js) => Ok(Out::Nats {
                js,
                prefix: subject_prefix.clone(),
            }),
            Err(e) => {
                tracing::warn!(sink = %cfg.name, error = %e, "cannot reach NATS; retrying");
                Err(Unreachable::Nats)
            }
        },
    }
}

/// Delivers one batch with retries (`base` and `cap` bound the backoff):
/// the attempts it took, or the attempts made and the last error.
async fn deliver(
    out: &Out,
    cfg: &SinkConfig,
    http: &webhook::HttpClient,
    config: &SinksConfig,
    matching: &[&events::Event],
    (base, cap): (Duration, Duration),
) -> Result<u32, (u32, String)> {
    match out {
        Out::Webhook { url, secret } => {
            let b = body(&cfg.name, matching);
            webhook::with_retries(cfg.max_attempts, base, cap, || {
                webhook::post(
                    http,
                    url,
                    secret.as_bytes(),
                    b.clone(),
                    config.request_timeout,
                )
            })
            .await
        }
        Out::Nats { js, prefix } => {
            crate::nats::deliver(
                js,
                prefix,
                (&config.region, &cfg.name),
                matching,
                cfg.max_attempts,
                base,
                cap,
            )
            .await
        }
    }
}

async fn worker(
    cfg: SinkConfig,
    mut sub: Subscription,
    http: webhook::HttpClient,
    db: events::db::Database,
    config: SinksConfig,
    stats: Arc<SinkStats>,
    mut stop: oneshot::Receiver<()>,
) {
    let out = match connect(&cfg).await {
        Ok(out) => out,
        Err(Unreachable::Secret) => {
            let _ = stop.await;
            let _ = sub.close().await;
            return;
        }
        Err(Unreachable::Nats) => {
            let _ = sub.close().await;
            return;
        }
    };
    let mut parked_in_a_row = 0u32;
    loop {
        let first = tokio::select! {
            _ = &mut stop => break,
            e = sub.next() => match e {
                Ok(e) => e,
                // Said once by the subscription (at error level), which goes
                // on after it: what was delivered of the lost events stays
                // delivered. Ending here would start the subscription again
                // from its cursor, past the takeover, to be told again, for
                // ever.
                Err(events::SubscribeError::Diverged { .. }) => continue,
                Err(e) => {
                    tracing::warn!(sink = %cfg.name, error = %e, "the sink's subscription ended");
                    return;
                }
            },
        };
        let mut batch = vec![first];
        while batch.len() < cfg.batch_max {
            match tokio::time::timeout(Duration::from_millis(20), sub.next()).await {
                Ok(Ok(e)) => batch.push(e),
                _ => break,
            }
        }
        let last = batch.last().expect("a batch has an event").position;
        let matching: Vec<&events::Event> = batch
            .iter()
            .map(|e| e.as_ref())
            .filter(|e| cfg.filter.matches(e))
            .collect();
        if !matching.is_empty() {
            let began = std::time::Instant::now();
            let (base, cap) = cfg
                .retry
                .map_or((config.backoff_base, config.backoff_cap), |r| {
                    (r.base(), r.cap())
                });
            let span =
                tracing::info_span!("sink.deliver", sink = %cfg.name, events = matching.len());
            // A stop (the sink paused, deleted or changed) ends a delivery
            // still being tried: nothing of it is acknowledged, so whoever
            // delivers the sink next sends it again.
            let delivered = tokio::select! {
                d = deliver(&out, &cfg, &http, &config, &matching, (base, cap)).instrument(span) => d,
                _ = &mut stop => {
                    tracing::info!(sink = %cfg.name, "stopped during a delivery; the batch is not acknowledged and will be sent again");
                    break;
                }
            };
            match delivered {
                Ok(attempts) => {
                    crate::metrics::batch(
                        &cfg.name,
                        true,
                        matching.len(),
                        attempts,
                        began.elapsed(),
                    );
                    parked_in_a_row = 0;
                    stats
                        .delivered
                        .fetch_add(matching.len() as u64, Ordering::Relaxed);
                    stats.batches.fetch_add(1, Ordering::Relaxed);
                }
                Err((attempts, error)) => {
                    tracing::warn!(sink = %cfg.name, %error, events = matching.len(), "parking a batch after {attempts} attempts");
                    if let Err(e) =
                        crate::parked::park(&db, &cfg.name, &matching, &error, attempts).await
                    {
                        // Not parked, so not acknowledged: it comes again.
                        tracing::error!(sink = %cfg.name, error = %e, "could not park a batch; it will be retried");
                        return;
                    }
                    crate::metrics::batch(
                        &cfg.name,
                        false,
                        matching.len(),
                        attempts,
                        began.elapsed(),
                    );
                    stats
                        .parked
                        .fetch_add(matching.len() as u64, Ordering::Relaxed);
                    parked_in_a_row += 1;
                    if parked_in_a_row >= config.pause_after_parked {
                        // The receiver is down, not one batch bad: stop
                        // parking everything, say so, and wait for an
                        // operator (the sink catches up when resumed).
                        sub.ack(last);
                        pause_with_alert(&db, &cfg.name, &error, parked_in_a_row).await;
                        stats.alerts.fetch_add(1, Ordering::Relaxed);
                        let _ = sub.close().await;
                        return;
                    }
                }
            }
        }
        sub.ack(last);
    }
    let _ = sub.close().await;
}

/// Appends `sink.alerted` and `sink.paused` for a sink that keeps failing.
async fn pause_with_alert(db: &events::db::Database, name: &str, error: &str, batches: u32) {
    let appender = events::Appender::start(db.clone(), events::AppenderConfig::default());
    let alert = events::NewEvent::new(
        crate::catalog::SINK_ALERTED,
        &serde_json::json!({
            "name": name,
            "reason": format!("{batches} batches in a row could not be delivered; paused"),
            "last_error": error,
        }),
    );
    let paused = events::NewEvent::new(
        crate::catalog::SINK_PAUSED,
        &serde_json::json!({ "name": name, "by": "alert" }),
    );
    match appender
        .append(
            &config::sink_stream(name),
            events::ExpectedVersion::StreamExists,
            vec![alert, paused],
        )
        .await
    {
        Ok(_) => {
            tracing::error!(sink = %name, %error, "sink paused after {batches} failed batches in a row")
        }
        Err(e) => tracing::error!(sink = %name, error = %e, "could not pause a failing sink"),
    }
}
