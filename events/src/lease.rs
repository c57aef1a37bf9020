//! Leases: named, epoch-fenced, time-limited ownership.
//!
//! ```text
//!  acquire(name, holder, ttl) --free or expired--> Lease { epoch: n+1 }
//!  renew()   --still ours and unexpired--> expiry pushed out   | otherwise LeaseError::Lost
//!  fence(tx) --in the holder's own write transaction--> the write commits only while the lease is held
//! ```
//!
//! Expiry is judged by the database's clock, so holders on different machines
//! agree on it. Every acquisition starts a new epoch. A holder that stalled
//! past its TTL may still believe it holds the lease; `fence` makes its writes
//! fail instead of racing the new holder: it locks the lease row for share
//! inside the writing transaction, so a takeover (an update of that row)
//! cannot commit in between, and a takeover that already happened is seen.

use crate::ErrorKind;
use schema::sql::Sql;
use std::time::Duration;
use tokio_postgres::{Client, GenericClient};

/// Why a lease operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The lease expired or was taken over: stop acting as its holder.
    #[error("lease {name:?} (epoch {epoch}) is no longer held by {holder:?}")]
    Lost {
        name: String,
        holder: String,
        epoch: i64,
    },
    #[error("{context}: {source}")]
    Database {
        context: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
}

impl LeaseError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            LeaseError::Lost { .. } => ErrorKind::Definite,
            LeaseError::Database { source, .. } => crate::classify_pg(source),
        }
    }
}

fn db(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> LeaseError {
    move |source| LeaseError::Database { context, source }
}

/// A held lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub name: String,
    pub holder: String,
    pub epoch: i64,
    pub ttl: Duration,
}

fn interval(ttl: Duration) -> String {
    format!("{} milliseconds", ttl.as_millis().max(1))
}

impl Lease {
    /// Takes the lease if it is free, expired, or already ours. Returns
    /// `None` while another holder's lease is valid.
    pub async fn acquire(
        client: &Client,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, LeaseError> {
        let row = client
            .opt(
                "INSERT INTO strata.leases AS l (name, holder, epoch, expires_at)
                 VALUES ($1, $2, 1, now() + $3::text::interval)
                 ON CONFLICT (name) DO UPDATE
                    SET holder = $2, epoch = l.epoch + 1, expires_at = now() + $3::text::interval,
                        acquired_at = now(), renewed_at = now()
                  WHERE strata.lease_until(l.expires_at, l.renewed_at) <= now() OR l.holder = $2
                 RETURNING epoch",
                &[&name, &holder, &interval(ttl)],
            )
            .await
            .map_err(db("acquire a lease"))?;
        Ok(row.map(|r| Lease {
            name: name.to_string(),
            holder: holder.to_string(),
            epoch: r.get(0),
            ttl,
        }))
    }

    /// Extends the lease by its TTL from now, if it is still ours.
    pub async fn renew(&self, client: &Client) -> Result<(), LeaseError> {
        let n = client
            .exec(
                "UPDATE strata.leases SET expires_at = now() + $4::text::interval, renewed_at = now()
                  WHERE name = $1 AND holder = $2 AND epoch = $3
                    AND strata.lease_until(expires_at, renewed_at) > now()",
                &[&self.name, &self.holder, &self.epoch, &interval(self.ttl)],
            )
            .await
            .map_err(db("renew a lease"))?;
        if n == 1 {
            Ok(())
        } else {
            Err(self.lost())
        }
    }

    /// Gives the lease up now, so another holder need not wait for expiry.
    pub async fn release(self, client: &Client) -> Result<(), LeaseError> {
        client
            .exec(
                "UPDATE strata.leases SET expires_at = now(), renewed_at = now() WHERE name = $1 AND holder = $2 AND epoch = $3",
                &[&self.name, &self.holder, &self.epoch],
            )
            .await
            .map_err(db("release a lease"))?;
        Ok(())
    }

    /// Checks, inside the caller's write transaction, that the lease is still
    /// held, and keeps a takeover from committing until that transaction ends.
    pub async fn fence<C: GenericClient + Sync>(&self, tx: &C) -> Result<(), LeaseError> {
        let held = tx
            .opt(
                "SELECT 1 FROM strata.leases
                  WHERE name = $1 AND holder = $2 AND epoch = $3
                    AND strata.lease_until(expires_at, renewed_at) > now()
                  FOR SHARE",
                &[&self.name, &self.holder, &self.epoch],
            )
            .await
            .map_err(db("check a lease"))?;
        match held {
            Some(_) => Ok(()),
            None => Err(self.lost()),
        }
    }

    fn lost(&self) -> LeaseError {
        LeaseError::Lost {
            name: self.name.clone(),
            holder: self.holder.clone(),
            epoch: self.epoch,
        }
    }
}

/// A default holder name: host, process and a random suffix.
pub fn default_holder() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".into());
    format!("{host}-{}-{:04x}", std::process::id(), fastrand::u16(..))
}
