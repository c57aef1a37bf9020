//! MIG through NVML's C API, which nvml-wrapper does not wrap beyond the
//! mode: listing a GPU's MIG device handles (with their GPU instance and
//! compute instance ids, from which the driver's capability device nodes
//! are found), and splitting a GPU into a layout (enable MIG mode, destroy
//! its instances, create a GPU instance and one compute instance filling it
//! per profile), as `nvidia-smi mig -cgi ... -C` does.
//!
//! The library is opened a second time by the same name nvml-wrapper uses:
//! the dynamic loader hands back the same, already initialized, NVML.
//!
//! The only module of the workspace allowed `unsafe`: every block is one C
//! call with handles NVML gave and plain outputs.
#![allow(unsafe_code)]

use super::GpuError;
use crate::mig::Profile;
use nvml_wrapper::error::nvml_try;
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstance_t, nvmlDevice_t,
    nvmlGpuInstanceProfileInfo_t, nvmlGpuInstance_t, NvmlLib,
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
    NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1, NVML_GPU_INSTANCE_PROFILE_COUNT,
};

/// The raw handle of `d`, for the calls below.
pub(super) fn handle(d: &nvml_wrapper::Device<'_>) -> nvmlDevice_t {
    // SAFETY: the handle is used only while `d`'s NVML lives.
    unsafe { d.handle() }
}

/// A MIG device handle (from [`MigApi::devices`]) as a device of `nvml`,
/// for the wrapper's queries (name, UUID, memory).
pub(super) fn device<'a>(
    handle: nvmlDevice_t,
    nvml: &'a nvml_wrapper::Nvml,
) -> nvml_wrapper::Device<'a> {
    // SAFETY: NVML gave the handle for a GPU of `nvml`; MIG device handles
    // answer the same queries as a GPU's.
    unsafe { nvml_wrapper::Device::new(handle, nvml) }
}

/// The library's name, as nvml-wrapper opens it.
const LIB: &str = "libnvidia-ml.so.1";

/// GPU instances or compute instances one call lists at most.
const MAX_INSTANCES: usize = 16;

pub(super) struct MigApi {
    lib: NvmlLib,
}

/// One MIG device of a GPU: its handle and its GPU and compute instance.
pub(super) struct MigDevice {
    pub handle: nvmlDevice_t,
    pub gpu_instance: u32,
    pub compute_instance: u32,
}

fn err(what: &str, e: nvml_wrapper::error::NvmlError) -> GpuError {
    GpuError::Nvml(format!("{what}: {e}"))
}

/// NVML's name of a GPU instance profile: `<slices>g.<GB>gb`, the memory
/// rounded up, and `+me` for the profiles with the media engines.
fn profile_name(id: u32, info: &nvmlGpuInstanceProfileInfo_t) -> String {
    let gb = info.memorySizeMB.div_ceil(1024);
    let me = matches!(
        id,
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 | NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1
    );
    format!("{}g.{gb}gb{}", info.sliceCount, if me { "+me" } else { "" })
}

/// The compute instance profile that fills a GPU instance of `slices`.
fn compute_profile(slices: u32) -> Option<u32> {
    use nvml_wrapper_sys::bindings::*;
    Some(match slices {
        1 => NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
        2 => NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
        3 => NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        4 => NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
        6 => NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
        7 => NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
        8 => NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
        _ => return None,
    })
}

impl MigApi {
    pub fn open() -> Result<MigApi, GpuError> {
        // SAFETY: loading NVML runs no code beyond its initializers, which
        // nvml-wrapper has already run in this process.
        let lib = unsafe { NvmlLib::new(LIB) }
            .map_err(|e| GpuError::Nvml(format!("load {LIB} for MIG: {e}")))?;
        Ok(MigApi { lib })
    }

    /// Whether MIG mode is on now on `gpu`.
    pub fn enabled(&self, gpu: nvmlDevice_t) -> bool {
        let (mut current, mut pending) = (0u32, 0u32);
        // SAFETY: `gpu` is a live handle; the outputs are plain integers.
        let r = unsafe {
            self.lib
                .nvmlDeviceGetMigMode(gpu, &mut current, &mut pending)
        };
        nvml_try(r).is_ok() && current == 1
    }

    /// The MIG devices of `gpu` (none where MIG is off or unsupported).
    pub fn devices(&self, gpu: nvmlDevice_t) -> Result<Vec<MigDevice>, GpuError> {
        if !self.enabled(gpu) {
            return Ok(Vec::new());
        }
        let mut max = 0u32;
        // SAFETY: as above.
        nvml_try(unsafe { self.lib.nvmlDeviceGetMaxMigDeviceCount(gpu, &mut max) })
            .map_err(|e| err("count MIG devices", e))?;
        let mut out = Vec::new();
        for i in 0..max {
            let mut handle: nvmlDevice_t = std::ptr::null_mut();
            // SAFETY: `handle` receives a handle owned by NVML.
            let r = unsafe {
                self.lib
                    .nvmlDeviceGetMigDeviceHandleByIndex(gpu, i, &mut handle)
            };
            if nvml_try(r).is_err() {
                // An index without a MIG device (NOT_FOUND).
                continue;
            }
            let (mut gi, mut ci) = (0u32, 0u32);
            // SAFETY: `handle` is the MIG device handle just returned.
            nvml_try(unsafe { self.lib.nvmlDeviceGetGpuInstanceId(handle, &mut gi) })
                .map_err(|e| err("GPU instance id", e))?;
            // SAFETY: as above.
            nvml_try(unsafe { self.lib.nvmlDeviceGetComputeInstanceId(handle, &mut ci) })
                .map_err(|e| err("compute instance id", e))?;
            out.push(MigDevice {
                handle,
                gpu_instance: gi,
                compute_instance: ci,
            });
        }
        Ok(out)
    }

    /// Splits `gpu` into `layout`, or turns MIG off for an empty one. MIG
    /// mode changes take a GPU reset on most systems: where one is pending,
    /// the operator is told to reset the GPU and run the command again.
    pub fn apply(&self, gpu: nvmlDevice_t, layout: &[Profile]) -> Result<(), GpuError> {
        if self.enabled(gpu) {
            self.destroy_all(gpu)?;
        }
        let want = u32::from(!layout.is_empty());
        let mut activation = 0;
        // SAFETY: `gpu` is live; `activation` receives a status code.
        let r = unsafe { self.lib.nvmlDeviceSetMigMode(gpu, want, &mut activation) };
        nvml_try(r).map_err(|e| err("set MIG mode", e))?;
        if nvml_try(activation).is_err() || (want == 1) != self.enabled(gpu) {
            return Err(GpuError::Refused(
                "the MIG mode change waits for a GPU reset (nvidia-smi -r); reset the GPU and run the command again".into(),
            ));
        }
        for p in layout {
            self.create(gpu, p)?;
        }
        Ok(())
    }

    /// Creates one GPU instance of profile `p` and a compute instance
    /// filling it.
    fn create(&self, gpu: nvmlDevice_t, p: &Profile) -> Result<(), GpuError> {
        let wanted = p.to_string();
        let mut found = None;
        for id in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            // SAFETY: `info` is a plain C struct NVML fills.
            let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
            let r = unsafe {
                self.lib
                    .nvmlDeviceGetGpuInstanceProfileInfo(gpu, id, &mut info)
            };
            if nvml_try(r).is_ok() && profile_name(id, &info) == wanted {
                found = Some(info.id);
                break;
            }
        }
        let Some(profile) = found else {
            return Err(GpuError::Refused(format!(
                "this GPU has no MIG profile {wanted}"
            )));
        };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: `gi` receives an instance handle owned by NVML.
        nvml_try(unsafe { self.lib.nvmlDeviceCreateGpuInstance(gpu, profile, &mut gi) })
            .map_err(|e| err(&format!("create GPU instance {wanted}"), e))?;
        let ci_profile = compute_profile(p.slices)
            .ok_or_else(|| GpuError::Refused(format!("no compute profile fills {wanted}")))?;
        // SAFETY: as above, for the compute instance's profile.
        let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        nvml_try(unsafe {
            self.lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi,
                ci_profile,
                NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                &mut info,
            )
        })
        .map_err(|e| err("compute instance profile", e))?;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `gi` is the instance just made.
        nvml_try(unsafe {
            self.lib
                .nvmlGpuInstanceCreateComputeInstance(gi, info.id, &mut ci)
        })
        .map_err(|e| err(&format!("create compute instance in {wanted}"), e))
    }

    /// Destroys every compute instance and GPU instance of `gpu`.
    fn destroy_all(&self, gpu: nvmlDevice_t) -> Result<(), GpuError> {
        for profile in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            let mut gis: [nvmlGpuInstance_t; MAX_INSTANCES] = [std::ptr::null_mut(); MAX_INSTANCES];
            let mut n = 0u32;
            // SAFETY: `gis` has room for MAX_INSTANCES handles.
            let r = unsafe {
                self.lib
                    .nvmlDeviceGetGpuInstances(gpu, profile, gis.as_mut_ptr(), &mut n)
            };
            if nvml_try(r).is_err() {
                continue;
            }
            for gi in gis.iter().take((n as usize).min(MAX_INSTANCES)) {
                for ci_profile in 0..8 {
                    let mut cis: [nvmlComputeInstance_t; MAX_INSTANCES] =
                        [std::ptr::null_mut(); MAX_INSTANCES];
                    let mut m = 0u32;
                    // SAFETY: as above, for compute instances.
                    let r = unsafe {
                        self.lib.nvmlGpuInstanceGetComputeInstances(
                            *gi,
                            ci_profile,
                            cis.as_mut_ptr(),
                            &mut m,
                        )
                    };
                    if nvml_try(r).is_err() {
                        continue;
                    }
                    for ci in cis.iter().take((m as usize).min(MAX_INSTANCES)) {
                        // SAFETY: a handle NVML just listed.
                        nvml_try(unsafe { self.lib.nvmlComputeInstanceDestroy(*ci) })
                            .map_err(|e| err("destroy a compute instance (is it in use?)", e))?;
                    }
                }
                // SAFETY: a handle NVML just listed, its compute instances gone.
                nvml_try(unsafe { self.lib.nvmlGpuInstanceDestroy(*gi) })
                    .map_err(|e| err("destroy a GPU instance", e))?;
            }
        }
        Ok(())
    }
}

/// The capability device a MIG GPU instance (`ci: None`) or compute
/// instance of GPU `minor` is reached through: the driver lists its minor
/// number in `/proc/driver/nvidia/capabilities/.../access`.
pub(super) fn capability_node(minor: u32, gi: u32, ci: Option<u32>) -> Option<String> {
    let mut path = format!("/proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{gi}");
    if let Some(ci) = ci {
        path.push_str(&format!("/ci{ci}"));
    }
    path.push_str("/access");
    let text = std::fs::read_to_string(path).ok()?;
    capability_minor(&text).map(|m| format!("/dev/nvidia-caps/nvidia-cap{m}"))
}

/// The `DeviceFileMinor` of a capability's `access` file.
fn capability_minor(text: &str) -> Option<u32> {
    text.lines()
        .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
        .and_then(|m| m.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_names_and_capability_files_read_as_the_driver_writes_them() {
        // SAFETY: a plain C struct.
        let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        info.sliceCount = 1;
        info.memorySizeMB = 9856;
        assert_eq!(profile_name(0, &info), "1g.10gb");
        assert_eq!(
            profile_name(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, &info),
            "1g.10gb+me"
        );
        info.sliceCount = 3;
        info.memorySizeMB = 40192;
        assert_eq!(profile_name(2, &info), "3g.40gb");
        assert_eq!(
            capability_minor("DeviceFileMinor: 21\nDeviceFileMode: 292\nDeviceFileModify: 1\n"),
            Some(21)
        );
        assert_eq!(capability_minor("garbage"), None);
        assert_eq!(compute_profile(5), None);
    }
}
