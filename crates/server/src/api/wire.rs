//! The control API's JSON shapes, as types the OpenAPI document is
//! generated from.
//!
//! Requests are parsed here into the model's validated types (labels, ids,
//! milli-CPUs, bytes), each problem reported with its JSON path. Answers are
//! built from the engine's views; keeping them separate from the engine's own
//! types means the published contract changes only when this file does.

use super::error::ApiError;
use kici_admission::{Cap, ScopeUsage};
use kici_engine::{
    AgentState, AgentView, BreakerState, FailureReason, Mode, ReloadReport, ScaleOutcome,
    ScaleRequest, Status,
};
use kici_model::{
    InstanceId, JobId, LabelSet, MemoryBytes, MilliCpu, ResourceRequest, ResourceSpec, Resources,
    ScalerType,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

// ------------------------------------------------------------------ requests

/// `POST /v1/scale`: ask for an agent for one job (orchestrator mode).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScaleBody {
    /// The caller's job id: 1 to 256 printable characters, no whitespace.
    /// A retry with the same id and body gets the same answer.
    pub job_id: String,
    /// The job's run (workflow run) id, passed to the agent.
    #[serde(default)]
    pub run_id: Option<String>,
    /// The job's `runsOn` labels: at least one; no whitespace, commas or
    /// control characters; at most 256 bytes each.
    pub labels: Vec<String>,
    /// Labels the agent must not have.
    #[serde(default)]
    pub exclude_labels: Option<Vec<String>>,
    /// What the job needs; unset dimensions fall back to the label set, then
    /// `defaults.resources`.
    #[serde(default)]
    pub resources: Option<ResourcesBody>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourcesBody {
    /// Reserved against the caps.
    #[serde(default)]
    pub requests: Option<ResourceSpecBody>,
    /// Enforced by the backend.
    #[serde(default)]
    pub limits: Option<ResourceSpecBody>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourceSpecBody {
    /// Cores, more than 0 and at most 256 (resolution 0.001).
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 256.0)]
    pub cpus: Option<f64>,
    /// A number followed by k, m or g (1024-based): `512m`, `1.5g`.
    #[serde(default)]
    #[schema(example = "512m")]
    pub memory: Option<String>,
}

impl ScaleBody {
    /// The engine's request; every problem names its field.
    pub fn into_request(self) -> Result<ScaleRequest, ApiError> {
        let job: JobId = self
            .job_id
            .parse()
            .map_err(|e: kici_model::IdError| ApiError::invalid("jobId", e.to_string()))?;
        let run_id = match self.run_id {
            Some(run) => {
                run.parse::<JobId>().map_err(|_| {
                    ApiError::invalid(
                        "runId",
                        format!(
                            "run id must be 1 to {} printable characters without whitespace",
                            JobId::MAX_LEN
                        ),
                    )
                })?;
                Some(run)
            }
            None => None,
        };
        if self.labels.is_empty() {
            return Err(ApiError::invalid(
                "labels",
                "at least one label is required (the job's runsOn)",
            ));
        }
        let labels = parse_labels("labels", &self.labels)?;
        let exclude = parse_labels(
            "excludeLabels",
            self.exclude_labels.as_deref().unwrap_or(&[]),
        )?;
        let resources = match self.resources {
            Some(r) => r.into_request("resources")?,
            None => None,
        };
        Ok(ScaleRequest {
            job,
            run_id,
            labels,
            exclude,
            resources,
            mode: Mode::Orchestrator,
        })
    }
}

pub(crate) fn parse_labels(field: &str, raw: &[String]) -> Result<LabelSet, ApiError> {
    for (i, label) in raw.iter().enumerate() {
        kici_model::Label::parse(label)
            .map_err(|e| ApiError::invalid(format!("{field}[{i}]"), e.to_string()))?;
    }
    LabelSet::parse(raw).map_err(|e| ApiError::invalid(field, e.to_string()))
}

impl ResourcesBody {
    pub(crate) fn into_request(self, at: &str) -> Result<Option<ResourceRequest>, ApiError> {
        let requests = self
            .requests
            .map(|s| s.into_spec(&format!("{at}.requests")))
            .transpose()?
            .filter(|s| !s.is_empty());
        let limits = self
            .limits
            .map(|s| s.into_spec(&format!("{at}.limits")))
            .transpose()?
            .filter(|s| !s.is_empty());
        if requests.is_none() && limits.is_none() {
            return Ok(None);
        }
        let request = ResourceRequest { requests, limits };
        request
            .check_requests_within_limits()
            .map_err(|e| ApiError::invalid(format!("{at}.requests"), e))?;
        Ok(Some(request))
    }
}

impl ResourceSpecBody {
    fn into_spec(self, at: &str) -> Result<ResourceSpec, ApiError> {
        let cpus = self
            .cpus
            .map(MilliCpu::from_cores)
            .transpose()
            .map_err(|e| ApiError::invalid(format!("{at}.cpus"), e.to_string()))?;
        let memory = self
            .memory
            .map(|m| MemoryBytes::parse_request(&m))
            .transpose()
            .map_err(|e| ApiError::invalid(format!("{at}.memory"), e.to_string()))?;
        if memory == Some(MemoryBytes::ZERO) {
            return Err(ApiError::invalid(
                format!("{at}.memory"),
                "memory must be more than 0",
            ));
        }
        Ok(ResourceSpec { cpus, memory })
    }
}

/// `POST /v1/agents/{id}/registered`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisteredBody {
    /// The token the agent presented (`kat_` + 64 hex).
    pub token: String,
}

/// `POST /v1/agents/{id}/job-started`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobStartedBody {
    pub job_id: String,
}

/// `POST /v1/agents/{id}/job-complete`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobCompleteBody {
    pub job_id: String,
    #[serde(default)]
    pub exit_code: Option<i32>,
}

pub fn parse_job(field: &str, raw: &str) -> Result<JobId, ApiError> {
    raw.parse()
        .map_err(|e: kici_model::IdError| ApiError::invalid(field, e.to_string()))
}

// ------------------------------------------------------------------- answers

/// The answer to `POST /v1/scale`.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "result", rename_all = "kebab-case")]
pub enum ScaleAnswer {
    /// An agent is being provisioned for the job (202), or a warm one took
    /// it.
    #[serde(rename_all = "camelCase")]
    Spawning {
        agent_id: String,
        scaler: String,
        backend: BackendName,
        warm: bool,
    },
    /// Capacity is busy: the request waits (FIFO among those that fit) until
    /// it fits, is cancelled, or its TTL passes. `position` is 1-based.
    Pending { position: usize },
    /// The request can never fit under `cap`.
    TooLarge { cap: CapName, detail: String },
    /// No label set accepts the labels.
    NoBackend { explanation: String },
}

impl From<ScaleOutcome> for ScaleAnswer {
    fn from(o: ScaleOutcome) -> Self {
        match o {
            ScaleOutcome::Spawning {
                agent_id,
                scaler,
                backend,
                warm,
            } => Self::Spawning {
                agent_id: agent_id.to_string(),
                scaler: scaler.to_string(),
                backend: backend.into(),
                warm,
            },
            ScaleOutcome::Pending { position } => Self::Pending { position },
            ScaleOutcome::TooLarge { cap, detail } => Self::TooLarge {
                cap: cap.into(),
                detail,
            },
            ScaleOutcome::NoBackend { explanation } => Self::NoBackend { explanation },
        }
    }
}

/// A scaler type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum BackendName {
    Container,
    BareMetal,
    Firecracker,
}

impl From<ScalerType> for BackendName {
    fn from(t: ScalerType) -> Self {
        match t {
            ScalerType::Container => Self::Container,
            ScalerType::BareMetal => Self::BareMetal,
            ScalerType::Firecracker => Self::Firecracker,
        }
    }
}

/// A cap admission enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum CapName {
    GlobalCount,
    ScalerCount,
    ScalerCpu,
    ScalerMemory,
    GlobalCpu,
    GlobalMemory,
    PoolCpu,
    PoolMemory,
}

impl From<Cap> for CapName {
    fn from(c: Cap) -> Self {
        match c {
            Cap::GlobalCount => Self::GlobalCount,
            Cap::ScalerCount => Self::ScalerCount,
            Cap::ScalerCpu => Self::ScalerCpu,
            Cap::ScalerMemory => Self::ScalerMemory,
            Cap::GlobalCpu => Self::GlobalCpu,
            Cap::GlobalMemory => Self::GlobalMemory,
            Cap::PoolCpu => Self::PoolCpu,
            Cap::PoolMemory => Self::PoolMemory,
        }
    }
}

/// Where an agent is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum AgentStateName {
    Requested,
    Provisioning,
    Booted,
    Registered,
    Idle,
    Busy,
    Draining,
    Destroying,
    Gone,
}

impl From<AgentState> for AgentStateName {
    fn from(s: AgentState) -> Self {
        match s {
            AgentState::Requested => Self::Requested,
            AgentState::Provisioning => Self::Provisioning,
            AgentState::Booted => Self::Booted,
            AgentState::Registered => Self::Registered,
            AgentState::Idle => Self::Idle,
            AgentState::Busy => Self::Busy,
            AgentState::Draining => Self::Draining,
            AgentState::Destroying => Self::Destroying,
            AgentState::Gone => Self::Gone,
        }
    }
}

/// Why an agent was destroyed early.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum FailureReasonName {
    ProvisionError,
    ProvisionTimeout,
    RegistrationTimeout,
    BootFailure,
    ExitedEarly,
    LifetimeExceeded,
    PendingDispatchTimeout,
}

impl From<FailureReason> for FailureReasonName {
    fn from(r: FailureReason) -> Self {
        match r {
            FailureReason::ProvisionError => Self::ProvisionError,
            FailureReason::ProvisionTimeout => Self::ProvisionTimeout,
            FailureReason::RegistrationTimeout => Self::RegistrationTimeout,
            FailureReason::BootFailure => Self::BootFailure,
            FailureReason::ExitedEarly => Self::ExitedEarly,
            FailureReason::LifetimeExceeded => Self::LifetimeExceeded,
            FailureReason::PendingDispatchTimeout => Self::PendingDispatchTimeout,
        }
    }
}

/// Who dispatches the agent's jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ModeName {
    Orchestrator,
    Standalone,
}

impl From<Mode> for ModeName {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Orchestrator => Self::Orchestrator,
            Mode::Standalone => Self::Standalone,
        }
    }
}

/// A label set's spawn circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum BreakerName {
    Closed,
    Open,
    HalfOpen,
}

impl From<BreakerState> for BreakerName {
    fn from(b: BreakerState) -> Self {
        match b {
            BreakerState::Closed => Self::Closed,
            BreakerState::Open => Self::Open,
            BreakerState::HalfOpen => Self::HalfOpen,
        }
    }
}

/// An amount of CPU and memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourcesObject {
    /// Cores.
    pub cpus: f64,
    pub memory_bytes: u64,
}

impl From<Resources> for ResourcesObject {
    fn from(r: Resources) -> Self {
        Self {
            cpus: r.cpu.as_cores(),
            memory_bytes: r.memory.bytes(),
        }
    }
}

/// One agent.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentObject {
    pub agent_id: String,
    pub state: AgentStateName,
    pub scaler: String,
    pub backend: BackendName,
    pub label_set_index: usize,
    /// The job the agent is bound to or running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    /// What the agent reserved against the caps.
    pub resources: ResourcesObject,
    /// Spawned for a warm pool and not yet taken by a job.
    pub warm: bool,
    pub mode: ModeName,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<FailureReasonName>,
    /// The last job's exit code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub age_seconds: f64,
    /// Seconds in the current state.
    pub state_seconds: f64,
}

impl From<AgentView> for AgentObject {
    fn from(v: AgentView) -> Self {
        Self {
            agent_id: v.agent_id.to_string(),
            state: v.state.into(),
            scaler: v.scaler.to_string(),
            backend: v.backend.into(),
            label_set_index: v.label_set_index,
            job_id: v.job_id.map(|j| j.to_string()),
            resources: v.resources.into(),
            warm: v.warm,
            mode: v.mode.into(),
            failure_reason: v.failure_reason.map(Into::into),
            exit_code: v.exit_code,
            age_seconds: v.age_seconds,
            state_seconds: v.state_seconds,
        }
    }
}

/// `GET /v1/agents`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AgentList {
    pub agents: Vec<AgentObject>,
}

/// What a registering agent is told.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RegistrationAnswer {
    /// The job this agent was spawned for (absent for a warm agent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound_job_id: Option<String>,
    /// Labels a job must carry to be dispatched to this agent.
    pub mandatory_labels: Vec<String>,
}

/// Usage and caps of one scope (global, a scaler).
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageObject {
    /// Live reservations.
    pub agents: u64,
    pub used: ResourcesObject,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_agents: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cpus: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory_bytes: Option<u64>,
    /// What is left under each cap that is set.
    pub free: FreeObject,
    /// False for a scaler a reload removed while its agents are still live.
    pub configured: bool,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FreeObject {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agents: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
}

impl From<&ScopeUsage> for UsageObject {
    fn from(u: &ScopeUsage) -> Self {
        Self {
            agents: u.agents,
            used: Resources::new(u.cpu, u.memory).into(),
            max_agents: u.caps.max_agents,
            max_cpus: u.caps.max_cpu.map(MilliCpu::as_cores),
            max_memory_bytes: u.caps.max_memory.map(MemoryBytes::bytes),
            free: FreeObject {
                agents: u.caps.max_agents.map(|m| m.saturating_sub(u.agents)),
                cpus: u.caps.max_cpu.map(|m| m.saturating_sub(u.cpu).as_cores()),
                memory_bytes: u
                    .caps
                    .max_memory
                    .map(|m| m.saturating_sub(u.memory).bytes()),
            },
            configured: u.configured,
        }
    }
}

/// Live agents of one scaler by state group.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentCounts {
    /// Requested, provisioning or booted.
    pub spawning: usize,
    pub registered: usize,
    pub idle: usize,
    pub busy: usize,
    pub draining: usize,
    pub destroying: usize,
    /// Every live agent.
    pub active: usize,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSetStatusObject {
    pub index: usize,
    /// The label set's labels, with the auto-injected `kici:` ones.
    pub labels: Vec<String>,
    pub breaker: BreakerName,
    pub consecutive_failures: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScalerStatusObject {
    pub name: String,
    pub backend: BackendName,
    pub agents: AgentCounts,
    /// Absent until admission knows the scaler.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageObject>,
    /// Idle warm agents the scaler keeps (pool size × label sets).
    pub warm_target: u32,
    pub warm_idle: usize,
    /// Scale requests waiting for capacity.
    pub pending: usize,
    pub cordoned: bool,
    pub draining: bool,
    pub label_sets: Vec<LabelSetStatusObject>,
}

/// `GET /v1/status`.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StatusObject {
    /// This daemon's instance id (owner of everything it creates).
    pub instance_id: String,
    pub global: UsageObject,
    pub global_max_agents: u32,
    pub pending: usize,
    pub scalers: Vec<ScalerStatusObject>,
}

impl StatusObject {
    pub fn new(instance: InstanceId, s: &Status) -> Self {
        Self {
            instance_id: instance.to_string(),
            global: (&s.global).into(),
            global_max_agents: s.global_max_agents,
            pending: s.pending,
            scalers: s
                .scalers
                .iter()
                .map(|sc| ScalerStatusObject {
                    name: sc.name.to_string(),
                    backend: sc.backend.into(),
                    agents: AgentCounts {
                        spawning: sc.agents.spawning,
                        registered: sc.agents.registered,
                        idle: sc.agents.idle,
                        busy: sc.agents.busy,
                        draining: sc.agents.draining,
                        destroying: sc.agents.destroying,
                        active: sc.agents.active,
                    },
                    usage: sc.usage.as_ref().map(Into::into),
                    warm_target: sc.warm_target,
                    warm_idle: sc.warm_idle,
                    pending: sc.pending,
                    cordoned: sc.cordoned,
                    draining: sc.draining,
                    label_sets: sc
                        .label_sets
                        .iter()
                        .map(|ls| LabelSetStatusObject {
                            index: ls.index,
                            labels: ls.labels.iter().map(|l| l.to_string()).collect(),
                            breaker: ls.breaker.into(),
                            consecutive_failures: ls.consecutive_failures,
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// What a reload changed.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReloadDiff {
    /// Scalers added.
    pub added: Vec<String>,
    /// Scalers removed (their agents finish their job and leave).
    pub removed: Vec<String>,
    /// Pending jobs cancelled because no scaler serves them any more.
    pub cancelled: Vec<String>,
    /// Every changed field, `path: old -> new`.
    pub changes: Vec<String>,
}

impl From<ReloadReport> for ReloadDiff {
    fn from(r: ReloadReport) -> Self {
        Self {
            added: r.added,
            removed: r.removed,
            cancelled: r.cancelled,
            changes: r.changes,
        }
    }
}

/// `POST /v1/reload` succeeded.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ReloadAnswer {
    pub diff: ReloadDiff,
}

/// `GET /healthz`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Health {
    /// Always `ok` while the process serves requests.
    pub status: String,
}

/// `GET /readyz`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Readiness {
    pub ready: bool,
    /// Why not, when not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}
