//! What a client-API caller may read, as events on `grant/<caller>`
//! (`grant.set` with stream prefixes and event types; `grant.revoked`).

use events::db::Sql;
use events::{AppendError, Appender, ExpectedVersion, NewEvent};
use serde::{Deserialize, Serialize};

pub fn grant_stream(caller: &str) -> String {
    format!("grant/{caller}")
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// Stream prefixes the caller may read; empty means none.
    pub stream_prefixes: Vec<String>,
    /// Event types; empty means all types within the prefixes.
    #[serde(default)]
    pub types: Vec<String>,
}

/// Whether stream prefix `prefix` covers `stream` (or a narrower prefix)
/// by whole path segments: `pool/p1` covers `pool/p1` and `pool/p1/x`, not
/// `pool/p10`; a prefix ending in `/` (`pool/`) covers everything under it.
fn covers(prefix: &str, stream: &str) -> bool {
    match stream.strip_prefix(prefix) {
        None => false,
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
    }
}

impl Grant {
    /// The filter a subscription gets: what it asked for, within the grant.
    /// `None` when the request reaches outside the grant entirely.
    pub fn narrow(&self, prefixes: &[String], types: &[String]) -> Option<Grant> {
        let prefixes: Vec<String> = if prefixes.is_empty() {
            self.stream_prefixes.clone()
        } else {
            // A requested prefix is allowed when a granted prefix covers it.
            prefixes
                .iter()
                .filter(|p| self.stream_prefixes.iter().any(|g| covers(g, p)))
                .cloned()
                .collect()
        };
        let types: Vec<String> = match (types.is_empty(), self.types.is_empty()) {
            (true, _) => self.types.clone(),
            (false, true) => types.to_vec(),
            (false, false) => types
                .iter()
                .filter(|t| self.types.contains(t))
                .cloned()
                .collect(),
        };
        if prefixes.is_empty() || (!types.is_empty() && types.is_empty()) {
            return None;
        }
        if !self.types.is_empty() && types.is_empty() {
            return None;
        }
        Some(Grant {
            stream_prefixes: prefixes,
            types,
        })
    }

    pub fn allows(&self, stream: &str, event_type: &str) -> bool {
        self.stream_prefixes.iter().any(|p| covers(p, stream))
            && (self.types.is_empty() || {
                // A grant names current types; old events carry old names.
                let event_type = domain::canonical_type(event_type);
                self.types
                    .iter()
                    .any(|t| domain::canonical_type(t) == event_type)
            })
    }
}

pub async fn set(appender: &Appender, caller: &str, grant: &Grant) -> Result<(), AppendError> {
    let payload = serde_json::to_value(grant).expect("grants serialize");
    appender
        .append(
            &grant_stream(caller),
            ExpectedVersion::Any,
            vec![NewEvent::new(crate::catalog::GRANT_SET, &payload)],
        )
        .await
        .map(|_| ())
}

/// Removes the caller's grant (a `grant.revoked` event): its Subscribe
/// streams get nothing more. `false` when it had none.
pub async fn remove(
    appender: &Appender,
    client: &tokio_postgres::Client,
    caller: &str,
) -> Result<bool, String> {
    let row = client
        .opt(
            "SELECT version, type FROM strata.events WHERE stream = $1 ORDER BY version DESC LIMIT 1",
            &[&grant_stream(caller)],
        )
        .await
        .map_err(|e| e.to_string())?;
    let Some(row) = row else { return Ok(false) };
    let (version, kind): (i64, &str) = (row.get(0), row.get(1));
    if kind != crate::catalog::GRANT_SET {
        return Ok(false);
    }
    // At the version read: a grant set meanwhile is not removed unseen.
    appender
        .append(
            &grant_stream(caller),
            ExpectedVersion::Exact(version as u64),
            vec![NewEvent::new(
                crate::catalog::GRANT_REVOKED,
                &serde_json::json!({}),
            )],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(true)
}

/// Every caller's current grant, by caller.
pub async fn list(
    client: &tokio_postgres::Client,
) -> Result<Vec<(String, Grant)>, tokio_postgres::Error> {
    crate::latest::all(client, "grant/", crate::catalog::GRANT_SET).await
}

/// The caller's current grant, if any.
pub async fn get(
    client: &tokio_postgres::Client,
    caller: &str,
) -> Result<Option<Grant>, tokio_postgres::Error> {
    crate::latest::current(client, &grant_stream(caller), crate::catalog::GRANT_SET).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_narrowed_to_the_grant() {
        let g = Grant {
            stream_prefixes: vec!["pool/".into()],
            types: vec![],
        };
        assert_eq!(g.narrow(&[], &[]), Some(g.clone()));
        assert_eq!(g.narrow(&["node/".into()], &[]), None);
        let n = g
            .narrow(
                &["pool/p1".into(), "node/".into()],
                &["reservation.placed".into()],
            )
            .unwrap();
        assert_eq!(n.stream_prefixes, ["pool/p1"]);
        assert!(n.allows("pool/p1", "reservation.placed"));
        assert!(!n.allows("pool/p2", "reservation.placed"));
        // Events written under an old name are granted by the new one.
        assert!(n.allows("pool/p1", "ReservationPlaced"));
        assert!(!n.allows("pool/p1", "node.joined"));
        let typed = Grant {
            stream_prefixes: vec!["pool/".into()],
            types: vec!["reservation.placed".into()],
        };
        assert_eq!(typed.narrow(&[], &["node.joined".into()]), None);
        assert!(!typed.allows("pool/p", "node.joined"));
        assert!(!Grant::default().allows("pool/p", "x"));
    }

    #[test]
    fn a_prefix_matches_whole_path_segments() {
        let g = Grant {
            stream_prefixes: vec!["pool/p1".into()],
            types: vec![],
        };
        assert!(g.allows("pool/p1", "t"));
        assert!(g.allows("pool/p1/x", "t"));
        for other in ["pool/p10", "pool/p1x", "pool/p"] {
            assert!(!g.allows(other, "t"), "{other}");
        }
        assert_eq!(g.narrow(&["pool/p10".into()], &[]), None);
        assert!(g.narrow(&["pool/p1".into()], &[]).is_some());
        let all = Grant {
            stream_prefixes: vec!["pool/".into()],
            types: vec![],
        };
        assert!(all.allows("pool/p10", "t") && !all.allows("pools", "t"));
    }
}
