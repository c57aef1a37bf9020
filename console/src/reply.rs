//! What the console answers with: a body of any kind, whole pages, a
//! redirection, and a page's refusal (its status and what to tell).

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use std::convert::Infallible;

pub type Body = BoxBody<Bytes, Infallible>;

pub fn full(status: StatusCode, kind: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    r
}

pub fn html(status: StatusCode, body: String) -> Response<Body> {
    full(status, "text/html; charset=utf-8", body)
}

pub fn redirect(to: &str) -> Response<Body> {
    let mut r = full(StatusCode::SEE_OTHER, "text/plain", "");
    if let Ok(v) = HeaderValue::from_str(to) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

/// A page's refusal: its status and what to tell.
#[derive(Debug)]
pub struct Failure {
    pub status: StatusCode,
    pub message: String,
}

impl Failure {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }
    pub fn not_found(message: impl Into<String>) -> Failure {
        Failure::new(StatusCode::NOT_FOUND, message)
    }
    pub fn unavailable(message: impl std::fmt::Display) -> Failure {
        Failure::new(StatusCode::SERVICE_UNAVAILABLE, message.to_string())
    }
}
