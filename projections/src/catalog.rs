//! The event reference for the facts of pools, nodes and reservations
//! (`domain::Fact`) and for commands to nodes (`commands`): see
//! `events::catalog`. A test serializes every fact and checks it against
//! its entry here, so the fields listed are the fields written.

use events::catalog::{opt, req, EventSpec, Ty};

const NODE: events::catalog::Field = req("node", Ty::String, "The node's id.");
const RESERVATION: events::catalog::Field = req("reservation", Ty::String, "The reservation's id.");
const DEVICES: events::catalog::Field = req(
    "devices",
    Ty::Array,
    "The node's GPUs, each `{id, class, memory_mb, island?, pci?, numa?}`: `id` unique within the node, `class` what reservations ask for (`H100-80GB`), `island` the NVLink island, unique within the pool.",
);

/// Every fact and command event.
pub const EVENTS: &[EventSpec] = &[
    EventSpec {
        event_type: "pool.created",
        stream: "pool/<pool>",
        written_by: "operators (`strata pool create`)",
        about: "A pool exists. Its stream holds everything that changes what can be placed in it; its version is the fence a placer commits against.",
        fields: &[opt("description", Ty::String, "Free text (default empty).")],
        formerly: &["PoolCreated"],
    },
    EventSpec {
        event_type: "pool.updated",
        stream: "pool/<pool>",
        written_by: "operators (`strata events append`: no command writes it yet)",
        about: "The pool's description changed.",
        fields: &[opt("description", Ty::String, "Free text (default empty).")],
        formerly: &["PoolUpdated"],
    },
    EventSpec {
        event_type: "node.joined",
        stream: "pool/<pool>",
        written_by: "the gateway, when a node's session opens in the pool; `strata pool seed` (simulated fleets)",
        about: "A node joined the pool with this inventory; joining again replaces it.",
        fields: &[NODE, DEVICES],
        formerly: &["NodeJoined"],
    },
    EventSpec {
        event_type: "node.inventory_reported",
        stream: "pool/<pool>",
        written_by: "the gateway, from the node's report",
        about: "The node's inventory is now this. Devices that are gone become unschedulable; bookings on them stay until released.",
        fields: &[NODE, DEVICES],
        formerly: &["InventoryReported"],
    },
    EventSpec {
        event_type: "node.left",
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes revoke`, `strata nodes replace`, `strata nodes leave`, the client API's RemoveNode)",
        about: "The node is gone from the pool; its capacity goes with it and the placer fails its live reservations (`reservation.failed`).",
        fields: &[NODE, opt("reason", Ty::String, "Why, e.g. `revoked` (absent: it left).")],
        formerly: &["NodeLeft"],
    },
    EventSpec {
        event_type: "node.contact_lost",
        stream: "pool/<pool>",
        written_by: "the gateway, with `node.marked_unreachable` or `node.disconnected`",
        about: "The region lost contact with the node. Nothing new is placed on it; its live reservations fail (`node_lost`) once it stays out of contact past the placer's `--node-lost-after`.",
        fields: &[NODE],
        formerly: &[],
    },
    EventSpec {
        event_type: "node.contact_restored",
        stream: "pool/<pool>",
        written_by: "the gateway",
        about: "Contact with the node is back (a heartbeat, or a new session).",
        fields: &[NODE],
        formerly: &[],
    },
    EventSpec {
        event_type: "node.cordoned",
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes cordon`, the client API)",
        about: "Nothing new is placed on the node; what runs there stays.",
        fields: &[NODE, opt("reason", Ty::String, "Why (default empty).")],
        formerly: &["NodeCordoned"],
    },
    EventSpec {
        event_type: "node.uncordoned",
        stream: "pool/<pool>",
        written_by: "operators",
        about: "Lifts `node.cordoned` and `node.drained`.",
        fields: &[NODE],
        formerly: &["NodeUncordoned"],
    },
    EventSpec {
        event_type: "node.topology_set",
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes topology`); gateways, for the node's daemon (its `topology` inventory section, when it changes); `strata pool seed --nodes-per-rack` (simulated fleets)",
        about: "Where the node is in the pool's topology, which gangs asking for one rack, block or rail group (or to be spread over them) are placed by. Absent labels are cleared.",
        fields: &[
            NODE,
            opt("rack", Ty::String, "Its rack (the nodes under one top-of-rack switch)."),
            opt("block", Ty::String, "Its block (a spine block of racks, or an NVL72 rack's NVLink domain)."),
            opt("rail", Ty::String, "Its rail group (the nodes whose NICs share one set of rail switches)."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "node.drained",
        stream: "pool/<pool>",
        written_by: "operators (`strata nodes drain`, the client API)",
        about: "No new placements; the node's live reservations fail (`node_drained`) at the deadline, at once without one. Payload version 2 (in the metadata's `payload_version`) has `deadline` as an RFC 3339 time; version 1 had `deadline_ms`, Unix milliseconds.",
        fields: &[
            NODE,
            opt("reason", Ty::String, "Why (default empty)."),
            opt("deadline", Ty::Time, "When its reservations end (absent: at once)."),
            opt("deadline_ms", Ty::Integer, "Payload version 1 only: the deadline in Unix milliseconds."),
        ],
        formerly: &["NodeDrained"],
    },
    EventSpec {
        event_type: "health.raised",
        stream: "pool/<pool>",
        written_by: "the gateway, from the node's health report",
        about: "A health condition (an XID or ECC error, say) on a device, or on the whole node without `device`. Unschedulable until cleared.",
        fields: &[
            NODE,
            opt("device", Ty::String, "The device's id (absent: the whole node)."),
            req("condition", Ty::String, "The condition's name, e.g. `xid_79`."),
            opt("detail", Ty::String, "Free text (default empty)."),
        ],
        formerly: &["HealthRaised"],
    },
    EventSpec {
        event_type: "health.cleared",
        stream: "pool/<pool>",
        written_by: "the gateway, from the node's report; operators (`strata nodes clear-health`, the client API's ClearNodeHealth)",
        about: "The condition raised by `health.raised` with the same node, device and condition is over.",
        fields: &[
            NODE,
            opt("device", Ty::String, "The device's id (absent: the whole node)."),
            req("condition", Ty::String, "The condition's name."),
        ],
        formerly: &["HealthCleared"],
    },
    EventSpec {
        event_type: "queue.configured",
        stream: "pool/<pool>",
        written_by: "operators (`strata queues create|set`, the client API)",
        about: "A queue of the pool (a team's share of it) is created or changed; the whole spec replaces the one before. On the pool's stream, so the pool's version fences quota against placement.",
        fields: &[
            req("queue", Ty::String, "The queue's name, unique within the pool."),
            opt("cohort", Ty::String, "Queues of one cohort lend each other their unused quota (absent: it borrows and lends nothing)."),
            opt("weight", Ty::Integer, "Its weight in fair sharing, 1 to 1000 (default 1)."),
            req("quotas", Ty::Array, "Per GPU class `{class, nominal, borrowing_limit?}`: `nominal` GPUs it is guaranteed, `borrowing_limit` the most it may borrow beyond them (absent: what its cohort has unused)."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "reservation.requested",
        stream: "reservation/<id>",
        written_by: "clients (`strata reserve`, the client API); the placer for a replacement",
        about: "A request for GPUs. The placer holding the pool places it, queues it or rejects it.",
        fields: &[
            RESERVATION,
            req("pool", Ty::String, "The pool."),
            req("class", Ty::String, "The GPU class, e.g. `H100-80GB`."),
            req("gpus", Ty::Integer, "GPUs in all (a gang: nodes times GPUs per node)."),
            req("shape", Ty::Object, "Where the GPUs may lie: `{kind: any|node|island}` or `{kind: gang, nodes, gpus_per_node}`."),
            opt("priority", Ty::Integer, "Higher is placed first within a batch (default 0)."),
            opt("ttl_ms", Ty::Integer, "Released automatically this long after placement (absent: never)."),
            opt("replace_on_failure", Ty::Boolean, "Placed again as `<id>~<n>` when a node it is on fails (default false)."),
            opt("replaces", Ty::String, "The reservation this one replaces (written by the placer)."),
            opt("queue", Ty::String, "The queue it is admitted under (`queue.configured`). A pool with queues places only requests naming one of them."),
            opt("requeue_on_preemption", Ty::Boolean, "Requested again as `<id>~<n>` when preempted (default false)."),
            opt("topology", Ty::Object, "A gang's place in the topology: `{mode: within|prefer|spread, tier: rack|block|rail}` (all in one rack, block or rail group; in one if it can be had now; each in a different one)."),
        ],
        formerly: &["ReservationRequested"],
    },
    EventSpec {
        event_type: "reservation.queued",
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "The request does not fit now and waits: written when it first does not fit, and again whenever why it waits changes (`waiting for capacity: ...`, `over quota: ...`).",
        fields: &[RESERVATION, req("reason", Ty::String, "Why it does not fit now.")],
        formerly: &["ReservationQueued"],
    },
    EventSpec {
        event_type: "reservation.placed",
        stream: "pool/<pool>",
        written_by: "the placer, at the pool stream's version it planned against",
        about: "The reservation holds these devices. The binder then binds them on the nodes.",
        fields: &[
            RESERVATION,
            req("allocations", Ty::Array, "One `{node, devices: [device id]}` per node."),
        ],
        formerly: &["ReservationPlaced"],
    },
    EventSpec {
        event_type: "reservation.rejected",
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "Terminal: the request can never fit the pool as it is.",
        fields: &[RESERVATION, req("reason", Ty::String, "Why it never fits.")],
        formerly: &["ReservationUnschedulable"],
    },
    EventSpec {
        event_type: "reservation.activated",
        stream: "reservation/<id>",
        written_by: "the binder, once every node has bound its devices",
        about: "The workload runs.",
        fields: &[RESERVATION],
        formerly: &["ReservationActive"],
    },
    EventSpec {
        event_type: "reservation.release_requested",
        stream: "reservation/<id>",
        written_by: "clients (`strata release`, the client API)",
        about: "The client wants the reservation released, or cancelled if it is not placed yet.",
        fields: &[RESERVATION, opt("reason", Ty::String, "Why (default empty).")],
        formerly: &["ReleaseRequested"],
    },
    EventSpec {
        event_type: "reservation.released",
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "Terminal: its devices are free. Committed with `reservation.ended`.",
        fields: &[RESERVATION],
        formerly: &["ReservationReleased"],
    },
    EventSpec {
        event_type: "reservation.expired",
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "Terminal: its time (`ttl_ms`) ran out and its devices are free.",
        fields: &[RESERVATION],
        formerly: &["ReservationExpired"],
    },
    EventSpec {
        event_type: "reservation.failed",
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "Terminal: a node it was placed on left, was revoked, drained or stayed out of contact too long; its devices are free.",
        fields: &[
            RESERVATION,
            req("node", Ty::String, "The node that failed it."),
            req("reason", Ty::String, "`node_left`, `node_revoked`, `node_lost` or `node_drained`."),
            opt("replaced_by", Ty::String, "The reservation requested in its place, in the same transaction (it asked for `replace_on_failure`)."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "reservation.preemption_scheduled",
        stream: "pool/<pool>",
        written_by: "the placer",
        about: "A live reservation is to make room for a waiting request: one of higher priority in its queue (or pool), or of a queue taking back quota it lent. It ends as `reservation.preempted` when its grace period ends, unless it ends first; its nodes are told (`allocation.preempting`). Withdrawn if the request is placed or ends before then.",
        fields: &[
            RESERVATION,
            req("by", Ty::String, "The waiting request it makes room for."),
            req("reason", Ty::String, "`priority` or `reclaim`."),
            opt("deadline", Ty::Time, "When its grace period ends (absent: at once)."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "reservation.preempted",
        stream: "pool/<pool>",
        written_by: "the placer, with `by`'s placement on the devices it frees",
        about: "Terminal: preempted once its grace period ended; its devices are free.",
        fields: &[
            RESERVATION,
            req("by", Ty::String, "The request placed in its place."),
            req("reason", Ty::String, "`priority` or `reclaim`."),
            opt("replaced_by", Ty::String, "The reservation requested in its place, in the same transaction (it asked for `requeue_on_preemption`)."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "reservation.ended",
        stream: "reservation/<id>",
        written_by: "the placer, with the terminal fact on the pool's stream",
        about: "The reservation's life cycle is over. It moves the reservation stream's version, which every other writer of the life cycle appends against, so nothing of it commits after its end.",
        fields: &[
            RESERVATION,
            req("outcome", Ty::String, "`released`, `expired`, `rejected`, `failed` or `preempted`."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "command.issued",
        stream: "command/<id>",
        written_by: "operators (`strata commands issue`, the client API); the binder (`allocation.bind`, `allocation.release`)",
        about: "A command for a node. Each later transition is appended at the exact version it follows, so a command ends in exactly one terminal state.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("node", Ty::String, "The node that runs it."),
            req("kind", Ty::String, "`diag.nvml`, `allocation.bind`, `allocation.release`, ..."),
            opt("args", Ty::Object, "Its arguments (default none)."),
            req("deadline_ms", Ty::Integer, "Unix milliseconds after which it is not run."),
            opt("issued_by", Ty::String, "`operator:<name>`, `cli:<user>` or `strata:<role>`."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "command.acked",
        stream: "command/<id>",
        written_by: "the gateway holding the node's session",
        about: "The node received the command.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("node", Ty::String, "The node."),
            req("gateway", Ty::String, "The gateway that heard the ack."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "command.succeeded",
        stream: "command/<id>",
        written_by: "the gateway holding the node's session",
        about: "Terminal: the node ran the command.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("node", Ty::String, "The node."),
            req("detail", Ty::String, "The node's words."),
            req("output", Ty::Any, "What the command returned (JSON; null without)."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "command.failed",
        stream: "command/<id>",
        written_by: "the gateway holding the node's session",
        about: "Terminal: the node ran the command and it failed.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("node", Ty::String, "The node."),
            req("detail", Ty::String, "Why."),
            req("output", Ty::Any, "What the command returned (JSON; null without)."),
        ],
        formerly: &[],
    },
    EventSpec {
        event_type: "command.expired",
        stream: "command/<id>",
        written_by: "any gateway",
        about: "Terminal: the deadline passed before a result came.",
        fields: &[
            req("id", Ty::String, "The command's id."),
            req("gateway", Ty::String, "The gateway that expired it."),
        ],
        formerly: &[],
    },
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::*;

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
                Fact::InventoryReported {
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
                },
                "pool/p",
            ),
            (
                Fact::NodeDrained {
                    node: node(),
                    reason: "x".into(),
                    deadline_ms: None,
                },
                "pool/p",
            ),
            (
                Fact::HealthRaised {
                    node: node(),
                    device: Some("0".into()),
                    condition: "c".into(),
                    detail: "d".into(),
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
                    topology: Some(crate::domain::Topology::Within(crate::domain::Tier::Rack)),
                    requeue_on_preemption: true,
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
                Fact::ReservationUnschedulable {
                    reservation: r(),
                    reason: "x".into(),
                },
                "pool/p",
            ),
            (
                Fact::ReservationActive { reservation: r() },
                "reservation/r1",
            ),
            (
                Fact::ReleaseRequested {
                    reservation: r(),
                    reason: "x".into(),
                },
                "reservation/r1",
            ),
            (Fact::ReservationReleased { reservation: r() }, "pool/p"),
            (Fact::ReservationExpired { reservation: r() }, "pool/p"),
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
                Fact::ReservationPreempting {
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
