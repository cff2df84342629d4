//! Eight threads hammer tight caps; an independent witness (atomics bumped
//! after a reservation succeeds and lowered before it is dropped, so they
//! never exceed what is really reserved) must never see a cap exceeded.
//!
//! With `--features check-then-act-mutant` admission checks and reserves in
//! two critical sections, as upstream did; the same stress test then sees
//! violations, which proves it can catch that race.
// Under `--cfg loom` the sync primitives only work inside `loom::model`.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{demand, ConfigBuilder, GIB};
use kici_admission::{Admission, AdmitError, Holds};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const THREADS: u32 = 8;
const ITERATIONS: u32 = 20_000;

// Caps chosen so that each kind binds for some mix of holders (a = 500m,
// b = 400m + 1 GiB): a+a+a hits scaler a's count (2); a+a+b hits the global
// cpu (1400m > 1300m); a+b+b fits exactly (1300m) and then hits the global
// count (3); b+b+b hits scaler b's memory (2 GiB).
const A_MAX: u64 = 2;
const B_MAX_MEM: u64 = 2 * GIB;
const GLOBAL_MAX: u64 = 3;
const GLOBAL_CPU: u64 = 1300;
const A_CPU: u64 = 500;
const B_CPU: u64 = 400;

#[derive(Default)]
struct Witness {
    global: AtomicU64,
    global_cpu: AtomicU64,
    a: AtomicU64,
    b_mem: AtomicU64,
    violations: AtomicU64,
    admitted: AtomicU64,
    refused: AtomicU64,
}

impl Witness {
    fn enter(&self, counter: &AtomicU64, amount: u64, limit: u64) {
        if counter.fetch_add(amount, Ordering::SeqCst) + amount > limit {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Runs the stress loop and returns (violations, admitted, refused).
fn stress() -> (u64, u64, u64) {
    let config = ConfigBuilder::new(GLOBAL_MAX as u32)
        .global_cap(Some(GLOBAL_CPU), None)
        .scaler("a", A_MAX as u32, Some(1500), None, None)
        .scaler("b", 4, None, Some(B_MAX_MEM), None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let w = Arc::new(Witness::default());
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let adm = adm.clone();
            let w = w.clone();
            std::thread::spawn(move || {
                for i in 0..ITERATIONS {
                    let id = t * ITERATIONS + i;
                    let on_a = (t + i) % 2 == 0;
                    let d = if on_a {
                        demand(id, "a", A_CPU, 0, None)
                    } else {
                        demand(id, "b", B_CPU, GIB, None)
                    };
                    match adm.try_reserve(d, &Holds::none()) {
                        Ok(r) => {
                            w.admitted.fetch_add(1, Ordering::Relaxed);
                            let cpu = if on_a { A_CPU } else { B_CPU };
                            w.enter(&w.global, 1, GLOBAL_MAX);
                            w.enter(&w.global_cpu, cpu, GLOBAL_CPU);
                            if on_a {
                                w.enter(&w.a, 1, A_MAX);
                            } else {
                                w.enter(&w.b_mem, GIB, B_MAX_MEM);
                            }
                            // Hold it across a reschedule point so that
                            // holders overlap.
                            std::thread::yield_now();
                            w.global.fetch_sub(1, Ordering::SeqCst);
                            w.global_cpu.fetch_sub(cpu, Ordering::SeqCst);
                            if on_a {
                                w.a.fetch_sub(1, Ordering::SeqCst);
                            } else {
                                w.b_mem.fetch_sub(GIB, Ordering::SeqCst);
                            }
                            drop(r);
                        }
                        Err(AdmitError::Refused(_)) => {
                            w.refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("unexpected admission error: {e}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let u = adm.usage();
    assert_eq!(
        (
            u.global.agents,
            u.global.cpu.millis(),
            u.global.memory.bytes()
        ),
        (0, 0, 0),
        "usage returns to zero"
    );
    (
        w.violations.load(Ordering::SeqCst),
        w.admitted.load(Ordering::SeqCst),
        w.refused.load(Ordering::SeqCst),
    )
}

#[cfg(not(feature = "check-then-act-mutant"))]
#[test]
fn eight_threads_never_exceed_any_cap() {
    let (violations, admitted, refused) = stress();
    assert_eq!(violations, 0, "cap violations: {violations}");
    // The caps really were contended.
    assert!(
        admitted > 0 && refused > 0,
        "admitted {admitted}, refused {refused}"
    );
}

/// Proof that the stress test catches the check-then-act race: with the
/// mutant, it must report violations.
#[cfg(feature = "check-then-act-mutant")]
#[test]
#[should_panic(expected = "cap violations")]
fn the_stress_test_catches_a_check_then_act_admission() {
    let (violations, admitted, refused) = stress();
    eprintln!("mutant: {violations} violations, {admitted} admitted, {refused} refused");
    assert_eq!(violations, 0, "cap violations: {violations}");
}
