//! The node's identity on disk: its key, its certificate, the region's CA
//! and its pool. Joining (once, with a token) and renewing the certificate
//! over the session before it expires (no token).
//!
//! A renewed key and certificate are written as `node.next.key` and then
//! `node.next.pem` (through a temporary file and a rename, so its presence
//! means both are whole), then moved over `node.key` and `node.pem` in that
//! order; [`load`] finishes a move it finds half done, so a crash at any
//! point leaves a key and certificate that match.

use crate::config::{io, DaemonConfig, DaemonError};
use crate::proto::{join_client::JoinClient, JoinRequest};
use std::path::Path;
use std::time::{Duration, SystemTime};
use tonic::transport::Endpoint;

/// The node's identity on disk.
pub struct Credentials {
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
    pub pool: String,
}

pub(crate) fn write_private(path: &Path, data: &[u8]) -> Result<(), DaemonError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io(path))?;
    f.write_all(data).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

pub(crate) fn load(dir: &Path) -> Result<Option<Credentials>, DaemonError> {
    promote(dir)?;
    let cert = dir.join("node.pem");
    if !cert.exists() {
        return Ok(None);
    }
    let read = |name: &str| {
        let p = dir.join(name);
        std::fs::read_to_string(&p).map_err(io(&p))
    };
    Ok(Some(Credentials {
        cert_pem: read("node.pem")?,
        key_pem: read("node.key")?,
        ca_pem: read("ca.pem")?,
        pool: read("pool").unwrap_or_default().trim().to_string(),
    }))
}

/// Joins the region if this node has no certificate yet; returns its
/// credentials either way. Joins through the node's home gateway.
pub async fn ensure_joined(config: &DaemonConfig) -> Result<Credentials, DaemonError> {
    ensure_joined_at(config, 0).await
}

/// The same on the `attempt`th try: each try goes to the next gateway after
/// the home one, so a fleet's joins spread over the gateways as its
/// sessions do, and a gateway that is down does not keep a node out.
pub async fn ensure_joined_at(
    config: &DaemonConfig,
    attempt: usize,
) -> Result<Credentials, DaemonError> {
    let dir = config.data_dir.clone();
    let known = on_disk(&dir, |dir| {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        load(dir)
    })
    .await?;
    if let Some(c) = known {
        return Ok(c);
    }
    let (Some(token), Some(ca_pem)) = (&config.token, &config.ca_pem) else {
        return Err(DaemonError::NeedsJoin);
    };
    // The key is kept until the join is answered, so a retry after a lost
    // answer asks with the same key and is answered with the same
    // certificate (the token is spent by then).
    let key = on_disk(&dir, |dir| {
        let join_key = dir.join("join.key");
        match std::fs::read_to_string(&join_key)
            .ok()
            .and_then(|pem| rcgen::KeyPair::from_pem(&pem).ok())
        {
            Some(k) => Ok(k),
            None => {
                let k =
                    rcgen::KeyPair::generate().map_err(|e| DaemonError::Other(e.to_string()))?;
                write_private(&join_key, k.serialize_pem().as_bytes())?;
                Ok(k)
            }
        }
    })
    .await?;
    let csr = csr_for(&key)?;
    if config.gateways.is_empty() {
        return Err(DaemonError::Other("no gateway given".into()));
    }
    // The ClientHello names the token (its hash), so that a gateway
    // rationing strangers' handshakes lets this node through.
    let connector = ops::join_alpn::JoinConnector::new(ca_pem, &config.server_name, token)
        .map_err(DaemonError::Other)?;
    let first = &config.gateways[(config.home() + attempt) % config.gateways.len()];
    let channel = Endpoint::from_shared(ops::join_alpn::endpoint_address(first))
        .map_err(|e| DaemonError::Other(format!("gateway address {first:?}: {e}")))?
        .connect_timeout(Duration::from_secs(10))
        .connect_with_connector(connector)
        .await
        .map_err(|e| DaemonError::Unreachable(format!("connect to the gateway {first}: {e}")))?;
    let mut client = JoinClient::new(channel);
    let asked = client.join(JoinRequest {
        token: token.clone(),
        node_id: config.node_id.clone(),
        csr_pem: csr,
    });
    let resp = tokio::time::timeout(JOIN_TIMEOUT, asked)
        .await
        .map_err(|_| DaemonError::Unreachable(format!("join: no answer within {JOIN_TIMEOUT:?}")))?
        .map_err(join_failure)?
        .into_inner();
    let key_pem = key.serialize_pem();
    let credentials = on_disk(&dir, move |dir| {
        write_private(&dir.join("node.key"), key_pem.as_bytes())?;
        std::fs::write(dir.join("ca.pem"), &resp.ca_pem).map_err(io(dir))?;
        std::fs::write(dir.join("pool"), &resp.pool).map_err(io(dir))?;
        // The certificate last: its presence means "joined".
        std::fs::write(dir.join("node.pem"), &resp.certificate_pem).map_err(io(dir))?;
        let _ = std::fs::remove_file(dir.join("join.key"));
        load(dir)?.ok_or(DaemonError::NeedsJoin)
    })
    .await?;
    tracing::info!(node = %config.node_id, pool = %credentials.pool, "joined the region");
    Ok(credentials)
}

/// Runs `f` on the data dir `dir` on tokio's blocking threads: its writes
/// are synced to the disk, and a disk that takes its time must not hold up
/// the runtime (where a fleet of daemons shares one, every other session).
async fn on_disk<T, F>(dir: &Path, f: F) -> Result<T, DaemonError>
where
    T: Send + 'static,
    F: FnOnce(&Path) -> Result<T, DaemonError> + Send + 'static,
{
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || f(&dir))
        .await
        .map_err(|e| DaemonError::Other(format!("a write to the data dir stopped: {e}")))?
}

/// Longest wait for the answer to a join. A join asked again with the same
/// key is answered with the same certificate, so giving up on one that was
/// in fact answered loses nothing.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// What a failed join means: only an answer the gateway gave on purpose
/// (the token, the id, the request refused) is final; whatever the network
/// or a busy gateway did (a connection closed before the request went out
/// reads as `Cancelled`, a reset as `Unavailable` or `Unknown`) is tried
/// again. Exhaustive on purpose: a new code must be classified here.
pub fn join_failure(status: tonic::Status) -> DaemonError {
    use tonic::Code;
    match status.code() {
        Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::PermissionDenied
        | Code::Unauthenticated
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented => DaemonError::JoinRefused(status.message().to_string()),
        Code::Ok
        | Code::Cancelled
        | Code::Unknown
        | Code::DeadlineExceeded
        | Code::ResourceExhausted
        | Code::Aborted
        | Code::Internal
        | Code::Unavailable
        | Code::DataLoss => {
            DaemonError::Unreachable(format!("join: {}: {}", status.code(), status.message()))
        }
    }
}

/// Moves a renewed key and certificate into place, or finishes a move a
/// crash interrupted.
fn promote(dir: &Path) -> Result<(), DaemonError> {
    let (next_pem, next_key) = (dir.join("node.next.pem"), dir.join("node.next.key"));
    if !next_pem.exists() {
        return Ok(());
    }
    if next_key.exists() {
        std::fs::rename(&next_key, dir.join("node.key")).map_err(io(&next_key))?;
    }
    std::fs::rename(&next_pem, dir.join("node.pem")).map_err(io(&next_pem))
}

/// Writes a renewed key and certificate and moves them into place.
pub(crate) fn store_renewed(dir: &Path, key_pem: &str, cert_pem: &str) -> Result<(), DaemonError> {
    write_private(&dir.join("node.next.key"), key_pem.as_bytes())?;
    let tmp = dir.join("node.next.pem.tmp");
    write_private(&tmp, cert_pem.as_bytes())?;
    std::fs::rename(&tmp, dir.join("node.next.pem")).map_err(io(&tmp))?;
    promote(dir)
}

/// A new key and a CSR for it.
pub(crate) fn new_csr() -> Result<(rcgen::KeyPair, String), DaemonError> {
    let key = rcgen::KeyPair::generate().map_err(|e| DaemonError::Other(e.to_string()))?;
    let csr = csr_for(&key)?;
    Ok((key, csr))
}

/// A certificate signing request for `key`.
fn csr_for(key: &rcgen::KeyPair) -> Result<String, DaemonError> {
    rcgen::CertificateParams::new(Vec::<String>::new())
        .and_then(|p| p.serialize_request(key))
        .and_then(|c| c.pem())
        .map_err(|e| DaemonError::Other(e.to_string()))
}

/// Whether the certificate (the first in `cert_pem`) has less than a third
/// of its validity left at `now`; an unreadable one is not renewed here.
pub fn renewal_due(cert_pem: &str, now: SystemTime) -> bool {
    let Ok((_, pem)) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes()) else {
        return false;
    };
    let Ok(cert) = pem.parse_x509() else {
        return false;
    };
    let at = |t: x509_parser::time::ASN1Time| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(t.timestamp().max(0) as u64)
    };
    let (from, to) = (
        at(cert.validity().not_before),
        at(cert.validity().not_after),
    );
    let total = to.duration_since(from).unwrap_or_default();
    to.duration_since(now).unwrap_or_default() < total / 3
}
