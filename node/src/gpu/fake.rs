//! A fake device set shaped like NVML's: whole GPUs, MIG instances, health
//! changes and failing diagnostics injected in the process or from outside
//! it, and a MIG layout kept across daemon restarts as a GPU keeps its own.

use super::{device_node, Gpu, GpuBackend, GpuError, HealthChange, CONTROL_DEVICES};
use crate::cdi::DeviceNode;
use crate::faults;
use crate::mig::{self, Layout, Profile};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// A fake device set: `COUNTxCLASS`, e.g. `8xH100-80GB`, one NVLink island
/// per node, optionally with MIG instances (`8xH100-80GB:mig=1g.10gb*7`
/// splits every GPU into seven; `...@0-1` only GPUs 0 and 1). Health changes
/// and failing diagnostics can be injected, in the process
/// ([`FakeGpus::inject`]) or from outside it through a fault folder
/// ([`FakeGpus::with_data_dir`], [`crate::faults`]). Its device nodes are named as
/// the driver's (`/dev/nvidia0`, `/dev/nvidiactl`, ...) and read from a
/// stand-in on the node ([`FAKE_DEVICE_NODE`] unless told otherwise), so a
/// container given a fake binding sees the same paths a real one would.
pub struct FakeGpus {
    node: String,
    /// The whole GPUs, in index order.
    gpus: Vec<Gpu>,
    /// Each whole GPU's MIG layout, and how many times it was split (the
    /// instances' ids change with it, as NVML's UUIDs do).
    mig: Mutex<Vec<(Layout, u32)>>,
    /// Where the layout is kept (`<data dir>/mig.json`), if anywhere.
    mig_file: Option<PathBuf>,
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
        let bad = || GpuError::Spec(spec.to_string());
        let (whole, mig) = match spec.split_once(":mig=") {
            Some((w, m)) => (w, Some(m)),
            None => (spec, None),
        };
        let (count, class) = whole.split_once('x').ok_or_else(bad)?;
        let count: u32 = count.parse().map_err(|_| bad())?;
        if count == 0
            || count > 64
            || class.is_empty()
            || class.contains('/')
            || class.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(bad());
        }
        let gpus: Vec<Gpu> = (0..count)
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
                parent: None,
            })
            .collect();
        let mut layouts = vec![(Layout::new(), 0); gpus.len()];
        if let Some(m) = mig {
            let (profiles, which) = match m.split_once('@') {
                Some((p, w)) => (p, Some(w)),
                None => (m, None),
            };
            let layout = mig::parse_layout(profiles)?;
            mig::check_fits(&layout, class_memory_mb(class))?;
            let (first, last) = match which {
                None => (0, count - 1),
                Some(w) => {
                    let (a, b) = w.split_once('-').unwrap_or((w, w));
                    let a: u32 = a.parse().map_err(|_| bad())?;
                    let b: u32 = b.parse().map_err(|_| bad())?;
                    if a > b || b >= count {
                        return Err(bad());
                    }
                    (a, b)
                }
            };
            for l in &mut layouts[first as usize..=last as usize] {
                *l = (layout.clone(), 1);
            }
        }
        Ok(FakeGpus {
            node: node.to_string(),
            gpus,
            mig: Mutex::new(layouts),
            mig_file: None,
            stand_in: FAKE_DEVICE_NODE.into(),
            injected: Mutex::new(Vec::new()),
            failing: std::sync::atomic::AtomicBool::new(false),
            diag_delay: std::time::Duration::ZERO,
            failing_diag: Mutex::new(BTreeMap::new()),
            fault_dir: None,
            wake: Arc::new(Notify::new()),
        })
    }

    /// The MIG instances of whole GPU `i` split as `layout` (its `gen`th
    /// split): ids `MIG-fake-<node>-<i>-<gen>-<k>`, the GPU's device node
    /// and a GPU-instance and compute-instance capability device each.
    fn instances(&self, i: usize, layout: &[Profile], gen: u32) -> Vec<Gpu> {
        let g = &self.gpus[i];
        layout
            .iter()
            .enumerate()
            .map(|(k, p)| {
                let caps = |n: usize| {
                    device_node(
                        format!("/dev/nvidia-caps/nvidia-cap{}", 16 + i * 64 + k * 2 + n),
                        Some(&self.stand_in),
                    )
                };
                let mut device_nodes = g.device_nodes.clone();
                device_nodes.extend([caps(0), caps(1)]);
                Gpu {
                    id: format!("MIG-fake-{}-{i}-{gen}-{k}", self.node),
                    class: crate::mig::instance_class(&g.class, &p.to_string()),
                    memory_mb: u64::from(p.memory_gb) * 1024,
                    island: None,
                    pci: g.pci.clone(),
                    numa: g.numa,
                    device_nodes,
                    parent: Some(g.id.clone()),
                }
            })
            .collect()
    }

    /// Takes faults injected from outside the process from the `faults/`
    /// folder of `data_dir` (see [`crate::faults`]), a thread looking for
    /// them every 100 ms and waking the daemon when one is there; and keeps
    /// the MIG layout in `data_dir/mig.json`, so a restarted daemon finds
    /// its GPUs split as it left them (a real GPU keeps its partitions).
    pub fn with_data_dir(mut self, data_dir: &Path) -> FakeGpus {
        let file = data_dir.join("mig.json");
        if let Some(kept) = std::fs::read(&file)
            .ok()
            .and_then(|b| serde_json::from_slice::<Vec<(String, u32)>>(&b).ok())
        {
            let mut mig = self.mig.lock().expect("fake lock");
            for (i, (text, gen)) in kept.into_iter().enumerate().take(mig.len()) {
                match mig::parse_layout(&text) {
                    Ok(layout) => mig[i] = (layout, gen),
                    Err(e) => {
                        tracing::warn!(file = %file.display(), error = %e, "a kept MIG layout is not valid; using the spec's")
                    }
                }
            }
        }
        self.mig_file = Some(file);
        self.with_fault_dir(data_dir)
    }

    /// Keeps the MIG layout in `mig.json` (written whole and flushed).
    fn keep_layout(&self, layouts: &[(Layout, u32)]) -> std::io::Result<()> {
        let Some(file) = &self.mig_file else {
            return Ok(());
        };
        let kept: Vec<(String, u32)> = layouts
            .iter()
            .map(|(l, g)| (mig::layout_text(l), *g))
            .collect();
        let body = serde_json::to_vec(&kept).expect("layouts serialize");
        crate::durable::write(file, &file.with_extension("json.tmp"), &body)
    }

    fn with_fault_dir(mut self, data_dir: &Path) -> FakeGpus {
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

    /// The index of a whole GPU named by index or id.
    fn index_of(&self, gpu: &str) -> Option<usize> {
        gpu.parse::<usize>()
            .ok()
            .filter(|i| *i < self.gpus.len())
            .or_else(|| self.gpus.iter().position(|g| g.id == gpu))
    }

    /// The whole GPU a fault names (by index or id, or through one of its
    /// MIG instances' ids), and the id of the device it is on.
    fn fault_target(&self, gpu: &str) -> Option<(usize, String)> {
        if let Some(i) = self.index_of(gpu) {
            return Some((i, self.gpus[i].id.clone()));
        }
        let inventory = self.inventory().ok()?;
        let instance = inventory.iter().find(|d| d.id == gpu)?;
        let i = self.index_of(instance.parent.as_deref()?)?;
        Some((i, instance.id.clone()))
    }

    /// Applies the faults waiting in the fault folder.
    fn take_faults(&self) {
        let Some(dir) = &self.fault_dir else { return };
        for f in faults::take(dir) {
            let (device, id) = match &f.gpu {
                None => (None, None),
                Some(g) => match self.fault_target(g) {
                    Some((i, id)) => (Some(i), Some(id)),
                    None => {
                        tracing::warn!(gpu = %g, "an injected fault names no GPU of this node; dropped");
                        continue;
                    }
                },
            };
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
        // (Instances are made with the stand-in in force.)
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
        let mig = self.mig.lock().expect("fake lock");
        let mut out = self.gpus.clone();
        for (i, (layout, gen)) in mig.iter().enumerate() {
            out.extend(self.instances(i, layout, *gen));
        }
        Ok(out)
    }

    fn repartition(&self, gpu: &str, layout: &[Profile]) -> Result<(), GpuError> {
        let i = self
            .index_of(gpu)
            .ok_or_else(|| GpuError::Refused(format!("no GPU {gpu} on this node")))?;
        mig::check_fits(layout, self.gpus[i].memory_mb)?;
        let mut mig = self.mig.lock().expect("fake lock");
        let mut next = mig.clone();
        next[i] = (layout.to_vec(), next[i].1 + 1);
        self.keep_layout(&next)
            .map_err(|e| GpuError::Refused(format!("keep the MIG layout: {e}")))?;
        *mig = next;
        Ok(())
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
        for bad in [
            "",
            "8",
            "0xH100",
            "x",
            "99xA",
            "ax B",
            "8xH100-80GB:mig=9g.10gb",
            "8xH100-80GB:mig=1g.10gb*8",
            "8xH100-80GB:mig=1g.10gb@7-9",
            "8xH100-80GB:mig=1g.10gb@2-1",
        ] {
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
    fn mig_instances_are_devices_of_their_own_class_and_a_split_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let f = FakeGpus::parse("8xH100-80GB:mig=1g.10gb*7@0-1", "n1")
            .unwrap()
            .with_data_dir(dir.path());
        let inv = f.inventory().unwrap();
        assert_eq!(inv.len(), 8 + 14);
        let slices: Vec<&Gpu> = inv.iter().filter(|g| g.parent.is_some()).collect();
        assert!(slices.iter().all(|g| g.class == "H100-80GB/1g.10gb"
            && g.memory_mb == 10 * 1024
            && g.island.is_none()));
        assert_eq!(slices[0].parent.as_deref(), Some("GPU-fake-n1-0"));
        assert_eq!(slices[7].parent.as_deref(), Some("GPU-fake-n1-1"));
        // An instance's device nodes: its GPU's, and two capability devices.
        let paths: Vec<&str> = slices[0]
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        assert_eq!(paths[0], "/dev/nvidia0");
        assert!(paths[1].starts_with("/dev/nvidia-caps/nvidia-cap"));
        assert_eq!(paths.len(), 3);
        let mut all: Vec<&str> = slices
            .iter()
            .flat_map(|g| g.device_nodes[1..].iter().map(|n| n.path.as_str()))
            .collect();
        all.sort();
        all.dedup();
        assert_eq!(
            all.len(),
            28,
            "every instance has capability devices of its own"
        );

        // GPU 1 made whole, GPU 2 split in two: new instance ids, kept.
        f.repartition("1", &[]).unwrap();
        f.repartition("GPU-fake-n1-2", &mig::parse_layout("3g.40gb*2").unwrap())
            .unwrap();
        let err = f
            .repartition("3", &mig::parse_layout("4g.40gb*2").unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("compute slices"), "{err}");
        assert!(f.repartition("9", &[]).is_err());
        let after = f.inventory().unwrap();
        let of = |inv: &[Gpu], gpu: &str| -> Vec<String> {
            inv.iter()
                .filter(|g| g.parent.as_deref() == Some(gpu))
                .map(|g| g.class.clone())
                .collect()
        };
        assert!(of(&after, "GPU-fake-n1-1").is_empty());
        assert_eq!(of(&after, "GPU-fake-n1-2"), ["H100-80GB/3g.40gb"; 2]);
        let restarted = FakeGpus::parse("8xH100-80GB:mig=1g.10gb*7@0-1", "n1")
            .unwrap()
            .with_data_dir(dir.path());
        assert_eq!(restarted.inventory().unwrap(), after);
        // A fault may name an instance: it is raised on the instance.
        faults::inject(
            dir.path(),
            &faults::Fault {
                gpu: Some(after[8].id.clone()),
                what: faults::What::Raise {
                    condition: "XID-94".into(),
                    detail: String::new(),
                },
            },
        )
        .unwrap();
        let raised = restarted.poll_health().unwrap();
        assert_eq!(raised[0].device.as_deref(), Some(after[8].id.as_str()));
    }

    mod properties {
        use super::super::FakeGpus;
        use crate::gpu::GpuBackend;
        use proptest::prelude::*;

        fn spec() -> impl Strategy<Value = String> {
            prop_oneof![
                any::<String>(),
                "[0-9]{1,3}x[A-Za-z0-9-]{0,10}",
                "[0-9]{1,2}x[A-Z0-9-]{1,8}:mig=[0-9a-z.*+,@-]{0,24}",
                (
                    1u32..9,
                    prop_oneof![
                        Just("1g.10gb"),
                        Just("3g.40gb"),
                        Just("7g.80gb"),
                        Just("9g.1gb")
                    ],
                    0u32..9,
                    0u32..9
                )
                    .prop_map(|(n, p, k, at)| format!("{n}xH100-80GB:mig={p}*{k}@{at}")),
            ]
        }

        proptest! {
            /// Any spec is an inventory or a refusal, never a panic; an
            /// inventory's ids are unique and each instance's GPU is in it,
            /// whole.
            #[test]
            fn specs_become_consistent_inventories_or_refusals(spec in spec()) {
                let Ok(gpus) = FakeGpus::parse(&spec, "n1") else { return Ok(()) };
                let inv = gpus.inventory().unwrap();
                let ids: std::collections::HashSet<&str> = inv.iter().map(|g| g.id.as_str()).collect();
                prop_assert_eq!(ids.len(), inv.len(), "ids repeat in {:?}", spec);
                for g in &inv {
                    if let Some(parent) = &g.parent {
                        let whole = inv.iter().find(|p| &p.id == parent);
                        prop_assert!(whole.is_some_and(|p| p.parent.is_none()), "{:?}", spec);
                    }
                }
            }
        }
    }
}
