//! The following side of a log share: a reader whose transactions come from
//! another process's reader on the same host (over its Unix socket) instead
//! of a replication slot of its own. To the subscriptions attached to it, it
//! is the same reader: `Head` when a session starts or one attaches, then
//! every transaction in commit order.
//!
//! ```text
//!  sharer's socket --frames--> session: Hello checked, then
//!      Head(p)  -> broadcast (a subscription fills from the table up to p)
//!      Txn      -> head = its last position, broadcast
//!      Keepalive-> nothing but a sign of life
//!  no frame within `silence` (the sharer died, froze or dropped us) ends
//!  the session; the reader connects again with backoff
//! ```

use super::wire::{body_len, decode, Frame, WireError, VERSION};
use crate::reader::{broadcast, Attached, Cmd, Inner, Live};
use crate::types::Position;
use futures_util::StreamExt;
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// Why a session with a sharer ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FollowError {
    #[error("log share at {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("log share at {path}: {source}")]
    Wire {
        path: String,
        #[source]
        source: WireError,
    },
    #[error("log share at {path}: nothing received for {silence:?} (the sharing process stopped, froze or dropped this one)")]
    Silent { path: String, silence: Duration },
    #[error("log share at {path} speaks version {version}; this process speaks {VERSION}")]
    Version { path: String, version: u32 },
}

/// Follows the share at `path` until it fails or the reader stops (`Ok`).
pub(crate) async fn session(
    inner: &Inner,
    path: &Path,
    silence: Duration,
    cmd: &mut mpsc::UnboundedReceiver<Cmd>,
    attached: &mut Vec<Attached>,
) -> Result<(), FollowError> {
    let shown = path.display().to_string();
    let io_err = |source| FollowError::Io {
        path: shown.clone(),
        source,
    };
    let sock = match tokio::time::timeout(silence, UnixStream::connect(path)).await {
        Ok(r) => r.map_err(io_err)?,
        Err(_) => return Err(io_err(io::Error::from(io::ErrorKind::TimedOut))),
    };
    let rd = BufReader::with_capacity(256 << 10, sock);
    // A stream of frames keeps a read in flight across the select below
    // (a bare read would lose the bytes it took when cancelled).
    let frames =
        futures_util::stream::unfold((rd, shown.clone()), move |(mut rd, path)| async move {
            let f = frame(&mut rd, silence, &path).await;
            Some((f, (rd, path)))
        });
    let mut frames = std::pin::pin!(frames);
    match frames.next().await.expect("endless")? {
        Frame::Hello { version } if version == VERSION => {}
        Frame::Hello { version } => {
            return Err(FollowError::Version {
                path: shown,
                version,
            })
        }
        _ => {
            return Err(FollowError::Wire {
                path: shown,
                source: WireError::Magic,
            })
        }
    }
    inner.sessions.fetch_add(1, Ordering::Relaxed);
    inner.streaming.store(true, Ordering::Relaxed);
    tracing::info!(share = %shown, "following the log through the share");
    let m = crate::metrics::global();
    loop {
        tokio::select! {
            f = frames.next() => match f.expect("endless")? {
                Frame::Head(p) => {
                    inner.head.fetch_max(p.0, Ordering::Relaxed);
                    broadcast(attached, Live::Head(p));
                }
                Frame::Txn(txn) => {
                    if let Some(last) = txn.last_position() {
                        m.replication_transactions.inc();
                        m.replication_events.inc_by(txn.events.len() as u64);
                        inner.head_at_ms.store(crate::lag::millis(txn.commit_time), Ordering::Relaxed);
                        let lag = SystemTime::now().duration_since(txn.commit_time).unwrap_or_default();
                        m.replication_lag_seconds.set(lag.as_secs_f64());
                        inner.head.fetch_max(last.0, Ordering::Relaxed);
                        broadcast(attached, Live::Txn(txn));
                    }
                }
                Frame::Keepalive(_) => {}
                Frame::Hello { .. } => {
                    return Err(FollowError::Wire { path: shown, source: WireError::Tag(0) })
                }
            },
            c = cmd.recv() => match c {
                Some(Cmd::Attach(a)) => {
                    let mut one = vec![a];
                    broadcast(&mut one, Live::Head(Position(inner.head.load(Ordering::Relaxed))));
                    attached.append(&mut one);
                }
                None => return Ok(()),
            },
        }
    }
}

/// Reads one frame, which must begin within `silence`; a frame begun is
/// read whole under the same deadline again.
async fn frame(
    rd: &mut BufReader<UnixStream>,
    silence: Duration,
    path: &str,
) -> Result<Frame, FollowError> {
    let io_err = |source| FollowError::Io {
        path: path.to_string(),
        source,
    };
    let silent = || FollowError::Silent {
        path: path.to_string(),
        silence,
    };
    let mut prefix = [0u8; 4];
    tokio::time::timeout(silence, rd.read_exact(&mut prefix))
        .await
        .map_err(|_| silent())?
        .map_err(io_err)?;
    let len = body_len(prefix).map_err(|source| FollowError::Wire {
        path: path.to_string(),
        source,
    })?;
    let mut body = vec![0u8; len];
    tokio::time::timeout(silence, rd.read_exact(&mut body))
        .await
        .map_err(|_| silent())?
        .map_err(io_err)?;
    decode(&body).map_err(|source| FollowError::Wire {
        path: path.to_string(),
        source,
    })
}
