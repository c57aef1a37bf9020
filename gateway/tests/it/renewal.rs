//! Node certificates renewed over the session, with no token: a node keeps
//! its session across its certificate's expiry, an early renewal is
//! refused, and the expired certificate no longer opens a session.

use super::*;
use node::proto::{
    gateway_message, node_message, session_client::SessionClient, Hello, NodeMessage, Renew,
};

async fn session_with(
    gw: &Running,
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<SessionClient<tonic::transport::Channel>, tonic::transport::Error> {
    Ok(SessionClient::new(
        node_channel(gw, ca_pem, cert_pem, key_pem).await?,
    ))
}

fn hello(node: &str) -> NodeMessage {
    NodeMessage {
        body: Some(node_message::Body::Hello(Hello {
            node_id: node.into(),
            generation: 1,
            ..Hello::default()
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_renews_its_certificate_over_its_session_and_outlives_it() {
    let r = region().await;
    let gw = r
        .gateway("gw-a", |c| c.certificate_validity = Duration::from_secs(6))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let c = joining(&r, &gw, dir.path(), "n1").await;
    let first = daemon::ensure_joined(&c).await.unwrap();
    let joined_at = std::time::Instant::now();
    // Too early: more than half of its validity is left.
    let mut early = session_with(&gw, &first.ca_pem, &first.cert_pem, &first.key_pem)
        .await
        .unwrap();
    let csr = new_csr();
    let msgs = vec![
        hello("n1"),
        NodeMessage {
            body: Some(node_message::Body::Renew(Renew { csr_pem: csr })),
        },
    ];
    let mut inbound = early
        .open(futures_util::stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    let answer = loop {
        match inbound.message().await.unwrap().unwrap().body {
            Some(gateway_message::Body::Renewed(r)) => break r,
            _ => continue,
        }
    };
    assert!(answer.error.contains("half"), "{answer:?}");
    assert!(answer.certificate_pem.is_empty());
    drop(inbound);
    drop(early);

    // The daemon renews twice over twelve seconds and stays connected.
    let n = start(c);
    testkit::eventually(30, "two renewals", || async {
        n.stats.renewals.load(Ordering::Relaxed) >= 2
    })
    .await;
    assert!(
        joined_at.elapsed() > Duration::from_secs(6),
        "renewed before it was due"
    );
    testkit::eventually(20, "n1 connected with its renewed certificate", || async {
        n.stats.connected.load(Ordering::Relaxed) == 1
    })
    .await;
    assert!(
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.certificate_renewed'")
            .await
            >= 2
    );
    assert!(
        r.count("SELECT count(*) FROM strata.node_certificates WHERE node = 'n1'")
            .await
            >= 3
    );
    // The first certificate, expired, opens nothing.
    let refused = match session_with(&gw, &first.ca_pem, &first.cert_pem, &first.key_pem).await {
        Err(_) => true,
        Ok(mut s) => match s.open(futures_util::stream::iter(vec![hello("n1")])).await {
            Err(_) => true,
            Ok(resp) => resp.into_inner().message().await.is_err(),
        },
    };
    assert!(refused, "the expired certificate opened a session");
    n.stop().await.unwrap();
    gw.stop().await.unwrap();
}
