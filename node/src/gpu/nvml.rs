//! The real GPUs, through NVML (nvml-wrapper): inventory with MIG
//! instances, health (XID events, ECC counters), diagnostics, and MIG
//! layouts applied through [`super::nvml_mig`].

use super::nvml_mig::{self, capability_node, MigApi};
use super::{device_node, Gpu, GpuBackend, GpuError, HealthChange, CONTROL_DEVICES};
use crate::cdi::DeviceNode;
use crate::mig::Profile;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

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
    /// NVML's MIG calls, where the library has them.
    mig: Option<MigApi>,
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
        let mig = MigApi::open()
            .map_err(|e| tracing::warn!(error = %e, "MIG instances will not be reported"))
            .ok();
        Ok(NvmlGpus {
            nvml,
            node: node.to_string(),
            ecc: Mutex::new(vec![0; n]),
            xids,
            wake,
            mig,
        })
    }

    /// The MIG instances of whole GPU `d` (`gpu`, minor number `minor`):
    /// each of class `<gpu class>/<profile>`, reached through the GPU's
    /// device node and its GPU and compute instances' capability devices.
    fn instances(
        &self,
        d: &nvml_wrapper::Device<'_>,
        gpu: &Gpu,
        minor: u32,
    ) -> Result<Vec<Gpu>, GpuError> {
        let Some(mig) = &self.mig else {
            return Ok(Vec::new());
        };
        let devices = mig.devices(nvml_mig::handle(d))?;
        let mut out = Vec::with_capacity(devices.len());
        for m in devices {
            let md = nvml_mig::device(m.handle, &self.nvml);
            let name = md.name().map_err(nvml_err)?;
            // "NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> "1g.10gb"
            let profile = name.rsplit(' ').next().unwrap_or(&name).to_string();
            let mut device_nodes = gpu.device_nodes.clone();
            for ci in [None, Some(m.compute_instance)] {
                if let Some(path) = capability_node(minor, m.gpu_instance, ci) {
                    device_nodes.push(device_node(path, None));
                }
            }
            out.push(Gpu {
                id: md.uuid().map_err(nvml_err)?,
                class: crate::mig::instance_class(&gpu.class, &profile),
                memory_mb: md.memory_info().map_err(nvml_err)?.total / (1024 * 1024),
                island: None,
                pci: gpu.pci.clone(),
                numa: gpu.numa,
                device_nodes,
                parent: Some(gpu.id.clone()),
            });
        }
        Ok(out)
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
            let minor = d.minor_number().map_err(nvml_err)?;
            let gpu = Gpu {
                id: d.uuid().map_err(nvml_err)?,
                class: Self::class_of(&name, memory_mb),
                memory_mb,
                island: linked.then(|| format!("{}/nvl0", self.node)),
                pci: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
                numa: 0,
                // The driver's node for minor number N is /dev/nvidiaN.
                device_nodes: vec![device_node(format!("/dev/nvidia{minor}"), None)],
                parent: None,
            };
            let instances = self.instances(&d, &gpu, minor)?;
            out.push(gpu);
            out.extend(instances);
        }
        Ok(out)
    }

    fn repartition(&self, gpu: &str, layout: &[Profile]) -> Result<(), GpuError> {
        let mig = self
            .mig
            .as_ref()
            .ok_or_else(|| GpuError::Refused("this NVML has no MIG calls".into()))?;
        let d = match gpu.parse::<u32>() {
            Ok(i) => self.nvml.device_by_index(i),
            Err(_) => self.nvml.device_by_uuid(gpu),
        }
        .map_err(|e| GpuError::Refused(format!("no GPU {gpu} on this node: {e}")))?;
        let memory_mb = d.memory_info().map_err(nvml_err)?.total / (1024 * 1024);
        crate::mig::check_fits(layout, memory_mb)?;
        mig.apply(nvml_mig::handle(&d), layout)
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
    fn nvml_class_names() {
        assert_eq!(
            NvmlGpus::class_of("NVIDIA H100 80GB HBM3", 81_559),
            "H100-80GB"
        );
        assert_eq!(NvmlGpus::class_of("NVIDIA H200", 143_771), "H200-140GB");
    }
}
