//! TLS to PostgreSQL: a private cluster with `ssl = on` and only `hostssl`
//! rules, reached by the appender, the replication reader and plain
//! sessions, with libpq's `sslmode`s, a CA the server's certificate is not
//! from, and a certificate login.

use crate::{ev, reader_config, take};
use events::db::Database;
use events::replication::ReplicationConnection;
use events::{Appender, AppenderConfig, ExpectedVersion, Reader, Start};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use std::path::Path;

/// A CA, the server's certificate (for the DNS name `localhost` only) and
/// a client certificate for the role `certuser`.
struct Pki {
    ca_pem: String,
    server: (String, String),
    client: (String, String),
}

fn new_ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    let cert = p.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(p, key))
}

fn leaf(issuer: &Issuer<'static, KeyPair>, names: Vec<String>, cn: &str) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(names).unwrap();
    p.distinguished_name.push(DnType::CommonName, cn);
    let cert = p.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    fn new() -> Pki {
        let (ca_pem, issuer) = new_ca("test postgres CA");
        Pki {
            ca_pem,
            server: leaf(&issuer, vec!["localhost".into()], "localhost"),
            client: leaf(&issuer, vec![], "certuser"),
        }
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    p.display().to_string()
}

fn tls_cluster(pki: &Pki) -> schema::Cluster {
    let base = tempfile::tempdir().unwrap().keep();
    let mut o = schema::ClusterOptions::new(base.join("pg"));
    o.fsync = false;
    o.remove_on_exit = Some(base);
    o.tls = Some(schema::cluster::ClusterTls {
        cert_pem: pki.server.0.clone(),
        key_pem: pki.server.1.clone(),
        client_ca_pem: Some(pki.ca_pem.clone()),
    });
    // TLS only: no `host` rule, so a connection in the clear finds no entry.
    o.hba = Some(
        "hostssl all certuser 127.0.0.1/32 cert\n\
         hostssl all all 127.0.0.1/32 trust\n"
            .into(),
    );
    schema::Cluster::start(o).unwrap()
}

async fn refused(url: &str) -> String {
    let db = Database::parse(url).unwrap();
    match events::db::connect(&db, "test").await {
        Ok(_) => panic!("{url} was let in"),
        Err(e) => format!("{e:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_speaks_tls_verifies_the_server_and_logs_in_by_certificate() {
    let pki = Pki::new();
    let files = tempfile::tempdir().unwrap();
    let ca = write(files.path(), "ca.pem", &pki.ca_pem);
    let (other, _) = new_ca("some other CA");
    let other = write(files.path(), "other.pem", &other);
    let cert = write(files.path(), "client.pem", &pki.client.0);
    let key = write(files.path(), "client.key", &pki.client.1);
    let cluster = tls_cluster(&pki);
    let port = cluster.port();
    let at = |host: &str, db: &str, extra: &str| {
        format!("host={host} port={port} user=postgres dbname={db} {extra}")
    };

    // Setup over TLS too (no rule admits anything else).
    let admin = events::db::connect(
        &Database::parse(&at("localhost", "postgres", "sslmode=require")).unwrap(),
        "test",
    )
    .await
    .unwrap();
    admin.batch_execute("CREATE DATABASE tls").await.unwrap();
    admin
        .batch_execute("CREATE ROLE certuser LOGIN SUPERUSER")
        .await
        .unwrap();
    let full = Database::parse(&at(
        "localhost",
        "tls",
        &format!("sslmode=verify-full sslrootcert='{ca}'"),
    ))
    .unwrap();
    let mut client = events::db::connect(&full, "test").await.unwrap();
    schema::migrate(&mut client).await.unwrap();
    let ssl: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl, "the session is not encrypted");
    // strata doctor's TLS check sees it too.
    let findings = events::doctor::examine(&client, std::time::Duration::from_secs(600))
        .await
        .unwrap();
    let tls = findings.iter().find(|f| f.check == "tls").unwrap();
    assert_eq!(tls.status, events::doctor::Status::Ok, "{tls:?}");

    // In the clear: no rule admits it.
    let e = refused(&at("localhost", "tls", "sslmode=disable")).await;
    assert!(e.contains("no encryption"), "{e}");
    // prefer (libpq's default) takes the TLS the server offers.
    let preferred = Database::parse(&at("localhost", "tls", "")).unwrap();
    events::db::connect(&preferred, "test").await.unwrap();

    // The appender and the replication reader, both over verify-full.
    let reader = Reader::start(&full, reader_config());
    let mut sub = reader.subscribe_ephemeral(Start::Now).await.unwrap();
    let appender = Appender::start(&full, AppenderConfig::default());
    appender
        .append("tls/1", ExpectedVersion::NoStream, vec![ev(1)])
        .await
        .unwrap();
    assert_eq!(take(&mut sub, 1).await.len(), 1);
    let walsenders_encrypted: bool = client
        .query_one(
            "SELECT count(*) > 0 AND bool_and(s.ssl)
               FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        walsenders_encrypted,
        "the replication connection is in the clear"
    );

    // A CA the server's certificate is not from: refused, on a session and
    // on a replication connection alike.
    let wrong = at(
        "localhost",
        "tls",
        &format!("sslmode=verify-full sslrootcert={other}"),
    );
    let e = refused(&wrong).await;
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    let r = ReplicationConnection::connect(Database::parse(&wrong).unwrap(), "test").await;
    let e = r
        .err()
        .expect("replication with the wrong CA was let in")
        .to_string();
    assert!(
        e.contains("TLS") && e.to_lowercase().contains("certificate"),
        "{e}"
    );
    // The server's certificate names localhost, not 127.0.0.1: verify-full
    // refuses the address, verify-ca checks the chain only.
    let e = refused(&at(
        "127.0.0.1",
        "tls",
        &format!("sslmode=verify-full sslrootcert={ca}"),
    ))
    .await;
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    let ca_only = Database::parse(&at(
        "127.0.0.1",
        "tls",
        &format!("sslmode=verify-ca sslrootcert={ca}"),
    ))
    .unwrap();
    events::db::connect(&ca_only, "test").await.unwrap();
    // require with a root checks the chain, as libpq does.
    let e = refused(&at(
        "localhost",
        "tls",
        &format!("sslmode=require sslrootcert={other}"),
    ))
    .await;
    assert!(e.to_lowercase().contains("certificate"), "{e}");

    // A certificate login: with the certificate, in; without, refused.
    let as_certuser = |extra: &str| {
        format!(
            "postgres://certuser@localhost:{port}/tls?sslmode=verify-full&sslrootcert={}{extra}",
            ca.replace('/', "%2F")
        )
    };
    let with_cert =
        Database::parse(&as_certuser(&format!("&sslcert={cert}&sslkey={key}"))).unwrap();
    let c = events::db::connect(&with_cert, "test").await.unwrap();
    let dn: String = c
        .query_one(
            "SELECT client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(dn.contains("certuser"), "{dn}");
    let e = refused(&as_certuser("")).await;
    assert!(e.contains("certificate"), "{e}");
    let e = Database::parse(&as_certuser(&format!("&sslcert={cert}")))
        .err()
        .unwrap();
    assert!(e.contains("sslcert and sslkey go together"), "{e}");
}

#[test]
fn database_urls_are_read_as_libpq_reads_them() {
    let d = Database::parse(
        "host=localhost port=5433 user=u dbname='my db' sslmode=disable application_name='it''s'",
    );
    assert!(d.is_err(), "a doubled quote is not libpq's escape");
    let d = Database::parse(
        r"host=localhost port=5433 user=u dbname='my db' sslmode=disable application_name='it\'s'",
    )
    .unwrap();
    assert_eq!(d.config.get_dbname(), Some("my db"));
    assert_eq!(d.config.get_application_name(), Some("it's"));
    assert_eq!(d.tls.settings.mode, events::pgtls::SslMode::Disable);
    let d =
        Database::parse("postgres://u@a,b:5432/x?target_session_attrs=read-write&sslmode=prefer")
            .unwrap();
    assert_eq!(d.config.get_hosts().len(), 2);
    let e = Database::parse("postgres://u@h/x?sslmode=verify-full").unwrap_err();
    assert!(e.contains("sslrootcert"), "{e}");
    let e = Database::parse("postgres://u@h/x?sslmode=sometimes").unwrap_err();
    assert!(e.contains("verify-full"), "{e}");
    let e = Database::parse("postgres://u@h/x?sslrootcert=/nonexistent/ca.pem&sslmode=verify-ca")
        .unwrap_err();
    assert!(e.contains("/nonexistent/ca.pem"), "{e}");
}
