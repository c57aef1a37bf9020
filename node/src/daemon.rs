//! The daemon: joins on first start (and keeps its certificate), then holds
//! its session with a gateway for as long as it runs, reconnecting with full
//! jitter and obeying every pushback.
//!
//! Each node has a home among the gateways it is given (chosen by a hash of
//! its id, so a fleet spreads evenly and each node always prefers the same
//! one). It starts there; when a session ends it tries another, chosen at
//! random, so the nodes of a gateway that died spread over the rest;
//! and while it is away from home it checks every `return_home` (jittered,
//! so a fleet returning to a restarted gateway arrives over that window
//! rather than at once) whether home accepts connections again, and moves
//! back if so.

use crate::allocation::{Bindings, Reconciled};
use crate::executor::{Decision, Executor, Outcome};
use crate::gpu::{GpuBackend, HealthChange};
use crate::health::Conditions;
use crate::link::{Channel, Link};
use crate::proto::{
    gateway_message, node_message, session_client::SessionClient, CommandAck, CommandResult,
    Device, GatewayMessage, HealthReport, Heartbeat, Hello, InventorySection, NodeMessage, Renew,
    StatusReport, Welcome,
};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// How long a gateway may take to answer a Hello, in the time this
/// process could run ([`ops::process_clock::ProcessClock::patient`]).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(15);
/// The most a Hello is waited for in wall time, however starved the
/// process.
pub const HELLO_MOST: Duration = Duration::from_secs(60);

/// `host:port` of a gateway address such as `https://gw1.example:7443`.
fn authority(gateway: &str) -> Option<String> {
    let uri: tonic::transport::Uri = gateway.parse().ok()?;
    let a = uri.authority()?;
    Some(match a.port_u16() {
        Some(_) => a.as_str().to_string(),
        None => format!("{}:443", a.host()),
    })
}

/// Whether something accepts connections at `addr` (within 2 s).
async fn accepts(addr: &str) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

use crate::config::io;
pub use crate::config::{home_index, CommandHook, DaemonConfig, DaemonError, ANSWER_SLACK};
pub use crate::identity::{ensure_joined, Credentials};

/// Counters of a running daemon.
#[derive(Debug, Default)]
pub struct DaemonStats {
    /// Certificates renewed over a session.
    pub renewals: AtomicU64,
    /// Connections made (TCP, TLS, HTTP/2).
    pub connects: AtomicU64,
    /// Sessions opened again over the connection a pushback left open
    /// (`retry-here`), with no new handshake.
    pub connections_reused: AtomicU64,
    pub sessions: AtomicU64,
    pub pushbacks: AtomicU64,
    /// Milliseconds waited because a gateway said so.
    pub pushback_wait_ms: AtomicU64,
    pub heartbeats: AtomicU64,
    pub health_reports: AtomicU64,
    pub epoch: AtomicU64,
    /// 1 while a session is open.
    /// Sessions open now (a fleet shares one set of counters).
    pub connected: AtomicU64,
    pub commands_received: AtomicU64,
    /// Commands actually run (not repeats).
    pub commands_run: AtomicU64,
    /// Sessions ended to move back to the home gateway.
    pub returned_home: AtomicU64,
    /// Connections that could not be made (refused, timed out, TLS).
    pub connect_failures: AtomicU64,
    /// Hellos given up on: no Welcome within the daemon's patience.
    pub welcomes_given_up: AtomicU64,
}

/// Increments and returns the daemon's generation (one per start).
fn next_generation(dir: &Path) -> Result<u64, DaemonError> {
    let p = dir.join("generation");
    let g = std::fs::read_to_string(&p)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0)
        + 1;
    std::fs::write(&p, g.to_string()).map_err(io(&p))?;
    Ok(g)
}

fn inventory_section(
    backend: &dyn GpuBackend,
    acceptance: &crate::acceptance::Report,
) -> Result<InventorySection, DaemonError> {
    let gpus = backend
        .inventory()
        .map_err(|e| DaemonError::Other(e.to_string()))?;
    let devices: Vec<Device> = gpus
        .into_iter()
        .map(|g| Device {
            id: g.id,
            class: g.class,
            memory_mb: g.memory_mb,
            island: g.island.unwrap_or_default(),
            pci: g.pci,
            numa: g.numa,
            parent: g.parent.unwrap_or_default(),
        })
        .collect();
    let mut canonical = String::new();
    for d in &devices {
        canonical.push_str(&format!(
            "{}|{}|{}|{}|{}|{}|{}\n",
            d.id, d.class, d.memory_mb, d.island, d.pci, d.numa, d.parent
        ));
    }
    // The check's outcome is part of the hash: a changed one is sent again.
    canonical.push_str(&acceptance.summary());
    Ok(InventorySection {
        name: "gpus".into(),
        hash: digest(&canonical),
        devices,
        labels: HashMap::new(),
        acceptance_json: serde_json::to_string(acceptance).unwrap_or_default(),
    })
}

/// The `acceptance` section: a re-check's result alone. The devices it was
/// run on are those of the `gpus` section the session opened with (a
/// change of them is sent as a `gpus` section), and a node that left its
/// pool is not brought back by a check it ran meanwhile.
fn acceptance_section(acceptance: &crate::acceptance::Report) -> InventorySection {
    InventorySection {
        name: "acceptance".into(),
        hash: digest(&acceptance.summary()),
        devices: Vec::new(),
        labels: HashMap::new(),
        acceptance_json: serde_json::to_string(acceptance).unwrap_or_default(),
    }
}

/// The `topology` section: the node's labels, when it has any.
fn topology_section(labels: &BTreeMap<String, String>) -> Option<InventorySection> {
    if labels.is_empty() {
        return None;
    }
    let canonical: String = labels.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    Some(InventorySection {
        name: "topology".into(),
        hash: digest(&canonical),
        devices: Vec::new(),
        acceptance_json: String::new(),
        labels: labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    })
}

/// A section's hash: the first 16 bytes of the SHA-256 of its canonical
/// text, in hex.
fn digest(canonical: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, canonical.as_bytes());
    digest.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// How a session ended.
enum End {
    /// Stopped on purpose.
    Shutdown,
    /// The gateway said when to come back, and whether to come back to it
    /// over the same connection (`retry-here`: it is only busy for the
    /// moment) or to go anywhere.
    Pushback { wait: Duration, here: bool },
    /// The gateway refused this node for good (revoked, unknown).
    Refused(String),
    /// Anything else: reconnect with backoff.
    Lost(String),
    /// The certificate was renewed: reconnect with it at once.
    Renewed,
    /// Home accepts connections again: move back to it at once.
    Home,
}

fn retry_after(status: &tonic::Status) -> Option<Duration> {
    status
        .metadata()
        .get("retry-after-ms")?
        .to_str()
        .ok()?
        .parse::<u64>()
        .ok()
        .map(Duration::from_millis)
}

fn classify(status: tonic::Status) -> End {
    if let Some(wait) = retry_after(&status) {
        let here = status.metadata().get("retry-here").is_some();
        return End::Pushback { wait, here };
    }
    match status.code() {
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
            End::Refused(status.message().to_string())
        }
        _ => End::Lost(with_causes(&status)),
    }
}

/// A status in words with every cause under it ("Unknown: transport
/// error: ... : keep-alive timed out"): a transport error alone does not
/// say whether the gateway, the network or this process ended the
/// connection.
fn with_causes(status: &tonic::Status) -> String {
    let mut words = format!("{}: {}", status.code(), status.message());
    let mut cause = std::error::Error::source(status);
    while let Some(c) = cause {
        let said = c.to_string();
        if !words.ends_with(&said) {
            words.push_str(": ");
            words.push_str(&said);
        }
        cause = c.source();
    }
    words
}

/// One link per gateway, presenting these credentials.
fn links(config: &DaemonConfig, creds: &Credentials) -> Result<Vec<Link>, DaemonError> {
    if config.gateways.is_empty() {
        return Err(DaemonError::Other("no gateway given".into()));
    }
    crate::link::links(
        &config.gateways,
        (&creds.ca_pem, &creds.cert_pem, &creds.key_pem),
        &config.server_name,
        config.gateway_answer,
        &config.clock,
    )
    .map_err(DaemonError::Other)
}

/// Runs the daemon until `shutdown` turns true. Returns an error only when
/// the node cannot go on (no credentials, refused for good).
pub async fn run(
    config: DaemonConfig,
    stats: Arc<DaemonStats>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), DaemonError> {
    // Joining waits out a gateway that is not up yet; a refusal is final.
    let mut tries = 0u32;
    let creds = loop {
        match crate::identity::ensure_joined_at(&config, tries as usize).await {
            Ok(c) => break c,
            Err(DaemonError::Unreachable(why)) => {
                tries = tries.saturating_add(1);
                tracing::info!(node = %config.node_id, reason = %why, "cannot join yet; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(config.backoff(tries)) => {}
                    _ = shutdown.changed() => return Ok(()),
                }
            }
            Err(e) => return Err(e),
        }
    };
    let generation = next_generation(&config.data_dir)?;
    // The acceptance check, before any session: the daemon starts after
    // every reboot.
    let dcgm = crate::rechecks::DcgmLevel::load(&config);
    let acceptance = {
        let (backend, level) = (config.backend.clone(), dcgm.get());
        tokio::task::spawn_blocking(move || crate::acceptance::check(backend.as_ref(), level))
            .await
            .map_err(|e| DaemonError::Other(format!("the acceptance check panicked: {e}")))?
    };
    if !acceptance.passed {
        tracing::warn!(node = %config.node_id, reason = %acceptance.reason, "the acceptance check failed; the node takes no work until one passes");
    }
    let acceptance = Arc::new(std::sync::Mutex::new(acceptance));
    let bindings = Bindings::new(&config.data_dir, &config.cdi_dir).guarded_by(acceptance.clone());
    let fixed = bindings
        .reconcile(config.backend.as_ref())
        .map_err(io(&config.cdi_dir))?;
    if fixed != Reconciled::default() {
        tracing::warn!(
            node = %config.node_id,
            releases_finished = ?fixed.released,
            specs_removed = ?fixed.specs_removed,
            specs_written = ?fixed.specs_written,
            "the bindings and their CDI specs disagreed after a stop; made them agree"
        );
    }
    let runner = Runner::new(
        Executor::open(&config.data_dir).map_err(io(&config.data_dir))?,
        bindings,
        acceptance.clone(),
    );
    let conditions = std::sync::Mutex::new(Conditions::open(&config.data_dir));
    let mut links = links(&config, &creds)?;
    let home = config.home();
    let home_addr = authority(&config.gateways[home]);
    let mut at = home;
    let mut failures = 0u32;
    let mut kept: Kept = None;
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        let link = &links[at];
        let away = (at != home && !config.return_home.is_zero())
            .then(|| home_addr.clone())
            .flatten();
        // Next time, any other gateway: the nodes of one that died spread
        // over all the others instead of doubling the next one's load.
        let tried = at;
        at = match links.len() {
            1 => 0,
            n => (tried + 1 + fastrand::usize(..n - 1)) % n,
        };
        let mut opened = false;
        let end = match connection(link, tried, &mut kept, &stats).await {
            Ok(channel) => {
                let end = session(
                    &config,
                    &stats,
                    channel.clone(),
                    generation,
                    (&runner, &conditions, &acceptance, &dcgm),
                    (&mut shutdown, away.as_deref()),
                    &mut opened,
                )
                .await;
                if matches!(end, End::Pushback { here: true, .. }) {
                    kept = Some((tried, channel));
                }
                end
            }
            Err(e) => End::Lost(format!("connect: {e}")),
        };
        if opened {
            // A session was open: start the backoff over.
            failures = 0;
        }
        let wait = match end {
            End::Shutdown => return Ok(()),
            End::Refused(why) => return Err(DaemonError::Refused(why)),
            End::Pushback { wait, here } => {
                stats.pushbacks.fetch_add(1, Ordering::Relaxed);
                stats
                    .pushback_wait_ms
                    .fetch_add(wait.as_millis() as u64, Ordering::Relaxed);
                tracing::info!(node = %config.node_id, wait_ms = wait.as_millis() as u64, here, "gateway pushback; waiting");
                if here {
                    // Only busy: back to it, over the same connection.
                    at = tried;
                }
                wait
            }
            End::Renewed => {
                let creds =
                    crate::identity::load(&config.data_dir)?.ok_or(DaemonError::NeedsJoin)?;
                links = self::links(&config, &creds)?;
                Duration::ZERO
            }
            End::Home => {
                tracing::info!(node = %config.node_id, gateway = %config.gateways[home], "home gateway is back; moving to it");
                stats.returned_home.fetch_add(1, Ordering::Relaxed);
                at = home;
                Duration::ZERO
            }
            End::Lost(why) => {
                failures = failures.saturating_add(1);
                // Full jitter: uniform in [0, min(cap, base * 2^failures)).
                let d = config.backoff(failures);
                tracing::info!(node = %config.node_id, reason = %why, wait_ms = d.as_millis() as u64, "session lost; reconnecting");
                d
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => {}
        }
    }
}

/// The connection a `retry-here` pushback left open, and to which gateway
/// (its index in the links).
type Kept = Option<(usize, Channel)>;

/// A connection to gateway `at` through `link`: the one a pushback left
/// open to it when it is still open (no new TCP, TLS and HTTP/2
/// handshakes: a fleet pushed back through a cold start would otherwise
/// make one for every pushback), else a new one. A kept connection to
/// another gateway is closed.
async fn connection(
    link: &Link,
    at: usize,
    kept: &mut Kept,
    stats: &DaemonStats,
) -> Result<Channel, String> {
    if let Some((to, channel)) = kept.take() {
        if to == at && !channel.is_closed() {
            stats.connections_reused.fetch_add(1, Ordering::Relaxed);
            return Ok(channel);
        }
    }
    match link.connect().await {
        Ok(channel) => {
            stats.connects.fetch_add(1, Ordering::Relaxed);
            Ok(channel)
        }
        Err(e) => {
            stats.connect_failures.fetch_add(1, Ordering::Relaxed);
            Err(e)
        }
    }
}

/// A renewal request (and its key) when the certificate on disk has less
/// than a third of its validity left.
fn renewal_request(
    config: &DaemonConfig,
) -> Result<Option<(rcgen::KeyPair, NodeMessage)>, DaemonError> {
    let path = config.data_dir.join("node.pem");
    let pem = std::fs::read_to_string(&path).map_err(io(&path))?;
    if !crate::identity::renewal_due(&pem, std::time::SystemTime::now()) {
        return Ok(None);
    }
    let (key, csr_pem) = crate::identity::new_csr()?;
    Ok(Some((
        key,
        NodeMessage {
            body: Some(node_message::Body::Renew(Renew { csr_pem })),
        },
    )))
}

fn health_message(c: HealthChange) -> NodeMessage {
    NodeMessage {
        body: Some(node_message::Body::Health(HealthReport {
            device: c.device.unwrap_or_default(),
            condition: c.condition,
            detail: c.detail,
            cleared: c.cleared,
        })),
    }
}

async fn session(
    config: &DaemonConfig,
    stats: &Arc<DaemonStats>,
    channel: Channel,
    generation: u64,
    (runner, conditions, acceptance, dcgm): (
        &Runner,
        &std::sync::Mutex<Conditions>,
        &Arc<std::sync::Mutex<crate::acceptance::Report>>,
        &Arc<crate::rechecks::DcgmLevel>,
    ),
    (shutdown, home): (&mut watch::Receiver<bool>, Option<&str>),
    opened: &mut bool,
) -> End {
    let report = acceptance.lock().expect("acceptance lock").clone();
    let section = match inventory_section(config.backend.as_ref(), &report) {
        Ok(s) => s,
        Err(e) => return End::Lost(e.to_string()),
    };
    let topology = topology_section(&config.topology);
    let mut section_hashes = HashMap::from([(section.name.clone(), section.hash.clone())]);
    if let Some(t) = &topology {
        section_hashes.insert(t.name.clone(), t.hash.clone());
    }
    let (tx, mut inbound, welcome) =
        match open(config, stats, channel, generation, section_hashes).await {
            Ok(x) => x,
            Err(end) => return end,
        };
    stats.sessions.fetch_add(1, Ordering::Relaxed);
    stats.epoch.store(welcome.epoch, Ordering::Relaxed);
    *opened = true;
    let _connected = Connected::new(&stats.connected);
    let _current = runner.attach(&tx);
    tracing::debug!(node = %config.node_id, epoch = welcome.epoch, "session open");
    let gpus = section.devices.len();
    if let Err(end) = announce(config, &welcome, section, topology, conditions, &tx).await {
        return end;
    }
    let every = Duration::from_secs(welcome.heartbeat_seconds.max(1).into());
    // Spread heartbeats of many nodes over the interval.
    let mut beat = tokio::time::interval_at(
        tokio::time::Instant::now() + every.mul_f64(fastrand::f64()),
        every,
    );
    let mut health = tokio::time::interval(config.health_poll);
    let mut rechecks = crate::rechecks::Rechecks::new(config, dcgm.clone());
    if dcgm.told(welcome.dcgm_level) {
        tracing::info!(node = %config.node_id, level = dcgm.get(), "the pool's DCGM level changed; checking at it");
        rechecks.cleared(config);
    }
    // Health that changed between polls is reported at once.
    let changed = config.backend.changed();
    let health_changed = notified(changed.as_deref());
    tokio::pin!(health_changed);
    // Away from home: when to look whether it is back.
    let next_look =
        || tokio::time::Instant::now() + config.return_home.mul_f64(0.5 + fastrand::f64());
    let look = tokio::time::sleep_until(next_look());
    tokio::pin!(look);
    let mut seq = 0u64;
    // The key of a renewal asked for in this session (one per session).
    let mut renewing: Option<rcgen::KeyPair> = None;
    let mut asked_renewal = false;
    loop {
        tokio::select! {
            _ = shutdown.changed() => return End::Shutdown,
            _ = &mut look, if home.is_some() => {
                if accepts(home.unwrap_or_default()).await {
                    return End::Home;
                }
                look.as_mut().reset(next_look());
            }
            _ = beat.tick() => {
                seq += 1;
                let m = NodeMessage { body: Some(node_message::Body::Heartbeat(Heartbeat { seq })) };
                if tx.send(m).await.is_err() {
                    return End::Lost("send heartbeat".into());
                }
                stats.heartbeats.fetch_add(1, Ordering::Relaxed);
                if !asked_renewal {
                    match renewal_request(config) {
                        Ok(Some((key, m))) => {
                            asked_renewal = true;
                            renewing = Some(key);
                            if tx.send(m).await.is_err() {
                                return End::Lost("send renewal".into());
                            }
                        }
                        Ok(None) => {}
                        Err(e) => tracing::warn!(node = %config.node_id, error = %e, "cannot ask for a renewed certificate"),
                    }
                }
            }
            _ = health.tick() => match report_health(config, stats, conditions, gpus, &tx).await {
                Err(end) => return end,
                Ok(cleared) => if cleared { rechecks.cleared(config) },
            },
            Some((report, forced)) = rechecks.next(config) => {
                if let Err(end) = rechecked_report(config, acceptance, report, forced, &tx).await {
                    return end;
                }
            }
            _ = &mut health_changed => {
                health_changed.set(notified(changed.as_deref()));
                match report_health(config, stats, conditions, gpus, &tx).await {
                    Err(end) => return end,
                    Ok(cleared) => if cleared { rechecks.cleared(config) },
                }
            }
            m = inbound.message() => match m {
                Ok(Some(msg)) => match msg.body {
                    Some(gateway_message::Body::Pushback(p)) => {
                        return End::Pushback {
                            wait: Duration::from_millis(p.retry_after_ms.into()),
                            here: false,
                        };
                    }
                    Some(gateway_message::Body::Renewed(r)) => match renewing.take() {
                        Some(key) if r.error.is_empty() => {
                            match crate::identity::store_renewed(&config.data_dir, &key.serialize_pem(), &r.certificate_pem) {
                                Ok(()) => {
                                    stats.renewals.fetch_add(1, Ordering::Relaxed);
                                    tracing::info!(node = %config.node_id, "certificate renewed; reconnecting with it");
                                    return End::Renewed;
                                }
                                Err(e) => tracing::error!(node = %config.node_id, error = %e, "could not store the renewed certificate; the current one is kept"),
                            }
                        }
                        Some(_) => {
                            // Asked again at a later heartbeat.
                            asked_renewal = false;
                            tracing::warn!(node = %config.node_id, reason = %r.error, "the gateway did not renew the certificate");
                        }
                        None => {}
                    },
                    Some(gateway_message::Body::Command(c)) => {
                        stats.commands_received.fetch_add(1, Ordering::Relaxed);
                        if let Some(hook) = &config.on_command {
                            hook(&c.id);
                        }
                        if runner.handle(config, stats, c, &tx).await.is_err() {
                            return End::Lost("send a command report".into());
                        }
                    }
                    _ => {}
                },
                Ok(None) => return End::Lost("the gateway ended the session".into()),
                Err(status) => return classify(status),
            },
        }
    }
}

/// Opens a session: sends the Hello, and waits (at most `HELLO_TIMEOUT`)
/// for the gateway's Welcome; the way to send, what comes back, and the
/// Welcome.
async fn open(
    config: &DaemonConfig,
    stats: &DaemonStats,
    channel: Channel,
    generation: u64,
    section_hashes: HashMap<String, String>,
) -> Result<
    (
        mpsc::Sender<NodeMessage>,
        tonic::Streaming<GatewayMessage>,
        Welcome,
    ),
    End,
> {
    let (tx, rx) = mpsc::channel::<NodeMessage>(64);
    let hello = NodeMessage {
        body: Some(node_message::Body::Hello(Hello {
            node_id: config.node_id.clone(),
            generation,
            section_hashes,
            agent_version: env!("CARGO_PKG_VERSION").into(),
        })),
    };
    if tx.send(hello).await.is_err() {
        return Err(End::Lost("send Hello".into()));
    }
    let outbound =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut client = SessionClient::with_origin(channel.clone(), channel.origin());
    // A gateway that does not answer the Hello in time is treated as lost.
    let opening = async {
        let mut inbound = client.open(outbound).await?.into_inner();
        let first = inbound.message().await?;
        Ok::<_, tonic::Status>((inbound, first))
    };
    // Counted in the time this process could run: a daemon waiting for a
    // core must not take that for a gateway that does not answer.
    let (inbound, first) = match config
        .clock
        .patient(HELLO_TIMEOUT, HELLO_MOST, opening)
        .await
    {
        Err(gave) => {
            stats.welcomes_given_up.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(node = %config.node_id, waited_ms = gave.waited.as_millis() as u64, "no Welcome within {HELLO_TIMEOUT:?}; trying again");
            return Err(End::Lost("no Welcome in time".into()));
        }
        Ok(Err(status)) => return Err(classify(status)),
        Ok(Ok(x)) => x,
    };
    let welcome = match Ok::<_, tonic::Status>(first) {
        Ok(Some(m)) => match m.body {
            Some(gateway_message::Body::Welcome(w)) => w,
            Some(gateway_message::Body::Pushback(p)) => {
                return Err(End::Pushback {
                    wait: Duration::from_millis(p.retry_after_ms.into()),
                    here: false,
                })
            }
            _ => return Err(End::Lost("the gateway did not start with Welcome".into())),
        },
        Ok(None) => return Err(End::Lost("the gateway closed the session".into())),
        Err(status) => return Err(classify(status)),
    };
    Ok((tx, inbound, welcome))
}

/// What a node says once a session is open: the inventory sections the
/// gateway wants (the devices before the labels: a node's labels are about
/// a node of the pool), that it is ready, and the conditions in force (a
/// report lost with the last session arrives).
async fn announce(
    config: &DaemonConfig,
    welcome: &Welcome,
    section: InventorySection,
    topology: Option<InventorySection>,
    conditions: &std::sync::Mutex<Conditions>,
    tx: &mpsc::Sender<NodeMessage>,
) -> Result<(), End> {
    let section_gpus = section.devices.len();
    // The devices first: a node's labels are about a node of the pool.
    for section in std::iter::once(section).chain(topology) {
        if welcome.want_sections.contains(&section.name) {
            let msg = NodeMessage {
                body: Some(node_message::Body::Inventory(section)),
            };
            if tx.send(msg).await.is_err() {
                return Err(End::Lost("send inventory".into()));
            }
        }
    }
    let ready = format!("{} GPUs through {}", section_gpus, config.backend.name());
    if tx.send(status("ready", ready)).await.is_err() {
        return Err(End::Lost("send status".into()));
    }
    // What is in force, again: a report lost with the last session arrives.
    let in_force = conditions.lock().expect("conditions lock").in_force();
    for c in in_force {
        if tx.send(health_message(c)).await.is_err() {
            return Err(End::Lost("send health".into()));
        }
    }
    Ok(())
}

/// The node's status, sent when it changes (the gateway writes only what is
/// new anyway).
fn status(state: &str, detail: String) -> NodeMessage {
    NodeMessage {
        body: Some(node_message::Body::Status(StatusReport {
            state: state.into(),
            detail,
        })),
    }
}

/// A re-check's result: kept, and sent (the `acceptance` section) when it
/// changed or was `forced` (a check after a GPU's condition cleared).
async fn rechecked_report(
    config: &DaemonConfig,
    acceptance: &std::sync::Mutex<crate::acceptance::Report>,
    report: crate::acceptance::Report,
    forced: bool,
    tx: &mpsc::Sender<NodeMessage>,
) -> Result<(), End> {
    let changed = {
        let mut last = acceptance.lock().expect("acceptance lock");
        let changed = last.summary() != report.summary();
        *last = report.clone();
        changed
    };
    if !changed && !forced {
        return Ok(());
    }
    tracing::info!(node = %config.node_id, passed = report.passed, reason = %report.reason, forced, "reporting the acceptance check's result");
    let m = NodeMessage {
        body: Some(node_message::Body::Inventory(acceptance_section(&report))),
    };
    tx.send(m)
        .await
        .map_err(|_| End::Lost("send the acceptance check".into()))
}

/// Waits for `n`, or forever without one.
async fn notified(n: Option<&tokio::sync::Notify>) {
    match n {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// Polls the backend's health and sends what changed (a condition in force
/// is not raised again, and one the backend no longer sees is cleared), with
/// the node's status when it moves between ready and degraded.
async fn report_health(
    config: &DaemonConfig,
    stats: &DaemonStats,
    conditions: &std::sync::Mutex<Conditions>,
    gpus: usize,
    tx: &mpsc::Sender<NodeMessage>,
) -> Result<bool, End> {
    // Only changes are sent: a condition in force is not raised
    // again, and one the backend no longer sees is cleared.
    let polled = config.backend.poll_health().map_err(|e| e.to_string());
    let changes = conditions.lock().expect("conditions lock").observe(polled);
    let gpu_cleared = changes.iter().any(|c| c.cleared && c.device.is_some());
    if let Some(c) = changes.iter().find(|c| !c.cleared) {
        let detail = format!(
            "{} on {}",
            c.condition,
            c.device.as_deref().unwrap_or("the node")
        );
        if tx.send(status("degraded", detail)).await.is_err() {
            return Err(End::Lost("send status".into()));
        }
    } else if !changes.is_empty()
        && conditions
            .lock()
            .expect("conditions lock")
            .in_force()
            .is_empty()
    {
        // The last condition cleared: ready again.
        let ready = format!("{gpus} GPUs through {}", config.backend.name());
        if tx.send(status("ready", ready)).await.is_err() {
            return Err(End::Lost("send status".into()));
        }
    }
    for c in changes {
        if tx.send(health_message(c)).await.is_err() {
            return Err(End::Lost("send health".into()));
        }
        stats.health_reports.fetch_add(1, Ordering::Relaxed);
    }
    Ok(gpu_cleared)
}

/// Runs commands off the session loop, so heartbeats go on while one runs;
/// each id at most once. A result goes to whichever session is current when
/// the command finishes; if none is, the gateway pushes the command again on
/// the next session and gets the recorded result.
#[derive(Clone)]
struct Runner {
    executor: Arc<std::sync::Mutex<Executor>>,
    bindings: Arc<Bindings>,
    /// The last acceptance check, sent with the inventory a command changed.
    acceptance: Arc<std::sync::Mutex<crate::acceptance::Report>>,
    running: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    out: Arc<std::sync::Mutex<Option<mpsc::Sender<NodeMessage>>>>,
}

fn result_message(id: String, o: Outcome) -> NodeMessage {
    NodeMessage {
        body: Some(node_message::Body::Result(CommandResult {
            command_id: id,
            ok: o.ok,
            detail: o.detail,
            output_json: o.output.to_string(),
        })),
    }
}

/// Clears the runner's current session when a session ends.
struct CurrentSession<'a>(&'a Runner);

impl Drop for CurrentSession<'_> {
    fn drop(&mut self) {
        if let Ok(mut o) = self.0.out.lock() {
            *o = None;
        }
    }
}

impl Runner {
    fn new(
        executor: Executor,
        bindings: Bindings,
        acceptance: Arc<std::sync::Mutex<crate::acceptance::Report>>,
    ) -> Runner {
        Runner {
            executor: Arc::new(std::sync::Mutex::new(executor)),
            bindings: Arc::new(bindings),
            acceptance,
            running: Arc::default(),
            out: Arc::default(),
        }
    }

    fn attach(&self, tx: &mpsc::Sender<NodeMessage>) -> CurrentSession<'_> {
        *self.out.lock().expect("runner lock") = Some(tx.clone());
        CurrentSession(self)
    }

    /// Acks a command and, in the background, runs it unless it ran before
    /// or is running now. Nothing here waits on the disk: the command's
    /// record is written durably (an fsync) before it runs and after, and a
    /// disk that takes its time must not hold up the session's heartbeats,
    /// nor, where many daemons share a runtime, every other session.
    async fn handle(
        &self,
        config: &DaemonConfig,
        stats: &Arc<DaemonStats>,
        c: crate::proto::Command,
        tx: &mpsc::Sender<NodeMessage>,
    ) -> Result<(), mpsc::error::SendError<NodeMessage>> {
        tx.send(NodeMessage {
            body: Some(node_message::Body::Ack(CommandAck {
                command_id: c.id.clone(),
            })),
        })
        .await?;
        if !self
            .running
            .lock()
            .expect("runner lock")
            .insert(c.id.clone())
        {
            return Ok(());
        }
        let (me, config, stats) = (self.clone(), config.clone(), stats.clone());
        tokio::spawn(async move { me.run(&config, &stats, c).await });
        Ok(())
    }

    /// Records the command as started, runs it, records its result, and
    /// sends the result to the current session; a command recorded before
    /// is not run, its recorded result is sent again. The records and the
    /// command itself run in one trip to tokio's blocking threads: on a
    /// machine short of cores each trip waits its turn for one.
    async fn run(&self, config: &DaemonConfig, stats: &Arc<DaemonStats>, c: crate::proto::Command) {
        let (executor, bindings) = (self.executor.clone(), self.bindings.clone());
        let (backend, hook, stats) = (
            config.backend.clone(),
            config.on_finished.clone(),
            stats.clone(),
        );
        let (id, kind, args_json, deadline) = (
            c.id.clone(),
            c.kind.clone(),
            c.args_json.clone(),
            c.deadline_unix_ms,
        );
        let o = tokio::task::spawn_blocking(move || {
            let decision = executor.lock().expect("runner lock").begin(&id);
            match decision {
                Ok(Decision::Run) => {}
                Ok(Decision::Known(o)) => return o,
                Err(e) => {
                    return Outcome::failed(format!(
                        "could not record the command before running it: {e}"
                    ))
                }
            }
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            let o = if deadline > 0 && now > deadline {
                Outcome::failed("its deadline passed before it arrived; not run")
            } else {
                let args: serde_json::Value =
                    serde_json::from_str(&args_json).unwrap_or(serde_json::Value::Null);
                stats.commands_run.fetch_add(1, Ordering::Relaxed);
                Executor::run(&bindings, backend.as_ref(), &kind, &args)
            };
            if let Some(hook) = &hook {
                hook(&id);
            }
            if let Err(e) = executor.lock().expect("runner lock").finish(&id, &o) {
                tracing::error!(command = %id, error = %e, "could not record a command's result");
            }
            o
        })
        .await
        .unwrap_or_else(|e| Outcome::failed(format!("the command panicked: {e}")));
        self.running.lock().expect("runner lock").remove(&c.id);
        let out = self.out.lock().expect("runner lock").clone();
        if let Some(out) = out {
            // A command that changed the GPUs: the new inventory goes
            // first, so the log has the devices when it has the result.
            if o.ok && c.kind == "gpu.mig" {
                let report = self.acceptance.lock().expect("acceptance lock").clone();
                match inventory_section(config.backend.as_ref(), &report) {
                    Ok(section) => {
                        let m = NodeMessage {
                            body: Some(node_message::Body::Inventory(section)),
                        };
                        let _ = out.send(m).await;
                    }
                    Err(e) => {
                        tracing::error!(node = %config.node_id, error = %e, "cannot read the inventory a MIG change made")
                    }
                }
            }
            let id = c.id.clone();
            if out.send(result_message(c.id, o)).await.is_ok() {
                if let Some(hook) = &config.on_sent {
                    hook(&id);
                }
            }
        }
    }
}

/// Counts an open session while it lives.
struct Connected<'a>(&'a AtomicU64);

impl<'a> Connected<'a> {
    fn new(c: &'a AtomicU64) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        Connected(c)
    }
}

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_session_says_every_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "keep-alive timed out");
        let mut status = tonic::Status::unknown("transport error");
        status.set_source(Arc::new(io));
        match classify(status) {
            End::Lost(why) => {
                assert_eq!(why, "Unknown error: transport error: keep-alive timed out")
            }
            _ => panic!("not a lost session"),
        }
    }
}
