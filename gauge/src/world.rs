//! The fixed world every workload measures: a pool of 1,000 nodes of eight
//! GPUs in racks of 32, shared by 16 queues in two cohorts, and demand at
//! 150% of it (see [`domain::demand`]), placed batch by batch as a placer
//! would. Everything is built in memory, the same way on every run.

use domain::{pool_stream, reservation_stream, Fact, Request};
use events::Event;
use placer::plan::{plan_with, Ending, Plan};
use projections::testing::Log;
use projections::Index;

pub const POOL: &str = "gauge";
pub const CLASS: &str = "H100-80GB";
pub const NODES: u32 = 1_000;
pub const NODES_PER_RACK: u32 = 32;
/// The largest batch the planner is given, as the placer's default.
pub const BATCH: usize = 1024;
/// The moment every batch is planned at (Unix ms), fixed so that every run
/// takes the same paths.
pub const NOW_MS: u64 = 1_800_000_000_000;

/// A log and the index folded from it.
pub struct World {
    pub log: Log,
    pub index: Index,
    /// Every reservation placed, in order.
    pub placed: Vec<String>,
}

impl World {
    /// The pool, its nodes in racks and its queues, with no request yet.
    pub fn pool() -> World {
        let mut w = World {
            log: Log::new(),
            index: Index::new(),
            placed: Vec::new(),
        };
        w.fold(
            &pool_stream(POOL),
            Fact::PoolCreated {
                description: String::new(),
            },
        );
        for (node, devices) in domain::pools::uniform_fleet("g-n", NODES, CLASS, 8, 8) {
            w.fold(&pool_stream(POOL), Fact::NodeJoined { node, devices });
        }
        for i in 0..NODES {
            w.fold(
                &pool_stream(POOL),
                Fact::NodeTopologySet {
                    node: format!("g-n{i:05}"),
                    rack: Some(format!("rack-{:03}", i / NODES_PER_RACK)),
                    block: None,
                    rail: None,
                },
            );
        }
        for spec in domain::demand::queues(CLASS, u64::from(NODES) * 8) {
            w.fold(&pool_stream(POOL), Fact::QueueConfigured(spec));
        }
        w
    }

    /// The demand on the pool, in the order it is offered.
    pub fn demand() -> Vec<Request> {
        domain::demand::mixed(POOL, CLASS, u64::from(NODES) * 8)
    }

    /// Appends `fact` to `stream` and folds it into the index; a fact the
    /// index refuses or finds in violation is a bug in the world.
    pub fn fold(&mut self, stream: &str, fact: Fact) {
        let e = self.log.push(stream, &fact);
        let violation = self.index.apply(&e).expect("the world's facts apply");
        assert!(
            violation.is_none(),
            "the world breaks an invariant: {violation:?}"
        );
    }

    /// The fixed script every workload runs, each batch planned with
    /// `plan` and its outcome folded as the placer commits it (preemptions
    /// a batch schedules end in the next one):
    ///
    /// 1. the demand, offered and planned in batches of [`BATCH`];
    /// 2. 64 requests of priority 10 for one GPU, across the queues, in
    ///    one batch: each looks for a victim;
    /// 3. every fourth placed reservation released, then every waiting
    ///    request tried again, in batches, as a change of capacity makes
    ///    the placer do.
    pub fn script(&mut self, mut plan: impl FnMut(&mut Index, &[String], &Ending) -> Plan) {
        for chunk in World::demand().chunks(BATCH) {
            let ids = self.offer(chunk);
            self.batch(&ids, &mut plan);
        }
        let high: Vec<Request> = (0..64)
            .map(|i| {
                let base =
                    domain::demand::request(format!("hp-{i}"), POOL, CLASS, 1, domain::Shape::Any);
                domain::demand::tenant_request(
                    base,
                    domain::demand::queue_name(i % domain::demand::QUEUES),
                    10,
                )
            })
            .collect();
        let ids = self.offer(&high);
        self.batch(&ids, &mut plan);
        let live: Vec<String> = self
            .placed
            .iter()
            .step_by(4)
            .filter(|id| {
                self.index
                    .reservation(id)
                    .is_some_and(|r| r.phase.is_live())
            })
            .cloned()
            .collect();
        for reservation in live {
            self.fold(
                &pool_stream(POOL),
                Fact::ReservationReleased { reservation },
            );
        }
        // In the order they wait in: priority, then arrival.
        let waiting: Vec<String> = self
            .index
            .queues(POOL)
            .map(|q| q.queued.iter().map(|k| k.2.clone()).collect())
            .unwrap_or_default();
        for chunk in waiting.chunks(BATCH) {
            self.batch(chunk, &mut plan);
        }
    }

    /// Folds the requests; their ids.
    fn offer(&mut self, requests: &[Request]) -> Vec<String> {
        requests
            .iter()
            .map(|r| {
                self.fold(
                    &reservation_stream(&r.reservation),
                    Fact::ReservationRequested(r.clone()),
                );
                r.reservation.clone()
            })
            .collect()
    }

    /// Plans one batch of `ids` with the due preemptions ending, and folds
    /// its outcome.
    fn batch(
        &mut self,
        ids: &[String],
        plan: &mut impl FnMut(&mut Index, &[String], &Ending) -> Plan,
    ) {
        let ending = self.due_preemptions();
        let outcome = plan(&mut self.index, ids, &ending);
        // The victims end as the batch commits, before its placements.
        for v in &ending.victims {
            let r = self.index.reservation(v).expect("a victim is known");
            let fact = Fact::ReservationPreempted {
                reservation: v.clone(),
                by: r
                    .preempted_by
                    .clone()
                    .expect("a victim knows its preemptor"),
                reason: r.preempt_reason.clone(),
                replaced_by: None,
            };
            self.fold(&pool_stream(POOL), fact);
        }
        self.commit(outcome);
    }

    /// Every preemption scheduled, as ended now (their grace is over).
    fn due_preemptions(&self) -> Ending {
        let mut ending = Ending::default();
        let scheduled = self
            .index
            .queues(POOL)
            .map(|q| q.preemptions.clone())
            .unwrap_or_default();
        for (_, victim) in scheduled {
            if let Some(by) = self
                .index
                .reservation(&victim)
                .and_then(|r| r.preempted_by.clone())
            {
                if !ending.first.contains(&by) {
                    ending.first.push(by);
                }
                ending.victims.push(victim);
            }
        }
        ending
    }

    fn commit(&mut self, plan: Plan) {
        let stream = pool_stream(POOL);
        for (reservation, allocations) in plan.placed {
            self.placed.push(reservation.clone());
            self.fold(
                &stream,
                Fact::ReservationPlaced {
                    reservation,
                    allocations,
                },
            );
        }
        for (reservation, by, reason) in plan.preempting {
            self.fold(
                &stream,
                Fact::ReservationPreemptionScheduled {
                    reservation,
                    by,
                    reason,
                    deadline_ms: Some(0),
                },
            );
        }
        for (reservation, reason) in plan.queued {
            self.fold(
                &stream,
                Fact::ReservationQueued {
                    reservation,
                    reason,
                },
            );
        }
        for (reservation, reason) in plan.rejected {
            self.fold(
                &stream,
                Fact::ReservationRejected {
                    reservation,
                    reason,
                },
            );
        }
    }

    /// The whole log: the pool, its demand and every batch's outcome.
    pub fn events(&self) -> &[Event] {
        &self.log.events
    }
}

/// Plans one batch at [`NOW_MS`].
pub fn plan_batch(index: &mut Index, ids: &[String], ending: &Ending) -> Plan {
    plan_with(index, POOL, ids, ending, NOW_MS)
}
