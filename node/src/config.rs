//! How a node daemon runs ([`DaemonConfig`]), where it starts (its home
//! gateway, [`home_index`]), and how it fails ([`DaemonError`]).

use crate::gpu::GpuBackend;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Called with a command's id when it arrives.
pub type CommandHook = Arc<dyn Fn(&str) + Send + Sync>;

/// How much longer than `gateway_answer` a starved daemon may wait for the
/// gateway's answer on the wall clock: as long as it waits for a Welcome.
pub const ANSWER_SLACK: Duration = Duration::from_secs(60);

/// How a daemon runs.
#[derive(Clone)]
pub struct DaemonConfig {
    /// Gateways, e.g. `https://gw1.example:7443`; the daemon moves to the next
    /// one whenever a session ends.
    pub gateways: Vec<String>,
    /// The TLS name the gateway's certificate must carry.
    pub server_name: String,
    /// A one-time join token, needed only until the node has a certificate.
    pub token: Option<String>,
    /// The region's CA certificate (PEM), needed only for the first join.
    pub ca_pem: Option<String>,
    pub data_dir: PathBuf,
    /// Where the CDI specs of the node's bindings go, for container
    /// runtimes to read: `/var/run/cdi` on a real node (`strata node`'s
    /// default); the data dir's `cdi/` unless set, so that daemons sharing
    /// a machine (tests, `strata dev`) keep apart.
    pub cdi_dir: PathBuf,
    pub node_id: String,
    pub backend: Arc<dyn GpuBackend>,
    pub health_poll: Duration,
    /// Reconnect backoff: first step and cap.
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Called with a command's id when it arrives (measurements).
    pub on_command: Option<CommandHook>,
    /// Called with a command's id once it has run, before its result is
    /// sent (measurements: a bind's CDI spec is in place by then).
    pub on_finished: Option<CommandHook>,
    /// Called with a command's id once its result is on the session's way
    /// out (measurements: what is left of its trip is the gateway's).
    pub on_sent: Option<CommandHook>,
    /// While away from its home gateway, how often (on average; each wait
    /// is uniform in half to one and a half times this) the daemon checks
    /// whether home is back. Zero: never move back.
    pub return_home: Duration,
    /// Where the node is in its pool's topology (`rack`, `block`, `rail`
    /// -> label), reported as the `topology` section; none: not reported,
    /// so an operator's labels stand.
    pub topology: BTreeMap<String, String>,
    /// The level of `dcgmi diag` in the acceptance check where DCGM is
    /// installed (0, the default: not run; a fake device set is not what
    /// DCGM would check).
    pub dcgm_level: u32,
    /// How often the acceptance check runs again (zero: only when the
    /// daemon starts).
    pub recheck: Duration,
    /// How long the gateway may leave an HTTP/2 ping unanswered before the
    /// daemon drops the connection and moves on (pings go out every this
    /// long too): a gateway that died without closing its connections, or
    /// froze, is noticed within twice this.
    pub gateway_answer: Duration,
    /// The clock `gateway_answer` is counted on: the time this process
    /// could run. Daemons sharing a process (a simulated fleet) share one.
    pub clock: ops::process_clock::ProcessClock,
}

impl DaemonConfig {
    /// Full jitter after the `n`th failure in a row: uniform in
    /// `[0, min(cap, base * 2^n))`.
    pub(crate) fn backoff(&self, n: u32) -> Duration {
        let ceiling = self
            .backoff_base
            .saturating_mul(1u32 << n.min(16))
            .min(self.backoff_cap);
        ceiling.mul_f64(fastrand::f64())
    }

    pub fn new(
        gateways: Vec<String>,
        data_dir: impl Into<PathBuf>,
        node_id: impl Into<String>,
        backend: Arc<dyn GpuBackend>,
    ) -> DaemonConfig {
        let data_dir = data_dir.into();
        DaemonConfig {
            cdi_dir: data_dir.join("cdi"),
            gateways,
            server_name: "localhost".into(),
            token: None,
            ca_pem: None,
            data_dir,
            node_id: node_id.into(),
            backend,
            health_poll: Duration::from_secs(5),
            backoff_base: Duration::from_millis(500),
            backoff_cap: Duration::from_secs(30),
            on_command: None,
            on_finished: None,
            on_sent: None,
            return_home: Duration::from_secs(30),
            topology: BTreeMap::new(),
            dcgm_level: 0,
            gateway_answer: Duration::from_secs(3),
            clock: ops::process_clock::ProcessClock::new(ANSWER_SLACK),
            recheck: Duration::ZERO,
        }
    }

    /// This node's home among its gateways.
    pub fn home(&self) -> usize {
        home_index(&self.node_id, self.gateways.len())
    }
}

/// The home gateway of `node` among `gateways` of them: FNV-1a of the id,
/// so it is the same on every start and spreads a fleet evenly.
pub fn home_index(node: &str, gateways: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % gateways.max(1) as u64) as usize
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("this node has no certificate yet: give it a join token (--token) and the region's CA (--ca)")]
    NeedsJoin,
    #[error("join refused: {0}")]
    JoinRefused(String),
    /// The gateway could not be reached (worth retrying).
    #[error("{0}")]
    Unreachable(String),
    #[error("the gateway refused this node: {0}")]
    Refused(String),
    #[error("{0}")]
    Other(String),
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DaemonError + '_ {
    move |source| DaemonError::Io {
        path: path.to_path_buf(),
        source,
    }
}
