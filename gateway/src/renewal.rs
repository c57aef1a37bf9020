//! A node's certificate renewed over its session: no token, since the
//! session's certificate speaks for the node. Allowed once less than half
//! of the presented certificate's validity is left, once per session, and
//! only while that certificate is still the node's (not revoked).

use crate::identity;
use crate::state::Shared;
use std::time::SystemTime;
use tonic::Status;

/// The certificate a session was opened with.
#[derive(Debug, Clone)]
pub(crate) struct Presented {
    pub(crate) serial: String,
    pub(crate) not_before: SystemTime,
    pub(crate) not_after: SystemTime,
}

impl Presented {
    /// Reads the validity of a certificate (DER).
    pub(crate) fn of(der: &[u8], serial: &str) -> Result<Presented, String> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("unreadable client certificate: {e}"))?;
        let at = |t: x509_parser::time::ASN1Time| {
            SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(t.timestamp().max(0) as u64)
        };
        Ok(Presented {
            serial: serial.to_string(),
            not_before: at(cert.validity().not_before),
            not_after: at(cert.validity().not_after),
        })
    }

    /// Whether less than half of its validity is left.
    fn due(&self, now: SystemTime) -> bool {
        let total = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        let left = self.not_after.duration_since(now).unwrap_or_default();
        left < total / 2
    }
}

/// Signs and records a new certificate for `node` for the key in `csr_pem`.
pub(crate) async fn renew(
    shared: &Shared,
    node: &str,
    pool: &str,
    presented: &Presented,
    csr_pem: &str,
) -> Result<String, Status> {
    if !presented.due(SystemTime::now()) {
        return Err(Status::failed_precondition(
            "a certificate is renewed once less than half of its validity is left",
        ));
    }
    let mut client = shared.identity_db().await?;
    match identity::lookup(&client, &presented.serial).await {
        Ok(Some(r)) if !r.revoked && r.node == node => {}
        Ok(_) => {
            return Err(Status::permission_denied(
                "the session's certificate is no longer this node's",
            ))
        }
        Err(e) => return Err(Status::unavailable(e.to_string())),
    }
    let signed = shared
        .ca
        .sign_node_for(node, csr_pem, shared.config.certificate_validity)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    identity::record_renewal(&mut client, node, pool, &presented.serial, &signed)
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    tracing::info!(%node, serial = %signed.serial, follows = %presented.serial, "node certificate renewed");
    Ok(signed.certificate_pem)
}
