//! Join tokens and issued certificates in the database.
//!
//! A token is 32 random bytes shown once (`stj_` and 64 hex digits); only its
//! SHA-256 is stored. Redeeming it and recording the certificate it paid for
//! is one statement, so a token is spent exactly once.

use crate::ca::Signed;
use events::append::{append_in, append_one_in};
use events::{AppenderConfig, ExpectedVersion, NewEvent, StreamAppend};
use projections::domain::pool_stream;
use projections::Fact;
use std::time::Duration;
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("the join token is unknown, already used or expired")]
    BadToken,
    #[error("node {0:?} has no certificate")]
    UnknownNode(String),
    #[error("{0}")]
    Invalid(String),
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Append(#[from] events::AppendError),
}

/// The log stream of a node.
pub fn node_stream(node: &str) -> String {
    format!("node/{node}")
}

fn digest(token: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, token.trim().as_bytes())
        .as_ref()
        .to_vec()
}

fn interval(d: Duration) -> String {
    format!("{} milliseconds", d.as_millis().max(1))
}

/// Issues a one-time join token for `pool`, valid for `ttl`.
pub async fn create_token(
    client: &Client,
    pool: &str,
    ttl: Duration,
) -> Result<String, IdentityError> {
    projections::domain::valid_name("pool", pool).map_err(IdentityError::Invalid)?;
    let mut bytes = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .expect("system randomness");
    let token = format!("stj_{}", events::hex(&bytes));
    client
        .execute(
            "INSERT INTO strata.join_tokens (hash, pool, expires_at) VALUES ($1, $2, now() + $3::text::interval)",
            &[&digest(&token), &pool, &interval(ttl)],
        )
        .await?;
    Ok(token)
}

/// Spends a token and records the certificate signed with it, in one
/// transaction with the `node.certificate_issued` event: a token is never
/// spent without the log saying so. Returns the token's pool.
pub async fn redeem(
    client: &mut Client,
    token: &str,
    node: &str,
    signed: &Signed,
) -> Result<String, IdentityError> {
    let tx = client.transaction().await?;
    let row = tx
        .query_opt(
            "WITH t AS (
                UPDATE strata.join_tokens SET used_at = now(), used_by = $2
                 WHERE hash = $1 AND used_at IS NULL AND expires_at > now()
                RETURNING pool)
             INSERT INTO strata.node_certificates (serial, node, pool, not_after)
             SELECT $3, $2, pool, $4 FROM t
             RETURNING pool",
            &[&digest(token), &node, &signed.serial, &signed.not_after],
        )
        .await?;
    let pool: String = row.ok_or(IdentityError::BadToken)?.get(0);
    append_one_in(
        &tx,
        node_stream(node),
        ExpectedVersion::Any,
        vec![NewEvent::new(
            "node.certificate_issued",
            &serde_json::json!({ "node": node, "pool": pool, "serial": signed.serial }),
        )],
    )
    .await?;
    tx.commit().await?;
    Ok(pool)
}

/// Records certificates issued outside a join (`Ca::issue_node`), in one
/// statement: (node, serial, not after).
pub async fn record(
    client: &Client,
    pool: &str,
    certificates: &[(String, Signed)],
) -> Result<u64, IdentityError> {
    let nodes: Vec<&str> = certificates.iter().map(|(n, _)| n.as_str()).collect();
    let serials: Vec<&str> = certificates
        .iter()
        .map(|(_, s)| s.serial.as_str())
        .collect();
    let not_after: Vec<std::time::SystemTime> =
        certificates.iter().map(|(_, s)| s.not_after).collect();
    Ok(client
        .execute(
            "INSERT INTO strata.node_certificates (serial, node, pool, not_after)
             SELECT s, n, $4, t FROM unnest($1::text[], $2::text[], $3::timestamptz[]) AS x(n, s, t)",
            &[&nodes, &serials, &not_after, &pool],
        )
        .await?)
}

/// What the database says about a presented certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateRecord {
    pub node: String,
    pub pool: String,
    pub revoked: bool,
    pub expired: bool,
}

pub async fn lookup(
    client: &Client,
    serial: &str,
) -> Result<Option<CertificateRecord>, IdentityError> {
    let row = client
        .query_opt(
            "SELECT node, pool, revoked_at IS NOT NULL, not_after <= now()
               FROM strata.node_certificates WHERE serial = $1",
            &[&serial],
        )
        .await?;
    Ok(row.map(|r| CertificateRecord {
        node: r.get(0),
        pool: r.get(1),
        revoked: r.get(2),
        expired: r.get(3),
    }))
}

/// Revokes every certificate of a node, in one transaction with the
/// `node.revoked` event that records it. Returns how many were revoked now.
pub async fn revoke(client: &mut Client, node: &str, reason: &str) -> Result<u64, IdentityError> {
    let tx = client.transaction().await?;
    let n = tx
        .execute(
            "UPDATE strata.node_certificates SET revoked_at = now() WHERE node = $1 AND revoked_at IS NULL",
            &[&node],
        )
        .await?;
    let known: i64 = tx
        .query_one(
            "SELECT count(*) FROM strata.node_certificates WHERE node = $1",
            &[&node],
        )
        .await?
        .get(0);
    if known == 0 {
        return Err(IdentityError::UnknownNode(node.to_string()));
    }
    // The node leaves every pool it joined, in the same transaction: no
    // placement goes to it from now on, and the placer ends the live
    // reservations on it (`reservation.failed`, `node_revoked`).
    let pools: Vec<String> = tx
        .query(
            "SELECT DISTINCT pool FROM strata.node_certificates WHERE node = $1",
            &[&node],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut appends = vec![StreamAppend {
        stream: node_stream(node),
        expected: ExpectedVersion::Any,
        events: vec![NewEvent::new(
            "node.revoked",
            &serde_json::json!({ "node": node, "reason": reason, "certificates": n }),
        )],
    }];
    for pool in pools {
        appends.push(StreamAppend {
            stream: pool_stream(&pool),
            expected: ExpectedVersion::StreamExists,
            events: vec![Fact::NodeLeft {
                node: node.to_string(),
                reason: "revoked".into(),
            }
            .to_event()],
        });
    }
    // One call: its streams are locked in name order, then the log head.
    append_in(&tx, appends, &AppenderConfig::default()).await?;
    tx.commit().await?;
    Ok(n)
}
