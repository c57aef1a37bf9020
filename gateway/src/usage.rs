//! The client API's `GetUsage`: a usage report
//! (`projections::usage::report`) scoped by the caller's role: an admin
//! sees every pool, an operator the pools it acts in, a viewer its own
//! reservations. Each report runs on a connection of its own (it reads in
//! one snapshot), at most [`AT_ONCE`] at a time per gateway.

use crate::api_proto::{GetUsageRequest, GetUsageResponse, UsageRow};
use crate::roles::{Assignment, Role};
use crate::state::Shared;
use projections::usage::report::{By, Query, Row};
use tonic::Status;

/// Usage reports one gateway runs at once; more are refused
/// (RESOURCE_EXHAUSTED) rather than queued.
pub(crate) const AT_ONCE: usize = 4;

/// Which pools and whose reservations `who`, holding `role`, may see of
/// those it asked for (`pools` empty: all it may see); why not, otherwise.
/// The console's usage page asks the same.
pub fn scope(
    who: &str,
    role: &Assignment,
    pools: Vec<String>,
    by: &[By],
) -> Result<(Option<Vec<String>>, Option<String>), String> {
    let asked = (!pools.is_empty()).then_some(pools);
    match role.role {
        Role::Admin => Ok((asked, None)),
        Role::Operator => {
            let asked = asked.unwrap_or_else(|| role.pools.clone());
            if let Some(p) = asked.iter().find(|p| !role.pools.contains(p)) {
                return Err(format!(
                    "operator {who} acts in pools {:?}, not in {p:?}: its usage is not {who}'s to see",
                    role.pools
                ));
            }
            Ok((Some(asked), None))
        }
        Role::Viewer if by.contains(&By::Node) => Err(format!(
            "{who} is a viewer: it sees its own usage, which is not kept by node"
        )),
        Role::Viewer => Ok((asked, Some(who.to_string()))),
    }
}

fn row(r: &Row) -> UsageRow {
    UsageRow {
        keys: r.keys.clone(),
        gpu_hours: r.gpu_hours,
        held_gpu_hours: r.held_gpu_hours,
        billed_hours: r.billed_hours,
        reservations_ended: r.reservations_ended,
        reservations_running: r.reservations_running,
    }
}

/// Answers `GetUsage` for `who`.
pub(crate) async fn get_usage(
    shared: &Shared,
    who: &str,
    role: &Assignment,
    req: GetUsageRequest,
) -> Result<GetUsageResponse, Status> {
    let by = By::parse_list(&req.by.join(",")).map_err(Status::invalid_argument)?;
    let (pools, owner) = scope(who, role, req.pools, &by).map_err(Status::permission_denied)?;
    let now = projections::usage::unix_ms(std::time::SystemTime::now());
    let until = if req.until_unix_ms == 0 {
        now
    } else {
        req.until_unix_ms
    };
    if until < req.since_unix_ms {
        return Err(Status::invalid_argument("until is before since"));
    }
    let _permit = shared.reports.try_acquire().map_err(|_| {
        Status::resource_exhausted(format!(
            "this gateway runs {AT_ONCE} usage reports at once; try again shortly"
        ))
    })?;
    let unavailable = |e: tokio_postgres::Error| Status::unavailable(format!("database: {e}"));
    let mut client = events::db::connect(shared.db.config.clone(), "strata-usage-report")
        .await
        .map_err(unavailable)?;
    let q = Query {
        since_ms: req.since_unix_ms,
        until_ms: until,
        by,
        pools,
        owner: owner.clone(),
        now_ms: now,
    };
    let r = projections::usage::report::report(&mut client, &q)
        .await
        .map_err(unavailable)?;
    Ok(GetUsageResponse {
        since: r.since,
        until: r.until,
        by: r.by.iter().map(|b| b.name().to_string()).collect(),
        position: r.position.unwrap_or(0),
        behind: r.behind,
        rows: r.rows.iter().map(row).collect(),
        total: Some(row(&r.total)),
        owner: owner.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn role(role: Role, pools: &[&str]) -> Assignment {
        Assignment {
            role,
            pools: pools.iter().map(|p| p.to_string()).collect(),
        }
    }

    #[test]
    fn each_role_sees_its_own_scope() {
        let op = role(Role::Operator, &["p"]);
        assert_eq!(
            scope("ana", &op, vec![], &[]).unwrap(),
            (Some(vec!["p".to_string()]), None)
        );
        let e = scope("ana", &op, vec!["q".into()], &[]).unwrap_err();
        assert!(e.contains("not in \"q\""), "{e}");
        let viewer = role(Role::Viewer, &[]);
        assert_eq!(
            scope("bo", &viewer, vec![], &[]).unwrap(),
            (None, Some("bo".to_string()))
        );
        assert!(scope("bo", &viewer, vec![], &[By::Node]).is_err());
        assert_eq!(
            scope("root", &role(Role::Admin, &[]), vec![], &[]).unwrap(),
            (None, None)
        );
    }
}
