//! Every second, the endpoint ends what it no longer serves: sessions idle
//! longer than their limit, and every few seconds the sessions of auditors
//! (or certificates) revoked since they logged in, checked against the
//! accounts in the database.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::handler::Shared;

/// How often idle sessions are looked for.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// How often open sessions' auditors and certificates are checked for
/// revocation: a revoked auditor's sessions end within this and a second.
pub const REVOCATION_CHECK: Duration = Duration::from_secs(2);

/// Runs until the endpoint stops.
pub async fn run(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(IDLE_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_revocation_check = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        let idle = shared.conns.end_idle(shared.idle_session_timeout);
        if idle > 0 {
            shared
                .stats
                .sessions_ended_idle
                .fetch_add(idle as u64, Ordering::Relaxed);
        }
        if last_revocation_check.elapsed() >= REVOCATION_CHECK {
            last_revocation_check = tokio::time::Instant::now();
            if let Err(e) = end_revoked(&shared).await {
                tracing::warn!(error = %e, "audit endpoint: could not check open sessions for revocation; trying again");
            }
        }
    }
}

/// Ends the sessions whose auditor is no longer active or whose
/// certificate was revoked.
async fn end_revoked(shared: &Shared) -> Result<(), pgwire::error::PgWireError> {
    let claims = shared.conns.claims();
    let mut auditors: Vec<&str> = claims.iter().map(|c| c.auditor.as_str()).collect();
    auditors.sort_unstable();
    auditors.dedup();
    let mut ended = 0;
    for auditor in auditors {
        if shared.lookup(auditor).await?.is_none() {
            tracing::info!(%auditor, "auditor revoked: their open sessions are ended");
            ended += shared.conns.end_revoked(auditor, None);
        }
    }
    let mut serials: Vec<(&str, &str)> = claims
        .iter()
        .filter_map(|c| Some((c.auditor.as_str(), c.serial.as_deref()?)))
        .collect();
    serials.sort_unstable();
    serials.dedup();
    for (auditor, serial) in serials {
        if shared.certificate_revoked(serial).await? {
            tracing::info!(%auditor, %serial, "certificate revoked: the sessions that logged in with it are ended");
            ended += shared.conns.end_revoked(auditor, Some(serial));
        }
    }
    if ended > 0 {
        shared
            .stats
            .sessions_ended_revoked
            .fetch_add(ended as u64, Ordering::Relaxed);
    }
    Ok(())
}
