//! A node's inventory sections as facts of its pool: `gpus` (its devices,
//! `node.joined`, and its acceptance check, `node.acceptance_reported`,
//! written together), `acceptance` (a re-check's result alone, sent during
//! a session) and `topology` (its rack, block and rail group,
//! `node.topology_set`). Pure: the session writes what this returns.
//!
//! A section travels only when its hash is new to the region (the Hello
//! offers hashes, the Welcome asks for what it has not seen), so a node's
//! labels are written when the node first reports them or changes them;
//! an operator's `strata nodes topology` in between stands until then.

use crate::proto::InventorySection;
use domain::{valid_name, Tier};
use domain::{DeviceSpec, Fact};
use tonic::Status;

/// The section of a re-check's result: never offered in a Hello, so no
/// hash of it is kept.
pub const ACCEPTANCE: &str = "acceptance";

/// The facts that section `section` of node `node` reports, or why the
/// section is refused.
pub fn section_facts(node: &str, section: InventorySection) -> Result<Vec<Fact>, Status> {
    match section.name.as_str() {
        "gpus" => {
            let acceptance = acceptance(node, &section.acceptance_json)?;
            Ok(std::iter::once(devices(node, section)?)
                .chain(acceptance)
                .collect())
        }
        // A re-check's result alone: not a join (a node that left stays
        // out), and its devices are the ones the log has.
        ACCEPTANCE => match acceptance(node, &section.acceptance_json)? {
            Some(fact) => Ok(vec![fact]),
            None => Err(Status::invalid_argument(
                "an acceptance section carries the check's result (acceptance_json)",
            )),
        },
        "topology" => Ok(vec![topology(node, section)?]),
        other => Err(Status::invalid_argument(format!(
            "unknown inventory section {other:?}: gpus, acceptance or topology"
        ))),
    }
}

/// The acceptance check a `gpus` section carries, if any.
fn acceptance(node: &str, json: &str) -> Result<Option<Fact>, Status> {
    if json.is_empty() {
        return Ok(None);
    }
    #[derive(serde::Deserialize)]
    struct Report {
        passed: bool,
        #[serde(default)]
        reason: String,
        #[serde(default)]
        failed_devices: Vec<String>,
        #[serde(default)]
        report: serde_json::Value,
    }
    let r: Report = serde_json::from_str(json)
        .map_err(|e| Status::invalid_argument(format!("acceptance_json: {e}")))?;
    Ok(Some(Fact::NodeAcceptanceReported {
        node: node.to_string(),
        passed: r.passed,
        reason: r.reason,
        failed_devices: r.failed_devices,
        report: r.report,
    }))
}

fn devices(node: &str, section: InventorySection) -> Result<Fact, Status> {
    let mut devices: Vec<DeviceSpec> = Vec::with_capacity(section.devices.len());
    for d in section.devices {
        if d.id.is_empty() || d.class.is_empty() {
            return Err(Status::invalid_argument("a device needs an id and a class"));
        }
        domain::valid_class(&d.class).map_err(Status::invalid_argument)?;
        if devices.iter().any(|e| e.id == d.id) {
            return Err(Status::invalid_argument(format!(
                "device {} is reported twice",
                d.id
            )));
        }
        devices.push(DeviceSpec {
            id: d.id,
            class: d.class,
            memory_mb: d.memory_mb,
            island: (!d.island.is_empty()).then_some(d.island),
            pci: (!d.pci.is_empty()).then_some(d.pci),
            numa: Some(d.numa),
            parent: (!d.parent.is_empty()).then_some(d.parent),
        });
    }
    // A MIG instance names a whole GPU of the same node: the index keeps
    // the two from being booked at once only if it can find the GPU.
    for d in &devices {
        if let Some(p) = &d.parent {
            if !devices.iter().any(|g| &g.id == p && g.parent.is_none()) {
                return Err(Status::invalid_argument(format!(
                    "MIG instance {} names {p}, which is not a whole GPU of this node",
                    d.id
                )));
            }
        }
    }
    Ok(Fact::NodeJoined {
        node: node.to_string(),
        devices,
    })
}

fn topology(node: &str, mut section: InventorySection) -> Result<Fact, Status> {
    if let Some(key) = section.labels.keys().find(|k| Tier::parse(k).is_err()) {
        return Err(Status::invalid_argument(format!(
            "unknown topology label {key:?}: rack, block or rail"
        )));
    }
    let mut take = |tier: Tier| -> Result<Option<String>, Status> {
        match section.labels.remove(tier.name()) {
            Some(v) => {
                valid_name(tier.name(), &v).map_err(Status::invalid_argument)?;
                Ok(Some(v))
            }
            None => Ok(None),
        }
    };
    Ok(Fact::NodeTopologySet {
        node: node.to_string(),
        rack: take(Tier::Rack)?,
        block: take(Tier::Block)?,
        rail: take(Tier::Rail)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn labels(pairs: &[(&str, &str)]) -> InventorySection {
        InventorySection {
            name: "topology".into(),
            hash: "h".into(),
            devices: Vec::new(),
            labels: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>(),
            acceptance_json: String::new(),
        }
    }

    #[test]
    fn a_nodes_labels_become_its_topology_and_bad_ones_are_refused() {
        let facts = section_facts("n1", labels(&[("rack", "r7"), ("rail", "ra")])).unwrap();
        assert_eq!(
            facts,
            [Fact::NodeTopologySet {
                node: "n1".into(),
                rack: Some("r7".into()),
                block: None,
                rail: Some("ra".into()),
            }]
        );
        let err = section_facts("n1", labels(&[("row", "3")])).unwrap_err();
        assert!(
            err.message().contains("unknown topology label \"row\""),
            "{err}"
        );
        let err = section_facts("n1", labels(&[("rack", "a b")])).unwrap_err();
        assert!(
            err.message().contains("may not contain whitespace"),
            "{err}"
        );
        let mut odd = labels(&[]);
        odd.name = "firmware".into();
        assert!(section_facts("n1", odd).is_err());
    }

    #[test]
    fn a_gpus_section_with_its_acceptance_check_is_two_facts_and_a_bad_report_is_refused() {
        let mut gpus = labels(&[]);
        gpus.name = "gpus".into();
        gpus.devices = vec![crate::proto::Device {
            id: "GPU-1".into(),
            class: "H100-80GB".into(),
            ..Default::default()
        }];
        assert_eq!(section_facts("n1", gpus.clone()).unwrap().len(), 1);
        gpus.acceptance_json =
            r#"{"passed":false,"reason":"GPU-1 failed","failed_devices":["GPU-1"]}"#.into();
        let facts = section_facts("n1", gpus.clone()).unwrap();
        assert!(matches!(&facts[0], Fact::NodeJoined { .. }));
        assert!(
            matches!(&facts[1], Fact::NodeAcceptanceReported { passed: false, failed_devices, .. } if failed_devices == &["GPU-1".to_string()])
        );
        // A re-check's result alone is the check alone: no join.
        let mut recheck = labels(&[]);
        recheck.name = ACCEPTANCE.into();
        recheck.acceptance_json = gpus.acceptance_json.clone();
        let facts = section_facts("n1", recheck.clone()).unwrap();
        assert!(
            matches!(
                &facts[..],
                [Fact::NodeAcceptanceReported { passed: false, .. }]
            ),
            "{facts:?}"
        );
        recheck.acceptance_json.clear();
        let err = section_facts("n1", recheck).unwrap_err();
        assert!(err.message().contains("acceptance_json"), "{err}");
        gpus.acceptance_json = "{".into();
        let err = section_facts("n1", gpus).unwrap_err();
        assert!(err.message().contains("acceptance_json"), "{err}");
    }

    mod properties {
        use super::super::section_facts;
        use crate::proto::{node_message, Device, InventorySection, NodeMessage};
        use proptest::prelude::*;
        use prost::Message;

        fn text() -> impl Strategy<Value = String> {
            prop_oneof![
                Just(String::new()),
                Just("gpus".to_string()),
                Just("topology".to_string()),
                Just("rack".to_string()),
                Just("H100-80GB/1g.10gb".to_string()),
                "[a-z0-9./_-]{0,12}",
                any::<String>(),
            ]
        }

        fn device() -> impl Strategy<Value = Device> {
            (
                text(),
                text(),
                any::<u64>(),
                text(),
                text(),
                any::<u32>(),
                text(),
            )
                .prop_map(|(id, class, memory_mb, island, pci, numa, parent)| Device {
                    id,
                    class,
                    memory_mb,
                    island,
                    pci,
                    numa,
                    parent,
                })
        }

        fn section() -> impl Strategy<Value = InventorySection> {
            (
                text(),
                proptest::collection::vec(device(), 0..6),
                proptest::collection::hash_map(text(), text(), 0..4),
                prop_oneof![
                    Just(String::new()),
                    any::<String>(),
                    Just("{\"passed\":true}".into())
                ],
            )
                .prop_map(|(name, devices, labels, acceptance_json)| {
                    InventorySection {
                        name,
                        hash: "h".into(),
                        devices,
                        labels,
                        acceptance_json,
                    }
                })
        }

        proptest! {
            /// A section, however made, becomes facts or a refusal, never a
            /// panic; every fact it becomes is one the pool can fold.
            #[test]
            fn sections_become_facts_or_refusals(node in "[a-z][a-z0-9-]{0,8}", s in section()) {
                if let Ok(facts) = section_facts(&node, s) {
                    for f in facts {
                        let e = f.to_event();
                        let back = domain::Fact::parse(&e.event_type, e.payload.get(), "{}");
                        prop_assert_eq!(back, Ok(Some(f)));
                    }
                }
            }

            /// Bytes off the wire never panic the decoder, and an inventory
            /// section inside them never panics the parser.
            #[test]
            fn wire_bytes_never_panic_the_session(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                if let Ok(NodeMessage { body: Some(node_message::Body::Inventory(s)) }) =
                    NodeMessage::decode(bytes.as_slice())
                {
                    let _ = section_facts("n1", s);
                }
            }

            /// A section encoded and decoded is the same section.
            #[test]
            fn sections_survive_the_wire(s in section()) {
                let m = NodeMessage { body: Some(node_message::Body::Inventory(s)) };
                let again = NodeMessage::decode(m.encode_to_vec().as_slice()).unwrap();
                prop_assert_eq!(m, again);
            }
        }
    }
}
