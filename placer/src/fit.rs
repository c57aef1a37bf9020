//! Where one request fits on the pool index, now: the best-fit node, island
//! or gang for its shape and topology ([`place_one`]), and whether it could
//! ever fit at all ([`never_fits`]). Pure: the batch planner and backfill
//! both ask it, and neither is asked by it.

use domain::{Allocation, Request, Shape};
use projections::index::{ClassIndex, Index};
use std::collections::BTreeMap;

/// Why a request can never fit the pool (counting every present device,
/// whatever its health and bookings), or `None`.
pub fn never_fits(index: &Index, pool: &str, r: &Request) -> Option<String> {
    let Some(c) = index.class(pool, &r.class) else {
        return Some(format!("pool {pool:?} has no {} GPUs", r.class));
    };
    match r.shape {
        Shape::Any if r.gpus as u64 > c.total => Some(format!(
            "asks for {} {} GPUs; the pool has {}",
            r.gpus, r.class, c.total
        )),
        Shape::Node if r.gpus > c.largest_node() => Some(format!(
            "asks for {} {} GPUs on one node; the largest node has {}",
            r.gpus,
            r.class,
            c.largest_node()
        )),
        Shape::Island if r.gpus > c.largest_island() => Some(format!(
            "asks for {} {} GPUs in one NVLink island; the largest island has {}",
            r.gpus,
            r.class,
            c.largest_island()
        )),
        Shape::Gang {
            nodes,
            gpus_per_node,
        } if c.nodes_of_size_at_least(gpus_per_node) < nodes => Some(format!(
            "asks for {nodes} nodes with {gpus_per_node} {} GPUs each; the pool has {}",
            r.class,
            c.nodes_of_size_at_least(gpus_per_node)
        )),
        _ => None,
    }
}

/// Picks `n` free devices of `class` on a node: from the smallest island
/// that holds all of them, else from the largest islands first.
pub(crate) fn pick_on_node(
    index: &Index,
    pool: &str,
    node: &str,
    class: &str,
    n: u32,
) -> Option<Vec<String>> {
    let node_state = index.pool(pool)?.nodes.get(node)?;
    let mut by_island: BTreeMap<Option<&str>, Vec<&str>> = BTreeMap::new();
    let free = node_state.free_devices();
    for (d, free) in node_state.devices.iter().zip(free) {
        if d.spec.class == class && free {
            by_island
                .entry(d.spec.island.as_deref())
                .or_default()
                .push(&d.spec.id);
        }
    }
    let n = n as usize;
    if let Some(devs) = by_island
        .values()
        .filter(|v| v.len() >= n)
        .min_by_key(|v| v.len())
    {
        return Some(devs[..n].iter().map(|s| s.to_string()).collect());
    }
    let mut groups: Vec<&Vec<&str>> = by_island.values().collect();
    groups.sort_by_key(|g| std::cmp::Reverse(g.len()));
    let picked: Vec<String> = groups
        .into_iter()
        .flatten()
        .take(n)
        .map(|s| s.to_string())
        .collect();
    (picked.len() == n).then_some(picked)
}

fn single_node(index: &Index, c: &ClassIndex, pool: &str, r: &Request) -> Option<Vec<Allocation>> {
    let (node, _) = c.nodes_best_fit(r.gpus).next()?;
    let devices = pick_on_node(index, pool, node, &r.class, r.gpus)?;
    Some(vec![Allocation {
        node: node.to_string(),
        devices,
    }])
}

/// Plans one request against the index as it is (nothing is booked).
pub fn place_one(index: &Index, pool: &str, r: &Request) -> Option<Vec<Allocation>> {
    let c = index.class(pool, &r.class)?;
    if (c.free) < r.gpus as u64 {
        return None;
    }
    match r.shape {
        Shape::Node => single_node(index, c, pool, r),
        Shape::Any => {
            if let Some(a) = single_node(index, c, pool, r) {
                return Some(a);
            }
            // Spread over as few nodes as possible: most free first.
            let mut left = r.gpus;
            let mut out = Vec::new();
            for (node, free) in c.nodes_most_free() {
                let take = free.min(left);
                out.push(Allocation {
                    node: node.to_string(),
                    devices: pick_on_node(index, pool, node, &r.class, take)?,
                });
                left -= take;
                if left == 0 {
                    return Some(out);
                }
            }
            None
        }
        Shape::Island => {
            let (island, _) = c.islands_best_fit(r.gpus).next()?;
            let p = index.pool(pool)?;
            let mut per_node: BTreeMap<&str, Vec<String>> = BTreeMap::new();
            for (node, dev) in c.island_free_devices(island).take(r.gpus as usize) {
                let id = &p.nodes.get(node)?.devices.get(dev as usize)?.spec.id;
                per_node.entry(node).or_default().push(id.clone());
            }
            Some(
                per_node
                    .into_iter()
                    .map(|(node, devices)| Allocation {
                        node: node.to_string(),
                        devices,
                    })
                    .collect(),
            )
        }
        Shape::Gang {
            nodes,
            gpus_per_node,
        } => {
            use domain::Topology;
            let (n, g) = (nodes as usize, gpus_per_node);
            let any = || gang_on(index, pool, r, c.nodes_best_fit(g).map(|(x, _)| x), n, g);
            match r.topology {
                None => any(),
                Some(Topology::Within(t)) => {
                    let tier = c.tier(t);
                    let value = tier.best_fit(nodes, g)?;
                    gang_on(index, pool, r, tier.nodes(value, g), n, g)
                }
                Some(Topology::Prefer(t)) => {
                    let tier = c.tier(t);
                    tier.best_fit(nodes, g)
                        .and_then(|value| gang_on(index, pool, r, tier.nodes(value, g), n, g))
                        .or_else(any)
                }
                Some(Topology::Spread(t)) => {
                    let tier = c.tier(t);
                    let one_each = tier
                        .spread(g)
                        .filter_map(|value| tier.nodes(value, g).next());
                    gang_on(index, pool, r, one_each, n, g)
                }
            }
        }
    }
}

/// A gang on the first `n` of `nodes`, `g` devices each, or `None` if there
/// are fewer.
fn gang_on<'a>(
    index: &Index,
    pool: &str,
    r: &Request,
    nodes: impl Iterator<Item = &'a str>,
    n: usize,
    g: u32,
) -> Option<Vec<Allocation>> {
    let mut out = Vec::with_capacity(n);
    for node in nodes.take(n) {
        out.push(Allocation {
            node: node.to_string(),
            devices: pick_on_node(index, pool, node, &r.class, g)?,
        });
    }
    (out.len() == n).then_some(out)
}
