//! The event reference for the audit endpoint (see `events::catalog`).

use events::catalog::{req, EventSpec, Ty};

/// Every event the replay crate writes.
pub const EVENTS: &[EventSpec] = &[EventSpec {
    event_type: "audit.query_recorded",
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
