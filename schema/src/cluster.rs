//! Private Postgres clusters: `strata dev`, the tests and the benchmarks each
//! start their own with `wal_level = logical` on a free loopback port.
//!
//! The server binaries are found on `PATH`, through `pg_config --bindir`, or in
//! the distribution's versioned folders (`/usr/lib/postgresql/N/bin`, newest
//! first). Postgres refuses to run as root, so when we are root the cluster is
//! initialized and run as the unprivileged `nobody` user.
//!
//! A cluster can be tied to the life of the process that started it: a small
//! watcher process stops the server (and removes a temporary data folder) once
//! the parent is gone, even if the parent was killed with SIGKILL.

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why a cluster could not be set up or started.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// No Postgres server binaries were found anywhere we look.
    #[error("no PostgreSQL server binaries found (looked for `initdb` and `postgres` on PATH, in `pg_config --bindir` and in /usr/lib/postgresql/*/bin); install them, e.g. `apt-get install postgresql` (Debian/Ubuntu) or `dnf install postgresql-server` (Fedora)")]
    NoServerBinaries,
    /// We run as root and there is no unprivileged user to run Postgres as.
    #[error("running as root but no unprivileged `nobody` user exists to run postgres as")]
    NoUnprivilegedUser,
    /// The unprivileged user cannot reach the data folder.
    #[error("postgres runs as `nobody` and cannot traverse {0}; choose a data folder whose parents others may enter (e.g. under /tmp)")]
    Unreachable(PathBuf),
    /// A command failed.
    #[error("{what} failed: {detail}")]
    Command { what: String, detail: String },
    /// The server did not accept connections in time.
    #[error("postgres did not become ready within {0:?}; see its log at {1}")]
    NotReady(Duration, PathBuf),
    /// A filesystem operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let context = context.into();
    move |source| ClusterError::Io { context, source }
}

/// How to set up a cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The data folder. Created (and initialized) when missing.
    pub data_dir: PathBuf,
    /// The TCP port on 127.0.0.1; `None` picks a free one.
    pub port: Option<u16>,
    /// Keep fsync on. Off makes tests faster; benchmarks and dev keep it on.
    pub fsync: bool,
    /// Extra `-c name=value` settings.
    pub settings: Vec<(String, String)>,
    /// Stop the server when this process exits, however it exits.
    pub die_with_parent: bool,
    /// Also delete this folder once the server has stopped after the parent
    /// exited (for temporary clusters).
    pub remove_on_exit: Option<PathBuf>,
    /// Serve TLS with these files (written into the data folder, owned by
    /// the server's user).
    pub tls: Option<ClusterTls>,
    /// The whole of `pg_hba.conf`, in place of initdb's (trust for all).
    pub hba: Option<String>,
}

/// A private cluster's TLS: its certificate chain and key, and the CA whose
/// client certificates it accepts (`cert` rules in `pg_hba.conf`).
#[derive(Debug, Clone)]
pub struct ClusterTls {
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: Option<String>,
}

impl ClusterOptions {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        ClusterOptions {
            data_dir: data_dir.into(),
            port: None,
            fsync: true,
            settings: Vec::new(),
            die_with_parent: true,
            remove_on_exit: None,
            tls: None,
            hba: None,
        }
    }
}

/// A running private Postgres cluster. Dropping it stops the server.
#[derive(Debug)]
pub struct Cluster {
    options: ClusterOptions,
    bindir: PathBuf,
    port: u16,
    run_as: Option<(u32, u32)>,
    child: Option<Child>,
    log_path: PathBuf,
}

/// The superuser every private cluster is initialized with.
pub const SUPERUSER: &str = "postgres";

impl Cluster {
    /// Finds the server binaries: on PATH, via `pg_config --bindir`, then in
    /// the distribution's versioned folders, newest version first.
    pub fn find_bindir() -> Result<PathBuf, ClusterError> {
        let has_server =
            |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                if has_server(&dir) {
                    // Resolve symlinks so that sibling tools (pg_ctl, pg_isready)
                    // come from the same installation.
                    let real = fs::canonicalize(dir.join("postgres"))
                        .ok()
                        .and_then(|p| p.parent().map(Path::to_path_buf));
                    return Ok(real.filter(|d| has_server(d)).unwrap_or(dir));
                }
            }
        }
        if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
            if out.status.success() {
                let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
                if has_server(&dir) {
                    return Ok(dir);
                }
            }
        }
        for root in ["/usr/lib/postgresql", "/usr/pgsql", "/opt/postgresql"] {
            let Ok(entries) = fs::read_dir(root) else {
                continue;
            };
            let mut versions: Vec<(u32, PathBuf)> = entries
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
                    Some((v, e.path().join("bin")))
                })
                .filter(|(_, d)| has_server(d))
                .collect();
            versions.sort();
            if let Some((_, dir)) = versions.pop() {
                return Ok(dir);
            }
        }
        Err(ClusterError::NoServerBinaries)
    }

    /// Initializes the data folder when needed and starts the server.
    pub fn start(options: ClusterOptions) -> Result<Cluster, ClusterError> {
        let mut cluster = Self::planned(options, Self::find_bindir()?, unprivileged_user()?)?;
        cluster.stop_stale();
        if !cluster.options.data_dir.join("PG_VERSION").exists() {
            cluster.initdb()?;
        }
        cluster.launch()?;
        Ok(cluster)
    }

    /// A streaming standby of this server: a base backup of it (WAL
    /// streamed, `-R` so that it follows this server) into
    /// `options.data_dir`, started on a port of its own.
    pub fn standby(&self, options: ClusterOptions) -> Result<Cluster, ClusterError> {
        let mut standby = Self::planned(options, self.bindir.clone(), self.run_as)?;
        standby.own_data_dir()?;
        let out = standby
            .command("pg_basebackup")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                SUPERUSER,
            ])
            .arg("-D")
            .arg(&standby.options.data_dir)
            .args(["-X", "stream", "-R", "--checkpoint=fast"])
            .stdin(Stdio::null())
            .output()
            .map_err(io("run pg_basebackup"))?;
        succeeded("pg_basebackup", out)?;
        standby.launch()?;
        Ok(standby)
    }

    /// A cluster not started yet: its data folder made absolute (its parent
    /// created, and checked traversable by the server's user), its log file
    /// beside it, and its port.
    fn planned(
        options: ClusterOptions,
        bindir: PathBuf,
        run_as: Option<(u32, u32)>,
    ) -> Result<Cluster, ClusterError> {
        let data_dir = absolute(&options.data_dir)?;
        let parent = data_dir
            .parent()
            .ok_or_else(|| ClusterError::Unreachable(data_dir.clone()))?
            .to_path_buf();
        fs::create_dir_all(&parent).map_err(io(format!("create {}", parent.display())))?;
        if run_as.is_some() {
            check_traversable(&parent)?;
        }
        let log_path = parent.join(format!(
            "{}.log",
            data_dir
                .file_name()
                .map_or("postgres".into(), |n| n.to_string_lossy())
        ));
        let port = match options.port {
            Some(p) => p,
            None => free_port()?,
        };
        Ok(Cluster {
            options: ClusterOptions {
                data_dir,
                ..options
            },
            bindir,
            port,
            run_as,
            child: None,
            log_path,
        })
    }

    /// Promotes a standby to a primary and waits until it is one.
    pub fn promote(&self) -> Result<(), ClusterError> {
        let out = self
            .command("pg_ctl")
            .arg("promote")
            .arg("-D")
            .arg(&self.options.data_dir)
            .args(["-w", "-t", "60"])
            .stdin(Stdio::null())
            .output()
            .map_err(io("run pg_ctl promote"))?;
        succeeded("pg_ctl promote", out)
    }

    /// The TCP port the server listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server log file.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The server's process id (the postmaster), from `postmaster.pid`.
    pub fn postmaster_pid(&self) -> Option<u32> {
        fs::read_to_string(self.options.data_dir.join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// The unprivileged user and group the server runs as, when we are root.
    pub fn run_as(&self) -> Option<(u32, u32)> {
        self.run_as
    }

    /// The folder holding the server binaries in use.
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    /// A connection string for `database` as the superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{database}", self.port)
    }

    /// Stops the server with a fast shutdown and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "INT");
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
    }

    /// Stops the server the way a crash would: an immediate shutdown (SIGQUIT)
    /// ends every server process without a checkpoint, so the next start
    /// runs crash recovery from the WAL.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "QUIT");
            let _ = child.wait();
        }
    }

    /// Starts the server again after [`Cluster::stop`] or [`Cluster::crash`].
    pub fn restart(&mut self) -> Result<(), ClusterError> {
        self.stop();
        self.launch()
    }

    /// Whether the server process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bindir.join(program));
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd.env_remove("PGDATA").env("LC_ALL", "C");
        cmd
    }

    /// Writes `name` in the data folder, readable by the server's user
    /// alone (as it requires of a key file).
    fn write_owned(&self, name: &str, text: &str) -> Result<(), ClusterError> {
        let path = self.options.data_dir.join(name);
        fs::write(&path, text).map_err(io(format!("write {}", path.display())))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
            .map_err(io(format!("set permissions of {}", path.display())))?;
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                .map_err(io(format!("hand {} to the postgres user", path.display())))?;
        }
        Ok(())
    }

    /// Creates the data folder, private to the server's user.
    fn own_data_dir(&self) -> Result<(), ClusterError> {
        let dir = &self.options.data_dir;
        fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(io(format!("set permissions of {}", dir.display())))?;
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid))
                .map_err(io(format!("hand {} to the postgres user", dir.display())))?;
        }
        Ok(())
    }

    fn initdb(&self) -> Result<(), ClusterError> {
        self.own_data_dir()?;
        let dir = &self.options.data_dir;
        let out = self
            .command("initdb")
            .arg("-D")
            .arg(dir)
            .args([
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(io("run initdb"))?;
        succeeded("initdb", out)
    }

    fn launch(&mut self) -> Result<(), ClusterError> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(io(format!("open {}", self.log_path.display())))?;
        let log2 = log.try_clone().map_err(io("clone the log handle"))?;
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(&self.options.data_dir)
            .args(["-p", &self.port.to_string(), "-k", ""])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "wal_level=logical"])
            .args(["-c", "max_wal_senders=64"])
            .args(["-c", "max_replication_slots=64"])
            .args(["-c", "max_connections=300"])
            .args(["-c", "wal_sender_timeout=60s"])
            .args(["-c", "max_slot_wal_keep_size=4GB"])
            .args(["-c", "shared_buffers=256MB"]);
        if !self.options.fsync {
            cmd.args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ]);
        }
        if let Some(tls) = &self.options.tls {
            let dir = &self.options.data_dir;
            self.write_owned("server.crt", &tls.cert_pem)?;
            self.write_owned("server.key", &tls.key_pem)?;
            cmd.args(["-c", "ssl=on"])
                .arg("-c")
                .arg(format!(
                    "ssl_cert_file={}",
                    dir.join("server.crt").display()
                ))
                .arg("-c")
                .arg(format!("ssl_key_file={}", dir.join("server.key").display()));
            if let Some(ca) = &tls.client_ca_pem {
                self.write_owned("client-ca.crt", ca)?;
                cmd.arg("-c").arg(format!(
                    "ssl_ca_file={}",
                    dir.join("client-ca.crt").display()
                ));
            }
        }
        if let Some(hba) = &self.options.hba {
            self.write_owned("pg_hba.conf", hba)?;
        }
        for (k, v) in &self.options.settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(io("start postgres"))?;
        let pid = child.id();
        self.child = Some(child);
        if self.options.die_with_parent {
            spawn_watcher(pid, self.options.remove_on_exit.as_deref());
        }
        self.wait_ready(Duration::from_secs(60))
    }

    fn wait_ready(&mut self, limit: Duration) -> Result<(), ClusterError> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if !self.is_running() {
                return Err(ClusterError::Command {
                    what: "postgres".into(),
                    detail: format!("exited during start-up; see {}", self.log_path.display()),
                });
            }
            let ok = Command::new(self.bindir.join("pg_isready"))
                .args([
                    "-q",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    SUPERUSER,
                    "-d",
                    "postgres",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(ClusterError::NotReady(limit, self.log_path.clone()))
    }

    /// A server left running on this data folder by a process that died
    /// (its lock file names a live pid) is stopped before we start ours.
    fn stop_stale(&self) {
        let pidfile = self.options.data_dir.join("postmaster.pid");
        let Ok(text) = fs::read_to_string(&pidfile) else {
            return;
        };
        let Some(pid) = text
            .lines()
            .next()
            .and_then(|l| l.trim().parse::<u32>().ok())
        else {
            return;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            return;
        }
        tracing::warn!(pid, data_dir = %self.options.data_dir.display(), "stopping a postgres left running on this data folder");
        signal(pid, "INT");
        let deadline = Instant::now() + Duration::from_secs(30);
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status();
}

/// Watches this process; once it is gone, stops postgres and removes the
/// temporary folder if asked. Survives SIGKILL of the parent because it is a
/// separate process.
pub fn spawn_watcher(pg_pid: u32, remove: Option<&Path>) {
    let parent = std::process::id();
    let rm = remove.map(|p| p.display().to_string()).unwrap_or_default();
    let script = "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; \
                  kill -INT \"$2\" 2>/dev/null; \
                  if [ -n \"$3\" ]; then i=0; while kill -0 \"$2\" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; rm -rf \"$3\"; fi";
    let _ = Command::new("sh")
        .args(["-c", script, "strata-pg-watcher"])
        .arg(parent.to_string())
        .arg(pg_pid.to_string())
        .arg(rm)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
}

/// Gives `path` to the user the server runs as.
pub fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), ClusterError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .map_err(io(format!("give {} to the server's user", path.display())))
}

/// A server tool's run: its stderr in the error when it failed.
fn succeeded(what: &str, out: std::process::Output) -> Result<(), ClusterError> {
    if out.status.success() {
        return Ok(());
    }
    Err(ClusterError::Command {
        what: what.into(),
        detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

fn absolute(p: &Path) -> Result<PathBuf, ClusterError> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        Ok(std::env::current_dir()
            .map_err(io("read the current folder"))?
            .join(p))
    }
}

pub fn free_port() -> Result<u16, ClusterError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io("find a free port"))?;
    Ok(l.local_addr().map_err(io("find a free port"))?.port())
}

/// `Some((uid, gid))` of `nobody` when we are root, else `None`.
fn unprivileged_user() -> Result<Option<(u32, u32)>, ClusterError> {
    let me = fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(1);
    if me != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd").map_err(io("read /etc/passwd"))?;
    for line in passwd.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() >= 4 && f[0] == "nobody" {
            if let (Ok(uid), Ok(gid)) = (f[2].parse(), f[3].parse()) {
                return Ok(Some((uid, gid)));
            }
        }
    }
    Err(ClusterError::NoUnprivilegedUser)
}

/// Every ancestor of `dir` must let others traverse it (x for others), or the
/// unprivileged server cannot open its data folder.
fn check_traversable(dir: &Path) -> Result<(), ClusterError> {
    let mut cur = Some(dir);
    while let Some(d) = cur {
        if let Ok(m) = fs::metadata(d) {
            if m.mode() & 0o001 == 0 {
                if d == dir {
                    // Our own parent folder: open it up for traversal.
                    let mode = m.mode() | 0o011;
                    if fs::set_permissions(d, fs::Permissions::from_mode(mode & 0o7777)).is_ok() {
                        cur = d.parent();
                        continue;
                    }
                }
                return Err(ClusterError::Unreachable(d.to_path_buf()));
            }
        }
        cur = d.parent();
    }
    Ok(())
}
