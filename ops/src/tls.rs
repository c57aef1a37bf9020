//! A serving certificate (the gateway's, the audit endpoint's, the
//! console's), swapped for a renewed one while it runs (every TLS handshake
//! asks for the current one), and the server configuration around it; the
//! client side: a configuration that verifies a server against the
//! region's CA (presenting a certificate of its own where it has one), and
//! a TLS connection over TCP with it.

use std::sync::{Arc, RwLock};
use tokio_rustls::rustls;

#[derive(Debug)]
pub struct ServingCert {
    current: RwLock<Arc<rustls::sign::CertifiedKey>>,
}

impl ServingCert {
    pub fn new(cert_pem: &str, key_pem: &str) -> Result<Arc<ServingCert>, String> {
        Ok(Arc::new(ServingCert {
            current: RwLock::new(Arc::new(certified(cert_pem, key_pem)?)),
        }))
    }

    /// Serves this certificate to every handshake from now on.
    pub fn replace(&self, cert_pem: &str, key_pem: &str) -> Result<(), String> {
        let c = certified(cert_pem, key_pem)?;
        *self.current.write().expect("serving cert lock") = Arc::new(c);
        Ok(())
    }
}

fn certified(cert_pem: &str, key_pem: &str) -> Result<rustls::sign::CertifiedKey, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("serving certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("serving key: {e}"))?;
    let key = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| format!("serving key: {e}"))?;
    Ok(rustls::sign::CertifiedKey::new(certs, key))
}

impl rustls::server::ResolvesServerCert for ServingCert {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.current.read().expect("serving cert lock").clone())
    }
}

/// A server configuration: this serving certificate, client certificates
/// optional but checked against `client_ca_pem` when presented, and these
/// ALPN protocols.
pub fn server_config(
    cert: Arc<ServingCert>,
    client_ca_pem: &str,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ServerConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(client_ca_pem.as_bytes()) {
        roots
            .add(c.map_err(|e| format!("client CA: {e}"))?)
            .map_err(|e| format!("client CA: {e}"))?;
    }
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .allow_unauthenticated()
            .build()
            .map_err(|e| e.to_string())?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(cert);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A client configuration: servers verified against the CA in `ca_pem`,
/// presenting `identity` (certificate chain and key, PEM) when given,
/// offering these ALPN protocols.
pub fn client_config(
    ca_pem: &str,
    identity: Option<(&str, &str)>,
    alpn: Vec<Vec<u8>>,
) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots
            .add(c.map_err(|e| format!("the region's CA: {e}"))?)
            .map_err(|e| format!("the region's CA: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let mut config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert_pem, key_pem)) => {
            let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("certificate: {e}"))?;
            let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
                .map_err(|e| format!("key: {e}"))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| format!("certificate and key: {e}"))?
        }
    };
    config.alpn_protocols = alpn;
    Ok(Arc::new(config))
}

/// TLS over a new TCP connection (no Nagle delay) to the host and port of
/// `uri` (443 when it names none), from the local address `from` when
/// given.
pub async fn connect(
    connector: tokio_rustls::TlsConnector,
    name: rustls::pki_types::ServerName<'static>,
    uri: &http::Uri,
    from: Option<std::net::IpAddr>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use tokio::net::TcpStream;
    let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_string());
    let host = uri.host().ok_or_else(|| bad("no host in the address"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(443);
    let tcp = match from {
        None => TcpStream::connect((host, port)).await?,
        Some(ip) => {
            let to = tokio::net::lookup_host((host, port))
                .await?
                .find(|a| a.is_ipv4() == ip.is_ipv4())
                .ok_or_else(|| bad("no address of the host's family"))?;
            let socket = if ip.is_ipv4() {
                tokio::net::TcpSocket::new_v4()?
            } else {
                tokio::net::TcpSocket::new_v6()?
            };
            socket.bind(std::net::SocketAddr::new(ip, 0))?;
            socket.connect(to).await?
        }
    };
    tcp.set_nodelay(true)?;
    connector.connect(name, tcp).await
}
