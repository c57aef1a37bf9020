//! How a joining node names its join token before its TLS handshake: beside
//! `h2`, its ClientHello offers the ALPN protocol `strata-join/` followed by
//! the token's SHA-256 in hex. A gateway rationing strangers' handshakes
//! (while its share of connections without a certificate is pressed) reads
//! the ClientHello, which costs it no cryptography, and lets a stranger
//! naming a token the region issued through: a flood that knows no token
//! cannot spend a real node's turn. The name is a hash, not the token; what
//! the node may do is still decided by the token itself, in the Join RPC.
//!
//! [`JoinConnector`] connects over TLS offering that protocol, for
//! `tonic::transport::Endpoint::connect_with_connector`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

/// What every join protocol begins with.
pub const JOIN_PROTOCOL_PREFIX: &[u8] = b"strata-join/";

/// The token's hash as the gateways keep it: SHA-256 of the trimmed token.
pub fn token_hash(token: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, token.trim().as_bytes())
        .as_ref()
        .to_vec()
}

/// The ALPN protocol that names `token`.
pub fn join_protocol(token: &str) -> Vec<u8> {
    let mut p = JOIN_PROTOCOL_PREFIX.to_vec();
    for b in token_hash(token) {
        p.extend_from_slice(format!("{b:02x}").as_bytes());
    }
    p
}

/// The token hash `protocol` names, if it is a join protocol.
pub fn named_token_hash(protocol: &[u8]) -> Option<Vec<u8>> {
    let hex = protocol.strip_prefix(JOIN_PROTOCOL_PREFIX)?;
    if hex.len() != 64 {
        return None;
    }
    hex.chunks(2)
        .map(|c| u8::from_str_radix(std::str::from_utf8(c).ok()?, 16).ok())
        .collect()
}

/// Connects over TLS, verifying the server against a CA, offering `h2` and
/// the join protocol of a token.
#[derive(Clone)]
pub struct JoinConnector {
    config: Arc<rustls::ClientConfig>,
    server_name: ServerName<'static>,
    from: Option<std::net::IpAddr>,
}

impl JoinConnector {
    /// A connector for a server named `server_name` with a certificate from
    /// the CA in `ca_pem`, naming `token`.
    pub fn new(ca_pem: &str, server_name: &str, token: &str) -> Result<JoinConnector, String> {
        let config =
            crate::tls::client_config(ca_pem, None, vec![b"h2".to_vec(), join_protocol(token)])?;
        let server_name = ServerName::try_from(server_name.to_string())
            .map_err(|e| format!("server name {server_name:?}: {e}"))?;
        Ok(JoinConnector {
            config,
            server_name,
            from: None,
        })
    }

    /// The same, connecting from the local address `ip`.
    pub fn from_address(mut self, ip: std::net::IpAddr) -> JoinConnector {
        self.from = Some(ip);
        self
    }
}

/// The address to give `Endpoint` for a gateway at `address` when a
/// [`JoinConnector`] does the TLS: the channel itself then speaks plain
/// HTTP/2 over it (tonic refuses an `https` address without TLS of its own).
pub fn endpoint_address(address: &str) -> String {
    match address.strip_prefix("https://") {
        Some(rest) => format!("http://{rest}"),
        None => address.to_string(),
    }
}

type Connecting = Pin<
    Box<
        dyn Future<
                Output = std::io::Result<
                    hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
                >,
            > + Send,
    >,
>;

impl tower_service::Service<http::Uri> for JoinConnector {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.config.clone());
        let (name, from) = (self.server_name.clone(), self.from);
        Box::pin(async move {
            let tls = crate::tls::connect(connector, name, &uri, from).await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_join_protocol_names_its_tokens_hash_and_nothing_else_does() {
        let p = join_protocol(" tok-123 ");
        assert!(p.len() <= 255, "an ALPN protocol is at most 255 bytes");
        assert_eq!(named_token_hash(&p), Some(token_hash("tok-123")));
        assert_eq!(named_token_hash(b"h2"), None);
        assert_eq!(named_token_hash(b"strata-join/abc"), None);
        let mut odd = p.clone();
        *odd.last_mut().unwrap() = b'g';
        assert_eq!(named_token_hash(&odd), None);
    }

    #[test]
    fn the_endpoint_address_drops_only_the_tls_scheme() {
        assert_eq!(endpoint_address("https://gw1:7443"), "http://gw1:7443");
        assert_eq!(endpoint_address("http://gw1:7443"), "http://gw1:7443");
    }
}
