//! What an operator may do through the client API, held as events on
//! `role/<operator>` (`role.set` with the role and, for `operator`, its
//! pools; `role.removed`), so every change of rights is in the log.
//!
//! - `admin`: everything, in every pool.
//! - `operator`: in its pools, reserve and release its own reservations,
//!   change nodes' standing, issue commands to nodes; read everything.
//! - `viewer`: read (pools, nodes, commands).
//!
//! An operator with no role may do nothing. Nobody issues Strata's own
//! command kinds (`allocation.*`) through the API: only the binder does.
//! Releasing a reservation takes its owner (the operator who asked for it)
//! or an admin.

use events::{AppendError, Appender, ExpectedVersion, NewEvent};
use serde::{Deserialize, Serialize};

pub fn role_stream(operator: &str) -> String {
    format!("role/{operator}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Admin,
    Operator,
    Viewer,
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        match s {
            "admin" => Ok(Role::Admin),
            "operator" => Ok(Role::Operator),
            "viewer" => Ok(Role::Viewer),
            other => Err(format!("unknown role {other:?}: admin, operator or viewer")),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::Viewer => "viewer",
        })
    }
}

/// An operator's role, as `role.set` records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub role: Role,
    /// The pools an `operator` acts in; empty for the others.
    #[serde(default)]
    pub pools: Vec<String>,
}

/// What a call needs.
#[derive(Debug, Clone, Copy)]
pub enum Need<'a> {
    /// Reading pools, nodes, commands.
    Read,
    /// Acting in a pool: reserving, changing a node's standing, commands.
    Pool(&'a str),
    /// Releasing a reservation owned by this operator (`None`: by nobody
    /// the API knows, such as one asked for with database access).
    Release { owner: Option<&'a str> },
    /// What only an admin does (changing a pool's queues), said as such.
    Admin(&'a str),
}

impl Assignment {
    /// Whether `who` holding this may do what `need` says; the refusal's
    /// reason otherwise.
    pub fn allows(&self, who: &str, need: Need<'_>) -> Result<(), String> {
        match (self.role, need) {
            (Role::Admin, _) => Ok(()),
            (_, Need::Read) => Ok(()),
            (Role::Operator, Need::Pool(p)) if self.pools.iter().any(|q| q == p) => Ok(()),
            (Role::Operator, Need::Pool(p)) => Err(format!(
                "operator {who} acts in pools {:?}, not in {p:?}",
                self.pools
            )),
            (Role::Operator, Need::Release { owner: Some(o) }) if o == who => Ok(()),
            (Role::Operator, Need::Release { owner }) => Err(format!(
                "the reservation belongs to {}; only its owner or an admin may release it",
                owner.map_or(
                    "no operator (it was asked for with database access)".into(),
                    |o| { format!("operator {o}") }
                )
            )),
            (_, Need::Admin(what)) => Err(format!("only an admin may {what}; {who} is not one")),
            (Role::Viewer, _) => Err(format!("{who} is a viewer: it may read, nothing else")),
        }
    }
}

/// Gives `operator` a role (replacing any it had).
pub async fn set(
    appender: &Appender,
    operator: &str,
    assignment: &Assignment,
) -> Result<(), AppendError> {
    domain::valid_name("operator", operator).map_err(AppendError::Invalid)?;
    match (assignment.role, assignment.pools.is_empty()) {
        (Role::Operator, true) => {
            return Err(AppendError::Invalid(
                "an operator acts in named pools: give --pools".into(),
            ))
        }
        (Role::Admin | Role::Viewer, false) => {
            return Err(AppendError::Invalid(format!(
                "--pools is for the operator role; {} is not scoped to pools",
                assignment.role
            )))
        }
        _ => {}
    }
    let payload = serde_json::to_value(assignment).expect("roles serialize");
    appender
        .append(
            &role_stream(operator),
            ExpectedVersion::Any,
            vec![NewEvent::new(crate::catalog::ROLE_SET, &payload)],
        )
        .await
        .map(|_| ())
}

/// Takes `operator`'s role away.
pub async fn remove(appender: &Appender, operator: &str) -> Result<(), AppendError> {
    appender
        .append(
            &role_stream(operator),
            ExpectedVersion::StreamExists,
            vec![NewEvent::new(
                crate::catalog::ROLE_REMOVED,
                &serde_json::json!({}),
            )],
        )
        .await
        .map(|_| ())
}

/// `operator`'s current role, if any.
pub async fn get(
    client: &tokio_postgres::Client,
    operator: &str,
) -> Result<Option<Assignment>, tokio_postgres::Error> {
    crate::latest::current(client, &role_stream(operator), crate::catalog::ROLE_SET).await
}

/// Every operator with a role, by name.
pub async fn list(
    client: &tokio_postgres::Client,
) -> Result<Vec<(String, Assignment)>, tokio_postgres::Error> {
    crate::latest::all(client, "role/", crate::catalog::ROLE_SET).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_allows_what_it_is_for() {
        let admin = Assignment {
            role: Role::Admin,
            pools: vec![],
        };
        let op = Assignment {
            role: Role::Operator,
            pools: vec!["p".into()],
        };
        let viewer = Assignment {
            role: Role::Viewer,
            pools: vec![],
        };
        for need in [
            Need::Read,
            Need::Pool("q"),
            Need::Release { owner: None },
            Need::Release {
                owner: Some("alice"),
            },
        ] {
            assert!(admin.allows("root", need).is_ok());
        }
        assert!(op.allows("bob", Need::Read).is_ok());
        assert!(op.allows("bob", Need::Pool("p")).is_ok());
        assert!(op
            .allows("bob", Need::Pool("q"))
            .unwrap_err()
            .contains("\"q\""));
        assert!(op
            .allows("bob", Need::Release { owner: Some("bob") })
            .is_ok());
        let e = op
            .allows(
                "bob",
                Need::Release {
                    owner: Some("alice"),
                },
            )
            .unwrap_err();
        assert!(e.contains("operator alice"), "{e}");
        assert!(op.allows("bob", Need::Release { owner: None }).is_err());
        assert!(viewer.allows("v", Need::Read).is_ok());
        assert!(viewer.allows("v", Need::Pool("p")).is_err());
        assert!(viewer
            .allows("v", Need::Release { owner: Some("v") })
            .is_err());
        assert_eq!("viewer".parse::<Role>().unwrap(), Role::Viewer);
        assert!("root".parse::<Role>().is_err());
    }
}
