//! Join tokens and issued certificates in the database.
//!
//! A token is 32 random bytes shown once (`stj_` and 64 hex digits); only its
//! SHA-256 is stored, with its pool and, optionally, the one node it admits.
//! Redeeming it checks the token and the node's id before anything is
//! signed, then spends it and records the certificate in one transaction, so
//! a token is spent exactly once and an id that exists cannot be taken.

use crate::ca::Signed;
use domain::pool_stream;
use domain::Fact;
use events::append::{append_in, append_one_in};
use events::db::Sql;
use events::{AppenderConfig, ExpectedVersion, NewEvent, StreamAppend};
use std::time::Duration;
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("the join token is unknown, already used or expired")]
    BadToken,
    /// The token names another node.
    #[error("this join token is for node {0:?}")]
    OtherNode(String),
    /// The token admits nodes matching a pattern, and this id does not.
    #[error("this join token admits nodes matching {0:?}")]
    NotAdmitted(String),
    /// The id holds a valid certificate: a second daemon cannot take it.
    #[error("node {0:?} already holds a valid certificate; a node keeps the one it was given (`strata nodes revoke {0}` frees the id)")]
    Taken(String),
    /// The id was revoked: only a token made for it lets it back.
    #[error("node {0:?} was revoked; only a token made for it (`strata tokens create --node {0}`) lets it join again")]
    Revoked(String),
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

/// A join token as the database keeps it (its SHA-256), as a joining
/// node's ClientHello names it.
pub fn digest(token: &str) -> Vec<u8> {
    ops::join_alpn::token_hash(token)
}

/// Which of `hashes` are join tokens not expired for more than a day (used
/// ones too: a node whose answer was lost asks again with its token), each
/// with the time (seconds since the epoch) until which it counts so: a
/// cheap check before a join costs a transaction.
pub async fn issued_among(
    client: &Client,
    hashes: &[Vec<u8>],
) -> Result<Vec<(Vec<u8>, f64)>, IdentityError> {
    let rows = client
        .query(
            "SELECT hash, extract(epoch FROM expires_at + interval '1 day')::float8 \
             FROM strata.join_tokens \
             WHERE hash = ANY($1) AND expires_at > now() - interval '1 day'",
            &[&hashes],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

fn interval(d: Duration) -> String {
    format!("{} milliseconds", d.as_millis().max(1))
}

/// Issues a one-time join token for `pool`, valid for `ttl`, that admits
/// the node ids `admits` names: one id (the only kind that lets a revoked
/// node back), or a pattern the operator chose where `*` stands for any run
/// of characters (`gpu-rack7-*`; `*` admits any id).
pub async fn create_token(
    client: &Client,
    pool: &str,
    ttl: Duration,
    admits: &str,
) -> Result<String, IdentityError> {
    domain::valid_name("pool", pool).map_err(IdentityError::Invalid)?;
    check_admits(admits)?;
    insert_token(client, pool, ttl, Some(admits)).await
}

/// A node id, or a pattern of node-id characters and `*`.
fn check_admits(admits: &str) -> Result<(), IdentityError> {
    if admits == "*" {
        return Ok(());
    }
    domain::valid_name("node id or pattern", &admits.replace('*', "x"))
        .map_err(IdentityError::Invalid)
}

/// Whether `id` matches `pattern`, where `*` matches any run of characters.
pub fn matches(pattern: &str, id: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == id;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !id.starts_with(first) || id.len() < first.len() + last.len() || !id.ends_with(last) {
        return false;
    }
    let mut rest = &id[first.len()..id.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

async fn insert_token(
    client: &(impl tokio_postgres::GenericClient + Sync),
    pool: &str,
    ttl: Duration,
    node: Option<&str>,
) -> Result<String, IdentityError> {
    let mut bytes = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .expect("system randomness");
    let token = format!("stj_{}", events::hex(&bytes));
    client
        .exec(
            "INSERT INTO strata.join_tokens (hash, pool, expires_at, node) VALUES ($1, $2, now() + $3::text::interval, $4)",
            &[&digest(&token), &pool, &interval(ttl), &node],
        )
        .await?;
    Ok(token)
}

/// A join token as `strata tokens list` shows it (never the token itself).
#[derive(Debug, Clone, serde::Serialize)]
pub struct TokenInfo {
    /// The first 16 hex digits of the token's SHA-256: what `strata tokens
    /// revoke` takes (`strata tokens create` prints it).
    pub id: String,
    pub pool: String,
    /// The node id or pattern it admits.
    pub admits: Option<String>,
    pub created_at: String,
    pub expires_at: String,
    /// `valid`, `used` or `expired` (a revoked token expired when revoked).
    pub state: String,
    pub used_by: Option<String>,
}

/// The id `strata tokens list` and `revoke` name a token by.
pub fn token_id(token: &str) -> String {
    events::hex(&digest(token)[..8])
}

/// Every join token, newest first.
pub async fn list_tokens(client: &Client) -> Result<Vec<TokenInfo>, IdentityError> {
    let rows = client
        .rows(
            "SELECT encode(substr(hash, 1, 8), 'hex'), pool, node,
                    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                    to_char(expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                    CASE WHEN used_at IS NOT NULL THEN 'used'
                         WHEN expires_at <= now() THEN 'expired' ELSE 'valid' END,
                    used_by
               FROM strata.join_tokens ORDER BY created_at DESC, hash",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| TokenInfo {
            id: r.get(0),
            pool: r.get(1),
            admits: r.get(2),
            created_at: r.get(3),
            expires_at: r.get(4),
            state: r.get(5),
            used_by: r.get(6),
        })
        .collect())
}

/// What revoking a token did.
#[derive(Debug, PartialEq, Eq)]
pub enum TokenRevoked {
    /// It could have been used until now; from now on it is refused.
    Revoked,
    /// It was spent or expired already: nothing to do.
    AlreadyUnusable,
    NotFound,
}

/// Makes the unspent token `id` (see [`token_id`]) expire now, so every
/// gateway refuses it at its next join (the join reads the table in its
/// transaction).
pub async fn revoke_token(client: &Client, id: &str) -> Result<TokenRevoked, IdentityError> {
    if id.len() != 16 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(IdentityError::Invalid(format!(
            "token id {id:?}: 16 hex digits, as `strata tokens list` shows them"
        )));
    }
    let row = client
        .opt(
            "WITH t AS (SELECT hash, used_at IS NULL AND expires_at > now() AS usable
                          FROM strata.join_tokens
                         WHERE substr(hash, 1, 8) = decode($1, 'hex') FOR UPDATE),
                  u AS (UPDATE strata.join_tokens j SET expires_at = now()
                          FROM t WHERE j.hash = t.hash AND t.usable RETURNING 1)
             SELECT (SELECT count(*) FROM u) > 0, (SELECT count(*) FROM t) > 0",
            &[&id.to_ascii_lowercase()],
        )
        .await?;
    let (revoked, found) = row.map_or((false, false), |r| (r.get(0), r.get(1)));
    Ok(match (revoked, found) {
        (true, _) => TokenRevoked::Revoked,
        (false, true) => TokenRevoked::AlreadyUnusable,
        (false, false) => TokenRevoked::NotFound,
    })
}

/// Joins `node` with `token`: checks the token and the node's id first,
/// then signs (`sign`, only once both are good), spends the token and
/// records the certificate, in one transaction with the
/// `node.certificate_issued` event. Refused: an unknown, spent or expired
/// token; a token for another node; an id that holds a valid certificate
/// (a second daemon cannot become a node that exists); a revoked id, unless
/// the token names it. A refused join spends nothing. Returns the pool and
/// what `sign` made.
pub async fn redeem<S>(
    client: &mut Client,
    token: &str,
    node: &str,
    csr_pem: &str,
    sign: impl FnOnce() -> Result<Signed, S>,
) -> Result<Result<(String, Signed), S>, IdentityError> {
    let tx = client.transaction().await?;
    let row = tx
        .opt(
            "SELECT pool, node FROM strata.join_tokens
              WHERE hash = $1 AND used_at IS NULL AND expires_at > now() FOR UPDATE",
            &[&digest(token)],
        )
        .await?;
    let Some(row) = row else {
        return match answered_before(&tx, token, node, csr_pem).await? {
            Some(again) => Ok(Ok(again)),
            None => Err(IdentityError::BadToken),
        };
    };
    // `node`: the id or pattern the token admits (tokens made before
    // patterns may admit any id).
    let (pool, admits): (String, Option<String>) = (row.get(0), row.get(1));
    let for_node = admits.as_ref().filter(|a| !a.contains('*'));
    match (&admits, for_node) {
        (Some(a), None) if !matches(a, node) => return Err(IdentityError::NotAdmitted(a.clone())),
        (_, Some(n)) if n != node => return Err(IdentityError::OtherNode(n.clone())),
        _ => {}
    }
    // Joins of one id are serialized, so two cannot both find it free.
    tx.exec(
        "SELECT pg_advisory_xact_lock(hashtextextended($1, 7))",
        &[&node],
    )
    .await?;
    let row = tx
        .one(
            "SELECT count(*) FILTER (WHERE revoked_at IS NULL AND not_after > now()),
                    count(*) FILTER (WHERE revoked_at IS NOT NULL)
               FROM strata.node_certificates WHERE node = $1",
            &[&node],
        )
        .await?;
    let (valid, revoked): (i64, i64) = (row.get(0), row.get(1));
    if valid > 0 {
        return Err(IdentityError::Taken(node.to_string()));
    }
    if revoked > 0 && for_node.is_none() {
        return Err(IdentityError::Revoked(node.to_string()));
    }
    let signed = match sign() {
        Ok(s) => s,
        Err(e) => return Ok(Err(e)),
    };
    tx.exec(
        "UPDATE strata.join_tokens SET used_at = now(), used_by = $2 WHERE hash = $1",
        &[&digest(token), &node],
    )
    .await?;
    record_in(
        &tx,
        node,
        &pool,
        &signed,
        NewEvent::new(
            crate::catalog::NODE_CERTIFICATE_ISSUED,
            &serde_json::json!({ "node": node, "pool": pool, "serial": signed.serial }),
        ),
    )
    .await?;
    tx.commit().await?;
    Ok(Ok((pool, signed)))
}

/// A join asked again after its answer was lost: the token was spent by
/// this node, and the node's newest valid certificate is for the key of
/// this CSR. Then the same certificate is the answer (a certificate is not
/// a secret: without the key it opens nothing). Anything else is a spent
/// token.
async fn answered_before(
    tx: &tokio_postgres::Transaction<'_>,
    token: &str,
    node: &str,
    csr_pem: &str,
) -> Result<Option<(String, Signed)>, IdentityError> {
    let Some(t) = tx
        .opt(
            "SELECT pool FROM strata.join_tokens
              WHERE hash = $1 AND used_by = $2 AND expires_at > now()",
            &[&digest(token), &node],
        )
        .await?
    else {
        return Ok(None);
    };
    let Some(c) = tx
        .opt(
            "SELECT serial, certificate_pem, not_after FROM strata.node_certificates
              WHERE node = $1 AND revoked_at IS NULL AND not_after > now()
                AND certificate_pem IS NOT NULL
              ORDER BY issued_at DESC LIMIT 1",
            &[&node],
        )
        .await?
    else {
        return Ok(None);
    };
    let certificate_pem: String = c.get(1);
    if !crate::ca::same_public_key(csr_pem, &certificate_pem) {
        return Ok(None);
    }
    tracing::info!(%node, "a join asked again with the same key: answered with its certificate");
    Ok(Some((
        t.get(0),
        Signed {
            certificate_pem,
            serial: c.get(0),
            not_after: c.get(2),
        },
    )))
}

/// Records a signed certificate with its event on the node's stream.
async fn record_in(
    tx: &tokio_postgres::Transaction<'_>,
    node: &str,
    pool: &str,
    signed: &Signed,
    event: NewEvent,
) -> Result<(), IdentityError> {
    tx.exec(
        "INSERT INTO strata.node_certificates (serial, node, pool, not_after, certificate_pem)
         VALUES ($1, $2, $3, $4, $5)",
        &[
            &signed.serial,
            &node,
            &pool,
            &signed.not_after,
            &signed.certificate_pem,
        ],
    )
    .await?;
    append_one_in(tx, node_stream(node), ExpectedVersion::Any, vec![event]).await?;
    Ok(())
}

/// Records a certificate renewed over a node's session, in one transaction
/// with `node.certificate_renewed` (naming the serial it follows). The
/// certificate it follows stays valid until it expires, so a node that
/// reconnects before it has written the new one still gets in.
pub async fn record_renewal(
    client: &mut Client,
    node: &str,
    pool: &str,
    follows: &str,
    signed: &Signed,
) -> Result<(), IdentityError> {
    let tx = client.transaction().await?;
    record_in(
        &tx,
        node,
        pool,
        signed,
        NewEvent::new(
            crate::catalog::NODE_CERTIFICATE_RENEWED,
            &serde_json::json!({ "node": node, "pool": pool, "serial": signed.serial, "follows": follows }),
        ),
    )
    .await?;
    tx.commit().await?;
    Ok(())
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
        .exec(
            "INSERT INTO strata.node_certificates (serial, node, pool, not_after)
             SELECT s, n, $4, t FROM unnest($1::text[], $2::text[], $3::timestamptz[]) AS x(n, s, t)",
            &[&nodes, &serials, &not_after, &pool],
        )
        .await?)
}

/// A certificate a node was issued, as `strata nodes list` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Issued {
    pub node: String,
    pub pool: String,
    pub serial: String,
    pub issued_at: String,
    pub not_after: String,
    pub revoked_at: Option<String>,
}

/// Every certificate issued to a node, by node and issue time.
pub async fn issued(client: &Client) -> Result<Vec<Issued>, IdentityError> {
    Ok(client
        .rows(
            "SELECT node, pool, serial, issued_at::text, not_after::text, revoked_at::text
               FROM strata.node_certificates ORDER BY node, issued_at",
            &[],
        )
        .await?
        .iter()
        .map(|r| Issued {
            node: r.get(0),
            pool: r.get(1),
            serial: r.get(2),
            issued_at: r.get(3),
            not_after: r.get(4),
            revoked_at: r.get(5),
        })
        .collect())
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
        .opt(
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
    let n = revoke_in(&tx, node, reason).await?;
    tx.commit().await?;
    Ok(n)
}

/// Re-provisions a node (its machine replaced or rebuilt): in one
/// transaction, revokes every certificate it holds (it leaves its pools, as
/// with [`revoke`]) and makes a one-time token for that node alone, in
/// `pool` or else the pool it was in. Returns the pool and the token.
pub async fn replace(
    client: &mut Client,
    node: &str,
    pool: Option<&str>,
    ttl: Duration,
    reason: &str,
) -> Result<(String, String), IdentityError> {
    let tx = client.transaction().await?;
    let pool = match pool {
        Some(p) => p.to_string(),
        None => tx
            .opt(
                "SELECT pool FROM strata.node_certificates WHERE node = $1
                  ORDER BY not_after DESC LIMIT 1",
                &[&node],
            )
            .await?
            .map(|r| r.get(0))
            .ok_or_else(|| IdentityError::UnknownNode(node.to_string()))?,
    };
    revoke_in(&tx, node, reason).await?;
    let token = insert_token(&tx, &pool, ttl, Some(node)).await?;
    tx.commit().await?;
    Ok((pool, token))
}

async fn revoke_in(
    tx: &tokio_postgres::Transaction<'_>,
    node: &str,
    reason: &str,
) -> Result<u64, IdentityError> {
    let n = tx
        .exec(
            "UPDATE strata.node_certificates SET revoked_at = now() WHERE node = $1 AND revoked_at IS NULL",
            &[&node],
        )
        .await?;
    let known: i64 = tx
        .one(
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
        .rows(
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
            crate::catalog::NODE_REVOKED,
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
    append_in(tx, appends, &AppenderConfig::default()).await?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn patterns_admit_what_they_say() {
        assert!(matches("*", "anything"));
        assert!(matches("gpu-rack7-*", "gpu-rack7-12"));
        assert!(!matches("gpu-rack7-*", "gpu-rack8-12"));
        assert!(matches("gpu-*-a", "gpu-7-a"));
        assert!(!matches("gpu-*-a", "gpu-7-b"));
        assert!(matches("a*b*c", "a-x-b-y-c"));
        assert!(!matches("a*b*c", "a-x-c-y-b"));
        assert!(!matches("ab*ba", "aba"));
        assert!(matches("alpha", "alpha"));
        assert!(!matches("alpha", "alpha2"));
    }
}
