//! The `console` role: the web console over HTTPS with a serving
//! certificate from the CA folder, kept renewed, following the log on the
//! process's reader.

use crate::roles::ServeArgs;
use anyhow::{Context, Result};
use events::db::Database;
use events::{Appender, AppenderConfig, Reader};

/// Starts the console on `--console-listen`.
pub(crate) async fn start(
    args: &ServeArgs,
    cfg: &Database,
    reader: Reader,
) -> Result<console::Console> {
    let ca = gateway::ca::Ca::load(&args.ca_dir).with_context(|| {
        format!(
            "the console serves HTTPS with a certificate of the region's CA, and there is none in {} (`strata ca init`)",
            args.ca_dir.display()
        )
    })?;
    let (cert_pem, key_pem) = ca.server_identity_for(&args.tls_names, args.serving_validity)?;
    let mut cc = console::ConsoleConfig::new(
        args.console_listen,
        cert_pem,
        key_pem,
        ca.cert_pem().to_string(),
    );
    cc.session_ttl = args.console_session_ttl;
    cc.snapshots = args
        .snapshot_dir
        .clone()
        .map(projections::SnapshotStore::new);
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    let c = console::start(cc, cfg.clone(), reader, appender)
        .await
        .context("start the console")?;
    let renewer = c.renewer.clone();
    let (dir, names, validity) = (
        args.ca_dir.clone(),
        args.tls_names.clone(),
        args.serving_validity,
    );
    ops::task::spawn(
        "console-serving-cert",
        gateway::ca::keep_renewed(dir, names, validity, "console", move |cert, key| {
            renewer.replace(cert, key)
        }),
    );
    eprintln!(
        "console listening on https://{} (sign in with `strata console login --operator NAME`)",
        c.addr
    );
    Ok(c)
}
