//! The region's simulated nodes: real node daemons (`node::daemon::run`)
//! with fake GPUs, in this process, each with its own data folder, its own
//! one-time join token (bound to its id) for its first start, and its own
//! mutual-TLS session with one of the gateways.
//!
//! The daemons run on a runtime of their own ([`FLEET_THREADS`] threads):
//! sharing the drill's, ten thousand of them queued every read and append
//! of the drill's behind their own work, so that a read of the log's
//! placements took minutes to collect its rows while the region waited.
//! On threads of their own they still take their share of the cores, as
//! machines of their own would not.

use super::lag::Lag;
use anyhow::Result;
use node::daemon::{self, DaemonConfig, DaemonError, DaemonStats};
use node::gpu::FakeGpus;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// GPUs of every simulated node.
pub const GPUS: &str = "8xH100-80GB";
/// Their class.
pub const CLASS: &str = "H100-80GB";

/// One simulated node.
pub struct Node {
    pub id: String,
    pub pool: String,
    pub dir: PathBuf,
    pub gpus: Arc<FakeGpus>,
    token: Option<String>,
}

/// Threads of the fleet's runtime.
pub const FLEET_THREADS: usize = 2;

/// A running daemon: its stop, and its task.
type Daemon = (watch::Sender<bool>, JoinHandle<Result<(), DaemonError>>);

/// Every simulated node, and the daemons running now.
pub struct Fleet {
    pub nodes: Vec<Arc<Node>>,
    pub stats: Arc<DaemonStats>,
    gateways: Vec<String>,
    ca_pem: String,
    /// Each node's daemon now, by the node's index: its stop and its task.
    running: Vec<Option<Daemon>>,
    return_home: Duration,
    /// Daemons that ended with an error (a refused join, say), over all starts.
    pub refusals: Vec<String>,
    /// Why each daemon that ended by itself did, as it happened.
    pub why: Arc<std::sync::Mutex<Vec<String>>>,
    /// The runtime the daemons run on (`None` once shut down).
    runtime: Option<tokio::runtime::Runtime>,
    /// When each bind command reached its node and when the node had run
    /// it, on the wall clock (to set beside the log's `recorded_at`).
    pub binds: Arc<std::sync::Mutex<HashMap<String, NodeTimes>>>,
    /// How late the daemons' runtime runs what is due.
    pub lag: Arc<Lag>,
}

/// When a command reached its node, and when the node had run it.
#[derive(Debug, Clone, Copy)]
pub struct NodeTimes {
    pub received: SystemTime,
    pub finished: Option<SystemTime>,
    /// When its result was on the session's way out.
    pub sent: Option<SystemTime>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // Dropped inside the drill's runtime: a runtime may not wait for
        // its threads there.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Fleet {
    /// Creates `n` nodes spread over `pools`, each with a token that admits
    /// its id alone.
    pub async fn provision(
        client: &tokio_postgres::Client,
        n: usize,
        pools: &[String],
        dir: &Path,
        ca_pem: String,
        nice: i32,
    ) -> Result<Fleet> {
        let mut nodes = Vec::with_capacity(n);
        for i in 0..n {
            let id = format!("rg{i:05}");
            let pool = pools[i % pools.len()].clone();
            let token =
                gateway::identity::create_token(client, &pool, Duration::from_secs(6 * 3600), &id)
                    .await?;
            nodes.push(Arc::new(Node {
                gpus: Arc::new(FakeGpus::parse(GPUS, &id)?),
                dir: dir.join(&id),
                id,
                pool,
                token: Some(token),
            }));
            if (i + 1) % 2000 == 0 {
                eprintln!("  {} of {n} join tokens issued", i + 1);
            }
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(FLEET_THREADS)
            .thread_name("fleet")
            .on_thread_start(move || renice_this_thread(nice))
            .enable_all()
            .build()?;
        let lag = Lag::start(runtime.handle());
        Ok(Fleet {
            nodes,
            stats: Arc::default(),
            gateways: Vec::new(),
            ca_pem,
            running: Vec::new(),
            return_home: Duration::from_secs(30),
            refusals: Vec::new(),
            why: Arc::default(),
            binds: Arc::default(),
            runtime: Some(runtime),
            lag,
        })
    }

    pub fn set_gateways(&mut self, gateways: Vec<String>) {
        self.gateways = gateways;
    }

    /// Starts every daemon at the same instant. A node without a
    /// certificate yet joins with its token first.
    pub fn start(&mut self, return_home: Duration) {
        self.return_home = return_home;
        let all: Vec<usize> = (0..self.nodes.len()).collect();
        self.start_these(&all);
    }

    /// Starts the daemons of the nodes at these indexes (those not running).
    pub fn start_these(&mut self, which: &[usize]) {
        self.running.resize_with(self.nodes.len(), || None);
        for &i in which {
            if self.running[i].is_some() {
                continue;
            }
            let n = &self.nodes[i];
            let mut c =
                DaemonConfig::new(self.gateways.clone(), n.dir.clone(), &n.id, n.gpus.clone());
            // Health is polled at the daemon's default: a drift the load
            // injects wakes its daemon at once, as a real backend's event
            // does, and 10,000 polls a second were the fleet's own load.
            c.return_home = self.return_home;
            let (arrived, ran) = (self.binds.clone(), self.binds.clone());
            c.on_command = Some(Arc::new(move |id: &str| {
                if id.starts_with("bind:") {
                    arrived
                        .lock()
                        .expect("binds lock")
                        .entry(id.to_string())
                        .or_insert(NodeTimes {
                            received: SystemTime::now(),
                            finished: None,
                            sent: None,
                        });
                }
            }));
            c.on_finished = Some(Arc::new(move |id: &str| {
                if let Some(t) = ran.lock().expect("binds lock").get_mut(id) {
                    t.finished.get_or_insert_with(SystemTime::now);
                }
            }));
            let sent = self.binds.clone();
            c.on_sent = Some(Arc::new(move |id: &str| {
                if let Some(t) = sent.lock().expect("binds lock").get_mut(id) {
                    t.sent.get_or_insert_with(SystemTime::now);
                }
            }));
            if !n.dir.join("node.pem").exists() {
                c.token = n.token.clone();
                c.ca_pem = Some(self.ca_pem.clone());
            }
            let (tx, rx) = watch::channel(false);
            let (stats, why, id) = (self.stats.clone(), self.why.clone(), n.id.clone());
            let runtime = self.runtime.as_ref().expect("the fleet's runtime runs");
            let task = runtime.spawn(async move {
                let r = daemon::run(c, stats, rx).await;
                if let Err(e) = &r {
                    why.lock().expect("why lock").push(format!("{id}: {e}"));
                }
                r
            });
            self.running[i] = Some((tx, task));
        }
    }

    /// Stops every daemon (their sessions end as a power loss would end
    /// them, without a goodbye) and waits for them.
    pub async fn stop(&mut self) {
        let all: Vec<usize> = (0..self.nodes.len()).collect();
        self.stop_these(&all).await;
    }

    /// Stops the daemons of the nodes at these indexes, all at once, as a
    /// power loss would, and waits for them.
    pub async fn stop_these(&mut self, which: &[usize]) {
        let mut stopping = Vec::new();
        for &i in which {
            if let Some((tx, task)) = self.running.get_mut(i).and_then(Option::take) {
                let _ = tx.send(true);
                stopping.push((i, task));
            }
        }
        for (i, t) in stopping {
            match t.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => self.refusals.push(format!("{}: {e}", self.nodes[i].id)),
                Err(e) => self.refusals.push(format!("{}: {e}", self.nodes[i].id)),
            }
        }
    }

    /// The indexes of these nodes.
    pub fn indexes(&self, ids: &[String]) -> Vec<usize> {
        let want: std::collections::HashSet<&String> = ids.iter().collect();
        (0..self.nodes.len())
            .filter(|&i| want.contains(&self.nodes[i].id))
            .collect()
    }

    /// Daemons that have ended while the fleet runs (each a refusal: a
    /// running daemon ends only when told to).
    pub fn ended(&self) -> usize {
        self.running
            .iter()
            .flatten()
            .filter(|(_, t)| t.is_finished())
            .count()
    }
}

/// Sets the calling thread's nice value (Linux: a thread's own); a refusal
/// (no privilege) is said once per thread and the thread runs as it is.
fn renice_this_thread(nice: i32) {
    if nice == 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    let r = rustix::process::setpriority_process(Some(tid), nice);
    if let Err(e) = r {
        eprintln!("the fleet's thread keeps its priority: nice {nice}: {e}");
    }
}
