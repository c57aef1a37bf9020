//! Shared pieces of the scenarios: the private cluster, the machine
//! description, percentiles, writing results, and the fleet's tries at a
//! session.

use anyhow::{Context, Result};
use schema::{Cluster, ClusterOptions};
use std::path::PathBuf;
use std::time::Duration;

/// A private cluster with fsync on: benchmarks measure durable commits.
pub fn cluster() -> Result<Cluster> {
    Ok(cluster_serving(None)?.0)
}

/// The same, also serving TLS (initdb's rules let a client in with or
/// without it), with a certificate from a CA of its own: the cluster, and
/// the CA's certificate file (for `sslrootcert`).
pub fn cluster_with_tls() -> Result<(Cluster, PathBuf)> {
    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "bench postgres CA");
    let ca_pem = ca.self_signed(&ca_key)?.pem();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate()?;
    let server =
        rcgen::CertificateParams::new(vec!["localhost".to_string()])?.signed_by(&key, &issuer)?;
    let tls = schema::cluster::ClusterTls {
        cert_pem: server.pem(),
        key_pem: key.serialize_pem(),
        client_ca_pem: None,
    };
    let (cluster, base) = cluster_serving(Some(tls))?;
    let ca_file = base.join("ca.pem");
    std::fs::write(&ca_file, ca_pem)?;
    Ok((cluster, ca_file))
}

fn cluster_serving(tls: Option<schema::cluster::ClusterTls>) -> Result<(Cluster, PathBuf)> {
    cluster_with(tls, |_| {})
}

/// The region drill's cluster: reachable from its network namespaces
/// where `namespaces` (`10.77.0.0/16`, see `region::net`, with initdb's
/// trust rules), and with `pg_stat_statements` loaded where `statements`.
pub fn region_cluster(
    namespaces: bool,
    statements: bool,
    settings: Vec<(String, String)>,
) -> Result<Cluster> {
    Ok(cluster_with(None, |o| {
        o.settings.extend(settings);
        if statements {
            o.settings.push((
                "shared_preload_libraries".into(),
                "pg_stat_statements".into(),
            ));
        }
        if !namespaces {
            return;
        }
        o.settings.push(("listen_addresses".into(), "*".into()));
        o.hba = Some(
            "local all all trust\n\
             host all all 127.0.0.1/32 trust\n\
             host all all 10.77.0.0/16 trust\n\
             host replication all 127.0.0.1/32 trust\n\
             host replication all 10.77.0.0/16 trust\n"
                .into(),
        );
    })?
    .0)
}

fn cluster_with(
    tls: Option<schema::cluster::ClusterTls>,
    tweak: impl FnOnce(&mut ClusterOptions),
) -> Result<(Cluster, PathBuf)> {
    let base = std::env::temp_dir().join(format!("strata-bench-{}", std::process::id()));
    let mut opts = ClusterOptions::new(base.join("pg"));
    opts.fsync = true;
    opts.remove_on_exit = Some(base.clone());
    opts.tls = tls;
    tweak(&mut opts);
    let c = Cluster::start(opts).context("start the benchmark's PostgreSQL")?;
    Ok((c, base))
}

pub async fn database(cluster: &Cluster, name: &str) -> Result<tokio_postgres::Config> {
    let admin = events::db::connect(
        &cluster.url("postgres").parse::<tokio_postgres::Config>()?,
        "bench-admin",
    )
    .await?;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))
        .await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await?;
    let cfg: tokio_postgres::Config = cluster.url(name).parse()?;
    let mut c = events::db::connect(&cfg, "bench-migrate").await?;
    schema::migrate(&mut c).await?;
    Ok(cfg)
}

/// What the numbers were measured on.
pub fn machine(pg_version: &str) -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0);
    serde_json::json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": cpu,
        "memory_gib": (mem_kib as f64 / 1048576.0 * 10.0).round() / 10.0,
        "postgres": pg_version,
        "note": "the load generator, Strata and PostgreSQL share the same cores; PostgreSQL runs with fsync on",
    })
}

/// The p-th percentile (0..=1) of an unsorted sample, in milliseconds.
pub fn percentile_ms(sample: &mut [Duration], p: f64) -> f64 {
    if sample.is_empty() {
        return 0.0;
    }
    sample.sort_unstable();
    let i = ((sample.len() - 1) as f64 * p).round() as usize;
    sample[i].as_secs_f64() * 1e3
}

pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prints the final JSON line and writes it to bench/results/NAME.json.
pub fn finish(name: &str, result: &serde_json::Value) -> Result<()> {
    let line = serde_json::to_string(result)?;
    let dir = results_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let path = dir.join(format!("{name}.json"));
    std::fs::write(
        &path,
        format!("{}\n", serde_json::to_string_pretty(result)?),
    )
    .with_context(|| format!("write {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    println!("{line}");
    Ok(())
}

fn results_dir() -> PathBuf {
    // `cargo run -p bench` runs from the workspace root; the manifest dir is
    // bench/ itself.
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results")
}

pub fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> f64 {
    proc_times(pid).map_or(0.0, |t| t.own)
}

/// What `/proc/<pid>/stat` says of a process's CPU time.
pub struct ProcTimes {
    pub ppid: u32,
    /// User and system seconds of the process itself.
    pub own: f64,
    /// User and system seconds of its children that it has reaped.
    pub reaped: f64,
}

pub fn proc_times(pid: u32) -> Option<ProcTimes> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may contain spaces.
    let f: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    Some(ProcTimes {
        ppid: f.get(1)?.parse().ok()?,
        own: (num(11)? + num(12)?) / 100.0,
        reaped: (num(13).unwrap_or(0.0) + num(14).unwrap_or(0.0)) / 100.0,
    })
}

/// Busy CPU time of the whole machine so far (all cores, seconds), from
/// /proc/stat: busy is user, nice, system, irq and softirq time; idle,
/// iowait and steal (time the hypervisor gave to others) are not.
fn machine_busy() -> f64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            let v: Vec<f64> = s
                .lines()
                .next()?
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let total: f64 = v.iter().take(8).sum();
            let not_busy = v.get(3)? + v.get(4)? + v.get(7)?;
            Some((total - not_busy) / 100.0)
        })
        .unwrap_or(0.0)
}

/// Where the cores went during a phase: started by [`CpuMeter::start`].
pub struct CpuMeter {
    machine: f64,
    own: f64,
    at: std::time::Instant,
}

/// Cores busy during a phase: the whole machine and this process (the load
/// generator and, for Strata's phases, the appender); the rest is PostgreSQL
/// and whatever else ran.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuUse {
    pub busy_cores: f64,
    pub own_cores: f64,
}

impl CpuMeter {
    pub fn start() -> CpuMeter {
        CpuMeter {
            machine: machine_busy(),
            own: cpu_seconds(std::process::id()),
            at: std::time::Instant::now(),
        }
    }

    pub fn stop(&self) -> CpuUse {
        let secs = self.at.elapsed().as_secs_f64().max(1e-9);
        let busy = machine_busy();
        CpuUse {
            busy_cores: (busy - self.machine) / secs,
            own_cores: (cpu_seconds(std::process::id()) - self.own) / secs,
        }
    }
}

/// After rows were COPYed into `strata.events` up to `last` (a bench's
/// log, loaded in bulk): the log's head and every stream's version set as
/// appends would have left them, and the table analyzed.
pub async fn after_bulk_load(
    db: &tokio_postgres::Client,
    last: u64,
    started: std::time::Instant,
) -> Result<()> {
    eprintln!(
        "\rloaded {last} events in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // Millions of streams take longer than a role's statement timeout.
    db.batch_execute("SET statement_timeout = 0").await?;
    db.execute(
        "UPDATE strata.log_head SET last_position = $1",
        &[&(last as i64)],
    )
    .await?;
    db.batch_execute(
        "INSERT INTO strata.streams (stream, version)
         SELECT stream, max(version) FROM strata.events GROUP BY stream
         ON CONFLICT (stream) DO UPDATE SET version = EXCLUDED.version",
    )
    .await?;
    db.batch_execute("VACUUM ANALYZE strata.events").await?;
    Ok(())
}

/// Seconds since the Unix epoch of `t`, as the log's `recorded_at` is read.
pub fn unix(t: std::time::SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The p-th percentile (0..=1) of a sample, to two digits; none of an
/// empty one.
pub fn pct(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    Some(round(v[i], 2))
}

/// The fleet's daemons' tries at a session, counted from a moment on.
pub(crate) struct Tries([(&'static str, u64); 6]);

impl Tries {
    /// Connections made, failed and kept for another try after a pushback,
    /// Hellos given up on, pushbacks obeyed, sessions opened: each by the
    /// name it is reported under.
    pub(crate) fn of(s: &node::daemon::DaemonStats) -> Tries {
        Tries(
            [
                ("connections", &s.connects),
                ("connect_failures", &s.connect_failures),
                ("connections_reused", &s.connections_reused),
                ("welcomes_given_up", &s.welcomes_given_up),
                ("pushbacks", &s.pushbacks),
                ("sessions", &s.sessions),
            ]
            .map(|(name, c)| (name, c.load(std::sync::atomic::Ordering::Relaxed))),
        )
    }

    /// What the daemons tried since `self`.
    pub(crate) fn since(&self, s: &node::daemon::DaemonStats) -> serde_json::Value {
        let now = Tries::of(s).0;
        self.0
            .iter()
            .zip(now)
            .map(|((name, then), (_, now))| (name.to_string(), now.saturating_sub(*then).into()))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// What the daemons tried since they started.
    pub(crate) fn all(s: &node::daemon::DaemonStats) -> serde_json::Value {
        Tries(Tries::of(s).0.map(|(name, _)| (name, 0))).since(s)
    }
}
