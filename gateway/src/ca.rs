//! The region's node CA: creating it, signing node certificates from CSRs,
//! issuing the gateway's own serving certificate, and reading a node's
//! identity back from its certificate.
//!
//! A node certificate names the node twice: as the subject's common name and
//! as the URI `urn:strata:node:<id>` in its subject alternative names. The
//! gateway trusts only the URI (and checks the common name agrees).

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use std::io::Write;
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
const NODE_URI_PREFIX: &str = "urn:strata:node:";
const OPERATOR_URI_PREFIX: &str = "urn:strata:operator:";
/// Auditors of the audit endpoint.
const AUDITOR_URI_PREFIX: &str = "urn:strata:auditor:";

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} already exists; refusing to replace a CA (nodes trust it)")]
    Exists(PathBuf),
    #[error("certificate: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("{0}")]
    Invalid(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CaError + '_ {
    move |source| CaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a file readable by its owner only.
pub fn write_private(path: &Path, contents: &[u8]) -> Result<(), CaError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io(path))?;
    f.write_all(contents).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

fn serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .expect("system randomness");
    // Positive and without a leading zero byte, so DER keeps all 16 bytes
    // and the serial reads back exactly as it was written.
    bytes[0] = (bytes[0] & 0x7f) | 0x01;
    SerialNumber::from_slice(&bytes)
}

/// A serial as stored and compared: lowercase hex without leading zero
/// bytes (as DER has it).
pub fn serial_hex(bytes: &[u8]) -> String {
    let start = bytes
        .iter()
        .position(|b| *b != 0)
        .unwrap_or(bytes.len().saturating_sub(1));
    events::hex(&bytes[start..])
}

/// Creates the CA under `dir`: `ca.pem` (the certificate, 0644) and `ca.key`
/// (its private key, 0600). Refuses to replace an existing one.
pub fn init(dir: &Path, region: &str) -> Result<PathBuf, CaError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
    for p in [&cert_path, &key_path] {
        if p.exists() {
            return Err(CaError::Exists(p.clone()));
        }
    }
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("Strata node CA ({region})"));
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.not_before = OffsetDateTime::now_utc() - Duration::hours(1);
    params.not_after = OffsetDateTime::now_utc() + Duration::days(3650);
    params.serial_number = Some(serial());
    let cert = params.self_signed(&key)?;
    write_private(&key_path, key.serialize_pem().as_bytes())?;
    std::fs::write(&cert_path, cert.pem()).map_err(io(&cert_path))?;
    Ok(cert_path)
}

/// A certificate signed for a node.
#[derive(Debug, Clone)]
pub struct Signed {
    pub certificate_pem: String,
    /// Lowercase hex of the serial number.
    pub serial: String,
    pub not_after: std::time::SystemTime,
}

/// Parameters of a client certificate naming `name` (common name and the
/// URI `prefix` + name), valid for `days` from now.
fn client_params(
    name: &str,
    prefix: &str,
    what: &str,
    days: i64,
) -> Result<CertificateParams, CaError> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    params.subject_alt_names =
        vec![SanType::URI(format!("{prefix}{name}").try_into().map_err(
            |_| CaError::Invalid(format!("{what} {name:?} cannot be named in a URI")),
        )?)];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::minutes(5);
    params.not_after = now + Duration::days(days);
    Ok(params)
}

/// The loaded CA.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ca { .. }")
    }
}

impl Ca {
    pub fn load(dir: &Path) -> Result<Ca, CaError> {
        let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
        let cert_pem = std::fs::read_to_string(&cert_path).map_err(io(&cert_path))?;
        let key_pem = std::fs::read_to_string(&key_path).map_err(io(&key_path))?;
        let key = KeyPair::from_pem(&key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)?;
        Ok(Ca { issuer, cert_pem })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Signs a certificate naming `node` for the key in `csr_pem` (whatever
    /// names the CSR asks for are ignored), valid for `days`.
    pub fn sign_node(&self, node: &str, csr_pem: &str, days: i64) -> Result<Signed, CaError> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| CaError::Invalid(format!("not a certificate signing request: {e}")))?;
        let mut params = client_params(node, NODE_URI_PREFIX, "node id", days)?;
        let serial = serial();
        let serial_hex = serial_hex(serial.as_ref());
        params.serial_number = Some(serial);
        let cert = params.signed_by(&csr.public_key, &self.issuer)?;
        Ok(Signed {
            certificate_pem: cert.pem(),
            serial: serial_hex,
            not_after: std::time::SystemTime::UNIX_EPOCH
                + std::time::Duration::from_secs(params.not_after.unix_timestamp().max(0) as u64),
        })
    }

    /// A serving certificate and key for a gateway, for these DNS names or
    /// IP addresses, valid 30 days.
    pub fn server_identity(&self, names: &[String]) -> Result<(String, String), CaError> {
        self.server_identity_for(names, std::time::Duration::from_secs(30 * 24 * 3600))
    }

    /// The same, valid for `validity`.
    pub fn server_identity_for(
        &self,
        names: &[String],
        validity: std::time::Duration,
    ) -> Result<(String, String), CaError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names.to_vec())?;
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "Strata gateway");
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::minutes(5);
        params.not_after = now + Duration::seconds(validity.as_secs().max(1) as i64);
        params.serial_number = Some(serial());
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A key and a certificate for `node`, made here rather than through a
    /// join (provisioning in bulk, tests). Gateways accept it only once it is
    /// recorded (`identity::record`).
    pub fn issue_node(&self, node: &str, days: i64) -> Result<(Signed, String), CaError> {
        let key = KeyPair::generate()?;
        let csr = CertificateParams::new(Vec::<String>::new())?.serialize_request(&key)?;
        let signed = self.sign_node(node, &csr.pem()?, days)?;
        Ok((signed, key.serialize_pem()))
    }

    /// A certificate and key for an operator or a tool using the client API
    /// (`urn:strata:operator:<name>`).
    pub fn issue_operator(&self, name: &str, days: i64) -> Result<(String, String), CaError> {
        let key = KeyPair::generate()?;
        let mut params = client_params(name, OPERATOR_URI_PREFIX, "operator name", days)?;
        params.serial_number = Some(serial());
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A certificate and key for an auditor of the audit endpoint
    /// (`urn:strata:auditor:<name>`).
    pub fn issue_auditor(&self, name: &str, days: i64) -> Result<(String, String), CaError> {
        let key = KeyPair::generate()?;
        let mut params = client_params(name, AUDITOR_URI_PREFIX, "auditor name", days)?;
        params.serial_number = Some(serial());
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A client certificate for an operator or a test, signed by this CA
    /// (not recorded anywhere: gateways refuse it for sessions).
    pub fn client_identity(&self, node: &str) -> Result<(String, String), CaError> {
        let (signed, key) = self.issue_node(node, 1)?;
        Ok((signed.certificate_pem, key))
    }
}

/// Who a client certificate names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeIdentity {
    pub node: String,
    /// Lowercase hex, as stored at signing.
    pub serial: String,
}

/// Who a client certificate names among its URIs: `("operator", name)` for
/// `urn:strata:operator:<name>`, else `("auditor", name)` for
/// `urn:strata:auditor:<name>`.
pub fn holder(
    cert: &x509_parser::certificate::X509Certificate<'_>,
) -> Option<(&'static str, String)> {
    let san = cert.subject_alternative_name().ok()??;
    let uris = || {
        san.value.general_names.iter().filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => Some(*u),
            _ => None,
        })
    };
    [
        ("operator", OPERATOR_URI_PREFIX),
        ("auditor", AUDITOR_URI_PREFIX),
    ]
    .into_iter()
    .find_map(|(kind, prefix)| {
        uris()
            .find_map(|u| u.strip_prefix(prefix))
            .map(|name| (kind, name.to_string()))
    })
}

/// Reads the node id and serial from a node certificate (DER).
pub fn node_identity(der: &[u8]) -> Result<NodeIdentity, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("unreadable client certificate: {e}"))?;
    let mut uri_node = None;
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::URI(u) = name {
                if let Some(n) = u.strip_prefix(NODE_URI_PREFIX) {
                    uri_node = Some(n.to_string());
                }
            }
        }
    }
    let node = uri_node.ok_or("the client certificate names no node (urn:strata:node:...)")?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|c| c.as_str().ok());
    if cn != Some(node.as_str()) {
        return Err(format!(
            "the client certificate's common name {cn:?} disagrees with its node {node:?}"
        ));
    }
    Ok(NodeIdentity {
        node,
        serial: serial_hex(cert.tbs_certificate.raw_serial()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_certificate_names_its_node_and_the_ca_key_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("strata-ca-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        init(&dir, "test").unwrap();
        assert!(matches!(init(&dir, "test"), Err(CaError::Exists(_))));
        let mode = std::fs::metadata(dir.join(CA_KEY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let ca = Ca::load(&dir).unwrap();
        let key = KeyPair::generate().unwrap();
        // Whatever the CSR asks for, the certificate names the node given.
        let csr = CertificateParams::new(vec!["evil.example".to_string()])
            .unwrap()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        let signed = ca.sign_node("node-7", &csr, 30).unwrap();
        let der = rustls_pem(&signed.certificate_pem);
        let id = node_identity(&der).unwrap();
        assert_eq!(id.node, "node-7");
        assert_eq!(id.serial, signed.serial);
        // Every serial reads back as written (a leading zero byte once broke
        // one certificate in 256).
        for i in 0..600 {
            let (signed, _) = ca.issue_node(&format!("n{i}"), 1).unwrap();
            let id = node_identity(&rustls_pem(&signed.certificate_pem)).unwrap();
            assert_eq!(id.serial, signed.serial);
        }
        assert_eq!(serial_hex(&[0, 0, 0x1f]), "1f");
        assert!(ca.sign_node("n", "garbage", 1).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn rustls_pem(pem: &str) -> Vec<u8> {
        let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
        p.contents
    }
}
