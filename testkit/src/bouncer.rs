//! A private PgBouncer in front of a private cluster, for the tests and the
//! benchmarks: transaction pooling (a server connection is a client's only
//! for the length of a transaction), the way production runs it.
//!
//! The binary is found on `PATH` or in `/usr/sbin` (Debian's package
//! `pgbouncer`). Like the cluster it runs as `nobody` when we are root, and
//! it is tied to this process's life by the same watcher.

use schema::cluster::{chown, free_port, io, spawn_watcher, Cluster, ClusterError, SUPERUSER};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How a private PgBouncer pools.
#[derive(Clone, Debug)]
pub struct BouncerOptions {
    /// `pool_mode`: `transaction` unless a test says otherwise.
    pub pool_mode: String,
    /// Server connections per database and user (`default_pool_size`):
    /// small, so that clients share them as they do in production.
    pub pool_size: u32,
    /// Users allowed in (`auth_type = trust`; the cluster authenticates).
    pub users: Vec<String>,
}

impl Default for BouncerOptions {
    fn default() -> Self {
        BouncerOptions {
            pool_mode: "transaction".into(),
            pool_size: 4,
            users: vec![SUPERUSER.into()],
        }
    }
}

/// A running PgBouncer. Dropping it stops it.
#[derive(Debug)]
pub struct Bouncer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    remove_dir: bool,
}

impl Bouncer {
    /// Finds `pgbouncer`: on `PATH`, then `/usr/sbin`, `/usr/local/sbin`.
    pub fn find() -> Result<PathBuf, ClusterError> {
        let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        dirs.extend(["/usr/sbin", "/usr/local/sbin"].map(PathBuf::from));
        dirs.into_iter()
            .map(|d| d.join("pgbouncer"))
            .find(|p| p.is_file())
            .ok_or_else(|| ClusterError::Command {
                what: "find pgbouncer".into(),
                detail: "no pgbouncer on PATH or in /usr/sbin; install it, e.g. `apt-get install pgbouncer`".into(),
            })
    }

    /// Starts a PgBouncer on a free loopback port in front of `cluster`
    /// (every database), its files in `dir`.
    pub fn start(
        cluster: &Cluster,
        dir: &Path,
        options: &BouncerOptions,
    ) -> Result<Bouncer, ClusterError> {
        let bin = Self::find()?;
        fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
        let port = free_port()?;
        let users: String = options
            .users
            .iter()
            .map(|u| format!("\"{u}\" \"\"\n"))
            .collect();
        let auth = dir.join("users.txt");
        fs::write(&auth, users).map_err(io("write the PgBouncer user list"))?;
        let ini = dir.join("pgbouncer.ini");
        let log = dir.join("pgbouncer.log");
        fs::write(
            &ini,
            format!(
                "[databases]\n* = host=127.0.0.1 port={pg}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {auth}\n\
                 pool_mode = {mode}\ndefault_pool_size = {size}\nmax_client_conn = 1000\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 logfile = {log}\npidfile =\nadmin_users = {su}\n",
                pg = cluster.port(),
                auth = auth.display(),
                mode = options.pool_mode,
                size = options.pool_size,
                log = log.display(),
                su = SUPERUSER,
            ),
        )
        .map_err(io("write pgbouncer.ini"))?;
        let mut cmd = Command::new(bin);
        if let Some((uid, gid)) = cluster.run_as() {
            use std::os::unix::process::CommandExt;
            chown(dir, uid, gid)?;
            for f in [&auth, &ini] {
                chown(f, uid, gid)?;
            }
            cmd.uid(uid).gid(gid);
        }
        let child = cmd
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(io("start pgbouncer"))?;
        spawn_watcher(child.id(), None);
        let mut bouncer = Bouncer {
            child: Some(child),
            port,
            dir: dir.to_path_buf(),
            remove_dir: false,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            let exited = bouncer
                .child
                .as_mut()
                .map(|c| matches!(c.try_wait(), Ok(Some(_))))
                .unwrap_or(true);
            if exited || Instant::now() > deadline {
                let detail = fs::read_to_string(&log).unwrap_or_default();
                return Err(ClusterError::Command {
                    what: "start pgbouncer".into(),
                    detail: format!("it did not listen on port {port}: {}", detail.trim()),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(bouncer)
    }

    /// The port PgBouncer listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A connection string for `database` through PgBouncer, as the
    /// cluster's superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{database}", self.port)
    }

    /// Removes the folder of its files when it is dropped.
    pub fn remove_on_drop(mut self) -> Bouncer {
        self.remove_dir = true;
        self
    }

    /// PgBouncer's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("pgbouncer.log")
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if self.remove_dir {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}
