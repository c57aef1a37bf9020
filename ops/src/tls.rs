//! A serving certificate (the gateway's, the audit endpoint's), swapped for a renewed one
//! while it runs (every TLS handshake asks for the current one).

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
