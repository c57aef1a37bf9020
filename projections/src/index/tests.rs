//! The index's own tests: what it refuses, what it reports as a
//! violation, and how it follows replacements. (The planner's tests, which
//! plan against it, are the placer's.)

use super::*;
use crate::testing::Log;
use domain::pool_stream;
use domain::pools::devices;

const C: &str = "H100-80GB";

/// A pool `p` with one node, `n00`: 8 GPUs in two islands of 4.
struct World {
    log: Log,
    index: Index,
}

impl World {
    fn new() -> World {
        let mut w = World {
            log: Log::new(),
            index: Index::new(),
        };
        w.pool(&Fact::PoolCreated {
            description: String::new(),
        });
        w.pool(&Fact::NodeJoined {
            node: "n00".into(),
            devices: devices("n00", C, 8, 4),
        });
        w
    }

    fn pool(&mut self, fact: &Fact) -> Option<Violation> {
        let e = self.log.push(&pool_stream("p"), fact);
        self.index.apply(&e).unwrap()
    }

    fn request(&mut self, id: &str, gpus: u32, shape: Shape, priority: i32) {
        let r = Request {
            reservation: id.into(),
            pool: "p".into(),
            class: C.into(),
            gpus,
            shape,
            priority,
            ttl_ms: None,
            replace_on_failure: false,
            replaces: None,
            topology: None,
            requeue_on_preemption: false,
            start_ms: None,
            queue: None,
        };
        let e = self.log.push(
            &domain::reservation_stream(id),
            &Fact::ReservationRequested(r),
        );
        assert_eq!(self.index.apply(&e).unwrap(), None);
    }
}

#[test]
fn invalid_placements_are_reported() {
    let mut w = World::new();
    w.request("a", 1, Shape::Any, 0);
    w.request("b", 1, Shape::Any, 0);
    w.pool(&Fact::HealthRaised {
        node: "n00".into(),
        device: Some("gpu7".into()),
        condition: "XID-48".into(),
        detail: String::new(),
        severity: None,
        action: None,
    });
    let on = |d: &str| {
        vec![Allocation {
            node: "n00".into(),
            devices: vec![d.into()],
        }]
    };
    assert_eq!(
        w.pool(&Fact::ReservationPlaced {
            reservation: "a".into(),
            allocations: on("gpu0")
        }),
        None
    );
    let v = w
        .pool(&Fact::ReservationPlaced {
            reservation: "b".into(),
            allocations: on("gpu0"),
        })
        .expect("double booking is a violation");
    assert!(v.message.contains("double booking"), "{v}");
    let v = w
        .pool(&Fact::ReservationPlaced {
            reservation: "a".into(),
            allocations: on("gpu1"),
        })
        .expect("placing twice is a violation");
    assert!(v.message.contains("placed while placed"), "{v}");
    w.request("c", 1, Shape::Any, 0);
    let v = w
        .pool(&Fact::ReservationPlaced {
            reservation: "c".into(),
            allocations: on("gpu7"),
        })
        .unwrap();
    assert!(v.message.contains("out of service (XID-48)"), "{v}");
    let v = w
        .pool(&Fact::ReservationPlaced {
            reservation: "nope".into(),
            allocations: on("gpu2"),
        })
        .unwrap();
    assert!(v.message.contains("unknown"), "{v}");
    assert_eq!(w.index.state().violations, 4);
}

#[test]
fn a_gap_is_refused() {
    let mut w = World::new();
    let mut e = w.log.push(
        "pool/p",
        &Fact::NodeLeft {
            node: "n00".into(),
            reason: String::new(),
        },
    );
    e.position = events::Position(e.position.0 + 2);
    let err = w.index.apply(&e).unwrap_err();
    assert!(err.to_string().contains("never arrived"), "{err}");
}

fn request(id: &str, replaces: Option<&str>) -> Request {
    Request {
        reservation: id.into(),
        pool: "p".into(),
        class: "H100-80GB".into(),
        gpus: 8,
        shape: Shape::Node,
        priority: 0,
        ttl_ms: None,
        replace_on_failure: true,
        replaces: replaces.map(str::to_string),
        topology: None,
        requeue_on_preemption: false,
        start_ms: None,
        queue: None,
    }
}

#[test]
fn releasing_a_reservation_releases_the_end_of_its_replacement_chain() {
    let (mut log, mut index) = (Log::new(), Index::new());
    let mut apply = |index: &mut Index, stream: &str, fact: Fact| {
        let e = log.push(stream, &fact);
        assert_eq!(index.apply(&e).unwrap(), None, "{fact:?}");
    };
    apply(
        &mut index,
        "pool/p",
        Fact::PoolCreated {
            description: String::new(),
        },
    );
    for n in ["n1", "n2", "n3"] {
        let fact = Fact::NodeJoined {
            node: n.into(),
            devices: devices(n, "H100-80GB", 8, 8),
        };
        apply(&mut index, "pool/p", fact);
    }
    // k on n1 fails and is placed again as k~1 on n2, which fails and
    // is placed again as k~2 on n3.
    let mut id = "k".to_string();
    let mut replaces: Option<String> = None;
    for (n, node) in ["n1", "n2", "n3"].iter().enumerate() {
        apply(
            &mut index,
            &format!("reservation/{id}"),
            Fact::ReservationRequested(request(&id, replaces.as_deref())),
        );
        let allocations = vec![Allocation {
            node: node.to_string(),
            devices: (0..8).map(|i| format!("gpu{i}")).collect(),
        }];
        apply(
            &mut index,
            "pool/p",
            Fact::ReservationPlaced {
                reservation: id.clone(),
                allocations,
            },
        );
        if n < 2 {
            let next = domain::replacement_id(&id);
            apply(
                &mut index,
                "pool/p",
                Fact::ReservationFailed {
                    reservation: id.clone(),
                    node: node.to_string(),
                    reason: "node_lost".into(),
                    replaced_by: Some(next.clone()),
                },
            );
            replaces = Some(id.clone());
            id = next;
        }
    }
    assert_eq!(id, "k~2");
    assert_eq!(index.state().replaced_by.len(), 2);
    // The client releases the id it asked for: the live end is released.
    apply(
        &mut index,
        "reservation/k",
        Fact::ReservationReleaseRequested {
            reservation: "k".into(),
            reason: String::new(),
        },
    );
    assert!(index
        .reservation("k~2")
        .is_some_and(|r| r.release_requested));
    apply(
        &mut index,
        "pool/p",
        Fact::ReservationReleased {
            reservation: "k~2".into(),
        },
    );
    assert!(
        index.state().replaced_by.is_empty(),
        "{:?}",
        index.state().replaced_by
    );
    assert!(index.derived_is_consistent());
}

#[test]
fn bookings_keep_the_derived_index_as_a_rebuild_makes_it() {
    // Nodes with NVLink islands, in racks, one with a second class and one
    // with MIG instances: every booking and release moves the node in its
    // class's free buckets, its rack's and its islands' as a full
    // derivation from the state would.
    let mut w = World::new();
    for n in 1..4 {
        let node = format!("n{n:02}");
        let mut d = devices(&node, C, 8, if n == 3 { 0 } else { 4 });
        if n == 1 {
            for mut extra in devices(&node, "L40S", 2, 2) {
                extra.id = format!("x{}", extra.id);
                d.push(extra);
            }
        }
        if n == 2 {
            domain::pools::split_mig(&mut d, 2, "1g.10gb", 7);
        }
        w.pool(&Fact::NodeJoined { node, devices: d });
    }
    for n in 0..4 {
        w.pool(&Fact::NodeTopologySet {
            node: format!("n{n:02}"),
            rack: Some(format!("rack{}", n / 2)),
            block: Some("b0".into()),
            rail: None,
        });
    }
    let alloc = |node: &str, ids: &[&str]| Allocation {
        node: node.into(),
        devices: ids.iter().map(|s| s.to_string()).collect(),
    };
    let steps: Vec<(bool, &str, Allocation)> = vec![
        (true, "a", alloc("n00", &["gpu0", "gpu1"])),
        (true, "b", alloc("n00", &["gpu4", "gpu5", "gpu6", "gpu7"])),
        (true, "c", alloc("n01", &["xgpu0"])),
        (true, "d", alloc("n02", &["gpu0.mig3"])),
        (true, "e", alloc("n02", &["gpu5"])),
        (
            true,
            "f",
            alloc(
                "n03",
                &[
                    "gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6", "gpu7",
                ],
            ),
        ),
        (false, "b", alloc("n00", &["gpu4", "gpu5", "gpu6", "gpu7"])),
        (false, "d", alloc("n02", &["gpu0.mig3"])),
        (true, "g", alloc("n00", &["gpu2", "gpu3", "gpu4"])),
        (
            false,
            "f",
            alloc(
                "n03",
                &[
                    "gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6", "gpu7",
                ],
            ),
        ),
        (false, "a", alloc("n00", &["gpu0", "gpu1"])),
        (false, "c", alloc("n01", &["xgpu0"])),
    ];
    for (book, id, a) in steps {
        if book {
            assert!(
                w.index.book("p", &a, id).is_empty(),
                "{id} books free devices"
            );
        } else {
            w.index.unbook("p", &a, id);
        }
        let rebuilt = Index::from_state(w.index.state().clone());
        assert!(
            w.index == rebuilt,
            "after {} {id} on {}, the derived index differs from a rebuild",
            if book { "booking" } else { "releasing" },
            a.node
        );
    }
}
