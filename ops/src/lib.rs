//! What every Strata process is operated through, whatever its roles: the
//! process's metrics registry ([`metrics`]) and the HTTP endpoint that
//! serves it with health and readiness ([`http`]); named background tasks
//! that are supervised and counted when they restart ([`task`]); and the
//! serving certificate that a TLS listener swaps for a renewed one while it
//! runs ([`tls`]); a clock of the time the process could run, for hyper's
//! HTTP/2 keep-alive and for waits on a peer that a busy process must not
//! take for a silent peer ([`process_clock`]); how late the process's runtime
//! runs what is due ([`runtime_lag`]); a warning allowed once a period,
//! the rest counted into the next ([`warn_every`]); and the join protocol a
//! joining node names its token with before its TLS handshake
//! ([`join_alpn`]).
//!
//! It depends on no other crate of the workspace, so every crate can report
//! through it.

pub mod http;
pub mod join_alpn;
pub mod metrics;
pub mod process_clock;
pub mod runtime_lag;
pub mod task;
pub mod tls;
pub mod warn_every;
