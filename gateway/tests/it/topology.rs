//! A node's daemon reports where it is (its rack, block and rail group):
//! the gateway writes `node.topology_set` when the labels are new or
//! changed, an operator's label stands until then, and gangs are placed
//! by what the nodes said.

use super::*;
use domain::{Request, Shape};
use domain::{Tier, Topology};
use std::collections::BTreeMap;

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The `node.topology_set` payloads of `node`, in order.
async fn reported(r: &Region, node: &str) -> Vec<serde_json::Value> {
    r.client
        .query(
            "SELECT payload FROM strata.events WHERE stream = 'pool/p' AND type = 'node.topology_set'
               AND payload->>'node' = $1 ORDER BY position",
            &[&node],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_report_their_topology_and_gangs_are_placed_by_it() {
    let r = region().await;
    let gw = r.gateway("gw-t", |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    // Three nodes: n1 and n3 share rail group ra, n2 is on rb.
    let mut nodes = Vec::new();
    for (node, rack, rail) in [("n1", "r1", "ra"), ("n2", "r1", "rb"), ("n3", "r2", "ra")] {
        let mut c = joining(&r, &gw, dir.path(), node).await;
        c.topology = labels(&[("rack", rack), ("rail", rail)]);
        nodes.push(start(c));
    }
    for node in ["n1", "n2", "n3"] {
        testkit::eventually(20, "each node's labels reach its pool", || async {
            reported(&r, node).await.len() == 1
        })
        .await;
    }
    let n1 = reported(&r, "n1").await.remove(0);
    assert_eq!(n1["rack"], "r1");
    assert_eq!(n1["rail"], "ra");
    assert!(n1.get("block").is_none(), "{n1}");
    // Each node's devices were written before its labels.
    for node in ["n1", "n2", "n3"] {
        let first = |ty: &str| {
            format!("SELECT min(position) FROM strata.events WHERE type = '{ty}' AND payload->>'node' = '{node}'")
        };
        let joined = r.count(&first("node.joined")).await;
        let labelled = r.count(&first("node.topology_set")).await;
        assert!(
            joined < labelled,
            "{node}: joined at {joined}, labelled at {labelled}"
        );
    }

    // An operator moves n1 to another rack; the node, restarted with the
    // same labels, does not undo it.
    domain::standing::change(
        &r.client,
        &r.appender,
        Some("p"),
        "n1",
        &domain::standing::Change::Topology {
            rack: Some("r9".into()),
            block: None,
            rail: Some("ra".into()),
        },
        None,
    )
    .await
    .unwrap();
    let mut n1_node = nodes.remove(0);
    n1_node = {
        n1_node.stop().await.unwrap();
        let mut c = config(vec![url(&gw)], dir.path(), "n1");
        c.topology = labels(&[("rack", "r1"), ("rail", "ra")]);
        start(c)
    };
    testkit::eventually(20, "n1's second session opens", || async {
        r.count("SELECT count(*) FROM strata.events WHERE stream = 'node/n1' AND type = 'node.session_opened'")
            .await
            == 2
    })
    .await;
    // Its inventory hashes were answered: a session that wanted nothing
    // writes nothing more.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let all = reported(&r, "n1").await;
    assert_eq!(all.len(), 2, "the operator's, and no report again: {all:?}");
    assert_eq!(all[1]["rack"], "r9");
    // Moved for real (a changed flag), the node's report wins.
    n1_node.stop().await.unwrap();
    let mut c = config(vec![url(&gw)], dir.path(), "n1");
    c.topology = labels(&[("rack", "r3"), ("block", "b1"), ("rail", "ra")]);
    let n1_node = start(c);
    testkit::eventually(20, "n1's changed labels are reported", || async {
        reported(&r, "n1").await.len() == 3
    })
    .await;
    let now = reported(&r, "n1").await.remove(2);
    assert_eq!((&now["rack"], &now["block"]), (&"r3".into(), &"b1".into()));

    // The pool index has them, and a gang within one rail group goes to
    // n1 and n3.
    let mut index = projections::projector::build(&r.client, projections::Index::new())
        .await
        .unwrap();
    let p = index.pool("p").unwrap();
    assert_eq!(p.nodes["n2"].label(Tier::Rail), Some("rb"));
    assert_eq!(p.nodes["n1"].label(Tier::Rack), Some("r3"));
    let gang = Request {
        reservation: "g".into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 16,
        shape: Shape::Gang {
            nodes: 2,
            gpus_per_node: 8,
        },
        priority: 0,
        ttl_ms: None,
        replace_on_failure: false,
        replaces: None,
        topology: Some(Topology::Within(Tier::Rail)),
        requeue_on_preemption: false,
        start_ms: None,
        queue: None,
    };
    let placed = placer::plan::place_one(&index, "p", &gang).expect("one rail group has two");
    let mut on: Vec<&str> = placed.iter().map(|a| a.node.as_str()).collect();
    on.sort();
    assert_eq!(on, ["n1", "n3"]);
    assert!(index.derived_is_consistent());
    index = projections::Index::from_state(index.into_state());
    assert!(index.derived_is_consistent());
    n1_node.stop().await.unwrap();
    for n in nodes {
        n.stop().await.unwrap();
    }
}
