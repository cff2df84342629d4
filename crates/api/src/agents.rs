//! Agents: the lifecycle reports an orchestrator sends and the agent views.

use crate::names::{AgentStateName, BackendName, FailureReasonName, ModeName};
use serde::{Deserialize, Serialize};

/// `POST /v1/agents/{id}/registered`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisteredBody {
    /// The token the agent presented (`kat_` + 64 hex).
    pub token: String,
}

/// `POST /v1/agents/{id}/job-started`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobStartedBody {
    pub job_id: String,
}

/// `POST /v1/agents/{id}/job-complete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobCompleteBody {
    pub job_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

/// What a registering agent is told.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RegistrationAnswer {
    /// The job this agent was spawned for (absent for a warm agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_job_id: Option<String>,
    /// Labels a job must carry to be dispatched to this agent.
    pub mandatory_labels: Vec<String>,
}

/// An amount of CPU and memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ResourcesObject {
    /// Cores.
    pub cpus: f64,
    pub memory_bytes: u64,
}

/// One agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentObject {
    pub agent_id: String,
    pub state: AgentStateName,
    pub scaler: String,
    pub backend: BackendName,
    pub label_set_index: usize,
    /// The job the agent is bound to or running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    /// What the agent reserved against the caps.
    pub resources: ResourcesObject,
    /// Spawned for a warm pool and not yet taken by a job.
    pub warm: bool,
    pub mode: ModeName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<FailureReasonName>,
    /// The last job's exit code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub age_seconds: f64,
    /// Seconds in the current state.
    pub state_seconds: f64,
    /// In a fleet: the instance id of the host that runs the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// `GET /v1/agents`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentList {
    pub agents: Vec<AgentObject>,
    /// In a fleet: the live hosts whose agents are missing from the list
    /// because they did not answer in time, each with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable_hosts: Vec<UnreachableHost>,
}

/// A fleet host a fleet-wide read could not reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct UnreachableHost {
    pub instance_id: String,
    /// Its advertised URL, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    pub reason: String,
}
