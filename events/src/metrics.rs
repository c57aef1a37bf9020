//! The log's own metrics (appends, replication), registered in the
//! process's registry ([`ops::metrics`]) and updated where the work happens.
//! The subscriptions' lag is computed when scraped, beside the
//! subscriptions (`lag`).

use ops::metrics::{counter, gauge, histogram, SECONDS_BUCKETS, SIZE_BUCKETS};
use prometheus::{Gauge, Histogram, IntCounter};
use std::sync::OnceLock;

/// The log's own metrics.
#[derive(Debug)]
pub struct Metrics {
    pub append_events: IntCounter,
    /// Events written by `append_in` inside callers' own transactions,
    /// counted when written (they commit or roll back with the caller's).
    pub append_in_events: IntCounter,
    pub append_transactions: IntCounter,
    pub append_conflicts: IntCounter,
    /// Batches the database did not answer within the appender's
    /// `attempt_timeout`.
    pub append_timeouts: IntCounter,
    pub append_batch_size: Histogram,
    pub append_duration: Histogram,
    pub replication_events: IntCounter,
    pub replication_transactions: IntCounter,
    pub replication_lag_bytes: Gauge,
    pub replication_lag_seconds: Gauge,
    /// Processes following this one's log share now.
    pub log_share_followers: Gauge,
    /// 1 while this process, told to follow a share, decodes the log
    /// itself through a temporary slot because the share is silent.
    pub log_share_fallback: Gauge,
}

/// The process-wide metrics of the log.
pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = Metrics {
            append_events: counter("strata_append_events_total", "Events appended and committed."),
            append_in_events: counter(
                "strata_append_in_events_total",
                "Events written inside callers' own transactions (counted when written; they commit or roll back with the caller's).",
            ),
            append_transactions: counter(
                "strata_append_transactions_total",
                "Group-commit transactions committed.",
            ),
            append_conflicts: counter(
                "strata_append_conflicts_total",
                "Appends refused for a version conflict.",
            ),
            append_timeouts: counter(
                "strata_append_timeouts_total",
                "Append batches the database did not answer in time (their connection was dropped).",
            ),
            append_batch_size: histogram(
                "strata_append_batch_size",
                "Events per group-commit transaction.",
                SIZE_BUCKETS,
            ),
            append_duration: histogram(
                "strata_append_duration_seconds",
                "Time from append call to durable commit.",
                SECONDS_BUCKETS,
            ),
            replication_events: counter(
                "strata_replication_events_total",
                "Events received from the replication stream (or a log share).",
            ),
            replication_transactions: counter(
                "strata_replication_transactions_total",
                "Transactions received from the replication stream (or a log share).",
            ),
            replication_lag_bytes: gauge(
                "strata_replication_lag_bytes",
                "WAL between the server's position and what this process acknowledged.",
            ),
            replication_lag_seconds: gauge(
                "strata_replication_lag_seconds",
                "Age of the newest transaction received, at receipt.",
            ),
            log_share_followers: gauge(
                "strata_log_share_followers",
                "Processes following the log through this process's share now.",
            ),
            log_share_fallback: gauge(
                "strata_log_share_fallback",
                "1 while this process, told to follow a log share (--log-from), decodes the log itself through a temporary slot because the share is silent.",
            ),
        };
        crate::lag::register();
        m
    })
}
