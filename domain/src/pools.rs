//! A pool's own writes: creating it, setting its fault policy, and nodes joining it or labelled with
//! their place in its topology in bulk (simulated fleets: `strata pool
//! seed`, `strata dev`, tests and benchmarks; a real node joins through its
//! gateway). Each is appended here and nowhere else.

use crate::error::RequestError;
use crate::{pool_stream, stored_types, valid_name, DeviceSpec, Fact};
use events::db::Sql;
use events::{AppendError, Appender, ExpectedVersion};

/// Whether a pool has been created.
pub async fn pool_exists(
    client: &tokio_postgres::Client,
    pool: &str,
) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .opt(
            "SELECT 1 FROM strata.events WHERE stream = $1 AND version = 1 AND type = ANY($2)",
            &[&pool_stream(pool), &stored_types("pool.created")],
        )
        .await?
        .is_some())
}

/// Appends to a pool that exists (refused with `NoSuchPool` if not).
async fn append_to_pool(
    appender: &Appender,
    pool: &str,
    events: Vec<events::NewEvent>,
) -> Result<(), RequestError> {
    appender
        .append(&pool_stream(pool), ExpectedVersion::StreamExists, events)
        .await
        .map_err(|e| match e {
            AppendError::VersionConflict { .. } => RequestError::NoSuchPool(pool.to_string()),
            e => RequestError::Append(e),
        })?;
    Ok(())
}

/// Creates a pool.
pub async fn create_pool(
    appender: &Appender,
    pool: &str,
    description: &str,
) -> Result<(), RequestError> {
    valid_name("pool", pool).map_err(RequestError::Invalid)?;
    let fact = Fact::PoolCreated {
        description: description.to_string(),
    };
    match appender
        .append(
            &pool_stream(pool),
            ExpectedVersion::NoStream,
            vec![fact.to_event()],
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(AppendError::VersionConflict { .. }) => Err(RequestError::PoolExists(pool.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// Sets how the pool's placer acts on GPU faults (`pool.fault_policy_set`),
/// recording `metadata` (who asked).
pub async fn set_fault_policy(
    appender: &Appender,
    pool: &str,
    policy: crate::faults::Policy,
    metadata: Option<&serde_json::Value>,
) -> Result<(), RequestError> {
    if policy.max_quarantined_percent > 100 {
        return Err(RequestError::Invalid(format!(
            "the circuit breaker is a percentage of the pool, 0 to 100, not {}",
            policy.max_quarantined_percent
        )));
    }
    let mut event = Fact::PoolFaultPolicySet(policy).to_event();
    if let Some(m) = metadata {
        event = event.with_metadata(m);
    }
    append_to_pool(appender, pool, vec![event]).await
}

/// Turns the pool's preemption on or off (`pool.preemption_set`),
/// recording `metadata` (who asked).
pub async fn set_preemption(
    appender: &Appender,
    pool: &str,
    enabled: bool,
    metadata: Option<&serde_json::Value>,
) -> Result<(), RequestError> {
    let mut event = Fact::PoolPreemptionSet { enabled }.to_event();
    if let Some(m) = metadata {
        event = event.with_metadata(m);
    }
    append_to_pool(appender, pool, vec![event]).await
}

/// Nodes joining a pool with their inventory, appended in chunks (each chunk
/// one transaction); `progress` hears the count so far.
pub async fn join_nodes(
    appender: &Appender,
    pool: &str,
    nodes: Vec<(String, Vec<DeviceSpec>)>,
    mut progress: impl FnMut(usize),
) -> Result<usize, RequestError> {
    let mut done = 0;
    for chunk in nodes.chunks(500) {
        let mut events = Vec::with_capacity(chunk.len());
        for (node, devices) in chunk {
            valid_name("node", node).map_err(RequestError::Invalid)?;
            events.push(
                Fact::NodeJoined {
                    node: node.clone(),
                    devices: devices.clone(),
                }
                .to_event(),
            );
        }
        append_to_pool(appender, pool, events).await?;
        done += chunk.len();
        progress(done);
    }
    Ok(done)
}

/// Labels nodes of a pool with their rack and block
/// (`node.topology_set`), in chunks.
pub async fn label_nodes(
    appender: &Appender,
    pool: &str,
    labels: Vec<(String, Option<String>, Option<String>)>,
) -> Result<usize, RequestError> {
    let mut done = 0;
    for chunk in labels.chunks(500) {
        let events = chunk
            .iter()
            .map(|(node, rack, block)| {
                Fact::NodeTopologySet {
                    node: node.clone(),
                    rack: rack.clone(),
                    block: block.clone(),
                    rail: None,
                }
                .to_event()
            })
            .collect();
        append_to_pool(appender, pool, events).await?;
        done += chunk.len();
    }
    Ok(done)
}

/// A uniform fleet for demos, tests and benchmarks: `nodes` nodes named
/// `{prefix}{i}` with `gpus` GPUs of `class`, `per_island` to an NVLink
/// island.
pub fn uniform_fleet(
    prefix: &str,
    nodes: u32,
    class: &str,
    gpus: u32,
    per_island: u32,
) -> Vec<(String, Vec<DeviceSpec>)> {
    (0..nodes)
        .map(|i| {
            let node = format!("{prefix}{i:05}");
            let devices = devices(&node, class, gpus, per_island);
            (node, devices)
        })
        .collect()
}

/// `n` devices of a class on a node, `per_island` to an island (islands are
/// named after the node).
pub fn devices(node: &str, class: &str, n: u32, per_island: u32) -> Vec<DeviceSpec> {
    (0..n)
        .map(|i| DeviceSpec {
            id: format!("gpu{i}"),
            class: class.to_string(),
            memory_mb: 81_920,
            island: (per_island > 0).then(|| format!("{node}/nvl{}", i / per_island)),
            pci: Some(format!("0000:{:02x}:00.0", 0x18 + i)),
            numa: Some(i / 4),
            parent: None,
        })
        .collect()
}

/// `per_gpu` MIG instances of `profile` on each of the first `gpus` GPUs of
/// `devices` (whole GPUs made by [`devices`]): `gpu<i>.mig<k>`, of class
/// `<gpu class>/<profile>`, without an island.
pub fn split_mig(devices: &mut Vec<DeviceSpec>, gpus: usize, profile: &str, per_gpu: u32) {
    let whole: Vec<DeviceSpec> = devices
        .iter()
        .filter(|d| d.parent.is_none())
        .take(gpus)
        .cloned()
        .collect();
    for g in whole {
        for k in 0..per_gpu {
            devices.push(DeviceSpec {
                id: format!("{}.mig{k}", g.id),
                class: crate::mig_class(&g.class, profile),
                memory_mb: g.memory_mb / u64::from(per_gpu.max(1)),
                island: None,
                pci: g.pci.clone(),
                numa: g.numa,
                parent: Some(g.id.clone()),
            });
        }
    }
}
