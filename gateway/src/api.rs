//! The client API (`strata.api.v1`), for holders of an operator certificate.

use crate::api_proto::{
    api_server, subscribe_message, Allocation, CommandStatus, ConfigureQueueRequest,
    GetCommandRequest, GetReservationRequest, IssueCommandRequest, ListNodesRequest,
    ListNodesResponse, ListPoolsRequest, ListPoolsResponse, ListQueuesRequest, ListQueuesResponse,
    Node, NodeStandingRequest, NodeStandingResponse, Pool, PoolClass, Promise, QueueShare,
    QueueSpec as ApiQueueSpec, ReleaseRequest, ReleaseResponse, Reservation, ReserveRequest,
    SubscribeMessage, SubscribedEvent, Waiting,
};
use crate::api_proto::{
    DeleteSubscriptionRequest, DeleteSubscriptionResponse, GetUsageRequest, GetUsageResponse,
    ListSubscriptionsRequest, ListSubscriptionsResponse, SubscriptionInfo,
};
use crate::revocation;
use crate::roles::Need;
use crate::state::{Shared, Waited};
use domain::commands::{self, Command};
use domain::requests::{self, RequestError};
use domain::standing::Change;
use domain::{Request as PRequest, Shape};
use events::db::Sql;
use events::AppendError;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

pub(crate) struct ApiService {
    pub(crate) shared: Arc<Shared>,
}

/// The operator a caller's certificate names, if its role allows `need`;
/// refused (PERMISSION_DENIED, with the reason) if the certificate names no
/// operator, was revoked (`strata ca revoke`), or the operator's role
/// (`strata roles`) does not allow it.
async fn authorized<T>(
    shared: &Shared,
    req: &Request<T>,
    need: Need<'_>,
) -> Result<String, Status> {
    let who = caller(shared, req).await?.0;
    let client = shared
        .db
        .get()
        .await
        .map_err(|e| Status::unavailable(format!("database: {e}")))?;
    let role = crate::roles::get(&client, &who)
        .await
        .map_err(|e| Status::unavailable(format!("database: {e}")))?
        .ok_or_else(|| {
            Status::permission_denied(format!(
                "operator {who} has no role; an admin gives one with `strata roles set {who} --role ...`"
            ))
        })?;
    role.allows(&who, need).map_err(Status::permission_denied)?;
    Ok(who)
}

/// The operator a caller's certificate names, and its serial.
async fn caller<T>(shared: &Shared, req: &Request<T>) -> Result<(String, String), Status> {
    let certs = req
        .peer_certs()
        .ok_or_else(|| Status::unauthenticated("the API needs an operator certificate"))?;
    let der = certs
        .first()
        .ok_or_else(|| Status::unauthenticated("the API needs an operator certificate"))?;
    let not_operator = || Status::permission_denied("this certificate is not an operator's");
    let presented = revocation::presented(der.as_ref()).map_err(|_| not_operator())?;
    let who = match (presented.kind, presented.name) {
        (Some("operator"), Some(name)) => name,
        _ => return Err(not_operator()),
    };
    // Operators' certificates come from the root alone: one the issuing
    // intermediate signed (a gateway's key) names nobody.
    if !shared.ca.issued_by_root(der.as_ref()) {
        return Err(Status::permission_denied(
            "this operator certificate was not issued by the region's root CA (operator certificates are issued offline with `strata ca issue-operator`)",
        ));
    }
    still_valid(shared, &who, &presented.serial).await?;
    Ok((who, presented.serial))
}

/// Refuses a certificate that was revoked since (or before) it was presented.
async fn still_valid(shared: &Shared, who: &str, serial: &str) -> Result<(), Status> {
    match shared.revoked.check(&shared.db, serial).await {
        Ok(false) => Ok(()),
        Ok(true) => Err(Status::permission_denied(format!(
            "the certificate of operator {who} (serial {serial}) is revoked"
        ))),
        Err(e) => Err(Status::unavailable(e)),
    }
}

fn request_status(e: RequestError) -> Status {
    match e {
        RequestError::Invalid(m) | RequestError::Refused(m) => Status::invalid_argument(m),
        RequestError::NoSuchPool(_)
        | RequestError::NotFound(_)
        | RequestError::NoSuchNode(_)
        | RequestError::NoSuchQueue { .. } => Status::not_found(e.to_string()),
        RequestError::Exists(_)
        | RequestError::PoolExists(_)
        | RequestError::QueueExists { .. } => Status::already_exists(e.to_string()),
        RequestError::Append(e) => append_status(e),
        RequestError::Database(e) => Status::unavailable(format!("database: {e}")),
    }
}

fn append_status(e: AppendError) -> Status {
    match e {
        AppendError::Invalid(m) => Status::invalid_argument(m),
        AppendError::TooLarge { .. } => Status::invalid_argument(e.to_string()),
        e => Status::unavailable(e.to_string()),
    }
}

fn status_of(t: &commands::Tracked) -> CommandStatus {
    CommandStatus {
        id: t.command.id.clone(),
        node: t.command.node.clone(),
        kind: t.command.kind.clone(),
        state: serde_json::to_value(t.state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        outcome_json: t
            .outcome
            .as_ref()
            .map(|o| o.to_string())
            .unwrap_or_default(),
    }
}

impl ApiService {
    /// Changes a node's standing for an operator; the operator is recorded.
    async fn standing(
        &self,
        req: Request<NodeStandingRequest>,
        change: Change,
    ) -> Result<Response<NodeStandingResponse>, Status> {
        let client = self.db().await?;
        let pool = self
            .pool_of(&client, &req.get_ref().pool, &req.get_ref().node)
            .await?;
        let who = authorized(&self.shared, &req, Need::Pool(&pool)).await?;
        let r = req.into_inner();
        let pool = domain::standing::change(
            &client,
            &self.shared.appender,
            (!r.pool.is_empty()).then_some(r.pool.as_str()),
            &r.node,
            &change,
            Some(&serde_json::json!({ "operator": who })),
        )
        .await
        .map_err(request_status)?;
        Ok(Response::new(NodeStandingResponse { pool }))
    }

    /// The pool a request names, or else the one node `node` is in.
    async fn pool_of(
        &self,
        client: &tokio_postgres::Client,
        named: &str,
        node: &str,
    ) -> Result<String, Status> {
        if !named.is_empty() {
            return Ok(named.to_string());
        }
        domain::standing::pool_of_node(client, node)
            .await
            .map_err(request_status)
    }

    async fn db(&self) -> Result<Arc<tokio_postgres::Client>, Status> {
        self.shared
            .db
            .get()
            .await
            .map_err(|e| Status::unavailable(format!("database: {e}")))
    }

    /// The gateway's pool index, brought up to date: only the events since
    /// the previous call are read (all of them on the first); one caller at
    /// a time brings it up to date.
    async fn pools(
        &self,
        client: &tokio_postgres::Client,
    ) -> Result<tokio::sync::MutexGuard<'_, projections::Index>, Status> {
        let mut index = self.shared.pools.lock().await;
        projections::projector::catch_up(
            client,
            &mut index,
            |v| {
                tracing::warn!(violation = %v, "the log breaks an invariant");
                true
            },
            |_| {},
        )
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(index)
    }

    async fn wait(
        &self,
        key: String,
        wait_ms: u32,
        rx: oneshot::Receiver<Waited>,
    ) -> Option<Waited> {
        let r = tokio::time::timeout(Duration::from_millis(wait_ms.into()), rx).await;
        self.shared.forget_waiter(&key);
        r.ok().and_then(Result::ok)
    }

    async fn command(&self, id: &str) -> Result<Option<commands::Tracked>, Status> {
        let client = self.db().await?;
        let node: Option<String> = client
            .opt(
                "SELECT payload->>'node' FROM strata.events WHERE stream = $1 AND version = 1",
                &[&commands::command_stream(id)],
            )
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?
            .map(|r| r.get(0));
        let Some(node) = node else {
            return Ok(None);
        };
        let found = commands::list(&client, Some(&node), 100_000)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(found.into_iter().find(|t| t.command.id == id))
    }
}

type EventStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<SubscribedEvent, Status>> + Send>>;

#[tonic::async_trait]
impl api_server::Api for ApiService {
    type SubscribeStream = EventStream;

    async fn subscribe(
        &self,
        req: Request<tonic::Streaming<SubscribeMessage>>,
    ) -> Result<Response<EventStream>, Status> {
        let (who, serial) = caller(&self.shared, &req).await?;
        let mut inbound = req.into_inner();
        let start = match inbound.message().await? {
            Some(SubscribeMessage {
                body: Some(subscribe_message::Body::Start(s)),
            }) => s,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message of Subscribe is start",
                ))
            }
        };
        domain::valid_name("subscription name", &start.name).map_err(Status::invalid_argument)?;
        let client = self.db().await?;
        let grant = crate::grants::get(&client, &who)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?
            .ok_or_else(|| {
                Status::permission_denied(format!(
                    "{who} has no grant to read events (strata grants set)"
                ))
            })?;
        let filter = grant
            .narrow(&start.stream_prefixes, &start.types)
            .ok_or_else(|| {
                Status::permission_denied("the subscription asks for nothing within your grant")
            })?;
        let from = match start.from.as_str() {
            "" => events::Start::Beginning,
            f => {
                match f.parse::<events::Start>() {
                    Ok(s) => s,
                    Err(_) => {
                        let t = humantime_rfc3339(f).ok_or_else(|| {
                            Status::invalid_argument(format!(
                                "from {f:?}: start, now, a position or an RFC 3339 time"
                            ))
                        })?;
                        let before: Option<i64> = client
                        .one("SELECT min(position) - 1 FROM strata.events WHERE recorded_at >= $1", &[&t])
                        .await
                        .map_err(|e| Status::unavailable(e.to_string()))?
                        .get(0);
                        match before {
                            Some(p) => events::Start::After(events::Position(p.max(0) as u64)),
                            None => events::Start::Now,
                        }
                    }
                }
            }
        };
        let name = crate::subscriptions::row_name(&who, &start.name);
        let existed = crate::subscriptions::exists(&client, &who, &start.name).await?;
        let sub = self
            .shared
            .reader
            .subscribe(&name, from)
            .await
            .map_err(|e| match e {
                events::SubscribeError::InUse { .. } => Status::already_exists(format!(
                    "subscription {:?} is open on another connection",
                    start.name
                )),
                e => Status::unavailable(e.to_string()),
            })?;
        // A new one counts against the caller's cap.
        let cap = self.shared.config.max_subscriptions_per_caller;
        if !existed {
            if let Some(held) = crate::subscriptions::over_cap(&client, &who, cap).await? {
                let _ = sub.close().await;
                crate::subscriptions::forget(&client, &who, &start.name).await;
                return Err(Status::resource_exhausted(format!(
                    "{who} would hold {held} durable subscriptions, more than a caller may (--max-subscriptions-per-caller {cap}); delete one first (DeleteSubscription)"
                )));
            }
        }
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<SubscribedEvent, Status>>(256);
        ops::task::spawn(
            "api-subscription",
            stream_subscription(self.shared.clone(), who, serial, inbound, sub, filter, tx),
        );
        let out =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        Ok(Response::new(Box::pin(out)))
    }

    async fn reserve(&self, req: Request<ReserveRequest>) -> Result<Response<Reservation>, Status> {
        let pool = req.get_ref().pool.clone();
        let who = authorized(&self.shared, &req, Need::Pool(&pool)).await?;
        let r = req.into_inner();
        let (shape, gpus) = if r.nodes > 0 || r.gpus_per_node > 0 {
            (
                Shape::Gang {
                    nodes: r.nodes,
                    gpus_per_node: r.gpus_per_node,
                },
                if r.gpus == 0 {
                    r.nodes.saturating_mul(r.gpus_per_node)
                } else {
                    r.gpus
                },
            )
        } else {
            let shape = match r.shape.as_str() {
                "" | "any" => Shape::Any,
                "node" => Shape::Node,
                "island" => Shape::Island,
                other => return Err(Status::invalid_argument(format!("unknown shape {other:?}"))),
            };
            (shape, r.gpus)
        };
        let id = if r.id.is_empty() {
            domain::new_id("r")
        } else {
            r.id
        };
        let tier = |t: &str| domain::Tier::parse(t).map_err(Status::invalid_argument);
        use domain::Topology;
        let topology = match (
            r.within.as_str(),
            r.prefer_within.as_str(),
            r.spread.as_str(),
        ) {
            ("", "", "") => None,
            (t, "", "") => Some(Topology::Within(tier(t)?)),
            ("", t, "") => Some(Topology::Prefer(tier(t)?)),
            ("", "", t) => Some(Topology::Spread(tier(t)?)),
            _ => {
                return Err(Status::invalid_argument(
                    "give at most one of within, prefer_within and spread",
                ))
            }
        };
        let request = PRequest {
            reservation: id.clone(),
            pool: r.pool.clone(),
            class: r.class,
            gpus,
            shape,
            priority: r.priority,
            ttl_ms: (r.ttl_ms > 0).then_some(r.ttl_ms),
            replace_on_failure: r.replace_on_failure,
            replaces: None,
            topology,
            requeue_on_preemption: r.requeue_on_preemption,
            start_ms: (r.start_ms > 0).then_some(r.start_ms),
            queue: (!r.queue.is_empty()).then_some(r.queue),
        };
        let client = self.db().await?;
        // Listen before asking, so the outcome cannot slip past.
        let key = format!("r:{id}");
        let rx = (r.wait_ms > 0).then(|| self.shared.add_waiter(&key));
        let asked = requests::reserve(
            &client,
            &self.shared.appender,
            &request,
            Some(&serde_json::json!({ "operator": who })),
        )
        .await;
        if let Err(e) = asked {
            self.shared.forget_waiter(&key);
            return Err(request_status(e));
        }
        let mut out = Reservation {
            id: id.clone(),
            state: "requested".into(),
            ..Reservation::default()
        };
        if let Some(rx) = rx {
            if let Some(Waited::Reservation {
                state,
                reason,
                allocations,
            }) = self.wait(key, r.wait_ms, rx).await
            {
                if state == "placed" {
                    out.cdi_device = node::cdi::qualified_name(&id);
                }
                out.state = state;
                out.reason = reason;
                out.allocations = api_allocations(&allocations);
            }
        }
        Ok(Response::new(out))
    }

    async fn get_reservation(
        &self,
        req: Request<GetReservationRequest>,
    ) -> Result<Response<Reservation>, Status> {
        authorized(&self.shared, &req, Need::Read).await?;
        let id = req.into_inner().id;
        let client = self.db().await?;
        let index = self.pools(&client).await?;
        if let Some(r) = index.reservation(&id) {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let waiting = projections::waiting::standing(&index, &id, now).map(|s| Waiting {
                why: s.why,
                position: s.position as u32,
                ahead: s.ahead as u32,
                ahead_gpus: s.ahead_gpus,
                waiting: s.waiting as u32,
                free_now: s.free_now,
                earliest_start_ms: s.earliest_start_ms.unwrap_or(0),
                queue: s.queue.unwrap_or_default(),
            });
            let state = r.state();
            let promise = r.promise.as_ref().map(|p| Promise {
                start_ms: p.start_ms,
                end_ms: p.end_ms,
                allocations: api_allocations(&p.allocations),
            });
            let cdi_device = if r.phase.is_live() {
                node::cdi::qualified_name(&id)
            } else {
                String::new()
            };
            return Ok(Response::new(Reservation {
                id,
                state: state.into(),
                reason: r.reason.clone(),
                allocations: api_allocations(&r.allocations),
                cdi_device,
                waiting,
                promise,
            }));
        }
        drop(index);
        // Not live or waiting: how it ended, if it was ever asked for.
        match requests::outcome(&client, &id)
            .await
            .map_err(request_status)?
        {
            Some(outcome) => Ok(Response::new(Reservation {
                id,
                state: outcome,
                ..Reservation::default()
            })),
            None => Err(Status::not_found(format!(
                "reservation {id:?} does not exist"
            ))),
        }
    }

    async fn release(
        &self,
        req: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let client = self.db().await?;
        let owner = requests::owner(&client, &req.get_ref().id)
            .await
            .map_err(request_status)?
            .ok_or_else(|| {
                Status::not_found(format!("reservation {:?} does not exist", req.get_ref().id))
            })?;
        let who = authorized(
            &self.shared,
            &req,
            Need::Release {
                owner: owner.as_deref(),
            },
        )
        .await?;
        let r = req.into_inner();
        requests::release(
            &self.shared.appender,
            &r.id,
            &r.reason,
            Some(&serde_json::json!({ "operator": who })),
        )
        .await
        .map_err(request_status)?;
        Ok(Response::new(ReleaseResponse {}))
    }

    async fn list_pools(
        &self,
        req: Request<ListPoolsRequest>,
    ) -> Result<Response<ListPoolsResponse>, Status> {
        authorized(&self.shared, &req, Need::Read).await?;
        let client = self.db().await?;
        let index = self.pools(&client).await?;
        let mut pools = Vec::new();
        for p in index.state().pools.values().filter(|p| p.created) {
            let q = index.queues(&p.name);
            pools.push(Pool {
                name: p.name.clone(),
                nodes: p.nodes.values().filter(|n| !n.left).count() as u32,
                schedulable: p.nodes.values().filter(|n| n.schedulable()).count() as u32,
                classes: index
                    .classes(&p.name)
                    .map(|(c, ci)| PoolClass {
                        class: c.to_string(),
                        total: ci.total,
                        free: ci.free,
                    })
                    .collect(),
                live: index
                    .state()
                    .reservations
                    .values()
                    .filter(|r| r.request.pool == p.name && r.phase.is_live())
                    .count() as u32,
                waiting: q.map_or(0, |q| (q.pending.len() + q.queued.len()) as u32),
            });
        }
        Ok(Response::new(ListPoolsResponse { pools }))
    }

    async fn configure_queue(
        &self,
        req: Request<ConfigureQueueRequest>,
    ) -> Result<Response<ApiQueueSpec>, Status> {
        let who = authorized(&self.shared, &req, Need::Admin("change a pool's queues")).await?;
        let r = req.into_inner();
        let Some(given) = r.spec else {
            return Err(Status::invalid_argument("give the queue's spec"));
        };
        let spec = domain::QueueSpec {
            queue: given.queue.clone(),
            cohort: (!given.cohort.is_empty()).then(|| given.cohort.clone()),
            weight: given.weight.max(1),
            quotas: given
                .quotas
                .iter()
                .map(|q| domain::Quota {
                    class: q.class.clone(),
                    nominal: q.nominal,
                    borrowing_limit: q.borrowing_limit,
                })
                .collect(),
            // Budgets and run time are not in the API's spec: kept below.
            budgets: Vec::new(),
            max_run_ms: None,
        };
        let client = self.db().await?;
        let (pool, queue, create_only) = (given.pool.clone(), given.queue.clone(), r.create_only);
        let edit = |now: Option<&domain::QueueSpec>| {
            if create_only {
                domain::queues::refuse_existing(&pool, &queue, now)?;
            }
            let mut spec = spec.clone();
            if let Some(now) = now {
                spec.budgets = now.budgets.clone();
                spec.max_run_ms = now.max_run_ms;
            }
            Ok(spec)
        };
        domain::queues::configure(
            &client,
            &self.shared.appender,
            &given.pool,
            &given.queue,
            &edit,
            Some(&serde_json::json!({ "operator": who })),
        )
        .await
        .map_err(request_status)?;
        Ok(Response::new(given))
    }

    async fn list_queues(
        &self,
        req: Request<ListQueuesRequest>,
    ) -> Result<Response<ListQueuesResponse>, Status> {
        authorized(&self.shared, &req, Need::Read).await?;
        let only = req.into_inner().pool;
        let client = self.db().await?;
        let index = self.pools(&client).await?;
        let now_ms = projections::usage::unix_ms(std::time::SystemTime::now()).max(0) as u64;
        let mut queues = Vec::new();
        for pool in index.state().pools.keys() {
            if !only.is_empty() && *pool != only {
                continue;
            }
            queues.extend(
                projections::quota::fair_shares(&index, pool, now_ms)
                    .into_iter()
                    .map(|s| QueueShare {
                        pool: pool.clone(),
                        queue: s.queue,
                        cohort: s.cohort.unwrap_or_default(),
                        weight: s.weight,
                        class: s.class,
                        nominal: s.nominal,
                        borrowing_limit: s.borrowing_limit,
                        used: s.used,
                        waiting: s.waiting,
                        fair: s.fair,
                        half_life_seconds: s.half_life_ms.map(|h| h / 1000),
                        past_gpus: s.past_gpus,
                        past_gpu_hours: s.past_gpu_hours,
                    }),
            );
        }
        Ok(Response::new(ListQueuesResponse { queues }))
    }

    async fn list_nodes(
        &self,
        req: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        authorized(&self.shared, &req, Need::Read).await?;
        let pool = req.into_inner().pool;
        let client = self.db().await?;
        let rows = client
            .rows(
                "SELECT node, pool, bool_and(revoked_at IS NOT NULL) FROM strata.node_certificates
                  WHERE $1 = '' OR pool = $1 GROUP BY node, pool ORDER BY node",
                &[&pool],
            )
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let here = self.shared.session_nodes();
        let nodes = rows
            .iter()
            .map(|r| {
                let id: String = r.get(0);
                Node {
                    session_here: here.contains(&id),
                    id,
                    pool: r.get(1),
                    revoked: r.get(2),
                }
            })
            .collect();
        Ok(Response::new(ListNodesResponse { nodes }))
    }

    async fn cordon_node(
        &self,
        req: Request<NodeStandingRequest>,
    ) -> Result<Response<NodeStandingResponse>, Status> {
        let reason = req.get_ref().reason.clone();
        self.standing(req, Change::Cordon { reason }).await
    }

    async fn uncordon_node(
        &self,
        req: Request<NodeStandingRequest>,
    ) -> Result<Response<NodeStandingResponse>, Status> {
        self.standing(req, Change::Uncordon).await
    }

    async fn drain_node(
        &self,
        req: Request<NodeStandingRequest>,
    ) -> Result<Response<NodeStandingResponse>, Status> {
        let r = req.get_ref();
        let change = Change::Drain {
            reason: r.reason.clone(),
            wait: (r.drain_wait_ms > 0).then(|| Duration::from_millis(r.drain_wait_ms)),
        };
        self.standing(req, change).await
    }

    async fn remove_node(
        &self,
        req: Request<NodeStandingRequest>,
    ) -> Result<Response<NodeStandingResponse>, Status> {
        let reason = req.get_ref().reason.clone();
        self.standing(req, Change::Leave { reason }).await
    }

    async fn clear_node_health(
        &self,
        req: Request<NodeStandingRequest>,
    ) -> Result<Response<NodeStandingResponse>, Status> {
        let r = req.get_ref();
        let change = Change::ClearHealth {
            device: (!r.device.is_empty()).then(|| r.device.clone()),
            condition: r.condition.clone(),
        };
        self.standing(req, change).await
    }

    async fn issue_command(
        &self,
        req: Request<IssueCommandRequest>,
    ) -> Result<Response<CommandStatus>, Status> {
        if commands::is_internal(&req.get_ref().kind) {
            return Err(Status::permission_denied(commands::internal_refusal(
                &req.get_ref().kind,
            )));
        }
        if commands::is_reserved_id(&req.get_ref().id) {
            return Err(Status::permission_denied(commands::reserved_id_refusal(
                &req.get_ref().id,
            )));
        }
        let client = self.db().await?;
        let pool = self.pool_of(&client, "", &req.get_ref().node).await?;
        let who = authorized(&self.shared, &req, Need::Pool(&pool)).await?;
        let r = req.into_inner();
        let args: serde_json::Value = if r.args_json.is_empty() {
            serde_json::json!({})
        } else {
            serde_json::from_str(&r.args_json)
                .map_err(|e| Status::invalid_argument(format!("args_json: {e}")))?
        };
        let id = if r.id.is_empty() {
            domain::new_id("c")
        } else {
            r.id
        };
        let deadline = if r.deadline_ms == 0 {
            300_000
        } else {
            r.deadline_ms
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let command = Command {
            id: id.clone(),
            node: r.node,
            kind: r.kind,
            args,
            deadline_ms: now + deadline,
            issued_by: format!("operator:{who}"),
        };
        let key = format!("c:{id}");
        let rx = (r.wait_ms > 0).then(|| self.shared.add_waiter(&key));
        tracing::info!(%who, command = %id, node = %command.node, kind = %command.kind, "command issued through the API");
        if let Err(e) = commands::issue(&self.shared.appender, &command).await {
            self.shared.forget_waiter(&key);
            return Err(match e {
                AppendError::VersionConflict { .. } => {
                    Status::already_exists(format!("command {id:?} already exists"))
                }
                e => append_status(e),
            });
        }
        if let Some(rx) = rx {
            if let Some(Waited::Command(t)) = self.wait(key, r.wait_ms, rx).await {
                return Ok(Response::new(status_of(&t)));
            }
        }
        Ok(Response::new(CommandStatus {
            id,
            node: command.node,
            kind: command.kind,
            state: "issued".into(),
            outcome_json: String::new(),
        }))
    }

    async fn list_subscriptions(
        &self,
        req: Request<ListSubscriptionsRequest>,
    ) -> Result<Response<ListSubscriptionsResponse>, Status> {
        let (who, _) = caller(&self.shared, &req).await?;
        let client = self.db().await?;
        let subscriptions = crate::subscriptions::list(&client, &who)
            .await?
            .into_iter()
            .map(|(name, position, open)| SubscriptionInfo {
                name,
                position,
                open,
            })
            .collect();
        Ok(Response::new(ListSubscriptionsResponse { subscriptions }))
    }

    async fn delete_subscription(
        &self,
        req: Request<DeleteSubscriptionRequest>,
    ) -> Result<Response<DeleteSubscriptionResponse>, Status> {
        let (who, _) = caller(&self.shared, &req).await?;
        let name = req.into_inner().name;
        domain::valid_name("subscription name", &name).map_err(Status::invalid_argument)?;
        let client = self.db().await?;
        crate::subscriptions::delete(&client, &who, &name).await?;
        Ok(Response::new(DeleteSubscriptionResponse {}))
    }

    async fn get_usage(
        &self,
        req: Request<GetUsageRequest>,
    ) -> Result<Response<GetUsageResponse>, Status> {
        let who = authorized(&self.shared, &req, Need::Read).await?;
        let client = self.db().await?;
        let role = crate::roles::get(&client, &who)
            .await
            .map_err(|e| Status::unavailable(format!("database: {e}")))?
            .ok_or_else(|| Status::permission_denied(format!("operator {who} has no role")))?;
        crate::usage::get_usage(&self.shared, &who, &role, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn get_command(
        &self,
        req: Request<GetCommandRequest>,
    ) -> Result<Response<CommandStatus>, Status> {
        authorized(&self.shared, &req, Need::Read).await?;
        let id = req.into_inner().id;
        match self.command(&id).await? {
            Some(t) => Ok(Response::new(status_of(&t))),
            None => Err(Status::not_found(format!("command {id:?} does not exist"))),
        }
    }
}

/// Parses an RFC 3339 time such as `2026-11-30T10:00:00Z`.
fn humantime_rfc3339(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s).ok()
}

/// Sends a subscription's events within `filter` to its caller, takes
/// its acknowledgements, and ends it when the caller leaves, is revoked,
/// or the gateway stops.
async fn stream_subscription(
    shared: Arc<Shared>,
    who: String,
    serial: String,
    mut inbound: tonic::Streaming<SubscribeMessage>,
    mut sub: events::Subscription,
    filter: crate::grants::Grant,
    tx: tokio::sync::mpsc::Sender<Result<SubscribedEvent, Status>>,
) {
    let mut stopping = shared.stopping.subscribe();
    // Events outside the filter are acknowledged on the client's
    // behalf when nothing it was sent is waiting for its ack.
    let (mut sent, mut acked) = (0u64, 0u64);
    // The certificate is checked again as often as revocations are
    // reloaded: a revoked operator's stream ends.
    let mut recheck = tokio::time::interval(crate::revocation::Revoked::RELOAD);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = async { let _ = stopping.wait_for(|s| *s).await; } => {
                let _ = tx
                    .send(Err(Status::unavailable(
                        "this gateway is shutting down; subscribe again (to another gateway)",
                    )))
                    .await;
                break;
            }
            _ = recheck.tick() => {
                // Only a revocation ends the stream; a database
                // that is briefly away does not.
                if let Err(status) = still_valid(&shared, &who, &serial).await {
                    if status.code() == tonic::Code::PermissionDenied {
                        let _ = tx.send(Err(status)).await;
                        break;
                    }
                }
            }
            m = inbound.message() => match m {
                Ok(Some(SubscribeMessage { body: Some(subscribe_message::Body::Ack(a)) })) => {
                    acked = acked.max(a.position.min(sent));
                    sub.ack(events::Position(acked));
                }
                Ok(Some(_)) => {}
                _ => break,
            },
            e = sub.next() => match e {
                Ok(e) => {
                    if filter.allows(&e.stream, &e.event_type) {
                        let ev = SubscribedEvent {
                            position: e.position.0,
                            stream: e.stream.clone(),
                            version: e.version,
                            r#type: e.event_type.clone(),
                            payload: e.payload.clone(),
                            metadata: e.metadata.clone(),
                            recorded_at_unix_us: events::types::to_pg_time(e.recorded_at)
                                + events::types::PG_EPOCH_OFFSET_MICROS,
                        };
                        if tx.send(Ok(ev)).await.is_err() {
                            break;
                        }
                        sent = e.position.0;
                    } else if acked >= sent {
                        acked = e.position.0;
                        sent = e.position.0;
                        sub.ack(e.position);
                    }
                }
                Err(err) => {
                    let _ = tx.send(Err(Status::unavailable(err.to_string()))).await;
                    break;
                }
            },
        }
    }
    let _ = sub.close().await;
}

/// A placement's devices as the API carries them.
fn api_allocations(allocations: &[domain::Allocation]) -> Vec<Allocation> {
    allocations
        .iter()
        .map(|a| Allocation {
            node: a.node.clone(),
            devices: a.devices.clone(),
        })
        .collect()
}
