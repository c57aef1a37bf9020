//! The gateway's listener: TCP accept, the TLS handshake (rustls with ring,
//! client certificates optional, served with a certificate that is renewed
//! while the gateway runs), and the limits that keep idle and half-open
//! connections from crowding out real nodes and clients.
//!
//! - A connection must finish its TLS handshake and start its first RPC (a
//!   node's session, a join, an API call) within `handshake_timeout` of its
//!   accept; it is not closed for anything else before that, so a fleet
//!   starting at once is not cut off mid-handshake.
//! - From its first RPC on, a connection is *busy* while an RPC is in
//!   progress on it (counted by [`ActivityLayer`]) and *idle* otherwise; an
//!   idle one is closed after `idle_timeout`, and at most `max_idle` may be
//!   idle at once: one more closes the one idle the longest.
//! - Running out of descriptors (`EMFILE` at accept) closes the connection
//!   idle the longest of all, so a flood of connections that never open a
//!   session cannot keep a real node or client out.
//! - Connections without a client certificate have a share of their own;
//!   while it is pressed, strangers' handshakes are rationed
//!   ([`crate::handshakes`]).

use futures_util::task::AtomicWaker;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tonic::transport::server::{Connected, TcpConnectInfo, TlsConnectInfo};

/// The limits of [`serve`].
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub handshake_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_idle: usize,
    /// Each request message must arrive whole within this of its start.
    pub request_deadline: Duration,
    /// Most connections without a client certificate at once (while it is
    /// full, strangers' handshakes are rationed: [`crate::handshakes`]).
    pub max_unauthenticated: usize,
}

/// Counters of the listener.
#[derive(Debug, Default)]
pub struct ListenerStats {
    pub accepted: AtomicU64,
    /// TLS handshakes completed.
    pub handshakes: AtomicU64,
    pub handshake_failures: AtomicU64,
    pub handshake_timeouts: AtomicU64,
    /// Idle connections closed: past the idle timeout, or the longest idle
    /// when too many were (or descriptors ran out).
    pub idle_closed: AtomicU64,
    /// Accepts that failed for want of a file descriptor.
    pub out_of_descriptors: AtomicU64,
    /// Connections without a client certificate closed after their
    /// handshake: their share of connections was full.
    pub unauthenticated_refused: AtomicU64,
    /// Busy connections without a client certificate closed to make room
    /// for a new one: the oldest of a share full of busy ones.
    pub unauthenticated_evicted: AtomicU64,
    /// RPCs cancelled because a request message did not arrive whole in time.
    pub requests_cut: AtomicU64,
    /// Connections closed before their handshake: from an address that
    /// never presented a certificate, while the share of those without one
    /// was pressed and their handshakes' bucket empty, and not naming a
    /// join token the region issued.
    pub handshakes_held_back: AtomicU64,
    /// Held-back connections let through because their ClientHello named a
    /// join token the region issued.
    pub handshakes_by_token: AtomicU64,
    /// Of those held back, the ones closed unread: too many ClientHellos
    /// were being read at once.
    pub hellos_unread: AtomicU64,
}

/// How long a connection without a client certificate may wait on its
/// client for a request message before a newcomer may close it to take its
/// place (milliseconds).
const EVICTABLE_AFTER_MS: u64 = 1_000;

/// A connection's standing in the count of idle ones.
const NOT_IDLE: u8 = 0;
const IDLE: u8 = 1;
const GONE: u8 = 2;

/// One accepted connection.
pub(crate) struct Conn {
    /// RPCs in progress.
    active: AtomicUsize,
    /// Since when no RPC has been in progress (milliseconds on `Conns.epoch`).
    idle_since_ms: AtomicU64,
    /// When it was accepted (milliseconds on `Conns.epoch`).
    accepted_ms: u64,
    /// Its first RPC began: from now on it counts against `max_idle` while
    /// none is in progress.
    settled: AtomicBool,
    /// Whether it counts in `Conns.idle`: [`NOT_IDLE`], [`IDLE`] or
    /// [`GONE`] (its socket dropped: never counted again, though an RPC
    /// of its may end after).
    idle_state: std::sync::atomic::AtomicU8,
    closed: AtomicBool,
    /// It presented no client certificate (and counts in that share).
    unauthenticated: AtomicBool,
    /// The address it came from.
    ip: std::net::IpAddr,
    /// Request messages due from its client (RPCs waiting on it).
    awaiting: AtomicUsize,
    /// Since when one has been due (milliseconds on `Conns.epoch`; valid
    /// while `awaiting` is above zero).
    awaiting_since_ms: AtomicU64,
    waker: AtomicWaker,
}

impl Conn {
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.waker.wake();
    }
}

/// Every open connection, by remote address.
pub(crate) struct Conns {
    by_addr: Mutex<HashMap<SocketAddr, Arc<Conn>>>,
    idle: AtomicUsize,
    /// Connections without a client certificate.
    unauthenticated: AtomicUsize,
    epoch: Instant,
    limits: Limits,
    gate: Arc<crate::handshakes::HandshakeGate>,
    /// Held-back strangers' ClientHellos being read.
    hello_reads: Arc<tokio::sync::Semaphore>,
    pub(crate) stats: Arc<ListenerStats>,
}

impl Conns {
    pub(crate) fn new(
        limits: Limits,
        gate: Arc<crate::handshakes::HandshakeGate>,
        stats: Arc<ListenerStats>,
    ) -> Arc<Conns> {
        Arc::new(Conns {
            by_addr: Mutex::new(HashMap::new()),
            idle: AtomicUsize::new(0),
            unauthenticated: AtomicUsize::new(0),
            epoch: Instant::now(),
            limits,
            gate,
            hello_reads: Arc::new(tokio::sync::Semaphore::new(
                crate::handshakes::MAX_HELLO_READS,
            )),
            stats,
        })
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Connections open, and how many of them idle after an RPC; those
    /// told to close are not counted, though their sockets may take a
    /// moment to go (the counter the cap is enforced by counts them until
    /// then, so it may close one more than needed, never one less).
    pub fn counts(&self) -> (usize, usize) {
        let map = self.by_addr.lock().expect("conns lock");
        let open = map.values().filter(|c| !c.closed.load(Ordering::SeqCst));
        open.fold((0, 0), |(n, idle), c| {
            let is_idle = c.settled.load(Ordering::SeqCst) && c.active.load(Ordering::SeqCst) == 0;
            (n + 1, idle + usize::from(is_idle))
        })
    }

    fn add(self: &Arc<Self>, addr: SocketAddr) -> Arc<Conn> {
        let conn = Arc::new(Conn {
            active: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(self.now_ms()),
            accepted_ms: self.now_ms(),
            settled: AtomicBool::new(false),
            idle_state: std::sync::atomic::AtomicU8::new(NOT_IDLE),
            closed: AtomicBool::new(false),
            unauthenticated: AtomicBool::new(false),
            ip: addr.ip(),
            awaiting: AtomicUsize::new(0),
            awaiting_since_ms: AtomicU64::new(0),
            waker: AtomicWaker::new(),
        });
        self.by_addr
            .lock()
            .expect("conns lock")
            .insert(addr, conn.clone());
        conn
    }

    /// Forgets `conn`, whose socket is dropped, and gives back its counts:
    /// whether or not it is still the table's entry for `addr` (a newer
    /// connection from the same address and port may have taken the entry
    /// before this one's socket went: a fleet joining from one address
    /// churns through every port, and a place in the share never given
    /// back once kept every join of a 10,000-node cold start out).
    fn remove(&self, addr: &SocketAddr, conn: &Arc<Conn>) {
        let mut map = self.by_addr.lock().expect("conns lock");
        if map.get(addr).is_some_and(|c| Arc::ptr_eq(c, conn)) {
            map.remove(addr);
        }
        if conn.idle_state.swap(GONE, Ordering::SeqCst) == IDLE {
            self.idle.fetch_sub(1, Ordering::SeqCst);
        }
        if conn.unauthenticated.swap(false, Ordering::SeqCst) {
            self.unauthenticated.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn get(&self, addr: &SocketAddr) -> Option<Arc<Conn>> {
        self.by_addr.lock().expect("conns lock").get(addr).cloned()
    }

    /// Closes the connection idle the longest (among those past their first
    /// RPC only, when `settled`).
    fn close_longest_idle(&self, settled: bool) -> bool {
        self.close_longest_idle_of(|c| !settled || c.settled.load(Ordering::SeqCst))
    }

    /// Closes the connection idle the longest among those `of` picks.
    fn close_longest_idle_of(&self, of: impl Fn(&Conn) -> bool) -> bool {
        let map = self.by_addr.lock().expect("conns lock");
        let oldest = map
            .values()
            .filter(|c| {
                c.active.load(Ordering::SeqCst) == 0 && !c.closed.load(Ordering::SeqCst) && of(c)
            })
            .min_by_key(|c| c.idle_since_ms.load(Ordering::Relaxed));
        match oldest {
            Some(c) => {
                c.close();
                self.stats.idle_closed.fetch_add(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Counts `conn`, which presented no client certificate, in its share:
    /// when the share is full, the one of them idle the longest is closed
    /// to make room (not one yet to begin its first RPC within
    /// [`EVICTABLE_AFTER_MS`] of its acceptance); if every one is busy, the one that has waited the
    /// longest on its client for a request message, if that wait is at
    /// least [`EVICTABLE_AFTER_MS`] old (a join's message comes whole in
    /// one round trip; a wait that long is almost surely a stall, and a
    /// share full of stalls would otherwise keep every real join out until
    /// their deadlines). A connection whose requests have all arrived is
    /// being served and is never closed for a newcomer, so churn cannot
    /// evict a real join under way. `conn` is refused (false) when there is
    /// none to close, unless it `named` a join token the region issued in
    /// its ClientHello (those are few: a handshake a second per token),
    /// and the listener's handshake gate is told the share is pressed
    /// either way.
    fn admit_unauthenticated(&self, conn: &Conn, named: bool) -> bool {
        let n = self.unauthenticated.fetch_add(1, Ordering::SeqCst) + 1;
        conn.unauthenticated.store(true, Ordering::SeqCst);
        if n <= self.limits.max_unauthenticated {
            return true;
        }
        self.gate.pressed(self.gate.now_ms());
        let others = |c: &Conn| c.unauthenticated.load(Ordering::SeqCst) && !std::ptr::eq(c, conn);
        // One that has not begun its first RPC yet, less than a second after
        // its handshake, is about to be served (a joining node between its
        // handshake and its Join, on a busy machine): not idle yet.
        let now = self.now_ms();
        let idle_others = |c: &Conn| {
            others(c)
                && (c.settled.load(Ordering::SeqCst)
                    || now.saturating_sub(c.accepted_ms) >= EVICTABLE_AFTER_MS)
        };
        if self.close_longest_idle_of(idle_others) || self.close_longest_waiting_of(others) || named
        {
            return true;
        }
        conn.unauthenticated.store(false, Ordering::SeqCst);
        self.unauthenticated.fetch_sub(1, Ordering::SeqCst);
        false
    }

    /// Closes the connection that has waited on its client the longest
    /// among those `of` picks, if it has waited at least
    /// [`EVICTABLE_AFTER_MS`].
    fn close_longest_waiting_of(&self, of: impl Fn(&Conn) -> bool) -> bool {
        let now = self.now_ms();
        let map = self.by_addr.lock().expect("conns lock");
        let longest = map
            .values()
            .filter(|c| {
                !c.closed.load(Ordering::SeqCst) && c.awaiting.load(Ordering::SeqCst) > 0 && of(c)
            })
            .min_by_key(|c| c.awaiting_since_ms.load(Ordering::SeqCst))
            .filter(|c| {
                now.saturating_sub(c.awaiting_since_ms.load(Ordering::SeqCst)) >= EVICTABLE_AFTER_MS
            });
        match longest {
            Some(c) => {
                c.close();
                self.gate.suspect(c.ip, self.gate.now_ms());
                self.stats
                    .unauthenticated_evicted
                    .fetch_add(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Closes every connection idle past the idle timeout, and every one
    /// that has not started an RPC within the handshake timeout.
    fn sweep(&self) {
        let now = self.now_ms();
        let idle = self.limits.idle_timeout.as_millis() as u64;
        let first = self.limits.handshake_timeout.as_millis() as u64;
        for c in self.by_addr.lock().expect("conns lock").values() {
            if c.active.load(Ordering::SeqCst) > 0 || c.closed.load(Ordering::SeqCst) {
                continue;
            }
            let late = match c.settled.load(Ordering::SeqCst) {
                true => now.saturating_sub(c.idle_since_ms.load(Ordering::Relaxed)) > idle,
                false => now.saturating_sub(c.accepted_ms) > first,
            };
            if late {
                c.close();
                self.stats.idle_closed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// An accepted TCP stream that closes when its connection is told to, and
/// leaves the table when dropped.
pub struct Tracked {
    inner: TcpStream,
    addr: SocketAddr,
    conn: Arc<Conn>,
    conns: Arc<Conns>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.conns.remove(&self.addr, &self.conn);
    }
}

fn closed() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "closed by the gateway (idle)",
    )
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.conn.waker.register(cx.waker());
        if this.conn.closed.load(Ordering::SeqCst) {
            return Poll::Ready(Err(closed()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.closed.load(Ordering::SeqCst) {
            return Poll::Ready(Err(closed()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Connected for Tracked {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

pub use ops::tls::ServingCert;

/// The TLS configuration: this serving certificate, client certificates
/// optional but checked against `client_ca_pem` when presented, HTTP/2.
pub fn server_config(
    cert: Arc<ServingCert>,
    client_ca_pem: &str,
) -> Result<Arc<rustls::ServerConfig>, String> {
    ops::tls::server_config(cert, client_ca_pem, &[b"h2"])
}

/// Whether a join token's hash is one the region issued.
pub(crate) type TokenCheck =
    Arc<dyn Fn(Vec<u8>) -> futures_util::future::BoxFuture<'static, bool> + Send + Sync>;

/// The connections that finished their handshake, for the gRPC server.
pub(crate) type Incoming = futures_util::stream::BoxStream<
    'static,
    Result<tokio_rustls::server::TlsStream<Tracked>, io::Error>,
>;

/// Accepts on `listener` until the returned stream is dropped, handshaking
/// each connection with a bounded time, closing idle ones past the limits.
pub(crate) fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    conns: Arc<Conns>,
    tokens: TokenCheck,
) -> Incoming {
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.clone());
    let sweep = {
        let conns = conns.clone();
        let tx = tx.clone();
        async move {
            let period = (conns.limits.idle_timeout / 4)
                .clamp(Duration::from_millis(50), Duration::from_secs(1));
            let mut tick = tokio::time::interval(period);
            while !tx.is_closed() {
                tick.tick().await;
                conns.sweep();
            }
        }
    };
    tokio::spawn(sweep);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            let (tcp, addr) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors: make room by closing the connection
                    // idle the longest, then accept again.
                    if matches!(e.raw_os_error(), Some(24 | 23)) {
                        conns
                            .stats
                            .out_of_descriptors
                            .fetch_add(1, Ordering::Relaxed);
                        conns.close_longest_idle(false);
                    } else {
                        tracing::warn!(error = %e, "gateway: accept failed");
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            conns.stats.accepted.fetch_add(1, Ordering::Relaxed);
            // Held back: its ClientHello is read (while few are), and only
            // one naming a join token the region issued gets a handshake.
            let held_back = if conns.gate.admit(addr.ip(), conns.gate.now_ms()) {
                None
            } else {
                match conns.hello_reads.clone().try_acquire_owned() {
                    Ok(reading) => Some(reading),
                    Err(_) => {
                        conns
                            .stats
                            .handshakes_held_back
                            .fetch_add(1, Ordering::Relaxed);
                        conns.stats.hellos_unread.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                }
            };
            let _ = tcp.set_nodelay(true);
            let conn = conns.add(addr);
            let tracked = Tracked {
                inner: tcp,
                addr,
                conn,
                conns: conns.clone(),
            };
            let (acceptor, tx, stats) = (acceptor.clone(), tx.clone(), conns.stats.clone());
            let (tls, tokens, gate) = (tls.clone(), tokens.clone(), conns.gate.clone());
            let timeout = conns.limits.handshake_timeout;
            tokio::spawn(async move {
                let handshake = async {
                    let Some(reading) = held_back else {
                        return acceptor.accept(tracked).await.map(|tls| Some((tls, false)));
                    };
                    let hello = tokio::time::timeout(
                        crate::handshakes::HELLO_READ,
                        tokio_rustls::LazyConfigAcceptor::new(
                            rustls::server::Acceptor::default(),
                            tracked,
                        ),
                    )
                    .await;
                    let Ok(Ok(start)) = hello else {
                        return Ok(None);
                    };
                    let named = start
                        .client_hello()
                        .alpn()
                        .and_then(|mut offered| offered.find_map(ops::join_alpn::named_token_hash));
                    let Some(hash) = named else {
                        return Ok(None);
                    };
                    if !(tokens(hash.clone()).await && gate.token_turn(&hash)) {
                        return Ok(None);
                    }
                    drop(reading);
                    stats.handshakes_by_token.fetch_add(1, Ordering::Relaxed);
                    start.into_stream(tls).await.map(|tls| Some((tls, true)))
                };
                match tokio::time::timeout(timeout, handshake).await {
                    Ok(Ok(None)) => {
                        stats.handshakes_held_back.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Ok(Some((tls, named)))) => {
                        stats.handshakes.fetch_add(1, Ordering::Relaxed);
                        let (tracked, session) = tls.get_ref();
                        let conns = &tracked.conns;
                        if session.peer_certificates().is_some() {
                            conns.gate.certified(addr.ip(), conns.gate.now_ms());
                        } else if !conns.admit_unauthenticated(&tracked.conn, named) {
                            stats
                                .unauthenticated_refused
                                .fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(%addr, "gateway: connection without a certificate refused: their share is full");
                            return;
                        }
                        let _ = tx.send(Ok(tls)).await;
                    }
                    Ok(Err(e)) => {
                        stats.handshake_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%addr, error = %e, "gateway: TLS handshake failed");
                    }
                    Err(_) => {
                        stats.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%addr, "gateway: TLS handshake timed out");
                    }
                }
            });
        }
    });
    Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

/// Counts RPCs in progress per connection (until each response's body
/// ends), so the listener knows which connections are idle.
#[derive(Clone)]
pub(crate) struct ActivityLayer {
    pub(crate) conns: Arc<Conns>,
}

impl<S> tower_layer::Layer<S> for ActivityLayer {
    type Service = Activity<S>;
    fn layer(&self, inner: S) -> Activity<S> {
        Activity {
            inner,
            conns: self.conns.clone(),
        }
    }
}

#[derive(Clone)]
pub(crate) struct Activity<S> {
    inner: S,
    conns: Arc<Conns>,
}

/// An RPC in progress on a connection.
pub(crate) struct Busy {
    conn: Arc<Conn>,
    conns: Arc<Conns>,
}

impl Busy {
    fn new(conn: Arc<Conn>, conns: Arc<Conns>) -> Busy {
        conn.active.fetch_add(1, Ordering::SeqCst);
        // The first RPC settles it; it was not counted idle before.
        conn.settled.store(true, Ordering::SeqCst);
        if conn
            .idle_state
            .compare_exchange(IDLE, NOT_IDLE, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            conns.idle.fetch_sub(1, Ordering::SeqCst);
        }
        Busy { conn, conns }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.conn
            .idle_since_ms
            .store(self.conns.now_ms(), Ordering::Relaxed);
        // Counted idle once, and only while its socket is open: an RPC can
        // end after its connection was dropped (a client that went away
        // mid-RPC), and counting that one idle for ever made the gateway
        // close a connection after every RPC once enough had gone so: a
        // join's, between its answer and the answer's flush.
        if self.conn.active.fetch_sub(1, Ordering::SeqCst) == 1
            && self
                .conn
                .idle_state
                .compare_exchange(NOT_IDLE, IDLE, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            && self.conns.idle.fetch_add(1, Ordering::SeqCst) >= self.conns.limits.max_idle
        {
            self.conns.close_longest_idle(true);
        }
    }
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for Activity<S>
where
    S: tower_service::Service<
        http::Request<tonic::body::Body>,
        Response = http::Response<tonic::body::Body>,
    >,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures_util::future::BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        // Each request message is due whole within the deadline: a stalled
        // one cancels the RPC, and the connection is idle again.
        let conn = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.get_ref().remote_addr())
            .and_then(|a| self.conns.get(&a));
        let watch = Arc::new(Waiting {
            conn: conn.clone(),
            conns: self.conns.clone(),
        });
        let deadline = self.conns.limits.request_deadline;
        let req = req.map(|body| {
            tonic::body::Body::new(crate::deadline::Deadlined::new(body, deadline, watch))
        });
        let busy = conn.map(|c| Busy::new(c, self.conns.clone()));
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(match busy {
                Some(busy) => {
                    resp.map(|body| tonic::body::Body::new(BusyBody { body, _busy: busy }))
                }
                None => resp,
            })
        })
    }
}

/// Tells a connection while one of its RPCs waits on the client for a
/// request message, and counts RPCs cut at the deadline.
struct Waiting {
    conn: Option<Arc<Conn>>,
    conns: Arc<Conns>,
}

impl crate::deadline::Watch for Waiting {
    fn due(&self, due: bool) {
        let Some(conn) = &self.conn else { return };
        if !due {
            conn.awaiting.fetch_sub(1, Ordering::SeqCst);
        } else if conn.awaiting.fetch_add(1, Ordering::SeqCst) == 0 {
            conn.awaiting_since_ms
                .store(self.conns.now_ms(), Ordering::SeqCst);
        }
    }

    fn cut(&self) {
        self.conns
            .stats
            .requests_cut
            .fetch_add(1, Ordering::Relaxed);
        if let Some(conn) = &self.conn {
            let gate = &self.conns.gate;
            gate.suspect(conn.ip, gate.now_ms());
        }
    }
}

/// A response body that keeps its RPC counted until it ends.
struct BusyBody {
    body: tonic::body::Body,
    _busy: Busy,
}

impl http_body::Body for BusyBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conns(max_unauthenticated: usize) -> Arc<Conns> {
        let limits = Limits {
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_idle: 10,
            request_deadline: Duration::from_secs(10),
            max_unauthenticated,
        };
        let gate = Arc::new(crate::handshakes::HandshakeGate::new(100.0));
        Conns::new(limits, gate, Arc::default())
    }

    #[test]
    fn a_connection_whose_address_came_back_before_it_went_still_gives_its_place_back() {
        let c = conns(1);
        let addr: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let old = c.add(addr);
        assert!(c.admit_unauthenticated(&old, false));
        // The client's port is used again (a fleet joining from one address
        // churns through every port) before the old socket is dropped.
        let new = c.add(addr);
        c.remove(&addr, &old);
        assert!(
            c.admit_unauthenticated(&new, false),
            "the old connection's place in the share was never given back"
        );
        c.remove(&addr, &new);
        assert_eq!(c.unauthenticated.load(Ordering::SeqCst), 0);
        assert!(c.by_addr.lock().unwrap().is_empty());
    }

    #[test]
    fn an_rpc_that_ends_after_its_connection_went_is_not_counted_idle() {
        let c = conns(10);
        let addr: SocketAddr = "127.0.0.1:40001".parse().unwrap();
        // An RPC ends and one starts again: idle once between them.
        let conn = c.add(addr);
        drop(Busy::new(conn.clone(), c.clone()));
        assert_eq!(c.idle.load(Ordering::SeqCst), 1);
        let busy = Busy::new(conn.clone(), c.clone());
        assert_eq!(c.idle.load(Ordering::SeqCst), 0);
        // The client goes away mid-RPC: the socket is dropped first, the
        // RPC ends after.
        c.remove(&addr, &conn);
        drop(busy);
        assert_eq!(
            c.idle.load(Ordering::SeqCst),
            0,
            "a dropped connection counted idle"
        );
    }
}
