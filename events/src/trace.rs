//! Trace context carried in the log: a request's W3C `traceparent` is
//! stored in its event's metadata, and whoever acts on the event later (the
//! placer placing a reservation, the binder activating it) continues that
//! trace, so one trace follows a reservation from the API call to `placed`
//! to `active` across processes.
//!
//! The crates do not depend on OpenTelemetry: the binary installs [`Hooks`]
//! that read the current span's context and set a span's remote parent.
//! Without hooks (tracing not exported), nothing is written and nothing is
//! read.

use crate::NewEvent;
use std::sync::OnceLock;

/// The metadata key of an event's trace context.
pub const TRACEPARENT: &str = "traceparent";

/// What the binary's tracing setup provides.
pub struct Hooks {
    /// The `traceparent` of the current span, if it is sampled and exported.
    pub current: fn() -> Option<String>,
    /// Makes `span`'s parent the remote span `traceparent` names.
    pub follow: fn(&tracing::Span, &str),
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

/// Installs the hooks (once per process; later calls are ignored).
pub fn install(hooks: Hooks) {
    let _ = HOOKS.set(hooks);
}

/// The current span's `traceparent`, when spans are exported.
pub fn current() -> Option<String> {
    HOOKS.get().and_then(|h| (h.current)())
}

/// Continues the trace `traceparent` names in `span`. A malformed value is
/// ignored: trace context never stops work.
pub fn follow(span: &tracing::Span, traceparent: &str) {
    if let Some(h) = HOOKS.get() {
        if valid(traceparent) {
            (h.follow)(span, traceparent);
        }
    }
}

/// `event` with the current span's `traceparent` in its metadata (kept
/// beside what the metadata already holds); as it was when there is none.
pub fn traced(event: NewEvent) -> NewEvent {
    let Some(tp) = current() else {
        return event;
    };
    let mut meta = event
        .metadata
        .as_ref()
        .and_then(|m| serde_json::from_str::<serde_json::Value>(m.get()).ok())
        .filter(|m| m.is_object())
        .unwrap_or_else(|| serde_json::json!({}));
    meta[TRACEPARENT] = serde_json::Value::String(tp);
    event.with_metadata(&meta)
}

/// The `traceparent` in an event's metadata (JSON text), if a valid one is
/// there.
pub fn of_metadata(metadata: &str) -> Option<String> {
    if !metadata.contains(TRACEPARENT) {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(metadata).ok()?;
    let tp = v.get(TRACEPARENT)?.as_str()?;
    valid(tp).then(|| tp.to_string())
}

/// The trace id of a `traceparent`.
pub fn trace_id(traceparent: &str) -> Option<&str> {
    valid(traceparent).then(|| &traceparent[3..35])
}

/// Whether `tp` is a W3C `traceparent`: `00-<32 hex>-<16 hex>-<2 hex>`,
/// with a trace id and a span id that are not all zeros.
pub fn valid(tp: &str) -> bool {
    let parts: Vec<&str> = tp.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    parts.len() == 4
        && parts[0] == "00"
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
        && parts[1].bytes().any(|b| b != b'0')
        && parts[2].bytes().any(|b| b != b'0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_read_back_from_metadata_and_bad_ones_ignored() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(valid(tp));
        assert_eq!(trace_id(tp), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        let meta = serde_json::json!({"cli": "ana", TRACEPARENT: tp}).to_string();
        assert_eq!(of_metadata(&meta).as_deref(), Some(tp));
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert!(!valid(bad), "{bad}");
            let meta = serde_json::json!({ TRACEPARENT: bad }).to_string();
            assert_eq!(of_metadata(&meta), None, "{bad}");
        }
        assert_eq!(of_metadata("{}"), None);
        assert_eq!(of_metadata("not json traceparent"), None);
        // Without hooks nothing is added.
        let e = traced(NewEvent::new("t.x", &serde_json::json!({})));
        assert!(e.metadata.is_none());
    }
}
