//! The daemon's connection to one gateway: mutual TLS over TCP, then
//! HTTP/2 whose keep-alive runs on the time this process could run.
//!
//! A gateway that died without closing its connections, or froze, answers
//! no HTTP/2 ping: the connection ends once an answer is `answer` late and
//! the daemon moves on. Timed on the wall clock (tonic's channel gives
//! hyper a fixed tokio timer), a daemon short of a core took its own
//! lateness for a silent gateway: the ping's answer sat unread in its socket
//! while the clock ran, and the connection checks its timer before it
//! reads. Here hyper gets a [`ProcessClock`], so only the time the process
//! could run counts (see `ops::process_clock`); a starved daemon keeps its
//! session, a free one still notices a silent gateway within `2 × answer`.
//!
//! The connection itself (TCP, TLS, the HTTP/2 preface) is waited for on
//! the same count. On the wall clock, a fleet powered on at once gave up
//! on half of its connections: ten thousand daemons sharing two cores ran
//! what was due up to 15 s late, so handshakes whose answers sat unread
//! timed out, and each was made again from the start.

use hyper::client::conn::http2::SendRequest;
use ops::process_clock::ProcessClock;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio_rustls::rustls::pki_types::ServerName;

/// How long a connection (TCP, TLS and the HTTP/2 preface) may take, in
/// the time this process could run.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a connection is waited for in wall time, however starved the
/// process.
const CONNECT_MOST: Duration = Duration::from_secs(60);

/// Where and how to reach one gateway.
#[derive(Clone)]
pub struct Link {
    origin: http::Uri,
    tls: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
    answer: Duration,
    clock: ProcessClock,
    /// [`CONNECT_TIMEOUT`] and [`CONNECT_MOST`].
    connect_limits: (Duration, Duration),
}

/// A connected gateway, for tonic's generated clients
/// (`SessionClient::with_origin(channel.clone(), channel.origin())`). Clones share the
/// connection; it closes when the last clone is dropped.
#[derive(Clone)]
pub struct Channel {
    send: SendRequest<tonic::body::Body>,
    origin: http::Uri,
}

impl Channel {
    /// The scheme and authority every request carries.
    pub fn origin(&self) -> http::Uri {
        self.origin.clone()
    }

    /// Whether the connection has ended (closed by either side, or its
    /// keep-alive went unanswered).
    pub fn is_closed(&self) -> bool {
        self.send.is_closed()
    }
}

impl Link {
    /// A link to the gateway at `address` (`https://host:port`) that
    /// verifies it against the CA in `ca_pem` under `server_name` and
    /// presents this certificate and key.
    pub fn new(
        address: &str,
        (ca_pem, cert_pem, key_pem): (&str, &str, &str),
        server_name: &str,
        answer: Duration,
        clock: ProcessClock,
    ) -> Result<Link, String> {
        let origin: http::Uri = address
            .parse()
            .map_err(|e| format!("gateway address {address:?}: {e}"))?;
        if origin.host().is_none() {
            return Err(format!("gateway address {address:?}: no host"));
        }
        let config =
            ops::tls::client_config(ca_pem, Some((cert_pem, key_pem)), vec![b"h2".to_vec()])?;
        let server_name = ServerName::try_from(server_name.to_string())
            .map_err(|e| format!("server name {server_name:?}: {e}"))?;
        Ok(Link {
            origin,
            tls: tokio_rustls::TlsConnector::from(config),
            server_name,
            answer,
            clock,
            connect_limits: (CONNECT_TIMEOUT, CONNECT_MOST),
        })
    }

    /// Connects: TCP, TLS, and the HTTP/2 handshake, within
    /// [`CONNECT_TIMEOUT`] of the time this process could run (and
    /// [`CONNECT_MOST`] of wall time). The connection is driven by a task
    /// of its own that ends with it.
    pub async fn connect(&self) -> Result<Channel, String> {
        let connecting = async {
            let tls = ops::tls::connect(
                self.tls.clone(),
                self.server_name.clone(),
                &self.origin,
                None,
            )
            .await
            .map_err(|e| e.to_string())?;
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .timer(self.clock.clone())
                .keep_alive_interval(self.answer)
                .keep_alive_timeout(self.answer)
                .keep_alive_while_idle(true)
                .handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| e.to_string())
        };
        let (limit, most) = self.connect_limits;
        let (send, conn) =
            self.clock
                .patient(limit, most, connecting)
                .await
                .map_err(|gave| {
                    format!("no connection within {limit:?} ({:?} waited)", gave.waited)
                })??;
        tokio::spawn(async move {
            // Its end reaches the session as the error of its stream.
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "gateway connection ended");
            }
        });
        Ok(Channel {
            send,
            origin: self.origin.clone(),
        })
    }
}

type Responding = Pin<
    Box<dyn Future<Output = Result<http::Response<hyper::body::Incoming>, hyper::Error>> + Send>,
>;

impl tower_service::Service<http::Request<tonic::body::Body>> for Channel {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = Responding;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.send.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.send.send_request(req))
    }
}

/// One link per gateway, presenting these credentials, on one clock.
pub fn links(
    gateways: &[String],
    creds: (&str, &str, &str),
    server_name: &str,
    answer: Duration,
    clock: &ProcessClock,
) -> Result<Vec<Link>, String> {
    gateways
        .iter()
        .map(|g| Link::new(g, creds, server_name, answer, clock.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// A link to `address` with throwaway credentials (the peer never
    /// answers, so they are never checked) and these connect limits.
    fn link(address: &str, limit: Duration, most: Duration) -> Link {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["gw".to_string()])
            .expect("params")
            .self_signed(&key)
            .expect("certificate");
        let (cert, key) = (cert.pem(), key.serialize_pem());
        let mut l = Link::new(
            address,
            (&cert, &cert, &key),
            "gw",
            Duration::from_secs(5),
            ProcessClock::new(Duration::from_secs(30)),
        )
        .expect("link");
        l.connect_limits = (limit, most);
        l
    }

    /// Holds the runtime's only thread most of the time, as ten thousand
    /// daemons on a machine short of cores do.
    async fn hog() {
        loop {
            std::thread::sleep(Duration::from_millis(1000));
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_starved_daemon_does_not_give_up_on_a_connection_at_the_wall_clocks_limit() {
        // A gateway whose kernel takes the connection and that never
        // answers the ClientHello.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let address = format!("https://{}", silent.local_addr().expect("address"));
        let free = link(&address, Duration::from_secs(1), Duration::from_secs(6));
        let t = Instant::now();
        let e = free.connect().await.err().expect("nothing answers");
        let free_waited = t.elapsed();
        assert!(e.contains("no connection within"), "{e}");
        assert!(
            free_waited < Duration::from_secs(3),
            "a free daemon gives up after its limit: {free_waited:?}"
        );
        let hog = tokio::spawn(hog());
        let starved = link(&address, Duration::from_secs(1), Duration::from_secs(6));
        let t = Instant::now();
        let e = starved.connect().await.err().expect("nothing answers");
        let starved_waited = t.elapsed();
        hog.abort();
        assert!(e.contains("no connection within"), "{e}");
        // On the wall clock it gave up as soon as it ran after 1 s.
        assert!(
            starved_waited > Duration::from_millis(2500),
            "a starved daemon waits past its limit: {starved_waited:?}"
        );
        assert!(
            starved_waited < Duration::from_secs(8),
            "and no more than its most: {starved_waited:?}"
        );
        drop(silent);
    }
}
