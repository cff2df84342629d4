//! The `Backend` trait: what the engine asks of containers, bare-metal
//! processes and microVMs. Backends own host resources; the engine owns
//! lifecycle, capacity and deadlines.

use crate::lifecycle::Mode;
use async_trait::async_trait;
use kici_model::{
    AgentId, EffectiveResources, JobId, LabelSetConfig, ScalerEntry, ScalerType, Secret,
};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;

/// Everything a backend needs to bring one agent up.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub agent: AgentId,
    pub scaler: Arc<ScalerEntry>,
    pub label_set_index: usize,
    pub label_set: LabelSetConfig,
    /// `KICI_LABELS`: configured labels + `kici:agent:*`, `kici:scaler:*`,
    /// role labels.
    pub agent_labels: Vec<String>,
    pub resources: EffectiveResources,
    pub job: Option<JobId>,
    pub run_id: Option<String>,
    pub mode: Mode,
    pub warm: bool,
    /// `KICI_SCALER_IDLE_TIMEOUT` in milliseconds, for agents that rest idle.
    pub idle_timeout_ms: Option<u128>,
    /// Where the agent connects back (`KICI_ORCHESTRATOR_URL`).
    pub orchestrator_url: String,
    /// The agent's bootstrap token; only its hash is kept elsewhere.
    pub token: Option<Secret>,
    /// Where the backend reports what happens to the agent after spawn.
    pub reports: ReportSender,
}

/// What a backend created: enough to destroy it and to find it again after
/// a restart (container id, pid + start time, VM id, TAP, chroot, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ResourceHandle {
    /// The primary id (container id, `pid:<pid>:<start>`, VM id).
    pub id: String,
    /// Secondary resources by kind (`tap`, `chroot`, `cgroup`, `ip`, ...).
    pub extra: BTreeMap<String, String>,
}

/// A resource found on the host that carries this instance's owner marker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OwnedResource {
    pub agent: Option<AgentId>,
    pub handle: ResourceHandle,
    pub created_at: SystemTime,
}

/// What a backend tells the engine about an agent after spawn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendReport {
    /// The agent's process/container/VM ended.
    Exited { agent: AgentId, detail: String },
    /// The guest failed to boot (kernel panic, init failure...).
    BootFailure { agent: AgentId, detail: String },
}

pub type ReportSender = mpsc::UnboundedSender<BackendReport>;

/// What [`Backend::adopt`] found of a recorded agent after a daemon restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// The resource is there and is still the one recorded (pid + start
    /// time, container id, VM process): it is watched again and its exit is
    /// reported as after a spawn.
    Alive,
    /// Nothing of it runs any more (what remains is for `destroy` to remove).
    Gone,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("{0}")]
    Provision(String),
    #[error("{0}")]
    Destroy(String),
    #[error("{0}")]
    Unavailable(String),
}

#[async_trait]
pub trait Backend: Send + Sync {
    fn kind(&self) -> ScalerType;

    /// Backend-specific validation of one scaler entry (files, engine,
    /// host capacity). Run for the whole new config before a reload applies.
    async fn validate(&self, scaler: &ScalerEntry) -> Result<(), Vec<String>>;

    /// Creates the resource and starts the agent. Returns when the resource is
    /// up (not when the agent registers). On error, whatever was created is
    /// already removed.
    async fn spawn(&self, spec: SpawnSpec) -> Result<ResourceHandle, BackendError>;

    /// Stops (with `grace`) and removes everything the agent holds. Must work
    /// without a handle (the spawn may have been cut short) and when the
    /// resource is already gone.
    async fn destroy(
        &self,
        agent: &AgentId,
        handle: Option<&ResourceHandle>,
        grace: Duration,
    ) -> Result<(), BackendError>;

    /// Every resource carrying this instance's owner marker, for reconcile.
    async fn list_owned(&self) -> Result<Vec<OwnedResource>, BackendError>;

    /// The agent acknowledged its configuration (`config.ack`): a backend
    /// that handed bootstrap secrets over a side channel (Firecracker's
    /// MMDS) removes them here, and must have verified it before returning
    /// — no job is dispatched to the agent until this succeeds.
    async fn agent_configured(&self, _agent: &AgentId) -> Result<(), BackendError> {
        Ok(())
    }

    /// After a daemon restart: checks that the recorded agent's resource
    /// still runs and is the one recorded, and if so watches it again
    /// (exit reported to `reports`, logs forwarded). Never creates anything.
    async fn adopt(
        &self,
        agent: &AgentId,
        handle: &ResourceHandle,
        reports: ReportSender,
    ) -> Result<Adoption, BackendError>;
}
