//! `gpu.mig`: splits one GPU into MIG instances, or makes it whole again,
//! through the backend (NVML, or the fake device set). Refused while
//! anything is bound to the GPU or to one of its instances: the check and
//! the change happen under the bindings' lock, so no bind lands between
//! them. The daemon reports the node's new inventory before the result.

use crate::allocation::Bindings;
use crate::gpu::GpuBackend;
use crate::mig;
use crate::outcome::Outcome;

/// Runs `gpu.mig` with `args` `{"gpu": <index or id>, "profiles": "1g.10gb*7"}`
/// (`"none"` or `""`: MIG off). Answers with the GPU's new instances.
pub fn run(bindings: &Bindings, backend: &dyn GpuBackend, args: &serde_json::Value) -> Outcome {
    let Some(gpu) = args["gpu"].as_str().filter(|g| !g.is_empty()) else {
        return Outcome::failed("gpu.mig needs a gpu (its index or id)");
    };
    let layout = match mig::parse_layout(args["profiles"].as_str().unwrap_or("")) {
        Ok(l) => l,
        Err(e) => return Outcome::failed(e.to_string()),
    };
    let inventory = match backend.inventory() {
        Ok(i) => i,
        Err(e) => return Outcome::failed(e.to_string()),
    };
    let whole: Vec<_> = inventory.iter().filter(|g| g.parent.is_none()).collect();
    let target = gpu
        .parse::<usize>()
        .ok()
        .and_then(|i| whole.get(i).copied())
        .or_else(|| whole.iter().copied().find(|g| g.id == gpu));
    let Some(target) = target else {
        return Outcome::failed(format!("no GPU {gpu} on this node"));
    };
    let id = target.id.clone();
    let family: Vec<&str> = inventory
        .iter()
        .filter(|g| g.id == id || g.parent.as_deref() == Some(id.as_str()))
        .map(|g| g.id.as_str())
        .collect();
    let applied = bindings.holding(|bound| {
        if let Some(b) = bound
            .iter()
            .find(|b| b.devices.iter().any(|d| family.contains(&d.uuid.as_str())))
        {
            return Err(format!(
                "GPU {id} or one of its MIG instances is bound to reservation {}; drain it first",
                b.reservation
            ));
        }
        backend.repartition(&id, &layout).map_err(|e| e.to_string())
    });
    match applied {
        Err(e) => Outcome::failed(format!("read the bindings: {e}")),
        Ok(Err(e)) => Outcome::failed(e),
        Ok(Ok(())) => {
            let instances: Vec<serde_json::Value> = backend
                .inventory()
                .unwrap_or_default()
                .into_iter()
                .filter(|g| g.parent.as_deref() == Some(id.as_str()))
                .map(|g| serde_json::json!({"id": g.id, "class": g.class}))
                .collect();
            Outcome {
                ok: true,
                detail: format!(
                    "GPU {id} is now {}",
                    match layout.len() {
                        0 => "whole (MIG off)".to_string(),
                        n => format!("{n} MIG instances: {}", mig::layout_text(&layout)),
                    }
                ),
                output: serde_json::json!({
                    "gpu": id,
                    "profiles": mig::layout_text(&layout),
                    "instances": instances,
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::FakeGpus;

    #[test]
    fn a_gpu_is_split_only_while_nothing_is_bound_to_it_or_its_instances() {
        let dir = tempfile::tempdir().unwrap();
        let gpus = FakeGpus::parse("2xH100-80GB:mig=1g.10gb*7@0", "n").unwrap();
        let bindings = Bindings::new(dir.path(), &dir.path().join("cdi"));
        let inv = gpus.inventory().unwrap();
        let slice = inv.iter().find(|g| g.parent.is_some()).unwrap().id.clone();
        let bound = bindings.bind(
            &gpus,
            &serde_json::json!({"reservation": "r1", "devices": [slice]}),
        );
        assert!(bound.ok, "{bound:?}");
        // Its GPU cannot be bound whole meanwhile, nor split again.
        let whole = bindings.bind(
            &gpus,
            &serde_json::json!({"reservation": "r2", "devices": [inv[0].id]}),
        );
        assert!(
            !whole.ok
                && whole
                    .detail
                    .contains("MIG relative bound to reservation r1"),
            "{whole:?}"
        );
        let args = serde_json::json!({"gpu": "0", "profiles": "3g.40gb*2"});
        let refused = run(&bindings, &gpus, &args);
        assert!(
            !refused.ok && refused.detail.contains("bound to reservation r1"),
            "{refused:?}"
        );
        // Released, the split goes through; bad layouts and GPUs are refused.
        assert!(
            bindings
                .release(&serde_json::json!({"reservation": "r1"}))
                .ok
        );
        let done = run(&bindings, &gpus, &args);
        assert!(done.ok, "{done:?}");
        assert_eq!(done.output["instances"].as_array().unwrap().len(), 2);
        assert_eq!(done.output["instances"][0]["class"], "H100-80GB/3g.40gb");
        for (args, why) in [
            (
                serde_json::json!({"gpu": "1", "profiles": "4g.40gb*2"}),
                "compute slices",
            ),
            (
                serde_json::json!({"gpu": "7", "profiles": "none"}),
                "no GPU 7",
            ),
            (serde_json::json!({"profiles": "none"}), "needs a gpu"),
            (
                serde_json::json!({"gpu": "1", "profiles": "big"}),
                "invalid MIG profile",
            ),
        ] {
            let o = run(&bindings, &gpus, &args);
            assert!(!o.ok && o.detail.contains(why), "{args}: {o:?}");
        }
        // Whole again.
        let o = run(
            &bindings,
            &gpus,
            &serde_json::json!({"gpu": "0", "profiles": "none"}),
        );
        assert!(o.ok && o.detail.contains("whole"), "{o:?}");
        assert_eq!(gpus.inventory().unwrap().len(), 2);
    }
}
