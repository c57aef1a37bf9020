//! `strata ca`: the region's node certificate authority.

use crate::cli::connect;
use crate::cli::DbArgs;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use clap::Args;
use clap::Subcommand;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Subcommand, Debug)]
pub(crate) enum CaCmd {
    /// Create the region's CA: an offline root (ca.pem, root.key) and the issuing intermediate gateways and audit hosts hold (issuing.pem, issuing.key); keys readable by their owner only
    Init {
        /// Where to write it
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
        /// The region's name, in the CA's subject
        #[arg(long, default_value = "default")]
        region: String,
    },
    /// Copy what a gateway or audit host needs (ca.pem and the issuing intermediate with its key; never root.key) to another folder
    ExportIssuing {
        /// The CA's folder
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
        /// The folder to give the gateway or audit host (its --ca-dir)
        #[arg(long)]
        out: PathBuf,
    },
    /// Issue an auditor certificate for the audit endpoint (log in without a password); needs the root key
    IssueAuditor(IssueArgs),
    /// Issue an operator certificate for the client API (strata.api.v1 on every gateway); needs the root key
    IssueOperator(IssueArgs),
    /// Revoke an operator's or auditor's certificate before it expires: gateways
    /// refuse its API calls within seconds, the audit endpoint its logins
    #[command(group(clap::ArgGroup::new("which").required(true).args(["cert", "serial"])))]
    Revoke {
        #[command(flatten)]
        db: DbArgs,
        /// The certificate (PEM), e.g. operator.pem; its holder is named in the log
        #[arg(long)]
        cert: Option<PathBuf>,
        /// Its serial in hex, when the file is gone (as `strata ca revoked` and
        /// `openssl x509 -serial` print it; colons allowed)
        #[arg(long)]
        serial: Option<String>,
        /// Why, kept with the revocation and in the log
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// List revoked certificates, newest first
    Revoked {
        #[command(flatten)]
        db: DbArgs,
    },
}

/// A client certificate from the CA.
#[derive(Args, Debug)]
pub(crate) struct IssueArgs {
    /// The CA's folder
    #[arg(long, default_value = "ca")]
    dir: PathBuf,
    /// The name it certifies (an auditor as in `strata audit users add`, or an operator)
    #[arg(long)]
    name: String,
    /// Where to write the certificate and key (auditor.pem/.key or operator.pem/.key) and ca.pem
    #[arg(long)]
    out: PathBuf,
    /// Validity in days
    #[arg(long, default_value_t = 90)]
    days: i64,
}

pub(crate) async fn ca(cmd: CaCmd) -> Result<ExitCode> {
    match cmd {
        CaCmd::Revoke {
            db,
            cert,
            serial,
            reason,
        } => {
            use gateway::revocation;
            let presented = match &cert {
                Some(path) => {
                    let pem = std::fs::read_to_string(path)
                        .with_context(|| format!("read {}", path.display()))?;
                    let p = revocation::presented_pem(&pem)
                        .with_context(|| format!("read the certificate in {}", path.display()))?;
                    if p.kind.is_none() {
                        bail!(
                            "{} is not an operator's or an auditor's certificate (nodes are revoked with `strata nodes revoke`)",
                            path.display()
                        );
                    }
                    Some(p)
                }
                None => None,
            };
            let (serial, target) = match (&presented, &serial) {
                (Some(p), _) => (p.serial.clone(), revocation::Target::Certificate(p)),
                (None, Some(s)) => (revocation::parse_serial(s)?, revocation::Target::Serial(s)),
                (None, None) => bail!("give --cert or --serial"),
            };
            let mut client = connect(&db).await?;
            let who = presented
                .as_ref()
                .and_then(|p| Some(format!("{} {}", p.kind?, p.name.as_deref()?)))
                .unwrap_or_else(|| "certificate".into());
            if revocation::revoke(&mut client, target, &reason).await? {
                println!("revoked the {who} (serial {serial}); gateways refuse it within {} s, the audit endpoint at once", gateway::revocation::Revoked::RELOAD.as_secs());
            } else {
                println!("the {who} (serial {serial}) was already revoked");
            }
        }
        CaCmd::Revoked { db } => {
            let client = connect(&db).await?;
            let list = gateway::revocation::list(&client).await?;
            if crate::exit::json() {
                for r in &list {
                    crate::exit::print_json(&serde_json::json!({
                        "serial": r.serial,
                        "kind": r.kind,
                        "name": r.name,
                        "not_after": r.not_after.map(crate::exit::time),
                        "reason": r.reason,
                        "revoked_at": crate::exit::time(r.revoked_at),
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            if list.is_empty() {
                println!("no certificates are revoked");
            }
            for r in list {
                println!(
                    "{:<34} {:<9} {:<24} revoked {}  {}",
                    r.serial,
                    r.kind.as_deref().unwrap_or("-"),
                    r.name.as_deref().unwrap_or("-"),
                    humantime::format_rfc3339_seconds(r.revoked_at),
                    r.reason
                );
            }
        }
        CaCmd::Init { dir, region } => {
            let cert = gateway::ca::init(&dir, &region)?;
            println!(
                "created the region's CA in {}:\n  {}  the root certificate: give it to nodes, operators and auditors\n  {}  the root's key (private): it issues operator and auditor certificates; keep it offline\n  {} and {}  the issuing intermediate (private key): gateways and audit hosts sign node and serving certificates with it\ngive a gateway or audit host its folder with: strata ca export-issuing --dir {} --out <folder>",
                dir.display(),
                cert.display(),
                dir.join(gateway::ca::ROOT_KEY).display(),
                dir.join(gateway::ca::ISSUING_CERT).display(),
                dir.join(gateway::ca::ISSUING_KEY).display(),
                dir.display()
            );
        }
        CaCmd::ExportIssuing { dir, out } => {
            gateway::ca::export_issuing(&dir, &out)?;
            println!(
                "wrote {} (without the root's key): pass it as --ca-dir to gateways and audit hosts",
                out.display()
            );
        }
        CaCmd::IssueAuditor(a) => {
            audit::accounts::check_name(&a.name)?;
            let out = issue(&a, "auditor", |ca| ca.issue_auditor(&a.name, a.days))?;
            println!(
                "psql: sslmode=verify-full sslrootcert={} sslcert={} sslkey={}",
                out.join("ca.pem").display(),
                out.join("auditor.pem").display(),
                out.join("auditor.key").display()
            );
        }
        CaCmd::IssueOperator(a) => {
            domain::valid_name("operator name", &a.name).map_err(anyhow::Error::msg)?;
            issue(&a, "operator", |ca| ca.issue_operator(&a.name, a.days))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `<kind>.pem`, `<kind>.key` (private) and `ca.pem` under `--out`.
pub(crate) fn issue(
    a: &IssueArgs,
    kind: &str,
    sign: impl FnOnce(&gateway::ca::Ca) -> Result<(String, String), gateway::ca::CaError>,
) -> Result<std::path::PathBuf> {
    if !(1..=3650).contains(&a.days) {
        bail!("--days must be 1 to 3650");
    }
    let ca = gateway::ca::Ca::load(&a.dir)?;
    let (cert, key) = sign(&ca)?;
    let out = &a.out;
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    gateway::ca::write_private(&out.join(format!("{kind}.key")), key.as_bytes())?;
    std::fs::write(out.join(format!("{kind}.pem")), &cert)?;
    std::fs::write(out.join("ca.pem"), ca.cert_pem())?;
    let serial = gateway::revocation::presented_pem(&cert)
        .map(|p| p.serial)
        .unwrap_or_default();
    println!(
        "wrote {} and {} (private) for {kind} {}, valid {} days, serial {serial} (`strata ca revoke --serial` revokes it)",
        out.join(format!("{kind}.pem")).display(),
        out.join(format!("{kind}.key")).display(),
        a.name,
        a.days
    );
    Ok(out.clone())
}
