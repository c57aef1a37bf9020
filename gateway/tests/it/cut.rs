//! A TCP proxy whose connections can be cut: the network failing under a
//! request that is in flight.

use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct Cut {
    pub addr: std::net::SocketAddr,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Cut {
    /// Forwards every connection made to [`Cut::addr`] to `upstream`.
    pub async fn to(upstream: std::net::SocketAddr) -> Cut {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let held = conns.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let task = tokio::spawn(async move {
                    if let Ok(mut up) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                held.lock().unwrap().push(task);
            }
        });
        Cut {
            addr,
            conns,
            accept,
        }
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
        self.accept.abort();
        self.cut();
    }
}
