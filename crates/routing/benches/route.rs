//! Routing hot path against a naive port of upstream's matcher.
//!
//! Workload (the task's benchmark): 100 scalers × 10 label sets, each set 4
//! random labels from a 50-label vocabulary, 10 % of the scalers gated by a
//! mandatory label that each of their sets carries; jobs of 2-3 labels, most
//! drawn from a configured set (so they match), some random.
//!
//! `naive_upstream` ports upstream's matcher (enrichment + selection) as upstream runs it per
//! request: enrich every label set by building strings, lower-case + sort +
//! dedup the job labels, scan with a `HashSet` subset test, keep the smallest
//! enriched set.
//!
//! `route_and_admit` is the full hot path of one scale request in the engine:
//! route, then reserve every cap atomically (and release, so the books stay
//! balanced across iterations); the target is a median ≤ 2.5 µs and ≥ 50×
//! faster than the naive port.
//!
//! After the criterion group, a summary prints both medians and their ratio
//! (only when run with `--bench`, i.e. not under `cargo test`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kici_admission::{Admission, Demand, Holds};
use kici_model::{AgentId, Config, LabelSet, Resources, Roles, ScalerType};
use kici_routing::{CordonSet, HostPlatform, Router};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::hint::black_box;
use std::time::Instant;

const SCALERS: usize = 100;
const SETS_PER_SCALER: usize = 10;
const VOCABULARY: usize = 50;
const JOBS: usize = 256;

struct Workload {
    config: Config,
    host: HostPlatform,
    /// Jobs as the API layer hands them to routing (parsed, normalised).
    jobs: Vec<LabelSet>,
    /// The same jobs as raw strings (what upstream's matcher receives).
    raw_jobs: Vec<Vec<String>>,
}

fn workload() -> Workload {
    let mut rng = StdRng::seed_from_u64(0x6b69_6369);
    let vocab: Vec<String> = (0..VOCABULARY).map(|i| format!("label{i:02}")).collect();
    let kinds = [
        ScalerType::Container,
        ScalerType::BareMetal,
        ScalerType::Firecracker,
    ];
    let mut builders = Vec::new();
    for s in 0..SCALERS {
        let gate = (s % 10 == 0).then(|| vocab.choose(&mut rng).unwrap().clone());
        let mut b = common::scaler(&format!("scaler-{s:03}"), kinds[s % 3]);
        if s % 7 == 0 {
            b = b.roles(Roles::Only(vec![]));
        }
        if let Some(g) = &gate {
            b = b.mandatory(&[g.as_str()]);
        }
        for _ in 0..SETS_PER_SCALER {
            let mut set: Vec<&str> = vocab
                .choose_multiple(&mut rng, 4)
                .map(String::as_str)
                .collect();
            if let Some(g) = &gate {
                if !set.contains(&g.as_str()) {
                    set[0] = g.as_str();
                }
            }
            b = b.set(&set);
        }
        builders.push(b);
    }
    let config = common::config(builders);

    let mut raw_jobs = Vec::with_capacity(JOBS);
    for _ in 0..JOBS {
        let n = rng.gen_range(2..=3);
        let job: Vec<String> = if rng.gen_bool(0.75) {
            let scaler = config.scalers.choose(&mut rng).unwrap();
            let set = scaler.label_sets.choose(&mut rng).unwrap();
            set.raw_labels
                .choose_multiple(&mut rng, n)
                .cloned()
                .collect()
        } else {
            vocab.choose_multiple(&mut rng, n).cloned().collect()
        };
        raw_jobs.push(job);
    }
    let jobs = raw_jobs
        .iter()
        .map(|j| LabelSet::parse(j.iter()).unwrap())
        .collect();
    Workload {
        config,
        host: HostPlatform::new("linux", "x86_64"),
        jobs,
        raw_jobs,
    }
}

// ---- naive port of upstream ---------------------------------------------------

struct NaiveScaler {
    name: String,
    backend_type: &'static str,
    label_sets: Vec<Vec<String>>,
    mandatory: Vec<String>,
    roles: Option<Vec<String>>,
}

fn naive_scalers(config: &Config) -> Vec<NaiveScaler> {
    config
        .scalers
        .iter()
        .map(|s| NaiveScaler {
            name: s.name.to_string(),
            backend_type: s.kind.as_str(),
            label_sets: s.label_sets.iter().map(|l| l.raw_labels.clone()).collect(),
            mandatory: s.mandatory_labels.iter().map(|l| l.to_string()).collect(),
            roles: match &s.roles {
                Roles::All => None,
                Roles::Only(r) => Some(r.iter().map(|r| r.as_str().to_string()).collect()),
            },
        })
        .collect()
}

/// Upstream's auto labels, rebuilt as strings for every request.
fn naive_auto_labels(s: &NaiveScaler, platform: &str, arch: &str) -> Vec<String> {
    let mut out = Vec::new();
    let platform = if s.backend_type == "bare-metal" {
        platform
    } else {
        "linux"
    };
    match platform {
        "linux" => out.push("kici:os:linux".to_string()),
        "darwin" => out.extend(["kici:os:macos".to_string(), "kici:os:darwin".to_string()]),
        "win32" => out.extend(["kici:os:windows".to_string(), "kici:os:win32".to_string()]),
        p => out.push(format!("kici:os:{p}")),
    }
    match arch {
        "x64" => out.extend(["kici:arch:x64".to_string(), "kici:arch:amd64".to_string()]),
        "arm64" => out.push("kici:arch:arm64".to_string()),
        a => out.push(format!("kici:arch:{a}")),
    }
    out.push(format!("kici:agent:{}", s.backend_type));
    out.push(format!("kici:scaler:{}", s.name));
    match &s.roles {
        None => out.extend([
            "kici:role:builder".to_string(),
            "kici:role:init-runner".to_string(),
        ]),
        Some(roles) => out.extend(roles.iter().map(|r| format!("kici:role:{r}"))),
    }
    out
}

/// Upstream's `findBackendForLabels` over freshly enriched sets.
fn naive_route(
    scalers: &[NaiveScaler],
    job: &[String],
    exclude: &[String],
) -> Option<(usize, usize)> {
    let enriched: Vec<Vec<Vec<String>>> = scalers
        .iter()
        .map(|s| {
            let auto = naive_auto_labels(s, "linux", "x64");
            s.label_sets
                .iter()
                .map(|set| {
                    let mut v = set.clone();
                    for a in &auto {
                        if !v.contains(a) {
                            v.push(a.clone());
                        }
                    }
                    v
                })
                .collect()
        })
        .collect();
    let mut normalised: Vec<String> = job.iter().map(|l| l.to_lowercase()).collect();
    normalised.sort();
    normalised.dedup();
    let wanted: HashSet<String> = normalised.into_iter().collect();
    let excluded: Vec<String> = exclude.iter().map(|l| l.to_lowercase()).collect();
    if wanted.is_empty() {
        return scalers
            .iter()
            .position(|s| s.mandatory.is_empty() && !s.label_sets.is_empty())
            .map(|i| (i, 0));
    }
    let mut best: Option<(usize, usize, usize)> = None;
    for (si, s) in scalers.iter().enumerate() {
        if !s
            .mandatory
            .iter()
            .all(|m| wanted.contains(&m.to_lowercase()))
        {
            continue;
        }
        for (li, set) in enriched[si].iter().enumerate() {
            let have: HashSet<String> = set.iter().map(|l| l.to_lowercase()).collect();
            if !wanted.iter().all(|w| have.contains(w)) {
                continue;
            }
            if excluded.iter().any(|e| have.contains(e)) {
                continue;
            }
            if best.is_none_or(|(size, _, _)| have.len() < size) {
                best = Some((have.len(), si, li));
            }
        }
    }
    best.map(|(_, s, l)| (s, l))
}

// ---- benches --------------------------------------------------------------------------

fn bench_route(c: &mut Criterion) {
    let w = workload();
    let router = Router::new(&w.config, &w.host);
    let naive = naive_scalers(&w.config);
    let (none, cordoned) = (LabelSet::default(), CordonSet::none());

    let mut group = c.benchmark_group("route");
    let mut i = 0;
    group.bench_function("router", |b| {
        b.iter(|| {
            i = (i + 1) % JOBS;
            black_box(router.route(black_box(&w.jobs[i]), &none, &cordoned))
        })
    });
    let admission = Admission::new(&w.config, None).unwrap();
    let mut i = 0;
    group.bench_function("route_and_admit", |b| {
        b.iter(|| {
            i = (i + 1) % JOBS;
            route_and_admit(&w, &router, &admission, i)
        })
    });
    let mut i = 0;
    group.bench_function("router_parse_and_route", |b| {
        b.iter(|| {
            i = (i + 1) % JOBS;
            let job = LabelSet::parse(black_box(&w.raw_jobs[i]).iter()).unwrap();
            black_box(router.route(&job, &none, &cordoned))
        })
    });
    let mut i = 0;
    group.bench_function("naive_upstream", |b| {
        b.iter(|| {
            i = (i + 1) % JOBS;
            black_box(naive_route(&naive, black_box(&w.raw_jobs[i]), &[]))
        })
    });
    group.bench_function("router_new", |b| {
        b.iter_batched(
            || (),
            |()| Router::new(&w.config, &w.host),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

/// One scale request's routing and admission (the reservation is dropped at
/// once so every iteration sees the same, empty books).
fn route_and_admit(w: &Workload, router: &Router, admission: &Admission, i: usize) -> bool {
    let none = LabelSet::default();
    let Some(route) = router.route(black_box(&w.jobs[i]), &none, &CordonSet::none()) else {
        return false;
    };
    let scaler = &w.config.scalers[route.scaler];
    let demand = Demand {
        agent: AgentId::new(scaler.kind, [0, 0, 0, 1]),
        scaler: scaler.name.clone(),
        requests: Resources::ZERO,
        pool: None,
    };
    black_box(admission.try_reserve(demand, &Holds::none())).is_ok()
}

/// Median per-call time over `samples` batches of `per_sample` calls.
fn median_ns(samples: usize, per_sample: usize, mut call: impl FnMut(usize)) -> f64 {
    let mut times: Vec<f64> = (0..samples)
        .map(|s| {
            let start = Instant::now();
            for k in 0..per_sample {
                call(s * per_sample + k);
            }
            start.elapsed().as_nanos() as f64 / per_sample as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn summary(_: &mut Criterion) {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let w = workload();
    let router = Router::new(&w.config, &w.host);
    let naive = naive_scalers(&w.config);
    let (none, cordoned) = (LabelSet::default(), CordonSet::none());

    // Both implementations must agree on the workload before being compared.
    let mut matched = 0;
    for (job, raw) in w.jobs.iter().zip(&w.raw_jobs) {
        let ours = router
            .route(job, &none, &cordoned)
            .map(|r| (r.scaler, r.label_set));
        let theirs = naive_route(&naive, raw, &[]);
        assert_eq!(
            ours.is_some(),
            theirs.is_some(),
            "match/no-match differs for {raw:?}"
        );
        matched += usize::from(ours.is_some());
    }

    let ours = median_ns(201, 2000, |k| {
        black_box(router.route(black_box(&w.jobs[k % JOBS]), &none, &cordoned));
    });
    let admission = Admission::new(&w.config, None).unwrap();
    let full = median_ns(201, 2000, |k| {
        black_box(route_and_admit(&w, &router, &admission, k % JOBS));
    });
    let theirs = median_ns(51, 20, |k| {
        black_box(naive_route(&naive, black_box(&w.raw_jobs[k % JOBS]), &[]));
    });
    println!(
        "route summary: {SCALERS} scalers x {SETS_PER_SCALER} sets, {JOBS} jobs ({matched} match): \
         router median {ours:.1} ns, route+admit median {full:.1} ns, naive upstream median {:.1} us, \
         ratio {:.0}x (route only) / {:.0}x (route+admit)",
        theirs / 1000.0,
        theirs / ours,
        theirs / full
    );
}

criterion_group!(benches, bench_route, summary);
criterion_main!(benches);
