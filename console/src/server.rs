//! The console's HTTPS listener: the region's serving certificate (renewed
//! in place), client certificates asked for but optional (an operator's
//! signs in without a link), HTTP/1.1. Connections are bounded: at most
//! `max_connections` at once (the oldest waits are not kept: a connection
//! over the bound is closed at once), the TLS handshake and each request's
//! head due within their timeouts (a kept-alive connection that sends no
//! next request is closed by the same one); a live stream is a request in
//! flight, bounded by its own semaphore.

use crate::router::Peer;
use crate::Shared;
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::rustls;

pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS configuration: the serving certificate, client certificates of
/// the region's CA optional, HTTP/1.1.
pub fn tls_config(
    cert: Arc<ops::tls::ServingCert>,
    client_ca_pem: &str,
) -> Result<Arc<rustls::ServerConfig>, String> {
    ops::tls::server_config(cert, client_ca_pem, &[b"http/1.1"])
}

/// Accepts connections until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shared: Arc<Shared>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let slots = Arc::new(tokio::sync::Semaphore::new(shared.config.max_connections));
    loop {
        let (sock, addr) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: wait instead of spinning.
                tracing::warn!(error = %e, "console: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%addr, "console: too many connections; closed one");
            continue;
        };
        let (acceptor, shared) = (acceptor.clone(), shared.clone());
        ops::task::spawn("console-conn", async move {
            let _slot = slot;
            let _ = sock.set_nodelay(true);
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(sock)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%addr, error = %e, "console: TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let peer = Arc::new(Peer {
                addr,
                cert: tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| c.as_ref().to_vec()),
            });
            let service = hyper::service::service_fn(move |req| {
                let (shared, peer) = (shared.clone(), peer.clone());
                async move {
                    Ok::<_, std::convert::Infallible>(crate::router::route(shared, peer, req).await)
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .header_read_timeout(HEAD_TIMEOUT)
                .timer(hyper_util::rt::TokioTimer::new())
                .keep_alive(true)
                .serve_connection(hyper_util::rt::TokioIo::new(tls), service);
            if let Err(e) = conn.await {
                tracing::debug!(%addr, error = %e, "console: connection ended");
            }
        });
    }
}
