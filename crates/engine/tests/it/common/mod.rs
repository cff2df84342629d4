#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]
//! Shared helpers for the engine's tests: configs from YAML, engines with
//! an injectable `now`.

use kici_admission::Admission;
use kici_engine::{Engine, EngineSettings, Mode, ScaleOutcome, ScaleRequest};
use kici_model::{AgentId, Config, JobId, LabelSet};
use kici_routing::HostPlatform;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub fn config(yaml: &str) -> Arc<Config> {
    match kici_config::load_documents(&[("scalers.yaml", yaml)]) {
        Ok(l) => Arc::new(l.config),
        Err(e) => panic!("test config invalid:\n{e}"),
    }
}

pub fn engine(yaml: &str) -> Engine {
    engine_with(yaml, EngineSettings::default())
}

pub fn engine_with(yaml: &str, settings: EngineSettings) -> Engine {
    let config = config(yaml);
    let admission = Admission::new(&config, None).unwrap();
    Engine::new(
        config,
        admission,
        HostPlatform::new("linux", "x86_64"),
        settings,
    )
}

pub fn labels(raw: &[&str]) -> LabelSet {
    LabelSet::parse(raw.iter().copied()).unwrap()
}

pub fn job(id: &str) -> JobId {
    id.parse().unwrap()
}

pub fn request(id: &str, raw: &[&str]) -> ScaleRequest {
    ScaleRequest {
        job: job(id),
        run_id: Some("run-1".into()),
        labels: labels(raw),
        exclude: LabelSet::default(),
        resources: None,
        mode: Mode::Standalone,
    }
}

/// [`request`] in orchestrator mode: a job whose agent fails before it
/// starts goes back to the queue (standalone jobs end instead).
pub fn orchestrator_request(id: &str, raw: &[&str]) -> ScaleRequest {
    ScaleRequest {
        mode: Mode::Orchestrator,
        ..request(id, raw)
    }
}

pub fn spawned(outcome: &ScaleOutcome) -> AgentId {
    match outcome {
        ScaleOutcome::Spawning { agent_id, .. } => *agent_id,
        other => panic!("expected spawning, got {other:?}"),
    }
}

/// A clock that only moves when told.
pub struct Clock(pub Instant);

impl Clock {
    pub fn new() -> Self {
        Self(Instant::now())
    }
    pub fn now(&self) -> Instant {
        self.0
    }
    pub fn advance(&mut self, secs: u64) -> Instant {
        self.0 += Duration::from_secs(secs);
        self.0
    }
}

pub const BASIC: &str = r#"
version: 1
globalMaxAgents: 10
scalers:
  - name: local
    type: bare-metal
    maxAgents: 2
    labelSets:
      - labels: [linux, local]
        binaryPath: /usr/bin/kici-agent-lite
        resources: { cpus: 1, memory: 1g }
  - name: docker
    type: container
    maxAgents: 5
    resourceCap: { maxCpu: 2 }
    labelSets:
      - labels: [linux, docker]
        image: agent:latest
        resources: { cpus: 1, memory: 512m }
"#;

pub fn usage_of(e: &Engine, scaler: &str) -> kici_admission::ScopeUsage {
    e.admission()
        .usage()
        .scalers
        .get(scaler)
        .cloned()
        .expect("scaler known to admission")
}

/// The agents of the spawn orders among the engine's effects (taken).
pub fn spawn_orders(e: &mut Engine) -> Vec<AgentId> {
    e.take_effects()
        .into_iter()
        .filter_map(|f| match f {
            kici_engine::Effect::Spawn(o) => Some(o.agent),
            _ => None,
        })
        .collect()
}
