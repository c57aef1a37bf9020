//! The drill's network faults (links cut or degraded in `net.rs`'s
//! namespaces, the processes on both ends left running) and the rack
//! power loss. Each reports `detection_s` (from the fault until the last
//! affected node has a session on another gateway, or the last pool has
//! another placer) and `recovery_s` (a fresh reservation gone the whole
//! way, [`super::scenarios::probe`]); each fault is held for
//! `o.partition`, then healed, and the drill's checker runs after it.

use super::scenarios::{first_after, holder, probe, sessions_by_gateway, spread, unix};
use super::{Options, Region};
use crate::util::round;
use anyhow::{Context, Result};
use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

/// The gateway whose links the faults cut (it runs in a namespace).
pub const GATEWAY: &str = "gw-1";

fn netns(r: &mut Region, role: &str) -> Result<std::sync::Arc<super::net::Netns>> {
    r.role(role)
        .netns
        .clone()
        .with_context(|| format!("{role} runs in no network namespace of its own"))
}

/// Seconds, per node of `nodes`, from `t` until its session was on
/// another gateway than `from`, waiting at most `patience`; nodes still on
/// `from` then are left out (`all_rehomed` says so).
async fn rehomed(
    r: &Region,
    from: &str,
    nodes: &[String],
    t: SystemTime,
    since: Instant,
    patience: Duration,
) -> Result<Vec<f64>> {
    let victims: HashSet<&String> = nodes.iter().collect();
    loop {
        let left = sessions_by_gateway(r)
            .await?
            .get(from)
            .map_or(0, |n| n.iter().filter(|n| victims.contains(n)).count());
        if left == 0 || since.elapsed() > patience {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let still: HashSet<String> = sessions_by_gateway(r)
        .await?
        .remove(from)
        .unwrap_or_default()
        .into_iter()
        .collect();
    let opened = first_after(r, "node.session_opened", t).await?;
    Ok(nodes
        .iter()
        .filter(|n| !still.contains(*n))
        .map(|n| opened.get(n).map_or(0.0, |x| (x - unix(t)).max(0.0)))
        .collect())
}

/// How many of `nodes` were marked lost (`node.session_expired` or
/// `node.contact_lost`) since `t`.
async fn marked_lost(r: &Region, nodes: &[String], t: SystemTime) -> Result<i64> {
    let c = r.client().await?;
    Ok(c.query_one(
        "SELECT count(DISTINCT payload->>'node') FROM strata.events
          WHERE type IN ('node.session_expired', 'node.contact_lost')
            AND recorded_at >= to_timestamp($1) AND payload->>'node' = ANY($2)",
        &[&unix(t), &nodes],
    )
    .await?
    .get(0))
}

/// The holder of `lease` once someone holds it, waiting at most `patience`.
async fn wait_lease(r: &Region, lease: &str, patience: Duration) -> Result<Option<String>> {
    let since = Instant::now();
    loop {
        if let Some(h) = holder(r, lease).await? {
            return Ok(Some(h));
        }
        if since.elapsed() > patience {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits out the rest of the fault's hold, then heals it.
async fn hold_then_heal(ns: &super::net::Netns, o: &Options, cut: Instant) -> Result<Instant> {
    tokio::time::sleep(o.partition.saturating_sub(cut.elapsed())).await;
    ns.heal()?;
    Ok(Instant::now())
}

/// A node-facing fault on [`GATEWAY`]: its nodes, where they went, the
/// probe, and what was marked lost.
async fn gateway_fault(
    r: &mut Region,
    o: &Options,
    moves: bool,
    inject: impl FnOnce(&super::net::Netns) -> Result<()>,
) -> Result<serde_json::Value> {
    let ns = netns(r, GATEWAY)?;
    let nodes = sessions_by_gateway(r)
        .await?
        .remove(GATEWAY)
        .unwrap_or_default();
    let t = SystemTime::now();
    let cut = Instant::now();
    inject(&ns)?;
    // A fault its nodes should leave for: until they have. One they should
    // ride out (a slow link): whoever left by the end of the hold.
    let (mut moved, recovery, healed) = if moves {
        let moved = rehomed(r, GATEWAY, &nodes, t, cut, o.patience).await?;
        let recovery = probe(r, o, &r.pools[0].clone(), cut).await?;
        (moved, recovery, hold_then_heal(&ns, o, cut).await?)
    } else {
        let recovery = probe(r, o, &r.pools[0].clone(), cut).await?;
        tokio::time::sleep(o.partition.saturating_sub(cut.elapsed())).await;
        let moved = rehomed(r, GATEWAY, &nodes, t, cut, Duration::ZERO).await?;
        ns.heal()?;
        (moved, recovery, Instant::now())
    };
    let lost = marked_lost(r, &nodes, t).await?;
    // Healed, the gateway is a gateway again: a node that looks for its
    // home finds it.
    let lease = wait_lease(r, &format!("gateway/{GATEWAY}"), o.patience).await?;
    let all = moved.len() == nodes.len();
    Ok(serde_json::json!({
        "gateway": GATEWAY,
        "sessions_on_it": nodes.len(),
        "rehomed": spread(&mut moved),
        "all_rehomed": all,
        "detection_s": if all { moved.iter().copied().fold(0.0, f64::max) } else { f64::NAN },
        "nodes_marked_lost": lost,
        "recovery_s": recovery,
        "held_s": round(healed.duration_since(cut).as_secs_f64(), 1),
        "lease_back_after_heal_s": lease.map(|_| round(healed.elapsed().as_secs_f64(), 1)),
    }))
}

/// [`GATEWAY`] cut off from PostgreSQL, its nodes still reaching it: it
/// must give its sessions up within its lease, so they move elsewhere.
pub async fn gateway_cut_from_postgres(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let port = r.pg_port();
    gateway_fault(r, o, true, |ns| ns.cut_to_host_port(port)).await
}

/// The nodes on [`GATEWAY`] (a rack behind it) cut off from it; it still
/// reaches PostgreSQL: the nodes notice the silence and move.
pub async fn rack_cut_from_gateway(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let port = r.role(GATEWAY).listen_port()?;
    gateway_fault(r, o, true, |ns| ns.cut_role_port(port)).await
}

/// Every packet between [`GATEWAY`] and the rest (its nodes and
/// PostgreSQL) delayed 500 ms each way (where the kernel has netem), and
/// 2% of them lost: its nodes should stay (no node is lost for a slow
/// link), placements go on.
pub async fn lossy_links(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let delayed = std::sync::atomic::AtomicU32::new(0);
    let mut s = gateway_fault(r, o, false, |ns| {
        delayed.store(ns.degrade(500, 2.0)?, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
    .await?;
    let d = delayed.load(std::sync::atomic::Ordering::Relaxed);
    s["delay_ms_each_way"] = d.into();
    s["loss_pct"] = 2.0.into();
    if d == 0 {
        s["delay_note"] = "this kernel has no netem: packets were lost, not delayed".into();
    }
    Ok(s)
}

/// The placer in a namespace cut off from PostgreSQL while it holds pool
/// leases: the other placer takes them once they lapse, the cut one
/// writes nothing (its writes cannot reach the log, and would be fenced).
pub async fn placer_cut_from_postgres(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let name = r
        .roles
        .iter()
        .find(|x| x.netns.is_some() && x.runs("placer"))
        .map(|x| x.name.clone())
        .context("no placer runs in a network namespace")?;
    let ns = netns(r, &name)?;
    let mut held = Vec::new();
    for p in r.pools.clone() {
        if holder(r, &format!("pool/{p}")).await?.as_deref() == Some(name.as_str()) {
            held.push(p);
        }
    }
    let port = r.pg_port();
    let cut = Instant::now();
    ns.cut_to_host_port(port)?;
    // Until every pool it held has another holder.
    let mut taken = Vec::new();
    for p in &held {
        loop {
            match holder(r, &format!("pool/{p}")).await? {
                Some(h) if h != name => {
                    taken.push(cut.elapsed().as_secs_f64());
                    break;
                }
                _ if cut.elapsed() > o.patience => break,
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
    let pool = held.first().cloned().unwrap_or_else(|| r.pools[0].clone());
    let recovery = probe(r, o, &pool, cut).await?;
    let healed = hold_then_heal(&ns, o, cut).await?;
    let all = taken.len() == held.len();
    Ok(serde_json::json!({
        "placer": name,
        "pools_held": held,
        "taken_over": spread(&mut taken.clone()),
        "detection_s": if all { taken.iter().copied().fold(0.0, f64::max) } else { f64::NAN },
        "recovery_s": recovery,
        "held_s": round(healed.duration_since(cut).as_secs_f64(), 1),
    }))
}

/// A rack loses power: the gateway with the most sessions is killed
/// (SIGKILL) together with every node on it, once every node holds a
/// reservation that does not end by itself (a pin). Until every GPU of
/// those nodes is free again (no live allocation on them in the log),
/// against the target of the placers' lost-node bound plus 10 s; then the
/// pins are released and the nodes and the gateway come back.
pub async fn rack_power_loss(r: &mut Region, o: &Options) -> Result<serde_json::Value> {
    let (victim, nodes) = sessions_by_gateway(r)
        .await?
        .into_iter()
        .max_by_key(|(_, n)| n.len())
        .unwrap_or_default();
    let which = r.fleet.indexes(&nodes);
    // The load's reservations end within seconds by themselves: whole-node
    // reservations that never end (pins) fill the pools first, so what
    // frees the victims' GPUs is the lost-node bound, not their owners.
    let pins = pin_every_node(r).await?;
    let pinned_by = Instant::now() + Duration::from_secs(30);
    let mut placements = replay::invariants::Placements::default();
    let c = r.client().await?;
    while busy(&c, &mut placements, &nodes).await? < nodes.len() && Instant::now() < pinned_by {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let t = SystemTime::now();
    let cut = Instant::now();
    let (gateway, fleet) = (&mut r.roles, &mut r.fleet);
    let role = gateway
        .iter_mut()
        .find(|x| x.name == victim)
        .context("the victim gateway is a role of the region")?;
    tokio::join!(role.kill(), fleet.stop_these(&which));
    let booked_at_cut = busy(&c, &mut placements, &nodes).await?;
    let mut freed = None;
    let mut marked = None;
    while cut.elapsed() < o.patience + o.node_lost_after {
        if marked.is_none() && marked_lost(r, &nodes, t).await? as usize == nodes.len() {
            marked = Some(round(cut.elapsed().as_secs_f64(), 1));
        }
        if busy(&c, &mut placements, &nodes).await? == 0 {
            freed = Some(round(cut.elapsed().as_secs_f64(), 1));
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The pins go (the probe needs room), then the rack comes back.
    {
        use futures_util::{StreamExt, TryStreamExt};
        let releases: Vec<_> = pins
            .iter()
            .map(|id| {
                let (appender, id) = (r.appender.clone(), id.clone());
                async move {
                    domain::requests::release(&appender, &id, "drill", None)
                        .await
                        .with_context(|| format!("release pin {id}"))
                }
            })
            .collect();
        futures_util::stream::iter(releases)
            .buffer_unordered(PINS_AT_ONCE)
            .try_collect::<Vec<_>>()
            .await?;
    }
    let recovery = probe(r, o, &r.pools[0].clone(), cut).await?;
    r.restart(&victim).await?;
    r.fleet.start_these(&which);
    let bound = o.node_lost_after.as_secs_f64();
    Ok(serde_json::json!({
        "gateway": victim,
        "nodes": nodes.len(),
        "gpus": nodes.len() * 8,
        "nodes_with_allocations_at_cut": booked_at_cut,
        "pins": pins.len(),
        "all_marked_lost_s": marked,
        "gpus_free_s": freed,
        "node_lost_after_s": bound,
        "target_s": bound + 10.0,
        "met": freed.is_some_and(|f| f < bound + 10.0),
        "recovery_s": recovery,
    }))
}

/// How many of `nodes` the log still has live allocations on, folding
/// into `placements` what was appended since it last looked.
async fn busy(
    c: &tokio_postgres::Client,
    placements: &mut replay::invariants::Placements,
    nodes: &[String],
) -> Result<usize> {
    placements.catch_up(c).await?;
    let live = placements.live();
    Ok(nodes
        .iter()
        .filter(|n| live.get(*n).is_some_and(|s| !s.is_empty()))
        .count())
}

/// As many whole-node reservations without an end as each pool has nodes,
/// so every node that frees is taken; their ids.
async fn pin_every_node(r: &Region) -> Result<Vec<String>> {
    use futures_util::{StreamExt, TryStreamExt};
    let pins: Vec<_> = r
        .fleet
        .nodes
        .iter()
        .map(|n| {
            let (appender, id) = (
                r.appender.clone(),
                format!("pin-{:016x}", fastrand::u64(..)),
            );
            let request = domain::Request {
                reservation: id.clone(),
                pool: n.pool.clone(),
                class: super::fleet::CLASS.into(),
                gpus: 8,
                shape: domain::Shape::Node,
                priority: 0,
                ttl_ms: None,
                replace_on_failure: false,
                replaces: None,
                topology: None,
                requeue_on_preemption: false,
                start_ms: None,
                queue: None,
            };
            async move {
                appender
                    .append(
                        &domain::reservation_stream(&id),
                        events::ExpectedVersion::NoStream,
                        vec![domain::Fact::ReservationRequested(request).to_event()],
                    )
                    .await?;
                anyhow::Ok(id)
            }
        })
        .collect();
    // Many at once: one by one, each waiting for its commit on a busy
    // region, 10,000 pins took hours.
    futures_util::stream::iter(pins)
        .buffer_unordered(PINS_AT_ONCE)
        .try_collect()
        .await
}

/// Pins appended or released at once.
const PINS_AT_ONCE: usize = 256;
