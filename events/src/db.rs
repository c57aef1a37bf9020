//! A shared, self-healing SQL connection: handed out as `Arc<Client>`, made
//! again on the next call after it closes.

use std::sync::Arc;
use tokio::sync::Mutex;
use tokio_postgres::{Client, Config, NoTls};

/// Connects to `config` and drives the connection in a named task.
pub async fn connect(config: &Config, task: &'static str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    crate::task::spawn(task, async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "connection closed");
        }
    });
    Ok(client)
}

/// A lazily made connection shared by the tasks of one reader.
pub struct Db {
    pub config: Config,
    client: Mutex<Option<Arc<Client>>>,
}

impl Db {
    pub fn new(config: Config) -> Self {
        Db {
            config,
            client: Mutex::new(None),
        }
    }

    /// The current connection, connecting first if there is none or it closed.
    pub async fn get(&self) -> Result<Arc<Client>, tokio_postgres::Error> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let c = Arc::new(connect(&self.config, "db-connection").await?);
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Forgets the current connection (one that stopped answering), so the
    /// next [`Db::get`] connects afresh.
    pub async fn reset(&self) {
        self.client.lock().await.take();
    }
}
