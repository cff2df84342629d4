//! Admission latency and contention.
//!
//! - `try_reserve_drop/no_pool`: one thread, a try_reserve plus the drop of
//!   its Reservation, against a ten-scaler configuration with every cap set.
//! - `try_reserve_drop/refused`: the refusal path (a full count cap).
//! - `try_reserve_drop/ledger_pool`: the same with a machine pool in the
//!   ledger (two flock + fsync'd read-modify-writes per iteration).
//! - `contention/8_threads`: eight threads hammer tight caps; throughput of
//!   attempts (admitted or refused); a witness asserts zero cap violations.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use common::{demand, ConfigBuilder, GIB};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kici_admission::{Admission, Holds, MachineLedger};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn ten_scalers() -> ConfigBuilder {
    (0..10).fold(
        ConfigBuilder::new(500).global_cap(Some(1_000_000), Some(1 << 50)),
        |c, i| c.scaler(&format!("s{i}"), 50, Some(100_000), Some(1 << 45), None),
    )
}

fn single_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("try_reserve_drop");
    g.throughput(Throughput::Elements(1));

    let adm = Admission::new(&ten_scalers().build(), None).unwrap();
    let holds = Holds::none();
    g.bench_function("no_pool", |b| {
        b.iter(|| {
            let r = adm
                .try_reserve(black_box(demand(1, "s7", 500, GIB, None)), &holds)
                .unwrap();
            drop(black_box(r));
        })
    });

    let full = Admission::new(
        &ConfigBuilder::new(1)
            .scaler("s", 1, None, None, None)
            .build(),
        None,
    )
    .unwrap();
    let _hold = full
        .try_reserve(demand(1, "s", 0, 0, None), &holds)
        .unwrap();
    g.bench_function("refused", |b| {
        b.iter(|| {
            black_box(full.try_reserve(black_box(demand(2, "s", 0, 0, None)), &holds)).is_err()
        })
    });

    let dir = tempfile::tempdir().unwrap();
    let ledger = MachineLedger::open(Some(dir.path()), "0be4c100".parse().unwrap()).unwrap();
    let pooled = ConfigBuilder::new(10)
        .pool("bench", Some(4000), None)
        .scaler("s", 10, None, None, Some("bench"))
        .build();
    let adm = Admission::new(&pooled, Some(ledger)).unwrap();
    g.bench_function("ledger_pool", |b| {
        b.iter(|| {
            let r = adm
                .try_reserve(black_box(demand(1, "s", 1000, 0, Some("bench"))), &holds)
                .unwrap();
            drop(black_box(r));
        })
    });
    g.finish();
}

fn contention(c: &mut Criterion) {
    const THREADS: u64 = 8;
    const MAX: u64 = 3;
    let mut g = c.benchmark_group("contention");
    g.throughput(Throughput::Elements(1));
    let config = ConfigBuilder::new(MAX as u32)
        .global_cap(Some(2000), None)
        .scaler("s", 10, None, None, None)
        .build();
    let adm = Admission::new(&config, None).unwrap();
    let live = Arc::new(AtomicU64::new(0));
    let violations = Arc::new(AtomicU64::new(0));
    let admitted = Arc::new(AtomicU64::new(0));
    g.bench_function("8_threads", |b| {
        b.iter_custom(|iters| {
            let per_thread = iters.div_ceil(THREADS);
            let start = Instant::now();
            let threads: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (adm, live, violations, admitted) = (
                        adm.clone(),
                        live.clone(),
                        violations.clone(),
                        admitted.clone(),
                    );
                    std::thread::spawn(move || {
                        let holds = Holds::none();
                        for i in 0..per_thread {
                            let id = (t * per_thread + i) as u32;
                            if let Ok(r) = adm.try_reserve(demand(id, "s", 600, 0, None), &holds) {
                                // 600m each against a 2000m cap: 3 fit (the
                                // count cap is 3 too).
                                if live.fetch_add(1, Ordering::SeqCst) + 1 > MAX {
                                    violations.fetch_add(1, Ordering::SeqCst);
                                }
                                admitted.fetch_add(1, Ordering::Relaxed);
                                live.fetch_sub(1, Ordering::SeqCst);
                                drop(r);
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            start.elapsed()
        })
    });
    g.finish();
    assert_eq!(
        violations.load(Ordering::SeqCst),
        0,
        "cap violations under contention"
    );
    assert!(admitted.load(Ordering::SeqCst) > 0);
    assert_eq!(adm.usage().global.agents, 0);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3));
    targets = single_thread, contention
}
criterion_main!(benches);
