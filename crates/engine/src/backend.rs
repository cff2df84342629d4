//! The `Backend` trait: what the engine asks of containers, bare-metal
//! processes and microVMs. Backends own host resources; the engine owns
//! lifecycle, capacity and deadlines.

use crate::lifecycle::{FailureReason, Mode, StopCause};
use async_trait::async_trait;
use kici_model::{
    AgentId, EffectiveResources, JobId, LabelSetConfig, ScalerEntry, ScalerType, Secret,
};

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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceHandle {
    /// The primary id (container id, `pid:<pid>:<start>`, VM id).
    pub id: String,
    /// Secondary resources by kind (`tap`, `chroot`, `cgroup`, `ip`, ...).
    pub extra: BTreeMap<String, String>,
}

/// A resource found on the host that carries this instance's owner marker.
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// Why the engine destroys an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DestroyReason {
    /// A failure: a deadline, a backend error, an early exit.
    Failed(FailureReason),
    /// Something stopped it (its job's end in standalone mode, a disconnect,
    /// an operator, shutdown, idle expiry, scale-in, removal, cancel).
    Stopped(StopCause),
    /// Its job completed and the agent is not kept.
    JobCompleted,
}

/// What kind of failure a backend reported: the one thing its callers
/// match on. The engine's failure handling and the control API's error codes
/// derive from it; the backend's own typed error rides along as the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendErrorKind {
    /// Creating the agent's resource failed at a step; what that spawn had
    /// made is already removed.
    Provision,
    /// Removing the agent's resource failed at a step; destroy is retried.
    Destroy,
    /// Something the backend needs could not be reached or read (the
    /// container engine, the cgroup tree, the VMM's API, the agent's
    /// process), or the agent is not one this backend can act on now.
    Unavailable,
    /// The operation did not finish within its deadline.
    TimedOut,
    /// A named failpoint was configured to fail here (test builds only).
    Injected,
}

impl BackendErrorKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Provision => "provision",
            Self::Destroy => "destroy",
            Self::Unavailable => "unavailable",
            Self::TimedOut => "timed-out",
            Self::Injected => "injected",
        }
    }
}

impl std::fmt::Display for BackendErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A backend's error as the engine and the daemon see it: a
/// [`BackendErrorKind`] to match on, and the backend's own typed error
/// (bare-metal, container, Firecracker) as the source, for its message and
/// its chain.
///
/// Displays as the backend's error: the kind is for matching, not for the
/// message (like [`std::io::Error`] with a custom error inside).
#[derive(Debug)]
pub struct BackendError {
    kind: BackendErrorKind,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl BackendError {
    pub fn new(
        kind: BackendErrorKind,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind,
            source: source.into(),
        }
    }

    pub fn kind(&self) -> BackendErrorKind {
        self.kind
    }

    /// The backend's own error.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }

    /// The backend's own error as its concrete type, if it is one.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.source.downcast_ref::<E>()
    }
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for BackendError {
    /// The backend's error is this error's text; the chain continues with
    /// what caused it, so a report of the whole chain says each thing once.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

/// Why the runtime could not have an agent's configuration acknowledged by
/// its backend ([`Backend::agent_configured`]).
#[derive(Debug, thiserror::Error)]
pub enum AgentConfiguredError {
    #[error("{0} is not managed here")]
    NotManaged(AgentId),
    #[error("{agent}: clearing the bootstrap data did not finish within {limit:?}")]
    TimedOut { agent: AgentId, limit: Duration },
}

/// Which part of a scaler entry's validation failed: the entry itself, or
/// the host it would run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProblemKind {
    /// A setting of the entry cannot work (a binary that does not exist,
    /// an invalid image reference, a runtime other than the one configured).
    Setting,
    /// This host lacks what the entry needs (a cgroup controller, a
    /// writable directory, a network as configured, a reachable engine).
    Host,
}

/// One reason a scaler entry cannot run on its backend, with the backend's
/// own typed error as the source.
#[derive(Debug)]
pub struct ScalerProblem {
    kind: ProblemKind,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl ScalerProblem {
    pub fn new(
        kind: ProblemKind,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind,
            source: source.into(),
        }
    }

    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The backend's own error.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }

    /// The backend's own error as its concrete type, if it is one.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.source.downcast_ref::<E>()
    }
}

impl std::fmt::Display for ScalerProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for ScalerProblem {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

/// Every reason a scaler entry cannot run on its backend ([`Backend::validate`]);
/// never empty. Displays as the problems joined by `; `.
#[derive(Debug)]
pub struct ScalerProblems(Vec<ScalerProblem>);

impl ScalerProblems {
    /// `Ok` when there is no problem.
    pub fn check(problems: Vec<ScalerProblem>) -> Result<(), Self> {
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Self(problems))
        }
    }

    /// Each problem's message, in order.
    pub fn messages(&self) -> Vec<String> {
        self.0.iter().map(ToString::to_string).collect()
    }

    pub fn into_vec(self) -> Vec<ScalerProblem> {
        self.0
    }
}

impl From<ScalerProblem> for ScalerProblems {
    fn from(problem: ScalerProblem) -> Self {
        Self(vec![problem])
    }
}

impl std::ops::Deref for ScalerProblems {
    type Target = [ScalerProblem];
    fn deref(&self) -> &[ScalerProblem] {
        &self.0
    }
}

impl IntoIterator for ScalerProblems {
    type Item = ScalerProblem;
    type IntoIter = std::vec::IntoIter<ScalerProblem>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl std::fmt::Display for ScalerProblems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, problem) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            problem.fmt(f)?;
        }
        Ok(())
    }
}

impl std::error::Error for ScalerProblems {}

#[async_trait]
pub trait Backend: Send + Sync {
    fn kind(&self) -> ScalerType;

    /// Backend-specific validation of one scaler entry (files, engine,
    /// host capacity). Run for the whole new config before a reload applies.
    /// Every problem found is returned, not only the first.
    async fn validate(&self, scaler: &ScalerEntry) -> Result<(), ScalerProblems>;

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

    /// [`Backend::destroy`], told why. Backends whose teardown is reported
    /// to someone (an external provisioner) override it; the others ignore
    /// the reason.
    async fn destroy_because(
        &self,
        agent: &AgentId,
        handle: Option<&ResourceHandle>,
        grace: Duration,
        _reason: DestroyReason,
    ) -> Result<(), BackendError> {
        self.destroy(agent, handle, grace).await
    }

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
