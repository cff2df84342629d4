//! Model checking of the admission critical section with loom: every
//! interleaving of concurrent `try_reserve`, `drop(Reservation)` and
//! `reconfigure` on a tiny cap. Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p kici-admission --test it --release loom::`
//! (with `--features check-then-act-mutant` every model must find upstream's
//! race: the tests then expect the panic).
#![cfg(loom)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{demand, ConfigBuilder};
use kici_admission::{Admission, AdmitError, Holds};
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;

/// Reserve, witness (after success: the witness never exceeds the truth),
/// release (witness lowered first).
fn attempt(adm: &Admission, live: &AtomicU64, cap: u64, id: u32, cpu: u64) {
    match adm.try_reserve(demand(id, "s", cpu, 0, None), &Holds::none()) {
        Ok(r) => {
            let now = live.fetch_add(1, Ordering::SeqCst) + 1;
            assert!(
                now <= cap,
                "cap exceeded: {now} live reservations, cap {cap}"
            );
            live.fetch_sub(1, Ordering::SeqCst);
            drop(r);
        }
        Err(AdmitError::Refused(_)) => {}
        Err(e) => panic!("unexpected: {e}"),
    }
}

/// Bounded preemptions (3) keep the run to seconds; a check-then-act race
/// needs only one preemption, so the bound does not hide it.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

fn assert_empty(adm: &Admission) {
    let u = adm.usage();
    assert_eq!(
        (u.global.agents, u.global.cpu.millis()),
        (0, 0),
        "usage returns to zero"
    );
    assert_eq!(u.scalers["s"].agents, 0);
}

/// The count cap (1) binds; a reload swaps the cpu cap underneath.
#[test]
#[cfg_attr(
    feature = "check-then-act-mutant",
    should_panic(expected = "cap exceeded")
)]
fn count_cap_holds_under_concurrent_reserve_drop_and_reload() {
    model(|| {
        let a = ConfigBuilder::new(5)
            .scaler("s", 1, Some(4000), None, None)
            .build();
        let b = ConfigBuilder::new(5)
            .scaler("s", 1, Some(2000), None, None)
            .build();
        let adm = Admission::new(&a, None).unwrap();
        let live = Arc::new(AtomicU64::new(0));
        let workers: Vec<_> = (0..2)
            .map(|id| {
                let adm = adm.clone();
                let live = live.clone();
                loom::thread::spawn(move || attempt(&adm, &live, 1, id, 1000))
            })
            .collect();
        adm.reconfigure(&b).unwrap();
        for w in workers {
            w.join().unwrap();
        }
        assert_empty(&adm);
    });
}

/// The cpu cap binds (1500m, 1000m requests: one at a time) while the count
/// cap would allow two; the reload lowers the cap to exactly one request.
#[test]
#[cfg_attr(
    feature = "check-then-act-mutant",
    should_panic(expected = "cap exceeded")
)]
fn cpu_cap_holds_under_concurrent_reserve_drop_and_reload() {
    model(|| {
        let a = ConfigBuilder::new(5)
            .global_cap(Some(1500), None)
            .scaler("s", 2, None, None, None)
            .build();
        let b = ConfigBuilder::new(5)
            .global_cap(Some(1000), None)
            .scaler("s", 2, None, None, None)
            .build();
        let adm = Admission::new(&a, None).unwrap();
        let live = Arc::new(AtomicU64::new(0));
        let workers: Vec<_> = (0..2)
            .map(|id| {
                let adm = adm.clone();
                let live = live.clone();
                loom::thread::spawn(move || attempt(&adm, &live, 1, id, 1000))
            })
            .collect();
        adm.reconfigure(&b).unwrap();
        for w in workers {
            w.join().unwrap();
        }
        assert_empty(&adm);
    });
}

/// A reservation dropped on another thread while two more compete: the
/// release is seen exactly once and nothing leaks.
#[test]
#[cfg_attr(
    feature = "check-then-act-mutant",
    should_panic(expected = "cap exceeded")
)]
fn release_on_another_thread_is_counted_once() {
    model(|| {
        let config = ConfigBuilder::new(5)
            .scaler("s", 1, None, None, None)
            .build();
        let adm = Admission::new(&config, None).unwrap();
        let live = Arc::new(AtomicU64::new(0));
        let first = adm
            .try_reserve(demand(100, "s", 0, 0, None), &Holds::none())
            .unwrap();
        live.fetch_add(1, Ordering::SeqCst);
        let mut signal = adm.subscribe_releases();
        let dropper = {
            let live = live.clone();
            loom::thread::spawn(move || {
                live.fetch_sub(1, Ordering::SeqCst);
                drop(first);
            })
        };
        let competitor = {
            let adm = adm.clone();
            let live = live.clone();
            loom::thread::spawn(move || attempt(&adm, &live, 1, 1, 0))
        };
        attempt(&adm, &live, 1, 2, 0);
        dropper.join().unwrap();
        competitor.join().unwrap();
        assert!(signal.take_released());
        assert_empty(&adm);
    });
}
