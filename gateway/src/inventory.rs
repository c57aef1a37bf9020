//! A node's inventory sections as facts of its pool: `gpus` (its devices,
//! `node.joined`) and `topology` (its rack, block and rail group,
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

/// The fact that section `section` of node `node` reports, or why the
/// section is refused.
pub fn section_fact(node: &str, section: InventorySection) -> Result<Fact, Status> {
    match section.name.as_str() {
        "gpus" => devices(node, section),
        "topology" => topology(node, section),
        other => Err(Status::invalid_argument(format!(
            "unknown inventory section {other:?}: gpus or topology"
        ))),
    }
}

fn devices(node: &str, section: InventorySection) -> Result<Fact, Status> {
    let mut devices = Vec::with_capacity(section.devices.len());
    for d in section.devices {
        if d.id.is_empty() || d.class.is_empty() {
            return Err(Status::invalid_argument("a device needs an id and a class"));
        }
        devices.push(DeviceSpec {
            id: d.id,
            class: d.class,
            memory_mb: d.memory_mb,
            island: (!d.island.is_empty()).then_some(d.island),
            pci: (!d.pci.is_empty()).then_some(d.pci),
            numa: Some(d.numa),
        });
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
        }
    }

    #[test]
    fn a_nodes_labels_become_its_topology_and_bad_ones_are_refused() {
        let fact = section_fact("n1", labels(&[("rack", "r7"), ("rail", "ra")])).unwrap();
        assert_eq!(
            fact,
            Fact::NodeTopologySet {
                node: "n1".into(),
                rack: Some("r7".into()),
                block: None,
                rail: Some("ra".into()),
            }
        );
        let err = section_fact("n1", labels(&[("row", "3")])).unwrap_err();
        assert!(
            err.message().contains("unknown topology label \"row\""),
            "{err}"
        );
        let err = section_fact("n1", labels(&[("rack", "a b")])).unwrap_err();
        assert!(
            err.message().contains("may not contain whitespace"),
            "{err}"
        );
        let mut odd = labels(&[]);
        odd.name = "firmware".into();
        assert!(section_fact("n1", odd).is_err());
    }
}
