//! Helpers for the crate's unit and integration tests (the latter include
//! this file by path): scaler entries from YAML, spawn specs.
#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_engine::{BackendReport, Mode, SpawnSpec};
use kici_model::{AgentId, EffectiveResources, ScalerEntry, ScalerType};
use std::sync::Arc;
use tokio::sync::mpsc;

pub fn scaler_from_yaml(yaml: &str, name: &str) -> Arc<ScalerEntry> {
    let loaded = match kici_config::load_documents(&[("scalers.yaml", yaml)]) {
        Ok(l) => l,
        Err(e) => panic!("test config invalid:\n{e}"),
    };
    Arc::new(
        loaded
            .config
            .scaler(name)
            .expect("scaler in config")
            .clone(),
    )
}

pub fn spawn_spec(
    scaler: &Arc<ScalerEntry>,
    label_set_index: usize,
) -> (SpawnSpec, mpsc::UnboundedReceiver<BackendReport>) {
    let (reports, rx) = mpsc::unbounded_channel();
    let agent = AgentId::random(ScalerType::Container);
    let label_set = scaler.label_sets[label_set_index].clone();
    let mut agent_labels = label_set.raw_labels.clone();
    agent_labels.push(format!("kici:agent:{}", ScalerType::Container));
    agent_labels.push(format!("kici:scaler:{}", scaler.name));
    let spec = SpawnSpec {
        agent,
        scaler: scaler.clone(),
        label_set_index,
        label_set,
        agent_labels,
        resources: EffectiveResources::default(),
        job: None,
        run_id: None,
        mode: Mode::Standalone,
        warm: false,
        idle_timeout_ms: None,
        orchestrator_url: "ws://172.29.0.1:7879/ws".into(),
        token: None,
        reports,
    };
    (spec, rx)
}
