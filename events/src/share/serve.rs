//! The sharing side of a log share: a process's reader serves what it
//! decoded to the other processes of its host, over a Unix socket, so that
//! the host's processes cost PostgreSQL one walsender instead of one each.
//!
//! ```text
//!  Reader --Live (attached as "log-share-N", holding no WAL back)--> feed N
//!     feed: Hello, then Head and Txn frames as they come (those ready are
//!           written together), a Keepalive every `keepalive` when idle;
//!           a follower that does not take a write within `write_timeout`,
//!           or falls too far behind the reader, is disconnected
//! ```
//!
//! A feed attaches like a subscription but counts as having everything it
//! was sent: a follower's subscriptions keep their own durable cursors in
//! the table and read from it whatever they missed, so no follower holds
//! the sharer's slot back.

use super::wire::{encode, Frame, VERSION};
use crate::reader::{Live, Reader};
use std::io;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

/// Settings of a share.
#[derive(Debug, Clone)]
pub struct ShareConfig {
    /// A frame is sent at least this often, so a follower can tell a
    /// sharer that stopped from a quiet log.
    pub keepalive: Duration,
    /// Longest a follower may take to accept one write.
    pub write_timeout: Duration,
}

impl Default for ShareConfig {
    fn default() -> Self {
        ShareConfig {
            keepalive: Duration::from_secs(1),
            write_timeout: Duration::from_secs(5),
        }
    }
}

/// Binds the share's socket at `path`, readable and writable by this user
/// only (a follower reads every event): it is made under a name of its own
/// beside `path`, given its mode, and only then renamed to `path`, so that
/// no one can connect to it before. A socket file left by a process that
/// died (nothing listens on it) is replaced; one that a live sharer answers
/// on, or that this user cannot try, is not.
pub async fn bind(path: &Path) -> io::Result<UnixListener> {
    if path.exists() {
        match UnixStream::connect(path).await {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("another process shares the log at {}", path.display()),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("{} exists and could not be tried: {e}", path.display()),
                ))
            }
        }
    }
    let mut making = path.as_os_str().to_owned();
    making.push(format!(".{}.new", std::process::id()));
    let making = std::path::PathBuf::from(making);
    let _ = std::fs::remove_file(&making);
    let listener = UnixListener::bind(&making)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&making, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&making, path)?;
    Ok(listener)
}

/// Serves `reader`'s stream to every follower that connects, until the
/// listener fails; the followers' feeds end with it (dropped, say).
pub async fn serve(reader: Reader, listener: UnixListener, config: ShareConfig) -> io::Result<()> {
    let mut feeds = tokio::task::JoinSet::new();
    let mut n = 0u64;
    loop {
        let sock = tokio::select! {
            accepted = listener.accept() => accepted?.0,
            // Reaps the feeds that ended; one that panicked is said.
            Some(done) = feeds.join_next(), if !feeds.is_empty() => {
                if let Err(e) = done {
                    tracing::error!(error = %e, "a log share feed failed; its follower connects again");
                }
                continue;
            }
        };
        n += 1;
        let (reader, config) = (reader.clone(), config.clone());
        feeds.spawn(async move {
            let _counted = Counted::new();
            match feed(&reader, sock, n, &config).await {
                Ok(()) => tracing::debug!(follower = n, "log share follower left"),
                Err(e) => {
                    tracing::warn!(follower = n, error = %e, "log share follower disconnected")
                }
            }
        });
    }
}

/// One follower in `strata_log_share_followers`, for as long as its feed
/// lives (ended or dropped).
struct Counted;

impl Counted {
    fn new() -> Counted {
        crate::metrics::global().log_share_followers.inc();
        Counted
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        crate::metrics::global().log_share_followers.dec();
    }
}

/// Sends one follower the reader's stream.
async fn feed(reader: &Reader, sock: UnixStream, n: u64, config: &ShareConfig) -> io::Result<()> {
    let (mut rd, mut wr) = sock.into_split();
    let mut live = reader.attach(
        &format!("log-share-{n}"),
        Arc::new(AtomicU64::new(u64::MAX)),
    );
    let mut buf = Vec::with_capacity(64 << 10);
    encode(&Frame::Hello { version: VERSION }, &mut buf);
    write(&mut wr, &buf, config.write_timeout).await?;
    let mut keepalive = tokio::time::interval(config.keepalive);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut probe = [0u8; 1];
    loop {
        buf.clear();
        tokio::select! {
            msg = live.recv() => {
                let Some(msg) = msg else {
                    return Err(io::Error::other("the follower fell too far behind the reader; it reads the table and connects again"));
                };
                push(&mut buf, msg);
                // What is already waiting goes in the same write.
                while buf.len() < (1 << 20) {
                    match live.try_recv() {
                        Ok(msg) => push(&mut buf, msg),
                        Err(_) => break,
                    }
                }
                keepalive.reset();
            }
            _ = keepalive.tick() => {
                encode(&Frame::Keepalive(reader.head()), &mut buf);
            }
            // A follower sends nothing: a read ends only when it left.
            r = rd.read(&mut probe) => {
                return match r {
                    Ok(0) => Ok(()),
                    Ok(_) => Err(io::Error::other("the follower sent bytes; followers only listen")),
                    Err(e) => Err(e),
                };
            }
        }
        write(&mut wr, &buf, config.write_timeout).await?;
    }
}

fn push(buf: &mut Vec<u8>, msg: Live) {
    let frame = match msg {
        Live::Txn(t) => Frame::Txn(t),
        Live::Head(p) => Frame::Head(p),
    };
    encode(&frame, buf);
}

async fn write(
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    buf: &[u8],
    limit: Duration,
) -> io::Result<()> {
    match tokio::time::timeout(limit, wr.write_all(buf)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the follower took no write within {limit:?}"),
        )),
    }
}
