use crate::{appender, db, ev, reader, take};
use events::{ExpectedVersion, Start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn get(port: u16, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
}

#[tokio::test]
async fn the_prometheus_endpoint_shows_appends_batches_replication_and_subscription_lag() {
    let (cfg, mut client) = db().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(ops::http::serve(listener));
    let a = appender(&cfg);
    let r = reader(&cfg);
    let mut sub = r
        .subscribe("metrics-probe", Start::Beginning)
        .await
        .unwrap();
    for i in 0..20 {
        a.append("m", ExpectedVersion::Any, vec![ev(i)])
            .await
            .unwrap();
    }
    take(&mut sub, 20).await;
    // Appends inside a caller's transaction count on their own, and their
    // conflicts with the rest.
    let before = get(port, "/metrics").await;
    let tx = client.transaction().await.unwrap();
    let three = || (0..3).map(ev).collect();
    events::append::append_one_in(&tx, "m/in".into(), ExpectedVersion::NoStream, three())
        .await
        .unwrap();
    events::append::append_one_in(&tx, "m/in".into(), ExpectedVersion::NoStream, three())
        .await
        .unwrap_err();
    tx.commit().await.unwrap();
    let text = get(port, "/metrics").await;
    for (series, at_least) in [
        ("strata_append_in_events_total", 3.0),
        ("strata_append_conflicts_total", 1.0),
    ] {
        let grew = value(&text, series) - value(&before, series);
        assert!(grew >= at_least, "{series} grew by {grew}");
    }
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(value(&text, "strata_append_events_total") >= 20.0);
    assert!(value(&text, "strata_append_batch_size_count") >= 1.0);
    assert!(value(&text, "strata_append_duration_seconds_count") >= 1.0);
    assert!(text.contains("# TYPE strata_replication_lag_bytes gauge"));
    assert!(text.contains("# TYPE strata_replication_lag_seconds gauge"));
    // Delivered, not acknowledged: 20 behind, and as old as the first.
    let series = "strata_subscription_lag_events{subscription=\"metrics-probe\"}";
    assert_eq!(value(&before, series), 20.0, "{before}");
    let seconds = "strata_subscription_lag_seconds{subscription=\"metrics-probe\"}";
    assert!(value(&before, seconds) > 0.0, "{before}");
    // Everything taken and acknowledged: the next scrape says caught up (the
    // gauge used to keep the value of the last delivery).
    take(&mut sub, 3).await;
    sub.ack(sub.position());
    let text = get(port, "/metrics").await;
    assert_eq!(value(&text, series), 0.0, "{text}");
    assert_eq!(value(&text, seconds), 0.0, "{text}");
    // Ephemeral subscriptions are reported under their role, never under
    // their process-made name; a dropped one is gone from the next scrape.
    let eph = r
        .subscribe_ephemeral_as("probe-role", Start::Now)
        .await
        .unwrap();
    let text = get(port, "/metrics").await;
    assert!(
        text.contains("strata_subscription_lag_events{subscription=\"probe-role\"} 0"),
        "{text}"
    );
    assert!(!text.contains("ephemeral-"), "{text}");
    drop(eph);
    drop(sub);
    let text = get(port, "/metrics").await;
    assert!(!text.contains("probe-role"), "{text}");
    assert!(!text.contains("subscription=\"metrics-probe\""), "{text}");
    assert!(get(port, "/nope").await.starts_with("HTTP/1.1 404"));
    assert!(get(port, "/healthz").await.starts_with("HTTP/1.1 200"));
    // Ready only when every check passes, and the body says which failed.
    ops::http::ready_when("probe", || Err("warming up".into()));
    let resp = get(port, "/readyz").await;
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    assert!(resp.contains("probe: not ready: warming up"), "{resp}");
    ops::http::ready_when("probe", || Ok(()));
    let resp = get(port, "/readyz").await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
}
