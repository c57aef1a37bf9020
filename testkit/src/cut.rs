//! A TCP proxy whose connections can be cut (the network failing under a
//! request that is in flight) or held (a link that goes silent: bytes
//! sent get no answer, no connection is refused or closed, new ones hang,
//! and a side that closes is not heard by the other), or taken down (every
//! connection dropped and new ones refused, as a server that died).

use std::sync::{Arc, Mutex};
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
}

/// Copies `from` to `to`, holding what it read while `held` says so. A
/// side that closes while the link is held is not passed on until the link
/// is let go: over a silent link the other end hears nothing, not even a
/// close.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut held: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = held.wait_for(|h| !*h).await;
                return;
            }
            Ok(n) => n,
        };
        if held.wait_for(|h| !*h).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Accepts connections on `listener` and forwards each to `upstream`.
fn accepting(
    listener: TcpListener,
    upstream: std::net::SocketAddr,
    open: Arc<Mutex<Vec<JoinHandle<()>>>>,
    hold: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let hold = hold.clone();
            let task = tokio::spawn(async move {
                let mut h = hold.clone();
                if h.wait_for(|h| !*h).await.is_err() {
                    return;
                }
                if let Ok(up) = TcpStream::connect(upstream).await {
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::select! {
                        _ = pump(dr, uw, hold.clone()) => {}
                        _ = pump(ur, dw, hold) => {}
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
        let accept = accepting(listener, upstream, conns.clone(), held.subscribe());
        Cut {
            addr,
            upstream,
            conns,
            accept: Mutex::new(Some(accept)),
            held,
        }
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
        );
        *self.accept.lock().unwrap() = Some(accept);
    }

    /// Holds every byte, both ways, on every connection (open and new)
    /// until [`Cut::release`].
    pub fn hold(&self) {
        self.held.send_replace(true);
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
