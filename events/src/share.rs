//! The log share: one process on a host decodes the log from its slot and
//! serves the transactions to the host's other processes over a Unix
//! socket, so that PostgreSQL runs one walsender for the host instead of
//! one per process (each walsender decodes the whole WAL and is woken by
//! every commit).
//!
//! ```text
//!  PostgreSQL --pgoutput, one slot--> sharer's Reader --Live--> serve (one feed per follower)
//!                                                                 | Unix socket, `wire` frames
//!                                                                 v
//!                                  follower's Reader (`ReaderConfig::share_from`) --> its subscriptions
//! ```
//!
//! A follower that hears nothing from its share for its silence (the sharer
//! died, froze, or is not started yet) decodes the log itself through a
//! temporary slot, and leaves it as soon as a share answers at the socket
//! again: a host's followers never wait on a sharer for longer than that.
//!
//! Nothing a follower's subscriptions promise rests on the share: they keep
//! their durable cursors in the table and fill any gap from it by position,
//! exactly as when a replication session restarts. The sharer's reader gates
//! on synchronous standbys before anything reaches a follower.

mod follow;
pub mod serve;
pub mod wire;

pub(crate) use follow::{answers, Follow, FollowError};
pub use serve::{bind, serve, ShareConfig};
