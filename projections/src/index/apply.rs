//! Folding one event into the index: [`Index::apply`] checks the event's
//! place in the log, resolves the pool it speaks of, and hands the fact to
//! one function per family (a pool's, a node's membership, a node's
//! standing, a client's, the placer's, an ending). Each keeps the derived
//! structures up to date and says, as a violation, where the log breaks an
//! invariant (a device booked twice, a placement over quota, a preemption
//! that was not scheduled).

use super::*;

impl Index {
    /// Applies one event. Events at or below the applied position are
    /// skipped (so replays after a snapshot apply each event once); a gap is
    /// refused. A fact that breaks an invariant is applied as far as it can
    /// be and reported as a [`Violation`].
    pub fn apply(&mut self, event: &Event) -> Result<Option<Violation>, ApplyError> {
        if event.position.0 <= self.state.position {
            return Ok(None);
        }
        let parsed = Fact::parse(&event.event_type, &event.payload, &event.metadata);
        self.apply_parsed(event, parsed)
    }

    /// [`Index::apply`] with the event's fact already parsed
    /// ([`Fact::parse`]), so a replay can parse on another thread.
    pub fn apply_parsed(
        &mut self,
        event: &Event,
        parsed: Result<Option<Fact>, String>,
    ) -> Result<Option<Violation>, ApplyError> {
        let p = event.position.0;
        if p <= self.state.position {
            return Ok(None);
        }
        if !event
            .position
            .follows(events::Position(self.state.position))
        {
            return Err(ApplyError::Gap {
                applied: self.state.position,
                got: p,
                missing_from: self.state.position + 1,
                missing_to: p - 1,
            });
        }
        self.state.position = p;
        let violation = |message: String| Violation {
            position: p,
            stream: event.stream.clone(),
            event_type: event.event_type.clone(),
            message,
        };
        // The pool's version follows its stream, whatever the event is.
        if let Some(pool) = pool_of(&event.stream) {
            match self.state.pools.get_mut(pool) {
                Some(entry) => entry.version = event.version,
                None => {
                    self.state.pools.insert(
                        pool.to_string(),
                        Pool {
                            name: pool.to_string(),
                            version: event.version,
                            ..Pool::default()
                        },
                    );
                }
            }
        }
        let fact = match parsed {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(None),
            Err(e) => {
                self.state.malformed += 1;
                return Ok(Some(violation(e)));
            }
        };
        self.event_ms = millis(event.recorded_at);
        let result = self.apply_fact(event, fact);
        if let Err(message) = result {
            self.state.violations += 1;
            return Ok(Some(violation(message)));
        }
        Ok(None)
    }

    fn apply_fact(&mut self, event: &Event, fact: Fact) -> Result<(), String> {
        let on_pool = pool_of(&event.stream).map(str::to_string);
        let pool_fact = !matches!(
            fact,
            Fact::ReservationRequested(_)
                | Fact::ReservationActivated { .. }
                | Fact::ReservationReleaseRequested { .. }
                | Fact::ReservationEnded { .. }
        );
        let pool = match (&on_pool, pool_fact) {
            (Some(p), true) => p.clone(),
            (None, true) => return Err("a pool fact outside a pool stream".into()),
            (_, false) => {
                let expected = fact.reservation().map(domain::reservation_stream);
                if expected.as_deref() != Some(event.stream.as_str()) {
                    return Err(format!(
                        "a reservation fact on stream {:?}, not {:?}",
                        event.stream,
                        expected.unwrap_or_default()
                    ));
                }
                String::new()
            }
        };
        match &fact {
            Fact::PoolCreated { .. }
            | Fact::PoolUpdated { .. }
            | Fact::PoolFaultPolicySet(_)
            | Fact::PoolPreemptionSet { .. }
            | Fact::CohortDecaySet { .. }
            | Fact::QueueConfigured(_) => self.apply_pool(pool, fact),
            Fact::NodeJoined { .. }
            | Fact::NodeInventoryReported { .. }
            | Fact::NodeLeft { .. }
            | Fact::NodeContactLost { .. }
            | Fact::NodeContactRestored { .. } => self.apply_membership(event, pool, fact),
            Fact::NodeMaintenanceScheduled {
                node,
                start_ms,
                end_ms,
                reason,
            } => {
                let (Some(start_ms), Some(end_ms)) = (*start_ms, *end_ms) else {
                    return Err("a maintenance window needs a start and an end".into());
                };
                let window = crate::index::Window {
                    start_ms,
                    end_ms,
                    reason: reason.clone(),
                };
                self.schedule_maintenance(&pool, node, window)
            }
            Fact::NodeCordoned { .. }
            | Fact::NodeDrained { .. }
            | Fact::NodeTopologySet { .. }
            | Fact::NodeUncordoned { .. }
            | Fact::HealthRaised { .. }
            | Fact::HealthCleared { .. }
            | Fact::DeviceQuarantined { .. }
            | Fact::DeviceQuarantineWithheld { .. }
            | Fact::DeviceRestored { .. }
            | Fact::NodeAcceptanceReported { .. } => self.apply_standing(pool, fact),
            Fact::ReservationRequested(_)
            | Fact::ReservationReleaseRequested { .. }
            | Fact::ReservationActivated { .. }
            | Fact::ReservationEnded { .. } => self.apply_request(event, fact),
            Fact::ReservationQueued { .. }
            | Fact::ReservationRejected { .. }
            | Fact::ReservationPlaced { .. }
            | Fact::ReservationEndingNoticed { .. }
            | Fact::ReservationPromised { .. }
            | Fact::ReservationPreemptionScheduled { .. } => {
                self.apply_placement(event, pool, fact)
            }
            Fact::ReservationReleased { .. }
            | Fact::ReservationExpired { .. }
            | Fact::ReservationFailed { .. }
            | Fact::ReservationPreempted { .. } => self.apply_ending(event, pool, fact),
        }
    }

    /// Something changed what the pool can place: requests that wait are
    /// looked at again.
    fn bump_capacity(&mut self, pool: &str) {
        if let Some(p) = self.state.pools.get_mut(pool) {
            p.capacity_epoch += 1;
        }
    }

    /// A pool is created or described, or one of its queues configured.
    fn apply_pool(&mut self, pool: String, fact: Fact) -> Result<(), String> {
        match fact {
            Fact::PoolCreated { description } | Fact::PoolUpdated { description } => {
                let p = self
                    .state
                    .pools
                    .get_mut(&pool)
                    .expect("made on the stream's first event");
                p.created = true;
                p.description = description;
            }
            Fact::PoolFaultPolicySet(policy) => {
                let p = self
                    .state
                    .pools
                    .get_mut(&pool)
                    .expect("made on the stream's first event");
                p.faults_advisory = !policy.automatic;
                p.max_quarantined_percent = Some(policy.max_quarantined_percent.min(100));
            }
            Fact::PoolPreemptionSet { enabled } => {
                self.state
                    .pools
                    .get_mut(&pool)
                    .expect("made on the stream's first event")
                    .preemption_off = !enabled;
                // Requests that waited may preempt now.
                self.bump_capacity(&pool);
            }
            Fact::QueueConfigured(spec) => {
                spec.validate().map_err(|e| format!("invalid queue: {e}"))?;
                // Its cohort, and so its half-life, may change.
                self.accrue_pool(&pool);
                self.state
                    .pools
                    .get_mut(&pool)
                    .expect("made on the stream's first event")
                    .queues
                    .insert(spec.queue.clone(), spec);
                // More quota may admit what waits.
                self.bump_capacity(&pool);
            }
            Fact::CohortDecaySet {
                cohort,
                half_life_ms,
            } => {
                self.accrue_pool(&pool);
                let lives = &mut self
                    .state
                    .pools
                    .get_mut(&pool)
                    .expect("made on the stream's first event")
                    .half_lives;
                match half_life_ms {
                    Some(h) => lives.insert(cohort, h.max(1)),
                    None => lives.remove(&cohort),
                };
            }
            other => return not_of("a pool", &other),
        }
        Ok(())
    }

    /// A node joins, reports its inventory, leaves, or is lost or found by its gateway.
    fn apply_membership(&mut self, event: &Event, pool: String, fact: Fact) -> Result<(), String> {
        let joined = matches!(&fact, Fact::NodeJoined { .. });
        match fact {
            Fact::NodeJoined { node, devices } | Fact::NodeInventoryReported { node, devices } => {
                let exists = self.state.pools[&pool].nodes.contains_key(&node);
                if !exists {
                    self.state
                        .pools
                        .get_mut(&pool)
                        .expect("made on the stream's first event")
                        .nodes
                        .insert(node.clone(), Node::default());
                }
                self.with_node(&pool, &node, |n| {
                    if joined {
                        n.left = false;
                        n.left_reason.clear();
                    }
                    let mut old: Vec<Device> = std::mem::take(&mut n.devices);
                    for spec in devices {
                        let kept = old
                            .iter()
                            .position(|d| d.spec.id == spec.id)
                            .map(|i| old.remove(i));
                        n.devices.push(match kept {
                            Some(mut d) => {
                                d.spec = spec;
                                d.present = true;
                                d
                            }
                            None => Device {
                                spec,
                                conditions: Vec::new(),
                                present: true,
                                booked_by: None,
                                fault: None,
                                quarantine: None,
                                failed_acceptance: false,
                                diagnosed: false,
                            },
                        });
                    }
                    // Devices no longer reported stay while booked.
                    for mut d in old {
                        if d.booked_by.is_some() {
                            d.present = false;
                            n.devices.push(d);
                        }
                    }
                });
                self.bump_capacity(&pool);
            }
            Fact::NodeLeft { node, reason } => {
                self.with_node(&pool, &node, |n| {
                    n.left = true;
                    n.left_reason = reason;
                });
            }
            Fact::NodeContactLost { node } => {
                let since = millis(event.recorded_at);
                self.with_node(&pool, &node, |n| {
                    n.unreachable_since_ms.get_or_insert(since);
                });
            }
            Fact::NodeContactRestored { node } => {
                self.with_node(&pool, &node, |n| n.unreachable_since_ms = None);
                self.bump_capacity(&pool);
            }
            other => return not_of("a node's membership", &other),
        }
        Ok(())
    }

    /// An operator's say over a node (cordon, drain, topology), or its health.
    fn apply_standing(&mut self, pool: String, fact: Fact) -> Result<(), String> {
        match fact {
            Fact::NodeCordoned { node, reason } => {
                self.with_node(&pool, &node, |n| n.cordoned = Some(reason));
            }
            Fact::NodeDrained {
                node,
                reason,
                deadline_ms,
                fault,
            } => {
                self.with_node(&pool, &node, |n| {
                    n.drained = Some(reason);
                    n.drain_deadline_ms = deadline_ms;
                    // A drain is the answer to a node's fault waiting.
                    n.fault = None;
                    n.drained_for = fault;
                });
            }
            Fact::NodeTopologySet {
                node,
                rack,
                block,
                rail,
            } => {
                self.with_node(&pool, &node, |n| {
                    n.rack = rack;
                    n.block = block;
                    n.rail = rail;
                })
                .ok_or_else(|| format!("node {node:?} is not in pool {pool:?}"))?;
                // A gang waiting for a rack may fit now.
                self.bump_capacity(&pool);
            }
            Fact::NodeUncordoned { node } => {
                self.with_node(&pool, &node, |n| {
                    n.cordoned = None;
                    n.drained = None;
                    n.drain_deadline_ms = None;
                    n.drained_for = None;
                });
                self.bump_capacity(&pool);
            }
            Fact::HealthRaised {
                node,
                device,
                condition,
                action,
                ..
            } => {
                let action = action.unwrap_or_else(|| domain::faults::classify(&condition).action);
                self.with_node(&pool, &node, |n| {
                    raise(n, device.as_deref(), condition, action)
                });
            }
            Fact::DeviceQuarantined {
                node,
                device,
                condition,
                ..
            } => {
                self.with_node(&pool, &node, |n| {
                    if let Some(d) = n.devices.iter_mut().find(|d| d.spec.id == device) {
                        d.quarantine = Some(condition);
                        d.fault = None;
                        d.diagnosed = false;
                    }
                })
                .ok_or_else(|| format!("node {node:?} is not in pool {pool:?}"))?;
            }
            Fact::DeviceQuarantineWithheld { node, device, .. } => {
                self.with_node(&pool, &node, |n| match device {
                    None => n.fault = None,
                    Some(id) => {
                        if let Some(d) = n.devices.iter_mut().find(|d| d.spec.id == id) {
                            d.fault = None;
                        }
                    }
                });
                self.bump_capacity(&pool);
            }
            Fact::NodeAcceptanceReported {
                node,
                passed,
                reason,
                failed_devices,
                ..
            } => {
                self.with_node(&pool, &node, |n| {
                    let whole = !passed && failed_devices.is_empty();
                    n.acceptance_failed = whole.then_some(reason);
                    for d in &mut n.devices {
                        d.failed_acceptance = failed_devices.contains(&d.spec.id);
                        // A check of the node that the GPU passed: the
                        // diagnostic a quarantine for a reset waits for.
                        if d.quarantine.is_some() && !whole && !d.failed_acceptance {
                            d.diagnosed = true;
                        }
                    }
                })
                .ok_or_else(|| format!("node {node:?} is not in pool {pool:?}"))?;
                self.bump_capacity(&pool);
            }
            Fact::DeviceRestored { node, device, .. } => {
                self.with_node(&pool, &node, |n| {
                    if let Some(d) = n.devices.iter_mut().find(|d| d.spec.id == device) {
                        d.quarantine = None;
                        d.fault = None;
                        d.diagnosed = false;
                    }
                });
                self.bump_capacity(&pool);
            }
            Fact::HealthCleared {
                node,
                device,
                condition,
            } => {
                self.with_node(&pool, &node, |n| {
                    let list = n.conditions_mut(device.as_deref());
                    if let Some(list) = list {
                        list.retain(|c| c != &condition);
                    }
                    // A fault gone before the placer acted on it asks for
                    // nothing more; a quarantine stays until restored.
                    if n.fault.as_ref() == Some(&condition) {
                        n.fault = None;
                    }
                    if let Some(d) = device
                        .as_deref()
                        .and_then(|id| n.devices.iter_mut().find(|d| d.spec.id == id))
                    {
                        if d.fault.as_ref() == Some(&condition) {
                            d.fault = None;
                        }
                    }
                });
                self.bump_capacity(&pool);
            }
            other => return not_of("a node's standing or health", &other),
        }
        Ok(())
    }

    /// A client's fact on a reservation's own stream: its request, its release request, its activation, its end.
    fn apply_request(&mut self, event: &Event, fact: Fact) -> Result<(), String> {
        match fact {
            Fact::ReservationRequested(request) => {
                let id = request.reservation.clone();
                if self.state.reservations.contains_key(&id) {
                    return Err(format!("reservation {id:?} was requested twice"));
                }
                request
                    .validate()
                    .map_err(|e| format!("invalid request: {e}"))?;
                if let Some(old) = &request.replaces {
                    self.state.replaced_by.insert(old.clone(), id.clone());
                }
                self.state.reservations.insert(
                    id.clone(),
                    Reservation {
                        request,
                        phase: Phase::Pending,
                        requested_at: event.position.0,
                        allocations: Vec::new(),
                        placed_at_ms: None,
                        expires_at_ms: None,
                        release_requested: false,
                        reason: String::new(),
                        preempted_by: None,
                        preempt_deadline_ms: None,
                        preempt_reason: String::new(),
                        end_reason: String::new(),
                        promise: None,
                        noticed: false,
                    },
                );
                self.queue(&id, true);
            }
            Fact::ReservationReleaseRequested { reservation, .. } => {
                // Releasing a reservation that failed and was placed again
                // releases the one in its place; releasing what is gone is
                // a no-op.
                let mut id = reservation;
                while !self.state.reservations.contains_key(&id) {
                    match self.state.replaced_by.get(&id) {
                        Some(next) => id = next.clone(),
                        None => break,
                    }
                }
                self.with_reservation(&id, |r| r.release_requested = true);
            }
            Fact::ReservationActivated { reservation } => {
                let ok = self.with_reservation(&reservation, |r| {
                    if r.phase == Phase::Placed {
                        r.phase = Phase::Active;
                        Ok(())
                    } else {
                        Err(format!(
                            "reservation {reservation:?} became active while {}",
                            r.phase.name()
                        ))
                    }
                });
                ok.unwrap_or_else(|| {
                    Err(format!("unknown reservation {reservation:?} became active"))
                })?;
            }
            Fact::ReservationEnded { reservation, .. } => {
                // Committed after the terminal fact on the pool's stream, in
                // the same transaction: by now the reservation is gone.
                if let Some(r) = self.state.reservations.get(&reservation) {
                    return Err(format!(
                        "reservation {reservation:?} ended while {}, before its terminal fact",
                        r.phase.name()
                    ));
                }
            }
            other => return not_of("a client's", &other),
        }
        Ok(())
    }

    /// The placer's word on a waiting request: queued, never fits, placed, or preempting others.
    fn apply_placement(&mut self, event: &Event, pool: String, fact: Fact) -> Result<(), String> {
        match fact {
            Fact::ReservationQueued {
                reservation,
                reason,
            } => {
                self.check_in_pool(&reservation, &pool)?;
                self.with_reservation(&reservation, |r| {
                    // Queued again when why it waits changes.
                    if matches!(r.phase, Phase::Pending | Phase::Queued) {
                        r.phase = Phase::Queued;
                        r.reason = reason;
                        // A promise not kept at its start: it waits like
                        // any request now.
                        r.promise = None;
                        Ok(())
                    } else {
                        Err(format!(
                            "reservation {reservation:?} queued while {}",
                            r.phase.name()
                        ))
                    }
                })
                .expect("checked")?;
            }
            Fact::ReservationRejected { reservation, .. } => {
                self.check_in_pool(&reservation, &pool)?;
                let phase = self.state.reservations[&reservation].phase;
                self.terminate(&pool, &reservation);
                self.forget_chain(&reservation);
                if phase.is_live() {
                    return Err(format!(
                        "reservation {reservation:?} rejected while {}",
                        phase.name()
                    ));
                }
            }
            Fact::ReservationPromised {
                reservation,
                allocations,
                start_ms,
                end_ms,
            } => {
                self.check_in_pool(&reservation, &pool)?;
                let (Some(start_ms), Some(end_ms)) = (start_ms, end_ms) else {
                    return Err("a promise needs a start and an end".into());
                };
                let promise = crate::index::Promise {
                    start_ms,
                    end_ms,
                    allocations,
                };
                self.promise(&pool, &reservation, promise)?;
            }
            Fact::ReservationEndingNoticed {
                reservation,
                reason,
                deadline_ms,
            } => {
                self.check_in_pool(&reservation, &pool)?;
                let r = &self.state.reservations[&reservation];
                if !r.phase.is_live() || r.end_reason != reason {
                    return Err(format!(
                        "reservation {reservation:?} noticed of its end ({reason}) while {}{}",
                        r.phase.name(),
                        if r.end_reason.is_empty() {
                            ", not cut short".to_string()
                        } else {
                            format!(", cut short for {}", r.end_reason)
                        }
                    ));
                }
                // Told late (its placer was away): it keeps the grace
                // period the notice promises.
                self.with_reservation(&reservation, |r| {
                    r.noticed = true;
                    r.expires_at_ms = r.expires_at_ms.max(deadline_ms);
                });
            }
            Fact::ReservationPlaced {
                reservation,
                allocations,
            } => {
                self.check_in_pool(&reservation, &pool)?;
                let placed = self.place(event, &pool, &reservation, allocations);
                self.withdraw_preemptions(&pool, &reservation);
                return placed;
            }
            Fact::ReservationPreemptionScheduled {
                reservation,
                by,
                reason,
                deadline_ms,
            } => {
                self.check_in_pool(&reservation, &pool)?;
                let victim = &self.state.reservations[&reservation];
                let problem = if !victim.phase.is_live() {
                    Some(format!(
                        "reservation {reservation:?} preempted while {}",
                        victim.phase.name()
                    ))
                } else if let Some(other) = &victim.preempted_by {
                    Some(format!(
                        "reservation {reservation:?} is already being preempted for {other:?}"
                    ))
                } else {
                    match self.state.reservations.get(&by) {
                        Some(p) if matches!(p.phase, Phase::Pending | Phase::Queued) => {
                            crate::quota::may_preempt(
                                self,
                                &pool,
                                &p.request,
                                victim,
                                &Default::default(),
                            )
                            .err()
                            .map(|no| no.to_string())
                        }
                        _ => Some(format!(
                            "reservation {reservation:?} preempted for {by:?}, which does not wait"
                        )),
                    }
                };
                let live = victim.phase.is_live();
                if live {
                    let why = reason.clone();
                    self.with_reservation(&reservation, |r| {
                        r.preempted_by = Some(by);
                        r.preempt_deadline_ms = deadline_ms;
                        r.preempt_reason = why;
                    });
                }
                if let Some(p) = problem {
                    return Err(format!("{p} ({reason})"));
                }
            }
            other => return not_of("a placement", &other),
        }
        Ok(())
    }

    /// A reservation ends: released, expired, failed or preempted.
    fn apply_ending(&mut self, event: &Event, pool: String, fact: Fact) -> Result<(), String> {
        let replaced = matches!(
            &fact,
            Fact::ReservationFailed {
                replaced_by: Some(_),
                ..
            } | Fact::ReservationPreempted {
                replaced_by: Some(_),
                ..
            }
        );
        match fact {
            Fact::ReservationReleased { reservation } => {
                self.check_in_pool(&reservation, &pool)?;
                self.terminate(&pool, &reservation);
                self.forget_chain(&reservation);
                self.bump_capacity(&pool);
            }
            Fact::ReservationExpired { reservation, .. }
            | Fact::ReservationFailed { reservation, .. } => {
                // Only a live reservation can run out of time or lose a node.
                self.check_in_pool(&reservation, &pool)?;
                let phase = self.state.reservations[&reservation].phase;
                self.terminate(&pool, &reservation);
                // Placed again: the reservation in its place is requested in
                // the same transaction, and keeps the chain.
                if !replaced {
                    self.forget_chain(&reservation);
                }
                self.bump_capacity(&pool);
                if !phase.is_live() {
                    return Err(format!(
                        "reservation {reservation:?} {} while {}",
                        domain::canonical_type(&event.event_type)
                            .trim_start_matches("reservation."),
                        phase.name()
                    ));
                }
            }
            Fact::ReservationPreempted { reservation, .. } => {
                self.check_in_pool(&reservation, &pool)?;
                let r = &self.state.reservations[&reservation];
                let (phase, marked) = (r.phase, r.preempted_by.is_some());
                self.terminate(&pool, &reservation);
                if !replaced {
                    self.forget_chain(&reservation);
                }
                self.bump_capacity(&pool);
                if !phase.is_live() || !marked {
                    return Err(format!(
                        "reservation {reservation:?} preempted while {}{}",
                        phase.name(),
                        if marked {
                            ""
                        } else {
                            ", without reservation.preemption_scheduled"
                        }
                    ));
                }
            }
            other => return not_of("an ending", &other),
        }
        Ok(())
    }

    /// A maintenance window on `node`: the live reservations on it that
    /// would outlast its start end then.
    fn schedule_maintenance(
        &mut self,
        pool: &str,
        node: &str,
        window: crate::index::Window,
    ) -> Result<(), String> {
        let (now, start_ms) = (self.event_ms, window.start_ms);
        self.with_node(pool, node, |n| {
            n.maintenance.retain(|w| w.end_ms > now);
            n.maintenance.push(window);
        })
        .ok_or_else(|| format!("node {node:?} is not in pool {pool:?}"))?;
        // What would outlast its start ends then, after a notice.
        let on: Vec<String> = self.state.pools[pool].nodes[node]
            .bookings()
            .into_iter()
            .map(str::to_string)
            .collect();
        for id in on {
            self.with_reservation(&id, |r| {
                if r.phase.is_live() && r.expires_at_ms.is_none_or(|e| e > start_ms) {
                    r.expires_at_ms = Some(start_ms);
                    r.end_reason = "maintenance".into();
                    r.noticed = false;
                }
            });
        }
        Ok(())
    }

    /// A reservation in advance promised: it waits for its start, its
    /// devices held for its window.
    fn promise(
        &mut self,
        pool: &str,
        reservation: &str,
        promise: crate::index::Promise,
    ) -> Result<(), String> {
        let r = &self.state.reservations[reservation];
        let problem = if !matches!(r.phase, Phase::Pending | Phase::Queued) || r.promise.is_some() {
            Some(format!(
                "reservation {reservation:?} promised while {}{}",
                r.phase.name(),
                if r.promise.is_some() {
                    ", promised already"
                } else {
                    ""
                }
            ))
        } else {
            self.window_problem(
                pool,
                reservation,
                &promise.allocations,
                promise.start_ms,
                Some(promise.end_ms),
            )
        };
        let reason = format!(
            "promised: {} GPUs from {}",
            promise
                .allocations
                .iter()
                .map(|a| a.devices.len())
                .sum::<usize>(),
            humantime::format_rfc3339_seconds(
                UNIX_EPOCH + std::time::Duration::from_millis(promise.start_ms)
            )
        );
        self.with_reservation(reservation, |r| {
            r.phase = Phase::Queued;
            r.reason = reason;
            r.promise = Some(promise);
        });
        problem.map_or(Ok(()), Err)
    }

    /// `preemptor` no longer waits (placed, or ended): the reservations
    /// being preempted for it are not.
    fn withdraw_preemptions(&mut self, pool: &str, preemptor: &str) {
        let victims: Vec<String> = self
            .queues
            .get(pool)
            .and_then(|q| q.preemptors.get(preemptor))
            .map(|v| v.iter().cloned().collect())
            .unwrap_or_default();
        for v in victims {
            self.with_reservation(&v, |r| {
                r.preempted_by = None;
                r.preempt_deadline_ms = None;
                r.preempt_reason.clear();
            });
        }
    }

    fn check_in_pool(&self, reservation: &str, pool: &str) -> Result<(), String> {
        match self.state.reservations.get(reservation) {
            None => Err(format!(
                "reservation {reservation:?} is unknown or already terminal"
            )),
            Some(r) if r.request.pool != pool => Err(format!(
                "reservation {reservation:?} belongs to pool {:?}",
                r.request.pool
            )),
            Some(_) => Ok(()),
        }
    }

    /// Ends a reservation: frees its devices and forgets it.
    fn terminate(&mut self, pool: &str, id: &str) {
        self.accrue_for(id);
        self.queue(id, false);
        let r = self
            .state
            .reservations
            .remove(id)
            .expect("checked by caller");
        for a in &r.allocations {
            self.unbook(pool, a, id);
        }
        self.withdraw_preemptions(pool, id);
    }

    /// Carries the past usage of reservation `id`'s queue to now, before
    /// its GPUs count (it is placed) or stop counting (it ends).
    fn accrue_for(&mut self, id: &str) {
        let Some(r) = self
            .state
            .reservations
            .get(id)
            .filter(|r| r.phase.is_live())
        else {
            return;
        };
        if let Some(q) = r.request.queue.clone() {
            let (pool, class) = (r.request.pool.clone(), r.request.class.clone());
            self.accrue(&pool, &q, &class);
            let spent = self.spent(&pool, &q, self.event_ms);
            if let Some(p) = self.state.pools.get_mut(&pool) {
                match p.spent.get_mut(&q) {
                    Some(s) => *s = spent,
                    None => {
                        p.spent.insert(q, spent);
                    }
                }
            }
        }
    }

    /// A reservation ended for good (not placed again): the chain of
    /// reservations it replaced no longer leads to a live one.
    fn forget_chain(&mut self, id: &str) {
        let mut end = id.to_string();
        while let Some(old) = self
            .state
            .replaced_by
            .iter()
            .find(|(_, new)| **new == end)
            .map(|(old, _)| old.clone())
        {
            self.state.replaced_by.remove(&old);
            end = old;
        }
    }

    fn place(
        &mut self,
        event: &Event,
        pool: &str,
        id: &str,
        allocations: Vec<Allocation>,
    ) -> Result<(), String> {
        let r = &self.state.reservations[id];
        if !matches!(r.phase, Phase::Pending | Phase::Queued) {
            return Err(format!(
                "reservation {id:?} placed while {}",
                r.phase.name()
            ));
        }
        // Check everything before booking anything.
        let placed_at = millis(event.recorded_at);
        // Placed from a promise, it ends with its window.
        let window_end = r.promise.as_ref().map(|p| p.end_ms);
        let ends = r
            .request
            .ttl_ms
            .map(|t| placed_at.saturating_add(t))
            .map(|e| window_end.map_or(e, |w| e.min(w)));
        let problem = self
            .placement_problem(pool, &r.request, &allocations)
            .or_else(|| self.window_problem(pool, id, &allocations, placed_at, ends))
            .or_else(|| {
                crate::quota::admit(self, pool, &r.request, &crate::quota::Batch::default())
                    .err()
                    .map(|refusal| format!("placed against its quota: {refusal}"))
            });
        self.queue(id, false);
        let mut refused = Vec::new();
        for a in &allocations {
            refused.extend(self.book(pool, a, id));
        }
        // Its queue's maximum run time, where that ends it before its own.
        let queue = self.state.reservations[id].request.queue.as_deref();
        let max_run = self
            .pool(pool)
            .and_then(|p| p.queues.get(queue?)?.max_run_ms);
        let r = self.state.reservations.get_mut(id).expect("checked above");
        r.phase = Phase::Placed;
        r.reason.clear();
        r.placed_at_ms = Some(placed_at);
        let own = ends;
        let limit = max_run.map(|m| placed_at.saturating_add(m));
        r.expires_at_ms = own;
        if let Some(l) = limit.filter(|l| own.is_none_or(|o| *l < o)) {
            r.expires_at_ms = Some(l);
            r.end_reason = "max_run_time".into();
        }
        r.promise = None;
        r.allocations = allocations;
        self.accrue_for(id);
        self.queue(id, true);
        match problem {
            Some(p) => Err(p),
            None if !refused.is_empty() => Err(format!("devices {refused:?} could not be booked")),
            None => Ok(()),
        }
    }

    /// Whether devices booked by `id` over `[from, to)` (`to` `None`: with
    /// no end) would last into a maintenance window of their nodes, or a
    /// window promised to another reservation on the same devices.
    pub fn window_problem(
        &self,
        pool: &str,
        id: &str,
        allocations: &[Allocation],
        from: u64,
        to: Option<u64>,
    ) -> Option<String> {
        let p = self.state.pools.get(pool)?;
        let at = |ms: u64| {
            humantime::format_rfc3339_seconds(UNIX_EPOCH + std::time::Duration::from_millis(ms))
        };
        for a in allocations {
            let windows = p
                .nodes
                .get(&a.node)
                .map(|n| n.maintenance.as_slice())
                .unwrap_or_default();
            if let Some(w) = windows.iter().find(|w| w.overlaps(from, to)) {
                return Some(format!(
                    "it would last into node {}'s maintenance from {} to {}",
                    a.node,
                    at(w.start_ms),
                    at(w.end_ms)
                ));
            }
        }
        let promised = self.queues(pool).map(|q| &q.promised)?;
        for (_, other) in promised.iter().filter(|(_, o)| o != id) {
            let Some(promise) = self.reservation(other).and_then(|r| r.promise.as_ref()) else {
                continue;
            };
            let window = Window {
                start_ms: promise.start_ms,
                end_ms: promise.end_ms,
                reason: String::new(),
            };
            if !window.overlaps(from, to) {
                continue;
            }
            for a in allocations {
                let shared = promise
                    .allocations
                    .iter()
                    .filter(|b| b.node == a.node)
                    .any(|b| b.devices.iter().any(|d| a.devices.contains(d)));
                if shared {
                    return Some(format!(
                        "it would last into the window promised to {other} on node {} from {}",
                        a.node,
                        at(promise.start_ms)
                    ));
                }
            }
        }
        None
    }

    /// What is wrong with a placement, checked against the index as it is:
    /// devices that do not exist, are of another class, unhealthy, on an
    /// unschedulable node or already booked, or a shape not honoured.
    pub fn placement_problem(
        &self,
        pool: &str,
        request: &Request,
        allocations: &[Allocation],
    ) -> Option<String> {
        let Some(p) = self.state.pools.get(pool) else {
            return Some(format!("pool {pool:?} does not exist"));
        };
        // Checked without allocating: this runs for every placement applied.
        let mut count = 0u32;
        // The one island every device shares so far: None before the first
        // device, Some(None) once devices disagree or one has no island.
        let mut island: Option<Option<&str>> = None;
        for (i, a) in allocations.iter().enumerate() {
            let Some(node) = p.nodes.get(&a.node) else {
                return Some(format!("node {:?} is not in pool {pool:?}", a.node));
            };
            if !node.schedulable() {
                return Some(format!("node {:?} is not schedulable", a.node));
            }
            if allocations[..i].iter().any(|b| b.node == a.node) {
                return Some(format!("node {:?} appears twice", a.node));
            }
            for (j, d) in a.devices.iter().enumerate() {
                if a.devices[..j].contains(d) {
                    return Some(format!("device {}/{d} appears twice", a.node));
                }
                let Some((_, dev)) = node.device(d) else {
                    return Some(format!("device {}/{d} does not exist", a.node));
                };
                if !dev.present {
                    return Some(format!("device {}/{d} is no longer reported", a.node));
                }
                if dev.spec.class != request.class {
                    return Some(format!(
                        "device {}/{d} is a {}, not a {}",
                        a.node, dev.spec.class, request.class
                    ));
                }
                if let Some(fault) = dev.quarantine.as_ref().or(dev.fault.as_ref()) {
                    return Some(format!("device {}/{d} is out of service ({fault})", a.node));
                }
                if let Some(other) = &dev.booked_by {
                    return Some(format!(
                        "device {}/{d} is already booked by reservation {other:?} (double booking)",
                        a.node
                    ));
                }
                let this = dev.spec.island.as_deref();
                island = match island {
                    None => Some(this),
                    Some(Some(i)) if this == Some(i) => Some(Some(i)),
                    Some(_) => Some(None),
                };
                count += 1;
            }
        }
        if count != request.gpus {
            return Some(format!(
                "{count} devices booked for a request of {}",
                request.gpus
            ));
        }
        match request.shape {
            Shape::Any => None,
            Shape::Node if allocations.len() != 1 => Some(format!(
                "shape node spread over {} nodes",
                allocations.len()
            )),
            Shape::Island if !matches!(island, Some(Some(_))) => {
                Some("shape island not within one NVLink island".into())
            }
            Shape::Gang {
                nodes,
                gpus_per_node,
            } if allocations.len() != nodes as usize
                || allocations
                    .iter()
                    .any(|a| a.devices.len() != gpus_per_node as usize) =>
            {
                Some(format!("gang of {nodes} x {gpus_per_node} not honoured"))
            }
            _ => self.topology_problem(p, request, allocations),
        }
    }

    /// What is wrong with a gang's placement in the topology it asked for.
    fn topology_problem(
        &self,
        p: &Pool,
        request: &Request,
        allocations: &[Allocation],
    ) -> Option<String> {
        use domain::Topology;
        let (tier, spread) = match request.topology? {
            Topology::Within(t) => (t, false),
            Topology::Spread(t) => (t, true),
            Topology::Prefer(_) => return None,
        };
        let label = |a: &Allocation| p.nodes.get(&a.node)?.label(tier);
        let labels: Vec<Option<&str>> = allocations.iter().map(label).collect();
        if labels.iter().any(Option::is_none) {
            return Some(format!("a node of the gang has no {}", tier.name()));
        }
        let distinct: BTreeSet<&str> = labels.iter().flatten().copied().collect();
        match spread {
            false if distinct.len() > 1 => Some(format!(
                "gang within one {} placed across {distinct:?}",
                tier.name()
            )),
            true if distinct.len() < allocations.len() => Some(format!(
                "gang spread over {}s placed twice in one",
                tier.name()
            )),
            _ => None,
        }
    }

    /// Checks that every booked device is booked by a live reservation that
    /// lists it, and that no MIG instance is booked with its GPU.
    pub fn check_bookings(&self) -> Result<(), String> {
        for (pool, p) in &self.state.pools {
            for (node, n) in &p.nodes {
                for (i, d) in n.devices.iter().enumerate() {
                    if d.booked_by.is_some() && d.spec.parent.is_some() && n.books_family(i) {
                        return Err(format!(
                            "MIG instance {pool}/{node}/{} and its GPU are booked at once",
                            d.spec.id
                        ));
                    }
                    if let Some(by) = &d.booked_by {
                        let ok = self.state.reservations.get(by).is_some_and(|r| {
                            r.phase.is_live()
                                && r.allocations
                                    .iter()
                                    .any(|a| &a.node == node && a.devices.contains(&d.spec.id))
                        });
                        if !ok {
                            return Err(format!(
                                "device {pool}/{node}/{} is booked by {by:?}, which does not hold it",
                                d.spec.id
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The error for a fact handed to a family function that does not fold it
/// (the dispatcher in `apply_fact` never does this; the match must still be
/// total).
fn not_of(family: &str, fact: &Fact) -> Result<(), String> {
    Err(format!("not {family} fact: {}", fact.event_type()))
}

/// A condition raised on `node` (or its GPU `device`): recorded, and, when
/// its action takes the GPU or node out of service, waiting for the
/// placer's answer (no new placement meanwhile). A GPU already quarantined
/// or a node already drained has had its answer.
fn raise(
    n: &mut super::Node,
    device: Option<&str>,
    condition: String,
    action: domain::faults::Action,
) {
    use domain::faults::Action;
    if let Some(list) = n.conditions_mut(device) {
        if !list.contains(&condition) {
            list.push(condition.clone());
        }
    } else {
        return;
    }
    if !action.takes_out_of_service() {
        return;
    }
    let device = device.and_then(|id| n.devices.iter_mut().find(|d| d.spec.id == id));
    match device {
        Some(d) if action != Action::DrainNode => {
            if d.quarantine.is_none() && d.fault.is_none() {
                d.fault = Some(condition);
            }
        }
        _ => {
            if n.drained.is_none() && n.fault.is_none() {
                n.fault = Some(condition);
            }
        }
    }
}
