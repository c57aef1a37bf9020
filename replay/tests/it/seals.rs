//! Seals and running checkpoints of monthly partitions against a real
//! Postgres: altered, inserted and deleted rows found; closed months sealed
//! by maintenance against their checkpoints.

use events::{Appender, AppenderConfig, ExpectedVersion};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::{Client, Config};

async fn db() -> (Config, Client) {
    let url = testkit::migrated_database(testkit::shared_cluster()).await;
    let cfg: Config = url.parse().unwrap();
    let client = events::db::connect(&cfg, "test").await.unwrap();
    (cfg, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seals_name_the_first_altered_inserted_or_deleted_row() {
    use replay::seal::{self, Finding};
    for case in ["intact", "altered", "inserted", "deleted"] {
        let (cfg, client) = db().await;
        let appender = Appender::start(cfg.clone(), AppenderConfig::default());
        for i in 0..4u32 {
            appender
                .append(
                    "pool/s",
                    ExpectedVersion::Any,
                    vec![events::NewEvent::new("t.p", &serde_json::json!({ "i": i }))],
                )
                .await
                .unwrap();
        }
        for i in 0..2500u32 {
            let e = events::NewEvent::new("t.x", &serde_json::json!({ "i": i }));
            appender
                .append("audit/x", ExpectedVersion::Any, vec![e])
                .await
                .unwrap();
        }
        let month: String = client
            .query_one("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM')", &[])
            .await
            .unwrap()
            .get(0);
        let sealed = seal::seal(&client, &month).await.unwrap();
        assert_eq!(sealed.rows, 2504, "{sealed:?}");
        assert!(seal::seal(&client, &month).await.is_err(), "sealed once");
        let part = seal::partition_of(&month).unwrap();
        let want = match case {
            "intact" => Finding::Intact { rows: 2504 },
            "altered" => {
                client
                    .execute(
                        &format!("UPDATE strata.{part} SET payload = '{{\"i\": -1}}' WHERE position = 1700"),
                        &[],
                    )
                    .await
                    .unwrap();
                Finding::Altered { position: 1700 }
            }
            "inserted" => {
                client
                    .execute(
                        "INSERT INTO strata.events (position, stream, version, type, payload, metadata, recorded_at, xid)
                         VALUES (9999, 'audit/x', 9999, 't.x', '{}', '{}', now(), pg_current_xact_id())",
                        &[],
                    )
                    .await
                    .unwrap();
                Finding::Inserted { position: 9999 }
            }
            _ => {
                client
                    .execute("DELETE FROM strata.events WHERE position = 1200", &[])
                    .await
                    .unwrap();
                Finding::Deleted { position: 1200 }
            }
        };
        assert_eq!(seal::verify(&client, &month).await.unwrap(), want, "{case}");
    }
    assert!(replay::seal::partition_of("2026-13").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_months_keep_checkpoints_and_closed_months_are_sealed_against_them() {
    use replay::seal::{self, Finding, SealError};
    let (cfg, client) = db().await;
    // A month long closed (2024-01) and the open one, written through the
    // appender with its clock set.
    let jan = std::time::UNIX_EPOCH + Duration::from_secs(1_704_067_200 + 86_400); // 2024-01-02
    schema::partitions::ensure(&client, 1, jan).await.unwrap();
    let old_cfg = AppenderConfig {
        clock: Some(Arc::new(move || jan)),
        ..AppenderConfig::default()
    };
    let old = Appender::start(cfg.clone(), old_cfg);
    let now = Appender::start(cfg.clone(), AppenderConfig::default());
    let put = |a: &Appender, n: u32, tag: &'static str| {
        let a = a.clone();
        async move {
            for i in 0..n {
                a.append(
                    "audit/x",
                    ExpectedVersion::Any,
                    vec![events::NewEvent::new(tag, &serde_json::json!({ "i": i }))],
                )
                .await
                .unwrap();
            }
        }
    };
    put(&old, 30, "t.jan").await;
    // The closed month was checkpointed while it was open.
    let c1 = seal::checkpoint(&client, "2024-01").await.unwrap().unwrap();
    assert_eq!((c1.rows, c1.last_position), (30, 30));
    put(&old, 10, "t.jan").await;
    put(&now, 20, "t.now").await;
    let month = seal::current_month(&client).await.unwrap();
    let open1 = seal::checkpoint(&client, &month).await.unwrap().unwrap();
    assert_eq!(open1.rows, 20);
    assert!(
        seal::checkpoint(&client, &month).await.unwrap().is_none(),
        "nothing new"
    );
    put(&now, 5, "t.now").await;
    let open2 = seal::checkpoint(&client, &month).await.unwrap().unwrap();
    assert_eq!(open2.rows, 25);
    assert_eq!(
        seal::verify(&client, &month).await.unwrap(),
        Finding::CheckpointsIntact {
            rows: 25,
            checkpoints: 2
        }
    );
    // An open-month row altered behind a checkpoint is found, with its range.
    let part = seal::partition_of(&month).unwrap();
    let target = open1.last_position + 2;
    client
        .execute(
            &format!(
                "UPDATE strata.{part} SET payload = '{{\"i\": -1}}' WHERE position = {target}"
            ),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        seal::verify(&client, &month).await.unwrap(),
        Finding::CheckpointBroken {
            after: open1.last_position,
            up_to: open2.last_position
        }
    );

    // A second closed month, altered after its checkpoint.
    let feb = std::time::UNIX_EPOCH + Duration::from_secs(1_706_745_600 + 86_400); // 2024-02-02
    schema::partitions::ensure(&client, 1, feb).await.unwrap();
    let feb_cfg = AppenderConfig {
        clock: Some(Arc::new(move || feb)),
        ..AppenderConfig::default()
    };
    let febs = Appender::start(cfg.clone(), feb_cfg);
    put(&febs, 10, "t.feb").await;
    let cf = seal::checkpoint(&client, "2024-02").await.unwrap().unwrap();
    client
        .execute(
            &format!(
                "DELETE FROM strata.events_2024_02 WHERE position = {}",
                cf.last_position - 3
            ),
            &[],
        )
        .await
        .unwrap();
    // Maintenance seals the month that matches its checkpoint and refuses
    // the other.
    let done = seal::maintain(&client, Duration::ZERO).await.unwrap();
    let sealed: Vec<&str> = done.sealed.iter().map(|s| s.partition.as_str()).collect();
    assert!(sealed.contains(&"events_2024_01"), "{done:?}");
    assert_eq!(
        done.sealed
            .iter()
            .find(|s| s.partition == "events_2024_01")
            .unwrap()
            .rows,
        40
    );
    assert_eq!(
        seal::verify(&client, "2024-01").await.unwrap(),
        Finding::Intact { rows: 40 }
    );
    assert!(
        done.refused
            .iter()
            .any(|(m, why)| m == "2024-02" && why.contains("altered after the checkpoint")),
        "{done:?}"
    );
    assert!(matches!(
        seal::seal(&client, "2024-02").await,
        Err(SealError::CheckpointBroken { .. })
    ));
}
