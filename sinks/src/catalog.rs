//! The event reference for sinks (see `events::catalog`).

use events::catalog::{opt, req, EventSpec, Ty};

/// `sink.created`: see its entry in [`EVENTS`].
pub const SINK_CREATED: &str = "sink.created";
/// `sink.paused`: see its entry in [`EVENTS`].
pub const SINK_PAUSED: &str = "sink.paused";
/// `sink.resumed`: see its entry in [`EVENTS`].
pub const SINK_RESUMED: &str = "sink.resumed";
/// `sink.deleted`: see its entry in [`EVENTS`].
pub const SINK_DELETED: &str = "sink.deleted";
/// `sink.reset`: see its entry in [`EVENTS`].
pub const SINK_RESET: &str = "sink.reset";
/// `sink.alerted`: see its entry in [`EVENTS`].
pub const SINK_ALERTED: &str = "sink.alerted";

const NAME: events::catalog::Field = req("name", Ty::String, "The sink's name.");

/// Every event the sinks crate writes.
pub const EVENTS: &[EventSpec] = &[
    EventSpec {
        event_type: SINK_CREATED,
        stream: "sink/<name>",
        written_by: "operators (`strata sinks create`)",
        about: "A sink: events matching its filter are delivered to its target, in log order, at least once. After `sink.deleted` the name may be defined again: the new sink starts afresh (no cursor, no parked events of the old one).",
        fields: &[
            NAME,
            req("target", Ty::Object, "`{kind: webhook, url, secret_env}` (batches POSTed as JSON, signed with HMAC-SHA256 from the environment variable `secret_env`; the secret is never in the log) or `{kind: nats, url, subject_prefix}` (JetStream, one message per event)."),
            opt("filter", Ty::Object, "`{types: [...], prefixes: [...]}`: event types and stream prefixes; empty lists match all (default: everything)."),
            opt("start", Ty::String, "`start`, `now` or a position (default `start`)."),
            opt("batch_max", Ty::Integer, "Most events in one delivery (default 500)."),
            opt("max_attempts", Ty::Integer, "Attempts before a batch is parked (default 8)."),
            opt("retry", Ty::Object, "`{base_ms, cap_ms}`: the wait before attempt n+1 is drawn between half and all of min(base * 2^n, cap) (absent: the sinks process's default, 500 ms and 10 s)."),
            opt("credentials", Ty::Boolean, "`true` when the target's URL had credentials (`user:password@` or `token@`): they are kept in `strata.sink_credentials`, which no auditor can read, and `url` here is without them. Sinks recorded before this field may hold them in `url`."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: SINK_PAUSED,
        stream: "sink/<name>",
        written_by: "operators (`strata sinks pause`); the sinks role, after `sink.alerted`",
        about: "Nothing more is delivered until `sink.resumed`; its subscription keeps its place.",
        fields: &[NAME, opt("by", Ty::String, "`alert` when the sinks role paused it (absent: an operator).")],
        formerly: &[],
    },
    EventSpec {
        event_type: SINK_RESUMED,
        stream: "sink/<name>",
        written_by: "operators (`strata sinks resume`)",
        about: "Delivery goes on from where it stopped.",
        fields: &[NAME],
        formerly: &[],
    },
    EventSpec {
        event_type: SINK_DELETED,
        stream: "sink/<name>",
        written_by: "operators (`strata sinks delete`)",
        about: "The sink is gone; its subscription is dropped.",
        fields: &[NAME],
        formerly: &[],
    },
    EventSpec {
        event_type: SINK_RESET,
        stream: "sink/<name>",
        written_by: "operators (`strata sinks reset`)",
        about: "The sink's subscription was moved: delivery goes on after `to`.",
        fields: &[NAME, req("to", Ty::Integer, "The position it resumes after.")],
        formerly: &[],
    },
    EventSpec {
        event_type: SINK_ALERTED,
        stream: "sink/<name>",
        written_by: "the sinks role",
        about: "Batch after batch could not be delivered; committed with `sink.paused` (`by: alert`).",
        fields: &[
            NAME,
            req("reason", Ty::String, "What happened."),
            req("last_error", Ty::String, "The last delivery's error."),
        ],
        formerly: &["sink.alert"],
    },
];
