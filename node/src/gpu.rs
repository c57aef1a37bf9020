//! The GPUs of a node, behind a trait: NVML (through nvml-wrapper) when the
//! driver is present, or a fake device set shaped like it.

use crate::cdi::DeviceNode;
use crate::faults;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

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
    /// Its device nodes, as a container must see them (`/dev/nvidiaN`),
    /// with the node's own path where that differs.
    pub device_nodes: Vec<DeviceNode>,
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
    #[error("invalid fake GPU spec {0:?}: use COUNTxCLASS, e.g. 8xH100-80GB")]
    Spec(String),
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
    fn name(&self) -> &'static str;
    /// Notified when health changed before the next poll is due (an XID
    /// event, an injected fault), so the daemon reports it at once.
    fn changed(&self) -> Option<Arc<Notify>> {
        None
    }
}

/// The driver's node-wide devices, in the order the NVIDIA container
/// toolkit lists them.
const CONTROL_DEVICES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// The device node `path` in a container, read from `host` on the node
/// (`None`: the same path).
fn device_node(path: String, host: Option<&str>) -> DeviceNode {
    DeviceNode {
        host_path: host.filter(|h| *h != path).map(str::to_string),
        path,
    }
}

/// A fake device set: `COUNTxCLASS`, e.g. `8xH100-80GB`, one NVLink island
/// per node. Health changes and failing diagnostics can be injected, in the
/// process ([`FakeGpus::inject`]) or from outside it through a fault folder
/// ([`FakeGpus::with_fault_dir`], [`crate::faults`]). Its device nodes are named as
/// the driver's (`/dev/nvidia0`, `/dev/nvidiactl`, ...) and read from a
/// stand-in on the node ([`FAKE_DEVICE_NODE`] unless told otherwise), so a
/// container given a fake binding sees the same paths a real one would.
pub struct FakeGpus {
    gpus: Vec<Gpu>,
    stand_in: String,
    injected: Mutex<Vec<HealthChange>>,
    /// While set, polls fail as NVML's do when the driver is gone.
    failing: std::sync::atomic::AtomicBool,
    /// How long `diagnose` takes (drills of commands in flight).
    pub diag_delay: std::time::Duration,
    /// GPUs (by index) whose diagnostic fails, and why.
    failing_diag: Mutex<BTreeMap<usize, String>>,
    /// Where faults are injected from outside, if anywhere.
    fault_dir: Option<PathBuf>,
    wake: Arc<Notify>,
}

/// The node's device that stands in for every fake GPU's and control
/// device node: harmless to hand to a container.
pub const FAKE_DEVICE_NODE: &str = "/dev/null";

fn class_memory_mb(class: &str) -> u64 {
    class
        .split('-')
        .find_map(|p| p.strip_suffix("GB")?.parse::<u64>().ok())
        .map_or(16_384, |gb| gb * 1024)
}

impl FakeGpus {
    pub fn parse(spec: &str, node: &str) -> Result<FakeGpus, GpuError> {
        let (count, class) = spec
            .split_once('x')
            .ok_or_else(|| GpuError::Spec(spec.to_string()))?;
        let count: u32 = count
            .parse()
            .map_err(|_| GpuError::Spec(spec.to_string()))?;
        if count == 0 || count > 64 || class.is_empty() {
            return Err(GpuError::Spec(spec.to_string()));
        }
        let gpus = (0..count)
            .map(|i| Gpu {
                id: format!("GPU-fake-{node}-{i}"),
                class: class.to_string(),
                memory_mb: class_memory_mb(class),
                island: Some(format!("{node}/nvl0")),
                pci: format!("00000000:{:02X}:00.0", 0x18 + i),
                numa: i / (count.div_ceil(2)).max(1),
                device_nodes: vec![device_node(
                    format!("/dev/nvidia{i}"),
                    Some(FAKE_DEVICE_NODE),
                )],
            })
            .collect();
        Ok(FakeGpus {
            gpus,
            stand_in: FAKE_DEVICE_NODE.into(),
            injected: Mutex::new(Vec::new()),
            failing: std::sync::atomic::AtomicBool::new(false),
            diag_delay: std::time::Duration::ZERO,
            failing_diag: Mutex::new(BTreeMap::new()),
            fault_dir: None,
            wake: Arc::new(Notify::new()),
        })
    }

    /// Takes faults injected from outside the process from the `faults/`
    /// folder of `data_dir` (see [`crate::faults`]); a thread looks for
    /// them every 100 ms and wakes the daemon when one is there.
    pub fn with_fault_dir(mut self, data_dir: &std::path::Path) -> FakeGpus {
        let dir = data_dir.join(faults::DIR);
        self.fault_dir = Some(dir.clone());
        let wake = Arc::downgrade(&self.wake);
        let spawned = std::thread::Builder::new()
            .name("fake-faults".into())
            .spawn(move || loop {
                std::thread::sleep(std::time::Duration::from_millis(100));
                // Ends with the device set.
                let Some(wake) = wake.upgrade() else { return };
                if faults::waiting(&dir) {
                    wake.notify_one();
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot watch for injected faults");
        }
        self
    }

    /// The index of a GPU named by index or id.
    fn index_of(&self, gpu: &str) -> Option<usize> {
        gpu.parse::<usize>()
            .ok()
            .filter(|i| *i < self.gpus.len())
            .or_else(|| self.gpus.iter().position(|g| g.id == gpu))
    }

    /// Applies the faults waiting in the fault folder.
    fn take_faults(&self) {
        let Some(dir) = &self.fault_dir else { return };
        for f in faults::take(dir) {
            let device = match &f.gpu {
                None => None,
                Some(g) => match self.index_of(g) {
                    Some(i) => Some(i),
                    None => {
                        tracing::warn!(gpu = %g, "an injected fault names no GPU of this node; dropped");
                        continue;
                    }
                },
            };
            let id = device.map(|i| self.gpus[i].id.clone());
            match f.what {
                faults::What::Raise { condition, detail } => self.inject(HealthChange {
                    device: id,
                    condition,
                    detail,
                    cleared: false,
                }),
                faults::What::Clear { condition } => self.inject(HealthChange {
                    device: id,
                    condition,
                    detail: String::new(),
                    cleared: true,
                }),
                faults::What::DiagnosticFails { reason } => {
                    let mut failing = self.failing_diag.lock().expect("fake lock");
                    for i in device.map_or(0..self.gpus.len(), |i| i..i + 1) {
                        failing.insert(i, reason.clone());
                    }
                }
                faults::What::DiagnosticPasses => {
                    let mut failing = self.failing_diag.lock().expect("fake lock");
                    match device {
                        Some(i) => {
                            failing.remove(&i);
                        }
                        None => failing.clear(),
                    }
                }
            }
        }
    }

    /// Reads every device node from `host` on the node instead of
    /// [`FAKE_DEVICE_NODE`] (an absolute path, e.g. a character device made
    /// for a test).
    pub fn with_stand_in(mut self, host: &str) -> Result<FakeGpus, GpuError> {
        if !host.starts_with('/') {
            return Err(GpuError::StandIn(host.to_string()));
        }
        for g in &mut self.gpus {
            for n in &mut g.device_nodes {
                n.host_path = Some(host.to_string());
            }
        }
        self.stand_in = host.to_string();
        Ok(self)
    }

    /// Makes health polls fail (`true`) or work again.
    pub fn fail_polls(&self, failing: bool) {
        self.failing
            .store(failing, std::sync::atomic::Ordering::Relaxed);
    }

    /// Makes the next poll report this change (tests, drills).
    pub fn inject(&self, change: HealthChange) {
        self.injected.lock().expect("fake lock").push(change);
        self.wake.notify_one();
    }
}

impl GpuBackend for FakeGpus {
    fn inventory(&self) -> Result<Vec<Gpu>, GpuError> {
        Ok(self.gpus.clone())
    }
    fn poll_health(&self) -> Result<Vec<HealthChange>, GpuError> {
        self.take_faults();
        if self.failing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(GpuError::Nvml("the fake driver is gone".into()));
        }
        Ok(std::mem::take(
            &mut *self.injected.lock().expect("fake lock"),
        ))
    }
    fn diagnose(&self) -> Result<serde_json::Value, GpuError> {
        std::thread::sleep(self.diag_delay);
        self.acceptance()
    }
    /// Without `diag_delay`: that drills commands in flight.
    fn acceptance(&self) -> Result<serde_json::Value, GpuError> {
        self.take_faults();
        let failing = self.failing_diag.lock().expect("fake lock");
        let gpus: Vec<serde_json::Value> = self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| match failing.get(&i) {
                Some(why) => serde_json::json!({"id": g.id, "ok": false, "reason": why}),
                None => serde_json::json!({"id": g.id, "ok": true}),
            })
            .collect();
        Ok(serde_json::json!({"backend": "fake", "gpus": gpus}))
    }
    fn changed(&self) -> Option<Arc<Notify>> {
        Some(self.wake.clone())
    }
    fn control_devices(&self) -> Vec<DeviceNode> {
        CONTROL_DEVICES[..3]
            .iter()
            .map(|p| device_node(p.to_string(), Some(&self.stand_in)))
            .collect()
    }
    fn name(&self) -> &'static str {
        "fake"
    }
}

/// The real GPUs, through NVML.
pub struct NvmlGpus {
    nvml: nvml_wrapper::Nvml,
    node: String,
    /// Uncorrected ECC counts last seen, per device index.
    ecc: Mutex<Vec<u64>>,
    /// Critical XID errors seen by the watcher thread, not yet polled.
    xids: std::sync::Arc<Mutex<Vec<HealthChange>>>,
    /// Notified by the watcher thread when it saw one.
    wake: Arc<Notify>,
}

/// Waits for critical XID events on every GPU, on its own thread with its
/// own NVML handle (an event set borrows the handle that made it). Ends
/// quietly where the driver does not support events.
fn watch_xids(out: std::sync::Arc<Mutex<Vec<HealthChange>>>, wake: Arc<Notify>) {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    use nvml_wrapper::error::NvmlError;
    let Ok(nvml) = nvml_wrapper::Nvml::init() else {
        return;
    };
    let Ok(mut set) = nvml.create_event_set() else {
        return;
    };
    let n = nvml.device_count().unwrap_or(0);
    for i in 0..n {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        set = match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(gpu = i, error = %e.error, "XID events are not available; ECC is still polled");
                return;
            }
        };
    }
    loop {
        match set.wait(1000) {
            Ok(ev) => {
                let device = ev.device.uuid().ok();
                let xid = match ev.event_data {
                    Some(XidError::Value(v)) => v.to_string(),
                    _ => "unknown".into(),
                };
                if let Ok(mut v) = out.lock() {
                    v.push(HealthChange {
                        device,
                        condition: format!("XID-{xid}"),
                        detail: "critical XID error reported by the driver".into(),
                        cleared: false,
                    });
                }
                wake.notify_one();
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "waiting for XID events failed; stopping the XID watcher");
                return;
            }
        }
    }
}

fn nvml_err(e: nvml_wrapper::error::NvmlError) -> GpuError {
    GpuError::Nvml(e.to_string())
}

impl NvmlGpus {
    /// Loads the NVML library; fails where there is no NVIDIA driver.
    pub fn open(node: &str) -> Result<NvmlGpus, GpuError> {
        let nvml = nvml_wrapper::Nvml::init().map_err(nvml_err)?;
        let n = nvml.device_count().map_err(nvml_err)? as usize;
        let xids = std::sync::Arc::new(Mutex::new(Vec::new()));
        let watcher = xids.clone();
        let wake = Arc::new(Notify::new());
        let waker = wake.clone();
        std::thread::Builder::new()
            .name("nvml-xid".into())
            .spawn(move || watch_xids(watcher, waker))
            .map_err(|e| GpuError::Nvml(format!("start the XID watcher: {e}")))?;
        Ok(NvmlGpus {
            nvml,
            node: node.to_string(),
            ecc: Mutex::new(vec![0; n]),
            xids,
            wake,
        })
    }

    fn class_of(name: &str, memory_mb: u64) -> String {
        // "NVIDIA H100 80GB HBM3" -> "H100-80GB"
        let model = name
            .split_whitespace()
            .find(|w| {
                w.chars().next().is_some_and(|c| c.is_ascii_uppercase())
                    && w.chars().any(|c| c.is_ascii_digit())
            })
            .unwrap_or(name);
        format!("{model}-{}GB", (memory_mb + 512) / 1024)
    }
}

impl GpuBackend for NvmlGpus {
    fn inventory(&self) -> Result<Vec<Gpu>, GpuError> {
        use nvml_wrapper::enum_wrappers::nv_link::Capability;
        let n = self.nvml.device_count().map_err(nvml_err)?;
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let d = self.nvml.device_by_index(i).map_err(nvml_err)?;
            let memory_mb = d.memory_info().map_err(nvml_err)?.total / (1024 * 1024);
            let name = d.name().map_err(nvml_err)?;
            // A GPU with an active NVLink is in the node's NVLink island.
            let linked = (0..18).any(|l| {
                let link = d.link_wrapper_for(l);
                link.is_active().unwrap_or(false)
                    && link.has_capability(Capability::P2p).unwrap_or(false)
            });
            out.push(Gpu {
                id: d.uuid().map_err(nvml_err)?,
                class: Self::class_of(&name, memory_mb),
                memory_mb,
                island: linked.then(|| format!("{}/nvl0", self.node)),
                pci: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
                numa: 0,
                // The driver's node for minor number N is /dev/nvidiaN.
                device_nodes: vec![device_node(
                    format!("/dev/nvidia{}", d.minor_number().map_err(nvml_err)?),
                    None,
                )],
            });
        }
        Ok(out)
    }

    fn poll_health(&self) -> Result<Vec<HealthChange>, GpuError> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
        let n = self.nvml.device_count().map_err(nvml_err)?;
        let mut changes = std::mem::take(&mut *self.xids.lock().expect("xid lock"));
        let mut seen = self.ecc.lock().expect("ecc lock");
        seen.resize(n as usize, 0);
        for i in 0..n {
            let d = self.nvml.device_by_index(i).map_err(nvml_err)?;
            let uuid = d.uuid().map_err(nvml_err)?;
            // Not every GPU reports ECC; those that do not are left alone.
            if let Ok(count) = d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
                let before = seen[i as usize];
                if count > before {
                    changes.push(HealthChange {
                        device: Some(uuid.clone()),
                        condition: "ECC-uncorrected".into(),
                        detail: format!("{count} volatile uncorrected ECC errors"),
                        cleared: false,
                    });
                }
                seen[i as usize] = count;
            }
        }
        Ok(changes)
    }

    fn diagnose(&self) -> Result<serde_json::Value, GpuError> {
        let n = self.nvml.device_count().map_err(nvml_err)?;
        let mut gpus = Vec::new();
        for i in 0..n {
            let d = self.nvml.device_by_index(i).map_err(nvml_err)?;
            let temp = d
                .temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu)
                .ok();
            let mem = d.memory_info().ok();
            // Where the GPU has ECC: no uncorrected error since the driver
            // loaded, and no page waiting to be retired at the next reset.
            let ecc = d
                .total_ecc_errors(
                    nvml_wrapper::enum_wrappers::device::MemoryError::Uncorrected,
                    nvml_wrapper::enum_wrappers::device::EccCounter::Volatile,
                )
                .ok();
            let pending = d.are_pages_pending_retired().ok();
            let reason = if temp.is_none() || mem.is_none() {
                Some("does not answer".to_string())
            } else if ecc.is_some_and(|n| n > 0) {
                Some(format!("{} uncorrected ECC errors", ecc.unwrap_or(0)))
            } else if pending == Some(true) {
                Some("pages pending retirement: reset it".to_string())
            } else {
                None
            };
            gpus.push(serde_json::json!({
                "id": d.uuid().map_err(nvml_err)?,
                "name": d.name().map_err(nvml_err)?,
                "temperature_c": temp,
                "memory_total_mb": mem.as_ref().map(|m| m.total / (1024 * 1024)),
                "memory_used_mb": mem.as_ref().map(|m| m.used / (1024 * 1024)),
                "ecc_uncorrected_volatile": ecc,
                "pages_pending_retirement": pending,
                "ok": reason.is_none(),
                "reason": reason,
            }));
        }
        Ok(serde_json::json!({
            "backend": "nvml",
            "driver": self.nvml.sys_driver_version().map_err(nvml_err)?,
            "gpus": gpus,
        }))
    }

    fn control_devices(&self) -> Vec<DeviceNode> {
        // Only those the driver made: a runtime refuses a spec naming a
        // device node that does not exist (nvidia-uvm appears once its
        // module is loaded, nvidia-modeset only with display support).
        CONTROL_DEVICES
            .iter()
            .filter(|p| std::path::Path::new(p).exists())
            .map(|p| device_node(p.to_string(), None))
            .collect()
    }

    fn name(&self) -> &'static str {
        "nvml"
    }

    fn changed(&self) -> Option<Arc<Notify>> {
        Some(self.wake.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_specs_parse_like_real_inventories() {
        let f = FakeGpus::parse("8xH100-80GB", "n1").unwrap();
        let inv = f.inventory().unwrap();
        assert_eq!(inv.len(), 8);
        assert_eq!(inv[0].class, "H100-80GB");
        assert_eq!(inv[0].memory_mb, 80 * 1024);
        assert_eq!(inv[7].numa, 1);
        assert!(inv.iter().all(|g| g.island.as_deref() == Some("n1/nvl0")));
        for bad in ["", "8", "0xH100", "x", "99xA", "ax B"] {
            assert!(FakeGpus::parse(bad, "n").is_err(), "{bad}");
        }
        f.inject(HealthChange {
            device: Some(inv[3].id.clone()),
            condition: "XID-79".into(),
            detail: String::new(),
            cleared: false,
        });
        assert_eq!(f.poll_health().unwrap().len(), 1);
        assert!(f.poll_health().unwrap().is_empty());
    }

    #[test]
    fn nvml_class_names() {
        assert_eq!(
            NvmlGpus::class_of("NVIDIA H100 80GB HBM3", 81_559),
            "H100-80GB"
        );
        assert_eq!(NvmlGpus::class_of("NVIDIA H200", 143_771), "H200-140GB");
    }
}
