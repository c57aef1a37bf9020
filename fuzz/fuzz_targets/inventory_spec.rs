//! The node's inventory parsers on arbitrary text: a fake GPU spec (with
//! its MIG layout) and a MIG layout alone; an inventory made never repeats
//! an id.
#![no_main]
use libfuzzer_sys::fuzz_target;
use node::gpu::GpuBackend;

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = std::str::from_utf8(data) else {
        return;
    };
    let _ = node::mig::parse_layout(spec);
    if let Ok(gpus) = node::gpu::FakeGpus::parse(spec, "n1") {
        let inv = gpus.inventory().unwrap();
        let mut ids: Vec<&str> = inv.iter().map(|g| g.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), inv.len());
    }
});
