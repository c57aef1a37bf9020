//! Auditor accounts: a name, an optional SCRAM-SHA-256 verifier, revocation.
//!
//! Only the verifier (salt, iterations, StoredKey, ServerKey) is stored, as
//! Postgres stores it: neither the password nor the salted password, either
//! of which would let a reader of the table log in.

use events::db::Sql;
use pgwire::api::auth::sasl::scram::{gen_salted_password, ScramSecret};
use ring::rand::{SecureRandom, SystemRandom};
use tokio_postgres::GenericClient;

/// PostgreSQL's default iteration count for SCRAM-SHA-256.
pub const ITERATIONS: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum AccountError {
    #[error(
        "auditor name {0:?} is not allowed: use 1 to 63 letters, digits, '_', '.', '@' or '-'"
    )]
    BadName(String),
    #[error("no auditor named {0:?}")]
    NotFound(String),
    #[error("a password must not be empty")]
    EmptyPassword,
    #[error("database: {0}")]
    Db(#[from] tokio_postgres::Error),
    #[error("no randomness from the system")]
    Random,
}

/// One auditor.
#[derive(Debug, Clone)]
pub struct Account {
    pub name: String,
    pub has_password: bool,
    pub created_at: std::time::SystemTime,
    pub revoked_at: Option<std::time::SystemTime>,
}

/// A stored verifier.
pub struct Verifier {
    pub salt: Vec<u8>,
    pub iterations: usize,
    pub stored_key: Vec<u8>,
    pub server_key: Vec<u8>,
}

impl Verifier {
    pub fn from_password(password: &str) -> Result<Verifier, AccountError> {
        if password.is_empty() {
            return Err(AccountError::EmptyPassword);
        }
        let mut salt = vec![0u8; 16];
        SystemRandom::new()
            .fill(&mut salt)
            .map_err(|_| AccountError::Random)?;
        let salted = gen_salted_password(password, &salt, ITERATIONS);
        match ScramSecret::verifier_from_salted_password(salt, salted, ITERATIONS) {
            ScramSecret::Verifier {
                salt,
                iterations,
                stored_key,
                server_key,
            } => Ok(Verifier {
                salt,
                iterations,
                stored_key,
                server_key,
            }),
            ScramSecret::SaltedPassword { .. } => Err(AccountError::Random),
        }
    }

    pub fn secret(&self) -> ScramSecret {
        ScramSecret::Verifier {
            salt: self.salt.clone(),
            iterations: self.iterations,
            stored_key: self.stored_key.clone(),
            server_key: self.server_key.clone(),
        }
    }
}

pub fn check_name(name: &str) -> Result<(), AccountError> {
    let ok = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'@' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(AccountError::BadName(name.to_string()))
    }
}

/// Adds an auditor, or sets a password and lifts a revocation of an
/// existing one. `None` makes a certificate-only account (or keeps the
/// existing password).
pub async fn add(
    db: &(impl GenericClient + Sync),
    name: &str,
    password: Option<&str>,
) -> Result<(), AccountError> {
    check_name(name)?;
    let v = password.map(Verifier::from_password).transpose()?;
    let (salt, iters, stored, server) = match &v {
        Some(v) => (
            Some(v.salt.as_slice()),
            Some(v.iterations as i32),
            Some(v.stored_key.as_slice()),
            Some(v.server_key.as_slice()),
        ),
        None => (None, None, None, None),
    };
    db.exec(
        "INSERT INTO strata.auditors (name, scram_salt, scram_iterations, stored_key, server_key)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (name) DO UPDATE SET
             scram_salt = COALESCE(EXCLUDED.scram_salt, auditors.scram_salt),
             scram_iterations = COALESCE(EXCLUDED.scram_iterations, auditors.scram_iterations),
             stored_key = COALESCE(EXCLUDED.stored_key, auditors.stored_key),
             server_key = COALESCE(EXCLUDED.server_key, auditors.server_key),
             revoked_at = NULL",
        &[&name, &salt, &iters, &stored, &server],
    )
    .await?;
    Ok(())
}

/// Revokes an auditor: no new connection is accepted for them.
pub async fn revoke(db: &(impl GenericClient + Sync), name: &str) -> Result<(), AccountError> {
    let n = db
        .exec(
            "UPDATE strata.auditors SET revoked_at = COALESCE(revoked_at, now()) WHERE name = $1",
            &[&name],
        )
        .await?;
    if n == 0 {
        return Err(AccountError::NotFound(name.to_string()));
    }
    Ok(())
}

pub async fn list(db: &(impl GenericClient + Sync)) -> Result<Vec<Account>, AccountError> {
    let rows = db
        .rows(
            "SELECT name, stored_key IS NOT NULL, created_at, revoked_at
               FROM strata.auditors ORDER BY name",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Account {
            name: r.get(0),
            has_password: r.get(1),
            created_at: r.get(2),
            revoked_at: r.get(3),
        })
        .collect())
}

/// An active (not revoked) auditor's verifier; `Some(None)` for an active
/// certificate-only auditor; `None` for no such active auditor.
pub async fn active(
    db: &(impl GenericClient + Sync),
    name: &str,
) -> Result<Option<Option<Verifier>>, AccountError> {
    let row = db
        .opt(
            "SELECT scram_salt, scram_iterations, stored_key, server_key
               FROM strata.auditors WHERE name = $1 AND revoked_at IS NULL",
            &[&name],
        )
        .await?;
    Ok(row.map(|r| {
        let salt: Option<Vec<u8>> = r.get(0);
        let iters: Option<i32> = r.get(1);
        let stored: Option<Vec<u8>> = r.get(2);
        let server: Option<Vec<u8>> = r.get(3);
        match (salt, iters, stored, server) {
            (Some(salt), Some(i), Some(stored_key), Some(server_key)) => Some(Verifier {
                salt,
                iterations: i as usize,
                stored_key,
                server_key,
            }),
            _ => None,
        }
    }))
}

/// Whether the certificate with this serial (lowercase hex without leading
/// zero bytes) was revoked with `strata ca revoke`.
pub async fn certificate_revoked(
    db: &(impl GenericClient + Sync),
    serial: &str,
) -> Result<bool, AccountError> {
    Ok(db
        .one(
            "SELECT EXISTS (SELECT 1 FROM strata.revoked_certificates WHERE serial = $1)",
            &[&serial],
        )
        .await?
        .get(0))
}
