//! `bench placements`, the backfill phase: gangs of whole nodes waiting in
//! a pool full of small reservations with TTLs, once alone (the baseline:
//! they start as the TTLs free whole nodes) and once with a stream of
//! small requests arriving as fast as GPUs free, on a pool of their own
//! each. Without backfill the stream takes every GPU as it frees and no
//! node is ever whole again; with it, the gangs start as they do alone.
//!
//! Then a reservation in advance for a whole pool ([`AHEAD`]) 10 s ahead,
//! with a stream of short requests before it: backfill lends them its
//! devices only while they end before its start, and it is placed at its
//! start.

use crate::util::percentile_ms;
use anyhow::Result;
use domain::{Request, Shape};
use events::Appender;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{flood, offer, Seen};

/// The pools of the two rounds.
pub const QUIET: &str = "backfill-quiet";
pub const CONTENDED: &str = "backfill-contended";
pub const AHEAD: &str = "backfill-ahead";
/// Most nodes of [`AHEAD`]: one reservation may ask for 4,096 GPUs.
pub const AHEAD_MAX_NODES: u32 = domain::MAX_GPUS / 8;
/// How far ahead the reservation in advance starts.
const AHEAD_START: Duration = Duration::from_secs(10);
/// The short requests' time to live, before it.
const SHORT_TTL_MS: u64 = 1_000;
/// Gangs per round: as many as the placer guards in one batch
/// (`placer::backfill::MAX_HOLDS`).
pub const GANGS: u32 = 8;
/// Nodes per gang, all 8 GPUs of each.
pub const GANG_NODES: u32 = 4;
/// The fill's TTLs: uniform in this range (ms).
const FILL_TTL_MS: (u64, u64) = (2_000, 6_000);
/// The stream's requests hold their GPU this long (past every gang's start).
const STREAM_TTL_MS: u64 = 60_000;
/// How long a round waits for its gangs.
const PATIENCE: Duration = Duration::from_secs(60);

/// One round: the gangs' waits, and the stream's requests.
pub struct Round {
    /// Request to placement seen, per gang; a gang not placed within the
    /// round's patience counts as the patience.
    pub waits: Vec<Duration>,
    pub placed_gangs: usize,
    pub stream_offered: u64,
    pub stream_placed: u64,
    pub secs: f64,
}

/// Both rounds.
pub struct Backfill {
    pub nodes: u32,
    pub stream_rate: u32,
    pub quiet: Round,
    pub contended: Round,
}

fn request(id: String, pool: &str, gpus: u32, shape: Shape, ttl_ms: Option<u64>) -> Request {
    Request {
        ttl_ms,
        ..super::request(id, pool, gpus, shape)
    }
}

async fn round(
    appender: &Appender,
    seen: &Arc<Seen>,
    pool: &str,
    nodes: u32,
    clients: usize,
    stream_rate: Option<u32>,
) -> Result<Round> {
    // Every GPU booked by a 1-GPU reservation whose TTL ends in 2 to 6 s.
    let mut rng = fastrand::Rng::with_seed(7);
    let fill: Vec<Request> = (0..nodes as u64 * 8)
        .map(|i| {
            let ttl = rng.u64(FILL_TTL_MS.0..FILL_TTL_MS.1);
            request(format!("{pool}-f{i}"), pool, 1, Shape::Any, Some(ttl))
        })
        .collect();
    flood(appender, seen, fill, clients).await?;
    // The gangs, then (contended) the stream until they are all placed.
    let t0 = Instant::now();
    let mut sent = Vec::new();
    for g in 0..GANGS {
        let r = request(
            format!("{pool}-g{g}"),
            pool,
            GANG_NODES * 8,
            Shape::Gang {
                nodes: GANG_NODES,
                gpus_per_node: 8,
            },
            None,
        );
        offer(appender, &r).await?;
        sent.push((r.reservation, Instant::now()));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let offered = Arc::new(AtomicU64::new(0));
    let stream = stream_rate.map(|rate| {
        let (appender, pool, stop, offered) = (
            appender.clone(),
            pool.to_string(),
            stop.clone(),
            offered.clone(),
        );
        tokio::spawn(async move {
            let start = Instant::now();
            let mut i = 0u64;
            let mut sends = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let at = start + Duration::from_secs_f64(i as f64 / rate as f64);
                tokio::time::sleep_until(at.into()).await;
                let r = request(
                    format!("{pool}-s{i}"),
                    &pool,
                    1,
                    Shape::Any,
                    Some(STREAM_TTL_MS),
                );
                let (appender, offered) = (appender.clone(), offered.clone());
                sends.push(tokio::spawn(async move {
                    offer(&appender, &r).await?;
                    offered.fetch_add(1, Ordering::Relaxed);
                    anyhow::Ok(())
                }));
                i += 1;
            }
            for s in sends {
                s.await??;
            }
            anyhow::Ok(i)
        })
    });
    let deadline = t0 + PATIENCE;
    let mut waits: Vec<Option<Duration>> = vec![None; sent.len()];
    while Instant::now() < deadline && waits.iter().any(Option::is_none) {
        {
            let at = seen.at.lock().expect("seen lock");
            for (w, (id, sent)) in waits.iter_mut().zip(&sent) {
                if w.is_none() {
                    *w = at
                        .get(id)
                        .map(|placed| placed.saturating_duration_since(*sent));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let streamed = match stream {
        Some(s) => s.await??,
        None => 0,
    };
    let stream_placed = {
        let at = seen.at.lock().expect("seen lock");
        (0..streamed)
            .filter(|i| at.contains_key(&format!("{pool}-s{i}")))
            .count() as u64
    };
    let placed_gangs = waits.iter().flatten().count();
    Ok(Round {
        waits: waits.into_iter().map(|w| w.unwrap_or(PATIENCE)).collect(),
        placed_gangs,
        stream_offered: offered.load(Ordering::Relaxed),
        stream_placed,
        secs,
    })
}

/// The round of the reservation in advance.
pub struct Ahead {
    pub nodes: u32,
    pub gpus: u32,
    /// Its placement seen, after its start (negative: before).
    pub late_ms: f64,
    pub stream_offered: u64,
    pub stream_placed: u64,
}

/// [`AHEAD`], `nodes` nodes full of 1-GPU reservations (TTL 2-6 s): the
/// whole pool asked for from 10 s from now, while 1-GPU requests of TTL
/// 1 s arrive as fast as the fill frees GPUs until its start.
pub async fn ahead(
    appender: &Appender,
    seen: &Arc<Seen>,
    nodes: u32,
    clients: usize,
) -> Result<Ahead> {
    let mut rng = fastrand::Rng::with_seed(11);
    let fill: Vec<Request> = (0..nodes as u64 * 8)
        .map(|i| {
            let ttl = rng.u64(FILL_TTL_MS.0..FILL_TTL_MS.1);
            request(format!("{AHEAD}-f{i}"), AHEAD, 1, Shape::Any, Some(ttl))
        })
        .collect();
    flood(appender, seen, fill, clients).await?;
    let start = std::time::SystemTime::now() + AHEAD_START;
    let start_at = Instant::now() + AHEAD_START;
    let gpus = nodes * 8;
    let whole = Request {
        start_ms: Some(
            start
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        ),
        ..request(
            format!("{AHEAD}-whole"),
            AHEAD,
            gpus,
            Shape::Any,
            Some(30_000),
        )
    };
    offer(appender, &whole).await?;
    // Short requests until its start, as fast as the fill frees GPUs.
    let mean_ttl_s = (FILL_TTL_MS.0 + FILL_TTL_MS.1) as f64 / 2_000.0;
    let rate = (gpus as f64 / mean_ttl_s).ceil();
    let t0 = Instant::now();
    let mut offered = 0u64;
    while Instant::now() < start_at {
        let at = t0 + Duration::from_secs_f64(offered as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let r = request(
            format!("{AHEAD}-s{offered}"),
            AHEAD,
            1,
            Shape::Any,
            Some(SHORT_TTL_MS),
        );
        offer(appender, &r).await?;
        offered += 1;
    }
    let deadline = start_at + PATIENCE;
    let placed = loop {
        if let Some(at) = seen.at.lock().expect("seen lock").get(&whole.reservation) {
            break Some(*at);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let late_ms = match placed {
        Some(at) if at >= start_at => at.duration_since(start_at).as_secs_f64() * 1000.0,
        Some(at) => -(start_at.duration_since(at).as_secs_f64() * 1000.0),
        None => PATIENCE.as_secs_f64() * 1000.0,
    };
    let stream_placed = {
        let at = seen.at.lock().expect("seen lock");
        (0..offered)
            .filter(|i| at.contains_key(&format!("{AHEAD}-s{i}")))
            .count() as u64
    };
    eprintln!(
        "backfill: {nodes} nodes, the whole pool ({gpus} GPUs) in advance 10 s ahead: placed {late_ms:.0} ms after its start; {stream_placed} of {offered} 1-GPU requests (TTL 1 s) placed before it"
    );
    Ok(Ahead {
        nodes,
        gpus,
        late_ms,
        stream_offered: offered,
        stream_placed,
    })
}

/// Runs both rounds, on the pools [`QUIET`] and [`CONTENDED`] of `nodes`
/// nodes each (created and held by the placer already). The stream offers
/// as many requests a second as the fill's TTLs free GPUs.
pub async fn run(
    appender: &Appender,
    seen: &Arc<Seen>,
    nodes: u32,
    clients: usize,
) -> Result<Backfill> {
    let mean_ttl_s = (FILL_TTL_MS.0 + FILL_TTL_MS.1) as f64 / 2_000.0;
    let stream_rate = (nodes as f64 * 8.0 / mean_ttl_s).ceil() as u32;
    let quiet = round(appender, seen, QUIET, nodes, clients, None).await?;
    let contended = round(appender, seen, CONTENDED, nodes, clients, Some(stream_rate)).await?;
    let show = |r: &Round| {
        let mut w = r.waits.clone();
        format!(
            "{} of {GANGS} gangs placed, wait p50 {:.0} ms, max {:.0} ms",
            r.placed_gangs,
            percentile_ms(&mut w, 0.5),
            percentile_ms(&mut w, 1.0)
        )
    };
    eprintln!(
        "backfill: {nodes} nodes full of 1-GPU reservations (TTL 2-6 s), {GANGS} gangs of {GANG_NODES}x8: alone {}; with {stream_rate}/s 1-GPU requests (TTL 60 s) arriving: {}, {} of {} of them placed meanwhile",
        show(&quiet),
        show(&contended),
        contended.stream_placed,
        contended.stream_offered
    );
    Ok(Backfill {
        nodes,
        stream_rate,
        quiet,
        contended,
    })
}
