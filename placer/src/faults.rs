//! The placer's answer to GPU faults: for every fault waiting in a pool it
//! holds (a condition whose action takes a GPU or node out of service, see
//! `domain::faults`), one fact in the next batch, at the pool's version:
//!
//! - `device.quarantined` for a GPU-scoped fault: no new placement on the
//!   GPU, and its live reservation ends (`gpu_fault`) in the batch after;
//! - `node.drained` (with the fault) for a node-scoped one: its live
//!   reservations end (`node_drained`);
//! - `device.quarantine_withheld` when the pool's policy is advisory, or
//!   when acting would take more of the pool out of service for faults than
//!   its circuit breaker allows: the GPU or node stays in service, and the
//!   withheld counter (and its alert) rises;
//! - `device.restored` for a GPU quarantined for a fault a reset clears,
//!   once its condition is gone and a check of its node has passed it
//!   (faults that need service wait for an operator's `clear-health`).
//!
//! Pure: the index in, the facts and their counts out.

use domain::faults::{classify, Policy};
use domain::Fact;
use projections::index::{Pool, Queues};

/// What the placer decided about a pool's waiting faults.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Decisions {
    pub facts: Vec<Fact>,
    pub quarantined: u64,
    pub drained: u64,
    pub withheld: u64,
    pub restored: u64,
}

/// Why a fault is not acted on, or `None` when `cost` more GPUs may go out
/// of service with `out` of `total` out already.
fn withheld_because(policy: &Policy, out: usize, cost: usize, total: usize) -> Option<String> {
    if !policy.automatic {
        return Some("the pool's fault policy is advisory".into());
    }
    let limit = policy.limit(total);
    (out + cost > limit).then(|| {
        format!(
            "circuit breaker open: {out} of {total} GPUs are out of service for faults and this would take {cost} more; the pool allows {} % ({limit})",
            policy.max_quarantined_percent
        )
    })
}

/// The answers to every fault waiting in `pool` (`queues.faulted`).
pub(crate) fn decide(pool: &Pool, queues: &Queues) -> Decisions {
    let mut d = Decisions::default();
    if queues.faulted.is_empty() {
        return d;
    }
    let policy = pool.fault_policy();
    let (total, mut out) = pool.fault_budget();
    for name in &queues.faulted {
        let Some(node) = pool.nodes.get(name).filter(|n| !n.left) else {
            continue;
        };
        if let Some(condition) = &node.fault {
            let cost = node
                .devices
                .iter()
                .filter(|g| g.present && g.quarantine.is_none() && g.spec.parent.is_none())
                .count();
            match withheld_because(&policy, out, cost, total) {
                None => {
                    out += cost;
                    d.drained += 1;
                    d.facts.push(Fact::NodeDrained {
                        node: name.clone(),
                        reason: format!("fault {condition}: {}", classify(condition).meaning),
                        deadline_ms: None,
                        fault: Some(condition.clone()),
                    });
                }
                Some(reason) => {
                    d.withheld += 1;
                    d.facts.push(Fact::DeviceQuarantineWithheld {
                        node: name.clone(),
                        device: None,
                        condition: condition.clone(),
                        reason,
                    });
                }
            }
            // A drained node's GPUs need no quarantine of their own.
            continue;
        }
        for g in node.devices.iter().filter(|g| g.restorable()) {
            let condition = g.quarantine.as_deref().unwrap_or_default();
            d.restored += 1;
            d.facts.push(Fact::DeviceRestored {
                node: name.clone(),
                device: g.spec.id.clone(),
                reason: format!("{condition} is gone and a diagnostic passed"),
            });
        }
        for g in &node.devices {
            let Some(condition) = &g.fault else { continue };
            match withheld_because(&policy, out, 1, total) {
                None => {
                    out += 1;
                    d.quarantined += 1;
                    let class = classify(condition);
                    d.facts.push(Fact::DeviceQuarantined {
                        node: name.clone(),
                        device: g.spec.id.clone(),
                        condition: condition.clone(),
                        action: class.action,
                        reason: class.meaning.into(),
                    });
                }
                Some(reason) => {
                    d.withheld += 1;
                    d.facts.push(Fact::DeviceQuarantineWithheld {
                        node: name.clone(),
                        device: Some(g.spec.id.clone()),
                        condition: condition.clone(),
                        reason,
                    });
                }
            }
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::World;
    use domain::Fact;

    fn raise(node: &str, device: Option<&str>, condition: &str) -> Fact {
        Fact::HealthRaised {
            node: node.into(),
            device: device.map(str::to_string),
            condition: condition.into(),
            detail: String::new(),
            severity: None,
            action: None,
        }
    }

    fn decide_in(w: &World) -> Decisions {
        decide(w.index.pool("p").unwrap(), w.index.queues("p").unwrap())
    }

    fn apply(w: &mut World, f: Fact) {
        assert_eq!(w.pool(&f), None);
    }

    #[test]
    fn gpu_faults_quarantine_the_gpu_node_faults_drain_and_harmless_ones_do_nothing() {
        // 160 GPUs: the breaker allows 16 out.
        let mut w = World::new(20);
        for f in [
            raise("n01", Some("gpu3"), "XID-48"),
            raise("n02", Some("gpu0"), "XID-13"),
            raise("n04", None, "NVML-unavailable"),
        ] {
            apply(&mut w, f);
        }
        let d = decide_in(&w);
        assert_eq!((d.quarantined, d.drained, d.withheld), (1, 1, 0), "{d:?}");
        assert!(
            matches!(&d.facts[0], Fact::DeviceQuarantined { node, device, .. } if node == "n01" && device == "gpu3")
        );
        assert!(
            matches!(&d.facts[1], Fact::NodeDrained { node, fault: Some(f), deadline_ms: None, .. } if node == "n04" && f == "NVML-unavailable")
        );
        // XID-13 keeps its GPU in service.
        let n2 = &w.index.pool("p").unwrap().nodes["n02"];
        assert!(n2.free_devices()[0] && n2.devices[0].conditions == ["XID-13"]);
        // Applied, nothing waits any more.
        for f in d.facts {
            apply(&mut w, f);
        }
        assert_eq!(decide_in(&w), Decisions::default());
        assert_eq!(w.index.pool("p").unwrap().fault_budget(), (160, 9));
    }

    #[test]
    fn a_gpu_quarantined_for_a_reset_comes_back_after_its_condition_goes_and_a_diagnostic_passes() {
        // gpu1 quarantined for a reset's fault, gpu2 for one needing service.
        let quarantined = || {
            let mut w = World::new(2);
            apply(
                &mut w,
                Fact::PoolFaultPolicySet(Policy {
                    automatic: true,
                    max_quarantined_percent: 50,
                }),
            );
            for (device, condition) in [("gpu1", "XID-48"), ("gpu2", "XID-64")] {
                apply(&mut w, raise("n00", Some(device), condition));
            }
            let d = decide_in(&w);
            assert_eq!(d.quarantined, 2);
            for f in d.facts {
                apply(&mut w, f);
            }
            w
        };
        let mut w = quarantined();
        let check = |passed: bool, failed: &[&str]| Fact::NodeAcceptanceReported {
            node: "n00".into(),
            passed,
            reason: String::new(),
            failed_devices: failed.iter().map(|d| d.to_string()).collect(),
            report: serde_json::Value::Null,
        };
        let cleared = |device: &str, condition: &str| Fact::HealthCleared {
            node: "n00".into(),
            device: Some(device.into()),
            condition: condition.into(),
        };
        // A diagnostic passed while the condition is still in force, or the
        // condition gone without one: the quarantine stays.
        apply(&mut w, check(true, &[]));
        assert_eq!(decide_in(&w).restored, 0);
        let mut w = quarantined();
        apply(&mut w, cleared("gpu1", "XID-48"));
        apply(&mut w, cleared("gpu2", "XID-64"));
        assert_eq!(decide_in(&w).restored, 0);
        // A check that fails the GPU does not count; one that passes it does,
        // for the reset's fault only (XID 64 asks for service).
        apply(&mut w, check(false, &["gpu1"]));
        assert_eq!(decide_in(&w).restored, 0);
        apply(&mut w, check(true, &[]));
        let d = decide_in(&w);
        assert_eq!(d.restored, 1, "{d:?}");
        assert!(
            matches!(&d.facts[0], Fact::DeviceRestored { device, reason, .. } if device == "gpu1" && reason.contains("XID-48 is gone"))
        );
        for f in d.facts {
            apply(&mut w, f);
        }
        let n = &w.index.pool("p").unwrap().nodes["n00"];
        assert!(n.free_devices()[1] && !n.free_devices()[2]);
        assert_eq!(decide_in(&w), Decisions::default());
    }

    #[test]
    fn a_flood_of_faults_stops_at_the_circuit_breaker_and_advisory_pools_only_report() {
        let mut w = World::new(10);
        // Every GPU of the pool reports a double-bit ECC error.
        for n in 0..10 {
            for g in 0..8 {
                apply(
                    &mut w,
                    raise(&format!("n{n:02}"), Some(&format!("gpu{g}")), "XID-48"),
                );
            }
        }
        let d = decide_in(&w);
        // 10% of 80.
        assert_eq!((d.quarantined, d.withheld), (8, 72), "{d:?}");
        let why = d
            .facts
            .iter()
            .find_map(|f| match f {
                Fact::DeviceQuarantineWithheld { reason, .. } => Some(reason.clone()),
                _ => None,
            })
            .unwrap();
        assert!(why.contains("circuit breaker open: 8 of 80"), "{why}");
        for f in d.facts {
            apply(&mut w, f);
        }
        // The withheld GPUs stay in service.
        let free: usize = w
            .index
            .pool("p")
            .unwrap()
            .nodes
            .values()
            .map(|n| n.free_devices().into_iter().filter(|f| *f).count())
            .sum();
        assert_eq!(free, 72);

        let mut w = World::new(2);
        apply(
            &mut w,
            Fact::PoolFaultPolicySet(Policy {
                automatic: false,
                max_quarantined_percent: 50,
            }),
        );
        apply(&mut w, raise("n00", Some("gpu1"), "XID-48"));
        let d = decide_in(&w);
        assert_eq!((d.quarantined, d.withheld), (0, 1));
        assert!(
            matches!(&d.facts[0], Fact::DeviceQuarantineWithheld { reason, .. } if reason.contains("advisory"))
        );
    }
}
