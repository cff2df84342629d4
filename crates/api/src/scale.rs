//! Scale requests (orchestrator mode): `POST /v1/scale` and its answer.

use crate::names::{BackendName, CapName};
use serde::{Deserialize, Serialize};

/// `POST /v1/scale`: ask for an agent for one job (orchestrator mode).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScaleBody {
    /// The caller's job id: 1 to 256 printable characters, no whitespace.
    /// A retry with the same id and body gets the same answer.
    pub job_id: String,
    /// The job's run (workflow run) id, passed to the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// The job's `runsOn` labels: at least one; no whitespace, commas or
    /// control characters; at most 256 bytes each.
    pub labels: Vec<String>,
    /// Labels the agent must not have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude_labels: Option<Vec<String>>,
    /// What the job needs; unset dimensions fall back to the label set, then
    /// `defaults.resources`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesBody>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourcesBody {
    /// Reserved against the caps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<ResourceSpecBody>,
    /// Enforced by the backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<ResourceSpecBody>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourceSpecBody {
    /// Cores, more than 0 and at most 256 (resolution 0.001).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0, maximum = 256.0))]
    pub cpus: Option<f64>,
    /// A number followed by k, m or g (1024-based): `512m`, `1.5g`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(example = "512m"))]
    pub memory: Option<String>,
}

impl ResourcesBody {
    /// Requests of `cpus` cores and `memory` (either may be unset); `None`
    /// when both are.
    pub fn requests(cpus: Option<f64>, memory: Option<String>) -> Option<Self> {
        (cpus.is_some() || memory.is_some()).then_some(Self {
            requests: Some(ResourceSpecBody { cpus, memory }),
            limits: None,
        })
    }
}

/// The answer to `POST /v1/scale`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
        /// In a fleet: the hosts (instance ids) serving the scaler's pool.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        hosts: Vec<String>,
    },
    /// Capacity is busy: the request waits (FIFO among those that fit) until
    /// it fits, is cancelled, or its TTL passes. `position` is 1-based.
    #[serde(rename_all = "camelCase")]
    Pending {
        position: usize,
        /// In a fleet: the hosts (instance ids) serving the chosen pool.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        hosts: Vec<String>,
    },
    /// The request can never fit under `cap`.
    TooLarge { cap: CapName, detail: String },
    /// No label set accepts the labels.
    NoBackend { explanation: String },
}
