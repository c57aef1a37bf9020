//! The audit endpoint against a real Postgres, with psql and tokio-postgres
//! as auditors: SCRAM passwords and client certificates over TLS, the simple
//! and the extended protocol, refused writes, DDL, side effects and relations
//! outside the audit set, and every query recorded in the log.

mod hostile;
mod invariants;
mod seals;

use audit::{AuditConfig, TlsFiles};
use events::{Appender, AppenderConfig, ExpectedVersion, NewEvent};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

struct Env {
    url: String,
    db: tokio_postgres::Client,
    endpoint: audit::Endpoint,
    ca_dir: tempfile::TempDir,
    psql: PathBuf,
}

static ROLE: AtomicU32 = AtomicU32::new(0);

async fn connect(url: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c
}

/// A migrated database with a few events, alice (password) and bob
/// (certificate only), and an endpoint without TLS (plain TCP is then
/// served).
async fn env() -> Env {
    env_with(|c| c.tls = None).await
}

/// The same with TLS from a fresh CA: nothing is served without it.
async fn env_tls() -> Env {
    env_with(|_| {}).await
}

async fn env_with(adjust: impl FnOnce(&mut AuditConfig)) -> Env {
    let cluster = testkit::shared_cluster();
    let url = testkit::migrated_database(cluster).await;
    let db = connect(&url).await;
    let cfg: tokio_postgres::Config = url.parse().unwrap();
    let appender = Appender::start(cfg.clone(), AppenderConfig::default());
    for i in 0..5u64 {
        appender
            .append(
                "pool/a",
                ExpectedVersion::Exact(i),
                vec![NewEvent::new("pool.test", &serde_json::json!({ "i": i }))],
            )
            .await
            .unwrap();
    }
    audit::accounts::add(&db, "alice", Some("correct horse"))
        .await
        .unwrap();
    audit::accounts::add(&db, "bob", None).await.unwrap();
    audit::accounts::add(&db, "dave", Some("daves-secret"))
        .await
        .unwrap();
    audit::accounts::add(&db, "carol", Some("carols-secret"))
        .await
        .unwrap();
    audit::accounts::revoke(&db, "carol").await.unwrap();

    let ca_dir = tempfile::tempdir().unwrap();
    gateway::ca::init(ca_dir.path(), "test").unwrap();
    let ca = gateway::ca::Ca::load(ca_dir.path()).unwrap();
    let (cert_pem, key_pem) = ca
        .server_identity(&["localhost".into(), "127.0.0.1".into()])
        .unwrap();
    let mut config = AuditConfig::new(cfg.clone());
    // Roles belong to the cluster: one per test keeps tests apart.
    let role = format!(
        "strata_audit_t{}_{}",
        std::process::id(),
        ROLE.fetch_add(1, Ordering::Relaxed)
    );
    config.role = role;
    config.tls = Some(TlsFiles {
        cert_pem,
        key_pem,
        client_ca_pem: Some(ca.cert_pem().to_string()),
    });
    adjust(&mut config);
    let endpoint = audit::start("127.0.0.1:0".parse().unwrap(), config, appender)
        .await
        .unwrap();
    Env {
        url,
        db,
        endpoint,
        psql: cluster.bindir().join("psql"),
        ca_dir,
    }
}

impl Env {
    fn auditor_url(&self, user: &str, password: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password='{password}' dbname=audit sslmode=disable",
            self.endpoint.addr.port()
        )
    }

    async fn auditor(&self, user: &str, password: &str) -> tokio_postgres::Client {
        connect(&self.auditor_url(user, password)).await
    }

    async fn recorded(&self, auditor: &str) -> Vec<String> {
        self.db
            .query(
                "SELECT payload->>'sql' FROM strata.events
                  WHERE stream = $1 AND type = 'audit.query_recorded' ORDER BY position",
                &[&format!("auditor/{auditor}")],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    fn psql(&self, conninfo: &str, sql: &str, password: Option<&str>) -> (bool, String, String) {
        let mut cmd = Command::new(&self.psql);
        cmd.arg(conninfo)
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .env_remove("PGPASSWORD");
        if let Some(p) = password {
            cmd.env("PGPASSWORD", p);
        }
        let out = cmd.output().expect("run psql");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn tls_conninfo(&self, user: &str, cert: Option<(&Path, &Path)>) -> String {
        let mut s = format!(
            "host=127.0.0.1 port={} user={user} dbname=audit sslmode=verify-full sslrootcert={}",
            self.endpoint.addr.port(),
            self.ca_dir.path().join("ca.pem").display()
        );
        if let Some((c, k)) = cert {
            s.push_str(&format!(" sslcert={} sslkey={}", c.display(), k.display()));
        }
        s
    }
}

/// Events on pool/a, as `client` sees them.
async fn pool_a(client: &impl tokio_postgres::GenericClient) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM strata.events WHERE stream = 'pool/a'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

fn code(e: &tokio_postgres::Error) -> String {
    e.code().map(|c| c.code().to_string()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_protocol_reads_the_audit_set_and_is_recorded() {
    let env = env().await;
    let a = env.auditor("alice", "correct horse").await;

    // Parameters and results in binary, both ways through the endpoint.
    let rows = a
        .query(
            "SELECT position, version, type, payload FROM strata.events
              WHERE stream = $1 AND version >= $2 ORDER BY position",
            &[&"pool/a", &2i64],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 4);
    let payload: serde_json::Value = rows[0].get(3);
    assert_eq!(payload, serde_json::json!({ "i": 1 }));
    assert_eq!(rows[0].get::<_, String>(2), "pool.test");

    // The partitions, the seal tables and the views are readable.
    let parts = a
        .query("SELECT partition FROM audit.partitions", &[])
        .await
        .unwrap();
    assert!(!parts.is_empty());
    let month: String = parts[0].get(0);
    let n: i64 = a
        .query_one(&format!("SELECT count(*) FROM strata.{month}"), &[])
        .await
        .unwrap()
        .get(0);
    assert!(n >= 0);
    a.query("SELECT * FROM strata.seals", &[]).await.unwrap();
    a.query("SELECT * FROM audit.checkpoints", &[])
        .await
        .unwrap();

    // A transaction of the auditor's: one snapshot for both statements.
    let mut a = a;
    let tx = a.transaction().await.unwrap();
    let c1 = pool_a(&tx).await;
    env.db
        .batch_execute(
            "SELECT 1", // the log grows meanwhile through the appender below
        )
        .await
        .unwrap();
    let app = Appender::start(
        env.url.parse::<tokio_postgres::Config>().unwrap(),
        AppenderConfig::default(),
    );
    app.append(
        "pool/a",
        ExpectedVersion::Any,
        vec![NewEvent::new("pool.test", &serde_json::json!({ "i": 99 }))],
    )
    .await
    .unwrap();
    let c2 = pool_a(&tx).await;
    assert_eq!(c1, c2, "one snapshot inside the auditor's transaction");
    tx.commit().await.unwrap();
    let c3 = pool_a(&a).await;
    assert_eq!(c3, c1 + 1);

    let recorded = env.recorded("alice").await;
    assert!(
        recorded
            .iter()
            .any(|s| s.contains("WHERE stream = $1 AND version >= $2")),
        "{recorded:?}"
    );
    let params: serde_json::Value = env
        .db
        .query_one(
            "SELECT payload->'parameters' FROM strata.events
              WHERE stream = 'auditor/alice' AND payload->>'sql' LIKE '%version >= $2%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(params.as_array().map(Vec::len), Some(2));
    assert!(recorded.len() >= 8, "{recorded:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_parsed_again_is_described_from_memory_and_runs_recorded_each_time() {
    let env = env().await;
    let a = env.auditor("alice", "correct horse").await;
    // What the auditor's PostgreSQL process was last sent.
    let last = || async {
        env.db
            .query_one(
                "SELECT query FROM pg_stat_activity
                  WHERE datname = current_database() AND application_name = 'strata-audit'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, String>(0)
    };
    let sql = "SELECT count(*) FROM strata.events WHERE stream = $1";
    let first = a.prepare(sql).await.unwrap();
    assert_eq!(last().await, sql, "described by PostgreSQL the first time");
    let n: i64 = a.query_one(&first, &[&"pool/a"]).await.unwrap().get(0);
    assert_eq!(n, 5);
    let after_run = last().await;
    let again = a.prepare(sql).await.unwrap();
    assert_eq!(
        last().await,
        after_run,
        "a statement this session described before is not sent to PostgreSQL to be described again"
    );
    assert_eq!(again.params(), first.params());
    assert_eq!(again.columns().len(), 1);
    assert_eq!(again.columns()[0].type_(), first.columns()[0].type_());
    let n: i64 = a.query_one(&again, &[&"pool/a"]).await.unwrap().get(0);
    assert_eq!(n, 5);
    // Each run is recorded.
    let runs: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM strata.events
              WHERE stream = 'auditor/alice' AND payload->>'sql' = $1",
            &[&sql],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(runs, 2);
    // A statement PostgreSQL refuses is refused each time: only accepted
    // ones are remembered.
    for _ in 0..2 {
        let e = a
            .prepare("SELECT no_such_column FROM strata.events")
            .await
            .unwrap_err();
        assert_eq!(code(&e), "42703", "{e:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_ddl_side_effects_and_other_relations_are_refused() {
    let env = env().await;
    let a = env.auditor("alice", "correct horse").await;
    let before: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM strata.events WHERE stream = 'pool/a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    let e = a
        .execute(
            "INSERT INTO strata.events (position, stream, version, type, payload)
             VALUES (100000, 'pool/a', 100, 'forged', '{}')",
            &[],
        )
        .await
        .unwrap_err();
    assert!(["42501", "25006"].contains(&code(&e).as_str()), "{e:?}");
    let e = a
        .execute("UPDATE strata.events SET payload = '{}'", &[])
        .await
        .unwrap_err();
    assert!(["42501", "25006"].contains(&code(&e).as_str()), "{e:?}");
    let e = a
        .execute("DELETE FROM strata.seals", &[])
        .await
        .unwrap_err();
    assert!(["42501", "25006"].contains(&code(&e).as_str()), "{e:?}");
    let e = a
        .batch_execute("CREATE TABLE audit.mine (a int)")
        .await
        .unwrap_err();
    assert!(["42501", "25006"].contains(&code(&e).as_str()), "{e:?}");
    // Relations outside the audit set.
    for rel in [
        "strata.auditors",
        "strata.join_tokens",
        "strata.subscriptions",
        "strata.streams",
    ] {
        let e = a
            .query(&format!("SELECT * FROM {rel}"), &[])
            .await
            .unwrap_err();
        assert_eq!(code(&e), "42501", "{rel}: {e:?}");
    }
    // Functions with side effects: refused by privilege, or undone with
    // the statement's transaction.
    for f in [
        "SELECT pg_reload_conf()",
        "SELECT pg_read_file('postgresql.conf')",
    ] {
        let e = a.query(f, &[]).await.unwrap_err();
        assert_eq!(code(&e), "42501", "{f}: {e:?}");
    }
    // Large objects persist whatever the transaction's read-only mode, and
    // an advisory lock held would stop migrations: no audit role may
    // execute either.
    for f in [
        "SELECT lo_create(0)",
        "SELECT lo_from_bytea(0, 'x')",
        "SELECT pg_advisory_lock(4242)",
        "SELECT pg_try_advisory_xact_lock(4242)",
    ] {
        let e = a.query(f, &[]).await.unwrap_err();
        assert_eq!(code(&e), "42501", "{f}: {e:?}");
    }
    let e = a
        .query(
            "SELECT set_config('transaction_read_only', 'off', true)",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(code(&e), "25001", "{e:?}");
    // Ending the endpoint's transaction inside a query string buys nothing:
    // every statement runs on its own, in its own read-only transaction.
    let e = a
        .simple_query(
            "COMMIT; SET default_transaction_read_only = off; SET transaction_read_only = off; \
             DELETE FROM strata.events",
        )
        .await
        .unwrap_err();
    assert!(
        ["42501", "25006", "25001", "0A000"].contains(&code(&e).as_str()),
        "{e:?}"
    );
    // COPY is not offered; the session goes on.
    let e = a
        .simple_query("COPY (SELECT * FROM strata.events) TO STDOUT")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "0A000", "{e:?}");
    // The session is usable after every refusal.
    let n = pool_a(&a).await;
    assert_eq!(n, before);
    let after: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM strata.events WHERE stream = 'pool/a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(after, before, "nothing was written");
    // The refused attempts were recorded too.
    let recorded = env.recorded("alice").await;
    assert!(recorded
        .iter()
        .any(|s| s.starts_with("INSERT INTO strata.events")));
    assert!(recorded.iter().any(|s| s == "DELETE FROM strata.seals"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_are_checked_and_revoked_auditors_refused() {
    let env = env().await;
    for (user, pw) in [
        ("alice", "wrong"),
        ("nobody", "x"),
        ("carol", "carols-secret"),
        ("bob", ""),
    ] {
        let r = tokio_postgres::connect(&env.auditor_url(user, pw), tokio_postgres::NoTls).await;
        let e = r.err().unwrap_or_else(|| panic!("{user} got in"));
        assert_eq!(code(&e), "28P01", "{user}: {e:?}");
    }
    // Nothing was recorded for them; the refusals are counted.
    assert!(env.recorded("carol").await.is_empty());
    use std::sync::atomic::Ordering::Relaxed;
    let stats = &env.endpoint.stats;
    assert_eq!(stats.logins_refused.load(Relaxed), 4);
    assert_eq!(stats.logins.load(Relaxed), 0);
    let a = env.auditor("alice", "correct horse").await;
    a.simple_query("SELECT 1; SELECT * FROM strata.auditors")
        .await
        .unwrap_err();
    assert_eq!(stats.logins.load(Relaxed), 1);
    assert_eq!(stats.sessions.load(Relaxed), 1);
    assert_eq!(stats.statements.load(Relaxed), 2);
    assert_eq!(stats.statement_errors.load(Relaxed), 1);
    drop(a);
    for _ in 0..100 {
        if stats.sessions.load(Relaxed) == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(stats.sessions.load(Relaxed), 0, "the session closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_beyond_the_limit_are_refused() {
    let env = env_with(|c| {
        c.max_sessions = 2;
        c.tls = None;
    })
    .await;
    let a = env.auditor("alice", "correct horse").await;
    let b = env.auditor("alice", "correct horse").await;
    let e = tokio_postgres::connect(
        &env.auditor_url("alice", "correct horse"),
        tokio_postgres::NoTls,
    )
    .await
    .err()
    .expect("a third session is refused");
    assert_eq!(code(&e), "53300", "{e:?}");
    drop(a);
    // A place frees up once a session ends.
    let mut third = None;
    for _ in 0..100 {
        if let Ok(c) = tokio_postgres::connect(
            &env.auditor_url("alice", "correct horse"),
            tokio_postgres::NoTls,
        )
        .await
        {
            third = Some(c);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let (c, conn) = third.expect("a session after one ended");
    tokio::spawn(conn);
    assert_eq!(pool_a(&c).await, 5);
    assert_eq!(pool_a(&b).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_over_tls_with_password_and_with_certificate() {
    let env = env_tls().await;
    // SCRAM over TLS, simple protocol, several statements in one string.
    let (ok, out, err) = env.psql(
        &env.tls_conninfo("alice", None),
        "SELECT count(*) FROM strata.events WHERE stream = 'pool/a'; SELECT 'it''s; fine'",
        Some("correct horse"),
    );
    assert!(ok, "{err}");
    assert_eq!(out.lines().collect::<Vec<_>>(), vec!["5", "it's; fine"]);
    // psql's own catalog queries work.
    let (ok, out, err) = env.psql(
        &env.tls_conninfo("alice", None),
        "\\dv audit.*",
        Some("correct horse"),
    );
    assert!(ok, "{err}");
    assert!(out.contains("partitions"), "{out}");
    // A refused write, with Postgres's own error.
    let (ok, _, err) = env.psql(
        &env.tls_conninfo("alice", None),
        "DELETE FROM strata.events",
        Some("correct horse"),
    );
    assert!(!ok);
    assert!(
        err.contains("permission denied") || err.contains("read-only transaction"),
        "{err}"
    );

    // A client certificate for bob: no password.
    let ca = gateway::ca::Ca::load(env.ca_dir.path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = ca.issue_auditor("bob", 1).unwrap();
    let (cp, kp) = (dir.path().join("bob.pem"), dir.path().join("bob.key"));
    std::fs::write(&cp, cert).unwrap();
    gateway::ca::write_private(&kp, key.as_bytes()).unwrap();
    let (ok, out, err) = env.psql(
        &env.tls_conninfo("bob", Some((&cp, &kp))),
        "SELECT current_user = session_user, count(*) > 0 FROM strata.events",
        None,
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "t|t");
    // bob's certificate does not make him alice.
    let (ok, _, err) = env.psql(
        &env.tls_conninfo("alice", Some((&cp, &kp))),
        "SELECT 1",
        None,
    );
    assert!(!ok);
    assert!(err.contains("names auditor \"bob\""), "{err}");
    // An operator's certificate from the same CA is no auditor's.
    let (cert, key) = ca.issue_operator("ops", 1).unwrap();
    std::fs::write(&cp, cert).unwrap();
    gateway::ca::write_private(&kp, key.as_bytes()).unwrap();
    let (ok, _, err) = env.psql(&env.tls_conninfo("bob", Some((&cp, &kp))), "SELECT 1", None);
    assert!(!ok);
    assert!(err.contains("not an auditor's"), "{err}");
    // Nor is an auditor-shaped one the issuing intermediate signed (an audit
    // host's key, were it stolen): only the root issues auditors'.
    let (cert, key) = auditor_minted_with_issuing_key(env.ca_dir.path(), "bob");
    std::fs::write(&cp, cert).unwrap();
    gateway::ca::write_private(&kp, key.as_bytes()).unwrap();
    let (ok, _, err) = env.psql(&env.tls_conninfo("bob", Some((&cp, &kp))), "SELECT 1", None);
    assert!(!ok);
    assert!(err.contains("not an auditor's"), "{err}");

    let recorded = env.recorded("bob").await;
    assert_eq!(
        recorded,
        vec!["SELECT current_user = session_user, count(*) > 0 FROM strata.events"]
    );
    let auth: String = env
        .db
        .query_one(
            "SELECT payload->>'auth' FROM strata.events WHERE stream = 'auditor/bob'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(auth, "certificate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auditor_cannot_switch_off_the_session_limits() {
    // `BEGIN; SET ...; COMMIT` would make a setting outlive the auditor's
    // transaction: once it ends, the session is back to the endpoint's.
    let env = env().await;
    let a = env.auditor("alice", "correct horse").await;
    let show = |rows: Vec<tokio_postgres::SimpleQueryMessage>| -> String {
        rows.into_iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
                _ => None,
            })
            .unwrap()
    };
    let timeout = show(a.simple_query("SHOW statement_timeout").await.unwrap());
    let idle = show(
        a.simple_query("SHOW idle_in_transaction_session_timeout")
            .await
            .unwrap(),
    );
    // SET of a limit is refused, in a transaction or not.
    for sql in [
        "SET statement_timeout = 0",
        "SET SESSION idle_in_transaction_session_timeout = 0",
        "SET LOCAL lock_timeout = 0",
        "RESET statement_timeout",
    ] {
        let e = a.batch_execute(sql).await.unwrap_err();
        assert_eq!(code(&e), "0A000", "{sql}: {e:?}");
    }
    a.batch_execute("BEGIN").await.unwrap();
    let e = a
        .batch_execute("SET idle_in_transaction_session_timeout = 0")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "0A000", "{e:?}");
    a.batch_execute("ROLLBACK").await.unwrap();
    // set_config() in a query does not outlive the statement: the limits
    // are set again after every statement of a transaction.
    a.batch_execute("BEGIN").await.unwrap();
    a.simple_query(
        "SELECT set_config('statement_timeout', '0', false), \
                set_config('idle_in_transaction_session_timeout', '0', false)",
    )
    .await
    .unwrap();
    assert_eq!(
        show(a.simple_query("SHOW statement_timeout").await.unwrap()),
        timeout
    );
    assert_eq!(
        show(
            a.simple_query("SHOW idle_in_transaction_session_timeout")
                .await
                .unwrap()
        ),
        idle
    );
    a.batch_execute("COMMIT").await.unwrap();
    assert_ne!(timeout, "0");
    assert_ne!(idle, "0");
    // And outside a transaction nothing outlives the statement either.
    a.simple_query("SELECT set_config('statement_timeout', '0', false)")
        .await
        .unwrap();
    assert_eq!(
        show(a.simple_query("SHOW statement_timeout").await.unwrap()),
        timeout
    );
    // Nor does any other setting, made alone or in a transaction of the
    // auditor's that they commit: the endpoint rolls back either, and the
    // rollback undoes the SET.
    a.batch_execute("SET TimeZone = 'Asia/Tokyo'")
        .await
        .unwrap();
    assert_eq!(show(a.simple_query("SHOW TimeZone").await.unwrap()), "UTC");
    a.batch_execute("BEGIN; SET search_path = public; SELECT set_config('DateStyle', 'SQL, DMY', false); COMMIT")
        .await
        .unwrap();
    assert_eq!(
        show(a.simple_query("SHOW search_path").await.unwrap()),
        "audit,strata,pg_catalog"
    );
    assert_eq!(
        show(a.simple_query("SHOW DateStyle").await.unwrap()),
        "ISO, MDY"
    );
    // Still a working session.
    assert_eq!(pool_a(&a).await, 5);
}

/// An auditor-shaped certificate (with the intermediate after it) signed
/// with the issuing intermediate's key.
fn auditor_minted_with_issuing_key(dir: &Path, name: &str) -> (String, String) {
    use rcgen::{CertificateParams, ExtendedKeyUsagePurpose, Issuer, KeyPair, SanType};
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    let issuing = read(gateway::ca::ISSUING_CERT);
    let issuer = Issuer::from_ca_cert_pem(
        &issuing,
        KeyPair::from_pem(&read(gateway::ca::ISSUING_KEY)).unwrap(),
    )
    .unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![SanType::URI(
        format!("urn:strata:auditor:{name}").try_into().unwrap(),
    )];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &issuer).unwrap();
    (cert.pem() + &issuing, key.serialize_pem())
}
