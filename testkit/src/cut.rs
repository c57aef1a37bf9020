//! A TCP proxy whose connections can be cut (the network failing under a
//! request that is in flight) or held (a link that goes silent: bytes
//! sent get no answer, no connection is refused or closed, new ones hang,
//! and a side that closes is not heard by the other), or taken down (every
//! connection dropped and new ones refused, as a server that died), or
//! slowed (every byte delivered a fixed time after it was read, both ways:
//! a long link, or a peer that always answers late).

use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct Cut {
    pub addr: std::net::SocketAddr,
    upstream: std::net::SocketAddr,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// The accepting task; none while the link is down.
    accept: Mutex<Option<JoinHandle<()>>>,
    held: watch::Sender<bool>,
    /// How late every byte is delivered.
    latency: watch::Sender<Duration>,
}

/// Copies `from` to `to`, holding what it read while `held` says so and
/// delivering it `latency` after it was read. A side that closes while the
/// link is held is not passed on until the link is let go: over a silent
/// link the other end hears nothing, not even a close.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut held: watch::Receiver<bool>,
    latency: watch::Receiver<Duration>,
) {
    // Read on, deliver when due: a later chunk never overtakes an earlier.
    // Both halves are this future's, so a connection cut drops them both.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let delivering = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    let reading = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    let _ = held.wait_for(|h| !*h).await;
                    return;
                }
                Ok(n) => n,
            };
            if held.wait_for(|h| !*h).await.is_err() {
                return;
            }
            let due = tokio::time::Instant::now() + *latency.borrow();
            if tx.send((due, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    tokio::pin!(delivering);
    tokio::select! {
        _ = &mut delivering => return,
        _ = reading => {}
    }
    // What was read before the end is still delivered.
    delivering.await;
}

/// Accepts connections on `listener` and forwards each to `upstream`.
fn accepting(
    listener: TcpListener,
    upstream: std::net::SocketAddr,
    open: Arc<Mutex<Vec<JoinHandle<()>>>>,
    hold: watch::Receiver<bool>,
    latency: watch::Receiver<Duration>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let (hold, latency) = (hold.clone(), latency.clone());
            let task = tokio::spawn(async move {
                let mut h = hold.clone();
                if h.wait_for(|h| !*h).await.is_err() {
                    return;
                }
                if let Ok(up) = TcpStream::connect(upstream).await {
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::select! {
                        _ = pump(dr, uw, hold.clone(), latency.clone()) => {}
                        _ = pump(ur, dw, hold, latency) => {}
                    }
                }
            });
            open.lock().unwrap().push(task);
        }
    })
}

impl Cut {
    /// Forwards every connection made to [`Cut::addr`] to `upstream`.
    pub async fn to(upstream: std::net::SocketAddr) -> Cut {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (held, _) = watch::channel(false);
        let (latency, _) = watch::channel(Duration::ZERO);
        let accept = accepting(
            listener,
            upstream,
            conns.clone(),
            held.subscribe(),
            latency.subscribe(),
        );
        Cut {
            addr,
            upstream,
            conns,
            accept: Mutex::new(Some(accept)),
            held,
            latency,
        }
    }

    /// A link to the PostgreSQL server `direct` names (its first port on
    /// 127.0.0.1), and the configuration that reaches it through the link:
    /// built from a URL, since a `Config` given a second host and port
    /// keeps trying the first.
    pub async fn to_postgres(direct: &tokio_postgres::Config) -> (Cut, tokio_postgres::Config) {
        let link = Cut::to(
            format!("127.0.0.1:{}", direct.get_ports()[0])
                .parse()
                .unwrap(),
        )
        .await;
        let through = format!(
            "postgres://{}@{}/{}",
            direct.get_user().unwrap_or("postgres"),
            link.addr,
            direct.get_dbname().unwrap_or("postgres")
        )
        .parse()
        .unwrap();
        (link, through)
    }

    /// Drops every connection and refuses new ones (the port closed), as a
    /// server that died, until [`Cut::up`]; returns once the connections
    /// are closed.
    pub async fn down(&self) {
        let accept = self.accept.lock().unwrap().take();
        if let Some(accept) = accept {
            accept.abort();
            let _ = accept.await;
        }
        let open: Vec<_> = std::mem::take(&mut *self.conns.lock().unwrap());
        for t in open {
            t.abort();
            let _ = t.await;
        }
    }

    /// Takes connections again, on the same address, after [`Cut::down`].
    pub async fn up(&self) {
        let listener = TcpListener::bind(self.addr).await.unwrap();
        let accept = accepting(
            listener,
            self.upstream,
            self.conns.clone(),
            self.held.subscribe(),
            self.latency.subscribe(),
        );
        *self.accept.lock().unwrap() = Some(accept);
    }

    /// Holds every byte, both ways, on every connection (open and new)
    /// until [`Cut::release`].
    pub fn hold(&self) {
        self.held.send_replace(true);
    }

    /// Delivers every byte read from now on `latency` after it was read,
    /// both ways, on every connection (open and new).
    pub fn slow(&self, latency: Duration) {
        self.latency.send_replace(latency);
    }

    /// Lets bytes through again.
    pub fn release(&self) {
        self.held.send_replace(false);
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Drops every connection open now, both ways; new ones go through.
    pub fn cut(&self) -> usize {
        let open: Vec<_> = std::mem::take(&mut *self.conns.lock().unwrap());
        let n = open.iter().filter(|t| !t.is_finished()).count();
        for t in open {
            t.abort();
        }
        n
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        if let Some(accept) = self.accept.lock().unwrap().take() {
            accept.abort();
        }
        self.cut();
    }
}
