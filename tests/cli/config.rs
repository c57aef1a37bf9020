//! `strata serve --config FILE` and `strata config check`: a real `serve`
//! reads its database, metrics address and slot from a file, a flag wins
//! over the file and a `STRATA_*` variable does too; the examples under
//! `deploy/` check clean; a bad file is refused naming the key.

use super::gateway::{free_port, query, Killed};
use super::{database, http_get, spawn};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `strata` with no `STRATA_*` variable but those in `env`.
fn strata_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    for (k, _) in std::env::vars() {
        if k.starts_with("STRATA_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run strata")
}

fn check_json(file: &Path, env: &[(&str, &str)]) -> serde_json::Value {
    let out = strata_env(&["config", "check", "--json", file.to_str().unwrap()], env);
    assert!(
        out.status.success(),
        "config check {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn the_example_configs_check_and_the_unit_runs_them() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let mut seen = 0;
    for e in std::fs::read_dir(root.join("strata")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let v = check_json(&p, &[]);
            assert_eq!(v["ok"], true);
            assert_eq!(v["settings"]["roles"]["source"], "file", "{}", p.display());
            let slot = v["settings"]["slot"]["value"].as_str().unwrap();
            assert!(slot.contains("{host}"), "one file for every host: {slot}");
            seen += 1;
        }
    }
    assert!(seen >= 4, "control, gateway, sinks and audit examples");
    let unit = std::fs::read_to_string(root.join("systemd/strata@.service")).unwrap();
    assert!(
        unit.contains("serve --config /etc/strata/%i.toml"),
        "{unit}"
    );
    assert!(unit.contains("config check /etc/strata/%i.toml"), "{unit}");
}

#[test]
fn a_bad_file_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "unknown.toml",
            "database_url = \"postgres://x/y\"\nmax_bacth = 3\n",
            "`max_bacth`",
        ),
        (
            "value.toml",
            "database_url = \"postgres://x/y\"\nlease_ttl = \"soon\"\n",
            "`lease_ttl`",
        ),
        (
            "role.toml",
            "database_url = \"postgres://x/y\"\nroles = [\"placr\"]\n",
            "placr",
        ),
        (
            "list.toml",
            "database_url = \"postgres://x/y\"\nslot = [\"a\", \"b\"]\n",
            "`slot` takes one value",
        ),
        ("syntax.toml", "database_url = \n", "syntax.toml"),
        (
            "no_db.toml",
            "roles = [\"placer\"]\n",
            "database_url is not set",
        ),
    ];
    for (name, text, says) in cases {
        let p = write(dir.path(), name, text);
        for args in [
            vec!["config", "check", p.to_str().unwrap()],
            vec!["serve", "--config", p.to_str().unwrap()],
        ] {
            let out = strata_env(&args, &[]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(err.contains(says), "{args:?} should say {says}: {err}");
        }
    }
}

#[test]
fn serve_reads_its_settings_from_a_file_and_flags_and_variables_win() {
    let url = database();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let file = write(
        dir.path(),
        "strata.toml",
        &format!(
            "database_url = \"{url}\"\nroles = [\"binder\"]\nmetrics-listen = \"127.0.0.1:{port}\"\n\
             slot = \"file_{{host}}\"\nregion = \"from_file\"\nstatement_timeout = \"20s\"\n"
        ),
    );
    // What check says: the file, a variable over it, the defaults.
    let v = check_json(&file, &[("STRATA_REGION", "from_env")]);
    let s = &v["settings"];
    assert_eq!(s["region"]["value"], "from_env");
    assert_eq!(s["region"]["source"], "env");
    assert_eq!(s["statement_timeout"]["value"], "20s");
    assert_eq!(s["statement_timeout"]["source"], "file");
    assert_eq!(s["metrics_listen"]["source"], "file");
    assert_eq!(s["max_batch"]["source"], "default");

    // A real serve: the database and the metrics address from the file,
    // the slot from the command line.
    let log = dir.path().join("serve.log");
    let _serve = Killed(spawn(
        &[
            "serve",
            "--config",
            file.to_str().unwrap(),
            "--slot",
            "from_flag",
        ],
        &log,
    ));
    let at = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while http_get(&at, "/readyz").0 != 200 {
        assert!(
            Instant::now() < deadline,
            "serve --config never became ready on the file's metrics address: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let slots = query(&url, "SELECT slot_name::text FROM pg_replication_slots WHERE active AND database = current_database()");
    assert!(
        slots.iter().any(|r| r[0] == "from_flag"),
        "the flag's slot is the one streaming: {slots:?}"
    );
    assert!(
        !slots.iter().any(|r| r[0].starts_with("file_")),
        "the file's slot was overridden: {slots:?}"
    );
}
