//! The console's one view of the log: a single ephemeral subscription per
//! console process, folded into a pool index (what every page renders
//! from), a ring of the newest events (the events page's first rows), the
//! positions of each reservation's and node's events (their timelines), a
//! throughput count and samples of each queue's usage over time; every
//! event is also broadcast, as a [`Summary`], to the browsers' live streams
//! (`sse.rs`). The follower is supervised: a subscription that fails (a
//! takeover, PostgreSQL restarting) is opened again from the beginning and
//! everything is folded again.

use crate::mentions::Mentions;
use crate::samples::Samples;
use events::{Event, Reader, Start};
use projections::Index;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};
use tokio::sync::broadcast;

/// How many of the newest events the events page starts from.
pub const RECENT: usize = 500;

/// One event as a browser sees it on the live stream.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub position: u64,
    pub stream: String,
    #[serde(rename = "type")]
    pub event_type: String,
    /// Unix milliseconds of its commit.
    pub at_ms: u64,
    /// The payload, cut to a few hundred characters.
    pub brief: String,
}

impl Summary {
    fn of(e: &Event) -> Summary {
        let mut brief = e.payload.clone();
        if brief.len() > 300 {
            let mut cut = 300;
            while !brief.is_char_boundary(cut) {
                cut -= 1;
            }
            brief.truncate(cut);
            brief.push('…');
        }
        Summary {
            position: e.position.0,
            stream: e.stream.clone(),
            event_type: e.event_type.clone(),
            at_ms: unix_ms(e.recorded_at),
            brief,
        }
    }
}

/// What the console knows of the log, shared by every request.
pub struct Live {
    index: RwLock<Index>,
    recent: Mutex<VecDeque<Arc<Summary>>>,
    mentions: Mutex<Mentions>,
    samples: Mutex<Samples>,
    /// Events folded per second over the last minute: (second, count).
    rate: Mutex<VecDeque<(u64, u64)>>,
    tx: broadcast::Sender<Arc<Summary>>,
    /// Whether the index has caught up with the log as it was at start.
    caught_up: AtomicBool,
    /// The commit time of the newest event folded (Unix ms).
    newest_ms: AtomicU64,
    restarts: AtomicU64,
}

impl Live {
    pub fn new() -> Arc<Live> {
        let (tx, _) = broadcast::channel(4096);
        Arc::new(Live {
            index: RwLock::new(Index::new()),
            recent: Mutex::new(VecDeque::with_capacity(RECENT)),
            mentions: Mutex::new(Mentions::default()),
            samples: Mutex::new(Samples::default()),
            rate: Mutex::new(VecDeque::new()),
            tx,
            caught_up: AtomicBool::new(false),
            newest_ms: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
        })
    }

    /// Reads the index (held briefly: renders copy what they show).
    pub fn index(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        self.index.read().expect("console index lock")
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Summary>> {
        self.tx.subscribe()
    }

    /// The newest events, oldest first.
    pub fn recent(&self) -> Vec<Arc<Summary>> {
        self.recent
            .lock()
            .expect("recent lock")
            .iter()
            .cloned()
            .collect()
    }

    /// The positions of the events that name this reservation or node.
    pub fn mentions(&self, key: &str) -> Option<Vec<u64>> {
        self.mentions.lock().expect("mentions lock").of(key)
    }

    pub fn samples(&self) -> std::sync::MutexGuard<'_, Samples> {
        self.samples.lock().expect("samples lock")
    }

    pub fn caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire)
    }

    /// How far behind the log the index is: now minus the newest event's
    /// commit time, when something was folded.
    pub fn newest_ms(&self) -> u64 {
        self.newest_ms.load(Ordering::Relaxed)
    }

    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    /// Events folded per second, averaged over the last minute.
    pub fn events_per_second(&self) -> f64 {
        let now = unix_ms(SystemTime::now()) / 1000;
        let rate = self.rate.lock().expect("rate lock");
        let n: u64 = rate
            .iter()
            .filter(|(s, _)| now.saturating_sub(*s) < 60)
            .map(|(_, c)| c)
            .sum();
        n as f64 / 60.0
    }

    fn fold(&self, e: &Event) {
        let violation = self.index.write().expect("console index lock").apply(e);
        match violation {
            Ok(Some(v)) => tracing::warn!(violation = %v, "console: the log breaks an invariant"),
            Ok(None) => {}
            Err(err) => tracing::warn!(error = %err, position = e.position.0,
                "console: an event could not be folded"),
        }
        self.mentions.lock().expect("mentions lock").note(e);
        let summary = Arc::new(Summary::of(e));
        {
            let mut recent = self.recent.lock().expect("recent lock");
            if recent.len() == RECENT {
                recent.pop_front();
            }
            recent.push_back(summary.clone());
        }
        {
            let second = summary.at_ms / 1000;
            let mut rate = self.rate.lock().expect("rate lock");
            match rate.back_mut() {
                Some((s, c)) if *s == second => *c += 1,
                _ => rate.push_back((second, 1)),
            }
            while rate.len() > 120 {
                rate.pop_front();
            }
        }
        self.newest_ms.fetch_max(summary.at_ms, Ordering::Relaxed);
        // Nobody listening is not an error.
        let _ = self.tx.send(summary);
    }

    fn reset(&self) {
        *self.index.write().expect("console index lock") = Index::new();
        *self.mentions.lock().expect("mentions lock") = Mentions::default();
        self.recent.lock().expect("recent lock").clear();
        self.caught_up.store(false, Ordering::Release);
    }

    fn sample(&self) {
        let now = unix_ms(SystemTime::now());
        let index = self.index();
        self.samples.lock().expect("samples lock").take(&index, now);
    }
}

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Follows the log into `live` until the task is dropped, opening the
/// subscription again (and folding from the newest snapshot, or the
/// beginning) when it fails.
pub async fn follow(
    reader: Reader,
    live: Arc<Live>,
    snapshots: Option<projections::SnapshotStore>,
) {
    let mut backoff = ops::task::Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        match follow_once(&reader, &live, snapshots.as_ref()).await {
            Ok(()) => return,
            Err(e) => {
                let delay = backoff.next_delay();
                ops::task::restarted("console-follow", &e, delay);
                live.restarts.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(delay).await;
                live.reset();
            }
        }
    }
}

/// The subscription the index is fed by: from the newest usable snapshot
/// (the placer's), its index put in place, or from the log's beginning.
async fn start(
    reader: &Reader,
    live: &Live,
    snapshots: Option<&projections::SnapshotStore>,
) -> Result<events::Subscription, events::SubscribeError> {
    if let Some(store) = snapshots {
        match projections::Projector::start(reader, Some(store.clone())).await {
            Ok(p) => {
                let (index, sub) = p.into_parts();
                *live.index.write().expect("console index lock") = index;
                return Ok(sub);
            }
            Err(projections::projector::ProjectError::Subscribe(e)) => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "console: no usable snapshot; folding the log from its beginning")
            }
        }
    }
    reader
        .subscribe_ephemeral_as("console", Start::Beginning)
        .await
}

async fn follow_once(
    reader: &Reader,
    live: &Live,
    snapshots: Option<&projections::SnapshotStore>,
) -> Result<(), events::SubscribeError> {
    let head = {
        let client = reader
            .client()
            .await
            .map_err(|e| events::SubscribeError::Database {
                context: "connect to postgres",
                source: e,
            })?;
        events::read::head(&client)
            .await
            .map_err(|e| events::SubscribeError::Database {
                context: "read the log's head",
                source: e,
            })?
            .0
    };
    let mut sub = start(reader, live, snapshots).await?;
    if head <= live.index().position() {
        live.caught_up.store(true, Ordering::Release);
    }
    let mut tick = tokio::time::interval(crate::samples::EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            e = sub.next() => {
                let e = e?;
                live.fold(&e);
                sub.ack(e.position);
                if e.position.0 >= head {
                    live.caught_up.store(true, Ordering::Release);
                }
            }
            _ = tick.tick() => live.sample(),
        }
    }
}
