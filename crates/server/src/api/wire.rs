//! The control API's edge: requests parsed into the engine's types, and
//! the engine's views converted into answers.
//!
//! The JSON shapes themselves are [`kici_api`]'s types (re-exported here),
//! which the OpenAPI document is generated from. Requests are parsed here
//! into the model's validated types (labels, ids, milli-CPUs, bytes), each
//! problem reported with its JSON path. Answers are converted from the
//! engine's views with [`IntoApi`]: no engine type is serialized on the
//! wire, so the published contract changes only when `kici-api` does.

use super::error::ApiError;
use crate::service::requests;
use kici_admission::{Cap, ScopeUsage};
use kici_engine::{
    AgentState, AgentView, BreakerState, EngineEvent, FailureReason, Mode, PendingEnd,
    ReloadReport, ScaleOutcome, ScaleRequest, Status,
};
use kici_model::{InstanceId, JobId, MemoryBytes, MilliCpu, Resources, ScalerType};

pub use kici_api::{
    AgentCounts, AgentList, AgentObject, AgentStateName, BackendName, BreakerName, CapName, Event,
    FailureReasonName, FreeObject, Health, JobCompleteBody, JobStartedBody, LabelSetStatusObject,
    ModeName, PendingEndName, Readiness, RegisteredBody, RegistrationAnswer, ReloadAnswer,
    ReloadDiff, ResourceSpecBody, ResourcesBody, ResourcesObject, ScaleAnswer, ScaleBody,
    ScalerStatusObject, SpawnsObject, StatusObject, UnreachableHost, UsageObject,
};

// ------------------------------------------------------------------ requests

/// A request body parsed into the engine's request; every problem names
/// its field.
pub trait IntoRequest {
    type Request;
    fn into_request(self) -> Result<Self::Request, ApiError>;
}

impl IntoRequest for ScaleBody {
    type Request = ScaleRequest;

    /// The engine's request ([`requests::scale_request`]); every problem
    /// names its field.
    fn into_request(self) -> Result<ScaleRequest, ApiError> {
        Ok(requests::scale_request(self)?)
    }
}

/// The status's warm source; `None` for upstream's own size.
fn warm_source(source: &kici_engine::WarmSource) -> Option<kici_api::WarmSourceObject> {
    use kici_engine::WarmSource;
    match source {
        WarmSource::Static => None,
        WarmSource::Period { index, description } => Some(kici_api::WarmSourceObject {
            kind: source.as_str().to_owned(),
            period: Some(*index),
            description: Some(description.clone()),
        }),
        WarmSource::Forecast => Some(kici_api::WarmSourceObject {
            kind: source.as_str().to_owned(),
            period: None,
            description: None,
        }),
    }
}

pub fn parse_job(field: &str, raw: &str) -> Result<JobId, ApiError> {
    raw.parse()
        .map_err(|e: kici_model::IdError| ApiError::invalid(field, e.to_string()))
}

// ------------------------------------------------------------------- answers

/// An engine (or model, or admission) value as the API shows it.
pub trait IntoApi<T> {
    fn into_api(self) -> T;
}

impl IntoApi<ScaleAnswer> for ScaleOutcome {
    fn into_api(self) -> ScaleAnswer {
        match self {
            ScaleOutcome::Spawning {
                agent_id,
                scaler,
                backend,
                warm,
            } => ScaleAnswer::Spawning {
                agent_id: agent_id.to_string(),
                scaler: scaler.to_string(),
                backend: backend.into_api(),
                warm,
                hosts: Vec::new(),
            },
            ScaleOutcome::Pending { position } => ScaleAnswer::Pending {
                position,
                hosts: Vec::new(),
            },
            ScaleOutcome::TooLarge { cap, detail } => ScaleAnswer::TooLarge {
                cap: cap.into_api(),
                detail,
            },
            ScaleOutcome::NoBackend { explanation } => ScaleAnswer::NoBackend { explanation },
        }
    }
}

impl IntoApi<BackendName> for ScalerType {
    fn into_api(self) -> BackendName {
        match self {
            ScalerType::Container => BackendName::Container,
            ScalerType::BareMetal => BackendName::BareMetal,
            ScalerType::Firecracker => BackendName::Firecracker,
            ScalerType::Event => BackendName::Event,
        }
    }
}

impl IntoApi<CapName> for Cap {
    fn into_api(self) -> CapName {
        match self {
            Cap::GlobalCount => CapName::GlobalCount,
            Cap::ScalerCount => CapName::ScalerCount,
            Cap::ScalerCpu => CapName::ScalerCpu,
            Cap::ScalerMemory => CapName::ScalerMemory,
            Cap::GlobalCpu => CapName::GlobalCpu,
            Cap::GlobalMemory => CapName::GlobalMemory,
            Cap::PoolCpu => CapName::PoolCpu,
            Cap::PoolMemory => CapName::PoolMemory,
        }
    }
}

impl IntoApi<AgentStateName> for AgentState {
    fn into_api(self) -> AgentStateName {
        match self {
            AgentState::Requested => AgentStateName::Requested,
            AgentState::Provisioning => AgentStateName::Provisioning,
            AgentState::Booted => AgentStateName::Booted,
            AgentState::Registered => AgentStateName::Registered,
            AgentState::Idle => AgentStateName::Idle,
            AgentState::Busy => AgentStateName::Busy,
            AgentState::Draining => AgentStateName::Draining,
            AgentState::Destroying => AgentStateName::Destroying,
            AgentState::Gone => AgentStateName::Gone,
        }
    }
}

impl IntoApi<FailureReasonName> for FailureReason {
    fn into_api(self) -> FailureReasonName {
        match self {
            FailureReason::ProvisionError => FailureReasonName::ProvisionError,
            FailureReason::ProvisionTimeout => FailureReasonName::ProvisionTimeout,
            FailureReason::RegistrationTimeout => FailureReasonName::RegistrationTimeout,
            FailureReason::BootFailure => FailureReasonName::BootFailure,
            FailureReason::ExitedEarly => FailureReasonName::ExitedEarly,
            FailureReason::LifetimeExceeded => FailureReasonName::LifetimeExceeded,
            FailureReason::PendingDispatchTimeout => FailureReasonName::PendingDispatchTimeout,
        }
    }
}

impl IntoApi<ModeName> for Mode {
    fn into_api(self) -> ModeName {
        match self {
            Mode::Orchestrator => ModeName::Orchestrator,
            Mode::Standalone => ModeName::Standalone,
        }
    }
}

impl IntoApi<BreakerName> for BreakerState {
    fn into_api(self) -> BreakerName {
        match self {
            BreakerState::Closed => BreakerName::Closed,
            BreakerState::Open => BreakerName::Open,
            BreakerState::HalfOpen => BreakerName::HalfOpen,
        }
    }
}

impl IntoApi<PendingEndName> for PendingEnd {
    fn into_api(self) -> PendingEndName {
        match self {
            PendingEnd::Admitted => PendingEndName::Admitted,
            PendingEnd::Cancelled => PendingEndName::Cancelled,
            PendingEnd::Expired => PendingEndName::Expired,
            PendingEnd::NoBackend => PendingEndName::NoBackend,
            PendingEnd::TooLarge => PendingEndName::TooLarge,
        }
    }
}

impl IntoApi<ResourcesObject> for Resources {
    fn into_api(self) -> ResourcesObject {
        ResourcesObject {
            cpus: self.cpu.as_cores(),
            memory_bytes: self.memory.bytes(),
        }
    }
}

impl IntoApi<AgentObject> for AgentView {
    fn into_api(self) -> AgentObject {
        AgentObject {
            agent_id: self.agent_id.to_string(),
            state: self.state.into_api(),
            scaler: self.scaler.to_string(),
            backend: self.backend.into_api(),
            label_set_index: self.label_set_index,
            job_id: self.job_id.map(|j| j.to_string()),
            resources: self.resources.into_api(),
            warm: self.warm,
            mode: self.mode.into_api(),
            failure_reason: self.failure_reason.map(IntoApi::into_api),
            exit_code: self.exit_code,
            age_seconds: self.age_seconds,
            state_seconds: self.state_seconds,
            host: None,
        }
    }
}

impl IntoApi<UsageObject> for &ScopeUsage {
    fn into_api(self) -> UsageObject {
        let u = self;
        UsageObject {
            agents: u.agents,
            used: Resources::new(u.cpu, u.memory).into_api(),
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

/// `GET /v1/status` of instance `instance`.
pub fn status_object(instance: InstanceId, s: &Status) -> StatusObject {
    StatusObject {
        hosts: Vec::new(),
        unreachable_hosts: Vec::new(),
        instance_id: instance.to_string(),
        global: (&s.global).into_api(),
        global_max_agents: s.global_max_agents,
        pending: s.pending,
        oldest_pending_seconds: s.oldest_pending.map(|d| d.as_secs_f64()),
        scalers: s
            .scalers
            .iter()
            .map(|sc| ScalerStatusObject {
                name: sc.name.to_string(),
                backend: sc.backend.into_api(),
                agents: AgentCounts {
                    spawning: sc.agents.spawning,
                    registered: sc.agents.registered,
                    idle: sc.agents.idle,
                    busy: sc.agents.busy,
                    draining: sc.agents.draining,
                    destroying: sc.agents.destroying,
                    active: sc.agents.active,
                },
                usage: sc.usage.as_ref().map(IntoApi::into_api),
                warm_target: sc.warm_target,
                warm_source: warm_source(&sc.warm_source),
                warm_idle: sc.warm_idle,
                pending: sc.pending,
                oldest_pending_seconds: sc.oldest_pending.map(|d| d.as_secs_f64()),
                spawns: SpawnsObject {
                    max_concurrent: sc.max_concurrent_spawns,
                    in_flight: sc.spawns_in_flight,
                    waiting: sc.spawns_waiting,
                },
                cordoned: sc.cordoned,
                draining: sc.draining,
                label_sets: sc
                    .label_sets
                    .iter()
                    .map(|ls| LabelSetStatusObject {
                        index: ls.index,
                        labels: ls.labels.iter().map(|l| l.to_string()).collect(),
                        breaker: ls.breaker.into_api(),
                        consecutive_failures: ls.consecutive_failures,
                    })
                    .collect(),
            })
            .collect(),
    }
}

impl IntoApi<ReloadDiff> for ReloadReport {
    fn into_api(self) -> ReloadDiff {
        ReloadDiff {
            added: self.added,
            removed: self.removed,
            cancelled: self.cancelled,
            changes: self.changes,
        }
    }
}

impl IntoApi<Event> for EngineEvent {
    fn into_api(self) -> Event {
        match self {
            EngineEvent::AgentTransition {
                agent_id,
                scaler,
                backend,
                from,
                to,
                job_id,
                failure_reason,
                cause,
                detail,
                seconds_in_state,
            } => Event::AgentTransition {
                agent_id: agent_id.to_string(),
                scaler: scaler.to_string(),
                backend: backend.into_api(),
                from: from.into_api(),
                to: to.into_api(),
                job_id: job_id.map(|j| j.to_string()),
                failure_reason: failure_reason.map(IntoApi::into_api),
                cause: cause.map(|c| c.as_str().to_owned()),
                detail,
                seconds_in_state,
            },
            EngineEvent::Refused {
                job_id,
                scaler,
                cap,
                detail,
            } => Event::Refused {
                job_id: job_id.to_string(),
                scaler: scaler.to_string(),
                cap: cap.into_api(),
                detail,
            },
            EngineEvent::PendingEnded {
                job_id,
                scaler,
                end,
                waited_seconds,
            } => Event::PendingEnded {
                job_id: job_id.to_string(),
                scaler: scaler.to_string(),
                end: end.into_api(),
                waited_seconds,
            },
            EngineEvent::BreakerChanged {
                scaler,
                label_set,
                state,
            } => Event::BreakerChanged {
                scaler: scaler.to_string(),
                label_set,
                state: state.into_api(),
            },
            EngineEvent::ScalerCordon {
                scaler,
                cordoned,
                draining,
            } => Event::ScalerCordon {
                scaler: scaler.to_string(),
                cordoned,
                draining,
            },
            EngineEvent::Reloaded { added, removed } => Event::Reloaded { added, removed },
            EngineEvent::Provision(kici_engine::ProvisionNotice::ScaleUp {
                request_id,
                agent_id,
                scaler,
                labels,
                resources,
                claim_code,
                claim_url,
                expires_at,
                job_id,
            }) => Event::ScaleUp {
                request_id,
                agent_id: agent_id.to_string(),
                scaler: scaler.to_string(),
                labels,
                resources: serde_json::to_value(kici_provision::EventResources::from(&resources))
                    .unwrap_or(serde_json::Value::Null),
                claim_code: Some(claim_code.expose().to_owned()),
                claim_url,
                expires_at,
                job_id: job_id.map(|j| j.to_string()),
            },
            EngineEvent::Provision(kici_engine::ProvisionNotice::ScaleDown {
                request_id,
                agent_id,
                scaler,
                reason,
            }) => Event::ScaleDown {
                request_id,
                agent_id: agent_id.to_string(),
                scaler: scaler.to_string(),
                reason,
            },
        }
    }
}
