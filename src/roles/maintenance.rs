//! The `maintenance` role: months sealed once they close and checkpoints of
//! the open one ([`spawn_sealer`]), and the replication slots' metrics.
//! Several processes may run it; one at a time does each piece of work.

use std::time::Duration;

/// Starts the role's tasks; they run until the process ends.
pub(crate) fn start(cfg: &events::db::Database, every: Duration, grace: Duration) {
    spawn_sealer(cfg.clone(), every, grace);
    ops::task::spawn(
        "slot-metrics",
        events::slots::watch(cfg.clone(), Duration::from_secs(5)),
    );
}

/// Seals months once they have closed (and nothing that began before the
/// end is still running) and takes running checkpoints of the open month,
/// every `every`. Several processes may run it; one at a time does the work.
pub(crate) fn spawn_sealer(cfg: events::db::Database, every: Duration, grace: Duration) {
    // Sealing a month reads all of it in one statement.
    let cfg = cfg.with_statement_timeout(None);
    ops::task::spawn("sealer", async move {
        let mut tick = tokio::time::interval(every.max(Duration::from_secs(1)));
        let mut client = None;
        loop {
            tick.tick().await;
            if client
                .as_ref()
                .is_none_or(|c: &tokio_postgres::Client| c.is_closed())
            {
                // Sealing holds a session lock: PostgreSQL itself, never
                // through a pooler.
                match events::db::connect(cfg.direct(), "strata-sealer").await {
                    Ok(c) => client = Some(c),
                    Err(e) => {
                        tracing::warn!(error = %e, "sealer: cannot connect; trying again later");
                        continue;
                    }
                }
            }
            let Some(c) = client.as_ref() else { continue };
            match ::replay::seal::maintain(c, grace).await {
                Ok(done) => {
                    for s in &done.sealed {
                        tracing::info!(partition = %s.partition, rows = s.rows, chain = %s.chain, "sealed a closed month");
                    }
                    if let Some(cp) = &done.checkpoint {
                        tracing::debug!(
                            position = cp.last_position,
                            rows = cp.rows,
                            "checkpoint of the open month"
                        );
                    }
                    for (month, why) in &done.refused {
                        tracing::error!(%month, %why, "NOT sealing a closed month: it changed after a checkpoint");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "sealing or checkpointing failed; trying again later")
                }
            }
        }
    });
}
