//! Durable subscriptions: a named cursor over the log that delivers all
//! history, then the live stream, in commit (= position) order, with no gap
//! and no duplicate across the hand-off.
//!
//! ```text
//!            +--> catching up: read strata.events WHERE position > fetched, by pages
//!  next() ---+      (a short page means we reached the head: attach to the reader)
//!            +--> live: Arc<Txn> from the reader; positions <= fetched are skipped,
//!                 a jump past fetched+1 is filled from the table first
//!  ack(p) --> acked --(every 100 ms, or flush_acks)--> strata.subscriptions.position --> durable
//! ```
//!
//! Progress: `fetched` is the highest position queued for delivery, `cursor`
//! the last one returned by `next`, `acked` what the consumer acknowledged and
//! `durable` what is stored. Because positions are gap-free, "deliver exactly
//! `fetched + 1` next" is checkable, and it is checked on every event: the
//! hand-off cannot lose or repeat one. If the reader drops a subscription
//! (too slow, too much WAL held), it simply goes back to reading the table.

use crate::cursor::Cursor;
use crate::lease::{Lease, LeaseError};
use crate::read;
use crate::reader::{Live, Reader};
use crate::types::{Event, Position, Txn};
use crate::ErrorKind;
use schema::sql::Sql;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

/// Where a new subscription starts. An existing named subscription always
/// resumes after its stored cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// From the first event.
    Beginning,
    /// After the last event committed now.
    Now,
    /// After this position.
    After(Position),
}

impl std::str::FromStr for Start {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "start" | "beginning" => Ok(Start::Beginning),
            "now" | "end" => Ok(Start::Now),
            n => n
                .parse::<u64>()
                .map(|p| Start::After(Position(p)))
                .map_err(|_| {
                    format!(
                        "invalid start {s:?}: use `start`, `now` or a position (a whole number)"
                    )
                }),
        }
    }
}

/// Errors of a subscription.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("{context}: {source}")]
    Database {
        context: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("invalid subscription name {0:?}: use 1 to 200 characters without whitespace")]
    InvalidName(String),
    /// Positions that must exist are missing from the table.
    #[error("positions {from} to {to} are missing from the event table (were their partitions retired?)")]
    Missing { from: Position, to: Position },
    #[error("the replication reader has shut down")]
    Closed,
    /// Another process holds the subscription.
    #[error("subscription {name:?} is in use by {holder} (its lease expires in {expires_in:.1}s unless renewed)")]
    InUse {
        name: String,
        holder: String,
        expires_in: f64,
    },
    /// This process lost the subscription's lease (it stalled past the lease's
    /// time to live, and another process may have taken over).
    #[error("lost the lease of subscription {0:?}; another process may now hold it")]
    LeaseLost(String),
    /// A standby took over without the old primary's last commits, and this
    /// subscription had delivered some of them. Returned once, before the
    /// first event of the new timeline; the subscription goes on after it.
    /// What was built from the lost events must be built again.
    #[error("a standby took over (timeline {timeline}) without positions {from} to {to}, which this subscription had delivered: they are not in the log any more; rebuild what was made from them")]
    Diverged {
        from: Position,
        to: Position,
        timeline: i32,
    },
}

impl SubscribeError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            SubscribeError::Database { source, .. } => crate::classify_pg(source),
            SubscribeError::InUse { .. } => ErrorKind::Transient,
            SubscribeError::InvalidName(_)
            | SubscribeError::Missing { .. }
            | SubscribeError::Closed
            | SubscribeError::LeaseLost(_)
            | SubscribeError::Diverged { .. } => ErrorKind::Definite,
        }
    }
}

impl SubscribeError {
    /// The subscription's view of a lease failure.
    fn from_lease(name: &str, e: LeaseError) -> SubscribeError {
        match e {
            LeaseError::Lost { .. } => SubscribeError::LeaseLost(name.to_string()),
            LeaseError::Database { context, source } => {
                SubscribeError::Database { context, source }
            }
        }
    }
}

/// The stored cursor of durable subscription `name`: the last position its
/// consumer acknowledged durably (`None`: no such subscription).
pub async fn stored_cursor(
    client: &(impl tokio_postgres::GenericClient + Sync),
    name: &str,
) -> Result<Option<u64>, tokio_postgres::Error> {
    Ok(client
        .opt(
            "SELECT position FROM strata.subscriptions WHERE name = $1",
            &[&name],
        )
        .await?
        .map(|r| r.get::<_, i64>(0) as u64))
}

fn db(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> SubscribeError {
    move |source| SubscribeError::Database { context, source }
}

/// A subscription. Call [`Subscription::next`] for events and
/// [`Subscription::ack`] once their effect is durable.
pub struct Subscription {
    name: String,
    persisted: bool,
    reader: Reader,
    fetched: Position,
    cursor_pos: Position,
    buf: VecDeque<Arc<Event>>,
    rx: Option<mpsc::Receiver<Live>>,
    shared: Arc<Cursor>,
    page: i64,
    delivered: u64,
    /// Times the subscription switched from the table to the live stream.
    attachments: u64,
    /// Events delivered from an old primary that a takeover lost.
    lost_in_takeovers: u64,
    /// Said by the next call to `next`.
    diverged: Option<SubscribeError>,
    /// A message taken from the live stream whose handling (a gap read) had
    /// not finished: `next` may be cancelled at that await (a `select!`
    /// polling it beside timers), and the message must not be lost with it.
    pending: Option<Live>,
    /// A read of the table in flight, kept across calls to `next` that
    /// were cancelled while it ran, so the next call goes on with it instead
    /// of starting it again (a read that outlasts the timer beside it would
    /// otherwise never finish).
    reading: Option<TableRead>,
}

/// Rows of the table being read: after `from`, up to a page (`until` none)
/// or up to `until` (a gap).
struct TableRead {
    from: Position,
    until: Option<Position>,
    /// In a mutex only to make the subscription `Sync`: it is reached
    /// through `&mut` (`get_mut`), never locked.
    rows: std::sync::Mutex<RowsFuture>,
}

type RowsFuture = Pin<Box<dyn Future<Output = Result<Vec<Arc<Event>>, SubscribeError>> + Send>>;

const PAGE: i64 = 5000;

impl Reader {
    /// Opens the named durable subscription, creating it at `start` if it
    /// does not exist yet (an existing one resumes after its cursor).
    pub async fn subscribe(
        &self,
        name: &str,
        start: Start,
    ) -> Result<Subscription, SubscribeError> {
        if name.is_empty()
            || name.len() > 200
            || name.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(SubscribeError::InvalidName(name.to_string()));
        }
        self.not_held_here(name).await?;
        let client = self.client().await.map_err(db("connect to postgres"))?;
        let lease_name = format!("subscription/{name}");
        // One holder per open, not per process: a second open of a name
        // held in this process (a gateway serving two callers) is refused
        // like one from elsewhere, instead of taking the lease over.
        static OPENS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let holder = format!(
            "{}#{}#{}",
            self.inner.config.slot,
            std::process::id(),
            OPENS.fetch_add(1, Ordering::Relaxed)
        );
        let ttl = self.inner.config.subscription_lease_ttl;
        let lease = match Lease::acquire(&client, &lease_name, &holder, ttl).await {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                let row = client
                    .opt(
                        "SELECT holder, greatest(extract(epoch FROM strata.lease_until(expires_at, renewed_at) - now()), 0)::float8
                           FROM strata.leases WHERE name = $1",
                        &[&lease_name],
                    )
                    .await
                    .map_err(db("read the subscription's lease"))?;
                let (holder, expires_in) = row
                    .map_or((String::from("another process"), 0.0), |r| {
                        (r.get(0), r.get(1))
                    });
                return Err(SubscribeError::InUse {
                    name: name.to_string(),
                    holder,
                    expires_in,
                });
            }
            Err(e) => return Err(SubscribeError::from_lease(name, e)),
        };
        let initial = start_position(&client, start).await?;
        client
            .exec(
                "INSERT INTO strata.subscriptions (name, position, reader, seen_at) VALUES ($1, $2, $3, now())
                 ON CONFLICT (name) DO UPDATE SET reader = $3, seen_at = now()",
                &[&name, &(initial.0 as i64), &self.inner.config.slot],
            )
            .await
            .map_err(db("create the subscription"))?;
        let row = client
            .one(
                "SELECT position FROM strata.subscriptions WHERE name = $1",
                &[&name],
            )
            .await
            .map_err(db("read the subscription's cursor"))?;
        let pos = Position(row.get::<_, i64>(0) as u64);
        tracing::info!(subscription = name, cursor = %pos, epoch = lease.epoch, "subscription opened");
        Ok(self.open(name, name, pos, Some(lease)))
    }

    /// Like [`Reader::subscribe`], but while another process holds the
    /// subscription, waits (up to `wait`) for its lease to be released or to
    /// expire, calling `waiting` with each refusal.
    pub async fn subscribe_waiting(
        &self,
        name: &str,
        start: Start,
        wait: Duration,
        mut waiting: impl FnMut(&SubscribeError),
    ) -> Result<Subscription, SubscribeError> {
        let deadline = Instant::now() + wait;
        loop {
            match self.subscribe(name, start).await {
                Err(e @ SubscribeError::InUse { .. }) if Instant::now() < deadline => {
                    waiting(&e);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                other => return other,
            }
        }
    }

    /// An ad-hoc subscription whose cursor lives only in this process.
    pub async fn subscribe_ephemeral(&self, start: Start) -> Result<Subscription, SubscribeError> {
        self.subscribe_ephemeral_as("ephemeral", start).await
    }

    /// An ad-hoc subscription of `role` (what its lag is reported under in
    /// the metrics: a stable name, where the subscription's own is not).
    pub async fn subscribe_ephemeral_as(
        &self,
        role: &str,
        start: Start,
    ) -> Result<Subscription, SubscribeError> {
        let client = self.client().await.map_err(db("connect to postgres"))?;
        let pos = start_position(&client, start).await?;
        let name = format!("ephemeral-{}", fastrand::u32(..));
        Ok(self.open(&name, role, pos, None))
    }

    /// Refuses a name this process holds in a live subscription; waits
    /// (briefly) for the lease of one just dropped or closed to be let go.
    async fn not_held_here(&self, name: &str) -> Result<(), SubscribeError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let held = self
                .inner
                .held
                .lock()
                .expect("held lock")
                .get(name)
                .cloned();
            let Some(cursor) = held else {
                return Ok(());
            };
            if !cursor.closed.load(Ordering::Acquire) || Instant::now() >= deadline {
                return Err(SubscribeError::InUse {
                    name: name.to_string(),
                    holder: cursor
                        .lease
                        .as_ref()
                        .map_or_else(|| "this process".into(), |l| l.holder.clone()),
                    expires_in: cursor.lease.as_ref().map_or(0.0, |l| l.ttl.as_secs_f64()),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// `label` is what the subscription's lag is reported under.
    fn open(&self, name: &str, label: &str, pos: Position, lease: Option<Lease>) -> Subscription {
        let persisted = lease.is_some();
        let shared = Arc::new(Cursor {
            acked: AtomicU64::new(pos.0),
            durable: Arc::new(AtomicU64::new(pos.0)),
            notify: Notify::new(),
            closed: std::sync::atomic::AtomicBool::new(false),
            lag: crate::lag::Lag {
                label: label.to_string(),
                ..Default::default()
            },
            lease,
            lost: std::sync::atomic::AtomicBool::new(false),
        });
        crate::metrics::global();
        let cursor: std::sync::Weak<dyn crate::lag::Watched> = Arc::downgrade(&shared) as _;
        let reader: std::sync::Weak<dyn crate::lag::Head> = Arc::downgrade(&self.inner) as _;
        crate::lag::add(crate::lag::Entry { cursor, reader });
        if persisted {
            self.inner
                .held
                .lock()
                .expect("held lock")
                .insert(name.to_string(), shared.clone());
            ops::task::spawn(
                "subscription-cursor",
                persist(shared.clone(), self.clone(), name.to_string()),
            );
        }
        Subscription {
            name: name.to_string(),
            persisted,
            reader: self.clone(),
            fetched: pos,
            cursor_pos: pos,
            buf: VecDeque::new(),
            rx: Some(self.attach(name, shared.durable.clone())),
            shared,
            page: PAGE,
            delivered: 0,
            attachments: 1,
            lost_in_takeovers: 0,
            diverged: None,
            pending: None,
            reading: None,
        }
    }
}

async fn start_position(
    client: &tokio_postgres::Client,
    start: Start,
) -> Result<Position, SubscribeError> {
    Ok(match start {
        Start::Beginning => Position(0),
        Start::After(p) => p,
        Start::Now => read::head(client).await.map_err(db("read the log head"))?,
    })
}

/// Stores acknowledged cursors every 100 ms (or when poked) until the
/// subscription is dropped, then once more; then the process no longer
/// holds the name.
async fn persist(cur: Arc<Cursor>, reader: Reader, name: String) {
    keep_cursor(&cur, &reader, &name).await;
    let mut held = reader.inner.held.lock().expect("held lock");
    if held.get(&name).is_some_and(|c| Arc::ptr_eq(c, &cur)) {
        held.remove(&name);
    }
}

async fn keep_cursor(cur: &Arc<Cursor>, reader: &Reader, name: &str) {
    let name = name.to_string();
    let (cur, reader) = (cur.clone(), reader.clone());
    let mut renewed = Instant::now();
    loop {
        let closed = cur.closed.load(Ordering::Acquire);
        let acked = cur.acked.load(Ordering::Acquire);
        if acked > cur.durable.load(Ordering::Acquire) {
            match store_cursor(&reader, &cur, &name, acked).await {
                Ok(()) => {
                    cur.durable.fetch_max(acked, Ordering::AcqRel);
                }
                Err(SubscribeError::LeaseLost(_)) => {
                    lose(&cur, &name);
                    return;
                }
                Err(e) => {
                    tracing::warn!(subscription = %name, error = %e, "could not store the subscription cursor; will retry")
                }
            }
        }
        if let Some(lease) = &cur.lease {
            if closed {
                if let Ok(client) = reader.client().await {
                    let _ = lease.clone().release(&client).await;
                }
                return;
            }
            if renewed.elapsed() >= lease.ttl / 3 {
                match reader.client().await {
                    Ok(client) => match lease.renew(&client).await {
                        Ok(()) => renewed = Instant::now(),
                        Err(LeaseError::Lost { .. }) => {
                            lose(&cur, &name);
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(subscription = %name, error = %e, "could not renew the subscription's lease; will retry")
                        }
                    },
                    Err(e) => {
                        tracing::warn!(subscription = %name, error = %e, "could not renew the subscription's lease; will retry")
                    }
                }
            }
        }
        if closed {
            return;
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), cur.notify.notified()).await;
    }
}

fn lose(cur: &Cursor, name: &str) {
    cur.lost.store(true, Ordering::Release);
    // A handover, not a failure: whoever holds the lease now delivers
    // from the stored cursor (a lease lost for good shows in the
    // subscription's lag and its alert).
    tracing::warn!(subscription = %name, "lost the subscription's lease; this process stops delivering it and the lease's new holder goes on from the stored cursor");
}

/// Stores the cursor, fenced by the subscription's lease: a process that lost
/// the lease cannot move the cursor under the new holder.
async fn store_cursor(
    reader: &Reader,
    cur: &Cursor,
    name: &str,
    acked: u64,
) -> Result<(), SubscribeError> {
    let client = reader.client().await.map_err(db("connect to postgres"))?;
    let Some(lease) = &cur.lease else {
        return Ok(());
    };
    let n = client
        .exec(
            "UPDATE strata.subscriptions SET position = greatest(position, $2), updated_at = now(), seen_at = now()
              WHERE name = $1
                AND EXISTS (SELECT 1 FROM strata.leases
                             WHERE name = $3 AND holder = $4 AND epoch = $5
                               AND strata.lease_until(expires_at, renewed_at) > now())",
            &[&name, &(acked as i64), &lease.name, &lease.holder, &lease.epoch],
        )
        .await
        .map_err(db("store the subscription cursor"))?;
    if n == 1 {
        Ok(())
    } else {
        Err(SubscribeError::LeaseLost(name.to_string()))
    }
}

impl Subscription {
    /// The subscription's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The last position returned by [`Subscription::next`].
    pub fn position(&self) -> Position {
        self.cursor_pos
    }

    /// The position stored durably.
    pub fn durable(&self) -> Position {
        Position(self.shared.durable.load(Ordering::Acquire))
    }

    /// Whether events currently come from the live stream (vs. the table).
    pub fn is_live(&self) -> bool {
        self.rx.is_some()
    }

    /// How often this subscription joined the live stream.
    pub fn attachments(&self) -> u64 {
        self.attachments
    }

    /// How many events it delivered that a standby's takeover then lost
    /// (they came from the old primary after the standby's last replay).
    pub fn lost_in_takeovers(&self) -> u64 {
        self.lost_in_takeovers
    }

    /// Acknowledges everything up to `position` as durably processed. Stored
    /// within 100 ms; [`Subscription::flush_acks`] stores it now.
    pub fn ack(&self, position: Position) {
        self.shared.acked.fetch_max(position.0, Ordering::AcqRel);
        self.acked_delivered(position);
        if !self.persisted {
            self.shared.durable.fetch_max(position.0, Ordering::AcqRel);
        }
    }

    /// Stores the acknowledged cursor now.
    pub async fn flush_acks(&self) -> Result<(), SubscribeError> {
        let acked = self.shared.acked.load(Ordering::Acquire);
        if self.persisted && acked > self.shared.durable.load(Ordering::Acquire) {
            if let Err(e) = store_cursor(&self.reader, &self.shared, &self.name, acked).await {
                if matches!(e, SubscribeError::LeaseLost(_)) {
                    lose(&self.shared, &self.name);
                }
                return Err(e);
            }
            self.shared.durable.fetch_max(acked, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Stores the acknowledged cursor and releases the subscription's lease,
    /// so another process can take the subscription over at once.
    pub async fn close(self) -> Result<(), SubscribeError> {
        self.flush_acks().await?;
        if let Some(lease) = &self.shared.lease {
            let client = self
                .reader
                .client()
                .await
                .map_err(db("connect to postgres"))?;
            lease
                .clone()
                .release(&client)
                .await
                .map_err(|e| SubscribeError::from_lease(&self.name, e))?;
        }
        Ok(())
    }

    /// Stores the cursor inside the caller's transaction, so the consumer's
    /// effect and its cursor commit together (exactly-once processing). Call
    /// [`Subscription::committed`] after the transaction commits.
    pub async fn ack_in(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        position: Position,
    ) -> Result<(), SubscribeError> {
        if let Some(lease) = &self.shared.lease {
            lease
                .fence(tx)
                .await
                .map_err(|e| SubscribeError::from_lease(&self.name, e))?;
        }
        tx.exec(
            "UPDATE strata.subscriptions SET position = greatest(position, $2), updated_at = now(), seen_at = now() WHERE name = $1",
            &[&self.name, &(position.0 as i64)],
        )
        .await
        .map_err(db("store the subscription cursor in the consumer's transaction"))?;
        Ok(())
    }

    /// Records that a cursor written with [`Subscription::ack_in`] committed.
    pub fn committed(&self, position: Position) {
        self.shared.acked.fetch_max(position.0, Ordering::AcqRel);
        self.acked_delivered(position);
        self.shared.durable.fetch_max(position.0, Ordering::AcqRel);
    }

    /// The next event, waiting for one if the subscription is caught up.
    pub async fn next(&mut self) -> Result<Arc<Event>, SubscribeError> {
        loop {
            if self.shared.lost.load(Ordering::Acquire) {
                return Err(SubscribeError::LeaseLost(self.name.clone()));
            }
            if let Some(e) = self.diverged.take() {
                return Err(e);
            }
            if let Some(e) = self.buf.pop_front() {
                self.cursor_pos = e.position;
                self.delivered += 1;
                let lag = &self.shared.lag;
                lag.seen.fetch_max(e.position.0, Ordering::Relaxed);
                if lag.pending_since_ms.load(Ordering::Relaxed) == 0 {
                    lag.pending_since_ms
                        .store(crate::lag::millis(e.recorded_at).max(1), Ordering::Relaxed);
                }
                return Ok(e);
            }
            if self.rx.is_none() {
                self.catch_up().await?;
                continue;
            }
            let msg = match self.pending.take() {
                Some(m) => Some(m),
                None => self.rx.as_mut().expect("live").recv().await,
            };
            // Kept until handled: if this future is dropped while the gap
            // is read, the next call handles the message again (handling
            // changes nothing before its reads complete).
            self.pending = msg.clone();
            match msg {
                None => {
                    tracing::info!(subscription = %self.name, at = %self.fetched, "dropped by the live stream; reading the table");
                    self.rx = None;
                }
                Some(Live::Txn(txn)) => self.take_live(&txn).await?,
                Some(Live::Head(head)) => {
                    if head.0 > self.fetched.0 + self.page as u64 {
                        // Far behind: page through the table instead of
                        // holding the whole gap in memory.
                        self.rx = None;
                    } else if head > self.fetched {
                        self.fill_gap(Position(head.0 + 1)).await?;
                    }
                }
            }
            self.pending = None;
        }
    }

    /// Reads one page from the table; attaches to the live stream once a page
    /// comes back short (the head is reached).
    async fn catch_up(&mut self) -> Result<(), SubscribeError> {
        let rows = self.table_read(None).await;
        self.reading = None;
        let rows = rows?;
        let short = (rows.len() as i64) < self.page;
        if let Some(first) = rows.first() {
            if first.position.starts_epoch() && first.position.follows(self.fetched) {
                self.crossed_epoch(first.position).await;
            } else if !first.position.follows(self.fetched) {
                tracing::error!(subscription = %self.name, from = self.fetched.0 + 1, to = first.position.0 - 1,
                    "positions are missing from the event table; continuing after them");
            }
        }
        if let Some(last) = rows.last() {
            self.fetched = last.position;
        }
        self.buf.extend(rows);
        if short {
            // Attach now: anything committed since the read arrives live, and
            // any jump is filled from the table in take_live.
            let durable = self.shared.durable.clone();
            self.rx = Some(self.reader.attach(&self.name, durable));
            self.attachments += 1;
        }
        Ok(())
    }

    async fn take_live(&mut self, txn: &Txn) -> Result<(), SubscribeError> {
        let Some(first_new) = txn.events.iter().position(|e| e.position > self.fetched) else {
            return Ok(());
        };
        let first = txn.events[first_new].position;
        if first.follows(self.fetched) {
            if first.starts_epoch() {
                self.crossed_epoch(first).await;
            }
        } else if first.0 > self.fetched.0 + self.page as u64 {
            // Far behind: leave the live stream and page through the table;
            // this transaction is read again from there.
            self.rx = None;
            return Ok(());
        } else {
            self.fill_gap(first).await?;
        }
        for e in &txn.events[first_new..] {
            self.buf.push_back(e.clone());
        }
        if let Some(last) = txn.last_position() {
            self.fetched = self.fetched.max(last);
        }
        Ok(())
    }

    /// Reads `fetched < position < until` from the table (see [`gap`]).
    async fn fill_gap(&mut self, until: Position) -> Result<(), SubscribeError> {
        let rows = self.table_read(Some(until)).await;
        self.reading = None;
        let rows = rows.inspect_err(|e| {
            if matches!(e, SubscribeError::Missing { .. }) {
                tracing::error!(subscription = %self.name, error = %e, "gap could not be filled");
            }
        })?;
        tracing::debug!(subscription = %self.name, events = rows.len(), "filled a gap from the table");
        if let Some(start) = rows.iter().map(|r| r.position).find(|p| p.starts_epoch()) {
            self.crossed_epoch(start).await;
        }
        if let Some(last) = rows.last() {
            self.fetched = last.position;
        }
        self.buf.extend(rows);
        Ok(())
    }

    /// The read of the table after `fetched` (a page, or up to `until`):
    /// the one in flight if a cancelled call began it, else a new one.
    fn table_read(&mut self, until: Option<Position>) -> &mut RowsFuture {
        let from = self.fetched;
        if !matches!(&self.reading, Some(r) if r.from == from && r.until == until) {
            let (reader, page) = (self.reader.clone(), self.page);
            let rows: RowsFuture = match until {
                None => Box::pin(async move {
                    let client = reader.client().await.map_err(db("connect to postgres"))?;
                    read::after(&client, from, page)
                        .await
                        .map_err(db("read the event table"))
                }),
                Some(until) => Box::pin(gap(reader, from, until)),
            };
            self.reading = Some(TableRead {
                from,
                until,
                rows: std::sync::Mutex::new(rows),
            });
        }
        self.reading
            .as_mut()
            .expect("just set")
            .rows
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The log jumps to `start`, a new epoch (a standby took over). What
    /// this subscription fetched past the head the new timeline began from
    /// came from the old primary and is not in the log any more: what is
    /// still buffered is dropped, what was delivered is said at error level,
    /// counted ([`Subscription::lost_in_takeovers`]) and returned once by
    /// `next` ([`SubscribeError::Diverged`]).
    async fn crossed_epoch(&mut self, start: Position) {
        let found = match self.reader.client().await {
            Ok(c) => c
                .opt(
                    "SELECT previous_head, timeline FROM strata.log_epochs WHERE first_position = $1",
                    &[&(start.0 as i64)],
                )
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let row = match found {
            Ok(Some(row)) => row,
            Ok(None) => {
                tracing::warn!(subscription = %self.name, at = %start, "the log goes on in a new epoch (no record of it)");
                return;
            }
            Err(e) => {
                tracing::warn!(subscription = %self.name, at = %start, error = %e, "the log goes on in a new epoch; its record could not be read");
                return;
            }
        };
        let previous = Position(row.get::<_, i64>(0) as u64);
        let timeline: i32 = row.get(1);
        self.buf
            .retain(|e| e.position <= previous || e.position >= start);
        let delivered = self.cursor_pos.0.saturating_sub(previous.0);
        if delivered == 0 {
            tracing::warn!(subscription = %self.name, timeline, at = %start, "the log goes on in a new epoch after a takeover; nothing delivered was lost");
            return;
        }
        self.lost_in_takeovers += delivered;
        let err = SubscribeError::Diverged {
            from: Position(previous.0 + 1),
            to: self.cursor_pos,
            timeline,
        };
        tracing::error!(subscription = %self.name, error = %err, lost = delivered, "events delivered from the old primary were lost in a takeover");
        self.diverged = Some(err);
    }

    /// Nothing delivered awaits an ack once everything delivered is
    /// acknowledged.
    fn acked_delivered(&self, position: Position) {
        if position >= self.cursor_pos {
            self.shared.lag.pending_since_ms.store(0, Ordering::Relaxed);
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.notify.notify_one();
    }
}

/// Reads `from < position < until` from the table. Those rows are committed
/// (the slot already sent a later commit), but may take a moment to become
/// visible to a new snapshot, so short reads are retried for up to 10 s.
async fn gap(
    reader: Reader,
    from: Position,
    until: Position,
) -> Result<Vec<Arc<Event>>, SubscribeError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let client = reader.client().await.map_err(db("connect to postgres"))?;
        let rows = read::between(&client, from, until)
            .await
            .map_err(db("fill a gap from the event table"))?;
        // Each row follows the one before it, and `until` the last.
        let mut at = from;
        let mut contiguous = true;
        for r in &rows {
            contiguous &= r.position.follows(at);
            at = r.position;
        }
        if contiguous && until.follows(at) {
            return Ok(rows);
        }
        if Instant::now() > deadline {
            return Err(SubscribeError::Missing {
                from: Position(from.0 + 1),
                to: Position(until.0 - 1),
            });
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
