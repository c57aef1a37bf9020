//! The facts of pools, nodes and reservations, each declared once: the
//! [`facts!`] list below names every fact's variant, its event type (the
//! wire name, `noun.verb_past`, and the one reference for its name), the
//! names it was written under before, its stream, who writes it, what it
//! means and its payload's fields. From that one declaration come the
//! [`Fact`] enum and its serde names, [`Fact::event_type`], [`FACT_TYPES`],
//! [`LEGACY_FACT_TYPES`] and the event reference [`EVENTS`] (which
//! `strata events types` and `docs/events.md` render). A variant's name is
//! its event type in CamelCase; a test holds every variant to that.
//!
//! Streams: everything that changes what can be placed in a pool (its nodes,
//! their inventory, health and cordons, and every placement, release and
//! expiry) is on the pool's stream `pool/<name>`, so the pool stream's version
//! is the fence a placer commits against. A reservation's request and the
//! client's later wishes about it (release, activation) are on
//! `reservation/<id>`.

use crate::payload::{payload_version, rfc3339_ms, PayloadVersions, PAYLOAD_VERSION};
use crate::{Allocation, DeviceSpec, QueueSpec, Request};
use events::catalog::{opt, req, EventSpec, Ty};
use serde::{Deserialize, Serialize};

const NODE: events::catalog::Field = req("node", Ty::String, "The node's id.");
const RESERVATION: events::catalog::Field = req("reservation", Ty::String, "The reservation's id.");
const DEVICES: events::catalog::Field = req(
    "devices",
    Ty::Array,
    "The node's GPUs, each `{id, class, memory_mb, island?, pci?, numa?, parent?}`: `id` unique within the node, `class` what reservations ask for (`H100-80GB`; a MIG instance's is its GPU's class and its profile, `H100-80GB/1g.10gb`), `island` the NVLink island, unique within the pool, `parent` the id of the GPU a MIG instance is carved from.",
);

/// Declares every fact once; see the module's documentation.
macro_rules! facts {
    ($(
        $variant:ident = $name:literal {
            stream: $stream:literal,
            written_by: $by:literal,
            about: $about:literal,
            fields: [$($field:expr),* $(,)?],
            formerly: [$($old:literal),* $(,)?] $(,)?
        } $body:tt
    ),* $(,)?) => {
        /// A fact about a pool, a node or a reservation: one event, its
        /// variant's serde name the event type and its fields the JSON
        /// payload.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "type", content = "payload")]
        pub enum Fact {
            $(
                #[doc = $about]
                #[serde(rename = $name)]
                $variant $body,
            )*
        }

        impl Fact {
            /// The event type this fact is written as.
            pub fn event_type(&self) -> &'static str {
                match self {
                    $(Fact::$variant { .. } => $name,)*
                }
            }
        }

        /// Every fact's event type, as it is written now.
        pub const FACT_TYPES: &[&str] = &[$($name),*];

        /// Every fact's variant name beside its event type.
        pub const FACT_VARIANTS: &[(&str, &str)] = &[$((stringify!($variant), $name)),*];

        /// The names facts were written under before every event type
        /// followed `noun.verb_past`, with the name each is read as now.
        /// Events in the log keep the name they were written with;
        /// [`canonical_type`] is the one place that reads an old name as the
        /// new one.
        pub const LEGACY_FACT_TYPES: &[(&str, &str)] = &[$($(($old, $name),)*)*];

        /// The event reference's entries for every fact.
        pub const EVENTS: &[EventSpec] = &[$(
            EventSpec {
                event_type: $name,
                stream: $stream,
                written_by: $by,
                about: $about,
                fields: &[$($field),*],
                formerly: &[$($old),*],
            }
        ),*];
    };
}

facts! {
    PoolCreated = "pool.created" {
        stream: "pool/<pool>",
        written_by: "operators (`strata pool create`)",
        about: "A pool exists. Its stream holds everything that changes what can be placed in it; its version is the fence a placer commits against.",
        fields: [opt("description", Ty::String, "Free text (default empty).")],
        formerly: ["PoolCreated"],
    } {
        #[serde(default)]
        description: String,
    },

    PoolUpdated = "pool.updated" {
        stream: "pool/<pool>",
        written_by: "operators (`strata events append`: no command writes it yet)",
        about: "The pool's description changed.",
        fields: [opt("description", Ty::String, "Free text (default empty).")],
        formerly: ["PoolUpdated"],
    } {
        #[serde(default)]
        description: String,
    },

    NodeJoined = "node.joined" {
        stream: "pool/<pool>",
        written_by: "the gateway, when a node's session opens in the pool; `strata pool seed` (simulated fleets)",
        about: "A node joined the pool with this inventory; joining again replaces it.",
        fields: [NODE, DEVICES],
        formerly: ["NodeJoined"],
    } {
        node: String,
        devices: Vec<DeviceSpec>,
    },

    NodeInventoryReported = "node.inventory_reported" {
        stream: "pool/<pool>",
        written_by: "the gateway, from the node's report",
        about: "The node's inventory is now this. Devices that are gone become unschedulable; bookings on them stay until released.",
        fields: [NODE, DEVICES],
        formerly: ["InventoryReported"],
    } {
        node: String,
        devices: Vec<DeviceSpec>,
    },

    NodeLeft = "node.left" {
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes revoke`, `strata nodes replace`, `strata nodes leave`, the client API's RemoveNode)",
        about: "The node is gone from the pool; its capacity goes with it and the placer fails its live reservations (`reservation.failed`).",
        fields: [NODE, opt("reason", Ty::String, "Why, e.g. `revoked` (absent: it left).")],
        formerly: ["NodeLeft"],
    } {
        node: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
    },

    NodeContactLost = "node.contact_lost" {
        stream: "pool/<pool>",
        written_by: "the gateway, with `node.marked_unreachable` or `node.disconnected`",
        about: "The region lost contact with the node. Nothing new is placed on it; its live reservations fail (`node_lost`) once it stays out of contact past the placer's `--node-lost-after`.",
        fields: [NODE],
        formerly: [],
    } { node: String },

    NodeContactRestored = "node.contact_restored" {
        stream: "pool/<pool>",
        written_by: "the gateway",
        about: "Contact with the node is back (a heartbeat, or a new session).",
        fields: [NODE],
        formerly: [],
    } { node: String },

    NodeCordoned = "node.cordoned" {
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes cordon`, the client API)",
        about: "Nothing new is placed on the node; what runs there stays.",
        fields: [NODE, opt("reason", Ty::String, "Why (default empty).")],
        formerly: ["NodeCordoned"],
    } {
        node: String,
        #[serde(default)]
        reason: String,
    },

    NodeMaintenanceScheduled = "node.maintenance_scheduled" {
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes maintenance`)",
        about: "A maintenance window on the node: no placement may last into it (one placed before must end by its start, by its time to live), nothing is placed during it, and the live reservations that would outlast its start end then (`reservation.expired`, reason `maintenance`, after `reservation.ending_noticed`).",
        fields: [
            NODE,
            req("start", Ty::Time, "When it begins."),
            req("end", Ty::Time, "When it ends: the node takes placements again."),
            opt("reason", Ty::String, "Why (default empty)."),
        ],
        formerly: [],
    } {
        node: String,
        #[serde(rename = "start", with = "rfc3339_ms")]
        start_ms: Option<u64>,
        #[serde(rename = "end", with = "rfc3339_ms")]
        end_ms: Option<u64>,
        #[serde(default)]
        reason: String,
    },

    NodeUncordoned = "node.uncordoned" {
        stream: "pool/<pool>",
        written_by: "operators",
        about: "Lifts `node.cordoned` and `node.drained`.",
        fields: [NODE],
        formerly: ["NodeUncordoned"],
    } { node: String },

    NodeTopologySet = "node.topology_set" {
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes topology`); gateways, for the node's daemon (its `topology` inventory section, when it changes); `strata pool seed --nodes-per-rack` (simulated fleets)",
        about: "Where the node is in the pool's topology, which gangs asking for one rack, block or rail group (or to be spread over them) are placed by. Absent labels are cleared.",
        fields: [
            NODE,
            opt("rack", Ty::String, "Its rack (the nodes under one top-of-rack switch)."),
            opt("block", Ty::String, "Its block (a spine block of racks, or an NVL72 rack's NVLink domain)."),
            opt("rail", Ty::String, "Its rail group (the nodes whose NICs share one set of rail switches)."),
        ],
        formerly: [],
    } {
        node: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rack: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rail: Option<String>,
    },

    NodeDrained = "node.drained" {
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes drain`, the client API); the placer holding the pool, for a fault that asks for it",
        about: "No new placements; the node's live reservations fail (`node_drained`) at the deadline, at once without one. Payload version 2 (in the metadata's `payload_version`) has `deadline` as an RFC 3339 time; version 1 had `deadline_ms`, Unix milliseconds.",
        fields: [
            NODE,
            opt("reason", Ty::String, "Why (default empty)."),
            opt("deadline", Ty::Time, "When its reservations end (absent: at once)."),
            opt("deadline_ms", Ty::Integer, "Payload version 1 only: the deadline in Unix milliseconds."),
            opt("fault", Ty::String, "The fault it was drained for, when the pool's placer drained it for one (`XID-79`, `NVML-unavailable`); it counts against the pool's circuit breaker."),
        ],
        formerly: ["NodeDrained"],
    } {
        node: String,
        #[serde(default)]
        reason: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fault: Option<String>,
        #[serde(
            rename = "deadline",
            default,
            skip_serializing_if = "Option::is_none",
            with = "rfc3339_ms"
        )]
        deadline_ms: Option<u64>,
    },

    HealthRaised = "health.raised" {
        stream: "pool/<pool>",
        written_by: "the gateway, from the node's health report",
        about: "A health condition (an XID or ECC error, say) on a device, or on the whole node without `device`. Unschedulable until cleared.",
        fields: [
            NODE,
            opt("device", Ty::String, "The device's id (absent: the whole node)."),
            req("condition", Ty::String, "The condition's name, e.g. `XID-79`, `ECC-uncorrected`."),
            opt("detail", Ty::String, "Free text (default empty)."),
            opt("severity", Ty::String, "`info`, `warning` or `critical`, from the fault catalog (absent in events written before it: classified when read)."),
            opt("action", Ty::String, "What the fault asks for: `none`, `restart_workload`, `reset_gpu`, `drain_node` or `service` (absent: classified when read). From `reset_gpu` up the GPU (or node) is out of service until the pool's placer decides (`device.quarantined`, `node.drained` or `device.quarantine_withheld`)."),
        ],
        formerly: ["HealthRaised"],
    } {
        node: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
        condition: String,
        #[serde(default)]
        detail: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        severity: Option<crate::faults::Severity>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        action: Option<crate::faults::Action>,
    },

    HealthCleared = "health.cleared" {
        stream: "pool/<pool>",
        written_by: "the gateway, from the node's report; operators (`strata nodes clear-health`, the client API's ClearNodeHealth)",
        about: "The condition raised by `health.raised` with the same node, device and condition is over.",
        fields: [
            NODE,
            opt("device", Ty::String, "The device's id (absent: the whole node)."),
            req("condition", Ty::String, "The condition's name."),
        ],
        formerly: ["HealthCleared"],
    } {
        node: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
        condition: String,
    },

    NodeAcceptanceReported = "node.acceptance_reported" {
        stream: "pool/<pool>",
        written_by: "the gateway, from the node's daemon (with its `gpus` inventory, in the same transaction as `node.joined`; again, alone, when a re-check's result changes or a GPU's condition cleared)",
        about: "The node's acceptance check: every GPU answers, no uncorrected ECC error, no page pending retirement, and `dcgmi diag` where DCGM is installed. A node (or GPU) whose last check failed takes no placement until one passes. A node that never reported one (seeded, or an older daemon) is accepted.",
        fields: [
            NODE,
            req("passed", Ty::Boolean, "Whether every check passed."),
            opt("reason", Ty::String, "Why it failed (default empty)."),
            opt("failed_devices", Ty::Array, "The GPUs that failed (empty with `passed` false: the whole node failed)."),
            opt("report", Ty::Object, "The checks' own report."),
        ],
        formerly: [],
    } {
        node: String,
        passed: bool,
        #[serde(default)]
        reason: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        failed_devices: Vec<String>,
        #[serde(default)]
        report: serde_json::Value,
    },

    DeviceQuarantined = "device.quarantined" {
        stream: "pool/<pool>",
        written_by: "the placer holding the pool, for a fault that takes a GPU out of service (under the pool's fault policy and circuit breaker)",
        about: "The GPU takes no new placements, and its live reservations end (`gpu_fault`; placed again when they asked to be), until `device.restored`.",
        fields: [
            NODE,
            req("device", Ty::String, "The GPU's id."),
            req("condition", Ty::String, "The fault that took it out."),
            req("action", Ty::String, "What the fault asks for (`reset_gpu`, `service`)."),
            opt("reason", Ty::String, "Free text (default empty)."),
        ],
        formerly: [],
    } {
        node: String,
        device: String,
        condition: String,
        action: crate::faults::Action,
        #[serde(default)]
        reason: String,
    },

    DeviceQuarantineWithheld = "device.quarantine_withheld" {
        stream: "pool/<pool>",
        written_by: "the placer holding the pool",
        about: "A fault that asks for a GPU or node to be taken out of service is reported but not acted on: the pool's fault policy is advisory, or its circuit breaker is open (as many GPUs quarantined as it allows). The GPU stays in service; an alert fires.",
        fields: [
            NODE,
            opt("device", Ty::String, "The GPU's id (absent: the whole node)."),
            req("condition", Ty::String, "The fault."),
            req("reason", Ty::String, "Why it was not acted on."),
        ],
        formerly: [],
    } {
        node: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
        condition: String,
        reason: String,
    },

    DeviceRestored = "device.restored" {
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes clear-health`, the client API's ClearNodeHealth); the pool's placer, for a GPU quarantined for a fault a reset clears, once the condition is gone and a check of its node passed it",
        about: "Lifts `device.quarantined`: the GPU takes placements again.",
        fields: [
            NODE,
            req("device", Ty::String, "The GPU's id."),
            opt("reason", Ty::String, "Why (default empty)."),
        ],
        formerly: [],
    } {
        node: String,
        device: String,
        #[serde(default)]
        reason: String,
    },

    PoolFaultPolicySet = "pool.fault_policy_set" {
        stream: "pool/<pool>",
        written_by: "operators (`strata pool policy`)",
        about: "How the pool's placer acts on GPU faults: automatically (quarantine, drain) or advisory (report only), and the circuit breaker: the most of the pool's GPUs quarantined automatically. The default is automatic and 10%.",
        fields: [
            req("automatic", Ty::Boolean, "Whether faults are acted on automatically."),
            req("max_quarantined_percent", Ty::Integer, "The circuit breaker, 0 to 100 (one GPU at least unless 0)."),
        ],
        formerly: [],
    } (crate::faults::Policy),

    PoolPreemptionSet = "pool.preemption_set" {
        stream: "pool/<pool>",
        written_by: "operators (`strata pool preemption`)",
        about: "Whether the pool's placer preempts. On (the default), a waiting request makes room by ending the fewest live reservations of lower priority after the grace period (`reservation.preemption_scheduled`): in a pool shared by queues those of its own queue, or what other queues of its cohort borrowed from its quota; in a pool without queues any of the pool's. Off, requests wait.",
        fields: [req("enabled", Ty::Boolean, "Whether it preempts.")],
        formerly: [],
    } { enabled: bool },

    CohortDecaySet = "cohort.decay_set" {
        stream: "pool/<pool>",
        written_by: "operators (`strata queues cohort`)",
        about: "Whether the fair share of a cohort's queues remembers their past usage, and for how long. On, the queues that borrow are served in the order of what they hold beyond their quota plus what they held beyond it in the past, decayed with this half-life, so a queue that used more yields to one that used less; off (the default), only what they hold now counts. Past usage is kept either way (with a 7-day half-life while off), so turning it on acts on the history at once.",
        fields: [
            req("cohort", Ty::String, "The cohort (a name queues of the pool share)."),
            opt("half_life_ms", Ty::Integer, "The half-life of past usage in milliseconds, a second to 366 days (absent: off)."),
        ],
        formerly: [],
    } {
        cohort: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        half_life_ms: Option<u64>,
    },

    QueueConfigured = "queue.configured" {
        stream: "pool/<pool>",
        written_by: "operators (`strata queues create|set`, the client API)",
        about: "A queue of the pool (a team's share of it) is created or changed; the whole spec replaces the one before. On the pool's stream, so the pool's version fences quota against placement.",
        fields: [
            req("queue", Ty::String, "The queue's name, unique within the pool."),
            opt("cohort", Ty::String, "Queues of one cohort lend each other their unused quota (absent: it borrows and lends nothing)."),
            opt("weight", Ty::Integer, "Its weight in fair sharing, 1 to 1000 (default 1)."),
            req("quotas", Ty::Array, "Per GPU class `{class, nominal, borrowing_limit?}`: `nominal` GPUs it is guaranteed, `borrowing_limit` the most it may borrow beyond them (absent: what its cohort has unused)."),
        ],
        formerly: [],
    } (QueueSpec),

    ReservationRequested = "reservation.requested" {
        stream: "reservation/<id>",
        written_by: "clients (`strata reserve`, the client API); the placer for a replacement",
        about: "A request for GPUs. The placer holding the pool places it, queues it or rejects it.",
        fields: [
            RESERVATION,
            req("pool", Ty::String, "The pool."),
            req("class", Ty::String, "The GPU class, e.g. `H100-80GB`."),
            req("gpus", Ty::Integer, "GPUs in all (a gang: nodes times GPUs per node)."),
            req("shape", Ty::Object, "Where the GPUs may lie: `{kind: any|node|island}` or `{kind: gang, nodes, gpus_per_node}`."),
            opt("priority", Ty::Integer, "Higher is placed first within a batch (default 0)."),
            opt("ttl_ms", Ty::Integer, "Released automatically this long after placement (absent: never)."),
            opt("replace_on_failure", Ty::Boolean, "Placed again as `<id>~<n>` when a node it is on fails (default false)."),
            opt("replaces", Ty::String, "The reservation this one replaces (written by the placer)."),
            opt("start", Ty::Time, "For a reservation in advance: when it is to start; the placer promises its GPUs for its window (`reservation.promised`) or rejects it (absent: as soon as it fits)."),
            opt("queue", Ty::String, "The queue it is admitted under (`queue.configured`). A pool with queues places only requests naming one of them."),
            opt("requeue_on_preemption", Ty::Boolean, "Requested again as `<id>~<n>` when preempted (default false)."),
            opt("topology", Ty::Object, "A gang's place in the topology: `{mode: within|prefer|spread, tier: rack|block|rail}` (all in one rack, block or rail group; in one if it can be had now; each in a different one)."),
        ],
        formerly: ["ReservationRequested"],
    } (Request),

    ReservationQueued = "reservation.queued" {
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "The request does not fit now and waits: written when it first does not fit, and again whenever why it waits changes (`waiting for capacity: ...`, `over quota: ...`).",
        fields: [RESERVATION, req("reason", Ty::String, "Why it does not fit now.")],
        formerly: ["ReservationQueued"],
    } { reservation: String, reason: String },

    ReservationPlaced = "reservation.placed" {
        stream: "pool/<pool>",
        written_by: "the placer, at the pool stream's version it planned against",
        about: "The reservation holds these devices. The binder then binds them on the nodes.",
        fields: [
            RESERVATION,
            req("allocations", Ty::Array, "One `{node, devices: [device id]}` per node."),
        ],
        formerly: ["ReservationPlaced"],
    } {
        reservation: String,
        allocations: Vec<Allocation>,
    },

    ReservationPromised = "reservation.promised" {
        stream: "pool/<pool>",
        written_by: "the placer, at the pool stream's version it planned against",
        about: "A reservation in advance is accepted: these devices are free for it from `start` to `end` (those booked now end by then, by their time to live), and nothing placed before may last into that window on them (backfill lends them only to work that ends before it). It waits, and is placed on them at its start.",
        fields: [
            RESERVATION,
            req("allocations", Ty::Array, "One `{node, devices: [device id]}` per node."),
            req("start", Ty::Time, "When it is placed."),
            req("end", Ty::Time, "When its window ends: its start and its time to live."),
        ],
        formerly: [],
    } {
        reservation: String,
        allocations: Vec<Allocation>,
        #[serde(rename = "start", with = "rfc3339_ms")]
        start_ms: Option<u64>,
        #[serde(rename = "end", with = "rfc3339_ms")]
        end_ms: Option<u64>,
    },

    ReservationRejected = "reservation.rejected" {
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "Terminal: the request can never fit the pool as it is.",
        fields: [RESERVATION, req("reason", Ty::String, "Why it never fits.")],
        formerly: ["ReservationUnschedulable"],
    } { reservation: String, reason: String },

    ReservationActivated = "reservation.activated" {
        stream: "reservation/<id>",
        written_by: "the binder, once every node has bound its devices",
        about: "The workload runs.",
        fields: [RESERVATION],
        formerly: ["ReservationActive"],
    } { reservation: String },

    ReservationReleaseRequested = "reservation.release_requested" {
        stream: "reservation/<id>",
        written_by: "clients (`strata release`, the client API)",
        about: "The client wants the reservation released, or cancelled if it is not placed yet.",
        fields: [RESERVATION, opt("reason", Ty::String, "Why (default empty).")],
        formerly: ["ReleaseRequested"],
    } {
        reservation: String,
        #[serde(default)]
        reason: String,
    },

    ReservationReleased = "reservation.released" {
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "Terminal: its devices are free. Committed with `reservation.ended`.",
        fields: [RESERVATION],
        formerly: ["ReservationReleased"],
    } { reservation: String },

    ReservationExpired = "reservation.expired" {
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "Terminal: its time ran out and its devices are free: its own (`ttl_ms`), or its queue's maximum run time, after `reservation.ending_noticed`.",
        fields: [
            RESERVATION,
            opt("reason", Ty::String, "`max_run_time` for its queue's limit (absent: its own `ttl_ms`)."),
        ],
        formerly: ["ReservationExpired"],
    } {
        reservation: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
    },

    ReservationEndingNoticed = "reservation.ending_noticed" {
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "A live reservation is told it ends at `deadline` for `reason` (`max_run_time`: its queue's maximum run time), one preemption grace period ahead: its nodes get the notice preemption gives (`allocation.preempting`), so its workload can wind down. It then ends as `reservation.expired` with the same reason, unless it ends first.",
        fields: [
            RESERVATION,
            req("reason", Ty::String, "`max_run_time`."),
            opt("deadline", Ty::Time, "When it ends."),
        ],
        formerly: [],
    } {
        reservation: String,
        reason: String,
        #[serde(
            rename = "deadline",
            default,
            skip_serializing_if = "Option::is_none",
            with = "rfc3339_ms"
        )]
        deadline_ms: Option<u64>,
    },

    ReservationFailed = "reservation.failed" {
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "Terminal: a node it was placed on left, was revoked, drained or stayed out of contact too long; its devices are free.",
        fields: [
            RESERVATION,
            req("node", Ty::String, "The node that failed it."),
            req("reason", Ty::String, "`node_left`, `node_revoked`, `node_lost` or `node_drained`."),
            opt("replaced_by", Ty::String, "The reservation requested in its place, in the same transaction (it asked for `replace_on_failure`)."),
        ],
        formerly: [],
    } {
        reservation: String,
        node: String,
        reason: String,
        /// The reservation requested in its place (it asked to be placed
        /// again), in the same transaction.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replaced_by: Option<String>,
    },

    ReservationPreemptionScheduled = "reservation.preemption_scheduled" {
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "A live reservation is to make room for a waiting request: one of higher priority in its queue (or pool), or of a queue taking back quota it lent. It ends as `reservation.preempted` when its grace period ends, unless it ends first; its nodes are told (`allocation.preempting`). Withdrawn if the request is placed or ends before then.",
        fields: [
            RESERVATION,
            req("by", Ty::String, "The waiting request it makes room for."),
            req("reason", Ty::String, "`priority` or `reclaim`."),
            opt("deadline", Ty::Time, "When its grace period ends (absent: at once)."),
        ],
        formerly: [],
    } {
        reservation: String,
        by: String,
        reason: String,
        #[serde(
            rename = "deadline",
            default,
            skip_serializing_if = "Option::is_none",
            with = "rfc3339_ms"
        )]
        deadline_ms: Option<u64>,
    },

    ReservationPreempted = "reservation.preempted" {
        stream: "pool/<pool>",
        written_by: "the placer, with `by`'s placement on the devices it frees",
        about: "Terminal: preempted once its grace period ended; its devices are free.",
        fields: [
            RESERVATION,
            req("by", Ty::String, "The request placed in its place."),
            req("reason", Ty::String, "`priority` or `reclaim`."),
            opt("replaced_by", Ty::String, "The reservation requested in its place, in the same transaction (it asked for `requeue_on_preemption`)."),
        ],
        formerly: [],
    } {
        reservation: String,
        by: String,
        reason: String,
        /// The reservation requested in its place (it asked to be
        /// requeued), in the same transaction.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replaced_by: Option<String>,
    },

    ReservationEnded = "reservation.ended" {
        stream: "reservation/<id>",
        written_by: "the placer, with the terminal fact on the pool's stream",
        about: "The reservation's life cycle is over. It moves the reservation stream's version, which every other writer of the life cycle appends against, so nothing of it commits after its end.",
        fields: [
            RESERVATION,
            req("outcome", Ty::String, "`released`, `expired`, `rejected`, `failed` or `preempted`."),
        ],
        formerly: [],
    } {
        reservation: String,
        /// The terminal fact's name: `released`, `expired`, `rejected`,
        /// `failed` or `preempted`.
        outcome: String,
    },
}

/// The current name of an event type: a fact's old name read as its new
/// one (see [`LEGACY_FACT_TYPES`]), every other type as it is.
pub fn canonical_type(event_type: &str) -> &str {
    // Old names are CamelCase; no current type starts with a capital.
    if !event_type.starts_with(|c: char| c.is_ascii_uppercase()) {
        return event_type;
    }
    LEGACY_FACT_TYPES
        .iter()
        .find(|(old, _)| *old == event_type)
        .map_or(event_type, |(_, new)| new)
}

/// Every name, old and new, under which a fact of type `event_type` (a
/// current name) may be in the log: for SQL that filters by type.
pub fn stored_types(event_type: &str) -> Vec<String> {
    let mut out = vec![event_type.to_string()];
    out.extend(
        LEGACY_FACT_TYPES
            .iter()
            .filter(|(_, new)| *new == event_type)
            .map(|(old, _)| old.to_string()),
    );
    out
}

impl Fact {
    /// The event to append for this fact, its payload in the version this
    /// release writes ([`PayloadVersions::written`]), which is marked in the
    /// metadata when it is above 1.
    pub fn to_event(&self) -> events::NewEvent {
        let mut value = serde_json::to_value(self).expect("facts serialize");
        let mut payload = value
            .get_mut("payload")
            .map(serde_json::Value::take)
            .unwrap_or_else(|| serde_json::json!({}));
        let shape = PayloadVersions::of(self.event_type());
        for down in shape.downcasts[shape.written as usize - 1..].iter().rev() {
            down(&mut payload);
        }
        let event = events::NewEvent::new(self.event_type(), &payload);
        if shape.written > 1 {
            event.with_metadata(&serde_json::json!({ PAYLOAD_VERSION: shape.written }))
        } else {
            event
        }
    }

    /// Reads a fact from an event: `Ok(None)` for event types that are not
    /// facts, an error for a fact whose payload does not parse or whose
    /// payload version (in the event's metadata, see [`PAYLOAD_VERSIONS`])
    /// is newer than this binary reads. Older versions are upcast first.
    pub fn parse(event_type: &str, payload: &str, metadata: &str) -> Result<Option<Fact>, String> {
        let event_type = canonical_type(event_type);
        if !FACT_TYPES.contains(&event_type) {
            return Ok(None);
        }
        let version = payload_version(metadata)?;
        let shape = PayloadVersions::of(event_type);
        if version > shape.read {
            return Err(format!(
                "{event_type} payload version {version} is newer than this binary reads ({}): upgrade strata",
                shape.read
            ));
        }
        if version < shape.read {
            let mut value: serde_json::Value = serde_json::from_str(payload)
                .map_err(|e| format!("malformed {event_type} payload (version {version}): {e}"))?;
            for up in &shape.upcasts[version as usize - 1..] {
                up(&mut value)
                    .map_err(|e| format!("{event_type} payload version {version}: {e}"))?;
            }
            return serde_json::from_value(
                serde_json::json!({ "type": event_type, "payload": value }),
            )
            .map(Some)
            .map_err(|e| {
                format!("malformed {event_type} payload (version {version}, upcast): {e}")
            });
        }
        // The type is one of FACT_TYPES: dotted lower case, nothing to escape.
        let mut text = String::with_capacity(payload.len() + event_type.len() + 24);
        text.push_str("{\"type\":\"");
        text.push_str(event_type);
        text.push_str("\",\"payload\":");
        text.push_str(payload);
        text.push('}');
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| format!("malformed {event_type} payload: {e}"))
    }

    /// How the reservation ended, for the facts that end one: the word
    /// `reservation.ended` records and the client API reports as its state
    /// (`released`, `expired`, `rejected`, `failed`, `preempted`): the
    /// fact's event type without its noun.
    pub fn outcome(&self) -> Option<&'static str> {
        match self {
            Fact::ReservationReleased { .. }
            | Fact::ReservationExpired { .. }
            | Fact::ReservationRejected { .. }
            | Fact::ReservationFailed { .. }
            | Fact::ReservationPreempted { .. } => self.event_type().strip_prefix("reservation."),
            _ => None,
        }
    }

    /// Why a reservation failed, with its replacement if it has one:
    /// `node_lost; placed again as r~1`.
    pub fn failure_reason(reason: &str, replaced_by: Option<&str>) -> String {
        match replaced_by {
            Some(next) => format!("{reason}; placed again as {next}"),
            None => reason.to_string(),
        }
    }

    /// The reservation this fact is about, if any.
    pub fn reservation(&self) -> Option<&str> {
        match self {
            Fact::ReservationRequested(r) => Some(&r.reservation),
            Fact::ReservationQueued { reservation, .. }
            | Fact::ReservationPlaced { reservation, .. }
            | Fact::ReservationRejected { reservation, .. }
            | Fact::ReservationActivated { reservation }
            | Fact::ReservationReleaseRequested { reservation, .. }
            | Fact::ReservationReleased { reservation }
            | Fact::ReservationExpired { reservation, .. }
            | Fact::ReservationFailed { reservation, .. }
            | Fact::ReservationPreemptionScheduled { reservation, .. }
            | Fact::ReservationEndingNoticed { reservation, .. }
            | Fact::ReservationPromised { reservation, .. }
            | Fact::ReservationPreempted { reservation, .. }
            | Fact::ReservationEnded { reservation, .. } => Some(reservation),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;

    #[test]
    fn facts_round_trip_through_events() {
        let facts = [
            Fact::NodeJoined {
                node: "n1".into(),
                devices: vec![DeviceSpec {
                    id: "0".into(),
                    class: "H100-80GB".into(),
                    memory_mb: 81920,
                    island: Some("n1/nvl0".into()),
                    pci: None,
                    numa: Some(0),
                    parent: None,
                }],
            },
            Fact::ReservationRequested(Request {
                reservation: "r1".into(),
                pool: "p".into(),
                class: "H100-80GB".into(),
                gpus: 4,
                shape: Shape::Gang {
                    nodes: 2,
                    gpus_per_node: 2,
                },
                priority: 3,
                ttl_ms: None,
                replace_on_failure: false,
                replaces: None,
                topology: None,
                requeue_on_preemption: false,
                start_ms: None,
                queue: None,
            }),
            Fact::ReservationReleased {
                reservation: "r1".into(),
            },
        ];
        for fact in facts {
            let e = fact.to_event();
            assert_eq!(e.event_type, fact.event_type());
            assert!(!e.payload.get().contains("\"type\""), "{}", e.payload.get());
            let back = Fact::parse(
                &e.event_type,
                e.payload.get(),
                e.metadata.as_ref().map_or("{}", |m| m.get()),
            )
            .unwrap()
            .unwrap();
            assert_eq!(back, fact);
        }
    }

    #[test]
    fn facts_written_under_their_old_names_read_as_the_new_ones() {
        for (old, new) in LEGACY_FACT_TYPES {
            assert!(FACT_TYPES.contains(new), "{new}");
            assert_eq!(canonical_type(old), *new);
            assert!(stored_types(new).iter().any(|t| t == old), "{new}");
        }
        for t in FACT_TYPES {
            assert_eq!(canonical_type(t), *t);
            let (noun, verb) = t.split_once('.').expect("noun.verb_past");
            assert!(!noun.is_empty() && !verb.is_empty(), "{t}");
            assert!(
                t.chars()
                    .all(|c| c.is_ascii_lowercase() || c == '.' || c == '_'),
                "{t}"
            );
        }
        let old = Fact::parse(
            "ReservationPlaced",
            r#"{"reservation":"r1","allocations":[]}"#,
            "{}",
        )
        .unwrap()
        .unwrap();
        assert_eq!(old.event_type(), "reservation.placed");
        assert_eq!(
            Some(old),
            Fact::parse(
                "reservation.placed",
                r#"{"reservation":"r1","allocations":[]}"#,
                "{}"
            )
            .unwrap()
        );
        assert_eq!(canonical_type("command.issued"), "command.issued");
        assert_eq!(canonical_type("Unknown"), "Unknown");
    }

    #[test]
    fn unknown_types_are_not_facts_and_bad_payloads_are_errors() {
        assert_eq!(Fact::parse("dev.tick", "{}", "{}").unwrap(), None);
        let err = Fact::parse("node.left", "{\"nod\":1}", "{}").unwrap_err();
        assert!(err.contains("malformed node.left"), "{err}");
    }

    #[test]
    fn every_variant_is_its_event_type_in_camel_case() {
        for (variant, name) in FACT_VARIANTS {
            let camel: String = name
                .split(['.', '_'])
                .map(|w| {
                    let mut c = w.chars();
                    c.next()
                        .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                        .unwrap_or_default()
                })
                .collect();
            assert_eq!(*variant, camel, "{name}");
        }
    }

    #[test]
    fn every_fact_is_declared_and_writes_the_fields_declared() {
        for t in FACT_TYPES {
            assert!(
                EVENTS.iter().any(|s| s.event_type == *t),
                "{t} is not in EVENTS"
            );
        }
        for (old, new) in LEGACY_FACT_TYPES {
            let spec = EVENTS.iter().find(|s| s.event_type == *new).unwrap();
            assert!(spec.formerly.contains(old), "{new} formerly {old}");
        }
        for s in EVENTS {
            assert!(
                events::catalog::well_named(s.event_type),
                "{}",
                s.event_type
            );
        }
        let node = || "n1".to_string();
        let dev = DeviceSpec {
            id: "0".into(),
            class: "H100-80GB".into(),
            memory_mb: 1,
            island: Some("i".into()),
            pci: Some("p".into()),
            numa: Some(0),
            parent: Some("g".into()),
        };
        let r = || "r1".to_string();
        let facts = vec![
            (
                Fact::PoolCreated {
                    description: "d".into(),
                },
                "pool/p",
            ),
            (
                Fact::PoolUpdated {
                    description: "d".into(),
                },
                "pool/p",
            ),
            (
                Fact::NodeJoined {
                    node: node(),
                    devices: vec![dev.clone()],
                },
                "pool/p",
            ),
            (
                Fact::NodeInventoryReported {
                    node: node(),
                    devices: vec![dev],
                },
                "pool/p",
            ),
            (
                Fact::NodeLeft {
                    node: node(),
                    reason: "revoked".into(),
                },
                "pool/p",
            ),
            (Fact::NodeContactLost { node: node() }, "pool/p"),
            (Fact::NodeContactRestored { node: node() }, "pool/p"),
            (
                Fact::NodeCordoned {
                    node: node(),
                    reason: "x".into(),
                },
                "pool/p",
            ),
            (Fact::NodeUncordoned { node: node() }, "pool/p"),
            (
                Fact::NodeTopologySet {
                    node: node(),
                    rack: Some("r1".into()),
                    block: Some("b1".into()),
                    rail: Some("rail-a".into()),
                },
                "pool/p",
            ),
            (
                Fact::NodeDrained {
                    node: node(),
                    reason: "x".into(),
                    deadline_ms: Some(1),
                    fault: Some("XID-79".into()),
                },
                "pool/p",
            ),
            (
                Fact::NodeDrained {
                    node: node(),
                    reason: "x".into(),
                    deadline_ms: None,
                    fault: None,
                },
                "pool/p",
            ),
            (
                Fact::HealthRaised {
                    node: node(),
                    device: Some("0".into()),
                    condition: "c".into(),
                    detail: "d".into(),
                    severity: Some(crate::faults::Severity::Warning),
                    action: Some(crate::faults::Action::ResetGpu),
                },
                "pool/p",
            ),
            (
                Fact::HealthCleared {
                    node: node(),
                    device: None,
                    condition: "c".into(),
                },
                "pool/p",
            ),
            (
                Fact::NodeAcceptanceReported {
                    node: node(),
                    passed: false,
                    reason: "r".into(),
                    failed_devices: vec!["0".into()],
                    report: serde_json::json!({"gpus": []}),
                },
                "pool/p",
            ),
            (
                Fact::DeviceQuarantined {
                    node: node(),
                    device: "0".into(),
                    condition: "XID-48".into(),
                    action: crate::faults::Action::ResetGpu,
                    reason: "r".into(),
                },
                "pool/p",
            ),
            (
                Fact::DeviceQuarantineWithheld {
                    node: node(),
                    device: Some("0".into()),
                    condition: "XID-48".into(),
                    reason: "r".into(),
                },
                "pool/p",
            ),
            (
                Fact::DeviceRestored {
                    node: node(),
                    device: "0".into(),
                    reason: "r".into(),
                },
                "pool/p",
            ),
            (
                Fact::PoolFaultPolicySet(crate::faults::Policy {
                    automatic: false,
                    max_quarantined_percent: 5,
                }),
                "pool/p",
            ),
            (Fact::PoolPreemptionSet { enabled: false }, "pool/p"),
            (
                Fact::NodeMaintenanceScheduled {
                    node: node(),
                    start_ms: Some(1_800_000_000_000),
                    end_ms: Some(1_800_003_600_000),
                    reason: "firmware".into(),
                },
                "pool/p",
            ),
            (
                Fact::ReservationPromised {
                    reservation: r(),
                    allocations: vec![Allocation {
                        node: node(),
                        devices: vec!["0".into()],
                    }],
                    start_ms: Some(1_800_000_000_000),
                    end_ms: Some(1_800_003_600_000),
                },
                "pool/p",
            ),
            (
                Fact::CohortDecaySet {
                    cohort: "c".into(),
                    half_life_ms: Some(604_800_000),
                },
                "pool/p",
            ),
            (
                Fact::ReservationRequested(Request {
                    reservation: r(),
                    pool: "p".into(),
                    class: "c".into(),
                    gpus: 2,
                    shape: Shape::Gang {
                        nodes: 1,
                        gpus_per_node: 2,
                    },
                    priority: 1,
                    ttl_ms: Some(5),
                    replace_on_failure: true,
                    replaces: Some("r0".into()),
                    topology: Some(crate::Topology::Within(crate::Tier::Rack)),
                    requeue_on_preemption: true,
                    start_ms: None,
                    queue: Some("ml".into()),
                }),
                "reservation/r1",
            ),
            (
                Fact::QueueConfigured(crate::QueueSpec {
                    queue: "ml".into(),
                    cohort: Some("research".into()),
                    weight: 2,
                    quotas: vec![crate::Quota {
                        class: "c".into(),
                        nominal: 8,
                        borrowing_limit: Some(4),
                    }],
                    budgets: Vec::new(),
                    max_run_ms: None,
                }),
                "pool/p",
            ),
            (
                Fact::ReservationQueued {
                    reservation: r(),
                    reason: "x".into(),
                },
                "pool/p",
            ),
            (
                Fact::ReservationPlaced {
                    reservation: r(),
                    allocations: vec![Allocation {
                        node: node(),
                        devices: vec!["0".into()],
                    }],
                },
                "pool/p",
            ),
            (
                Fact::ReservationRejected {
                    reservation: r(),
                    reason: "x".into(),
                },
                "pool/p",
            ),
            (
                Fact::ReservationActivated { reservation: r() },
                "reservation/r1",
            ),
            (
                Fact::ReservationReleaseRequested {
                    reservation: r(),
                    reason: "x".into(),
                },
                "reservation/r1",
            ),
            (Fact::ReservationReleased { reservation: r() }, "pool/p"),
            (
                Fact::ReservationExpired {
                    reservation: r(),
                    reason: "max_run_time".into(),
                },
                "pool/p",
            ),
            (
                Fact::ReservationEndingNoticed {
                    reservation: r(),
                    reason: "max_run_time".into(),
                    deadline_ms: Some(1_800_000_000_000),
                },
                "pool/p",
            ),
            (
                Fact::ReservationFailed {
                    reservation: r(),
                    node: node(),
                    reason: "node_lost".into(),
                    replaced_by: Some("r1~1".into()),
                },
                "pool/p",
            ),
            (
                Fact::ReservationPreemptionScheduled {
                    reservation: r(),
                    by: "r2".into(),
                    reason: "priority".into(),
                    deadline_ms: Some(1_700_000_000_000),
                },
                "pool/p",
            ),
            (
                Fact::ReservationPreempted {
                    reservation: r(),
                    by: "r2".into(),
                    reason: "reclaim".into(),
                    replaced_by: Some("r1~1".into()),
                },
                "pool/p",
            ),
            (
                Fact::ReservationEnded {
                    reservation: r(),
                    outcome: "released".into(),
                },
                "reservation/r1",
            ),
        ];
        let mut seen = std::collections::BTreeSet::new();
        for (fact, stream) in facts {
            let e = fact.to_event();
            seen.insert(e.event_type.clone());
            let payload: serde_json::Value = serde_json::from_str(e.payload.get()).unwrap();
            events::catalog::conforms(EVENTS, &e.event_type, stream, &payload)
                .unwrap_or_else(|err| panic!("{err}"));
        }
        assert_eq!(
            seen.len(),
            FACT_TYPES.len(),
            "every fact type serialized: {seen:?}"
        );
    }
}
