//! The `usage` role's work: the durable subscription `usage` folded into the
//! usage tables, the rollups, the open reservations and the subscription's
//! cursor committed in one transaction (so a restart, a takeover by another
//! process or a promoted standby resumes exactly where the tables stand).
//! The subscription's lease makes one process the writer; its fence is in
//! every transaction, so a writer that lost it commits nothing more.

use super::fold::{Delta, Fold};
use super::store;
use events::db::Database;
use events::{Position, Reader, Start, SubscribeError};
use std::time::Duration;

pub use super::store::SUBSCRIPTION;

/// Most events folded into one transaction.
const BATCH: usize = 5000;
/// How long a process waits for the subscription another holds before it
/// opens it again (the lease's end is noticed sooner: the wait polls).
const STANDBY_WAIT: Duration = Duration::from_secs(3600);
/// How long a batch waits for more events once it has one.
const GATHER: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum KeepError {
    #[error(transparent)]
    Subscribe(#[from] SubscribeError),
    #[error("{context}: {source}")]
    Database {
        context: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
}

fn db(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> KeepError {
    move |source| KeepError::Database { context, source }
}

/// Keeps the usage tables until the process ends, starting again (from the
/// tables) after any failure: a lost lease, a standby's takeover, a
/// database that went away.
pub async fn run(reader: Reader, cfg: Database) {
    let mut backoff = ops::task::Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        let started = std::time::Instant::now();
        let Err(e) = keep(&reader, &cfg).await;
        if started.elapsed() > Duration::from_secs(30) {
            backoff.reset();
        }
        if matches!(e, KeepError::Subscribe(SubscribeError::InUse { .. })) {
            // Another process keeps the rollups: wait on.
            continue;
        }
        let delay = backoff.next_delay();
        ops::task::restarted("usage", &e, delay);
        tokio::time::sleep(delay).await;
    }
}

/// Holds the subscription and folds it in until something fails.
async fn keep(reader: &Reader, cfg: &Database) -> Result<std::convert::Infallible, KeepError> {
    let mut sub = reader
        .subscribe_waiting(
            SUBSCRIPTION,
            Start::Beginning,
            STANDBY_WAIT,
            |e| tracing::debug!(error = %e, "usage: waiting for the subscription"),
        )
        .await?;
    let mut client = events::db::connect(cfg.clone(), "strata-usage")
        .await
        .map_err(db("connect to postgres"))?;
    // The lease is ours: whatever the last holder committed is here, and
    // nothing it did not commit can commit now.
    let mut fold = Fold::from_open(
        store::load_open(&client)
            .await
            .map_err(db("read the open reservations"))?,
    );
    tracing::info!(
        cursor = %sub.durable(),
        open = fold.open.len(),
        "usage: keeping the rollups"
    );
    loop {
        let first = sub.next().await?;
        let mut last = first.position;
        let mut delta = Delta::default();
        apply(&mut fold, &first, &mut delta);
        let until = tokio::time::Instant::now() + GATHER;
        let mut n = 1;
        while n < BATCH {
            match tokio::time::timeout_at(until, sub.next()).await {
                Ok(e) => {
                    let e = e?;
                    last = e.position;
                    apply(&mut fold, &e, &mut delta);
                    n += 1;
                }
                Err(_) => break,
            }
        }
        commit(&mut client, &sub, &fold, &delta, last).await?;
    }
}

fn apply(fold: &mut Fold, e: &events::Event, delta: &mut Delta) {
    let at = super::unix_ms(e.recorded_at);
    fold.apply(&e.event_type, &e.payload, &e.metadata, at, delta);
}

async fn commit(
    client: &mut tokio_postgres::Client,
    sub: &events::Subscription,
    fold: &Fold,
    delta: &Delta,
    last: Position,
) -> Result<(), KeepError> {
    if delta.is_empty() {
        sub.ack(last);
        return Ok(());
    }
    let tx = client
        .transaction()
        .await
        .map_err(db("begin the usage transaction"))?;
    store::write(&tx, fold, delta)
        .await
        .map_err(db("write the usage rollups"))?;
    sub.ack_in(&tx, last).await?;
    tx.commit().await.map_err(db("commit the usage rollups"))?;
    sub.committed(last);
    Ok(())
}
