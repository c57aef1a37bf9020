//! Every session's events into the log: one writer task appends everything
//! queued in one I/O turn as one transaction (`append_batch`).

use crate::identity::node_stream;
use crate::state::{Shared, Write};
use events::{AppendError, ExpectedVersion, NewEvent, StreamAppend};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

impl Shared {
    pub(crate) async fn write(&self, w: Write) -> Result<u64, AppendError> {
        let (tx, rx) = oneshot::channel();
        let w = Write {
            done: Some(tx),
            ..w
        };
        if self.writes.send(w).await.is_err() {
            return Err(AppendError::Closed);
        }
        rx.await.unwrap_or(Err(AppendError::Closed))
    }

    /// Queues a write without waiting for it.
    pub(crate) fn write_later(&self, w: Write) {
        if self.writes.try_send(w).is_err() {
            self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("the gateway's write queue is full; an event was dropped");
        }
    }

    /// A write fenced by the node's current session, if this gateway holds it.
    pub(crate) fn session_write(&self, node: &str, event: NewEvent) {
        let (expected, epoch) = {
            let sessions = self.sessions.lock().expect("sessions lock");
            match sessions.get(node) {
                Some(s) => (ExpectedVersion::Exact(s.version), s.epoch),
                None => return,
            }
        };
        self.write_later(Write {
            stream: node_stream(node),
            session: Some((node.to_string(), epoch)),
            expected,
            events: vec![event],
            done: None,
        });
    }
}

/// Appends everything queued in one I/O turn as one transaction.
pub(crate) async fn writer(shared: Arc<Shared>, mut rx: mpsc::Receiver<Write>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < 4096 {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        while !batch.is_empty() {
            // One StreamAppend per stream, in first-seen order.
            let mut order: Vec<String> = Vec::new();
            let mut by_stream: HashMap<String, StreamAppend> = HashMap::new();
            for w in &batch {
                let a = by_stream.entry(w.stream.clone()).or_insert_with(|| {
                    order.push(w.stream.clone());
                    StreamAppend {
                        stream: w.stream.clone(),
                        expected: w.expected,
                        events: Vec::new(),
                    }
                });
                a.events.extend(w.events.iter().cloned());
            }
            let appends: Vec<StreamAppend> =
                order.iter().filter_map(|s| by_stream.remove(s)).collect();
            let events: u64 = appends.iter().map(|a| a.events.len() as u64).sum();
            match shared.appender.append_batch(appends).await {
                Ok(done) => {
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
                    for w in batch.drain(..) {
                        if let Some(done) = w.done {
                            let _ = done
                                .send(Ok(versions.get(w.stream.as_str()).copied().unwrap_or(0)));
                        }
                    }
                }
                Err(AppendError::VersionConflict {
                    stream,
                    expected,
                    actual,
                }) => {
                    // That stream moved: its writer is fenced. Drop its
                    // writes and commit the rest.
                    let (fenced, rest): (Vec<Write>, Vec<Write>) =
                        batch.drain(..).partition(|w| w.stream == stream);
                    batch = rest;
                    for w in fenced {
                        if let Some((node, epoch)) = &w.session {
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
                        if let Some(done) = w.done {
                            let _ = done.send(Err(AppendError::VersionConflict {
                                stream: stream.clone(),
                                expected,
                                actual,
                            }));
                        }
                    }
                }
                Err(e) => {
                    shared.stats.write_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, writes = batch.len(), "a batch of node events failed");
                    for w in batch.drain(..) {
                        if let Some(done) = w.done {
                            let _ = done.send(Err(e.clone()));
                        }
                    }
                }
            }
        }
    }
}
