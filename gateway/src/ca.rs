//! The region's CA: creating it, signing node certificates from CSRs,
//! issuing serving certificates, and reading a node's identity back from
//! its certificate.
//!
//! Two levels: an offline root (`ca.pem`, which everyone trusts, and
//! `root.key`, kept off the serving hosts) and an issuing intermediate
//! (`issuing.pem`, `issuing.key`) that gateways and audit hosts hold. The
//! intermediate signs node and serving certificates (each served with the
//! intermediate after it); operator and auditor certificates are signed by
//! the root alone, and the gateway and audit endpoint honour an operator or
//! auditor name only in a certificate the root issued, so a stolen issuing
//! key cannot mint one. A folder made before the split (`ca.pem` and
//! `ca.key`) still loads: its one key is the root and signs everything.
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

/// The root certificate: the trust anchor nodes, operators and auditors use.
pub const CA_CERT: &str = "ca.pem";
/// A single-level CA's key (folders made before the split).
pub const CA_KEY: &str = "ca.key";
/// The root's key: operator and auditor certificates; keep it offline.
pub const ROOT_KEY: &str = "root.key";
/// The issuing intermediate: node and serving certificates.
pub const ISSUING_CERT: &str = "issuing.pem";
pub const ISSUING_KEY: &str = "issuing.key";
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
    #[error("the root key ({0}) is not here: operator and auditor certificates are issued where the root is kept, offline")]
    NoRoot(PathBuf),
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
/// Whether the CSR asks for the key the certificate (the first in
/// `cert_pem`) is for. Unreadable input is not the same key.
pub fn same_public_key(csr_pem: &str, cert_pem: &str) -> bool {
    use x509_parser::prelude::FromDer;
    let csr_key = x509_parser::pem::parse_x509_pem(csr_pem.as_bytes())
        .ok()
        .and_then(|(_, pem)| {
            x509_parser::certification_request::X509CertificationRequest::from_der(&pem.contents)
                .ok()
                .map(|(_, r)| r.certification_request_info.subject_pki.raw.to_vec())
        });
    let cert_key = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .ok()
        .and_then(|(_, pem)| {
            pem.parse_x509()
                .ok()
                .map(|c| c.tbs_certificate.subject_pki.raw.to_vec())
        });
    matches!((csr_key, cert_key), (Some(a), Some(b)) if a == b)
}

pub fn serial_hex(bytes: &[u8]) -> String {
    let start = bytes
        .iter()
        .position(|b| *b != 0)
        .unwrap_or(bytes.len().saturating_sub(1));
    events::hex(&bytes[start..])
}

/// Creates the CA under `dir`: the root (`ca.pem`, 0644, and `root.key`,
/// 0600) and the issuing intermediate it signs (`issuing.pem`,
/// `issuing.key`). Refuses to replace an existing one.
pub fn init(dir: &Path, region: &str) -> Result<PathBuf, CaError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let paths = [CA_CERT, CA_KEY, ROOT_KEY, ISSUING_CERT, ISSUING_KEY].map(|f| dir.join(f));
    for p in &paths {
        if p.exists() {
            return Err(CaError::Exists(p.clone()));
        }
    }
    let now = OffsetDateTime::now_utc();
    let root_key = KeyPair::generate()?;
    let mut root = CertificateParams::default();
    root.distinguished_name = DistinguishedName::new();
    root.distinguished_name
        .push(DnType::CommonName, format!("Strata root CA ({region})"));
    root.is_ca = IsCa::Ca(BasicConstraints::Constrained(1));
    root.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    root.not_before = now - Duration::hours(1);
    root.not_after = now + Duration::days(3650);
    root.serial_number = Some(serial());
    let root_cert = root.self_signed(&root_key)?;
    let root_issuer = Issuer::new(root, &root_key);
    let issuing_key = KeyPair::generate()?;
    let mut issuing = CertificateParams::default();
    issuing.distinguished_name = DistinguishedName::new();
    issuing
        .distinguished_name
        .push(DnType::CommonName, format!("Strata issuing CA ({region})"));
    issuing.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    issuing.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    issuing.not_before = now - Duration::hours(1);
    issuing.not_after = now + Duration::days(1825);
    issuing.serial_number = Some(serial());
    let issuing_cert = issuing.signed_by(&issuing_key, &root_issuer)?;
    write_private(&dir.join(ROOT_KEY), root_key.serialize_pem().as_bytes())?;
    write_private(
        &dir.join(ISSUING_KEY),
        issuing_key.serialize_pem().as_bytes(),
    )?;
    let issuing_path = dir.join(ISSUING_CERT);
    std::fs::write(&issuing_path, issuing_cert.pem()).map_err(io(&issuing_path))?;
    let cert_path = dir.join(CA_CERT);
    std::fs::write(&cert_path, root_cert.pem()).map_err(io(&cert_path))?;
    Ok(cert_path)
}

/// Whether `dir` holds a CA that can sign (an issuing intermediate, or a
/// single-level CA's key).
pub fn exists(dir: &Path) -> bool {
    dir.join(CA_CERT).exists() && (dir.join(ISSUING_KEY).exists() || dir.join(CA_KEY).exists())
}

/// Copies what a gateway or audit host needs (the root certificate and the
/// issuing intermediate with its key, not the root's key) to `out`.
pub fn export_issuing(dir: &Path, out: &Path) -> Result<(), CaError> {
    if !dir.join(ISSUING_KEY).exists() {
        return Err(CaError::Invalid(format!(
            "{} has no issuing intermediate (a CA made before the split signs with its one key)",
            dir.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(io(out))?;
    for f in [CA_CERT, ISSUING_CERT] {
        let (from, to) = (dir.join(f), out.join(f));
        std::fs::copy(&from, &to).map_err(io(&to))?;
    }
    let key_path = dir.join(ISSUING_KEY);
    let key = std::fs::read(&key_path).map_err(io(&key_path))?;
    write_private(&out.join(ISSUING_KEY), &key)
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
    /// Signs node and serving certificates: the intermediate (or, before
    /// the split, the one key).
    issuer: Issuer<'static, KeyPair>,
    /// Sent after every certificate the issuer signs (empty before the split).
    chain_pem: String,
    /// The root, where its key is here.
    root: Option<Issuer<'static, KeyPair>>,
    root_subject: Vec<u8>,
    dir: PathBuf,
    cert_pem: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ca { .. }")
    }
}

impl Ca {
    pub fn load(dir: &Path) -> Result<Ca, CaError> {
        let read = |f: &str| {
            let p = dir.join(f);
            std::fs::read_to_string(&p).map_err(io(&p))
        };
        let cert_pem = read(CA_CERT)?;
        let (issuer, chain_pem, root) = if dir.join(ISSUING_KEY).exists() {
            let chain = read(ISSUING_CERT)?;
            let issuer = Issuer::from_ca_cert_pem(&chain, KeyPair::from_pem(&read(ISSUING_KEY)?)?)?;
            let root = match dir.join(ROOT_KEY).exists() {
                true => Some(Issuer::from_ca_cert_pem(
                    &cert_pem,
                    KeyPair::from_pem(&read(ROOT_KEY)?)?,
                )?),
                false => None,
            };
            (issuer, chain, root)
        } else {
            let key = read(CA_KEY)?;
            let issuer = Issuer::from_ca_cert_pem(&cert_pem, KeyPair::from_pem(&key)?)?;
            let root = Issuer::from_ca_cert_pem(&cert_pem, KeyPair::from_pem(&key)?)?;
            (issuer, String::new(), Some(root))
        };
        let root_subject = subject_of(&cert_pem)?;
        Ok(Ca {
            issuer,
            chain_pem,
            root,
            root_subject,
            dir: dir.to_path_buf(),
            cert_pem,
        })
    }

    /// Whether the root itself issued this certificate (DER): the only
    /// certificates whose operator or auditor name is honoured.
    pub fn issued_by_root(&self, der: &[u8]) -> bool {
        issued_by(&self.root_subject, der)
    }

    fn root(&self) -> Result<&Issuer<'static, KeyPair>, CaError> {
        self.root
            .as_ref()
            .ok_or_else(|| CaError::NoRoot(self.dir.join(ROOT_KEY)))
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Signs a certificate naming `node` for the key in `csr_pem` (whatever
    /// names the CSR asks for are ignored), valid for `days`.
    pub fn sign_node(&self, node: &str, csr_pem: &str, days: i64) -> Result<Signed, CaError> {
        self.sign_node_for(
            node,
            csr_pem,
            std::time::Duration::from_secs(days.max(1) as u64 * 86_400),
        )
    }

    /// The same, valid for `validity`.
    pub fn sign_node_for(
        &self,
        node: &str,
        csr_pem: &str,
        validity: std::time::Duration,
    ) -> Result<Signed, CaError> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| CaError::Invalid(format!("not a certificate signing request: {e}")))?;
        let mut params = client_params(node, NODE_URI_PREFIX, "node id", 1)?;
        // Backdated for clocks a little behind, by at most a tenth of the
        // validity, so that "how much of it is left" stays meaningful for
        // short ones.
        let now = OffsetDateTime::now_utc();
        let secs = validity.as_secs().max(1) as i64;
        params.not_before = now - Duration::seconds((secs / 10).min(300));
        params.not_after = now + Duration::seconds(secs);
        let serial = serial();
        let serial_hex = serial_hex(serial.as_ref());
        params.serial_number = Some(serial);
        let cert = params.signed_by(&csr.public_key, &self.issuer)?;
        Ok(Signed {
            certificate_pem: cert.pem() + &self.chain_pem,
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
        Ok((cert.pem() + &self.chain_pem, key.serialize_pem()))
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
        let cert = params.signed_by(&key, self.root()?)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A certificate and key for an auditor of the audit endpoint
    /// (`urn:strata:auditor:<name>`).
    pub fn issue_auditor(&self, name: &str, days: i64) -> Result<(String, String), CaError> {
        let key = KeyPair::generate()?;
        let mut params = client_params(name, AUDITOR_URI_PREFIX, "auditor name", days)?;
        params.serial_number = Some(serial());
        let cert = params.signed_by(&key, self.root()?)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A client certificate for an operator or a test, signed by this CA
    /// (not recorded anywhere: gateways refuse it for sessions).
    pub fn client_identity(&self, node: &str) -> Result<(String, String), CaError> {
        let (signed, key) = self.issue_node(node, 1)?;
        Ok((signed.certificate_pem, key))
    }
}

/// When the serving certificate of each server of the process expires, on
/// `/metrics` (alert well before: renewal failed).
fn serving_expiry() -> &'static ops::metrics::prometheus::GaugeVec {
    use ops::metrics::prometheus::{GaugeVec, Opts};
    static G: std::sync::OnceLock<GaugeVec> = std::sync::OnceLock::new();
    G.get_or_init(|| {
        let g = GaugeVec::new(
            Opts::new(
                "strata_serving_certificate_expiry_timestamp_seconds",
                "When the certificate this server serves expires (Unix time); renewed once a third of its validity is left.",
            ),
            &["server"],
        )
        .expect("valid gauge");
        ops::metrics::register(Box::new(g.clone()));
        g
    })
}

/// Makes a new serving certificate (from the CA in `dir`, for `names`,
/// valid `validity`) and hands it to `serve` whenever a third of the current
/// one's validity is left, so it never expires while the server runs. A
/// failure (the folder unreadable, say) is logged and tried again soon; the
/// current certificate is served meanwhile.
pub async fn keep_renewed(
    dir: PathBuf,
    names: Vec<String>,
    validity: std::time::Duration,
    what: &'static str,
    serve: impl Fn(&str, &str) -> Result<(), String>,
) {
    let mut wait = validity * 2 / 3;
    let expiry = serving_expiry().with_label_values(&[what]);
    let expires = |from: std::time::SystemTime| {
        (from + validity)
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    // The certificate served now was made when the server started.
    expiry.set(expires(std::time::SystemTime::now()));
    loop {
        tokio::time::sleep(wait).await;
        let made = Ca::load(&dir)
            .and_then(|ca| ca.server_identity_for(&names, validity))
            .map_err(|e| e.to_string())
            .and_then(|(cert, key)| serve(&cert, &key));
        match made {
            Ok(()) => {
                expiry.set(expires(std::time::SystemTime::now()));
                tracing::info!(server = what, valid_for = %humantime::format_duration(validity), "serving certificate renewed");
                wait = validity * 2 / 3;
            }
            Err(e) => {
                tracing::error!(server = what, error = %e, "could not renew the serving certificate; trying again");
                wait = (validity / 30).clamp(
                    std::time::Duration::from_millis(100),
                    std::time::Duration::from_secs(60),
                );
            }
        }
    }
}

/// The raw subject name of the first certificate in `pem`.
fn subject_of(pem: &str) -> Result<Vec<u8>, CaError> {
    let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .map_err(|e| CaError::Invalid(format!("CA certificate: {e}")))?;
    let cert = p
        .parse_x509()
        .map_err(|e| CaError::Invalid(format!("CA certificate: {e}")))?;
    Ok(cert.subject().as_raw().to_vec())
}

/// Whether the certificate (DER) names `subject` (raw) as its issuer. The
/// TLS layer has already verified its chain to the root; this says whether
/// the root signed it itself rather than through the intermediate.
pub fn issued_by(subject: &[u8], der: &[u8]) -> bool {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, c)| c.issuer().as_raw() == subject)
        .unwrap_or(false)
}

/// The raw subject of the root in `ca_pem`, for [`issued_by`].
pub fn root_subject(ca_pem: &str) -> Result<Vec<u8>, CaError> {
    subject_of(ca_pem)
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
        for key in [ROOT_KEY, ISSUING_KEY] {
            let mode = std::fs::metadata(dir.join(key))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{key}");
        }
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
        // Node certificates come from the intermediate, served with it;
        // operators' from the root.
        assert_eq!(
            signed.certificate_pem.matches("BEGIN CERTIFICATE").count(),
            2
        );
        assert!(!ca.issued_by_root(&der));
        let (op, _) = ca.issue_operator("alice", 1).unwrap();
        assert!(ca.issued_by_root(&rustls_pem(&op)));
        // A gateway's folder: no root key, so no operator certificates.
        let gw = dir.join("gateway");
        export_issuing(&dir, &gw).unwrap();
        assert!(!gw.join(ROOT_KEY).exists());
        let at_gateway = Ca::load(&gw).unwrap();
        assert!(at_gateway.sign_node("n2", &csr, 1).is_ok());
        assert!(matches!(
            at_gateway.issue_operator("mallory", 1),
            Err(CaError::NoRoot(_))
        ));
        assert!(matches!(
            at_gateway.issue_auditor("mallory", 1),
            Err(CaError::NoRoot(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn rustls_pem(pem: &str) -> Vec<u8> {
        let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
        p.contents
    }
}
