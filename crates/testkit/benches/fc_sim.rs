//! The simulator's own costs, to subtract from backend spawn measurements:
//! one API round trip, a typical MMDS PUT, and a whole boot sequence from
//! process start to `InstanceStart` (launched directly, no jail).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use kici_testkit::fc::{build_binaries, GuestSetup, Simulator};
use serde_json::json;

fn bench(c: &mut Criterion) {
    let paths = build_binaries().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for f in ["kernel", "rootfs.ext4"] {
        std::fs::write(dir.path().join(f), b"").unwrap();
    }
    let sim = Simulator::start(&paths, dir.path(), &[], &GuestSetup::default()).unwrap();
    c.bench_function("fc_sim_get_instance_info", |b| {
        b.iter(|| sim.client.get("/").unwrap())
    });
    let meta = json!({"latest": {"meta-data": {
        "kici-orchestrator-url": "ws://10.0.0.1:4000/ws",
        "kici-agent-id": "scaler-firecracker-0123abcd",
        "kici-labels": "linux,firecracker,kici:agent:firecracker,kici:scaler:test-fc",
        "kici-scaler-managed": "1",
        "kici-gateway-ip": "10.0.0.1",
        "kici-env": {"PAD": "x".repeat(4096)}
    }}});
    c.bench_function("fc_sim_put_mmds_4k", |b| {
        b.iter(|| sim.client.put("/mmds", &meta).unwrap())
    });
    drop(sim);

    let kernel = dir.path().join("kernel");
    let rootfs = dir.path().join("rootfs.ext4");
    let mut group = c.benchmark_group("fc_sim_boot");
    group.sample_size(20);
    group.bench_function("start_to_instance_start", |b| {
        b.iter(|| {
            let run = tempfile::tempdir().unwrap();
            let sim = Simulator::start(&paths, run.path(), &[], &GuestSetup::default()).unwrap();
            let cl = &sim.client;
            assert_eq!(cl.put("/boot-source", &json!({"kernel_image_path": kernel, "boot_args": "console=ttyS0"})).unwrap().status, 204);
            assert_eq!(cl.put("/drives/rootfs", &json!({"drive_id": "rootfs", "path_on_host": rootfs, "is_root_device": true, "is_read_only": true})).unwrap().status, 204);
            assert_eq!(cl.put("/machine-config", &json!({"vcpu_count": 1, "mem_size_mib": 256})).unwrap().status, 204);
            assert_eq!(cl.put("/mmds", &meta).unwrap().status, 204);
            assert_eq!(cl.put("/actions", &json!({"action_type": "InstanceStart"})).unwrap().status, 204);
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
