//! Every session's events into the log: one writer task appends everything
//! queued in one I/O turn as one transaction (`append_batch`).
//!
//! ```text
//!  sessions, sweeper --queue (bounded: a full queue holds the session back)--> writer
//!  writer: batch --append_batch--> ok: versions to the sessions, answers
//!                               \-> version conflict: that stream's writers are fenced, the rest retried
//!                               \-> transient error: the same batch again, after backoff
//!                               \-> outcome unknown: the table says whether it committed;
//!                                   asked again, never written again, while the database cannot say
//!                               \-> a definite error: each write alone, so one bad write fails alone
//! ```
//!
//! Nothing accepted is dropped: a write leaves the writer committed, fenced
//! (a newer session owns the node), or, after a definite error of its own,
//! answered with that error and counted in `write_errors`.

use crate::identity::node_stream;
use crate::state::{abandoned, Shared, Write};
use events::db::Sql;
use events::{AppendError, Appended, ErrorKind, ExpectedVersion, NewEvent, StreamAppend};
use ops::task::Backoff;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

/// Most writes in one batch. A batch's insert holds the log head until it
/// commits, and every other append in the region (placers, binders, the
/// other gateways, this gateway's command outcomes) waits for it: while a
/// fleet reconnects, batches of thousands of session openings held a bind's
/// outcome back for seconds at a time. In the region bench's steady load a
/// bind's outcome reached the log 0.38 s (p50) after its node had run it
/// with batches of 512, 0.19 s with 128.
const MAX_WRITES: usize = 128;

impl Shared {
    /// Queues a write and waits for its outcome.
    pub(crate) async fn write(&self, w: Write) -> Result<u64, AppendError> {
        self.submit(w).await.await
    }

    /// Queues a write, in the order of the calls, and returns its outcome
    /// to wait for (so a session's writes keep its messages' order while
    /// the session goes on).
    pub(crate) async fn submit(
        &self,
        w: Write,
    ) -> impl std::future::Future<Output = Result<u64, AppendError>> {
        let (tx, rx) = oneshot::channel();
        let w = Write {
            done: Some(tx),
            ..w
        };
        self.stats.writes_queued.fetch_add(1, Ordering::Relaxed);
        let queued = self.writes.send(w).await.is_ok();
        if !queued {
            self.stats.writes_queued.fetch_sub(1, Ordering::Relaxed);
        }
        async move {
            if !queued {
                return Err(AppendError::Closed);
            }
            rx.await.unwrap_or(Err(AppendError::Closed))
        }
    }

    /// Queues a write without waiting for its outcome; waits for room in the
    /// queue (backpressure on whoever writes), never drops it.
    pub(crate) async fn queue(&self, w: Write) {
        self.stats.writes_queued.fetch_add(1, Ordering::Relaxed);
        if self.writes.send(w).await.is_err() {
            self.stats.writes_queued.fetch_sub(1, Ordering::Relaxed);
            self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!("the gateway's writer has stopped; an event was not written");
        }
    }

    /// A write fenced by the node's current session, if this gateway holds
    /// it, with `also` committed in the same transaction.
    pub(crate) async fn session_write(
        &self,
        node: &str,
        event: NewEvent,
        also: Vec<(String, NewEvent)>,
    ) {
        let (expected, epoch) = {
            let sessions = self.sessions.lock().expect("sessions lock");
            match sessions.get(node) {
                Some(s) => (ExpectedVersion::Exact(s.version), s.epoch),
                None => return,
            }
        };
        self.queue(Write {
            stream: node_stream(node),
            session: Some((node.to_string(), epoch)),
            expected,
            events: vec![event],
            also,
            done: None,
            client: None,
        })
        .await;
    }
}

/// What one attempt at a batch came to.
enum Attempt {
    Committed(Vec<Appended>),
    Conflict(AppendError),
    Failed(AppendError),
}

/// Appends everything queued in one I/O turn as one transaction.
pub(crate) async fn writer(shared: Arc<Shared>, mut rx: mpsc::Receiver<Write>) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
    // Batches still to write: normally one; after a definite error, each
    // write of the failed batch alone.
    let mut todo: VecDeque<Vec<Write>> = VecDeque::new();
    // What was sent of the batch at the front of `todo` when its outcome
    // was left unknown and the database could not yet say: it is asked
    // again before that batch is written again.
    let mut in_doubt: Option<Vec<StreamAppend>> = None;
    loop {
        let taken: usize = todo.iter().map(Vec::len).sum();
        shared
            .stats
            .writes_in_flight
            .store(taken as u64, Ordering::Relaxed);
        if todo.is_empty() {
            let Some(batch) = take(&shared, &mut rx).await else {
                return;
            };
            todo.push_back(batch);
        }
        let Some(mut batch) = todo.pop_front() else {
            continue;
        };
        if let Some(sent) = in_doubt.take() {
            batch = match settle(&shared, &mut backoff, batch, sent).await {
                Doubt::Answered => continue,
                Doubt::WriteAgain(batch) => batch,
                Doubt::AskAgain(batch, sent) => {
                    in_doubt = Some(sent);
                    todo.push_front(batch);
                    continue;
                }
            };
        }
        fence_superseded(&shared, &mut batch);
        drop_abandoned(&mut batch);
        if batch.is_empty() {
            continue;
        }
        let appends = appends_of(&shared, &batch);
        let attempt = match shared.appender.append_batch(appends.clone()).await {
            Ok(done) => Attempt::Committed(done),
            Err(e @ AppendError::VersionConflict { .. }) => Attempt::Conflict(e),
            Err(AppendError::OutcomeUnknown(why)) => {
                // The table says whether it committed, before anything else.
                tracing::info!(reason = %why, writes = batch.len(), "a batch of node events may or may not have committed; asking the table");
                in_doubt = Some(appends);
                todo.push_front(batch);
                continue;
            }
            Err(e) => Attempt::Failed(e),
        };
        match attempt {
            Attempt::Committed(done) => {
                backoff.reset();
                committed_batch(&shared, batch, &appends, &done);
            }
            Attempt::Conflict(AppendError::VersionConflict {
                stream,
                expected,
                actual,
            }) => {
                // That stream moved: its writers are fenced. The rest is
                // written without them.
                let (fenced, rest): (Vec<Write>, Vec<Write>) =
                    batch.into_iter().partition(|w| w.touches(&stream));
                for w in fenced {
                    fence(&shared, &w);
                    if let Some(done) = w.done {
                        let _ = done.send(Err(AppendError::VersionConflict {
                            stream: stream.clone(),
                            expected,
                            actual,
                        }));
                    }
                }
                if !rest.is_empty() {
                    todo.push_front(rest);
                }
            }
            Attempt::Conflict(_) => unreachable!("only conflicts are classified so"),
            Attempt::Failed(AppendError::Closed) => {
                // The process is stopping: nothing queued can be written
                // any more. Its nodes are marked by another gateway once
                // this one's lease has lapsed.
                let mut left = 0usize;
                for w in todo.drain(..).flatten().chain(batch) {
                    left += 1;
                    if let Some(done) = w.done {
                        let _ = done.send(Err(AppendError::Closed));
                    }
                }
                rx.close();
                while let Some(w) = rx.recv().await {
                    shared.stats.writes_queued.fetch_sub(1, Ordering::Relaxed);
                    left += 1;
                    if let Some(done) = w.done {
                        let _ = done.send(Err(AppendError::Closed));
                    }
                }
                tracing::warn!(not_written = left, "the appender has shut down: the gateway's node events still queued are not written");
                return;
            }
            Attempt::Failed(e) if e.kind() == ErrorKind::Transient => {
                // The database restarting, a connection lost: the same batch
                // again, and whatever queues behind it waits.
                let delay = backoff.next_delay();
                shared.stats.write_retries.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, writes = batch.len(), delay_ms = delay.as_millis() as u64, "a batch of node events failed; retrying");
                tokio::time::sleep(delay).await;
                todo.push_front(batch);
            }
            Attempt::Failed(e) if batch.len() > 1 => {
                // A definite error (a malformed event): find the write it
                // belongs to by writing each alone.
                tracing::warn!(error = %e, writes = batch.len(), "a batch of node events was refused; writing them one by one");
                for w in batch.into_iter().rev() {
                    todo.push_front(vec![w]);
                }
            }
            Attempt::Failed(e) => {
                shared.stats.write_errors.fetch_add(1, Ordering::Relaxed);
                for w in batch {
                    tracing::error!(error = %e, stream = %w.stream, "a node event was refused");
                    if let Some(done) = w.done {
                        let _ = done.send(Err(e.clone()));
                    }
                }
            }
        }
    }
}

/// Answers, as [`abandoned`], the writes whose client went away before
/// they were sent, and takes them out (checked before every attempt: a
/// batch retried after a failure drops those given up meanwhile).
fn drop_abandoned(batch: &mut Vec<Write>) {
    batch.retain_mut(|w| {
        if !w.client.as_ref().is_some_and(|c| c.0.is_closed()) {
            return true;
        }
        if let Some(done) = w.done.take() {
            let _ = done.send(Err(abandoned()));
        }
        false
    });
}

/// Answers, as fenced, the session writes whose session this gateway has
/// since replaced with a newer one for the same node, and takes them out.
fn fence_superseded(shared: &Shared, batch: &mut Vec<Write>) {
    let superseded: Vec<usize> = {
        let sessions = shared.sessions.lock().expect("sessions lock");
        batch
            .iter()
            .enumerate()
            .filter(|(_, w)| {
                w.session.as_ref().is_some_and(|(node, epoch)| {
                    sessions.get(node).is_some_and(|s| s.epoch > *epoch)
                })
            })
            .map(|(i, _)| i)
            .collect()
    };
    for i in superseded.into_iter().rev() {
        let w = batch.remove(i);
        shared.stats.fenced.fetch_add(1, Ordering::Relaxed);
        if let Some(done) = w.done {
            let _ = done.send(Err(AppendError::Invalid(
                "a newer session for the node replaced this one".into(),
            )));
        }
    }
}

/// One `StreamAppend` per stream, in first-seen order. A session write
/// expects the version its session holds now; attached events add to their
/// stream with no check of their own.
fn appends_of(shared: &Shared, batch: &[Write]) -> Vec<StreamAppend> {
    let sessions = shared.sessions.lock().expect("sessions lock");
    let mut order: Vec<String> = Vec::new();
    let mut by_stream: HashMap<String, StreamAppend> = HashMap::new();
    let mut add = |stream: &str, expected: ExpectedVersion, events: &[NewEvent]| {
        let a = by_stream.entry(stream.to_string()).or_insert_with(|| {
            order.push(stream.to_string());
            StreamAppend {
                stream: stream.to_string(),
                expected,
                events: Vec::new(),
            }
        });
        a.events.extend(events.iter().cloned());
    };
    for w in batch {
        let expected = match &w.session {
            Some((node, epoch)) => match sessions.get(node) {
                Some(s) if s.epoch == *epoch => ExpectedVersion::Exact(s.version),
                _ => w.expected,
            },
            None => w.expected,
        };
        add(&w.stream, expected, &w.events);
        for (stream, event) in &w.also {
            add(stream, ExpectedVersion::Any, std::slice::from_ref(event));
        }
    }
    order.iter().filter_map(|s| by_stream.remove(s)).collect()
}

/// The next batch: the first write queued (waited for) and whatever else
/// is queued now, up to [`MAX_WRITES`]; `None` once no session can queue
/// any more.
async fn take(shared: &Shared, rx: &mut mpsc::Receiver<Write>) -> Option<Vec<Write>> {
    let first = rx.recv().await?;
    let mut batch = vec![first];
    while batch.len() < MAX_WRITES {
        match rx.try_recv() {
            Ok(w) => batch.push(w),
            Err(_) => break,
        }
    }
    shared
        .stats
        .writes_queued
        .fetch_sub(batch.len() as u64, Ordering::Relaxed);
    shared
        .stats
        .writes_in_flight
        .store(batch.len() as u64, Ordering::Relaxed);
    Some(batch)
}

/// What became of a batch whose commit was in doubt.
enum Doubt {
    /// It had committed, and its writes are answered.
    Answered,
    /// It had not: written again.
    WriteAgain(Vec<Write>),
    /// The database did not say: asked after again (with what was sent).
    AskAgain(Vec<Write>, Vec<StreamAppend>),
}

/// A batch whose commit is in doubt (`sent`, as it was sent), settled by
/// the table; while the database does not answer, given back after a
/// backoff to be asked after again, never written again meanwhile. Written
/// again then, a batch that had committed would meet its own versions and
/// be taken for a newer session's writes: live sessions ended.
async fn settle(
    shared: &Shared,
    backoff: &mut Backoff,
    batch: Vec<Write>,
    sent: Vec<StreamAppend>,
) -> Doubt {
    match committed(shared, &sent).await {
        Ok(Some(done)) => {
            backoff.reset();
            committed_batch(shared, batch, &sent, &done);
            Doubt::Answered
        }
        Ok(None) => Doubt::WriteAgain(batch),
        Err(why) => {
            let delay = backoff.next_delay();
            shared.stats.write_retries.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(reason = %why, writes = batch.len(), delay_ms = delay.as_millis() as u64, "whether a batch of node events committed is not known yet; asking again");
            tokio::time::sleep(delay).await;
            Doubt::AskAgain(batch, sent)
        }
    }
}

/// How long the table is given to say whether a batch committed.
const ASK_PATIENCE: Duration = Duration::from_secs(5);

/// After an append whose outcome is unknown (the connection broke while it
/// committed): whether it committed, from the streams' versions in the
/// table. A batch commits whole, so one stream it expected at an exact
/// version tells: past it by the batch's events, committed (the streams'
/// versions as they are now); anywhere else (still at it, or moved by
/// another writer), not (`None`). `None` too when no stream was expected at
/// an exact version: the table cannot tell, and the batch is written again;
/// facts written without an exact expectation are ones the index applies
/// idempotently (inventory, health, contact). An error when the database
/// did not answer: asked again later, never written again meanwhile.
async fn committed(
    shared: &Shared,
    appends: &[StreamAppend],
) -> Result<Option<Vec<Appended>>, String> {
    let Some((probe, expected)) = appends.iter().find_map(|a| match a.expected {
        ExpectedVersion::Exact(v) => Some((a, v)),
        _ => None,
    }) else {
        return Ok(None);
    };
    let names: Vec<&str> = appends.iter().map(|a| a.stream.as_str()).collect();
    let asked = tokio::time::timeout(ASK_PATIENCE, async {
        let client = shared.db.get().await.map_err(|e| e.to_string())?;
        let rows = client
            .rows(
                "SELECT stream, version FROM strata.streams WHERE stream = ANY($1)",
                &[&names],
            )
            .await;
        rows.map_err(|e| e.to_string())
    })
    .await;
    let rows = match asked {
        Ok(rows) => rows?,
        Err(_) => {
            // A connection that stopped answering: the next ask connects
            // afresh.
            shared.db.reset().await;
            return Err(format!("no answer within {ASK_PATIENCE:?}"));
        }
    };
    let versions: HashMap<String, u64> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u64))
        .collect();
    let now = versions.get(&probe.stream).copied().unwrap_or(0);
    if now != expected + probe.events.len() as u64 {
        return Ok(None);
    }
    tracing::info!(stream = %probe.stream, version = now, "a batch whose commit was in doubt had committed");
    // Positions are not known here; nothing downstream of the writer reads
    // them.
    Ok(Some(
        appends
            .iter()
            .map(|a| Appended {
                stream: a.stream.clone(),
                version: versions.get(&a.stream).copied().unwrap_or(0),
                first_position: events::Position(0),
                last_position: events::Position(0),
            })
            .collect(),
    ))
}

/// A committed batch: the sessions learn their streams' new versions, and
/// every write is answered.
fn committed_batch(
    shared: &Shared,
    batch: Vec<Write>,
    appends: &[StreamAppend],
    done: &[Appended],
) {
    let events: u64 = appends.iter().map(|a| a.events.len() as u64).sum();
    shared.stats.batches.fetch_add(1, Ordering::Relaxed);
    shared
        .stats
        .events_written
        .fetch_add(events, Ordering::Relaxed);
    let versions: HashMap<&str, u64> = done
        .iter()
        .map(|a| (a.stream.as_str(), a.version))
        .collect();
    {
        let mut sessions = shared.sessions.lock().expect("sessions lock");
        for w in &batch {
            if let Some((node, epoch)) = &w.session {
                if let (Some(s), Some(v)) =
                    (sessions.get_mut(node), versions.get(w.stream.as_str()))
                {
                    if s.epoch == *epoch {
                        s.version = *v;
                    }
                }
            }
        }
    }
    for w in batch {
        if let Some(done) = w.done {
            let _ = done.send(Ok(versions.get(w.stream.as_str()).copied().unwrap_or(0)));
        }
    }
}

/// A session write refused by its stream's version: a newer session for
/// the node exists elsewhere, so this gateway's session ends.
fn fence(shared: &Shared, w: &Write) {
    let Some((node, epoch)) = &w.session else {
        return;
    };
    shared.stats.fenced.fetch_add(1, Ordering::Relaxed);
    let mut sessions = shared.sessions.lock().expect("sessions lock");
    if sessions.get(node).is_some_and(|s| s.epoch == *epoch) {
        if let Some(s) = sessions.remove(node) {
            tracing::info!(%node, epoch, "fenced: a newer session for the node exists elsewhere");
            let _ = s.tx.try_send(Err(Status::aborted(
                "a newer session for this node was opened on another gateway",
            )));
        }
    }
}
