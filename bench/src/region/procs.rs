//! The region's roles as separate `strata serve` processes, started the way
//! an operator would start them, and what is sampled of each: CPU seconds
//! and RSS from `/proc`, for the roles and for PostgreSQL's server
//! processes.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};
use tokio::process::{Child, Command};

/// One `strata serve` process.
pub struct Role {
    pub name: String,
    args: Vec<String>,
    child: Option<Child>,
    log: PathBuf,
    /// The gateway's node address, for gateways.
    pub listen: Option<String>,
    /// CPU seconds of earlier lives of this role (before a kill).
    pub cpu_before: f64,
    /// The network namespace it runs in, for network faults (else the
    /// host's).
    pub netns: Option<std::sync::Arc<super::net::Netns>>,
}

/// How every role is started.
pub struct Launch {
    pub strata: PathBuf,
    pub url: String,
    pub dir: PathBuf,
}

impl Role {
    pub fn new(name: &str, args: Vec<String>, dir: &Path) -> Role {
        Role {
            name: name.to_string(),
            args,
            child: None,
            log: dir.join(format!("{name}.log")),
            listen: None,
            cpu_before: 0.0,
            netns: None,
        }
    }

    pub fn start(&mut self, l: &Launch) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        // In a namespace of its own, it reaches PostgreSQL over its link.
        let (mut cmd, url) = match &self.netns {
            Some(ns) => {
                let p = ns.prefix();
                let mut c = Command::new(&p[0]);
                c.args(&p[1..]).arg(&l.strata);
                (c, l.url.replace("127.0.0.1", &ns.host_ip))
            }
            None => (Command::new(&l.strata), l.url.clone()),
        };
        let child = cmd
            .arg("serve")
            .args(&self.args)
            // Its connections carry its name, so PostgreSQL's CPU per
            // client (`pg_stat_activity.application_name`) names the role.
            .env(
                "STRATA_DATABASE_URL",
                format!(
                    "{}{}application_name={}",
                    url,
                    if url.contains('?') { '&' } else { '?' },
                    self.name
                ),
            )
            .env("STRATA_SINK_SECRET_REGION", "region-drill")
            .env(
                "RUST_LOG",
                std::env::var("STRATA_REGION_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .current_dir(&l.dir)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {} ({})", self.name, l.strata.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// More arguments for its next start.
    pub fn args_push(&mut self, more: &[&str]) {
        self.args.extend(more.iter().map(|s| s.to_string()));
    }

    /// The port its `listen` address names (gateways).
    pub fn listen_port(&self) -> Result<u16> {
        self.listen
            .as_deref()
            .and_then(|l| l.rsplit_once(':'))
            .and_then(|(_, p)| p.parse().ok())
            .with_context(|| format!("{} listens nowhere", self.name))
    }

    /// Whether this process runs `role` (its `--roles`).
    pub fn runs(&self, role: &str) -> bool {
        self.args
            .iter()
            .skip_while(|a| *a != "--roles")
            .nth(1)
            .is_some_and(|r| r.split(',').any(|x| x == role))
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    /// SIGKILL, and waits for the process to be gone.
    pub async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Some(pid) = c.id() {
                self.cpu_before += crate::util::cpu_seconds(pid);
            }
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
    }

    /// SIGTERM, then SIGKILL after 20 s.
    pub async fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Some(pid) = c.id() {
                signal(pid, "TERM");
            }
            if tokio::time::timeout(Duration::from_secs(20), c.wait())
                .await
                .is_err()
            {
                let _ = c.start_kill();
                let _ = c.wait().await;
            }
        }
    }

    /// Fails if the process has exited (naming its log).
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(c) = self.child.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                bail!(
                    "{} exited ({status}); see {}",
                    self.name,
                    self.log.display()
                );
            }
        }
        Ok(())
    }

    /// CPU seconds over all of this role's lives, and its RSS now (MiB).
    pub fn usage(&self) -> (f64, f64) {
        match self.pid() {
            Some(pid) => (
                self.cpu_before + crate::util::cpu_seconds(pid),
                crate::gateway::rss_of(pid),
            ),
            None => (self.cpu_before, 0.0),
        }
    }
}

/// The last `n` warnings and errors each role logged, on standard error:
/// what a failed check needs to be explained once the drill's folder is
/// gone (a CI run keeps only its output).
pub fn tell_warnings(roles: &[Role], n: usize) {
    for role in roles {
        let Ok(text) = std::fs::read_to_string(&role.log) else {
            continue;
        };
        let said: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        eprintln!(
            "  {}: {} warnings and errors, the last {}:",
            role.name,
            said.len(),
            said.len().min(n)
        );
        for line in &said[said.len().saturating_sub(n)..] {
            eprintln!("    {line}");
        }
    }
}

/// The lines each role logged at or after `since` (by their timestamps),
/// as (role, line).
pub fn said_since(roles: &[Role], since: SystemTime) -> Vec<(String, String)> {
    let mut said = Vec::new();
    for role in roles {
        let Ok(text) = std::fs::read_to_string(&role.log) else {
            continue;
        };
        said.extend(
            text.lines()
                .filter(|l| {
                    l.split_whitespace()
                        .next()
                        .and_then(|t| humantime::parse_rfc3339(t).ok())
                        .is_some_and(|at| at >= since)
                })
                .map(|l| (role.name.clone(), l.to_string())),
        );
    }
    said
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status();
}

/// CPU seconds PostgreSQL has used so far.
#[derive(Debug, Clone, Default)]
pub struct PgCpu {
    /// The postmaster, its live children and the children it has reaped.
    pub total: f64,
    /// Of that, the live walsenders (logical decoding, one per slot in use).
    pub walsenders: f64,
    /// Each live child's CPU seconds so far, by pid (to tell, with
    /// `pg_stat_activity`, which client a backend's CPU went to).
    pub by_pid: std::collections::HashMap<u32, f64>,
}

/// What PostgreSQL's processes have used: the postmaster, its live children
/// (backends, walsenders, background workers) and the children it has
/// reaped (which can no longer be told apart).
pub fn postgres_cpu(postmaster: u32) -> PgCpu {
    let Some(pm) = crate::util::proc_times(postmaster) else {
        return PgCpu::default();
    };
    let mut cpu = PgCpu {
        total: pm.own + pm.reaped,
        walsenders: 0.0,
        by_pid: Default::default(),
    };
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(p) = crate::util::proc_times(pid) {
                if p.ppid == postmaster {
                    let t = p.own;
                    cpu.total += t;
                    cpu.by_pid.insert(pid, t);
                    let title = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                    if String::from_utf8_lossy(&title).contains("walsender") {
                        cpu.walsenders += t;
                    }
                }
            }
        }
    }
    cpu
}

/// A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range
/// (32768 and up on Linux): a port the kernel handed out for one of the
/// region's thousands of outgoing connections could be taken again
/// between this check and the role binding it.
pub fn free_port() -> Result<u16> {
    for _ in 0..1000 {
        let port = fastrand::u16(20_000..32_000);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port between 20000 and 32000")
}

/// Waits until something accepts on `addr`.
pub async fn wait_listening(addr: &str, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("nothing listens on {addr} after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
