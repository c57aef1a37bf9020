//! Who may open a session now: a token bucket for new sessions, a cap on
//! open sessions and on sessions not yet welcomed (as many as the gateway
//! welcomes in a few seconds, `welcome_rate`), and none while the
//! gateway's writes are behind. Every refusal is
//! `RESOURCE_EXHAUSTED` with a jittered `retry-after-ms` in its metadata,
//! which daemons obey.

use crate::state::Shared;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;
use tonic::Status;

pub(crate) fn pushback(reason: &str, base_ms: u32) -> Status {
    // Full jitter around the base: [base/2, 3*base/2).
    let ms = base_ms / 2 + fastrand::u32(0..base_ms.max(1));
    let mut s = Status::resource_exhausted(format!("{reason}; retry in {ms} ms"));
    if let Ok(v) = ms.to_string().parse() {
        s.metadata_mut().insert("retry-after-ms", v);
    }
    s
}

/// A pushback for a gateway that is only busy for the moment (new sessions
/// come faster than it welcomes them, or its writes are behind): it asks the
/// node to come back here, over the connection it already has
/// (`retry-here`), instead of making a new TLS handshake here or elsewhere.
/// Pushbacks that mean "go elsewhere" (no lease, full, stopping) do not
/// carry it.
pub(crate) fn pushback_here(reason: &str, base_ms: u32) -> Status {
    let mut s = pushback(reason, base_ms);
    s.metadata_mut().insert(
        "retry-here",
        tonic::metadata::MetadataValue::from_static("1"),
    );
    s
}

impl Shared {
    pub(crate) fn admit(&self) -> Result<OwnedSemaphorePermit, Status> {
        if self.lease_epoch.load(Ordering::Relaxed) == 0 {
            // Its sessions could not be kept: the nodes go elsewhere.
            self.stats.refused_no_lease.fetch_add(1, Ordering::Relaxed);
            return Err(pushback(
                "this gateway holds no lease (cut off from the database?)",
                2000,
            ));
        }
        let rate = self.config.handshakes_per_second.max(0.001);
        if !self
            .bucket
            .lock()
            .expect("bucket lock")
            .take(rate, rate.max(1.0))
        {
            self.stats.refused_rate.fetch_add(1, Ordering::Relaxed);
            return Err(pushback_here("too many new sessions per second", 1000));
        }
        if self.stats.writes_queued.load(Ordering::Relaxed) > self.config.max_queued_writes {
            self.stats.refused_behind.fetch_add(1, Ordering::Relaxed);
            return Err(pushback_here("this gateway's writes are behind", 2000));
        }
        let permit = self.streams.clone().try_acquire_owned().map_err(|_| {
            self.stats.refused_full.fetch_add(1, Ordering::Relaxed);
            pushback("this gateway holds its maximum of sessions", 5000)
        })?;
        let pending = self.pending_hellos.fetch_add(1, Ordering::AcqRel);
        if pending
            >= self.welcomes.cap(
                self.config.min_pending_hellos,
                self.config.max_pending_hellos,
            )
        {
            self.pending_hellos.fetch_sub(1, Ordering::AcqRel);
            self.stats.refused_pending.fetch_add(1, Ordering::Relaxed);
            // Come back when those waiting now have been welcomed.
            let wait = crate::welcome_rate::WAIT.as_millis() as u32;
            return Err(pushback_here("too many sessions opening at once", wait));
        }
        Ok(permit)
    }
}

/// Counts a session as not yet welcomed until dropped.
pub(crate) struct PendingHello(pub(crate) Arc<Shared>);

impl Drop for PendingHello {
    fn drop(&mut self) {
        self.0.pending_hellos.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Shared {
    /// Admits a join from `source` with `token`, as `join_limits` says, or
    /// refuses it: `RESOURCE_EXHAUSTED` with a pushback the daemon waits
    /// out, or `PERMISSION_DENIED` for a token the region never issued.
    pub(crate) async fn admit_join(
        self: &Arc<Self>,
        source: IpAddr,
        token: &str,
    ) -> Result<(), Status> {
        let c = &self.config;
        let bad_rate = c.bad_joins_per_source_per_second.max(0.001);
        let bad_burst = (bad_rate * 5.0).max(1.0);
        let bad = &self.join_limits.bad_per_source;
        if !bad.holds(&source, bad_rate, bad_burst) {
            self.stats.refused_joins.fetch_add(1, Ordering::Relaxed);
            return Err(pushback("too many bad join tokens from this address", 2000));
        }
        let hash = crate::identity::digest(token);
        if !self.token_known(&hash).await? {
            bad.take(&source, bad_rate, bad_burst);
            self.handshakes.suspect(source, self.handshakes.now_ms());
            self.stats.refused_joins.fetch_add(1, Ordering::Relaxed);
            return Err(Status::permission_denied(
                crate::identity::IdentityError::BadToken.to_string(),
            ));
        }
        let per_token = c.joins_per_token_per_second.max(0.001);
        if !self
            .join_limits
            .per_token
            .take(&hash, per_token, (per_token * 2.0).max(1.0))
        {
            self.stats.refused_joins.fetch_add(1, Ordering::Relaxed);
            return Err(pushback("too many joins with this token", 1000));
        }
        let rate = c.joins_per_second.max(0.001);
        if !self
            .join_bucket
            .lock()
            .expect("join bucket lock")
            .take(rate, rate.max(1.0))
        {
            self.stats.refused_joins.fetch_add(1, Ordering::Relaxed);
            return Err(pushback("too many joins per second", 1000));
        }
        Ok(())
    }

    /// Whether `hash` is a join token's the region issued: one found
    /// before, or found by the next lookup of the hashes missing (see
    /// `join_limits`), which sees every token made before it runs.
    pub(crate) async fn token_known(self: &Arc<Self>, hash: &[u8]) -> Result<bool, Status> {
        let miss = {
            let mut known = self.join_limits.known.lock().expect("known tokens lock");
            if known.contains(hash, unix_now()) {
                return Ok(true);
            }
            known
                .wait_for(hash.to_vec())
                .ok_or_else(|| pushback("too many join tokens waiting to be checked", 1000))?
        };
        if miss.start_lookups {
            ops::task::spawn(
                "gateway-token-lookups",
                self.clone().look_up_tokens(miss.run),
            );
        }
        match miss.answer.await {
            Ok(answer) => answer.map_err(Status::unavailable),
            Err(_) => Err(Status::unavailable("the lookup of join tokens ended")),
        }
    }

    /// Looks up the hashes that missed, a batch at a time with a pause
    /// between, until none waits.
    async fn look_up_tokens(self: Arc<Self>, run: u64) {
        // However this task ends, the next miss starts the lookups again.
        struct Ended<'a>(&'a Shared, u64);
        impl Drop for Ended<'_> {
            fn drop(&mut self) {
                if let Ok(mut known) = self.0.join_limits.known.lock() {
                    known.lookups_ended(self.1);
                }
            }
        }
        let _ended = Ended(&self, run);
        loop {
            let batch = self
                .join_limits
                .known
                .lock()
                .expect("known tokens lock")
                .next_batch();
            if batch.is_empty() {
                return;
            }
            let hashes: Vec<Vec<u8>> = batch.iter().map(|(h, _)| h.clone()).collect();
            let found = match tokio::time::timeout(LOOKUP_DEADLINE, async {
                let client = self
                    .identity_db()
                    .await
                    .map_err(|s| s.message().to_string())?;
                crate::identity::issued_among(&client, &hashes)
                    .await
                    .map_err(|e| e.to_string())
            })
            .await
            {
                Ok(found) => found,
                Err(_) => Err(format!(
                    "join tokens could not be looked up within {LOOKUP_DEADLINE:?}"
                )),
            };
            match found {
                Ok(found) => {
                    let answers: Vec<bool> = {
                        let issued: std::collections::HashSet<&[u8]> =
                            found.iter().map(|(h, _)| h.as_slice()).collect();
                        batch
                            .iter()
                            .map(|(h, _)| issued.contains(h.as_slice()))
                            .collect()
                    };
                    self.join_limits
                        .known
                        .lock()
                        .expect("known tokens lock")
                        .learn(found, unix_now());
                    for ((_, tx), known) in batch.into_iter().zip(answers) {
                        let _ = tx.send(Ok(known));
                    }
                }
                Err(why) => {
                    tracing::warn!(error = %why, "could not look up join tokens");
                    for (_, tx) in batch {
                        let _ = tx.send(Err(why.clone()));
                    }
                }
            }
            tokio::time::sleep(crate::join_limits::LOOKUP_EVERY).await;
        }
    }
}

/// How long one lookup of join tokens may take.
const LOOKUP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// Seconds since the epoch, as found tokens' times are kept.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Ends every session `shared` holds with `why` and a short pushback: their
/// nodes open new sessions (elsewhere, or here again).
pub(crate) fn end_sessions(shared: &crate::state::Shared, why: &str) {
    let sessions: Vec<_> = shared
        .sessions
        .lock()
        .expect("sessions lock")
        .drain()
        .map(|(_, s)| s.tx)
        .collect();
    for tx in sessions {
        let _ = tx.try_send(Err(pushback(why, 200)));
    }
}
