//! The console's metrics, computed when scraped from what it holds: live
//! streams open, the log position its index has folded and how far its
//! newest event is behind the clock, and how often its follower restarted;
//! and counted as they happen: streams told to resync (they fell behind
//! the broadcast) and streams ended because their sign-in ended.

use crate::live::{unix_ms, Live};
use prometheus::IntCounter;
use std::sync::{Arc, OnceLock};

pub struct Counters {
    pub resyncs: IntCounter,
    pub ended: IntCounter,
}

/// The process's counters (one console per process).
pub fn counters() -> &'static Counters {
    static C: OnceLock<Counters> = OnceLock::new();
    C.get_or_init(|| Counters {
        resyncs: ops::metrics::counter(
            "strata_console_stream_resyncs_total",
            "Live streams that fell behind the console's broadcast and were told to fetch their page again",
        ),
        ended: ops::metrics::counter(
            "strata_console_streams_ended_total",
            "Live streams closed because their sign-in ended (signed out, expired, role removed, certificate revoked)",
        ),
    })
}

/// Registers the gauges computed from `live` and the stream semaphore.
pub fn register(live: Arc<Live>, streams: Arc<tokio::sync::Semaphore>, max_streams: usize) {
    let _ = counters();
    ops::metrics::gauge_fn(
        "strata_console_streams",
        "Live streams (Server-Sent Events) open on this console",
        &[],
        move || {
            vec![(
                vec![],
                max_streams.saturating_sub(streams.available_permits()) as f64,
            )]
        },
    );
    let l = live.clone();
    ops::metrics::gauge_fn(
        "strata_console_position",
        "The log position the console's index has folded",
        &[],
        move || vec![(vec![], l.index().position() as f64)],
    );
    let l = live.clone();
    ops::metrics::gauge_fn(
        "strata_console_newest_event_age_seconds",
        "Seconds since the commit of the newest event the console folded (0 before the first)",
        &[],
        move || {
            let newest = l.newest_ms();
            let age = match newest {
                0 => 0.0,
                t => unix_ms(std::time::SystemTime::now()).saturating_sub(t) as f64 / 1000.0,
            };
            vec![(vec![], age)]
        },
    );
    ops::metrics::gauge_fn(
        "strata_console_follower_restarts",
        "Times the console's subscription failed and the log was folded again from the start",
        &[],
        move || vec![(vec![], live.restarts() as f64)],
    );
}
