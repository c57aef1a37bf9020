//! A region of one `serve` (gateway, placer, binder), pool `p` and one real
//! node daemon `n1` of 8 simulated H100s: what the container and fault
//! tests run against.

use super::gateway::{ca_pool_and_token, free_port, query, Killed};
use super::{database, ok, spawn};
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A region of one `serve` (gateway, placer, binder) and pool `p`.
pub(crate) struct Region {
    pub dir: tempfile::TempDir,
    pub url: String,
    /// The serve's metrics endpoint.
    pub metrics: String,
    gateway: String,
    token: String,
    _serve: Killed,
}

pub(crate) fn region() -> Region {
    region_with("gateway,placer,binder", &[])
}

/// A region whose `serve` runs `roles` with `extra` options.
pub(crate) fn region_with(roles: &str, extra: &[&str]) -> Region {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    let ca_s = ca.to_str().unwrap();
    let token = ca_pool_and_token(&url, ca_s);
    let listen = format!("127.0.0.1:{}", free_port());
    // Slots are the cluster's: one per test's database.
    let slot = format!("containers_{}", url.rsplit('/').next().unwrap());
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = vec![
        "serve",
        "--roles",
        roles,
        "--database-url",
        &url,
        "--listen",
        &listen,
        "--ca-dir",
        ca_s,
        "--slot",
        &slot,
        "--metrics-listen",
        &metrics,
    ];
    args.extend_from_slice(extra);
    let serve = Killed(spawn(&args, &dir.path().join("serve.log")));
    Region {
        dir,
        url,
        metrics,
        gateway: format!("https://{listen}"),
        token,
        _serve: serve,
    }
}

impl Region {
    pub(crate) fn cdi(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    pub(crate) fn node_dir(&self) -> PathBuf {
        self.dir.path().join("n1")
    }

    /// Starts node `n1` (8 simulated H100s, `/dev/null` standing in for
    /// their device nodes), with `env` set.
    pub(crate) fn node(&self, env: &[(&str, &str)]) -> Killed {
        self.node_with(env, &[])
    }

    /// Starts node `n1` with `env` set and `extra` options.
    pub(crate) fn node_with(&self, env: &[(&str, &str)], extra: &[&str]) -> Killed {
        self.node_of("8xH100-80GB", env, extra)
    }

    /// Starts node `n1` with the fake GPUs `spec`, `env` set and `extra`
    /// options.
    pub(crate) fn node_of(&self, spec: &str, env: &[(&str, &str)], extra: &[&str]) -> Killed {
        let ca = self.dir.path().join("ca/ca.pem");
        let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
        c.args([
            "node",
            "--gateway",
            &self.gateway,
            "--data-dir",
            self.node_dir().to_str().unwrap(),
            "--node-id",
            "n1",
            "--token",
            &self.token,
            "--ca",
            ca.to_str().unwrap(),
            "--fake-gpus",
            spec,
            "--fake-device-node",
            "/dev/null",
            "--cdi-dir",
            self.cdi().to_str().unwrap(),
        ])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.path().join("node.log"))
                .unwrap(),
        );
        for (k, v) in env {
            c.env(k, v);
        }
        Killed(c.spawn().unwrap())
    }

    pub(crate) fn wait_until(&self, secs: u64, what: &str, f: impl FnMut() -> bool) {
        testkit::wait_until(secs, what, f, || {
            for log in ["serve.log", "node.log"] {
                let text = std::fs::read_to_string(self.dir.path().join(log)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(20).collect();
                eprintln!("--- {log} (last lines, newest first)\n{}", tail.join("\n"));
            }
        })
    }

    pub(crate) fn wait_for_gpus(&self) {
        self.wait_until(60, "the node's GPUs are in the pool", || {
            !query(
                &self.url,
                "SELECT 1::text FROM strata.events WHERE stream = 'pool/p' AND type = 'node.joined'",
            )
            .is_empty()
        });
    }

    pub(crate) fn reserve(&self, id: &str, gpus: u32) {
        self.reserve_with(id, gpus, &[]);
    }

    /// `reserve` with `extra` options.
    pub(crate) fn reserve_with(&self, id: &str, gpus: u32, extra: &[&str]) {
        self.reserve_class(id, "H100-80GB", gpus, extra);
    }

    /// `reserve` of `gpus` devices of `class`, with `extra` options.
    pub(crate) fn reserve_class(&self, id: &str, class: &str, gpus: u32, extra: &[&str]) {
        let gpus = gpus.to_string();
        let mut args = vec![
            "reserve",
            "--database-url",
            &self.url,
            "--pool",
            "p",
            "--class",
            class,
            "--gpus",
            &gpus,
            "--id",
            id,
        ];
        args.extend_from_slice(extra);
        ok(&args);
    }

    /// `strata fault` into node `n1`, with `args`.
    pub(crate) fn fault(&self, args: &[&str]) {
        let dir = self.node_dir();
        let mut all = vec!["fault", "--data-dir", dir.to_str().unwrap()];
        all.extend_from_slice(args);
        ok(&all);
    }

    /// Events of `types` on the pool's stream, as (type, payload).
    pub(crate) fn pool_events(&self, types: &[&str]) -> Vec<(String, serde_json::Value)> {
        let list = types
            .iter()
            .map(|t| format!("'{t}'"))
            .collect::<Vec<_>>()
            .join(",");
        query(
            &self.url,
            &format!(
                "SELECT type, payload::text FROM strata.events WHERE stream = 'pool/p' AND type IN ({list}) ORDER BY position"
            ),
        )
        .into_iter()
        .map(|r| (r[0].clone(), serde_json::from_str(&r[1]).unwrap()))
        .collect()
    }

    /// `nodes show n1 --output json`.
    pub(crate) fn node_shown(&self) -> serde_json::Value {
        let out = ok(&[
            "nodes",
            "show",
            "n1",
            "--database-url",
            &self.url,
            "--output",
            "json",
        ]);
        serde_json::from_str(&out).unwrap()
    }

    /// `reservations show --output json`.
    pub(crate) fn show(&self, id: &str) -> serde_json::Value {
        let out = ok(&[
            "reservations",
            "show",
            id,
            "--database-url",
            &self.url,
            "--output",
            "json",
        ]);
        serde_json::from_str(&out).unwrap()
    }

    pub(crate) fn phase(&self, id: &str) -> String {
        self.show(id)["phase"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// The CDI spec files of Strata's bindings in the node's CDI folder.
    pub(crate) fn specs(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.cdi())
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|f| f.starts_with("strata-reservation-"))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }
}
