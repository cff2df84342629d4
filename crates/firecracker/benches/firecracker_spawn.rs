//! Spawn latency through the real backend against testkit's `fc-sim` and
//! `fake-jailer` (root: real TAP, bridge, ext4 overlay), and a sweep of
//! orphaned TAPs + VM directories against an `ip link del` + `rm -rf` loop
//! over the same set. Not run in CI.
//!
//! `cargo bench -p kici-firecracker --bench firecracker_spawn -- --warm-up-time 1 --measurement-time 2`
//! (`KICI_TESTKIT_PROFILE=release` for a release simulator). Besides
//! criterion's numbers it prints, per phase, the median and p99 of
//! `spawn_timed` over the measured spawns: our own phases (dir, lease, TAP,
//! rules, chroot, overlay) apart from those that include the VMM (jailer,
//! socket, API calls).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/support/mod.rs"]
mod support;

use criterion::{criterion_group, criterion_main, Criterion};
use kici_engine::Backend;
use kici_firecracker::names::{owner_tag, tap_name};
use kici_firecracker::SpawnTimings;
use kici_testkit::fc::GuestSetup;
use std::collections::HashSet;
use std::time::{Duration, Instant};
use support::{random_agent, Binaries, Harness};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(all: &[SpawnTimings]) {
    let phase = |name: &str, f: &dyn Fn(&SpawnTimings) -> Duration| {
        let mut v: Vec<Duration> = all.iter().map(f).collect();
        v.sort();
        println!(
            "  {name:<8} median {:>8.2} ms   p99 {:>8.2} ms",
            percentile(&v, 0.5).as_secs_f64() * 1e3,
            percentile(&v, 0.99).as_secs_f64() * 1e3
        );
    };
    println!("spawn phases over {} spawns:", all.len());
    phase("dir", &|t| t.vm_dir);
    phase("lease", &|t| t.lease);
    phase("tap", &|t| t.tap);
    phase("rules", &|t| t.rules);
    phase("chroot", &|t| t.chroot);
    phase("overlay", &|t| t.overlay);
    phase("OURS", &|t| t.host());
    phase("jailer", &|t| t.jailer);
    phase("socket", &|t| t.socket);
    phase("api", &|t| t.api);
    phase("TOTAL", &|t| t.total());
}

fn spawn(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let h = rt.block_on(Harness::with("", Binaries::Testkit(GuestSetup::default())));
    let mut timings = Vec::new();
    c.bench_function("firecracker_spawn_destroy", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let agent = random_agent();
                let (spec, _rx) = h.spec(agent);
                let start = Instant::now();
                let (handle, t) = rt.block_on(h.backend.spawn_timed(spec)).unwrap();
                spent += start.elapsed();
                timings.push(t);
                rt.block_on(
                    h.backend
                        .destroy(&agent, Some(&handle), Duration::from_secs(5)),
                )
                .unwrap();
            }
            spent
        })
    });
    // Filtered out (e.g. `-- firecracker_sweep`): nothing was measured, and
    // the concurrent spawns below are part of this benchmark.
    if timings.is_empty() {
        return;
    }
    report(&timings);

    // 50 concurrent spawns: distinct addresses and TAPs, total time.
    let agents: Vec<_> = (0..50).map(|_| random_agent()).collect();
    let start = Instant::now();
    let handles = rt.block_on(async {
        let spawns = agents.iter().map(|a| {
            let (spec, _rx) = h.spec(*a);
            h.backend.spawn(spec)
        });
        futures_util::future::join_all(spawns).await
    });
    let elapsed = start.elapsed();
    let ok = handles.iter().filter(|r| r.is_ok()).count();
    let ips: HashSet<String> = handles
        .iter()
        .flatten()
        .map(|h| h.extra["ip"].clone())
        .collect();
    println!(
        "50 concurrent spawns: {ok} ok, {} distinct IPs, {:.0} ms total",
        ips.len(),
        elapsed.as_secs_f64() * 1e3
    );
    assert_eq!(ips.len(), ok, "address collision");
    rt.block_on(async {
        for (a, r) in agents.iter().zip(&handles) {
            h.backend
                .destroy(a, r.as_ref().ok(), Duration::from_secs(5))
                .await
                .unwrap();
        }
    });
}

/// 1,000 orphaned TAPs + VM directories: the sweep vs. a plain loop.
fn sweep(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let h = rt.block_on(Harness::new(""));
    h.backend.register_layout(&h.layout());
    let n: usize = std::env::var("KICI_BENCH_ORPHANS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let plant = |with_alias: bool| -> Vec<kici_model::AgentId> {
        let netlink = rt.block_on(async { kici_firecracker::tap::Netlink::connect().unwrap() });
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        (0..n)
            .map(|_| {
                let a = random_agent();
                let dir = h.vm_dir(&a);
                std::fs::create_dir_all(dir.join("root")).unwrap();
                std::fs::write(dir.join("root/overlay.ext4"), b"x").unwrap();
                std::fs::write(dir.join(".kici-owner"), owner_tag(h.instance, &a)).unwrap();
                std::fs::File::open(dir.join(".kici-owner"))
                    .unwrap()
                    .set_modified(old)
                    .unwrap();
                kici_firecracker::tap::create_tap(&tap_name(&a), 10000, 10000).unwrap();
                if with_alias {
                    rt.block_on(netlink.attach_tap(
                        &tap_name(&a),
                        &h.network.bridge_name,
                        &owner_tag(h.instance, &a),
                    ))
                    .unwrap();
                }
                a
            })
            .collect()
    };
    let mut group = c.benchmark_group("firecracker_sweep");
    // One iteration plants and sweeps `n` orphans twice (ours, then the
    // baseline loop): seconds, not nanoseconds. Criterion's default linear
    // sampling would run 1 + 2 + ... + 10 of them per sample set (minutes
    // at n = 1,000); flat sampling runs one per sample.
    group
        .sample_size(10)
        .sampling_mode(criterion::SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    let mut ratio = Vec::new();
    group.bench_function("sweep_vs_loop", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let agents = plant(true);
                let start = Instant::now();
                let report = rt.block_on(h.backend.sweep(&HashSet::new()));
                let ours = start.elapsed();
                assert_eq!(
                    report.vms.len(),
                    agents.len(),
                    "{:?}",
                    report.errors.first()
                );
                let agents = plant(false);
                let start = Instant::now();
                for a in &agents {
                    std::process::Command::new("ip")
                        .args(["link", "del", &tap_name(a)])
                        .status()
                        .unwrap();
                    std::process::Command::new("rm")
                        .arg("-rf")
                        .arg(h.vm_dir(a))
                        .status()
                        .unwrap();
                }
                let baseline = start.elapsed();
                ratio.push(ours.as_secs_f64() / baseline.as_secs_f64());
                spent += ours;
            }
            spent
        })
    });
    group.finish();
    if !ratio.is_empty() {
        println!("sweep / (ip link del + rm -rf) ratio per run: {ratio:.2?}");
    }
}

criterion_group!(benches, spawn, sweep);
criterion_main!(benches);
