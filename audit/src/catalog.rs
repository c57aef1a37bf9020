//! The event reference for the audit endpoint (see `events::catalog`).

use events::catalog::{req, EventSpec, Ty};

/// `audit.query_recorded`: see its entry in [`EVENTS`].
pub const AUDIT_QUERY_RECORDED: &str = "audit.query_recorded";

/// Every event the replay crate writes.
pub const EVENTS: &[EventSpec] = &[EventSpec {
    event_type: AUDIT_QUERY_RECORDED,
    stream: "auditor/<name>",
    written_by: "the audit endpoint, before the statement runs",
    about: "An auditor's statement. It runs only once this is durable; `audit.queries` shows them.",
    fields: &[
        req("auditor", Ty::String, "The auditor."),
        req(
            "auth",
            Ty::String,
            "How they logged in: `scram` (a password) or `certificate`.",
        ),
        req("client", Ty::String, "The client's address."),
        req("session", Ty::String, "The connection's id."),
        req("protocol", Ty::String, "`simple` or `extended`."),
        req("tls", Ty::Boolean, "Whether the connection is TLS."),
        req("sql", Ty::String, "The statement."),
        req(
            "parameters",
            Ty::Array,
            "Its bound parameters (text, `\\\\x` hex for binary, null), each cut at 1 KiB.",
        ),
    ],
    formerly: &["audit.query"],
}];
