//! Bare-metal spawn → agent exec'd, through `BareMetalBackend::spawn` with
//! each [`SpawnMethod`], against the same stub started directly with
//! `Command` (own process group, no cgroup). The stub's first statement
//! writes bash's `$EPOCHREALTIME` into a fifo; the measured time is that
//! stamp minus the wall clock just before the spawn (as
//! `bench/spawn-latency.sh` measures the whole daemon). Each iteration
//! destroys its agent before the next (not timed), so spawns are spaced as
//! in real use — which matters: a `cgroup.procs` write pays an RCU grace
//! period only when the cgroup rwsem was not recently taken.
//!
//! Needs root and the cgroup v2 mount at `/sys/fs/cgroup/unified`; prints
//! a note and measures nothing otherwise. Short run:
//! `cargo bench -p kici-bare-metal --bench spawn -- --warm-up-time 1 --measurement-time 2`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use kici_bare_metal::{BareMetalBackend, BareMetalOptions, SpawnMethod};
use kici_engine::{Backend, Mode, SpawnSpec};
use kici_model::{AgentId, EffectiveResources, InstanceId, ScalerType};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Reads the stub's stamp and returns how long after `started` it was taken.
fn stamp_after(fifo: &Path, started: SystemTime) -> Duration {
    let mut text = String::new();
    std::fs::File::open(fifo)
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    let stamp: f64 = text.trim().parse().unwrap();
    let started = started.duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
    Duration::from_secs_f64((stamp - started).max(0.0))
}

fn spec_for(scaler: &Arc<kici_model::ScalerEntry>) -> SpawnSpec {
    let (reports, _rx) = tokio::sync::mpsc::unbounded_channel();
    let label_set = scaler.label_sets[0].clone();
    SpawnSpec {
        agent: AgentId::random(ScalerType::BareMetal),
        scaler: scaler.clone(),
        label_set_index: 0,
        agent_labels: label_set.raw_labels.clone(),
        label_set,
        resources: EffectiveResources::default(),
        job: None,
        run_id: None,
        mode: Mode::Standalone,
        warm: false,
        idle_timeout_ms: None,
        orchestrator_url: "ws://127.0.0.1:1/ws".into(),
        token: None,
        reports,
    }
}

fn bench(c: &mut Criterion) {
    let probe = BareMetalOptions::new(InstanceId::random(), PathBuf::new(), Vec::new());
    let v2 = probe.cgroup_root.as_path();
    if !rustix::process::geteuid().is_root() || !v2.join("cgroup.procs").is_file() {
        eprintln!(
            "spawn bench: needs root and cgroup v2 at {}; skipped",
            v2.display()
        );
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("kici-bare-metal-bench-")
        .tempdir()
        .unwrap();
    let fifo: PathBuf = dir.path().join("exec-d");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let stub = dir.path().join("stub-agent");
    std::fs::write(
        &stub,
        format!(
            "#!/bin/bash\necho \"$EPOCHREALTIME\" > {}\nexec /bin/sleep 30\n",
            fifo.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    let yaml = format!(
        "version: 1\nscalers:\n  - name: bench\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [bench]\n        binaryPath: {}\n",
        stub.display()
    );
    let loaded = kici_config::load_documents(&[("bench.yaml", yaml.as_str())]).unwrap();
    let scaler = Arc::new(loaded.config.scaler("bench").unwrap().clone());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    let mut group = c.benchmark_group("spawn_to_exec");
    group.sample_size(20);
    for (name, method) in [
        ("clone_into_cgroup", SpawnMethod::Auto),
        ("pre_exec_cgroup_procs", SpawnMethod::PreExec),
    ] {
        let mut options = BareMetalOptions::new(
            InstanceId::random(),
            dir.path().join(format!("state-{name}")),
            vec![("PATH".into(), "/usr/bin:/bin".into())],
        );
        options.spawn_method = method;
        let backend = {
            let _rt = rt.enter();
            BareMetalBackend::new(options).unwrap()
        };
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let spec = spec_for(&scaler);
                    let agent = spec.agent;
                    let started = SystemTime::now();
                    let handle = rt.block_on(backend.spawn(spec)).unwrap();
                    total += stamp_after(&fifo, started);
                    rt.block_on(backend.destroy(&agent, Some(&handle), Duration::from_secs(5)))
                        .unwrap();
                }
                total
            })
        });
        // Until `spawn` returns (the agent has exec'd by then: the launch
        // waits for it), without bash's start-up: the backend's own share.
        group.bench_function(format!("{name}/spawn_call"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let spec = spec_for(&scaler);
                    let agent = spec.agent;
                    let started = std::time::Instant::now();
                    let handle = rt.block_on(backend.spawn(spec)).unwrap();
                    total += started.elapsed();
                    stamp_after(&fifo, SystemTime::now());
                    rt.block_on(backend.destroy(&agent, Some(&handle), Duration::from_secs(5)))
                        .unwrap();
                }
                total
            })
        });
        backend.prune_empty_cgroups();
    }
    group.bench_function("direct_command", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let started = SystemTime::now();
                let mut child = std::process::Command::new(&stub)
                    .env_clear()
                    .process_group(0)
                    .spawn()
                    .unwrap();
                total += stamp_after(&fifo, started);
                child.kill().unwrap();
                child.wait().unwrap();
            }
            total
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
