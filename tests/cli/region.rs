//! The region drill in a small form: every role as its own `strata serve`
//! process, 200 simulated nodes joining with tokens, each fault once
//! (power cycle, gateway, placer, binder and sinks SIGKILLed, a gateway
//! killed with its nodes, PostgreSQL crashed, walsenders terminated, a slot
//! dropped, a gateway and a placer cut off from PostgreSQL and a gateway
//! from its nodes in network namespaces, a lossy link, the primary killed
//! and a synchronous standby promoted) and the invariant checker after each
//! and at the end. `bench region` is the same drill at 10,000
//! nodes with the measurements.

use std::time::Duration;

#[test]
fn a_small_region_survives_every_fault_with_nothing_lost_or_doubled() {
    let mut o = bench::region::Options::sized(env!("CARGO_BIN_EXE_strata").into(), 200);
    o.steady = Duration::from_secs(5);
    o.outage = Duration::from_secs(3);
    o.return_home = Duration::from_secs(2);
    o.spread_wait = Duration::from_secs(40);
    o.patience = Duration::from_secs(120);
    o.partition = Duration::from_secs(10);
    o.node_lost_after = Duration::from_secs(10);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(bench::region::drill(o)).expect("the drill ran");
    assert_eq!(
        r["violations"], 0,
        "no invariant broken: {:#}",
        r["violation_list"]
    );
    assert!(
        r["cold_start_all_schedulable_s"].is_number(),
        "every node joined and became schedulable: {:#}",
        r["scenarios"]["cold_start"]
    );
    for (name, s) in r["scenarios"].as_object().unwrap() {
        if name != "cold_start" {
            assert!(
                s["recovery_s"].is_number(),
                "a reservation went the whole way after {name}: {s:#}"
            );
        }
    }
    let g = &r["scenarios"]["gateway_kill"];
    assert_eq!(g["all_rehomed"], true, "{g:#}");
    assert_eq!(g["false_unreachable"], 0, "{g:#}");
    assert_eq!(g["commands_run_twice"], 0, "{g:#}");
    assert!(
        g["spread_back_s"].is_number(),
        "the killed gateway's nodes went back to it: {g:#}"
    );
    for cut in ["gateway_cut_from_postgres", "rack_cut_from_gateway"] {
        let c = &r["scenarios"][cut];
        assert_eq!(c["all_rehomed"], true, "{cut}: {c:#}");
    }
    let p = &r["scenarios"]["placer_cut_from_postgres"];
    assert!(
        p["detection_s"].is_number(),
        "its pools were taken over: {p:#}"
    );
    let rack = &r["scenarios"]["rack_power_loss"];
    assert!(
        rack["gpus_free_s"].is_number(),
        "the dead rack's GPUs were freed: {rack:#}"
    );
    assert_eq!(r["commands_run_twice"], 0);
    assert_eq!(r["scenarios"]["power_cycle"]["all_reconnected"], true);
    assert!(
        r["scenarios"]["standby_promoted"]["recovery_s"].is_number(),
        "the region went on against the promoted standby: {:#}",
        r["scenarios"]["standby_promoted"]
    );
    assert_eq!(
        r["jetstream_checked"], true,
        "nats-server is on this machine"
    );
}
