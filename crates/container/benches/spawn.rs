//! Spawn latency against the real dockerd: `ContainerBackend::spawn` (lease,
//! image check under `IfNotPresent`, create, rules hook, start, log and exit
//! watch) against the raw Engine API create + start of the *same* body, in
//! the same run, on the same image, network and limits. Each iteration's
//! container is removed outside the measured time.
//!
//!   scripts/dockerd.sh start
//!   cargo bench -p kici-container --bench spawn -- --warm-up-time 1 --measurement-time 20
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use bollard::query_parameters::{CreateContainerOptions, RemoveContainerOptions};
use common::*;
use criterion::{criterion_group, criterion_main, Criterion};
use kici_container::create::{create_body, ContainerLabelSet, CreateContext, DEFAULT_PIDS_LIMIT};
use kici_container::{ImageReference, RuntimeKind};
use kici_engine::Backend;
use kici_model::{EffectiveResources, ScalerType};
use std::time::{Duration, Instant};

fn spawn(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let fx = rt.block_on(Fixture::new());
    let image = fx.image("bench", &["sleep", "3600"]);
    let scaler = scaler_from_yaml(
        &scaler_yaml(
            "bench",
            &image,
            "",
            "        resources: {cpus: 0.5, memory: 64m}",
        ),
        "bench",
    );
    rt.block_on(fx.backend.validate(&scaler)).unwrap();
    let docker = bollard::Docker::connect_with_unix(
        "/var/run/docker.sock",
        120,
        bollard::API_DEFAULT_VERSION,
    )
    .unwrap();
    let docker = rt.block_on(docker.negotiate_version()).unwrap();
    let reference = ImageReference::parse(&image).unwrap();
    // The baseline's address: far from the allocator's first ones.
    let raw_ip = fx.options.network.pool.assignable().nth(200).unwrap();

    let mut group = c.benchmark_group("container_spawn");
    group.sample_size(20);
    group.bench_function("backend_spawn", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let fx = &fx;
            let scaler = scaler.clone();
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let (mut spec, _rx) = spawn_spec(&scaler, 0);
                    spec.resources =
                        EffectiveResources::resolve(&[spec.label_set.resources.as_ref()]);
                    let agent = spec.agent;
                    let started = Instant::now();
                    let handle = fx.backend.spawn(spec).await.unwrap();
                    total += started.elapsed();
                    fx.backend
                        .destroy(&agent, Some(&handle), Duration::ZERO)
                        .await
                        .unwrap();
                }
                total
            }
        });
    });
    group.bench_function("raw_create_start", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let docker = docker.clone();
            let fx = &fx;
            let scaler = scaler.clone();
            let reference = reference.clone();
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let (mut spec, _rx) = spawn_spec(&scaler, 0);
                    spec.resources =
                        EffectiveResources::resolve(&[spec.label_set.resources.as_ref()]);
                    let env = kici_host::env::agent_env(
                        &spec,
                        ScalerType::Container,
                        &Default::default(),
                        &Default::default(),
                    );
                    let body = create_body(
                        &spec,
                        &ContainerLabelSet {
                            image: &reference,
                            container_socket: false,
                            volumes: &[],
                            read_only_rootfs: false,
                        },
                        &CreateContext {
                            instance: fx.instance,
                            kind: RuntimeKind::Docker,
                            network: &fx.options.network.name,
                            ip: raw_ip,
                            env: &env,
                            extra_hosts: &[],
                            pids_limit: DEFAULT_PIDS_LIMIT,
                            ulimits: &[],
                            socket_on_host: None,
                            stop_timeout: Duration::from_secs(10),
                        },
                    );
                    let name = format!("kici-raw-{}", spec.agent);
                    let started = Instant::now();
                    let created = docker
                        .create_container(
                            Some(CreateContainerOptions {
                                name: Some(name),
                                ..Default::default()
                            }),
                            body,
                        )
                        .await
                        .unwrap();
                    docker.start_container(&created.id, None).await.unwrap();
                    total += started.elapsed();
                    docker
                        .remove_container(
                            &created.id,
                            Some(RemoveContainerOptions {
                                force: true,
                                v: true,
                                link: false,
                            }),
                        )
                        .await
                        .unwrap();
                }
                total
            }
        });
    });
    group.finish();
    drop(fx);
}

criterion_group!(benches, spawn);
criterion_main!(benches);
