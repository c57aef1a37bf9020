//! A node's bindings on its disk: what `allocation.bind`,
//! `allocation.release` and `allocation.preempting` do, and how the daemon
//! makes its folders agree when it starts.
//!
//! A binding is `allocations/<reservation>.json` under the data dir (the
//! bound GPUs, written whole and flushed) and its CDI spec (see
//! [`crate::cdi`]) in the CDI folder, which is what a container runtime
//! reads (written whole, not flushed: it is derived from the binding). A
//! bind writes the binding, then the spec; a release writes `<reservation>.released` (a tombstone),
//! removes the spec, then the binding. So at any moment a spec without a
//! binding, or a binding without a spec, is a command cut short by a crash,
//! and [`Bindings::reconcile`] finishes it at the next start.
//!
//! The tombstone also makes a bind that arrives after its reservation's
//! release (the daemon runs each command in its own task, and the two can
//! cross) refused instead of binding devices the log has freed. Bind and
//! release hold one lock while they touch the folders. Tombstones older
//! than two days are pruned: by then the bind has long expired.
//!
//! Preemption: `allocation.preempting` writes `<reservation>.preempting`
//! (why it ends, who preempts it if anyone, and when its grace period
//! ends; the same notice comes one grace period before its queue's
//! maximum run time) beside the binding,
//! for the workload's runtime to see and checkpoint before the release
//! comes; the release removes it.

use crate::acceptance::Report;
use crate::cdi;
use crate::gpu::{Gpu, GpuBackend};
use crate::outcome::Outcome;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The environment variable that names a crash point: tests of crash
/// recovery set it to make the daemon abort there, as a power cut would.
pub const CRASH_AT_ENV: &str = "STRATA_NODE_CRASH_AT";

/// Where a crash can be asked for: after a bind wrote the binding, before
/// its spec.
pub const CRASH_AFTER_BINDING: &str = "bind:binding-written";

/// Aborts the process if [`CRASH_AT_ENV`] names `point`.
fn crash_point(point: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if AT
        .get_or_init(|| std::env::var(CRASH_AT_ENV).ok())
        .as_deref()
        == Some(point)
    {
        tracing::error!(point, "crashing here as {CRASH_AT_ENV} asks");
        std::process::abort();
    }
}

/// The lock under which a node's binds, releases and reconciling run, so
/// that they never interleave: one per allocations folder, shared by every
/// [`Bindings`] of that folder in the process. One lock for the whole
/// process made the simulated nodes of a fleet in one process (the region
/// bench's 10,000) wait on each other's disk writes.
fn lock_of(dir: &Path) -> Arc<Mutex<()>> {
    static LOCKS: std::sync::LazyLock<Mutex<std::collections::HashMap<PathBuf, Arc<Mutex<()>>>>> =
        std::sync::LazyLock::new(Default::default);
    LOCKS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(dir.to_path_buf())
        .or_default()
        .clone()
}

/// How long a release's tombstone is kept.
const TOMBSTONE_AGE: std::time::Duration = std::time::Duration::from_secs(2 * 24 * 3600);

/// One bound GPU as the binding records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundDevice {
    /// The device id the log gave (the GPU's UUID, or `gpuN`).
    pub id: String,
    pub uuid: String,
    pub pci: String,
    /// Its device nodes when bound (absent in bindings older than CDI
    /// specs: then taken from the inventory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<cdi::DeviceNode>,
}

/// A binding: `allocations/<reservation>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    pub reservation: String,
    pub devices: Vec<BoundDevice>,
    /// The name a container runtime is given: `strata.dev/reservation=<name>`.
    #[serde(default)]
    pub cdi_device: String,
}

/// What [`Bindings::reconcile`] did at start.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Releases cut short by a crash, finished (their reservations).
    pub released: Vec<String>,
    /// Specs without a binding, removed (their device names).
    pub specs_removed: Vec<String>,
    /// Bindings without a spec, whose spec was written (their reservations).
    pub specs_written: Vec<String>,
}

/// Where a node keeps its bindings and their CDI specs.
#[derive(Debug, Clone)]
pub struct Bindings {
    /// `allocations/` under the data dir.
    pub dir: PathBuf,
    /// The CDI folder runtimes read (`/var/run/cdi` by default).
    pub cdi_dir: PathBuf,
    /// The node's last acceptance check, if binds are held to it: while it
    /// fails the node, or a device, no new bind of them lands.
    acceptance: Option<Arc<Mutex<Report>>>,
    /// This node's bindings' lock ([`lock_of`]).
    lock: Arc<Mutex<()>>,
}

fn fail(detail: String) -> Outcome {
    Outcome {
        ok: false,
        detail,
        output: serde_json::Value::Null,
    }
}

fn done(detail: impl Into<String>, output: serde_json::Value) -> Outcome {
    Outcome {
        ok: true,
        detail: detail.into(),
        output,
    }
}

fn valid_file_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 200 && !s.contains(['/', '\0']) && s != "." && s != ".."
}

/// The reservation a command is about, if it names one that may become a
/// file name.
fn reservation_arg<'a>(kind: &str, args: &'a serde_json::Value) -> Result<&'a str, Outcome> {
    args["reservation"]
        .as_str()
        .filter(|r| valid_file_name(r))
        .ok_or_else(|| fail(format!("{kind} needs a reservation")))
}

impl Bindings {
    /// The bindings of the node whose data dir is `data_dir`, with their
    /// specs in `cdi_dir`.
    pub fn new(data_dir: &Path, cdi_dir: &Path) -> Bindings {
        let dir = data_dir.join("allocations");
        Bindings {
            lock: lock_of(&dir),
            dir,
            cdi_dir: cdi_dir.to_path_buf(),
            acceptance: None,
        }
    }

    /// Holds new binds to the node's acceptance check as it stands when
    /// each arrives (the daemon's; the log may still say the node passed
    /// while a failing report is on its way).
    pub fn guarded_by(mut self, acceptance: Arc<Mutex<Report>>) -> Bindings {
        self.acceptance = Some(acceptance);
        self
    }

    fn binding_path(&self, reservation: &str) -> PathBuf {
        self.dir.join(format!("{reservation}.json"))
    }

    fn tombstone(&self, reservation: &str) -> PathBuf {
        self.dir.join(format!("{reservation}.released"))
    }

    fn preempting_path(&self, reservation: &str) -> PathBuf {
        self.dir.join(format!("{reservation}.preempting"))
    }

    /// A binding's CDI spec.
    fn spec_of(&self, backend: &dyn GpuBackend, b: &Binding) -> cdi::Spec {
        let gpus: Vec<cdi::BoundGpu> = b
            .devices
            .iter()
            .map(|d| cdi::BoundGpu {
                uuid: d.uuid.clone(),
                nodes: d.device_nodes.clone(),
            })
            .collect();
        cdi::spec(&b.reservation, &gpus, &backend.control_devices())
    }

    /// Writes a binding's CDI spec.
    fn write_spec(&self, backend: &dyn GpuBackend, b: &Binding) -> std::io::Result<PathBuf> {
        cdi::write(&self.cdi_dir, &b.reservation, &self.spec_of(backend, b))
    }

    /// `allocation.bind`: records the reservation's devices and writes their
    /// CDI spec; answers with the binding (its `cdi_device` is the name to
    /// give a runtime).
    pub fn bind(&self, backend: &dyn GpuBackend, args: &serde_json::Value) -> Outcome {
        let reservation = match reservation_arg("allocation.bind", args) {
            Ok(r) => r,
            Err(o) => return o,
        };
        let Some(devices) = args["devices"].as_array() else {
            return fail("allocation.bind needs devices".into());
        };
        let inventory = match backend.inventory() {
            Ok(i) => i,
            Err(e) => return fail(e.to_string()),
        };
        let mut bound = Vec::new();
        for d in devices {
            let Some(id) = d.as_str() else {
                return fail("device ids are strings".into());
            };
            // Ids from the log are the inventory's ids; indexes work too.
            let found = inventory
                .iter()
                .enumerate()
                .find(|(i, g)| g.id == id || format!("gpu{i}") == id);
            match found {
                Some((_, g)) => bound.push(BoundDevice {
                    id: id.to_string(),
                    uuid: g.id.clone(),
                    pci: g.pci.clone(),
                    device_nodes: g.device_nodes.clone(),
                }),
                None => return fail(format!("device {id} is not on this node")),
            }
        }
        let binding = Binding {
            reservation: reservation.to_string(),
            devices: bound,
            cdi_device: cdi::qualified_name(reservation),
        };
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        // A bind of a reservation bound here already is answered as before.
        if let Some(acceptance) = self
            .acceptance
            .as_ref()
            .filter(|_| !self.binding_path(reservation).exists())
        {
            let ids: Vec<&str> = binding.devices.iter().map(|d| d.uuid.as_str()).collect();
            if let Some(why) = acceptance.lock().expect("acceptance lock").refuses(&ids) {
                return fail(why);
            }
        }
        match self.family_bound(&inventory, &binding) {
            Ok(None) => {}
            Ok(Some((other, _))) if other == reservation => {}
            Ok(Some((other, device))) => {
                return fail(format!(
                    "device {device} shares its GPU with a MIG relative bound to reservation {other}; nothing bound"
                ))
            }
            Err(e) => return fail(format!("read the bindings: {e}")),
        }
        if self.tombstone(reservation).exists() {
            return fail(format!(
                "reservation {reservation} was released before its bind arrived; nothing bound"
            ));
        }
        let body = serde_json::to_value(&binding).expect("bindings serialize");
        let written = std::fs::create_dir_all(&self.dir).and_then(|_| {
            crate::durable::write(
                &self.binding_path(reservation),
                &self.dir.join(format!(".{reservation}.tmp")),
                body.to_string().as_bytes(),
            )
        });
        if let Err(e) = written {
            return fail(format!("write the allocation: {e}"));
        }
        crash_point(CRASH_AFTER_BINDING);
        if let Err(e) = self.write_spec(backend, &binding) {
            // No binding without its spec: take the binding back.
            let _ = std::fs::remove_file(self.binding_path(reservation));
            return fail(format!(
                "write the CDI spec in {}: {e}",
                self.cdi_dir.display()
            ));
        }
        done(
            format!(
                "bound {} devices as {}",
                binding.devices.len(),
                binding.cdi_device
            ),
            body,
        )
    }

    /// Every binding on the disk.
    fn all(&self) -> std::io::Result<Vec<Binding>> {
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e),
        };
        for entry in entries {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if let Some(r) = name.strip_suffix(".json").filter(|r| !r.starts_with('.')) {
                out.push(self.binding(r)?);
            }
        }
        Ok(out)
    }

    /// Runs `f` on every binding while no bind or release runs (a change of
    /// the GPUs themselves, which must find nothing bound to them).
    pub(crate) fn holding<R>(&self, f: impl FnOnce(&[Binding]) -> R) -> std::io::Result<R> {
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        Ok(f(&self.all()?))
    }

    /// A binding that holds a MIG relative (the GPU, or one of its
    /// instances) of a device of `binding`, and that device's id, if any:
    /// the node's own guard that a GPU and its instances are never bound at
    /// once. The bindings are read once, and only when a device has
    /// relatives.
    fn family_bound(
        &self,
        inventory: &[Gpu],
        binding: &Binding,
    ) -> std::io::Result<Option<(String, String)>> {
        // (a relative's id, the bound device's id)
        let mut relatives: Vec<(&str, &str)> = Vec::new();
        for d in &binding.devices {
            let Some(gpu) = inventory.iter().find(|g| g.id == d.uuid) else {
                continue;
            };
            relatives.extend(
                inventory
                    .iter()
                    .filter(|o| {
                        gpu.parent.as_deref() == Some(o.id.as_str())
                            || o.parent.as_deref() == Some(gpu.id.as_str())
                    })
                    .map(|o| (o.id.as_str(), d.id.as_str())),
            );
        }
        if relatives.is_empty() {
            return Ok(None);
        }
        for b in self.all()? {
            for bd in &b.devices {
                if let Some((_, device)) = relatives.iter().find(|(r, _)| *r == bd.uuid) {
                    return Ok(Some((b.reservation, device.to_string())));
                }
            }
        }
        Ok(None)
    }

    /// `allocation.release`: the tombstone first (from then on no bind of
    /// the reservation lands), then the spec (no new container gets the
    /// devices), then the binding.
    pub fn release(&self, args: &serde_json::Value) -> Outcome {
        let reservation = match reservation_arg("allocation.release", args) {
            Ok(r) => r,
            Err(o) => return o,
        };
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let marked = std::fs::create_dir_all(&self.dir)
            .and_then(|_| std::fs::write(self.tombstone(reservation), b""));
        if let Err(e) = marked {
            return fail(format!("record the release: {e}"));
        }
        self.prune_tombstones();
        if let Err(e) = cdi::remove(&self.cdi_dir, reservation) {
            return fail(format!("remove the CDI spec: {e}"));
        }
        let _ = std::fs::remove_file(self.preempting_path(reservation));
        match std::fs::remove_file(self.binding_path(reservation)) {
            Ok(()) => done("released", serde_json::Value::Null),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                done("nothing was bound", serde_json::Value::Null)
            }
            Err(e) => fail(format!("remove the allocation: {e}")),
        }
    }

    /// `allocation.preempting`: tells the workload its reservation is
    /// preempted and when its devices go.
    pub fn preempting(&self, args: &serde_json::Value) -> Outcome {
        let reservation = match reservation_arg("allocation.preempting", args) {
            Ok(r) => r,
            Err(o) => return o,
        };
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if !self.binding_path(reservation).exists() {
            return done(
                format!("reservation {reservation} is not bound here"),
                serde_json::Value::Null,
            );
        }
        match std::fs::write(self.preempting_path(reservation), args.to_string()) {
            Ok(()) => done(
                format!(
                    "reservation {reservation} ends ({}{}); it keeps its devices until {}",
                    args["reason"].as_str().unwrap_or("preempted"),
                    match args["by"].as_str() {
                        Some(by) if !by.is_empty() => format!(", for {by}"),
                        _ => String::new(),
                    },
                    args["deadline_ms"]
                ),
                args.clone(),
            ),
            Err(e) => fail(format!("record the preemption: {e}")),
        }
    }

    /// Removes tombstones older than [`TOMBSTONE_AGE`].
    fn prune_tombstones(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > TOMBSTONE_AGE);
            if old && path.extension().is_some_and(|x| x == "released") {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// The binding of `reservation`, as written.
    pub fn binding(&self, reservation: &str) -> std::io::Result<Binding> {
        let text = std::fs::read(self.binding_path(reservation))?;
        serde_json::from_slice(&text).map_err(std::io::Error::other)
    }

    /// Makes the folders agree, at start: finishes the releases a crash cut
    /// short (a tombstone beside a binding), removes every spec without a
    /// binding and writes every one that is missing or not what its binding
    /// says (device nodes of bindings older than specs are taken from
    /// `backend`'s inventory).
    pub fn reconcile(&self, backend: &dyn GpuBackend) -> std::io::Result<Reconciled> {
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Reconciled::default();
        for r in bound_in(&self.dir) {
            if self.tombstone(&r).exists() {
                let _ = std::fs::remove_file(self.preempting_path(&r));
                std::fs::remove_file(self.binding_path(&r))?;
                out.released.push(r);
            }
        }
        let bound = bound_in(&self.dir);
        out.specs_removed = cdi::reconcile(&self.cdi_dir, &bound)?;
        let mut inventory: Option<Vec<Gpu>> = None;
        // Every binding's spec is checked, not only the missing ones: specs
        // are not flushed, so a power cut may have emptied one.
        for r in bound {
            let mut b = self.binding(&r)?;
            for d in b.devices.iter_mut().filter(|d| d.device_nodes.is_empty()) {
                if inventory.is_none() {
                    inventory = Some(backend.inventory().map_err(std::io::Error::other)?);
                }
                if let Some(g) = inventory.iter().flatten().find(|g| g.id == d.uuid) {
                    d.device_nodes = g.device_nodes.clone();
                }
            }
            let spec = self.spec_of(backend, &b);
            if cdi::read(&self.cdi_dir, &r).as_ref() != Some(&spec) {
                cdi::write(&self.cdi_dir, &r, &spec)?;
                out.specs_written.push(r);
            }
        }
        Ok(out)
    }
}

/// The reservations with a binding in `allocations`.
fn bound_in(allocations: &Path) -> BTreeSet<String> {
    std::fs::read_dir(allocations)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_suffix(".json")
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The reservations bound on the node whose data dir is `data_dir`, as
/// `allocation.bind` left them on its disk.
pub fn bound_reservations(data_dir: &Path) -> BTreeSet<String> {
    bound_in(&data_dir.join("allocations"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::FakeGpus;
    use serde_json::json;

    fn setup() -> (tempfile::TempDir, Bindings, FakeGpus) {
        let dir = tempfile::tempdir().unwrap();
        let b = Bindings::new(dir.path(), &dir.path().join("cdi"));
        (dir, b, FakeGpus::parse("8xH100-80GB", "n").unwrap())
    }

    fn spec_of(b: &Bindings, reservation: &str) -> Option<cdi::Spec> {
        let text = std::fs::read(cdi::spec_path(&b.cdi_dir, reservation)).ok()?;
        Some(serde_json::from_slice(&text).unwrap())
    }

    /// Two nodes' bindings in one process do not wait on each other: a
    /// bind whose disk write blocks (its temporary file is a named pipe
    /// nobody reads yet) holds up no other node's bind. Its own node's next
    /// bind waits, as it must.
    #[test]
    fn a_node_whose_disk_blocks_holds_up_no_other_nodes_bind() {
        let (slow_dir, slow, gpus) = setup();
        let (_dir, other, _) = setup();
        std::fs::create_dir_all(&slow.dir).unwrap();
        let pipe = slow.dir.join(".r1.tmp");
        let made = std::process::Command::new("mkfifo")
            .arg(&pipe)
            .status()
            .unwrap();
        assert!(made.success(), "mkfifo");
        let held = slow.lock.clone();
        let blocked = std::thread::spawn(move || {
            let gpus = FakeGpus::parse("8xH100-80GB", "n").unwrap();
            slow.bind(&gpus, &json!({"reservation": "r1", "devices": ["gpu0"]}))
        });
        // Once the first bind holds its node's lock (waiting on its disk),
        // the other node binds.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while held.try_lock().is_ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "the first bind never took its lock"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let out = other.bind(&gpus, &json!({"reservation": "r2", "devices": ["gpu1"]}));
            let _ = tx.send(out);
        });
        let out = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the other node's bind waited on the first node's disk");
        assert!(out.ok, "{out:?}");
        // The disk answers: the pipe is read, and the first bind fails
        // cleanly (a pipe cannot be synced), leaving nothing bound.
        let read = std::fs::read(&pipe).unwrap();
        assert!(!read.is_empty());
        let first = blocked.join().unwrap();
        assert!(!first.ok, "{first:?}");
        assert!(!slow_dir.path().join("allocations/r1.json").exists());
    }

    #[test]
    fn a_bind_writes_the_binding_and_its_spec_and_a_release_removes_both() {
        let (_dir, b, gpus) = setup();
        let out = b.bind(
            &gpus,
            &json!({"reservation": "r~1", "devices": ["GPU-fake-n-2", "gpu5"]}),
        );
        assert!(out.ok, "{out:?}");
        assert_eq!(out.output["cdi_device"], "strata.dev/reservation=r_7E1");
        assert!(out.detail.contains("strata.dev/reservation=r_7E1"));
        let spec = spec_of(&b, "r~1").expect("the spec is written");
        let edits = &spec.devices[0].container_edits;
        assert_eq!(
            edits.env,
            [
                "NVIDIA_VISIBLE_DEVICES=GPU-fake-n-2,GPU-fake-n-5",
                "STRATA_RESERVATION=r~1"
            ]
        );
        let paths: Vec<&str> = edits.device_nodes.iter().map(|n| n.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/dev/nvidia2",
                "/dev/nvidia5",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools"
            ]
        );
        assert!(edits
            .device_nodes
            .iter()
            .all(|n| n.host_path.as_deref() == Some(crate::gpu::FAKE_DEVICE_NODE)));
        assert_eq!(
            bound_reservations(b.dir.parent().unwrap()),
            ["r~1".to_string()].into()
        );

        let released = b.release(&json!({"reservation": "r~1"}));
        assert!(released.ok && released.detail == "released", "{released:?}");
        assert!(spec_of(&b, "r~1").is_none());
        assert!(bound_reservations(b.dir.parent().unwrap()).is_empty());
        let again = b.release(&json!({"reservation": "r~1"}));
        assert!(again.ok && again.detail == "nothing was bound", "{again:?}");
    }

    #[test]
    fn refused_names_and_devices_never_reach_the_file_system() {
        let (dir, b, gpus) = setup();
        for r in ["../x", "", "a/b", ".."] {
            let out = b.bind(&gpus, &json!({"reservation": r, "devices": ["gpu0"]}));
            assert!(!out.ok, "{r:?}: {out:?}");
        }
        let missing = b.bind(&gpus, &json!({"reservation": "r2", "devices": ["gpu9"]}));
        assert!(!missing.ok && missing.detail.contains("not on this node"));
        assert!(!b.dir.exists() && !b.cdi_dir.exists());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "nothing written"
        );
    }

    #[test]
    fn a_failed_acceptance_check_refuses_new_binds_of_what_failed() {
        let (_dir, b, gpus) = setup();
        let report = Arc::new(Mutex::new(Report {
            passed: true,
            reason: String::new(),
            failed_devices: Vec::new(),
            report: serde_json::Value::Null,
        }));
        let b = b.guarded_by(report.clone());
        assert!(
            b.bind(&gpus, &json!({"reservation": "r1", "devices": ["gpu0"]}))
                .ok
        );
        {
            let mut r = report.lock().unwrap();
            r.passed = false;
            r.failed_devices = vec!["GPU-fake-n-1".into()];
        }
        let refused = b.bind(&gpus, &json!({"reservation": "r2", "devices": ["gpu1"]}));
        assert!(
            !refused.ok && refused.detail.contains("GPU-fake-n-1 failed"),
            "{refused:?}"
        );
        assert!(
            b.bind(&gpus, &json!({"reservation": "r3", "devices": ["gpu2"]}))
                .ok
        );
        // The whole node failing refuses every new bind, not one bound here.
        {
            let mut r = report.lock().unwrap();
            r.failed_devices.clear();
            r.reason = "dcgmi diag -r 3 failed".into();
        }
        let refused = b.bind(&gpus, &json!({"reservation": "r4", "devices": ["gpu4"]}));
        assert!(
            !refused.ok && refused.detail.contains("dcgmi diag -r 3 failed"),
            "{refused:?}"
        );
        assert!(
            b.bind(&gpus, &json!({"reservation": "r1", "devices": ["gpu0"]}))
                .ok
        );
    }

    #[test]
    fn a_bind_that_arrives_after_its_release_is_refused() {
        // The daemon runs each command in its own task, so a reservation's
        // release can run before its bind: the bind must not leave a
        // binding behind.
        let (_dir, b, gpus) = setup();
        let release = b.release(&json!({"reservation": "r9"}));
        assert!(release.ok, "{release:?}");
        let bind = b.bind(&gpus, &json!({"reservation": "r9", "devices": ["gpu0"]}));
        assert!(!bind.ok && bind.detail.contains("released"), "{bind:?}");
        assert!(!b.dir.join("r9.json").exists());
        assert!(spec_of(&b, "r9").is_none());
        let other = b.bind(&gpus, &json!({"reservation": "r10", "devices": ["gpu0"]}));
        assert!(other.ok, "{other:?}");
    }

    #[test]
    fn a_spec_that_cannot_be_written_takes_its_binding_back() {
        let (dir, mut b, gpus) = setup();
        let blocker = dir.path().join("not-a-folder");
        std::fs::write(&blocker, b"").unwrap();
        b.cdi_dir = blocker.join("cdi");
        let out = b.bind(&gpus, &json!({"reservation": "r1", "devices": ["gpu0"]}));
        assert!(!out.ok && out.detail.contains("CDI spec"), "{out:?}");
        assert!(bound_reservations(dir.path()).is_empty());
    }

    #[test]
    fn reconcile_finishes_what_a_crash_cut_short() {
        let (_dir, b, gpus) = setup();
        for r in ["a", "b", "c", "d"] {
            assert!(
                b.bind(&gpus, &json!({"reservation": r, "devices": ["gpu0"]}))
                    .ok
            );
        }
        // a: died between the binding and its spec.
        std::fs::remove_file(cdi::spec_path(&b.cdi_dir, "a")).unwrap();
        // b: died in its release, after the tombstone.
        std::fs::write(b.tombstone("b"), b"").unwrap();
        // c: died in its release, after the spec went.
        std::fs::write(b.tombstone("c"), b"").unwrap();
        std::fs::remove_file(cdi::spec_path(&b.cdi_dir, "c")).unwrap();
        // d: a spec a power cut emptied.
        std::fs::write(cdi::spec_path(&b.cdi_dir, "d"), b"").unwrap();
        // e: a spec whose binding never landed.
        let e = cdi::spec("e", &[], &[]);
        cdi::write(&b.cdi_dir, "e", &e).unwrap();
        // An old binding, written before specs, without device nodes.
        std::fs::write(
            b.binding_path("old"),
            json!({"reservation": "old", "devices": [{"id": "gpu3", "uuid": "GPU-fake-n-3", "pci": ""}]}).to_string(),
        )
        .unwrap();

        let r = b.reconcile(&gpus).unwrap();
        assert_eq!(r.released, ["b", "c"]);
        assert_eq!(r.specs_removed, ["b", "e"]);
        assert_eq!(r.specs_written, ["a", "d", "old"]);
        assert_eq!(
            bound_reservations(b.dir.parent().unwrap()),
            ["a", "d", "old"].map(String::from).into()
        );
        for (r, gpu) in [
            ("a", "/dev/nvidia0"),
            ("d", "/dev/nvidia0"),
            ("old", "/dev/nvidia3"),
        ] {
            let s = spec_of(&b, r).unwrap_or_else(|| panic!("{r} has its spec"));
            assert_eq!(s.devices[0].container_edits.device_nodes[0].path, gpu);
        }
        assert_eq!(b.reconcile(&gpus).unwrap(), Reconciled::default());
    }
}
