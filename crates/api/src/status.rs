//! Operations: status, reload, health and readiness.

use crate::agents::ResourcesObject;
use crate::names::{BackendName, BreakerName};
use serde::{Deserialize, Serialize};

/// Usage and caps of one scope (global, a scaler).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct UsageObject {
    /// Live reservations.
    pub agents: u64,
    pub used: ResourcesObject,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_agents: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cpus: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_bytes: Option<u64>,
    /// What is left under each cap that is set.
    pub free: FreeObject,
    /// False for a scaler a reload removed while its agents are still live.
    pub configured: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct FreeObject {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agents: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
}

/// Live agents of one scaler by state group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct LabelSetStatusObject {
    pub index: usize,
    /// The label set's labels, with the auto-injected `kici:` ones.
    pub labels: Vec<String>,
    pub breaker: BreakerName,
    pub consecutive_failures: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ScalerStatusObject {
    pub name: String,
    pub backend: BackendName,
    pub agents: AgentCounts,
    /// Absent until admission knows the scaler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageObject>,
    /// Idle warm agents the scaler keeps (pool size × label sets).
    pub warm_target: u32,
    /// Where `warmTarget` comes from when the scaler has an
    /// `x-kici-scaler.warmPool` schedule or forecast and it is not
    /// upstream's size; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_source: Option<WarmSourceObject>,
    pub warm_idle: usize,
    /// Scale requests waiting for capacity.
    pub pending: usize,
    /// How long the oldest of `pending` has waited, in seconds; absent when
    /// nothing waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_seconds: Option<f64>,
    /// The spawn throttle (`maxConcurrentSpawns`).
    pub spawns: SpawnsObject,
    pub cordoned: bool,
    pub draining: bool,
    pub label_sets: Vec<LabelSetStatusObject>,
}

/// The schedule period or forecast a warm pool target comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct WarmSourceObject {
    /// `schedule` or `forecast`.
    pub kind: String,
    /// The active period's index in `schedule` (kind `schedule`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<usize>,
    /// The active period: `mon,tue 08:00-18:00 Europe/Paris`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// A scaler's spawn throttle: admitted agents whose backend spawn runs,
/// and those waiting (in admission order) for one of its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SpawnsObject {
    /// `maxConcurrentSpawns`: most spawns in flight at once.
    pub max_concurrent: u32,
    /// Spawns running now (agents in `provisioning` whose backend spawn has
    /// not ended; an external agent stays `provisioning` after delivery).
    pub in_flight: usize,
    /// Admitted agents waiting for a slot (in `requested`).
    pub waiting: usize,
}

/// `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StatusObject {
    /// This daemon's instance id (owner of everything it creates).
    pub instance_id: String,
    pub global: UsageObject,
    pub global_max_agents: u32,
    /// Scale requests waiting for capacity, over every scaler.
    pub pending: usize,
    /// How long the oldest of `pending` has waited, in seconds; absent when
    /// nothing waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_seconds: Option<f64>,
    pub scalers: Vec<ScalerStatusObject>,
    /// In a fleet: every other live host's status, each as this object
    /// (without hosts of its own). Empty with `?local=true`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(no_recursion))]
    pub hosts: Vec<StatusObject>,
    /// In a fleet: the live hosts missing from `hosts` because they did
    /// not answer in time, each with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable_hosts: Vec<crate::agents::UnreachableHost>,
}

/// What a reload changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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

/// `POST /v1/reload` succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReloadAnswer {
    pub diff: ReloadDiff,
}

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// Always `ok` while the process serves requests.
    pub status: String,
}

/// `GET /readyz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Readiness {
    pub ready: bool,
    /// Why not, when not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}
