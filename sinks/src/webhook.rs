//! Delivering a batch to a webhook: one POST of
//! `{"sink": NAME, "events": [...]}` with
//! `X-Strata-Timestamp: <unix seconds>` and
//! `X-Strata-Signature: sha256=<hex HMAC-SHA256 over "<timestamp>.<body>">`.
//! Any 2xx answer is delivery; anything else (or no answer in time) is
//! retried with exponential backoff and full jitter.
//!
//! `https://` receivers are checked against the system's trusted roots and,
//! where the sinks process is given one (`--webhook-ca`), a CA file of its
//! own (rustls on ring); `http://` is delivered in the clear.

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A client for `http://` and `https://` webhooks. TLS trusts the system's
/// roots and the PEM certificates in `extra_ca`, if given; an unreadable or
/// empty file is an error.
pub fn client(extra_ca: Option<&Path>) -> Result<HttpClient, String> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _) = roots.add_parsable_certificates(native.certs);
    if let Some(path) = extra_ca {
        let pem = std::fs::read(path).map_err(|e| format!("read {}: {e}", path.display()))?;
        let mut n = 0;
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| format!("{}: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            n += 1;
        }
        if n == 0 {
            return Err(format!("{} holds no PEM certificate", path.display()));
        }
    } else if added == 0 {
        tracing::debug!("no trusted roots on this system: https:// webhooks need --webhook-ca");
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// An error with its causes, which is where hyper keeps the useful part
/// (a refused connection, a certificate that did not verify).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// Signs a body the way receivers check it.
pub fn signature(secret: &[u8], timestamp: u64, body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut ctx = ring::hmac::Context::with_key(&key);
    ctx.update(timestamp.to_string().as_bytes());
    ctx.update(b".");
    ctx.update(body);
    let tag = ctx.sign();
    format!("sha256={}", events::hex(tag.as_ref()))
}

/// Checks a signature (for receivers, and the tests).
pub fn verify(secret: &[u8], timestamp: u64, body: &[u8], header: &str) -> bool {
    let Some(hex) = header.strip_prefix("sha256=") else {
        return false;
    };
    let Some(tag) = (0..hex.len())
        .step_by(2)
        .map(|i| {
            hex.get(i..i + 2)
                .and_then(|b| u8::from_str_radix(b, 16).ok())
        })
        .collect::<Option<Vec<u8>>>()
    else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut msg = timestamp.to_string().into_bytes();
    msg.push(b'.');
    msg.extend_from_slice(body);
    ring::hmac::verify(&key, &msg, &tag).is_ok()
}

/// One POST; `Err` says why it did not count as delivered.
pub async fn post(
    client: &HttpClient,
    url: &str,
    secret: &[u8],
    body: Bytes,
    timeout: Duration,
) -> Result<(), String> {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Credentials in the URL are sent as HTTP Basic authentication.
    let (bare, userinfo) = crate::credentials::split(url);
    let mut req = hyper::Request::post(bare.as_str());
    if let Some(u) = userinfo {
        use base64::Engine;
        let token = base64::engine::general_purpose::STANDARD.encode(u);
        req = req.header("authorization", format!("Basic {token}"));
    }
    let req = req
        .header("content-type", "application/json")
        .header("x-strata-timestamp", ts.to_string())
        .header("x-strata-signature", signature(secret, ts, &body))
        .body(Full::new(body))
        .map_err(|e| format!("bad request: {e}"))?;
    match tokio::time::timeout(timeout, client.request(req)).await {
        Err(_) => Err(format!("no answer in {timeout:?}")),
        Ok(Err(e)) => Err(format!("request failed: {}", chain(&e))),
        Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
        Ok(Ok(resp)) => Err(format!("answered {}", resp.status())),
    }
}

/// Tries `attempt` up to `attempts` times, sleeping between tries with
/// exponential backoff from `base` to `cap` and full jitter. Returns the
/// attempts used, or the attempts and the last error.
/// The longest wait after the `n`th failed attempt: `min(base * 2^n, cap)`;
/// the wait is drawn between half of it and all of it.
pub fn ceiling(base: Duration, cap: Duration, n: u32) -> Duration {
    base.saturating_mul(1 << n.min(16)).min(cap)
}

pub async fn with_retries<F, Fut>(
    attempts: u32,
    base: Duration,
    cap: Duration,
    mut attempt: F,
) -> Result<u32, (u32, String)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let mut last = String::new();
    for n in 1..=attempts.max(1) {
        match attempt().await {
            Ok(()) => return Ok(n),
            Err(e) => {
                tracing::debug!(attempt = n, error = %e, "delivery failed");
                last = e;
            }
        }
        if n < attempts {
            let ceiling = ceiling(base, cap, n);
            tokio::time::sleep(ceiling.mul_f64(0.5 + fastrand::f64() / 2.0)).await;
        }
    }
    Err((attempts, last))
}

/// Posts with retries (see [`with_retries`]).
pub async fn deliver(
    client: &HttpClient,
    url: &str,
    secret: &[u8],
    body: Bytes,
    attempts: u32,
    base: Duration,
    cap: Duration,
) -> Result<u32, (u32, String)> {
    with_retries(attempts, base, cap, || {
        post(client, url, secret, body.clone(), Duration::from_secs(10))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_and_reject_tampering() {
        let sig = signature(b"k", 1700000000, b"{\"a\":1}");
        assert!(verify(b"k", 1700000000, b"{\"a\":1}", &sig));
        assert!(!verify(b"k", 1700000001, b"{\"a\":1}", &sig));
        assert!(!verify(b"k", 1700000000, b"{\"a\":2}", &sig));
        assert!(!verify(b"other", 1700000000, b"{\"a\":1}", &sig));
        assert!(!verify(b"k", 1700000000, b"{\"a\":1}", "sha256=zz"));
        assert!(!verify(b"k", 1700000000, b"{\"a\":1}", "md5=00"));
    }
}
