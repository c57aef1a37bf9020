//! The GPUs of a node, behind a trait: NVML (through nvml-wrapper) when the
//! driver is present ([`nvml`]), or a fake device set shaped like it
//! ([`fake`]). A GPU split into MIG instances is reported whole, followed by
//! its instances, each a device of its own class naming the GPU as its
//! parent.

use crate::cdi::DeviceNode;
use crate::mig::Profile;
use std::sync::Arc;
use tokio::sync::Notify;

mod fake;
mod nvml;
mod nvml_mig;

pub use fake::{FakeGpus, FAKE_DEVICE_NODE};
pub use nvml::NvmlGpus;

/// One GPU as the daemon reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The GPU's UUID (NVML) or a stable fake one.
    pub id: String,
    pub class: String,
    pub memory_mb: u64,
    pub island: Option<String>,
    pub pci: String,
    pub numa: u32,
    /// Its device nodes, as a container must see them (`/dev/nvidiaN`; a
    /// MIG instance's also its GPU instance's and compute instance's
    /// capability devices), with the node's own path where that differs.
    pub device_nodes: Vec<DeviceNode>,
    /// The id of the GPU this is a MIG instance of; `None` for a whole GPU.
    pub parent: Option<String>,
}

/// A health condition that appeared or went away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthChange {
    /// The GPU's id; `None` for the whole node.
    pub device: Option<String>,
    /// e.g. `XID-79`, `ECC-uncorrected`.
    pub condition: String,
    pub detail: String,
    pub cleared: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("NVML: {0}")]
    Nvml(String),
    #[error("invalid fake GPU spec {0:?}: use COUNTxCLASS[:mig=PROFILE*N,...[@FIRST-LAST]], e.g. 8xH100-80GB or 8xH100-80GB:mig=1g.10gb*7@0-1")]
    Spec(String),
    #[error("{0}")]
    Mig(#[from] crate::mig::LayoutError),
    #[error("{0}")]
    Refused(String),
    #[error("the stand-in device node {0:?} is not an absolute path")]
    StandIn(String),
}

/// Where inventory and health come from.
pub trait GpuBackend: Send + Sync {
    /// Every GPU, in index order.
    fn inventory(&self) -> Result<Vec<Gpu>, GpuError>;
    /// Health changes since the last call.
    fn poll_health(&self) -> Result<Vec<HealthChange>, GpuError>;
    /// Runs the diagnostic on every GPU (`diag.nvml`): a JSON report, a
    /// `gpus` list of `{id, ok, reason?}`.
    fn diagnose(&self) -> Result<serde_json::Value, GpuError>;
    /// The same checks, for the node's acceptance check.
    fn acceptance(&self) -> Result<serde_json::Value, GpuError> {
        self.diagnose()
    }
    /// The device nodes every GPU workload needs besides its GPUs' own (the
    /// driver's control and unified-memory devices).
    fn control_devices(&self) -> Vec<DeviceNode>;
    /// Splits GPU `gpu` (its id, or its index among whole GPUs) into MIG
    /// instances of `layout`, or makes it whole again (an empty layout).
    /// The caller makes sure nothing is bound to the GPU or its instances.
    fn repartition(&self, gpu: &str, layout: &[Profile]) -> Result<(), GpuError>;
    fn name(&self) -> &'static str;
    /// Notified when health changed before the next poll is due (an XID
    /// event, an injected fault), so the daemon reports it at once.
    fn changed(&self) -> Option<Arc<Notify>> {
        None
    }
}

/// The driver's node-wide devices, in the order the NVIDIA container
/// toolkit lists them.
pub(crate) const CONTROL_DEVICES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// The device node `path` in a container, read from `host` on the node
/// (`None`: the same path).
pub(crate) fn device_node(path: String, host: Option<&str>) -> DeviceNode {
    DeviceNode {
        host_path: host.filter(|h| *h != path).map(str::to_string),
        path,
    }
}
