//! The peer event store of `bench append`: Message DB, installed into the
//! benchmark's own cluster at bench time.
//!
//! Its SQL is the npm package `@eventide/message-db`; it is fetched with
//! `npm pack` into a temporary folder and installed with the package's own
//! `database/install.sh` (which runs `psql` and `createdb` against the
//! cluster). Nothing of it is kept in this repository. Without `npm`, or if
//! the fetch fails (no network), the peer is skipped and the reason is
//! reported.
//!
//! Each writer holds its own connection (Message DB is called one
//! statement per message, `message_store.write_message`, with the expected
//! version) and writes to a stream of its own category: a category's writes
//! take one advisory lock, so writers sharing a category would queue on it.
//! That is Message DB's best case.

use crate::writers::Phase;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Config;

/// The database the package installs into.
const DATABASE: &str = "message_store";

/// Installs Message DB into the cluster `cfg` points at and returns the
/// configuration of its database, or why it could not.
pub(crate) fn install(cfg: &Config, bindir: &Path) -> Result<Config, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("a temporary folder: {e}"))?;
    let npm = Command::new("npm")
        .args(["pack", "@eventide/message-db", "--silent"])
        .current_dir(dir.path())
        .output();
    let out = match npm {
        Err(e) => return Err(format!("npm is not available ({e})")),
        Ok(o) if !o.status.success() => {
            return Err(format!(
                "npm pack @eventide/message-db failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
        Ok(o) => o,
    };
    let tarball = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string();
    let unpack = Command::new("tar")
        .args(["xzf", &tarball])
        .current_dir(dir.path())
        .status()
        .map_err(|e| format!("tar: {e}"))?;
    if !unpack.success() {
        return Err(format!("could not unpack {tarball}"));
    }
    let version = std::fs::read_to_string(dir.path().join("package/database/VERSION.txt"))
        .unwrap_or_default();
    let (host, port, user) = parts(cfg).map_err(|e| e.to_string())?;
    let path = format!(
        "{}:{}",
        bindir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let installed = Command::new("bash")
        .arg(dir.path().join("package/database/install.sh"))
        .env("PATH", path)
        .env("PGHOST", &host)
        .env("PGPORT", &port)
        .env("PGUSER", &user)
        .env("DATABASE_NAME", DATABASE)
        .output()
        .map_err(|e| format!("run install.sh: {e}"))?;
    if !installed.status.success() {
        return Err(format!(
            "Message DB's install.sh failed: {}",
            String::from_utf8_lossy(&installed.stderr).trim()
        ));
    }
    eprintln!("Message DB {} installed from npm", version.trim());
    let mut c = cfg.clone();
    c.dbname(DATABASE);
    c.options("-c search_path=message_store,public");
    Ok(c)
}

fn parts(cfg: &Config) -> Result<(String, String, String)> {
    let host = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => bail!("the benchmark cluster listens on TCP"),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432).to_string();
    Ok((host, port, cfg.get_user().unwrap_or("postgres").into()))
}

static RUN: AtomicU64 = AtomicU64::new(0);

/// `writers` connections, each writing one message at a time to a stream of
/// its own with the expected version; the rate of acknowledged writes.
pub(crate) async fn appends(cfg: &Config, writers: usize, secs: Duration) -> Result<Phase> {
    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let client = events::db::connect(cfg, "message-db")
            .await
            .context("connect to Message DB's database")?;
        let (count, stop) = (count.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let stmt = client
                .prepare(
                    "SELECT message_store.write_message($1, $2, 'BenchAppended', $3, NULL, $4)",
                )
                .await?;
            // The category is the part before the first '-': one per writer.
            let stream = format!("bench{run}x{w}-1");
            let mut expected = -1i64;
            while !stop.load(Ordering::Relaxed) {
                let id = uuid();
                let data = crate::writers::payload(expected as u64);
                client
                    .query_one(&stmt, &[&id, &stream, &data, &expected])
                    .await?;
                expected += 1;
                count.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    let label = format!("Message DB {writers} writers: ");
    let (phase, _) =
        crate::writers::timed(count, stop, None, tasks, secs, &label, "writers").await?;
    Ok(phase)
}

fn uuid() -> String {
    let (a, b) = (fastrand::u64(..), fastrand::u64(..));
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        (b >> 48) & 0x3fff | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_version_4_uuids() {
        for _ in 0..1000 {
            let id = super::uuid();
            let groups: Vec<&str> = id.split('-').collect();
            assert_eq!(
                groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
                [8, 4, 4, 4, 12]
            );
            assert!(groups[2].starts_with('4'), "{id}");
            assert!(matches!(&groups[3][..1], "8" | "9" | "a" | "b"), "{id}");
        }
    }
}
