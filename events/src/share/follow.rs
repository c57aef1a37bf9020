//! The following side of a log share: a session with the sharer's socket
//! ([`Follow`]: the greeting checked, then frames, each of which must
//! begin within the follower's silence), and [`answers`], which tells a
//! follower decoding the log itself when a share is back. The reader
//! (`reader::share_session`) hands the frames to its subscriptions as it
//! would a slot's transactions.
//!
//! ```text
//!  sharer's socket --frames--> Follow: Hello checked, then
//!      Head(p), Txn, Keepalive (a sign of life) to the reader
//!  no frame within `silence` (the sharer died, froze or dropped us) is an
//!  error: the reader connects again, or decodes the log itself
//! ```

use super::wire::{body_len, decode, Frame, WireError, VERSION};
use futures_util::{Stream, StreamExt};
use std::io;
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::UnixStream;

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

/// A session with a share: its frames after the greeting.
pub(crate) struct Follow {
    frames: std::pin::Pin<Box<dyn Stream<Item = Result<Frame, FollowError>> + Send>>,
    path: String,
}

impl Follow {
    /// Connects to the share at `path` and checks its greeting, each
    /// within `silence`; every later frame must begin within it too.
    pub(crate) async fn connect(path: &Path, silence: Duration) -> Result<Follow, FollowError> {
        let shown = path.display().to_string();
        let sock = match tokio::time::timeout(silence, UnixStream::connect(path)).await {
            Ok(r) => r.map_err(|source| FollowError::Io {
                path: shown.clone(),
                source,
            })?,
            Err(_) => {
                return Err(FollowError::Io {
                    path: shown,
                    source: io::Error::from(io::ErrorKind::TimedOut),
                })
            }
        };
        let rd = BufReader::with_capacity(256 << 10, sock);
        // A stream keeps a read in flight when the caller's select drops
        // `next` (a bare read would lose the bytes it took).
        let frames =
            futures_util::stream::unfold((rd, shown.clone()), move |(mut rd, path)| async move {
                let f = frame(&mut rd, silence, &path).await;
                Some((f, (rd, path)))
            });
        let mut follow = Follow {
            frames: Box::pin(frames),
            path: shown,
        };
        match follow.frames.next().await.expect("endless")? {
            Frame::Hello { version } if version == VERSION => Ok(follow),
            Frame::Hello { version } => Err(FollowError::Version {
                path: follow.path,
                version,
            }),
            _ => Err(follow.wire(WireError::Magic)),
        }
    }

    /// The share's socket, for messages.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The next frame (a greeting again is refused). Cancel-safe.
    pub(crate) async fn next(&mut self) -> Result<Frame, FollowError> {
        match self.frames.next().await.expect("endless")? {
            Frame::Hello { .. } => Err(self.wire(WireError::Tag(0))),
            f => Ok(f),
        }
    }

    fn wire(&self, source: WireError) -> FollowError {
        FollowError::Wire {
            path: self.path.clone(),
            source,
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

/// Returns once a share answers at `path`: its greeting, then a frame (a
/// live share sends its head or a keepalive at once), each within a second;
/// tried every second.
pub(crate) async fn answers(path: &Path) {
    let limit = Duration::from_secs(1);
    loop {
        tokio::time::sleep(limit).await;
        if let Ok(mut share) = Follow::connect(path, limit).await {
            if share.next().await.is_ok() {
                return;
            }
        }
    }
}
