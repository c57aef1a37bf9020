//! Revoking client certificates (operators of the client API, auditors of the
//! audit endpoint) before they expire.
//!
//! A revocation is a row in `strata.revoked_certificates`, keyed by the
//! certificate's serial, and a `certificate.revoked` event in the log. The
//! client API checks the serial of every caller against [`Revoked`], a set
//! reloaded from the table at most every [`Revoked::RELOAD`], so a revocation
//! takes effect on every gateway within that time, for calls on connections
//! already open too; a running Subscribe stream is checked at the same
//! interval and ends. The audit endpoint checks the table at every
//! certificate login.

use crate::ca;
use events::db::Sql;
use events::{ExpectedVersion, NewEvent};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum RevocationError {
    #[error("{0}")]
    Invalid(String),
    #[error("database: {0}")]
    Db(#[from] tokio_postgres::Error),
    #[error("append: {0}")]
    Append(#[from] events::AppendError),
}

/// What a client certificate says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presented {
    /// Lowercase hex, without leading zero bytes (as the CA writes it).
    pub serial: String,
    /// `operator` or `auditor`, from its `urn:strata:...` name.
    pub kind: Option<&'static str>,
    pub name: Option<String>,
    pub not_after: SystemTime,
}

/// Reads a PEM certificate (the first one in `pem`).
pub fn presented_pem(pem: &str) -> Result<Presented, RevocationError> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .map_err(|e| RevocationError::Invalid(format!("not a PEM certificate: {e}")))?;
    if block.label != "CERTIFICATE" {
        return Err(RevocationError::Invalid(format!(
            "the PEM block is a {:?}, not a CERTIFICATE",
            block.label
        )));
    }
    presented(&block.contents)
}

/// Reads a DER certificate.
pub fn presented(der: &[u8]) -> Result<Presented, RevocationError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| RevocationError::Invalid(format!("not an X.509 certificate: {e}")))?;
    let (kind, name) = ca::holder(&cert).unzip();
    let secs = cert.validity().not_after.timestamp().max(0) as u64;
    Ok(Presented {
        serial: ca::serial_hex(cert.raw_serial()),
        kind,
        name,
        not_after: SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
    })
}

/// Checks and normalizes a serial given by hand (hex, `:` allowed between
/// bytes, any case).
pub fn parse_serial(s: &str) -> Result<String, RevocationError> {
    let hex: String = s.chars().filter(|c| *c != ':').collect::<String>();
    let hex = hex.to_ascii_lowercase();
    if hex.is_empty() || hex.len() > 40 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(RevocationError::Invalid(format!(
            "serial {s:?} is not 1 to 20 bytes of hex"
        )));
    }
    // Whole bytes, without leading zero bytes: as `ca::serial_hex` writes it.
    let mut hex = if hex.len() % 2 == 1 {
        format!("0{hex}")
    } else {
        hex
    };
    while hex.len() > 2 && hex.starts_with("00") {
        hex.drain(..2);
    }
    Ok(hex)
}

/// A revoked certificate, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revocation {
    pub serial: String,
    pub kind: Option<String>,
    pub name: Option<String>,
    pub not_after: Option<SystemTime>,
    pub reason: String,
    pub revoked_at: SystemTime,
}

/// Which certificate [`revoke`] revokes.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// The certificate itself: its holder is recorded and named in the log.
    Certificate(&'a Presented),
    /// Its serial alone, in hex (as `strata ca revoked` and issuing print it).
    Serial(&'a str),
}

/// Revokes a certificate. The revocation and its `certificate.revoked` event
/// commit in one transaction: neither is ever kept without the other. Returns
/// false if it was revoked already.
pub async fn revoke(
    client: &mut Client,
    target: Target<'_>,
    reason: &str,
) -> Result<bool, RevocationError> {
    let (serial, cert) = match target {
        Target::Certificate(c) => (parse_serial(&c.serial)?, Some(c)),
        Target::Serial(s) => (parse_serial(s)?, None),
    };
    let kind = cert.and_then(|c| c.kind);
    let name = cert.and_then(|c| c.name.clone());
    let not_after = cert.map(|c| c.not_after);
    let tx = client.transaction().await?;
    let n = tx
        .exec(
            "INSERT INTO strata.revoked_certificates (serial, kind, name, not_after, reason)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (serial) DO NOTHING",
            &[&serial, &kind, &name, &not_after, &reason],
        )
        .await?;
    if n == 0 {
        return Ok(false);
    }
    let stream = match (kind, &name) {
        (Some(k), Some(n)) => format!("{k}/{n}"),
        _ => format!("certificate/{serial}"),
    };
    let event = NewEvent::new(
        crate::catalog::CERTIFICATE_REVOKED,
        &serde_json::json!({ "serial": serial, "kind": kind, "name": name, "reason": reason }),
    );
    events::append::append_one_in(&tx, stream, ExpectedVersion::Any, vec![event]).await?;
    tx.commit().await?;
    Ok(true)
}

/// Every revoked certificate, newest first.
pub async fn list(client: &Client) -> Result<Vec<Revocation>, RevocationError> {
    let rows = client
        .rows(
            "SELECT serial, kind, name, not_after, reason, revoked_at
               FROM strata.revoked_certificates ORDER BY revoked_at DESC, serial",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Revocation {
            serial: r.get(0),
            kind: r.get(1),
            name: r.get(2),
            not_after: r.get(3),
            reason: r.get(4),
            revoked_at: r.get(5),
        })
        .collect())
}

/// The revoked serials, reloaded from the table when older than
/// [`Revoked::RELOAD`]. If a reload fails, the last set is used for up to
/// [`Revoked::STALE`]; after that, checks fail (callers refuse).
#[derive(Default)]
pub struct Revoked {
    state: Mutex<Option<(Instant, Arc<HashSet<String>>)>>,
    reload: tokio::sync::Mutex<()>,
}

impl Revoked {
    pub const RELOAD: Duration = Duration::from_secs(2);
    pub const STALE: Duration = Duration::from_secs(60);

    /// Whether `serial` is revoked, reloading from `db` if the set is old (a
    /// fresh set needs no connection).
    pub async fn check(&self, db: &events::db::SharedClient, serial: &str) -> Result<bool, String> {
        if let Some(set) = self.fresh(Self::RELOAD) {
            return Ok(set.contains(serial));
        }
        let _one = self.reload.lock().await;
        // Another caller may have reloaded while this one waited.
        if let Some(set) = self.fresh(Self::RELOAD) {
            return Ok(set.contains(serial));
        }
        let loaded = match db.get().await {
            Ok(client) => {
                client
                    .rows("SELECT serial FROM strata.revoked_certificates", &[])
                    .await
            }
            Err(e) => Err(e),
        };
        match loaded {
            Ok(rows) => {
                let set: Arc<HashSet<String>> = Arc::new(rows.iter().map(|r| r.get(0)).collect());
                *self.state.lock().expect("revocations lock") = Some((Instant::now(), set.clone()));
                Ok(set.contains(serial))
            }
            Err(e) => match self.fresh(Self::STALE) {
                Some(set) => {
                    tracing::warn!(error = %e, "could not reload certificate revocations; using the last set");
                    Ok(set.contains(serial))
                }
                None => Err(format!("certificate revocations could not be read: {e}")),
            },
        }
    }

    fn fresh(&self, within: Duration) -> Option<Arc<HashSet<String>>> {
        let state = self.state.lock().expect("revocations lock");
        match &*state {
            Some((at, set)) if at.elapsed() < within => Some(set.clone()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_are_normalized() {
        assert_eq!(parse_serial("0A:1b:FF").unwrap(), "0a1bff");
        assert_eq!(parse_serial("00:00:ab").unwrap(), "ab");
        assert_eq!(parse_serial("abc").unwrap(), "0abc");
        assert_eq!(parse_serial("0000").unwrap(), "00");
        assert_eq!(
            ca::serial_hex(&[0, 0x0a, 0xbc]),
            parse_serial("0abc").unwrap()
        );
        assert!(parse_serial("").is_err());
        assert!(parse_serial("xyz").is_err());
        assert!(parse_serial(&"a".repeat(41)).is_err());
    }

    #[test]
    fn certificates_name_their_holder_and_serial() {
        let dir = tempfile::tempdir().unwrap();
        ca::init(dir.path(), "test").unwrap();
        let ca = ca::Ca::load(dir.path()).unwrap();
        let (pem, _) = ca.issue_operator("alice", 1).unwrap();
        let p = presented_pem(&pem).unwrap();
        assert_eq!(p.kind, Some("operator"));
        assert_eq!(p.name.as_deref(), Some("alice"));
        assert_eq!(parse_serial(&p.serial).unwrap(), p.serial);
        assert!(p.not_after > SystemTime::now());
        let (pem, _) = ca.issue_auditor("bob", 1).unwrap();
        let q = presented_pem(&pem).unwrap();
        assert_eq!((q.kind, q.name.as_deref()), (Some("auditor"), Some("bob")));
        assert_ne!(p.serial, q.serial);
        let (pem, _) = ca.client_identity("n1").unwrap();
        assert_eq!(presented_pem(&pem).unwrap().kind, None);
        assert!(presented_pem("not a certificate").is_err());
    }
}
