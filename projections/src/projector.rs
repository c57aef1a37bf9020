//! Feeding an [`Index`] from the log: from the table (catch-up, checks) or
//! live from a subscription, starting at a snapshot.

use crate::index::{ApplyError, Index, Violation};
use crate::snapshot::{SnapshotError, SnapshotStore};
use events::db::Sql;
use events::{read, Event, Position, Reader, Start, SubscribeError, Subscription};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    #[error("read the event log: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Subscribe(#[from] SubscribeError),
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
}

/// Applies the table's durable events after the index's position, in pages,
/// calling `progress` after each page and `on_violation` for every
/// violation. Returns the events applied.
pub async fn catch_up(
    client: &Client,
    index: &mut Index,
    mut on_violation: impl FnMut(&Violation) -> bool,
    mut progress: impl FnMut(u64),
) -> Result<u64, ProjectError> {
    let mut applied = 0u64;
    loop {
        let page = read::after(client, Position(index.position()), 10_000).await?;
        if page.is_empty() {
            return Ok(applied);
        }
        for e in &page {
            if let Some(v) = index.apply(e)? {
                if !on_violation(&v) {
                    return Ok(applied);
                }
            }
            applied += 1;
        }
        progress(index.position());
    }
}

/// Builds an index from the whole log (or from `from` onwards).
pub async fn build(client: &Client, from: Index) -> Result<Index, ProjectError> {
    let mut index = from;
    catch_up(
        client,
        &mut index,
        |v| {
            tracing::warn!(violation = %v, "the log breaks an invariant");
            true
        },
        |_| {},
    )
    .await?;
    Ok(index)
}

/// The positions takeovers cut from the log: `(previous_head,
/// first_position)` of every epoch, with nothing in the log strictly between.
pub async fn lost_ranges(client: &Client) -> Result<Vec<(u64, u64)>, tokio_postgres::Error> {
    Ok(client
        .rows(
            "SELECT previous_head, first_position FROM strata.log_epochs",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get::<_, i64>(0) as u64, r.get::<_, i64>(1) as u64))
        .collect())
}

/// A live index: loaded from the newest snapshot, then fed by an ephemeral
/// subscription from the snapshot's position.
pub struct Projector {
    pub index: Index,
    sub: Subscription,
    store: Option<SnapshotStore>,
    snapshot_every: Duration,
    last_snapshot: Instant,
    last_snapshot_position: u64,
    /// Violations seen (each is logged).
    pub violations: u64,
    /// Where the index started: the snapshot's position, or 0.
    pub started_at: u64,
    pub started_from: Option<PathBuf>,
}

impl Projector {
    pub async fn start(
        reader: &Reader,
        store: Option<SnapshotStore>,
    ) -> Result<Projector, ProjectError> {
        // A snapshot taken from events a takeover lost (past the head a new
        // timeline began from, before that timeline's epoch) is not the log.
        let cuts = match &store {
            Some(_) => lost_ranges(&*reader.client().await?).await?,
            None => Vec::new(),
        };
        let valid = |p: u64| !cuts.iter().any(|(after, before)| p > *after && p < *before);
        let (index, from) = match store
            .as_ref()
            .map(|s| s.latest_where(valid))
            .transpose()?
            .flatten()
        {
            Some((path, state)) => {
                let t = Instant::now();
                let index = Index::from_state(state);
                tracing::info!(path = %path.display(), position = index.position(),
                    ms = t.elapsed().as_secs_f64() * 1e3, "pool index loaded from a snapshot");
                (index, Some(path))
            }
            None => (Index::new(), None),
        };
        let start = match index.position() {
            0 => Start::Beginning,
            p => Start::After(Position(p)),
        };
        let sub = reader.subscribe_ephemeral_as("projector", start).await?;
        let at = index.position();
        Ok(Projector {
            index,
            sub,
            store,
            snapshot_every: Duration::from_secs(60),
            last_snapshot: Instant::now(),
            last_snapshot_position: at,
            violations: 0,
            started_at: at,
            started_from: from,
        })
    }

    /// The index and the subscription that feeds it, for a caller that
    /// folds on its own (the console shares its index between requests).
    pub fn into_parts(self) -> (Index, Subscription) {
        (self.index, self.sub)
    }

    /// How often [`Projector::maybe_snapshot`] writes one (default 60 s).
    pub fn snapshot_every(mut self, every: Duration) -> Projector {
        self.snapshot_every = every;
        self
    }

    /// Waits for the next event and applies it. Cancel-safe: an event is
    /// applied in the same poll that takes it.
    pub async fn step(&mut self) -> Result<Arc<Event>, ProjectError> {
        let e = self.sub.next().await?;
        if let Some(v) = self.index.apply(&e)? {
            self.violations += 1;
            tracing::error!(violation = %v, "the log breaks an invariant");
        }
        self.sub.ack(e.position);
        Ok(e)
    }

    /// Writes a snapshot now.
    pub fn snapshot(&mut self) -> Result<Option<PathBuf>, ProjectError> {
        let Some(store) = &self.store else {
            return Ok(None);
        };
        let path = store.write(self.index.state())?;
        self.last_snapshot = Instant::now();
        self.last_snapshot_position = self.index.position();
        Ok(Some(path))
    }

    /// Writes a snapshot if one is due and the index moved since the last.
    pub fn maybe_snapshot(&mut self) -> Result<Option<PathBuf>, ProjectError> {
        if self.last_snapshot.elapsed() < self.snapshot_every
            || self.index.position() == self.last_snapshot_position
        {
            return Ok(None);
        }
        self.snapshot()
    }
}
