//! Admission semantics: every cap, the order of checks, exact caps, holds,
//! refusals that change nothing, reservations released exactly once, reload.
// Under `--cfg loom` the sync primitives only work inside `loom::model`.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{agent, demand, res, ConfigBuilder, GIB};
use kici_admission::{Admission, AdmitError, Cap, Holds, Refusal, Reservation, UsageSnapshot};
use kici_model::ScalerName;

fn refused(r: Result<Reservation, AdmitError>) -> Refusal {
    match r {
        Err(AdmitError::Refused(refusal)) => refusal,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn none() -> Holds {
    Holds::none()
}

fn is_empty(u: &UsageSnapshot) -> bool {
    u.global.agents == 0
        && u.global.cpu.millis() == 0
        && u.global.memory.bytes() == 0
        && u.scalers
            .values()
            .chain(u.pools.values())
            .all(|s| s.agents == 0 && s.cpu.millis() == 0 && s.memory.bytes() == 0)
}

/// For each cap: a configuration where only that cap binds; requests fill
/// it exactly (admitted), and one more is refused naming that cap.
#[test]
fn every_cap_admits_up_to_exactly_its_limit_then_refuses() {
    // (cap, config, request cpu, request memory, how many fit)
    let cases = [
        (
            Cap::GlobalCount,
            ConfigBuilder::new(3).scaler("s", 10, None, None, None),
            0,
            0,
            3,
        ),
        (
            Cap::ScalerCount,
            ConfigBuilder::new(10).scaler("s", 2, None, None, None),
            0,
            0,
            2,
        ),
        (
            Cap::ScalerCpu,
            ConfigBuilder::new(10).scaler("s", 10, Some(2000), None, None),
            500,
            0,
            4,
        ),
        (
            Cap::ScalerMemory,
            ConfigBuilder::new(10).scaler("s", 10, None, Some(3 * GIB), None),
            0,
            GIB,
            3,
        ),
        (
            Cap::GlobalCpu,
            ConfigBuilder::new(10)
                .global_cap(Some(1500), None)
                .scaler("s", 10, None, None, None),
            500,
            0,
            3,
        ),
        (
            Cap::GlobalMemory,
            ConfigBuilder::new(10)
                .global_cap(None, Some(2 * GIB))
                .scaler("s", 10, None, None, None),
            0,
            GIB,
            2,
        ),
        (
            Cap::PoolCpu,
            ConfigBuilder::new(10).pool("p", Some(1000), None).scaler(
                "s",
                10,
                None,
                None,
                Some("p"),
            ),
            250,
            0,
            4,
        ),
        (
            Cap::PoolMemory,
            ConfigBuilder::new(10).pool("p", None, Some(GIB)).scaler(
                "s",
                10,
                None,
                None,
                Some("p"),
            ),
            0,
            GIB / 2,
            2,
        ),
    ];
    for (cap, config, cpu, mem, fits) in cases {
        let config = config.build();
        let adm = Admission::new(&config, None).unwrap();
        let pool = config.scalers[0].machine_pool.as_deref();
        let held: Vec<_> = (0..fits)
            .map(|i| {
                adm.try_reserve(demand(i, "s", cpu, mem, pool), &none())
                    .unwrap_or_else(|e| panic!("{cap}: reservation {i} of {fits}: {e}"))
            })
            .collect();
        let r = refused(adm.try_reserve(demand(99, "s", cpu, mem, pool), &none()));
        assert_eq!(r.cap, cap, "{r}");
        assert_eq!(r.held, 0);
        let (requested, limit) = match cap.unit() {
            kici_admission::CapUnit::Agents => (1, u64::from(fits)),
            kici_admission::CapUnit::MilliCpu => (cpu, cpu * u64::from(fits)),
            kici_admission::CapUnit::Bytes => (mem, mem * u64::from(fits)),
        };
        assert_eq!(
            (r.requested, r.used, r.limit),
            (requested, limit, limit),
            "{cap}"
        );
        drop(held);
        assert!(is_empty(&adm.usage()), "{cap}: everything released");
    }
}

#[test]
fn checks_run_in_the_documented_order() {
    // One (1000m, 1g) reservation fills every cap at once; the next request
    // is refused by each cap in turn as the earlier ones are lifted.
    let base = |global_max: u32, scaler_max: u32| {
        ConfigBuilder::new(global_max)
            .global_cap(Some(1000), Some(GIB))
            .pool("p", Some(1000), Some(GIB))
            .scaler("s", scaler_max, Some(1000), Some(GIB), Some("p"))
    };
    let adm = Admission::new(&base(1, 1).build(), None).unwrap();
    let _first = adm
        .try_reserve(demand(1, "s", 1000, GIB, Some("p")), &none())
        .unwrap();
    let next = || refused(adm.try_reserve(demand(2, "s", 1000, GIB, Some("p")), &none())).cap;

    let steps = [
        (base(1, 1), Cap::GlobalCount),
        (base(5, 1), Cap::ScalerCount),
        (base(5, 5), Cap::ScalerCpu),
        (
            ConfigBuilder::new(5)
                .global_cap(Some(1000), Some(GIB))
                .pool("p", Some(1000), Some(GIB))
                .scaler("s", 5, None, Some(GIB), Some("p")),
            Cap::ScalerMemory,
        ),
        (
            ConfigBuilder::new(5)
                .global_cap(Some(1000), Some(GIB))
                .pool("p", Some(1000), Some(GIB))
                .scaler("s", 5, None, None, Some("p")),
            Cap::GlobalCpu,
        ),
        (
            ConfigBuilder::new(5)
                .global_cap(None, Some(GIB))
                .pool("p", Some(1000), Some(GIB))
                .scaler("s", 5, None, None, Some("p")),
            Cap::GlobalMemory,
        ),
        (
            ConfigBuilder::new(5)
                .pool("p", Some(1000), Some(GIB))
                .scaler("s", 5, None, None, Some("p")),
            Cap::PoolCpu,
        ),
        (
            ConfigBuilder::new(5)
                .pool("p", None, Some(GIB))
                .scaler("s", 5, None, None, Some("p")),
            Cap::PoolMemory,
        ),
    ];
    for (config, expected) in steps {
        adm.reconfigure(&config.build()).unwrap();
        assert_eq!(next(), expected);
    }
    adm.reconfigure(
        &ConfigBuilder::new(5)
            .pool("p", None, None)
            .scaler("s", 5, None, None, Some("p"))
            .build(),
    )
    .unwrap();
    let second = adm
        .try_reserve(demand(2, "s", 1000, GIB, Some("p")), &none())
        .unwrap();
    assert_eq!(adm.usage().global.agents, 2);
    drop(second);
}

#[test]
fn integer_sums_admit_at_the_exact_cap() {
    // Upstream's floats refused 0.1 + 0.2 against a 0.3 cap.
    let config = ConfigBuilder::new(10)
        .scaler("s", 10, Some(300), None, None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let _a = adm
        .try_reserve(demand(1, "s", 100, 0, None), &none())
        .unwrap();
    let _b = adm
        .try_reserve(demand(2, "s", 200, 0, None), &none())
        .unwrap();
    let r = refused(adm.try_reserve(demand(3, "s", 1, 0, None), &none()));
    assert_eq!(
        r.to_string(),
        "scaler-cpu: needs 1m, 300m of 300m used, short by 1m"
    );
}

#[test]
fn unset_dimensions_and_zero_requests_never_refuse() {
    let config = ConfigBuilder::new(100)
        .global_cap(Some(1000), None)
        .scaler("cpu-only", 100, Some(1000), None, None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let _big = adm
        .try_reserve(demand(1, "cpu-only", 1000, 1 << 50, None), &none())
        .unwrap();
    // Every cpu is used; zero-cpu requests still fit.
    let zeros: Vec<_> = (2..50)
        .map(|i| {
            adm.try_reserve(demand(i, "cpu-only", 0, 1 << 40, None), &none())
                .unwrap()
        })
        .collect();
    assert_eq!(adm.usage().global.agents, 49);
    drop(zeros);
}

#[test]
fn a_refusal_or_an_error_changes_nothing() {
    let config = ConfigBuilder::new(10)
        .pool("p", Some(2000), None)
        .scaler("s", 2, Some(2000), None, Some("p"))
        .scaler("t", 5, None, None, None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let _a = adm
        .try_reserve(demand(1, "s", 1500, GIB, Some("p")), &none())
        .unwrap();
    let before = adm.usage();
    let generation = adm.subscribe_releases().generation();

    let attempts: Vec<(&str, Result<Reservation, AdmitError>)> = vec![
        (
            "refused",
            adm.try_reserve(demand(2, "s", 1000, 0, Some("p")), &none()),
        ),
        (
            "too large",
            adm.try_reserve(demand(3, "s", 2001, 0, Some("p")), &none()),
        ),
        (
            "unknown scaler",
            adm.try_reserve(demand(4, "gone", 0, 0, None), &none()),
        ),
        (
            "pool mismatch",
            adm.try_reserve(demand(5, "s", 0, 0, None), &none()),
        ),
        (
            "pool mismatch 2",
            adm.try_reserve(demand(5, "t", 0, 0, Some("p")), &none()),
        ),
        (
            "duplicate agent",
            adm.try_reserve(demand(1, "t", 0, 0, None), &none()),
        ),
    ];
    for (what, r) in attempts {
        let err = r.expect_err(what);
        match (what, &err) {
            ("refused", AdmitError::Refused(r)) => assert_eq!(r.cap, Cap::ScalerCpu),
            ("too large", AdmitError::TooLarge(t)) => assert_eq!(t.cap, Cap::ScalerCpu),
            ("unknown scaler", AdmitError::UnknownScaler(n)) => assert_eq!(n.as_str(), "gone"),
            ("pool mismatch" | "pool mismatch 2", AdmitError::PoolMismatch { .. }) => {}
            ("duplicate agent", AdmitError::DuplicateAgent(a)) => assert_eq!(*a, agent(1)),
            _ => panic!("{what}: unexpected {err}"),
        }
        assert_eq!(adm.usage(), before, "{what} changed usage");
    }
    assert_eq!(
        adm.subscribe_releases().generation(),
        generation,
        "nothing was released"
    );
}

#[test]
fn too_large_is_a_pure_check_against_cap_totals() {
    let config = ConfigBuilder::new(10)
        .global_cap(Some(8000), Some(8 * GIB))
        .pool("p", Some(4000), Some(4 * GIB))
        .scaler("s", 3, Some(2000), Some(2 * GIB), Some("p"))
        .scaler("free", 3, None, None, None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let tl = |s: &str, cpu, mem, pool| adm.too_large(s, res(cpu, mem), pool).map(|t| t.cap);
    assert_eq!(
        tl("s", 2000, 2 * GIB, Some("p")),
        None,
        "exactly the cap fits"
    );
    assert_eq!(tl("s", 2001, 0, Some("p")), Some(Cap::ScalerCpu));
    assert_eq!(tl("s", 0, 2 * GIB + 1, Some("p")), Some(Cap::ScalerMemory));
    assert_eq!(tl("free", 8001, 0, None), Some(Cap::GlobalCpu));
    assert_eq!(tl("free", 0, 8 * GIB + 1, None), Some(Cap::GlobalMemory));
    assert_eq!(tl("missing", 0, 0, None), Some(Cap::ScalerCount));
    assert_eq!(tl("s", 0, 0, Some("nope")), Some(Cap::PoolCpu));
    let t = adm.too_large("s", res(3000, 0), Some("p")).unwrap();
    assert_eq!(
        t.to_string(),
        "scaler-cpu: requests 3000m but scaler s resourceCap.maxCpu is 2000m"
    );

    let config = ConfigBuilder::new(10)
        .pool("p", Some(4000), Some(GIB))
        .scaler("s", 3, None, None, Some("p"))
        .build();
    adm.reconfigure(&config).unwrap();
    assert_eq!(tl("s", 4001, 0, Some("p")), Some(Cap::PoolCpu));
    assert_eq!(tl("s", 0, GIB + 1, Some("p")), Some(Cap::PoolMemory));
    // try_reserve says too-large (never fits), not refused (wait), even
    // when the cap is currently full.
    let _a = adm
        .try_reserve(demand(1, "s", 4000, 0, Some("p")), &none())
        .unwrap();
    assert!(matches!(
        adm.try_reserve(demand(2, "s", 4001, 0, Some("p")), &none()),
        Err(AdmitError::TooLarge(t)) if t.cap == Cap::PoolCpu
    ));
}

#[test]
fn a_reservation_is_released_exactly_once_by_drop_or_release() {
    let config = ConfigBuilder::new(10)
        .scaler("s", 10, Some(4000), Some(4 * GIB), None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let mut signal = adm.subscribe_releases();
    let a = adm
        .try_reserve(demand(1, "s", 1000, GIB, None), &none())
        .unwrap();
    let b = adm
        .try_reserve(demand(2, "s", 2000, 2 * GIB, None), &none())
        .unwrap();
    assert_eq!(
        (a.agent(), a.scaler().as_str(), a.requests()),
        (agent(1), "s", res(1000, GIB))
    );
    assert!(!signal.take_released());

    a.release();
    let u = adm.usage();
    assert_eq!(
        (
            u.global.agents,
            u.global.cpu.millis(),
            u.global.memory.bytes()
        ),
        (1, 2000, 2 * GIB)
    );
    assert_eq!(u.scalers["s"].agents, 1);
    assert!(signal.take_released());
    assert_eq!(signal.generation(), 1, "one release, one bump");

    drop(b);
    assert!(is_empty(&adm.usage()));
    assert_eq!(signal.generation(), 2);
    // The id is free again.
    let again = adm
        .try_reserve(demand(1, "s", 4000, 4 * GIB, None), &none())
        .unwrap();
    drop(again);
    assert!(is_empty(&adm.usage()));
}

#[test]
fn reservations_outlive_a_reload_and_release_what_they_added() {
    let old = ConfigBuilder::new(10)
        .pool("p", Some(4000), None)
        .pool("q", Some(4000), None)
        .scaler("a", 5, Some(3000), None, Some("p"))
        .scaler("b", 5, None, None, None)
        .build();
    let adm = Admission::new(&old, None).unwrap();
    let a = adm
        .try_reserve(demand(1, "a", 2000, GIB, Some("p")), &none())
        .unwrap();
    let b = adm
        .try_reserve(demand(2, "b", 1000, 0, None), &none())
        .unwrap();

    // Reload: scaler a removed, b moved into pool q with a lower count cap
    // than it uses... and global lowered below current usage.
    let new = ConfigBuilder::new(1)
        .pool("q", Some(4000), None)
        .scaler("b", 1, None, None, Some("q"))
        .build();
    let mut signal = adm.subscribe_releases();
    adm.reconfigure(&new).unwrap();
    assert!(signal.take_released(), "a reload wakes pending requests");
    let u = adm.usage();
    assert_eq!(u.global.agents, 2, "usage is kept");
    assert!(!u.scalers["a"].configured && u.scalers["a"].agents == 1);
    assert!(!u.pools["p"].configured && u.pools["p"].cpu.millis() == 2000);
    assert!(u.scalers["b"].configured);
    assert_eq!(u.scalers["b"].caps.max_agents, Some(1));
    assert!(matches!(
        adm.try_reserve(demand(3, "a", 0, 0, Some("p")), &none()),
        Err(AdmitError::UnknownScaler(_))
    ));
    assert_eq!(
        refused(adm.try_reserve(demand(3, "b", 0, 0, Some("q")), &none())).cap,
        Cap::GlobalCount
    );

    drop(a);
    let u = adm.usage();
    assert!(
        !u.scalers.contains_key("a"),
        "removed scaler forgotten once idle"
    );
    assert!(!u.pools.contains_key("p"));
    assert_eq!((u.global.agents, u.global.cpu.millis()), (1, 1000));
    assert_eq!(u.pools["q"].agents, 0, "b's old reservation was not in q");
    drop(b);
    assert!(is_empty(&adm.usage()));
    assert_eq!(adm.usage().scalers["b"].agents, 0);
}

#[test]
fn holds_make_younger_requests_wait_for_a_starved_one() {
    let config = ConfigBuilder::new(10)
        .pool("p", None, Some(4 * GIB))
        .scaler("s", 10, Some(4000), None, Some("p"))
        .scaler("t", 10, None, None, Some("p"))
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let _running = adm
        .try_reserve(demand(1, "s", 2000, 0, Some("p")), &none())
        .unwrap();

    // A starved request needs 2000m on s; a younger one asks for 1000m.
    let starved = demand(2, "s", 2000, 2 * GIB, Some("p"));
    let mut holds = Holds::none();
    holds.add_demand(&starved);
    assert!(!holds.is_empty());
    let r = refused(adm.try_reserve(demand(3, "s", 1000, 0, Some("p")), &holds));
    assert_eq!(
        (r.cap, r.used, r.held, r.limit),
        (Cap::ScalerCpu, 2000, 2000, 4000)
    );
    assert_eq!(r.to_string(), "scaler-cpu: needs 1000m, 2000m of 4000m used, 2000m held for older requests, short by 1000m");
    // The pool is held too: a younger request on another scaler of the pool.
    let r = refused(adm.try_reserve(demand(4, "t", 0, 3 * GIB, Some("p")), &holds));
    assert_eq!((r.cap, r.held), (Cap::PoolMemory, 2 * GIB));
    // What the holds leave free is still usable.
    let small = adm
        .try_reserve(demand(5, "t", 0, 2 * GIB, Some("p")), &holds)
        .unwrap();
    drop(small);
    // The starved request itself is tried with the holds of older ones only.
    let granted = adm.try_reserve(starved, &Holds::none()).unwrap();
    assert_eq!(adm.usage().scalers["s"].cpu.millis(), 4000);
    drop(granted);
    let mut counted = Holds::none();
    counted.add(&ScalerName::new("s"), res(0, 0), None);
    let mut many = Holds::none();
    for _ in 0..9 {
        many.add(&ScalerName::new("t"), res(0, 0), None);
    }
    assert_eq!(
        refused(adm.try_reserve(demand(6, "t", 0, 0, Some("p")), &many)).cap,
        Cap::GlobalCount
    );
    let r = refused(adm.try_reserve(demand(6, "s", 0, 0, Some("p")), &{
        let mut h = many.clone();
        h.add(&ScalerName::new("s"), res(0, 0), None);
        h
    }));
    assert_eq!((r.cap, r.used, r.held), (Cap::GlobalCount, 1, 10));
    assert!(adm
        .try_reserve(demand(6, "s", 0, 0, Some("p")), &counted)
        .is_ok());
}

#[test]
fn release_signal_wakes_an_async_waiter() {
    use std::future::Future;
    use std::pin::pin;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let config = ConfigBuilder::new(1)
        .scaler("s", 1, None, None, None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let r = adm
        .try_reserve(demand(1, "s", 0, 0, None), &none())
        .unwrap();
    let mut signal = adm.subscribe_releases();
    assert_eq!(
        refused(adm.try_reserve(demand(2, "s", 0, 0, None), &none())).cap,
        Cap::GlobalCount
    );

    let flag = Arc::new(Flag(AtomicBool::new(false)));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    let mut released = pin!(signal.released());
    assert!(released.as_mut().poll(&mut cx).is_pending());
    drop(r);
    assert!(flag.0.load(Ordering::SeqCst), "the drop woke the waiter");
    assert!(released.as_mut().poll(&mut cx).is_ready());
    assert!(adm.try_reserve(demand(2, "s", 0, 0, None), &none()).is_ok());
}

#[test]
fn admission_is_a_shared_send_sync_handle() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Admission>();
    assert_send_sync::<Reservation>();
    let config = ConfigBuilder::new(2)
        .scaler("s", 2, None, None, None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let clone = adm.clone();
    let r = clone
        .try_reserve(demand(1, "s", 0, 0, None), &none())
        .unwrap();
    assert_eq!(adm.usage().global.agents, 1);
    let json = serde_json::to_value(adm.usage()).unwrap();
    assert_eq!(json["global"]["agents"], 1);
    assert_eq!(json["global"]["caps"]["maxAgents"], 2);
    assert_eq!(json["scalers"]["s"]["configured"], true);
    drop(r);
}

#[test]
fn a_scaler_naming_an_undefined_pool_is_rejected() {
    let config = ConfigBuilder::new(2)
        .scaler("s", 2, None, None, Some("nope"))
        .build();
    let err = Admission::new(&config, None).unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
    let good = ConfigBuilder::new(2)
        .scaler("s", 2, None, None, None)
        .build();
    let adm = Admission::new(&good, None).unwrap();
    let r = adm
        .try_reserve(demand(1, "s", 0, 0, None), &none())
        .unwrap();
    assert!(adm.reconfigure(&config).is_err());
    assert_eq!(
        adm.usage().scalers["s"].caps.max_agents,
        Some(2),
        "a failed reload changes nothing"
    );
    drop(r);
}

#[test]
fn adopt_counts_existing_agents_beyond_caps() {
    let config = ConfigBuilder::new(1)
        .scaler("s", 1, Some(1000), None, None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let a = adm.adopt(demand(1, "s", 1000, 0, None)).unwrap();
    let b = adm.adopt(demand(2, "s", 1000, 0, None)).unwrap();
    assert_eq!(adm.usage().global.agents, 2);
    assert!(matches!(
        adm.adopt(demand(2, "s", 0, 0, None)),
        Err(AdmitError::DuplicateAgent(_))
    ));
    assert_eq!(
        refused(adm.try_reserve(demand(3, "s", 0, 0, None), &none())).cap,
        Cap::GlobalCount
    );
    drop((a, b));
    assert!(is_empty(&adm.usage()));
}

#[test]
fn a_reload_forgets_idle_removed_scalers_and_pools_at_once() {
    let old = ConfigBuilder::new(10)
        .pool("p", Some(4000), None)
        .scaler("a", 5, None, None, Some("p"))
        .scaler("b", 5, None, None, None)
        .build();
    let adm = Admission::new(&old, None).unwrap();
    // `a` has been used and is idle again when the reload removes it.
    let r = adm
        .try_reserve(demand(1, "a", 1000, 0, Some("p")), &none())
        .unwrap();
    assert_eq!(r.pool(), Some("p"));
    assert_eq!(r.scaler().as_str(), "a");
    assert_eq!(r.requests().cpu.millis(), 1000);
    drop(r);
    let new = ConfigBuilder::new(10)
        .scaler("b", 5, None, None, None)
        .build();
    adm.reconfigure(&new).unwrap();
    let u = adm.usage();
    assert!(!u.scalers.contains_key("a"), "{:?}", u.scalers.keys());
    assert!(!u.pools.contains_key("p"));
    assert!(adm.ledger().is_none());
}
