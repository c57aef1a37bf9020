//! The facts of pools, nodes and reservations, as they are written to the
//! log. Each fact is one event: its variant's serde name is the event type
//! (`noun.verb_past`, like every event type: `reservation.placed`,
//! `node.joined`) and its fields are the JSON payload, so auditors can read
//! them with plain SQL. Facts written before that convention carry CamelCase
//! names (`ReservationPlaced`); [`canonical_type`] reads them as the new
//! names, and is the only place that knows the old ones.
//!
//! Streams: everything that changes what can be placed in a pool (its nodes,
//! their inventory, health and cordons, and every placement, release and
//! expiry) is on the pool's stream `pool/<name>`, so the pool stream's version
//! is the fence a placer commits against. A reservation's request and the
//! client's later wishes about it (release, active) are on
//! `reservation/<id>`.

use events::db::Sql;
use serde::{Deserialize, Serialize};

/// The stream of a pool.
pub fn pool_stream(pool: &str) -> String {
    format!("pool/{pool}")
}

/// The stream of a reservation.
pub fn reservation_stream(id: &str) -> String {
    format!("reservation/{id}")
}

/// The reservation whose stream `stream` is, if it is one.
pub fn reservation_of(stream: &str) -> Option<&str> {
    stream.strip_prefix("reservation/")
}

/// One GPU as a node reports it.
#[derive(
    Debug,
    Clone,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct DeviceSpec {
    /// Unique within its node (e.g. the GPU's UUID or its index).
    pub id: String,
    /// The class reservations ask for, e.g. `H100-80GB`.
    pub class: String,
    #[serde(default)]
    pub memory_mb: u64,
    /// The NVLink island the device belongs to, unique within the pool. An
    /// island may span nodes (a rack-scale NVLink domain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub island: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<u32>,
}

/// Where a reservation's GPUs may lie.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Shape {
    /// Anywhere in the pool.
    Any,
    /// All on one node.
    Node,
    /// All in one NVLink island.
    Island,
    /// `nodes` distinct nodes with `gpus_per_node` each, all or nothing.
    Gang { nodes: u32, gpus_per_node: u32 },
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Any => f.write_str("any"),
            Shape::Node => f.write_str("node"),
            Shape::Island => f.write_str("island"),
            Shape::Gang {
                nodes,
                gpus_per_node,
            } => write!(f, "gang of {nodes} nodes x {gpus_per_node} GPUs"),
        }
    }
}

/// A level of a pool's network topology that nodes are labelled with.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The nodes under one top-of-rack switch.
    Rack,
    /// A larger domain: the racks of one spine block, or one NVL72 rack's
    /// NVLink domain.
    Block,
    /// A rail group: the nodes whose NICs share one set of rail switches
    /// (GPU i of each on rail i), so collectives between them stay on
    /// their rails.
    Rail,
}

impl Tier {
    /// Every tier, in the order labels are shown.
    pub const ALL: [Tier; 3] = [Tier::Rack, Tier::Block, Tier::Rail];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Rack => "rack",
            Tier::Block => "block",
            Tier::Rail => "rail",
        }
    }

    /// The tier named `name` (`rack`, `block` or `rail`).
    pub fn parse(name: &str) -> Result<Tier, String> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| format!("unknown topology tier {name:?}: rack, block or rail"))
    }
}

/// Where a gang's nodes may lie in the topology.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(tag = "mode", content = "tier", rename_all = "snake_case")]
pub enum Topology {
    /// All in one rack (or block), or not placed.
    Within(Tier),
    /// All in one if it can be had now, anywhere otherwise.
    Prefer(Tier),
    /// Each in a different one (for availability).
    Spread(Tier),
}

/// A request for GPUs.
#[derive(
    Debug,
    Clone,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct Request {
    pub reservation: String,
    pub pool: String,
    pub class: String,
    /// GPUs in all (for a gang, nodes times GPUs per node).
    pub gpus: u32,
    pub shape: Shape,
    /// Higher is placed first within a batch.
    #[serde(default)]
    pub priority: i32,
    /// Released automatically this long after placement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// When a node it is on fails (left, revoked, lost, drained), placed
    /// again under a new id (`<id>~<n>`) instead of only ending.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replace_on_failure: bool,
    /// The reservation this one replaces, for one the placer requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaces: Option<String>,
    /// When preempted, requested again under a new id (`<id>~<n>`), to
    /// wait in its queue, instead of only ending.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub requeue_on_preemption: bool,
    /// Where a gang's nodes lie in the topology (only gangs have one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<Topology>,
    /// The queue (a team's share of the pool, see [`Fact::QueueConfigured`])
    /// it is admitted under. A pool with queues places only requests that
    /// name one of them; a pool without places only those that name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

/// Most GPUs one reservation may ask for.
pub const MAX_GPUS: u32 = 4096;

impl Request {
    /// Checks the request's own consistency (not whether it fits).
    pub fn validate(&self) -> Result<(), String> {
        valid_name("reservation id", &self.reservation)?;
        valid_name("pool", &self.pool)?;
        valid_name("class", &self.class)?;
        if let Some(q) = &self.queue {
            valid_name("queue", q)?;
        }
        if self.gpus == 0 {
            return Err("a reservation needs at least one GPU".into());
        }
        if self.gpus > MAX_GPUS {
            return Err(format!(
                "{} GPUs is more than one reservation may ask for ({MAX_GPUS})",
                self.gpus
            ));
        }
        if self.topology.is_some() && !matches!(self.shape, Shape::Gang { .. }) {
            return Err(
                "a topology (--within, --prefer-within, --spread) is for gangs (--nodes)".into(),
            );
        }
        if let Shape::Gang {
            nodes,
            gpus_per_node,
        } = self.shape
        {
            if nodes == 0 || gpus_per_node == 0 {
                return Err("a gang needs at least one node and one GPU per node".into());
            }
            if nodes.checked_mul(gpus_per_node) != Some(self.gpus) {
                return Err(format!(
                    "a gang of {nodes} nodes x {gpus_per_node} GPUs is {} GPUs, not {}",
                    nodes as u64 * gpus_per_node as u64,
                    self.gpus
                ));
            }
        }
        Ok(())
    }
}

/// The id of the reservation that replaces `id` after a failure:
/// `<root>~<n+1>` for `<root>~<n>`, `<id>~1` for a first failure. Clients
/// may not use `~` in their ids, so these never collide with theirs.
pub fn replacement_id(id: &str) -> String {
    match id.rsplit_once('~') {
        Some((root, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            format!("{root}~{}", n.parse::<u64>().unwrap_or(0) + 1)
        }
        _ => format!("{id}~1"),
    }
}

/// A fresh id: `prefix`, the time in milliseconds (hex, so ids sort by
/// time) and a random tail.
pub fn new_id(prefix: &str) -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{prefix}-{ms:x}-{:06x}", fastrand::u32(..1 << 24))
}

/// Whether a pool has been created.
pub async fn pool_exists(
    client: &tokio_postgres::Client,
    pool: &str,
) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .opt(
            "SELECT 1 FROM strata.events WHERE stream = $1 AND version = 1 AND type = ANY($2)",
            &[&pool_stream(pool), &stored_types("pool.created")],
        )
        .await?
        .is_some())
}

/// Checks a name used in a stream name or an index key.
pub fn valid_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 200 {
        return Err(format!("{what} must be 1 to 200 characters, got {name:?}"));
    }
    if name
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || c == '/')
    {
        return Err(format!(
            "{what} {name:?} may not contain whitespace, control characters or '/'"
        ));
    }
    Ok(())
}

/// A queue's share of one GPU class in its pool.
#[derive(
    Debug,
    Clone,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct Quota {
    pub class: String,
    /// GPUs the queue is guaranteed: what it may use whatever the others
    /// in its cohort do, and what it lends them while it does not.
    pub nominal: u32,
    /// How many GPUs beyond `nominal` it may borrow from its cohort's
    /// unused quota; `None`: as many as the cohort has unused. Without a
    /// cohort a queue borrows nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub borrowing_limit: Option<u32>,
}

/// Most a queue's weight may be.
pub const MAX_WEIGHT: u32 = 1000;

/// A queue as it is configured: what `queue.configured` says.
#[derive(
    Debug,
    Clone,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct QueueSpec {
    pub queue: String,
    /// Queues of one cohort lend each other their unused quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cohort: Option<String>,
    /// Its weight in the cohort's fair sharing (1 to [`MAX_WEIGHT`]): a
    /// queue of weight 2 is served as if it used half of what it uses.
    #[serde(default = "one")]
    pub weight: u32,
    /// Per class; a class it has no quota of it may only borrow.
    pub quotas: Vec<Quota>,
}

fn one() -> u32 {
    1
}

impl QueueSpec {
    /// Checks the spec's own consistency.
    pub fn validate(&self) -> Result<(), String> {
        valid_name("queue", &self.queue)?;
        if let Some(c) = &self.cohort {
            valid_name("cohort", c)?;
        }
        if self.weight == 0 || self.weight > MAX_WEIGHT {
            return Err(format!(
                "a queue's weight is 1 to {MAX_WEIGHT}, got {}",
                self.weight
            ));
        }
        for (i, q) in self.quotas.iter().enumerate() {
            valid_name("class", &q.class)?;
            if self.quotas[..i].iter().any(|o| o.class == q.class) {
                return Err(format!("class {} has two quotas", q.class));
            }
            if q.nominal > MAX_QUOTA || q.borrowing_limit.is_some_and(|b| b > MAX_QUOTA) {
                return Err(format!(
                    "a quota is at most {MAX_QUOTA} GPUs (class {})",
                    q.class
                ));
            }
        }
        Ok(())
    }

    /// The quota of `class`, if it has one.
    pub fn quota(&self, class: &str) -> Option<&Quota> {
        self.quotas.iter().find(|q| q.class == class)
    }
}

/// Most GPUs one quota may name.
pub const MAX_QUOTA: u32 = 10_000_000;

/// The devices a placement booked on one node.
#[derive(
    Debug,
    Clone,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct Allocation {
    pub node: String,
    pub devices: Vec<String>,
}

/// A fact about a pool, a node or a reservation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "payload")]
pub enum Fact {
    #[serde(rename = "pool.created")]
    PoolCreated {
        #[serde(default)]
        description: String,
    },
    #[serde(rename = "pool.updated")]
    PoolUpdated {
        #[serde(default)]
        description: String,
    },
    /// A node joined the pool with this inventory (joining again replaces it).
    #[serde(rename = "node.joined")]
    NodeJoined {
        node: String,
        devices: Vec<DeviceSpec>,
    },
    /// The node's inventory now is this. Devices that are gone become
    /// unschedulable; bookings on them stay until released.
    #[serde(rename = "node.inventory_reported")]
    InventoryReported {
        node: String,
        devices: Vec<DeviceSpec>,
    },
    /// The node is gone from the pool (it left, or its certificate was
    /// revoked: `reason` says which). Its capacity goes with it; live
    /// reservations on it are ended by the placer (`reservation.failed`).
    #[serde(rename = "node.left")]
    NodeLeft {
        node: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
    },
    /// The region lost contact with the node (its session went silent past
    /// the gateway's grace period), committed with `node.marked_unreachable` on the
    /// node's stream. Nothing new is placed on it; live reservations on it
    /// end once it stays out of contact past the placer's bound.
    #[serde(rename = "node.contact_lost")]
    NodeContactLost { node: String },
    /// Contact with the node is back (a heartbeat, or a new session).
    #[serde(rename = "node.contact_restored")]
    NodeContactRestored { node: String },
    #[serde(rename = "node.cordoned")]
    NodeCordoned {
        node: String,
        #[serde(default)]
        reason: String,
    },
    #[serde(rename = "node.uncordoned")]
    NodeUncordoned { node: String },
    /// Where the node is in the pool's topology (set by an operator,
    /// reported by the node's daemon, or when fleets are seeded); absent
    /// labels are cleared.
    #[serde(rename = "node.topology_set")]
    NodeTopologySet {
        node: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rack: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rail: Option<String>,
    },
    /// No new placements; the node's live reservations fail
    /// (`node_drained`) at `deadline_ms` (unix milliseconds), at once
    /// without one. Lifted by `node.uncordoned`.
    ///
    /// Payload version 2: `deadline` is an RFC 3339 time (readable and
    /// comparable in SQL); version 1 had `deadline_ms`, Unix milliseconds.
    #[serde(rename = "node.drained")]
    NodeDrained {
        node: String,
        #[serde(default)]
        reason: String,
        #[serde(
            rename = "deadline",
            default,
            skip_serializing_if = "Option::is_none",
            with = "rfc3339_ms"
        )]
        deadline_ms: Option<u64>,
    },
    /// A health condition (an XID or ECC error, say) on a device, or on the
    /// whole node when `device` is absent. Unschedulable until cleared.
    #[serde(rename = "health.raised")]
    HealthRaised {
        node: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
        condition: String,
        #[serde(default)]
        detail: String,
    },
    #[serde(rename = "health.cleared")]
    HealthCleared {
        node: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
        condition: String,
    },
    /// A queue of the pool is created or changed: the whole spec, which
    /// replaces the one before. On the pool's stream, so the pool's version
    /// fences quota against placement.
    #[serde(rename = "queue.configured")]
    QueueConfigured(QueueSpec),
    /// On the reservation's stream.
    #[serde(rename = "reservation.requested")]
    ReservationRequested(Request),
    /// Waiting: written when it first does not fit, and again whenever why
    /// it waits changes (capacity, quota).
    #[serde(rename = "reservation.queued")]
    ReservationQueued { reservation: String, reason: String },
    #[serde(rename = "reservation.placed")]
    ReservationPlaced {
        reservation: String,
        allocations: Vec<Allocation>,
    },
    /// Can never fit the pool as it is; terminal.
    #[serde(rename = "reservation.rejected")]
    ReservationUnschedulable { reservation: String, reason: String },
    /// On the reservation's stream: the workload runs.
    #[serde(rename = "reservation.activated")]
    ReservationActive { reservation: String },
    /// On the reservation's stream: the client wants it released (or
    /// cancelled, if it is not placed yet).
    #[serde(rename = "reservation.release_requested")]
    ReleaseRequested {
        reservation: String,
        #[serde(default)]
        reason: String,
    },
    /// Terminal; frees its devices.
    #[serde(rename = "reservation.released")]
    ReservationReleased { reservation: String },
    /// Terminal; its time ran out and its devices are free.
    #[serde(rename = "reservation.expired")]
    ReservationExpired { reservation: String },
    /// Terminal: a node it was placed on left the pool, was revoked or stayed
    /// out of contact too long (`reason`: `node_left`, `node_revoked`,
    /// `node_lost`, `node_drained`); its devices are free.
    #[serde(rename = "reservation.failed")]
    ReservationFailed {
        reservation: String,
        node: String,
        reason: String,
        /// The reservation requested in its place (it asked to be placed
        /// again), in the same transaction.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replaced_by: Option<String>,
    },
    /// A live reservation is to make room for `by`, a waiting request of
    /// higher priority (`reason`: `priority`) or of a queue taking back the
    /// quota it lent (`reclaim`). It ends (`reservation.preempted`) when
    /// its grace period ends at `deadline_ms` (unix milliseconds), unless it
    /// ends first; its nodes are told (`allocation.preempting`). Withdrawn
    /// when `by` is placed or ends before then.
    #[serde(rename = "reservation.preemption_scheduled")]
    ReservationPreempting {
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
    /// Terminal: preempted by `by` (`reason` as in `reservation.preemption_scheduled`)
    /// once its grace period ended; its devices are free, and `by` is
    /// placed on them in the same transaction.
    #[serde(rename = "reservation.preempted")]
    ReservationPreempted {
        reservation: String,
        by: String,
        reason: String,
        /// The reservation requested in its place (it asked to be
        /// requeued), in the same transaction.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replaced_by: Option<String>,
    },
    /// On the reservation's stream, committed with the terminal fact on the
    /// pool's stream (`reservation.released`, `.expired`, `.rejected`): the
    /// reservation's life cycle is over, and how. It moves the reservation
    /// stream's version, which every other writer of the life cycle appends
    /// against (the binder's activation above all), so nothing of the life
    /// cycle can commit after its end.
    #[serde(rename = "reservation.ended")]
    ReservationEnded {
        reservation: String,
        /// The terminal fact's name: `released`, `expired`, `rejected`,
        /// `failed` or `preempted`.
        outcome: String,
    },
}

/// Every event type this module reads, as it is written now.
pub const FACT_TYPES: &[&str] = &[
    "pool.created",
    "pool.updated",
    "node.joined",
    "node.inventory_reported",
    "node.left",
    "node.contact_lost",
    "node.contact_restored",
    "node.cordoned",
    "node.uncordoned",
    "node.topology_set",
    "node.drained",
    "health.raised",
    "health.cleared",
    "queue.configured",
    "reservation.requested",
    "reservation.queued",
    "reservation.placed",
    "reservation.rejected",
    "reservation.activated",
    "reservation.release_requested",
    "reservation.released",
    "reservation.expired",
    "reservation.failed",
    "reservation.preemption_scheduled",
    "reservation.preempted",
    "reservation.ended",
];

/// The metadata key that carries an event's payload version. Absent, the
/// payload is version 1: every payload was, before versions existed.
pub const PAYLOAD_VERSION: &str = "payload_version";

/// The payload versions of one fact type: the newest this binary reads,
/// the one it writes, and how to turn each version into the next one
/// (`upcasts[i]`: version `i + 1` to `i + 2`) and back (`downcasts[i]`:
/// `i + 2` to `i + 1`).
///
/// A new version is rolled out like a contraction of the schema: one
/// release reads it (and writes the old one, downcast), the next writes it.
/// So during a rolling upgrade no running binary meets a version it cannot
/// read; one that does anyway (a binary older than the release that
/// introduced a version) refuses the event rather than misread it.
pub struct PayloadVersions {
    pub event_type: &'static str,
    pub read: u32,
    pub written: u32,
    pub upcasts: &'static [Upcast],
    pub downcasts: &'static [fn(&mut serde_json::Value)],
}

/// Turns a payload of one version into the next, or says why it cannot.
pub type Upcast = fn(&mut serde_json::Value) -> Result<(), String>;

/// Every fact type whose payload has more than one version; the others are
/// version 1, read and written.
pub const PAYLOAD_VERSIONS: &[PayloadVersions] = &[PayloadVersions {
    event_type: "node.drained",
    read: 2,
    written: 1,
    upcasts: &[drained_v1_to_v2],
    downcasts: &[drained_v2_to_v1],
}];

impl PayloadVersions {
    /// The versions of `event_type` (a current name).
    pub fn of(event_type: &str) -> &'static PayloadVersions {
        static PLAIN: PayloadVersions = PayloadVersions {
            event_type: "",
            read: 1,
            written: 1,
            upcasts: &[],
            downcasts: &[],
        };
        PAYLOAD_VERSIONS
            .iter()
            .find(|v| v.event_type == event_type)
            .unwrap_or(&PLAIN)
    }
}

/// `node.drained` 1 to 2: `deadline_ms` (Unix milliseconds) becomes
/// `deadline` (RFC 3339).
fn drained_v1_to_v2(p: &mut serde_json::Value) -> Result<(), String> {
    let Some(o) = p.as_object_mut() else {
        return Err("not a JSON object".into());
    };
    if let Some(ms) = o.remove("deadline_ms") {
        let ms = ms
            .as_u64()
            .ok_or_else(|| format!("deadline_ms {ms} is not a number of milliseconds"))?;
        o.insert("deadline".into(), rfc3339_ms::format(ms).into());
    }
    Ok(())
}

/// `node.drained` 2 to 1.
fn drained_v2_to_v1(p: &mut serde_json::Value) {
    if let Some(o) = p.as_object_mut() {
        if let Some(ms) = o
            .remove("deadline")
            .and_then(|d| rfc3339_ms::parse(d.as_str()?).ok())
        {
            o.insert("deadline_ms".into(), ms.into());
        }
    }
}

/// An event's payload version, from its metadata (1 when it has none).
pub fn payload_version(metadata: &str) -> Result<u32, String> {
    // Most metadata has no version: spare it a parse.
    if !metadata.contains(PAYLOAD_VERSION) {
        return Ok(1);
    }
    #[derive(Deserialize)]
    struct Meta {
        payload_version: Option<u32>,
    }
    match serde_json::from_str::<Meta>(metadata) {
        Ok(Meta {
            payload_version: Some(v),
        }) if v >= 1 => Ok(v),
        Ok(Meta {
            payload_version: None,
        }) => Ok(1),
        Ok(_) => Err("payload_version 0 in the metadata; versions start at 1".into()),
        Err(e) => Err(format!("metadata's payload_version: {e}")),
    }
}

/// Unix milliseconds as RFC 3339 times (UTC, milliseconds) in payloads.
mod rfc3339_ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::{Duration, UNIX_EPOCH};

    pub fn format(ms: u64) -> String {
        humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
    }

    pub fn parse(s: &str) -> Result<u64, String> {
        let t = humantime::parse_rfc3339_weak(s).map_err(|e| format!("{s:?}: {e}"))?;
        t.duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .map_err(|_| format!("{s:?} is before 1970"))
    }

    pub fn serialize<S: Serializer>(ms: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match ms {
            Some(ms) => s.serialize_str(&format(*ms)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| parse(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// The names facts were written under before every event type followed
/// `noun.verb_past`, with the name each is read as now. Events in the log
/// keep the name they were written with; [`canonical_type`] is the one place
/// that reads an old name as the new one.
pub const LEGACY_FACT_TYPES: &[(&str, &str)] = &[
    ("PoolCreated", "pool.created"),
    ("PoolUpdated", "pool.updated"),
    ("NodeJoined", "node.joined"),
    ("InventoryReported", "node.inventory_reported"),
    ("NodeLeft", "node.left"),
    ("NodeCordoned", "node.cordoned"),
    ("NodeUncordoned", "node.uncordoned"),
    ("NodeDrained", "node.drained"),
    ("HealthRaised", "health.raised"),
    ("HealthCleared", "health.cleared"),
    ("ReservationRequested", "reservation.requested"),
    ("ReservationQueued", "reservation.queued"),
    ("ReservationPlaced", "reservation.placed"),
    ("ReservationUnschedulable", "reservation.rejected"),
    ("ReservationActive", "reservation.activated"),
    ("ReleaseRequested", "reservation.release_requested"),
    ("ReservationReleased", "reservation.released"),
    ("ReservationExpired", "reservation.expired"),
];

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
    /// The event type this fact is written as.
    pub fn event_type(&self) -> &'static str {
        match self {
            Fact::PoolCreated { .. } => "pool.created",
            Fact::PoolUpdated { .. } => "pool.updated",
            Fact::NodeJoined { .. } => "node.joined",
            Fact::InventoryReported { .. } => "node.inventory_reported",
            Fact::NodeLeft { .. } => "node.left",
            Fact::NodeContactLost { .. } => "node.contact_lost",
            Fact::NodeContactRestored { .. } => "node.contact_restored",
            Fact::NodeCordoned { .. } => "node.cordoned",
            Fact::NodeUncordoned { .. } => "node.uncordoned",
            Fact::NodeTopologySet { .. } => "node.topology_set",
            Fact::NodeDrained { .. } => "node.drained",
            Fact::HealthRaised { .. } => "health.raised",
            Fact::HealthCleared { .. } => "health.cleared",
            Fact::QueueConfigured(_) => "queue.configured",
            Fact::ReservationRequested(_) => "reservation.requested",
            Fact::ReservationQueued { .. } => "reservation.queued",
            Fact::ReservationPlaced { .. } => "reservation.placed",
            Fact::ReservationUnschedulable { .. } => "reservation.rejected",
            Fact::ReservationActive { .. } => "reservation.activated",
            Fact::ReleaseRequested { .. } => "reservation.release_requested",
            Fact::ReservationReleased { .. } => "reservation.released",
            Fact::ReservationExpired { .. } => "reservation.expired",
            Fact::ReservationFailed { .. } => "reservation.failed",
            Fact::ReservationPreempting { .. } => "reservation.preemption_scheduled",
            Fact::ReservationPreempted { .. } => "reservation.preempted",
            Fact::ReservationEnded { .. } => "reservation.ended",
        }
    }

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
            | Fact::ReservationUnschedulable { reservation, .. }
            | Fact::ReservationActive { reservation }
            | Fact::ReleaseRequested { reservation, .. }
            | Fact::ReservationReleased { reservation }
            | Fact::ReservationExpired { reservation }
            | Fact::ReservationFailed { reservation, .. }
            | Fact::ReservationPreempting { reservation, .. }
            | Fact::ReservationPreempted { reservation, .. }
            | Fact::ReservationEnded { reservation, .. } => Some(reservation),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn replacements_are_numbered_from_their_root() {
        assert_eq!(replacement_id("train-7"), "train-7~1");
        assert_eq!(replacement_id("train-7~1"), "train-7~2");
        assert_eq!(replacement_id("train-7~19"), "train-7~20");
    }

    #[test]
    fn requests_are_validated() {
        let mut r = Request {
            reservation: "r".into(),
            pool: "p".into(),
            class: "c".into(),
            gpus: 4,
            shape: Shape::Gang {
                nodes: 2,
                gpus_per_node: 3,
            },
            priority: 0,
            ttl_ms: None,
            replace_on_failure: false,
            replaces: None,
            topology: None,
            requeue_on_preemption: false,
            queue: None,
        };
        assert!(r.validate().unwrap_err().contains("is 6 GPUs"));
        r.shape = Shape::Any;
        r.validate().unwrap();
        r.gpus = 0;
        assert!(r.validate().is_err());
        r.gpus = 1;
        r.pool = "a/b".into();
        assert!(r.validate().is_err());
    }

    #[test]
    fn older_payload_versions_are_upcast_and_newer_ones_refused() {
        let drained = Fact::NodeDrained {
            node: "n1".into(),
            reason: "rma".into(),
            deadline_ms: Some(1_700_000_000_123),
        };
        // Version 1 (no version in the metadata): Unix milliseconds.
        let v1 = r#"{"node":"n1","reason":"rma","deadline_ms":1700000000123}"#;
        assert_eq!(
            Fact::parse("node.drained", v1, "{}").unwrap(),
            Some(drained.clone())
        );
        assert_eq!(
            Fact::parse("NodeDrained", v1, r#"{"operator":"ana"}"#).unwrap(),
            Some(drained.clone())
        );
        // Version 2: an RFC 3339 time.
        let v2 = r#"{"node":"n1","reason":"rma","deadline":"2023-11-14T22:13:20.123Z"}"#;
        let meta2 = r#"{"operator":"ana","payload_version":2}"#;
        assert_eq!(
            Fact::parse("node.drained", v2, meta2).unwrap(),
            Some(drained.clone())
        );
        // Read as version 2, a version 1 payload would lose its deadline:
        // the version in the metadata is what tells them apart.
        assert_eq!(
            Fact::parse("node.drained", v1, meta2).unwrap(),
            Some(Fact::NodeDrained {
                node: "n1".into(),
                reason: "rma".into(),
                deadline_ms: None,
            })
        );
        // A version newer than this binary reads is refused, never misread.
        let err = Fact::parse("node.drained", v2, r#"{"payload_version":3}"#).unwrap_err();
        assert!(err.contains("newer than this binary reads (2)"), "{err}");
        let err =
            Fact::parse("node.left", r#"{"node":"n1"}"#, r#"{"payload_version":2}"#).unwrap_err();
        assert!(err.contains("upgrade strata"), "{err}");
        for bad in [r#"{"payload_version":0}"#, r#"{"payload_version":"2"}"#] {
            assert!(
                Fact::parse("node.left", r#"{"node":"n1"}"#, bad).is_err(),
                "{bad}"
            );
        }
        // This release writes version 1 (the one every older binary reads),
        // and reads it back unchanged.
        let e = drained.to_event();
        assert!(e.metadata.is_none());
        assert!(
            e.payload.get().contains("\"deadline_ms\":1700000000123"),
            "{}",
            e.payload.get()
        );
        assert_eq!(
            Fact::parse(&e.event_type, e.payload.get(), "{}").unwrap(),
            Some(drained)
        );
        // Without a deadline both versions are the same payload.
        let now = Fact::NodeDrained {
            node: "n1".into(),
            reason: String::new(),
            deadline_ms: None,
        };
        assert_eq!(now.to_event().payload.get(), r#"{"node":"n1","reason":""}"#);
    }

    #[test]
    fn every_versioned_type_can_be_upcast_from_version_1_and_downcast_to_what_it_writes() {
        for v in PAYLOAD_VERSIONS {
            assert!(FACT_TYPES.contains(&v.event_type), "{}", v.event_type);
            assert!(v.written >= 1 && v.written <= v.read, "{}", v.event_type);
            assert_eq!(v.upcasts.len() as u32, v.read - 1, "{}", v.event_type);
            assert_eq!(v.downcasts.len() as u32, v.read - 1, "{}", v.event_type);
        }
        assert_eq!(PayloadVersions::of("reservation.placed").read, 1);
    }
}
