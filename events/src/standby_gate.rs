//! Holds decoded transactions back until a synchronous standby has them.
//!
//! Logical decoding sends what the primary has flushed, not what its
//! synchronous standbys have: an append commits asynchronously and waits
//! for the standby only in its acknowledgement's flush barrier. A
//! transaction delivered before the standby has it may be lost by the
//! standby's takeover, while a consumer already acted on it (a gateway
//! handed a node its command, a sink sent it on). So while the server names
//! synchronous standbys, the reader delivers a transaction only after a
//! flush barrier begun after its arrival returned: the barrier's commit
//! waits for the standbys up to a point past every such transaction.
//!
//! ```text
//!  decoded txn --> held --(barrier begun after it returns)--> delivered
//!                  (nothing held and no standby named: delivered at once)
//! ```
//!
//! The barriers run on a connection of their own, one in flight at a time;
//! what arrives meanwhile waits for the next. Whether standbys are named is
//! read at the start of every replication session and then once per status
//! interval, so turning synchronous replication on takes effect within that
//! interval; each reader records what it found in
//! `strata.replication_readers.holds_for_standbys`.
//!
//! A reader whose own replication connection the server chose as a
//! synchronous standby (`synchronous_standby_names = '*'`) cannot wait for
//! it: the barrier would wait for the reader's own acknowledgement. It says
//! so at error level and delivers at once; the setting should name the
//! physical standbys.

use crate::db::Database;
use crate::session_error::{bounded, SessionError};
use crate::types::Txn;
use schema::sql::Sql;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Client;

type Barrier = Pin<Box<dyn Future<Output = Result<(), SessionError>> + Send>>;

/// Whether the server names synchronous standbys, and whether this slot's
/// own walsender is one of them.
const STANDBYS_SQL: &str = "SELECT current_setting('synchronous_standby_names') <> '',
        coalesce((SELECT r.sync_state IN ('sync', 'quorum')
                    FROM pg_stat_replication r
                    JOIN pg_replication_slots s ON s.active_pid = r.pid
                   WHERE s.slot_name = $1), false)";

/// Whether the server names synchronous standbys now, and whether slot
/// `slot`'s own walsender is one of them (for [`StandbyGate::apply`]).
pub(crate) async fn read(
    client: &Client,
    slot: &str,
    limit: Duration,
) -> Result<(bool, bool), SessionError> {
    let row = bounded(
        limit,
        "read whether synchronous standbys are named",
        client.one(STANDBYS_SQL, &[&slot]),
    )
    .await?;
    Ok((row.get(0), row.get(1)))
}

pub(crate) struct StandbyGate {
    db: Database,
    slot: String,
    limit: Duration,
    /// Transactions are held for the standbys.
    on: bool,
    /// This reader's own walsender is a synchronous standby (said once).
    itself: bool,
    /// `on` was written to `strata.replication_readers` this session.
    recorded: bool,
    held: VecDeque<Txn>,
    /// The barrier in flight and how many held transactions it covers.
    flight: Option<(usize, Barrier)>,
    conn: Option<Arc<Client>>,
}

impl StandbyGate {
    pub(crate) fn new(db: Database, slot: &str, limit: Duration) -> StandbyGate {
        StandbyGate {
            db,
            slot: slot.to_string(),
            limit,
            on: false,
            itself: false,
            recorded: false,
            held: VecDeque::new(),
            flight: None,
            conn: None,
        }
    }

    /// Reads whether the server names synchronous standbys now.
    pub(crate) async fn refresh(&mut self, client: &Client) -> Result<(), SessionError> {
        let found = read(client, &self.slot, self.limit).await?;
        self.apply(client, found).await
    }

    /// Takes what [`read`] found: says so when it changed, and records it
    /// (a statement only then, and once a session).
    pub(crate) async fn apply(
        &mut self,
        client: &Client,
        (named, itself): (bool, bool),
    ) -> Result<(), SessionError> {
        if itself && !self.itself {
            tracing::error!(slot = %self.slot, "this reader's replication connection is itself a synchronous standby (synchronous_standby_names matches it): it cannot wait for the standbys, and delivers what a takeover may lose; name the physical standbys in synchronous_standby_names instead");
        }
        self.itself = itself;
        let on = named && !itself;
        if on != self.on || !self.recorded {
            if on {
                tracing::info!(slot = %self.slot, "synchronous standbys named: transactions are delivered once the standbys have them");
            }
            bounded(
                self.limit,
                "record whether the reader holds for standbys",
                client.exec(
                    "UPDATE strata.replication_readers SET holds_for_standbys = $2 WHERE slot_name = $1",
                    &[&self.slot, &on],
                ),
            )
            .await?;
            self.recorded = true;
        }
        self.on = on;
        if !on {
            self.conn = None;
        }
        Ok(())
    }

    /// `txn` to deliver now, or `None` if it waits (behind others, or for
    /// the standbys).
    pub(crate) fn admit(&mut self, txn: Txn) -> Option<Txn> {
        if self.on || !self.held.is_empty() {
            self.held.push_back(txn);
            None
        } else {
            Some(txn)
        }
    }

    /// Nothing is held: everything received was delivered.
    pub(crate) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The transactions a barrier let through, in order. Never returns
    /// while nothing is held. Cancel-safe: the barrier in flight is kept
    /// and awaited again by the next call.
    pub(crate) async fn passed(&mut self) -> Result<Vec<Txn>, SessionError> {
        if self.held.is_empty() {
            return std::future::pending().await;
        }
        if self.itself {
            // A barrier would wait for this reader's own acknowledgement,
            // which waits for what is held: let everything through.
            self.flight = None;
            return Ok(self.held.drain(..).collect());
        }
        if self.flight.is_none() {
            let conn = self.connection().await?;
            let limit = self.limit;
            let barrier: Barrier = Box::pin(async move {
                bounded(
                    limit,
                    "wait for the synchronous standbys",
                    crate::read::flush_barrier(&conn),
                )
                .await
            });
            self.flight = Some((self.held.len(), barrier));
        }
        let (covered, barrier) = self.flight.as_mut().expect("just set");
        let result = barrier.await;
        let covered = *covered;
        self.flight = None;
        if let Err(e) = result {
            // The connection may be the one that failed.
            self.conn = None;
            return Err(e);
        }
        Ok(self.held.drain(..covered).collect())
    }

    async fn connection(&mut self) -> Result<Arc<Client>, SessionError> {
        if let Some(c) = &self.conn {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let client = bounded(
            self.limit,
            "connect for the standby barrier",
            crate::db::connect(self.db.direct().clone(), "reader-standby-barrier"),
        )
        .await?;
        let client = Arc::new(client);
        self.conn = Some(client.clone());
        Ok(client)
    }
}
