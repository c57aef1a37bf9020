//! The `gateway` role: a gateway configured from `serve`'s flags.

use crate::roles::ServeArgs;
use anyhow::{Context, Result};
use events::db::Database;
use events::{Appender, AppenderConfig, Reader};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// While a gateway's appends come thick (command outcomes from many
/// sessions), each waits up to this for others to share its transaction
/// (`AppenderConfig::group_delay`); short, since a client's request through
/// the API waits on its append.
const GROUP_DELAY: Duration = Duration::from_millis(2);

/// Starts a gateway on `--listen`, named `--gateway-id` (the holder name
/// when not given).
pub(crate) async fn start(
    args: &ServeArgs,
    cfg: &Database,
    reader: Reader,
    holder: &str,
) -> Result<gateway::server::Running> {
    let mut gc = gateway::server::GatewayConfig::new(
        args.gateway_id
            .clone()
            .unwrap_or_else(|| holder.to_string()),
        args.listen,
        &args.ca_dir,
    );
    gc.names = args.tls_names.clone();
    gc.max_streams = args.max_streams;
    gc.handshakes_per_second = args.handshakes_per_second;
    gc.max_pending_hellos = args.max_pending_hellos;
    gc.joins_per_second = args.joins_per_second;
    gc.bad_joins_per_source_per_second = args.bad_joins_per_source_per_second;
    gc.joins_per_token_per_second = args.joins_per_token_per_second;
    gc.handshake_timeout = args.handshake_timeout;
    gc.idle_timeout = args.idle_timeout;
    gc.max_idle_connections = args.max_idle_connections;
    gc.request_deadline = args.request_deadline;
    gc.max_unauthenticated_connections = args.max_unauthenticated_connections;
    gc.unknown_handshakes_per_second = args.unknown_handshakes_per_second;
    gc.max_subscriptions_per_caller = args.max_subscriptions_per_caller;
    gc.node_messages_per_second = args.node_messages_per_second;
    gc.serving_validity = args.serving_validity;
    gc.heartbeat = args.heartbeat;
    gc.lease_ttl = args.gateway_lease_ttl;
    gc.ack_hold = args.ack_hold;
    let appender = Appender::start(
        cfg.clone(),
        AppenderConfig {
            group_delay: GROUP_DELAY,
            ..AppenderConfig::default()
        },
    );
    let g = gateway::server::start(cfg.clone(), reader, appender, gc)
        .await
        .context("start the gateway")?;
    eprintln!("gateway listening on {}", g.addr);
    Ok(g)
}

/// Logs the gateway's counters.
pub(crate) fn report(g: &gateway::server::Running) {
    let s = &g.stats;
    tracing::info!(
        sessions = s.sessions.load(Ordering::Relaxed),
        opened = s.sessions_opened.load(Ordering::Relaxed),
        refused_admission = s.refused_rate.load(Ordering::Relaxed)
            + s.refused_full.load(Ordering::Relaxed)
            + s.refused_pending.load(Ordering::Relaxed),
        refused_identity = s.refused_identity.load(Ordering::Relaxed),
        events = s.events_written.load(Ordering::Relaxed),
        commands = s.commands_dispatched.load(Ordering::Relaxed),
        "gateway"
    );
}
