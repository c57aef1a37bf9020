//! Auditors acting as a careless or hostile one would: trying to commit,
//! chain into a writable transaction, hold a transaction (and its locks)
//! open for ever, watch or kill another auditor's session, or log in
//! without TLS where TLS is configured. Checked against the catalogs and
//! tables themselves.

use super::*;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auditor_commits_nothing_and_cannot_chain_into_a_writable_transaction() {
    let env = env().await;
    let a = env.auditor("alice", "correct horse").await;
    let large_objects = || async {
        env.db
            .query_one("SELECT count(*) FROM pg_largeobject_metadata", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let before = large_objects().await;
    // What once wrote 6 MB of large objects: refused, and the COMMIT
    // commits nothing anyway.
    let e = a
        .batch_execute("BEGIN; SELECT lo_from_bytea(0, 'x'); COMMIT")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "42501", "{e:?}");
    a.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(large_objects().await, before);
    // COMMIT AND CHAIN would open a transaction with no snapshot yet, which
    // SET TRANSACTION READ WRITE could then make writable.
    a.batch_execute("BEGIN; SELECT count(*) FROM strata.events")
        .await
        .unwrap();
    for sql in [
        "COMMIT AND CHAIN",
        "ROLLBACK AND CHAIN",
        "END WORK AND CHAIN",
        "PREPARE TRANSACTION 'p'",
    ] {
        let e = a.batch_execute(sql).await.unwrap_err();
        assert_eq!(code(&e), "0A000", "{sql}: {e:?}");
        a.batch_execute("ROLLBACK").await.unwrap();
        a.batch_execute("BEGIN").await.unwrap();
    }
    let e = a
        .batch_execute("SET TRANSACTION READ WRITE")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "25001", "{e:?}");
    a.batch_execute("ROLLBACK").await.unwrap();
    // No temporary tables, not even in a transaction of one's own.
    for sql in [
        "CREATE TEMP TABLE t (x int)",
        "BEGIN; CREATE TEMP TABLE t (x int); COMMIT",
    ] {
        let e = a.batch_execute(sql).await.unwrap_err();
        assert!(
            ["42501", "25006"].contains(&code(&e).as_str()),
            "{sql}: {e:?}"
        );
        let _ = a.batch_execute("ROLLBACK").await;
    }
    // Through psql: the COMMIT is answered with the rollback it was, and
    // the endpoint says so; notices reach the auditor.
    let (ok, out, err) = env.psql(
        &env.auditor_url("alice", "correct horse"),
        "BEGIN; SELECT count(*) FROM strata.events WHERE stream = 'pool/a'; COMMIT;",
        Some("correct horse"),
    );
    assert!(ok, "{err}");
    assert_eq!(out.lines().collect::<Vec<_>>(), ["BEGIN", "5", "ROLLBACK"]);
    assert!(
        err.contains("nothing an auditor runs is committed"),
        "{err}"
    );
    let (ok, _, err) = env.psql(
        &env.auditor_url("alice", "correct horse"),
        "DO $$ BEGIN RAISE NOTICE 'a notice for the auditor'; END $$",
        Some("correct horse"),
    );
    assert!(ok, "{err}");
    assert!(err.contains("NOTICE:  a notice for the auditor"), "{err}");
    // The session is fine after all of it.
    assert_eq!(pool_a(&a).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auditor_transaction_is_rolled_back_at_its_maximum_age() {
    let env = env_with(|c| {
        c.tls = None;
        c.max_transaction_age = Duration::from_secs(2);
    })
    .await;
    let a = env.auditor("alice", "correct horse").await;
    a.batch_execute("BEGIN; SELECT count(*) FROM strata.events")
        .await
        .unwrap();
    // The auditor's role holds a lock on the event table while it is open.
    let role: String = env
        .db
        .query_one(
            "SELECT role FROM strata.audit_logins WHERE auditor = 'alice'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let locks = || async {
        env.db
            .query_one(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s ON s.pid = l.pid
                  WHERE s.usename = $1 AND l.relation = 'strata.events'::regclass",
                &[&role],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    assert_eq!(locks().await, 1);
    // The endpoint ends it, without a word from the auditor.
    let started = Instant::now();
    while locks().await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the transaction is still open"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The auditor learns it at the next statement; after ROLLBACK the
    // session goes on.
    let e = a.batch_execute("SELECT 1").await.unwrap_err();
    assert_eq!(code(&e), "25P03", "{e:?}");
    a.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(pool_a(&a).await, 5);
    // A statement running when the age is reached is cancelled.
    a.batch_execute("BEGIN").await.unwrap();
    let t = Instant::now();
    let e = a.batch_execute("SELECT pg_sleep(30)").await.unwrap_err();
    assert_eq!(code(&e), "57014", "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(20));
    let _ = a.batch_execute("ROLLBACK").await;
    assert_eq!(pool_a(&a).await, 5);
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(env.endpoint.stats.transactions_expired.load(Relaxed), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auditors_cannot_see_cancel_or_terminate_each_other_but_can_cancel_their_own() {
    let env = env().await;
    let alice = env.auditor("alice", "correct horse").await;
    let dave = std::sync::Arc::new(env.auditor("dave", "daves-secret").await);
    let sleeper = {
        let dave = dave.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            let r = dave
                .batch_execute("SELECT pg_sleep(60) /* dave's secret query */")
                .await;
            (r, t.elapsed())
        })
    };
    // Dave's backend, as alice finds it: she sees it exists, not what it runs.
    let dave_role: String = env
        .db
        .query_one(
            "SELECT role FROM strata.audit_logins WHERE auditor = 'dave'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let mut found = None;
    let started = Instant::now();
    while found.is_none() {
        assert!(started.elapsed() < Duration::from_secs(20));
        let rows = alice
            .query(
                "SELECT pid, coalesce(query, '') FROM pg_stat_activity WHERE usename = $1",
                &[&dave_role],
            )
            .await
            .unwrap();
        for r in rows {
            let query: String = r.get(1);
            assert!(!query.contains("secret query"), "alice read {query:?}");
            found = Some(r.get::<_, i32>(0));
        }
        if found.is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let pid = found.unwrap();
    for f in ["pg_terminate_backend", "pg_cancel_backend"] {
        let e = alice
            .query(&format!("SELECT {f}($1)"), &[&pid])
            .await
            .unwrap_err();
        assert_eq!(code(&e), "42501", "{f}: {e:?}");
    }
    assert!(!sleeper.is_finished(), "dave's statement was stopped");
    // Dave cancels his own statement through the endpoint.
    dave.cancel_token()
        .cancel_query(tokio_postgres::NoTls)
        .await
        .unwrap();
    let (r, took) = sleeper.await.unwrap();
    let e = r.unwrap_err();
    assert_eq!(code(&e), "57014", "{e:?}");
    assert!(took < Duration::from_secs(30), "{took:?}");
    assert_eq!(pool_a(&*dave).await, 5);
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(env.endpoint.stats.cancels.load(Relaxed), 1);
    // Each auditor's role logs in with a password; the group role not at all.
    let rows = env
        .db
        .query(
            "SELECT l.auditor, a.rolcanlogin, a.rolpassword LIKE 'SCRAM-SHA-256$%'
               FROM strata.audit_logins l JOIN pg_authid a ON a.rolname = l.role
              ORDER BY l.auditor",
            &[],
        )
        .await
        .unwrap();
    let logins: Vec<(String, bool, bool)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        logins,
        [("alice".into(), true, true), ("dave".into(), true, true)]
    );
    let group: String = env
        .db
        .query_one(
            "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid
               JOIN pg_roles r ON r.oid = m.member
               JOIN strata.audit_logins l ON l.role = r.rolname WHERE l.auditor = 'alice'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let mut direct: tokio_postgres::Config = env.url.parse().unwrap();
    direct.user(&group);
    let e = direct.connect(tokio_postgres::NoTls).await.err().unwrap();
    assert_eq!(code(&e), "28000", "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_is_refused_where_tls_is_configured_and_the_record_names_the_transport() {
    let env = env_tls().await;
    // A second driver, in plain TCP.
    let e = tokio_postgres::connect(
        &env.auditor_url("alice", "correct horse"),
        tokio_postgres::NoTls,
    )
    .await
    .err()
    .expect("a plaintext login");
    assert_eq!(code(&e), "28000", "{e:?}");
    assert!(format!("{e:?}").contains("TLS"), "{e:?}");
    // psql in plain TCP, then over TLS with channel binding (SCRAM-SHA-256-PLUS).
    let (ok, _, err) = env.psql(
        &env.auditor_url("alice", "correct horse"),
        "SELECT 1",
        Some("correct horse"),
    );
    assert!(!ok && err.contains("TLS"), "{err}");
    let (ok, out, err) = env.psql(
        &format!(
            "{} channel_binding=require",
            env.tls_conninfo("alice", None)
        ),
        "SELECT count(*) FROM strata.events WHERE stream = 'pool/a'",
        Some("correct horse"),
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "5");
    let tls: Vec<bool> = env
        .db
        .query(
            "SELECT (payload->>'tls')::boolean FROM strata.events
              WHERE stream = 'auditor/alice' AND type = 'audit.query_recorded'",
            &[],
        )
        .await
        .map_err(|e| format!("{e:?}"))
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(tls, [true]);
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(env.endpoint.stats.logins_refused.load(Relaxed), 2);

    // Where no TLS is configured, the record says plain TCP.
    let plain = super::env().await;
    let a = plain.auditor("alice", "correct horse").await;
    assert_eq!(pool_a(&a).await, 5);
    let tls: bool = plain
        .db
        .query_one(
            "SELECT (payload->>'tls')::boolean FROM strata.events
              WHERE stream = 'auditor/alice' AND type = 'audit.query_recorded'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!tls);
}
