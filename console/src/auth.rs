//! Who a browser is. Two ways in:
//!
//! - A one-time link (`strata console login --operator NAME`): a random
//!   token whose SHA-256 is kept in `strata.console_links` for a few
//!   minutes; redeeming it (once: the row is deleted as it is read) opens a
//!   session, whose cookie (`__Host-strata`, HttpOnly, Secure,
//!   SameSite=Strict) is again only kept hashed, in
//!   `strata.console_sessions`, with the session's CSRF token.
//! - A client certificate of the region's root CA naming an operator, as
//!   the client API takes it; its CSRF token is an HMAC of its serial under
//!   a key of the process.
//!
//! Every request is then checked where the data is: the session's row (not
//! ended, not expired), the certificate's serial against the revocations,
//! and the operator's role, read from `role/<operator>` each time, so a
//! role removed or a certificate revoked ends the session at its next
//! request (and a live stream within seconds: `sse.rs` checks again).

use crate::Shared;
use events::db::Sql;
use gateway::roles::Assignment;
use ring::rand::SecureRandom;
use std::time::Duration;

/// The session cookie's name (the `__Host-` prefix: Secure, Path=/, no
/// Domain, so no other host may set it).
pub const COOKIE: &str = "__Host-strata";

/// How long a sign-in link stays valid.
pub const LINK_TTL: Duration = Duration::from_secs(300);

/// Who is asking, and what they may do.
#[derive(Debug, Clone)]
pub struct Who {
    pub operator: String,
    pub role: Assignment,
    /// The token every form must carry back.
    pub csrf: String,
    /// The session cookie's value, for signing out (absent: a certificate).
    pub session: Option<String>,
}

/// Why a request is not let in.
#[derive(Debug)]
pub enum Refused {
    /// Nobody signed in (or the session is over): sign in.
    SignIn(String),
    /// Signed in, but not allowed.
    Forbidden(String),
    /// The database could not say.
    Unavailable(String),
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system's random source");
    hex(&b)
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn digest(secret: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, secret.as_bytes())
        .as_ref()
        .to_vec()
}

/// Issues a one-time sign-in link's token for `operator`, valid for
/// `ttl`. The caller must have checked that the operator exists.
pub async fn issue_link(
    client: &tokio_postgres::Client,
    operator: &str,
    ttl: Duration,
) -> Result<String, tokio_postgres::Error> {
    let token = random_hex(32);
    let secs = ttl.as_secs_f64();
    client
        .exec(
            "INSERT INTO strata.console_links (token_hash, operator, expires_at)
             VALUES ($1, $2, now() + make_interval(secs => $3))",
            &[&digest(&token), &operator, &secs],
        )
        .await?;
    // Links nobody used are of no further use.
    client
        .exec(
            "DELETE FROM strata.console_links WHERE expires_at < now() - interval '1 day'",
            &[],
        )
        .await?;
    Ok(token)
}

/// Redeems a link's token: the operator it was issued for, once, while it
/// is valid.
pub async fn redeem(
    client: &tokio_postgres::Client,
    token: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    Ok(client
        .opt(
            "DELETE FROM strata.console_links WHERE token_hash = $1 RETURNING operator, expires_at > now()",
            &[&digest(token)],
        )
        .await?
        .filter(|r| r.get::<_, bool>(1))
        .map(|r| r.get(0)))
}

/// Opens a session for `operator`: the cookie's value and its CSRF token.
pub async fn open(
    client: &tokio_postgres::Client,
    operator: &str,
    ttl: Duration,
) -> Result<(String, String), tokio_postgres::Error> {
    let (id, csrf) = (random_hex(32), random_hex(16));
    client
        .exec(
            "INSERT INTO strata.console_sessions (id_hash, operator, csrf, expires_at)
             VALUES ($1, $2, $3, now() + make_interval(secs => $4))",
            &[&digest(&id), &operator, &csrf, &ttl.as_secs_f64()],
        )
        .await?;
    Ok((id, csrf))
}

/// Ends a session (signing out).
pub async fn end(client: &tokio_postgres::Client, id: &str) -> Result<(), tokio_postgres::Error> {
    client
        .exec(
            "UPDATE strata.console_sessions SET ended_at = now() WHERE id_hash = $1 AND ended_at IS NULL",
            &[&digest(id)],
        )
        .await
        .map(|_| ())
}

/// Ends every open session of `operator`: the number ended.
pub async fn end_all(
    client: &tokio_postgres::Client,
    operator: &str,
) -> Result<u64, tokio_postgres::Error> {
    client
        .exec(
            "UPDATE strata.console_sessions SET ended_at = now() WHERE operator = $1 AND ended_at IS NULL",
            &[&operator],
        )
        .await
}

/// The session cookie's value in a `Cookie` header.
pub fn cookie_value(header: Option<&str>) -> Option<String> {
    header?
        .split(';')
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The `Set-Cookie` value that keeps a session in the browser.
pub fn set_cookie(id: &str, ttl: Duration) -> String {
    format!(
        "{COOKIE}={id}; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age={}",
        ttl.as_secs()
    )
}

/// The `Set-Cookie` value that drops it.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=0")
}

/// Who the request is: its client certificate, else its session cookie;
/// then the operator's role, which must exist.
pub async fn who(
    shared: &Shared,
    cert: Option<&[u8]>,
    cookie: Option<&str>,
) -> Result<Who, Refused> {
    let client = shared
        .db
        .get()
        .await
        .map_err(|e| Refused::Unavailable(format!("database: {e}")))?;
    let db = |e: tokio_postgres::Error| Refused::Unavailable(format!("database: {e}"));
    let (operator, csrf, session) =
        match (by_certificate(shared, cert).await?, cookie_value(cookie)) {
            (Some((operator, csrf)), _) => (operator, csrf, None),
            (None, Some(id)) => {
                let row = client
                    .opt(
                        "SELECT operator, csrf FROM strata.console_sessions
                      WHERE id_hash = $1 AND ended_at IS NULL AND expires_at > now()",
                        &[&digest(&id)],
                    )
                    .await
                    .map_err(db)?
                    .ok_or_else(|| Refused::SignIn("your session is over: sign in again".into()))?;
                (row.get(0), row.get(1), Some(id))
            }
            (None, None) => return Err(Refused::SignIn("sign in to see the console".into())),
        };
    let role = gateway::roles::get(&client, &operator).await.map_err(db)?.ok_or_else(|| {
        Refused::SignIn(format!(
            "operator {operator} has no role (any more); an admin gives one with `strata roles set {operator} --role ...`"
        ))
    })?;
    Ok(Who {
        operator,
        role,
        csrf,
        session,
    })
}

/// The operator a client certificate names and its CSRF token, if it is an
/// operator's of the region's root and not revoked.
async fn by_certificate(
    shared: &Shared,
    cert: Option<&[u8]>,
) -> Result<Option<(String, String)>, Refused> {
    let Some(der) = cert else {
        return Ok(None);
    };
    let Ok(presented) = gateway::revocation::presented(der) else {
        return Ok(None);
    };
    let (Some("operator"), Some(name)) = (presented.kind, presented.name) else {
        return Ok(None);
    };
    if !gateway::ca::issued_by(&shared.root_subject, der) {
        return Err(Refused::Forbidden(
            "this operator certificate was not issued by the region's root CA".into(),
        ));
    }
    match shared.revoked.check(&shared.db, &presented.serial).await {
        Ok(false) => {}
        Ok(true) => {
            return Err(Refused::Forbidden(format!(
                "the certificate of operator {name} (serial {}) is revoked",
                presented.serial
            )))
        }
        Err(e) => return Err(Refused::Unavailable(e)),
    }
    let tag = ring::hmac::sign(&shared.csrf_key, presented.serial.as_bytes());
    Ok(Some((name, hex(&tag.as_ref()[..16]))))
}

/// Which raw events someone may read in the events tail.
#[derive(Debug, Clone)]
pub enum Reads {
    /// An admin: every event.
    All,
    /// What a Subscribe grant allows (`strata grants`).
    Granted(gateway::grants::Grant),
    /// No grant: none.
    Nothing,
}

impl Reads {
    pub fn allows(&self, stream: &str, event_type: &str) -> bool {
        match self {
            Reads::All => true,
            Reads::Granted(g) => g.allows(stream, event_type),
            Reads::Nothing => false,
        }
    }
}

/// Which raw events `who` may read: an admin every one, anyone else what
/// its grant allows, exactly as the client API's Subscribe reads them.
pub async fn readable(shared: &Shared, who: &Who) -> Result<Reads, Refused> {
    if who.role.role == gateway::roles::Role::Admin {
        return Ok(Reads::All);
    }
    let client = shared
        .db
        .get()
        .await
        .map_err(|e| Refused::Unavailable(format!("database: {e}")))?;
    Ok(gateway::grants::get(&client, &who.operator)
        .await
        .map_err(|e| Refused::Unavailable(format!("database: {e}")))?
        .map_or(Reads::Nothing, Reads::Granted))
}

/// Whether a form's token is the session's (compared in constant time).
pub fn csrf_ok(who: &Who, given: Option<&str>) -> bool {
    given.is_some_and(|g| {
        let (a, b) = (g.as_bytes(), who.csrf.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cookie_is_read_only_in_its_own_shape() {
        let id = "a".repeat(64);
        let header = format!("x=1; {COOKIE}={id}; y=2");
        assert_eq!(cookie_value(Some(&header)), Some(id.clone()));
        assert_eq!(cookie_value(Some(&format!("{COOKIE}=short"))), None);
        assert_eq!(
            cookie_value(Some(&format!("{COOKIE}={}", "z".repeat(64)))),
            None
        );
        assert_eq!(cookie_value(Some("other=1")), None);
        assert_eq!(cookie_value(None), None);
        let set = set_cookie(&id, Duration::from_secs(60));
        for attr in [
            "Secure",
            "HttpOnly",
            "SameSite=Strict",
            "Path=/",
            "Max-Age=60",
        ] {
            assert!(set.contains(attr), "{set}");
        }
    }

    #[test]
    fn secrets_are_random_and_kept_hashed() {
        let (a, b) = (random_hex(32), random_hex(32));
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert_eq!(digest(&a).len(), 32);
        assert_ne!(digest(&a), digest(&b));
    }
}
