//! The endpoint's open connections, each one endable from outside its
//! pgwire task: at most so many per auditor, idle ones closed, and those of
//! an auditor (or a certificate) revoked ended within seconds.
//!
//! A connection is registered by its peer address when it is accepted, and
//! claimed for an auditor when that auditor logs in; the claim counts
//! against the auditor's cap and is given back when the connection's task
//! ends. [`sweep`] ends connections: dropping the pgwire task closes the
//! client's socket and the auditor's PostgreSQL connection, whose process
//! ends within [`crate::backend::CONNECTION_CHECK_MS`] even mid-statement.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Why the endpoint ended a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Idle,
    Revoked,
}

impl Ended {
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Idle => "idle",
            Ended::Revoked => "revoked",
        }
    }
}

/// Who a connection logged in as.
#[derive(Debug, Clone)]
pub struct Claim {
    pub auditor: String,
    /// The serial of the certificate it logged in with, if it did.
    pub serial: Option<String>,
}

/// One accepted connection.
pub struct Conn {
    ended: tokio::sync::Notify,
    reason: OnceLock<Ended>,
    claim: OnceLock<Claim>,
    /// Milliseconds since the registry's start at the last statement's
    /// start or end.
    last_active: AtomicU64,
    /// Statements running now.
    busy: AtomicU64,
}

impl Conn {
    /// Waits until the endpoint ends this connection, and says why.
    pub async fn ended(&self) -> Ended {
        loop {
            if let Some(r) = self.reason.get() {
                return *r;
            }
            self.ended.notified().await;
        }
    }

    fn end(&self, why: Ended) {
        if self.reason.set(why).is_ok() {
            self.ended.notify_one();
        }
    }

    pub fn claim(&self) -> Option<&Claim> {
        self.claim.get()
    }
}

/// Marks a connection busy for as long as it lives.
pub struct Busy<'a> {
    conn: &'a Conn,
    conns: &'a Conns,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.conns.touch(self.conn);
        self.conn.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Every open connection, by peer address.
pub struct Conns {
    start: Instant,
    by_peer: Mutex<HashMap<SocketAddr, Arc<Conn>>>,
    /// Connections claimed per auditor.
    per_auditor: Mutex<HashMap<String, u64>>,
    max_per_auditor: u64,
}

/// A claim refused: the auditor holds this many sessions already.
#[derive(Debug)]
pub struct AtCap(pub u64);

impl Conns {
    pub fn new(max_per_auditor: u64) -> Conns {
        Conns {
            start: Instant::now(),
            by_peer: Mutex::default(),
            per_auditor: Mutex::default(),
            max_per_auditor: max_per_auditor.max(1),
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// A connection just accepted.
    pub fn register(&self, peer: SocketAddr) -> Arc<Conn> {
        let conn = Arc::new(Conn {
            ended: tokio::sync::Notify::new(),
            reason: OnceLock::new(),
            claim: OnceLock::new(),
            last_active: AtomicU64::new(self.now_ms()),
            busy: AtomicU64::new(0),
        });
        self.by_peer
            .lock()
            .expect("conns lock")
            .insert(peer, conn.clone());
        conn
    }

    /// The connection's task ended: its claim is given back.
    pub fn remove(&self, peer: SocketAddr) {
        let conn = self.by_peer.lock().expect("conns lock").remove(&peer);
        if let Some(claim) = conn.as_ref().and_then(|c| c.claim.get()) {
            let mut per = self.per_auditor.lock().expect("conns lock");
            if let Some(n) = per.get_mut(&claim.auditor) {
                *n -= 1;
                if *n == 0 {
                    per.remove(&claim.auditor);
                }
            }
        }
    }

    /// Claims the connection from `peer` for an auditor who just logged in,
    /// unless they hold their cap of sessions already.
    pub fn claim(&self, peer: SocketAddr, claim: Claim) -> Result<Arc<Conn>, AtCap> {
        let conn = self.by_peer.lock().expect("conns lock").get(&peer).cloned();
        // A connection not registered (never the case through `start`) is
        // claimed on a connection of its own, so the count still holds.
        let conn = conn.unwrap_or_else(|| self.register(peer));
        let mut per = self.per_auditor.lock().expect("conns lock");
        let held = per.entry(claim.auditor.clone()).or_insert(0);
        if *held >= self.max_per_auditor {
            return Err(AtCap(self.max_per_auditor));
        }
        if conn.claim.set(claim).is_ok() {
            *held += 1;
        }
        conn.last_active.store(self.now_ms(), Ordering::SeqCst);
        Ok(conn)
    }

    /// A statement starts on `conn`; it is busy until the guard drops.
    pub fn busy<'a>(&'a self, conn: &'a Conn) -> Busy<'a> {
        conn.busy.fetch_add(1, Ordering::SeqCst);
        self.touch(conn);
        Busy { conn, conns: self }
    }

    fn touch(&self, conn: &Conn) {
        conn.last_active.store(self.now_ms(), Ordering::SeqCst);
    }

    /// Ends every claimed connection idle for `idle` or longer; how many.
    pub fn end_idle(&self, idle: Duration) -> usize {
        let now = self.now_ms();
        let idle = idle.as_millis() as u64;
        let conns = self.by_peer.lock().expect("conns lock");
        let mut n = 0;
        for c in conns.values() {
            if c.claim.get().is_some()
                && c.reason.get().is_none()
                && c.busy.load(Ordering::SeqCst) == 0
                && now.saturating_sub(c.last_active.load(Ordering::SeqCst)) >= idle
            {
                c.end(Ended::Idle);
                n += 1;
            }
        }
        n
    }

    /// The claims of the open connections (to check for revocation).
    pub fn claims(&self) -> Vec<Claim> {
        let conns = self.by_peer.lock().expect("conns lock");
        conns
            .values()
            .filter(|c| c.reason.get().is_none())
            .filter_map(|c| c.claim.get().cloned())
            .collect()
    }

    /// Ends every connection of `auditor` (or only those that logged in
    /// with the certificate `serial`); how many.
    pub fn end_revoked(&self, auditor: &str, serial: Option<&str>) -> usize {
        let conns = self.by_peer.lock().expect("conns lock");
        let mut n = 0;
        for c in conns.values() {
            let Some(claim) = c.claim.get() else { continue };
            if claim.auditor == auditor
                && serial.is_none_or(|s| claim.serial.as_deref() == Some(s))
                && c.reason.get().is_none()
            {
                c.end(Ended::Revoked);
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn claim(name: &str) -> Claim {
        Claim {
            auditor: name.into(),
            serial: None,
        }
    }

    #[test]
    fn an_auditor_holds_at_most_the_cap_and_a_closed_connection_gives_its_place_back() {
        let conns = Conns::new(2);
        for p in 1..=4 {
            conns.register(peer(p));
        }
        assert!(conns.claim(peer(1), claim("ann")).is_ok());
        assert!(conns.claim(peer(2), claim("ann")).is_ok());
        assert!(matches!(conns.claim(peer(3), claim("ann")), Err(AtCap(2))));
        assert!(conns.claim(peer(4), claim("bob")).is_ok());
        conns.remove(peer(1));
        assert!(conns.claim(peer(3), claim("ann")).is_ok());
    }

    #[tokio::test]
    async fn idle_connections_end_and_busy_ones_do_not() {
        let conns = Conns::new(4);
        let (a, b) = (conns.register(peer(1)), conns.register(peer(2)));
        let unclaimed = conns.register(peer(3));
        conns.claim(peer(1), claim("ann")).unwrap();
        conns.claim(peer(2), claim("ann")).unwrap();
        let busy = conns.busy(&b);
        assert_eq!(conns.end_idle(Duration::ZERO), 1);
        assert_eq!(a.ended().await, Ended::Idle);
        assert!(b.reason.get().is_none() && unclaimed.reason.get().is_none());
        drop(busy);
        assert_eq!(conns.end_idle(Duration::ZERO), 1);
        assert_eq!(conns.end_idle(Duration::ZERO), 0, "ended once");
    }

    #[test]
    fn revocation_ends_the_auditors_connections_or_only_the_certificates() {
        let conns = Conns::new(4);
        for p in 1..=3 {
            conns.register(peer(p));
        }
        conns.claim(peer(1), claim("ann")).unwrap();
        let cert = Claim {
            auditor: "ann".into(),
            serial: Some("0a".into()),
        };
        conns.claim(peer(2), cert).unwrap();
        conns.claim(peer(3), claim("bob")).unwrap();
        assert_eq!(conns.end_revoked("ann", Some("0a")), 1);
        assert_eq!(conns.claims().len(), 2);
        assert_eq!(conns.end_revoked("ann", None), 1);
        assert_eq!(conns.claims().len(), 1);
    }
}
