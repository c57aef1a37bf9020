//! Which page or action a request is, and who asks. Sign-in and the assets
//! are open; everything else needs a session or an operator's certificate
//! (`auth.rs`), and every action (a POST) also the session's CSRF token and,
//! where the browser sends one, an `Origin` of this console. Every answer
//! carries a Content-Security-Policy that allows only the console's own
//! script and style, and is never cached.

use crate::auth::{self, Refused, Who};
use crate::html::{bare, esc};
use crate::reply::{full, html, redirect, Body, Failure};
use crate::{actions, form, pages, sse, Shared};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use std::net::SocketAddr;
use std::sync::Arc;

/// The other end of a connection.
pub struct Peer {
    pub addr: SocketAddr,
    /// Its client certificate (DER), if it presented one.
    pub cert: Option<Vec<u8>>,
}

/// Most bytes of a form body.
const MAX_FORM: usize = 16 * 1024;

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

fn failure_page(f: &Failure) -> Response<Body> {
    let title = match f.status {
        StatusCode::FORBIDDEN => "Not allowed",
        StatusCode::NOT_FOUND => "Not found",
        StatusCode::BAD_REQUEST => "Not done",
        _ => "Not available",
    };
    html(
        f.status,
        bare(
            title,
            &format!(
                r#"<p class="error" role="alert">{}</p><p><a href="/">Back to the region</a></p>"#,
                esc(&f.message)
            ),
        ),
    )
}

/// Answers one request.
pub async fn route(
    shared: Arc<Shared>,
    peer: Arc<Peer>,
    req: Request<hyper::body::Incoming>,
) -> Response<Body> {
    let mut resp = answer(&shared, &peer, req).await;
    let h = resp.headers_mut();
    h.insert("content-security-policy", HeaderValue::from_static(CSP));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("referrer-policy", HeaderValue::from_static("same-origin"));
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert(
        "strict-transport-security",
        HeaderValue::from_static("max-age=31536000"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    resp
}

async fn answer(
    shared: &Arc<Shared>,
    peer: &Peer,
    req: Request<hyper::body::Incoming>,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    let query = form::pairs(req.uri().query().unwrap_or(""));
    let segments: Vec<String> = path
        .trim_start_matches('/')
        .split('/')
        .map(form::decode)
        .collect();
    let seg: Vec<&str> = segments.iter().map(String::as_str).collect();
    let method = req.method().clone();
    match (&method, seg.as_slice()) {
        (&Method::GET, ["assets", name]) => return asset(name),
        (&Method::GET, ["login"]) => return login_page(form::get(&query, "token")),
        (&Method::POST, ["login"]) => {
            // A page of another site may not sign a browser in (as its
            // author, say).
            if !same_origin(&req) {
                return failure_page(&Failure::new(
                    StatusCode::FORBIDDEN,
                    "this sign-in did not come from this console's page",
                ));
            }
            let body = match read_form(req).await {
                Ok(b) => b,
                Err(f) => return failure_page(&f),
            };
            return login(shared, form::get(&body, "token").unwrap_or("")).await;
        }
        _ => {}
    }
    let cookie = req
        .headers()
        .get(header::COOKIE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let fragment = req.headers().contains_key("x-console-fragment");
    let who = match auth::who(shared, peer.cert.as_deref(), cookie.as_deref()).await {
        Ok(w) => w,
        Err(Refused::SignIn(m)) if method == Method::GET && !fragment && seg != ["live"] => {
            return html(StatusCode::UNAUTHORIZED, sign_in_needed(&m))
        }
        Err(Refused::SignIn(m)) => return failure_page(&Failure::new(StatusCode::UNAUTHORIZED, m)),
        Err(Refused::Forbidden(m)) => return failure_page(&Failure::new(StatusCode::FORBIDDEN, m)),
        Err(Refused::Unavailable(m)) => return failure_page(&Failure::unavailable(m)),
    };
    if method == Method::POST {
        return act(shared, &who, req, &seg).await;
    }
    if method != Method::GET {
        return failure_page(&Failure::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and POST",
        ));
    }
    if seg == ["live"] {
        return sse::stream(shared, who, cookie, peer.cert.clone(), &query).await;
    }
    // Taken before the page reads the index, so it is at most what the
    // page shows.
    let position = shared.live.index().position();
    let page = match seg.as_slice() {
        [""] => pages::region::page(shared).await,
        ["pools", pool] => pages::pool::page(shared, &who, pool, &query).await,
        ["queues"] => pages::queues::page(shared, form::get(&query, "pool")).await,
        ["reservations", id] => pages::reservation::page(shared, &who, id).await,
        ["nodes", node] => pages::node::page(shared, &who, node).await,
        ["events"] => pages::events::page(shared, &who, &query).await,
        ["usage"] => pages::usage::page(shared, &who, &query).await,
        ["usage.csv"] => {
            return match pages::usage::run(shared, &who, &query).await {
                Ok(r) => {
                    let mut resp = full(
                        StatusCode::OK,
                        "text/csv; charset=utf-8",
                        projections::usage::report::csv(&r),
                    );
                    resp.headers_mut().insert(
                        header::CONTENT_DISPOSITION,
                        HeaderValue::from_static("attachment; filename=\"usage.csv\""),
                    );
                    resp
                }
                Err(f) => failure_page(&f),
            }
        }
        _ => Err(Failure::not_found(format!("no page at {path}"))),
    };
    let page = page.map(|mut p| {
        p.position = position;
        p
    });
    match page {
        Ok(p) if fragment => html(StatusCode::OK, p.main()),
        Ok(p) => html(StatusCode::OK, p.document(&who)),
        Err(f) => failure_page(&f),
    }
}

/// An action: the CSRF token and the origin checked, then done.
async fn act(
    shared: &Shared,
    who: &Who,
    req: Request<hyper::body::Incoming>,
    seg: &[&str],
) -> Response<Body> {
    let origin_ok = same_origin(&req);
    let body = match read_form(req).await {
        Ok(b) => b,
        Err(f) => return failure_page(&f),
    };
    if !origin_ok || !auth::csrf_ok(who, form::get(&body, "csrf")) {
        return failure_page(&Failure::new(
            StatusCode::FORBIDDEN,
            "this form did not come from this console's page (its CSRF token or origin is wrong); reload the page and try again",
        ));
    }
    if seg == ["logout"] {
        if let (Some(id), Ok(client)) = (&who.session, shared.db.get().await) {
            if let Err(e) = auth::end(&client, id).await {
                return failure_page(&Failure::unavailable(e));
            }
        }
        let mut r = redirect("/login");
        if let Ok(v) = HeaderValue::from_str(&auth::clear_cookie()) {
            r.headers_mut().insert(header::SET_COOKIE, v);
        }
        return r;
    }
    match actions::act(shared, who, seg, &body).await {
        Ok(to) => redirect(&to),
        Err(f) => failure_page(&f),
    }
}

/// Whether a POST came from this console's own pages: its `Origin`, when
/// the browser sends one, is this host over HTTPS.
fn same_origin<B>(req: &Request<B>) -> bool {
    match (
        req.headers().get(header::ORIGIN),
        req.headers().get(header::HOST),
    ) {
        (None, _) => true,
        (Some(o), Some(h)) => {
            o.as_bytes() == format!("https://{}", h.to_str().unwrap_or("")).as_bytes()
        }
        (Some(_), None) => false,
    }
}

async fn read_form(req: Request<hyper::body::Incoming>) -> Result<Vec<(String, String)>, Failure> {
    let body = Limited::new(req.into_body(), MAX_FORM)
        .collect()
        .await
        .map_err(|e| {
            Failure::new(
                StatusCode::BAD_REQUEST,
                format!("the form could not be read: {e}"),
            )
        })?
        .to_bytes();
    let text = std::str::from_utf8(&body)
        .map_err(|_| Failure::new(StatusCode::BAD_REQUEST, "the form is not UTF-8"))?;
    Ok(form::pairs(text))
}

fn sign_in_needed(why: &str) -> String {
    bare(
        "Sign in",
        &format!(
            r#"<p>{}</p><p>An admin or the operator runs <code>strata console login --operator NAME</code>, which prints a link for one sign-in; or present an operator certificate (<code>strata ca issue-operator</code>).</p>"#,
            esc(why)
        ),
    )
}

fn login_page(token: Option<&str>) -> Response<Body> {
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return html(
            StatusCode::OK,
            sign_in_needed("This page signs you in from a link."),
        );
    };
    html(
        StatusCode::OK,
        bare(
            "Sign in",
            &format!(
                r#"<p>This link signs you in once; it is then used up.</p>
<form method="post" action="/login"><input type="hidden" name="token" value="{}"><button type="submit" id="sign-in">Sign in</button></form>"#,
                esc(token)
            ),
        ),
    )
}

async fn login(shared: &Shared, token: &str) -> Response<Body> {
    let refused = || {
        failure_page(&Failure::new(
            StatusCode::FORBIDDEN,
            "this sign-in link is used up, expired or unknown: run `strata console login` for a new one",
        ))
    };
    if token.len() != 64 {
        return refused();
    }
    let client = match shared.db.get().await {
        Ok(c) => c,
        Err(e) => return failure_page(&Failure::unavailable(e)),
    };
    let operator = match auth::redeem(&client, token).await {
        Ok(Some(o)) => o,
        Ok(None) => return refused(),
        Err(e) => return failure_page(&Failure::unavailable(e)),
    };
    let ttl = shared.config.session_ttl;
    match auth::open(&client, &operator, ttl).await {
        Ok((id, _)) => {
            tracing::info!(operator, "console: signed in with a link");
            let mut r = redirect("/");
            if let Ok(v) = HeaderValue::from_str(&auth::set_cookie(&id, ttl)) {
                r.headers_mut().insert(header::SET_COOKIE, v);
            }
            r
        }
        Err(e) => failure_page(&Failure::unavailable(e)),
    }
}

fn asset(name: &str) -> Response<Body> {
    let (kind, body): (&'static str, &'static str) = match name {
        "console.js" => (
            "text/javascript; charset=utf-8",
            include_str!("../assets/console.js"),
        ),
        "console.css" => (
            "text/css; charset=utf-8",
            include_str!("../assets/console.css"),
        ),
        _ => return failure_page(&Failure::not_found("no such asset")),
    };
    let mut r = full(StatusCode::OK, kind, body);
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=300"),
    );
    r
}
