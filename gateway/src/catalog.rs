//! The event reference for what gateways write about nodes, certificates,
//! grants and roles (see `events::catalog`). The CLI tests check the events
//! real gateways wrote against it.

use events::catalog::{opt, req, EventSpec, Ty};

/// `node.certificate_issued`: see its entry in [`EVENTS`].
pub const NODE_CERTIFICATE_ISSUED: &str = "node.certificate_issued";
/// `node.certificate_renewed`: see its entry in [`EVENTS`].
pub const NODE_CERTIFICATE_RENEWED: &str = "node.certificate_renewed";
/// `node.revoked`: see its entry in [`EVENTS`].
pub const NODE_REVOKED: &str = "node.revoked";
/// `node.session_opened`: see its entry in [`EVENTS`].
pub const NODE_SESSION_OPENED: &str = "node.session_opened";
/// `node.session_expired`: see its entry in [`EVENTS`].
pub const NODE_SESSION_EXPIRED: &str = "node.session_expired";
/// `node.disconnected`: see its entry in [`EVENTS`].
pub const NODE_DISCONNECTED: &str = "node.disconnected";
/// `node.marked_unreachable`: see its entry in [`EVENTS`].
pub const NODE_MARKED_UNREACHABLE: &str = "node.marked_unreachable";
/// `node.marked_reachable`: see its entry in [`EVENTS`].
pub const NODE_MARKED_REACHABLE: &str = "node.marked_reachable";
/// `node.status_reported`: see its entry in [`EVENTS`].
pub const NODE_STATUS_REPORTED: &str = "node.status_reported";
/// `certificate.revoked`: see its entry in [`EVENTS`].
pub const CERTIFICATE_REVOKED: &str = "certificate.revoked";
/// `grant.set`: see its entry in [`EVENTS`].
pub const GRANT_SET: &str = "grant.set";
/// `grant.revoked`: see its entry in [`EVENTS`].
pub const GRANT_REVOKED: &str = "grant.revoked";
/// `role.set`: see its entry in [`EVENTS`].
pub const ROLE_SET: &str = "role.set";
/// `role.removed`: see its entry in [`EVENTS`].
pub const ROLE_REMOVED: &str = "role.removed";
/// `pool.dcgm_level_set`: see its entry in [`EVENTS`].
pub const POOL_DCGM_LEVEL_SET: &str = "pool.dcgm_level_set";

const NODE: events::catalog::Field = req("node", Ty::String, "The node's id.");

/// Every event the gateway crate writes.
pub const EVENTS: &[EventSpec] = &[
    EventSpec {
        event_type: NODE_CERTIFICATE_ISSUED,
        stream: "node/<node>",
        written_by: "the gateway, on a join",
        about: "The node spent a join token and got its first certificate for this pool.",
        fields: &[
            NODE,
            req("pool", Ty::String, "The pool the node joins."),
            req("serial", Ty::String, "The certificate's serial number (hex)."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: NODE_CERTIFICATE_RENEWED,
        stream: "node/<node>",
        written_by: "the gateway, when a node renews",
        about: "The node has a new certificate; the one it follows stays valid until it expires.",
        fields: &[
            NODE,
            req("pool", Ty::String, "The node's pool."),
            req("serial", Ty::String, "The new certificate's serial number (hex)."),
            req("follows", Ty::String, "The serial of the certificate it renews."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: NODE_REVOKED,
        stream: "node/<node>",
        written_by: "operators (`strata nodes revoke`, `strata nodes replace`)",
        about: "Every certificate of the node is revoked; committed with `node.left` (reason `revoked`) on each pool's stream. Gateways end its sessions.",
        fields: &[
            NODE,
            req("reason", Ty::String, "Why."),
            req("certificates", Ty::Integer, "How many certificates were revoked."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: NODE_SESSION_OPENED,
        stream: "node/<node>",
        written_by: "the gateway the node connected to",
        about: "A session with the node opened. It is appended at the stream's exact version, so it takes ownership from any older session: the older owner's later writes are refused.",
        fields: &[
            NODE,
            req("gateway", Ty::String, "The gateway holding the session."),
            req("generation", Ty::Integer, "The node daemon's start count (grows on every start)."),
            req("agent_version", Ty::String, "The daemon's version."),
            opt("pool", Ty::String, "The node's pool (absent from gateways before leases)."),
            opt("gateway_epoch", Ty::Integer, "The epoch of the gateway's lease (`gateway/<id>`) when it opened the session."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: NODE_SESSION_EXPIRED,
        stream: "node/<node>",
        written_by: "another gateway (or the same one, restarted), once the session's gateway's lease lapsed",
        about: "The gateway holding the session died, froze or lost the database: its lease `gateway/<id>` lapsed or belongs to a newer epoch. Appended at the node stream's exact version (a node that opened a session elsewhere is not marked, and the old gateway's later writes are refused), with `node.contact_lost` on the pool's stream in the same transaction.",
        fields: &[
            NODE,
            req("gateway", Ty::String, "The gateway that held the session."),
            req("gateway_epoch", Ty::Integer, "Its lease's epoch when it opened the session."),
            req("by", Ty::String, "The gateway that found it lapsed."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: NODE_DISCONNECTED,
        stream: "node/<node>",
        written_by: "the gateway holding the session",
        about: "The node's side ended the session (it closed the stream, the connection broke); committed with `node.contact_lost` on the pool's stream.",
        fields: &[NODE, req("gateway", Ty::String, "The gateway that held the session.")],
        formerly: &[],
    },
    EventSpec {
        event_type: NODE_MARKED_UNREACHABLE,
        stream: "node/<node>",
        written_by: "the gateway holding the session",
        about: "The session went silent for three heartbeat intervals; committed with `node.contact_lost` on the pool's stream.",
        fields: &[NODE],
        formerly: &["node.unreachable"],
    },
    EventSpec {
        event_type: NODE_MARKED_REACHABLE,
        stream: "node/<node>",
        written_by: "the gateway holding the session",
        about: "A node marked unreachable was heard again; committed with `node.contact_restored` on the pool's stream.",
        fields: &[NODE],
        formerly: &["node.reachable"],
    },
    EventSpec {
        event_type: NODE_STATUS_REPORTED,
        stream: "node/<node>",
        written_by: "the gateway holding the session, when the node's status changes",
        about: "The node daemon's own state.",
        fields: &[
            NODE,
            req("state", Ty::String, "The daemon's state, e.g. `ready`."),
            req("detail", Ty::String, "Free text."),
        ],
        formerly: &["node.status"],
    },
    EventSpec {
        event_type: CERTIFICATE_REVOKED,
        stream: "<kind>/<name> (node/, operator/, auditor/) or certificate/<serial>",
        written_by: "operators (`strata ca revoke`)",
        about: "One certificate is revoked; every gateway and the audit endpoint refuse it from then on.",
        fields: &[
            req("serial", Ty::String, "The certificate's serial number (hex)."),
            opt("kind", Ty::String, "Whose: `operator`, `auditor` (null when only the serial was given)."),
            opt("name", Ty::String, "The holder's name (null when only the serial was given)."),
            req("reason", Ty::String, "Why."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: GRANT_SET,
        stream: "grant/<caller>",
        written_by: "admins (`strata grants set`)",
        about: "What an operator certificate may read through the API's Subscribe; replaces the caller's grant.",
        fields: &[
            req("stream_prefixes", Ty::Array, "Stream prefixes it may read (strings); empty: none."),
            opt("types", Ty::Array, "Event types it may read (strings); empty: every type within the prefixes."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: GRANT_REVOKED,
        stream: "grant/<caller>",
        written_by: "admins (`strata grants remove`)",
        about: "The caller's grant is gone: its Subscribe streams get nothing more.",
        fields: &[],
        formerly: &[],
    },
    EventSpec {
        event_type: ROLE_SET,
        stream: "role/<operator>",
        written_by: "admins (`strata roles set`)",
        about: "What the operator may do through the client API; replaces the operator's role.",
        fields: &[
            req("role", Ty::String, "`admin`, `operator` or `viewer`."),
            opt("pools", Ty::Array, "The pools an `operator` acts in (strings); empty for the others."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: ROLE_REMOVED,
        stream: "role/<operator>",
        written_by: "admins (`strata roles remove`)",
        about: "The operator has no role: the client API refuses it.",
        fields: &[],
        formerly: &[],
    },
    EventSpec {
        event_type: POOL_DCGM_LEVEL_SET,
        stream: "dcgm-level/<pool>",
        written_by: "operators (`strata pool policy --dcgm-level`)",
        about: "The `dcgmi diag` level of the pool's acceptance checks; gateways tell it to each node when its session opens (nodes that do not run DCGM ignore it). Without one, each node's own `--dcgm-level`.",
        fields: &[
            req("pool", Ty::String, "The pool."),
            req("level", Ty::Integer, "1 (quick) to 4 (extended); 0: DCGM is not run."),
        ],
        formerly: &[],
    },
];
