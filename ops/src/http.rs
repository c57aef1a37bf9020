//! The operations endpoint (`--metrics-listen`): HTTP/1.1 with hyper.
//!
//! - `GET /metrics`: every metric of the process in the Prometheus text
//!   format ([`crate::metrics::render`]).
//! - `GET /healthz`: 200 while the process serves requests at all.
//! - `GET /readyz`: 200 when every readiness check registered with
//!   [`ready_when`] passes, 503 otherwise; the body names each check and,
//!   for a failing one, why.

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// A readiness check: `Ok` when ready, otherwise why not.
pub type Check = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

fn checks() -> &'static Mutex<Vec<(String, Check)>> {
    static C: OnceLock<Mutex<Vec<(String, Check)>>> = OnceLock::new();
    C.get_or_init(Mutex::default)
}

/// Adds a readiness check named `name` (a second one of the same name
/// replaces the first).
pub fn ready_when(name: &str, check: impl Fn() -> Result<(), String> + Send + Sync + 'static) {
    let mut c = checks().lock().expect("readiness lock");
    c.retain(|(n, _)| n != name);
    c.push((name.to_string(), Arc::new(check)));
}

/// Runs every readiness check: whether all pass, and one line per check.
pub fn readiness() -> (bool, String) {
    let checks: Vec<(String, Check)> = checks().lock().expect("readiness lock").clone();
    let mut ok = true;
    let mut body = String::new();
    for (name, check) in checks {
        match check() {
            Ok(()) => body.push_str(&format!("{name}: ok\n")),
            Err(why) => {
                ok = false;
                body.push_str(&format!("{name}: not ready: {why}\n"));
            }
        }
    }
    if body.is_empty() {
        body.push_str("no checks\n");
    }
    (ok, body)
}

fn answer(req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let (status, kind, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            crate::metrics::render(),
        ),
        (&Method::GET, "/healthz") => (StatusCode::OK, "text/plain", "ok\n".to_string()),
        (&Method::GET, "/readyz") => {
            let (ok, body) = readiness();
            let status = if ok {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, "text/plain", body)
        }
        (&Method::GET, _) => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found; try /metrics, /healthz or /readyz\n".to_string(),
        ),
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET is served\n".to_string(),
        ),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(kind),
    );
    resp
}

/// Serves the endpoint on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener) {
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // EMFILE and the like: wait instead of spinning.
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        crate::task::spawn("metrics-conn", async move {
            let service = hyper::service::service_fn(|req| async move {
                Ok::<_, std::convert::Infallible>(answer(&req))
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .header_read_timeout(Duration::from_secs(5))
                .timer(hyper_util::rt::TokioTimer::new())
                .serve_connection(hyper_util::rt::TokioIo::new(sock), service);
            // A scraper keeps its connection; one gone quiet for a minute
            // is closed.
            let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
        });
    }
}
