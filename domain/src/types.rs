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
    /// The GPU this device is a MIG instance of (that GPU's id on the same
    /// node); `None` for a whole GPU. A GPU and its instances are never
    /// booked at once, and a GPU with instances is booked only through them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// The class of a MIG instance: its GPU's class and its profile, e.g.
/// `H100-80GB/1g.10gb`.
pub fn mig_class(gpu_class: &str, profile: &str) -> String {
    format!("{gpu_class}/{profile}")
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
    /// When it is to start (Unix ms), for a reservation in advance: the
    /// placer promises its GPUs for `[start, start + ttl)` now, or refuses
    /// it, and places it at its start. `None`: as soon as it fits.
    #[serde(
        rename = "start",
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::payload::rfc3339_ms"
    )]
    pub start_ms: Option<u64>,
}

/// Most GPUs one reservation may ask for.
pub const MAX_GPUS: u32 = 4096;

impl Request {
    /// Checks the request's own consistency (not whether it fits).
    pub fn validate(&self) -> Result<(), String> {
        valid_name("reservation id", &self.reservation)?;
        valid_name("pool", &self.pool)?;
        valid_class(&self.class)?;
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
        if self.start_ms.is_some() && self.ttl_ms.is_none() {
            return Err(
                "a reservation in advance needs a duration (--duration), its time to live".into(),
            );
        }
        if self.start_ms.is_some() && self.replaces.is_some() {
            return Err("a replacement is placed at once, not in advance".into());
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

/// Checks a GPU class: a name (see [`valid_name`]), or a GPU's class and a
/// MIG profile joined by one '/' (see [`mig_class`]).
pub fn valid_class(class: &str) -> Result<(), String> {
    match class.split_once('/') {
        Some((gpu, profile)) => {
            let part = |p: &str| {
                valid_name("class", p).map_err(|_| {
                    format!("class {class:?} must be a GPU class or a GPU class and a MIG profile joined by '/' (e.g. H100-80GB/1g.10gb), without whitespace or control characters")
                })
            };
            part(gpu)?;
            part(profile)
        }
        None => valid_name("class", class),
    }
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
    /// Its GPU time per day, week or month (one per period at most).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<Budget>,
    /// The longest one of its reservations may run (ms from its
    /// placement): past it, it is ended (`reservation.expired`,
    /// `max_run_time`) after a notice to its nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_run_ms: Option<u64>,
}

/// A queue's budget of GPU time in each period of a kind (UTC).
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
pub struct Budget {
    pub period: BudgetPeriod,
    /// GPU-seconds in each period: GPUs booked times how long.
    pub gpu_seconds: u64,
    /// What happens to a request once the budget is spent.
    #[serde(default)]
    pub enforce: Enforce,
}

/// The periods a budget renews in: UTC days, ISO weeks (from Monday) and
/// months.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum BudgetPeriod {
    Day,
    Week,
    Month,
}

impl BudgetPeriod {
    pub const ALL: [BudgetPeriod; 3] = [BudgetPeriod::Day, BudgetPeriod::Week, BudgetPeriod::Month];

    pub fn name(self) -> &'static str {
        match self {
            BudgetPeriod::Day => "day",
            BudgetPeriod::Week => "week",
            BudgetPeriod::Month => "month",
        }
    }

    pub fn from_name(s: &str) -> Option<BudgetPeriod> {
        BudgetPeriod::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The start of the period holding `ms` (Unix ms, UTC).
    pub fn start(self, ms: i64) -> i64 {
        match self {
            BudgetPeriod::Day => crate::calendar::day_start(ms),
            BudgetPeriod::Week => crate::calendar::week_start(ms),
            BudgetPeriod::Month => crate::calendar::month_start(ms),
        }
    }

    /// The start of the period after the one holding `ms`.
    pub fn next(self, ms: i64) -> i64 {
        let start = self.start(ms);
        match self {
            BudgetPeriod::Day => start + crate::calendar::DAY_MS,
            BudgetPeriod::Week => start + crate::calendar::WEEK_MS,
            BudgetPeriod::Month => crate::calendar::next_month(start),
        }
    }
}

/// What a spent budget does to a queue's requests.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Enforce {
    /// They wait for the next period (a hard budget).
    #[default]
    Wait,
    /// They are rejected (a hard budget).
    Reject,
    /// They are served after every queue within its budgets (a soft one).
    Soft,
}

impl Enforce {
    pub fn name(self) -> &'static str {
        match self {
            Enforce::Wait => "wait",
            Enforce::Reject => "reject",
            Enforce::Soft => "soft",
        }
    }
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
        for (i, b) in self.budgets.iter().enumerate() {
            if self.budgets[..i].iter().any(|o| o.period == b.period) {
                return Err(format!("two budgets per {}", b.period.name()));
            }
            if b.gpu_seconds == 0 {
                return Err(format!(
                    "a budget per {} of no GPU time would stop the queue: remove it instead",
                    b.period.name()
                ));
            }
        }
        if self.max_run_ms.is_some_and(|m| m < 1000) {
            return Err("a maximum run time is at least a second".into());
        }
        for (i, q) in self.quotas.iter().enumerate() {
            valid_class(&q.class)?;
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

    /// Its budget for `period`, if it has one.
    pub fn budget(&self, period: BudgetPeriod) -> Option<&Budget> {
        self.budgets.iter().find(|b| b.period == period)
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

#[cfg(test)]
mod tests {
    use super::*;

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
            start_ms: None,
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
}
