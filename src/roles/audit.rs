//! The `audit` role: the audit endpoint (pgwire for auditors, every statement
//! recorded before it runs), with TLS from the CA folder when there is one
//! and its serving certificate kept renewed.

use crate::roles::ServeArgs;
use anyhow::{Context, Result};
use events::{Appender, AppenderConfig};

/// The audit endpoint, with TLS from the CA folder when there is one.
pub(crate) async fn start(args: &ServeArgs, cfg: &events::db::Database) -> Result<audit::Endpoint> {
    let mut ac = audit::AuditConfig::new(cfg.clone());
    audit::setup::check_role(&args.audit_role)?;
    ac.role = args.audit_role.clone();
    ac.backend = match &args.audit_database_url {
        Some(u) => events::db::Database::parse(u)
            .map_err(anyhow::Error::msg)
            .context("--audit-database-url")?,
        // Each auditor's session is a login of its own, with its settings.
        None => cfg.direct().clone(),
    };
    ac.statement_timeout = args.audit_statement_timeout;
    ac.idle_in_transaction = args.audit_idle_in_transaction;
    ac.max_transaction_age = args.audit_max_transaction_age;
    ac.max_result_bytes = args.audit_max_result_mib.max(1) << 20;
    ac.max_sessions = args.audit_max_sessions;
    ac.max_sessions_per_auditor = args.audit_max_sessions_per_auditor;
    ac.idle_session_timeout = args.audit_idle_session_timeout;
    ac.work_mem_kib = args.audit_work_mem_mib.max(1) << 10;
    ac.temp_file_limit_kib = args.audit_temp_file_limit_mib.max(1) << 10;
    if gateway::ca::exists(&args.ca_dir) {
        let ca = gateway::ca::Ca::load(&args.ca_dir)?;
        let (cert_pem, key_pem) = ca.server_identity_for(&args.tls_names, args.serving_validity)?;
        ac.tls = Some(audit::TlsFiles {
            cert_pem,
            key_pem,
            client_ca_pem: Some(ca.cert_pem().to_string()),
        });
    } else {
        tracing::warn!(ca_dir = %args.ca_dir.display(),
            "audit: no CA there, so no TLS: auditors log in with SCRAM passwords over plain TCP, and certificates are not available");
    }
    let tls = ac.tls.is_some();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let endpoint = audit::start(args.audit_listen, ac, appender)
        .await
        .context("start the audit endpoint")?;
    if let Some(renewer) = endpoint.renewer() {
        let (dir, names, validity) = (
            args.ca_dir.clone(),
            args.tls_names.clone(),
            args.serving_validity,
        );
        ops::task::spawn(
            "audit-serving-cert",
            gateway::ca::keep_renewed(dir, names, validity, "audit", move |cert, key| {
                renewer.renew(cert, key).map_err(|e| e.to_string())
            }),
        );
    }
    eprintln!(
        "audit endpoint listening on {} ({}); connect with: psql \"host={} port={} user=<auditor> dbname=audit{}\"",
        endpoint.addr,
        if tls { "TLS" } else { "no TLS" },
        endpoint.addr.ip(),
        endpoint.addr.port(),
        if tls { " sslmode=require" } else { "" }
    );
    Ok(endpoint)
}
