//! Start-up recovery of 1,000 recorded agents (target: ready in ≤ 1 s): the rows are read from a real SQLite store, decoded, and each
//! agent is adopted through the runtime (backend calls answered by the
//! in-memory backend, which knows every agent as alive), its reservation
//! re-established and its record rewritten. Baseline in the same run: the
//! store read alone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use kici_admission::Admission;
use kici_engine::memory_backend::MemoryBackend;
use kici_engine::runtime::{DefaultBootstrap, Runtime};
use kici_engine::{AgentState, Backend, DurableAgent, Engine, EngineSettings, Mode};
use kici_model::{AgentId, LabelSet, MemoryBytes, MilliCpu, Resources, ScalerName, ScalerType};
use kici_routing::HostPlatform;
use kici_scaler::durable::state::{durable_from_record, record_from_durable, StoreJournal};
use kici_scaler::gateway::token::TokenStore;
use kici_store::{StateStore, StoreOptions, StoreUrl};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

const AGENTS: u32 = 1000;

const CONFIG: &str = "version: 1\nglobalMaxAgents: 2000\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 2000\n    labelSets:\n      - labels: [local]\n        binaryPath: /bin/true\n        resources: { cpus: 0.1, memory: 64m }\n";

async fn seeded_store(dir: &std::path::Path, owner: kici_model::InstanceId) -> Arc<dyn StateStore> {
    let url: StoreUrl = format!("sqlite:{}", dir.join("state.db").display())
        .parse()
        .unwrap();
    let store = kici_store::open(&url, owner, StoreOptions::default())
        .await
        .unwrap();
    let now = SystemTime::now();
    for n in 0..AGENTS {
        let d = DurableAgent {
            agent: AgentId::new(ScalerType::BareMetal, n.to_be_bytes()),
            scaler: ScalerName::new("local"),
            backend: ScalerType::BareMetal,
            label_set_index: 0,
            label_set: LabelSet::parse(["local"]).unwrap(),
            state: AgentState::Busy,
            job: Some(format!("job-{n}").parse().unwrap()),
            run_id: None,
            mode: Mode::Orchestrator,
            warm: false,
            requests: Resources {
                cpu: MilliCpu::from_millis(100),
                memory: MemoryBytes::from_bytes(64 << 20),
            },
            machine_pool: None,
            handle: None,
            failure: None,
            age: Duration::from_secs(60),
        };
        store
            .put_agent(&record_from_durable(&d, now, None))
            .await
            .unwrap();
    }
    store
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let owner: kici_model::InstanceId = "0badc0de".parse().unwrap();
    let store = rt.block_on(seeded_store(dir.path(), owner));
    let config = Arc::new(
        kici_config::load_documents(&[("s.yaml", CONFIG)])
            .unwrap()
            .config,
    );

    let mut group = c.benchmark_group("recovery_1000_agents");
    group.sample_size(10);
    group.bench_function("store_read_baseline", |b| {
        b.to_async(&rt)
            .iter(|| async { store.agents().await.unwrap().len() })
    });
    group.bench_function("read_adopt_ready", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let store = Arc::clone(&store);
            let config = Arc::clone(&config);
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let backend = Arc::new(MemoryBackend::new(ScalerType::BareMetal));
                    for n in 0..AGENTS {
                        backend.plant(AgentId::new(ScalerType::BareMetal, n.to_be_bytes()));
                    }
                    let start = Instant::now();
                    let now = SystemTime::now();
                    let records: Vec<DurableAgent> = store
                        .agents()
                        .await
                        .unwrap()
                        .iter()
                        .map(|r| durable_from_record(r, now).unwrap().0)
                        .collect();
                    let admission = Admission::new(&config, None).unwrap();
                    let engine = Engine::new(
                        Arc::clone(&config),
                        admission,
                        HostPlatform::current(),
                        EngineSettings::default(),
                    );
                    let journal = Arc::new(StoreJournal::new(
                        Arc::clone(&store),
                        Arc::new(TokenStore::new()),
                    ));
                    let backends: Vec<Arc<dyn Backend>> = vec![backend];
                    let runtime = Runtime::with_journal(
                        engine,
                        backends,
                        Arc::new(DefaultBootstrap),
                        journal,
                    );
                    let report = runtime.recover_and_start(records).await;
                    // Ready = every agent managed and every rewrite stored.
                    assert!(runtime.flush_journal().await);
                    total += start.elapsed();
                    assert_eq!(report.adopted.len(), AGENTS as usize);
                    assert!(runtime.detach().await);
                }
                total
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
