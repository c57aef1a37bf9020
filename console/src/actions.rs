//! What a signed-in operator does in the console: reserve in a pool,
//! release a reservation, cordon, uncordon, drain a node and clear a
//! condition. Each is checked against the operator's role exactly as the
//! client API checks it (`gateway::roles`), and written by the same
//! function of `domain` as the API and the command line write it, with the
//! operator in the event's metadata (and `via: console`). Each answers
//! with the page to go to, or why it was refused.

use crate::auth::Who;
use crate::form;
use crate::reply::Failure;
use crate::Shared;
use domain::requests::RequestError;
use domain::standing::Change;
use gateway::roles::Need;
use http::StatusCode;
use std::time::Duration;

fn refused(e: RequestError) -> Failure {
    let status = match &e {
        RequestError::Invalid(_) | RequestError::Refused(_) | RequestError::Exists(_) => {
            StatusCode::BAD_REQUEST
        }
        RequestError::NoSuchPool(_)
        | RequestError::NotFound(_)
        | RequestError::NoSuchNode(_)
        | RequestError::NoSuchQueue { .. } => StatusCode::NOT_FOUND,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    Failure::new(status, e.to_string())
}

fn forbidden(why: String) -> Failure {
    Failure::new(StatusCode::FORBIDDEN, why)
}

fn metadata(who: &Who) -> serde_json::Value {
    serde_json::json!({ "operator": who.operator, "via": "console" })
}

/// Does the action `seg` names with the form `body`.
pub async fn act(
    shared: &Shared,
    who: &Who,
    seg: &[&str],
    body: &[(String, String)],
) -> Result<String, Failure> {
    let client = shared.db.get().await.map_err(Failure::unavailable)?;
    let reason = form::get(body, "reason").unwrap_or("").to_string();
    match seg {
        ["reservations", id, "release"] => {
            let owner = domain::requests::owner(&client, id)
                .await
                .map_err(refused)?
                .ok_or_else(|| Failure::not_found(format!("no reservation {id:?}")))?;
            who.role
                .allows(
                    &who.operator,
                    Need::Release {
                        owner: owner.as_deref(),
                    },
                )
                .map_err(forbidden)?;
            domain::requests::release(&shared.appender, id, &reason, Some(&metadata(who)))
                .await
                .map_err(refused)?;
            Ok(format!("/reservations/{}", form::encode(id)))
        }
        ["pools", pool, "reserve"] => {
            who.role
                .allows(&who.operator, Need::Pool(pool))
                .map_err(forbidden)?;
            let number = |k: &str| -> Result<u64, Failure> {
                form::get(body, k)
                    .unwrap_or("")
                    .trim()
                    .parse()
                    .map_err(|_| {
                        Failure::new(StatusCode::BAD_REQUEST, format!("{k}: give a whole number"))
                    })
            };
            let ttl = match form::get(body, "ttl")
                .map(str::trim)
                .filter(|t| !t.is_empty())
            {
                Some(t) => Some(
                    humantime::parse_duration(t)
                        .map_err(|e| {
                            Failure::new(
                                StatusCode::BAD_REQUEST,
                                format!("time to live {t:?}: {e}"),
                            )
                        })?
                        .as_millis() as u64,
                ),
                None => None,
            };
            let id = domain::new_id("r");
            let request = domain::Request {
                reservation: id.clone(),
                pool: pool.to_string(),
                class: form::get(body, "class").unwrap_or("").trim().to_string(),
                gpus: u32::try_from(number("gpus")?)
                    .map_err(|_| Failure::new(StatusCode::BAD_REQUEST, "gpus: too many"))?,
                shape: domain::Shape::Any,
                priority: 0,
                ttl_ms: ttl,
                replace_on_failure: false,
                replaces: None,
                requeue_on_preemption: false,
                topology: None,
                queue: form::get(body, "queue")
                    .map(str::trim)
                    .filter(|q| !q.is_empty())
                    .map(str::to_string),
                start_ms: None,
            };
            domain::requests::reserve(&client, &shared.appender, &request, Some(&metadata(who)))
                .await
                .map_err(refused)?;
            Ok(format!("/reservations/{}", form::encode(&id)))
        }
        ["nodes", node, action] => {
            let change = match *action {
                "cordon" => Change::Cordon { reason },
                "uncordon" => Change::Uncordon,
                "drain" => Change::Drain {
                    reason,
                    wait: form::get(body, "wait")
                        .filter(|w| !w.trim().is_empty())
                        .map(|w| humantime::parse_duration(w.trim()))
                        .transpose()
                        .map_err(|e| Failure::new(StatusCode::BAD_REQUEST, format!("wait: {e}")))?
                        .map(|d: Duration| d),
                },
                "clear-health" => Change::ClearHealth {
                    device: form::get(body, "device")
                        .map(str::trim)
                        .filter(|d| !d.is_empty())
                        .map(str::to_string),
                    condition: form::get(body, "condition")
                        .unwrap_or("")
                        .trim()
                        .to_string(),
                },
                other => return Err(Failure::not_found(format!("no action {other:?} on a node"))),
            };
            let pool = domain::standing::pool_of_node(&client, node)
                .await
                .map_err(refused)?;
            who.role
                .allows(&who.operator, Need::Pool(&pool))
                .map_err(forbidden)?;
            domain::standing::change(
                &client,
                &shared.appender,
                Some(&pool),
                node,
                &change,
                Some(&metadata(who)),
            )
            .await
            .map_err(refused)?;
            Ok(format!("/nodes/{}", form::encode(node)))
        }
        _ => Err(Failure::not_found("no such action")),
    }
}
