//! Which new connections get a TLS handshake while connections without a
//! certificate crowd the gateway.
//!
//! A handshake costs the gateway a signature and a key exchange, the most
//! expensive thing a stranger can make it do, and nothing tells a stalled
//! or garbage join from a real one before it. So while the share of
//! connections without a certificate is *pressed* (it was full within the
//! last [`PRESSURE_MS`]), connections from addresses the gateway has not
//! seen present a client certificate get handshakes only at
//! `--unknown-handshakes-per-second` in all and [`PER_SOURCE_PER_S`] each
//! (so one busy address cannot spend the others' turns), and addresses
//! *suspected* in the last [`SUSPECT_MS`] (one of their RPCs stalled until
//! it was evicted or cut at its deadline, or they offered a join token the
//! region never issued) get none; the rest are closed at accept, which
//! costs neither side a handshake, and a daemon tries again after its
//! backoff. A flood from many addresses so spends each address once. Addresses that presented a certificate (the fleet's nodes,
//! operators) are never held back, and with no pressure nobody is: a
//! fleet re-homing onto this gateway after another died is not slowed.
//! A joining node names its token in its ClientHello
//! ([`ops::join_alpn`]): a stranger held back has its ClientHello read
//! (no cryptography; at most [`MAX_HELLO_READS`] at once, each within
//! [`HELLO_READ`]) and gets its handshake if it names a token the region
//! issued, [`PER_SOURCE_PER_S`] a second per token, whatever the
//! strangers' bucket holds: a flood that knows no token cannot spend a
//! real node's turn.
//! This is a priority of service, not a guarantee: what a connection may
//! do is still decided by its certificate and its token.

use crate::bucket::{Bucket, Buckets};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// How long the share counts as pressed after it was last full.
pub(crate) const PRESSURE_MS: u64 = 5_000;

/// How long an address stays suspected after its last offence.
pub(crate) const SUSPECT_MS: u64 = 60_000;

/// Handshakes a second one unknown address gets while pressed (bursts of
/// [`PER_SOURCE_BURST`]).
pub(crate) const PER_SOURCE_PER_S: f64 = 1.0;
const PER_SOURCE_BURST: f64 = 3.0;

/// ClientHellos of held-back strangers read at once, at most; past it they
/// are closed at accept unread.
pub(crate) const MAX_HELLO_READS: usize = 512;

/// How long a held-back stranger's ClientHello may take to arrive.
pub(crate) const HELLO_READ: std::time::Duration = std::time::Duration::from_secs(1);

/// Addresses remembered at most, known and suspected each; past it, known
/// ones not seen for an hour and suspects past their time are forgotten,
/// and if none were, no new one is remembered until some are.
const MAX_KNOWN: usize = 262_144;

/// Forgotten when the table is full and they were last seen this long ago.
const KNOWN_FOR_MS: u64 = 3_600_000;

/// The gate in front of the TLS handshake.
pub(crate) struct HandshakeGate {
    /// What `now_ms` counts from.
    epoch: Instant,
    /// Addresses that presented a client certificate, with when they last
    /// did (milliseconds on `epoch`).
    known: Mutex<HashMap<IpAddr, u64>>,
    /// Suspected addresses, with until when.
    suspects: Mutex<HashMap<IpAddr, u64>>,
    /// Until when the share counts as pressed (milliseconds; 0: never was).
    pressed_until_ms: AtomicU64,
    /// Handshakes for unknown addresses while pressed: all of them, and
    /// each.
    bucket: Mutex<Bucket>,
    per_source: Buckets<IpAddr>,
    /// Handshakes of held-back strangers that named a join token, per token.
    per_token: Buckets<Vec<u8>>,
    per_second: f64,
}

impl HandshakeGate {
    /// A gate letting `per_second` handshakes (bursts of as many) from
    /// unknown addresses through while pressed.
    pub(crate) fn new(per_second: f64) -> HandshakeGate {
        let per_second = per_second.max(0.1);
        HandshakeGate {
            epoch: Instant::now(),
            known: Mutex::new(HashMap::new()),
            suspects: Mutex::new(HashMap::new()),
            pressed_until_ms: AtomicU64::new(0),
            bucket: Mutex::new(Bucket {
                tokens: per_second,
                last: Instant::now(),
            }),
            per_source: Buckets::default(),
            per_token: Buckets::default(),
            per_second,
        }
    }

    /// Milliseconds since the gate was made: the clock of its methods.
    pub(crate) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// `ip` presented a client certificate at `now_ms`.
    pub(crate) fn certified(&self, ip: IpAddr, now_ms: u64) {
        let mut known = self.known.lock().expect("known sources lock");
        remember(&mut known, ip, now_ms, |seen| {
            now_ms.saturating_sub(seen) < KNOWN_FOR_MS
        });
    }

    /// An RPC from `ip` stalled, or it offered a token never issued, at
    /// `now_ms`.
    pub(crate) fn suspect(&self, ip: IpAddr, now_ms: u64) {
        let mut suspects = self.suspects.lock().expect("suspects lock");
        remember(&mut suspects, ip, now_ms + SUSPECT_MS, |until| {
            until > now_ms
        });
    }

    /// The share of connections without a certificate was full at `now_ms`.
    pub(crate) fn pressed(&self, now_ms: u64) {
        self.pressed_until_ms
            .fetch_max(now_ms + PRESSURE_MS, Ordering::Relaxed);
    }

    /// Whether a connection from `ip`, accepted at `now_ms`, gets its
    /// handshake.
    pub(crate) fn admit(&self, ip: IpAddr, now_ms: u64) -> bool {
        if now_ms >= self.pressed_until_ms.load(Ordering::Relaxed) {
            return true;
        }
        if self
            .known
            .lock()
            .expect("known sources lock")
            .contains_key(&ip)
        {
            return true;
        }
        let suspects = self.suspects.lock().expect("suspects lock");
        if suspects.get(&ip).is_some_and(|until| *until > now_ms) {
            return false;
        }
        drop(suspects);
        let (each, burst) = (PER_SOURCE_PER_S, PER_SOURCE_BURST);
        if !self.per_source.holds(&ip, each, burst) {
            return false;
        }
        let rate = self.per_second;
        let all = self
            .bucket
            .lock()
            .expect("handshake bucket lock")
            .take(rate, rate);
        all && self.per_source.take(&ip, each, burst)
    }

    /// A held-back stranger named the join token `hash`, which the region
    /// issued (the caller's check, so only issued tokens are remembered):
    /// whether it gets its handshake.
    pub(crate) fn token_turn(&self, hash: &[u8]) -> bool {
        self.per_token
            .take(&hash.to_vec(), PER_SOURCE_PER_S, PER_SOURCE_BURST)
    }
}

/// Puts `ip` in `table` with `value`; a full table first forgets the
/// entries `keep` refuses, and takes no new address while still full.
fn remember(table: &mut HashMap<IpAddr, u64>, ip: IpAddr, value: u64, keep: impl Fn(u64) -> bool) {
    if table.len() >= MAX_KNOWN && !table.contains_key(&ip) {
        table.retain(|_, v| keep(*v));
        if table.len() >= MAX_KNOWN {
            return;
        }
    }
    table.insert(ip, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unknown_addresses_are_held_back_and_only_while_pressed() {
        let gate = HandshakeGate::new(100.0);
        let (node, stranger): (IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.9.9.9".parse().unwrap());
        assert!((0..10).all(|_| gate.admit(stranger, 0)), "no pressure: all");
        gate.certified(node, 0);
        gate.pressed(10);
        assert!(
            (0..10).all(|_| gate.admit(node, 20)),
            "a node's address: all"
        );
        let admitted = (0..10).filter(|_| gate.admit(stranger, 20)).count();
        assert_eq!(admitted, 3, "a stranger gets its own burst");
        let other: IpAddr = "10.9.9.8".parse().unwrap();
        assert!(gate.admit(other, 20), "another stranger has its own turns");
        let all = HandshakeGate::new(1.0);
        all.pressed(0);
        let sources = (0..10u8).map(|i| IpAddr::from([10, 8, 0, i]));
        let admitted = sources.filter(|ip| all.admit(*ip, 1)).count();
        assert!(admitted <= 2, "all strangers share the bucket: {admitted}");
        assert!(gate.admit(stranger, 10 + PRESSURE_MS), "pressure over");
        let staller: IpAddr = "10.7.7.7".parse().unwrap();
        gate.suspect(staller, 100);
        gate.pressed(100);
        assert!(
            !gate.admit(staller, 200),
            "a suspect gets none while pressed"
        );
        gate.certified(staller, 200);
        assert!(
            gate.admit(staller, 300),
            "unless it presented a certificate"
        );
    }
}
