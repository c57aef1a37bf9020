//! The gateway's metrics on `/metrics`: its counters summed over the
//! gateways of the process ([`ops::metrics::Instances`]), every RPC by
//! service, method and status code ([`RpcLayer`]), and how long commands
//! take from the log to a node's session and from its result to the log.

use crate::listener::ListenerStats;
use crate::state::GatewayStats;
use ops::metrics::{Field, Instances};
use prometheus::{Histogram, IntCounterVec};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use ops::metrics::prometheus;

const REFUSED: &str = "Sessions, joins and messages refused, by reason.";

static GATEWAY: &[Field<GatewayStats>] = &[
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_sessions",
        Gauge,
        "Node sessions held.",
        &[],
        sessions
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_sessions_opened_total",
        Counter,
        "Node sessions opened.",
        &[],
        sessions_opened
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_hellos_abandoned_total",
        Counter,
        "Hellos whose node gave up waiting before its session opened (not opened).",
        &[],
        hellos_abandoned
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_write_queue",
        Gauge,
        "Writes queued for the gateway's writer and not yet taken by it.",
        &[],
        writes_queued
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_writes_in_flight",
        Gauge,
        "Writes the gateway's writer has taken and not yet answered (being written, retried, or asked after).",
        &[],
        writes_in_flight
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "rate")],
        refused_rate
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "full")],
        refused_full
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "pending_hellos")],
        refused_pending
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "writes_behind")],
        refused_behind
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "inventory")],
        refused_inventory
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "no_lease")],
        refused_no_lease
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "identity")],
        refused_identity
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "join")],
        refused_joins
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_refused_total",
        Counter,
        REFUSED,
        &[("reason", "message_rate")],
        refused_messages
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_lease_lost_total",
        Counter,
        "Times this gateway found its lease lapsed (frozen, or cut off from the database) and ended its sessions.",
        &[],
        lease_lost
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_database_outages_ridden_total",
        Counter,
        "Times this gateway's lease ran past its end while the database said it was down (restarting, recovering) and the gateway kept its sessions, refusing new ones, until the database was back.",
        &[],
        database_outages_ridden
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_lapsed_nodes_marked_total",
        Counter,
        "Nodes of gateways whose lease lapsed that this gateway marked lost (node.session_expired).",
        &[],
        orphans_marked
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_joins_total",
        Counter,
        "Nodes joined with a token.",
        &[],
        joins
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_write_batches_total",
        Counter,
        "Batches of node events written to the log.",
        &[],
        batches
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_events_written_total",
        Counter,
        "Node events written to the log.",
        &[],
        events_written
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_fenced_total",
        Counter,
        "Node events refused by a session's fence (a newer session of the node).",
        &[],
        fenced
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_write_errors_total",
        Counter,
        "Batches of node events that failed to be written.",
        &[],
        write_errors
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_write_retries_total",
        Counter,
        "Writes tried again after a transient failure (batches of node events, command results), and asks again whether a batch whose commit is in doubt committed.",
        &[],
        write_retries
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_health_coalesced_total",
        Counter,
        "Health reports not written: repeats, and clears of a flapping condition held back.",
        &[],
        health_coalesced
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_commands_dispatched_total",
        Counter,
        "Commands sent to nodes' sessions.",
        &[],
        commands_dispatched
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_commands_finished_total",
        Counter,
        "Commands whose outcome a node reported.",
        &[],
        commands_finished
    ),
    ops::stat_field!(
        GatewayStats,
        "strata_gateway_command_drops_total",
        Counter,
        "Commands that could not be queued to a live session (sent again on reconnect).",
        &[],
        command_drops
    ),
];

const HANDSHAKES: &str = "TLS handshakes, by result.";

static LISTENER: &[Field<ListenerStats>] = &[
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_connections_accepted_total",
        Counter,
        "TCP connections accepted.",
        &[],
        accepted
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_handshakes_total",
        Counter,
        HANDSHAKES,
        &[("result", "ok")],
        handshakes
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_handshakes_total",
        Counter,
        HANDSHAKES,
        &[("result", "failed")],
        handshake_failures
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_handshakes_total",
        Counter,
        HANDSHAKES,
        &[("result", "timed_out")],
        handshake_timeouts
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_idle_closed_total",
        Counter,
        "Idle connections closed (past the idle timeout, or the longest idle when too many were).",
        &[],
        idle_closed
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_out_of_descriptors_total",
        Counter,
        "Accepts that failed for want of a file descriptor.",
        &[],
        out_of_descriptors
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_unauthenticated_refused_total",
        Counter,
        "Connections without a client certificate closed after their handshake: their share (--max-unauthenticated-connections) was full and none could be closed.",
        &[],
        unauthenticated_refused
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_unauthenticated_evicted_total",
        Counter,
        "Busy connections without a client certificate closed to make room for a new one: of a share full of busy ones, the one that has waited the longest (over a second) on its client for a request message.",
        &[],
        unauthenticated_evicted
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_handshakes_held_back_total",
        Counter,
        "Connections closed before their TLS handshake: from an address that never presented a client certificate, while the share of connections without one was pressed, and suspected (an RPC of its stalled, or it offered a token never issued, in the last minute) or over --unknown-handshakes-per-second, and whose ClientHello named no join token the region issued (or was not read: too many were being read).",
        &[],
        handshakes_held_back
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_hellos_unread_total",
        Counter,
        "Of the connections held back before their TLS handshake, those closed without their ClientHello read: as many as the gateway reads at once were being read.",
        &[],
        hellos_unread
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_handshakes_by_token_total",
        Counter,
        "Connections that would have been held back but whose ClientHello named a join token the region issued: they got their TLS handshake.",
        &[],
        handshakes_by_token
    ),
    ops::stat_field!(
        ListenerStats,
        "strata_gateway_requests_cut_total",
        Counter,
        "RPCs cancelled because a request message did not arrive whole within --request-deadline.",
        &[],
        requests_cut
    ),
];

/// Counts `stats` into `/metrics` while it lives.
pub(crate) fn count_gateway(stats: &Arc<GatewayStats>) {
    static G: OnceLock<Instances<GatewayStats>> = OnceLock::new();
    G.get_or_init(|| Instances::new(GATEWAY)).add(stats);
}

/// Counts `stats` into `/metrics` while it lives.
pub(crate) fn count_listener(stats: &Arc<ListenerStats>) {
    static L: OnceLock<Instances<ListenerStats>> = OnceLock::new();
    L.get_or_init(|| Instances::new(LISTENER)).add(stats);
}

fn rpcs() -> &'static IntCounterVec {
    static R: OnceLock<IntCounterVec> = OnceLock::new();
    R.get_or_init(|| {
        ops::metrics::counter_vec(
            "strata_gateway_rpcs_total",
            "RPCs answered, by service, method and gRPC status code (a stream counts when it ends).",
            &["service", "method", "code"],
        )
    })
}

fn rpc_seconds() -> &'static prometheus::HistogramVec {
    static R: OnceLock<prometheus::HistogramVec> = OnceLock::new();
    R.get_or_init(|| {
        ops::metrics::histogram_vec(
            "strata_gateway_rpc_duration_seconds",
            "Time to answer unary RPCs (streams are not timed), by service and method.",
            &["service", "method"],
            &[
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
            ],
        )
    })
}

/// Time from a command's event to its sending on the node's session.
pub(crate) fn command_dispatch_seconds() -> &'static Histogram {
    static H: OnceLock<Histogram> = OnceLock::new();
    H.get_or_init(|| {
        ops::metrics::histogram(
            "strata_gateway_command_dispatch_seconds",
            "Time from a command's event being recorded to its sending on the node's session.",
            ops::metrics::SECONDS_BUCKETS,
        )
    })
}

/// Time from a node's result being read off its session to its outcome
/// recorded in the log.
pub(crate) fn command_result_seconds() -> &'static Histogram {
    static H: OnceLock<Histogram> = OnceLock::new();
    H.get_or_init(|| {
        ops::metrics::histogram(
            "strata_gateway_command_result_seconds",
            "Time from a node's command result being read off its session to the command's outcome recorded in the log.",
            ops::metrics::SECONDS_BUCKETS,
        )
    })
}

/// The services of this gateway: a method outside them is not a label.
const SERVICES: &[&str] = &[
    "strata.node.v1.Join",
    "strata.node.v1.Session",
    "strata.api.v1.Api",
];

/// Splits `/pkg.Service/Method` into bounded label values: a path that is
/// not one of this gateway's services is `other`.
fn labels(path: &str) -> (&'static str, String) {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (service, method) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    match SERVICES.iter().find(|s| **s == service) {
        Some(s)
            if !method.is_empty()
                && method.len() <= 64
                && method.bytes().all(|b| b.is_ascii_alphanumeric()) =>
        {
            (s, method.to_string())
        }
        _ => ("other", "other".to_string()),
    }
}

fn code_name(code: i32) -> String {
    format!("{:?}", tonic::Code::from_i32(code))
}

/// One RPC, counted once when its response ends (or is dropped unfinished:
/// `Cancelled`).
struct Rpc {
    service: &'static str,
    method: String,
    started: Instant,
    /// A unary call is timed.
    unary: bool,
    code: Option<i32>,
}

impl Drop for Rpc {
    fn drop(&mut self) {
        // An UNIMPLEMENTED method is not a label value: any client could
        // make up as many as it liked.
        let method = match self.code {
            Some(12) => "other",
            _ => self.method.as_str(),
        };
        let code = code_name(self.code.unwrap_or(1));
        rpcs()
            .with_label_values(&[self.service, method, &code])
            .inc();
        if self.unary && self.code.is_some() {
            rpc_seconds()
                .with_label_values(&[self.service, method])
                .observe(self.started.elapsed().as_secs_f64());
        }
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<i32> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Counts every RPC by service, method and code.
#[derive(Clone, Default)]
pub(crate) struct RpcLayer;

impl<S> tower_layer::Layer<S> for RpcLayer {
    type Service = RpcService<S>;
    fn layer(&self, inner: S) -> RpcService<S> {
        RpcService { inner }
    }
}

#[derive(Clone)]
pub(crate) struct RpcService<S> {
    inner: S,
}

/// The streaming methods (not timed).
const STREAMS: &[&str] = &["Open", "Subscribe"];

impl<S, B> tower_service::Service<http::Request<B>> for RpcService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures_util::future::BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let (service, method) = labels(req.uri().path());
        let unary = !STREAMS.contains(&method.as_str());
        let mut rpc = Rpc {
            service,
            method,
            started: Instant::now(),
            unary,
            code: None,
        };
        // A span per unary call (a session or a subscription would be one
        // span as long as the connection), continuing the caller's trace
        // when it sent a `traceparent`.
        let span = if unary {
            let span = tracing::info_span!(
                "rpc",
                otel.kind = "server",
                rpc.system = "grpc",
                rpc.service = service,
                rpc.method = %rpc.method
            );
            if let Some(tp) = req
                .headers()
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
            {
                events::trace::follow(&span, tp);
            }
            span
        } else {
            tracing::Span::none()
        };
        let fut = span.in_scope(|| self.inner.call(req));
        use tracing::Instrument as _;
        Box::pin(
            async move {
                let resp = fut.await?;
                // A trailers-only answer (an error) carries its status here.
                if let Some(code) = grpc_status(resp.headers()) {
                    rpc.code = Some(code);
                }
                Ok(resp.map(|body| tonic::body::Body::new(RpcBody { body, rpc })))
            }
            .instrument(span),
        )
    }
}

/// A response body that reads the status from the trailers.
struct RpcBody {
    body: tonic::body::Body,
    rpc: Rpc,
}

impl http_body::Body for RpcBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(code) = frame.trailers_ref().and_then(grpc_status) {
                this.rpc.code = Some(code);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_gateways_methods_are_label_values() {
        assert_eq!(
            labels("/strata.api.v1.Api/Reserve"),
            ("strata.api.v1.Api", "Reserve".to_string())
        );
        assert_eq!(labels("/evil.Svc/Whatever"), ("other", "other".to_string()));
        assert_eq!(
            labels("/strata.api.v1.Api/a\"b"),
            ("other", "other".to_string())
        );
        assert_eq!(code_name(0), "Ok");
        assert_eq!(code_name(5), "NotFound");
    }
}
