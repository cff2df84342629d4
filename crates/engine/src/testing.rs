//! Building blocks for backend tests: a scaler entry from YAML, and a
//! `SpawnSpec` for one of its label sets (with the agent id and
//! `kici:agent:*` label of the scaler's own type), so each backend crate's
//! tests share one definition of "a spawn as the engine makes it".
#![allow(clippy::expect_used)]

use crate::backend::{BackendReport, SpawnSpec};
use crate::lifecycle::Mode;
use kici_model::{AgentId, EffectiveResources, ScalerEntry};
use std::sync::Arc;
use tokio::sync::mpsc;

/// The scaler `name` of a `scalers.yaml` text; panics (a test bug) when the
/// text is invalid or has no such scaler.
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

/// A standalone, job-less spawn of label set `label_set_index`, and the
/// receiving end of its report channel.
pub fn spawn_spec(
    scaler: &Arc<ScalerEntry>,
    label_set_index: usize,
) -> (SpawnSpec, mpsc::UnboundedReceiver<BackendReport>) {
    let (reports, rx) = mpsc::unbounded_channel();
    let agent = AgentId::random(scaler.kind);
    let label_set = scaler.label_sets[label_set_index].clone();
    let mut agent_labels = label_set.raw_labels.clone();
    agent_labels.push(format!("kici:agent:{}", scaler.kind));
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
        orchestrator_url: "ws://127.0.0.1:7879/ws".into(),
        token: None,
        reports,
    };
    (spec, rx)
}
