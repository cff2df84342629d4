//! The rows the store keeps, as plain values. Every one belongs to the
//! store's owner (the instance id), which the store stamps on write and
//! filters on read, so the records themselves carry no owner.

use kici_model::{AgentId, JobId, MemoryBytes, MilliCpu, ScalerName, ScalerType};
use std::collections::BTreeMap;

/// Every instant in the store: the workspace's one wall-clock type.
pub use kici_model::UnixMillis;

/// Backend resource names of one agent, by kind: what recovery needs to
/// re-adopt or destroy it. Keys are free-form but conventional:
/// `container` (container id), `pid` (`<pid>:<start time>`), `vm`, `tap`,
/// `chroot`, `cgroup`, `ip`, …. Stored as a JSON object.
pub type ResourceNames = BTreeMap<String, String>;

/// One agent, as recorded by its owning instance (table `agents`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentRecord {
    /// The agent's id (primary key across every instance of the store).
    pub agent_id: AgentId,
    /// The scaler entry that spawned it.
    pub scaler: ScalerName,
    /// The scaler's backend type.
    pub backend: ScalerType,
    /// Index of its label set in the scaler entry at spawn time.
    pub label_set_index: u32,
    /// The label set's normalized labels, joined: identifies the label set
    /// across config reloads that reorder entries.
    pub label_set_key: String,
    /// The lifecycle state name (the engine's, e.g. `provisioning`).
    pub state: String,
    /// Who dispatches its jobs: `orchestrator` or `standalone` (recovery
    /// resumes the two differently).
    pub mode: String,
    /// The job it is bound to, if any (warm agents have none).
    pub job_id: Option<JobId>,
    /// The orchestrator's run id of that job, if any.
    pub run_id: Option<String>,
    /// Spawned for the warm pool.
    pub warm: bool,
    /// CPU reserved for it at admission.
    pub milli_cpu: MilliCpu,
    /// Memory reserved for it at admission.
    pub memory_bytes: MemoryBytes,
    /// The machine pool its reservation is held in, if any.
    pub machine_pool: Option<String>,
    /// The backend's primary handle (container id, pid, VM id), once known.
    pub resource_id: Option<String>,
    /// Every backend resource created for it so far.
    pub resources: ResourceNames,
    /// Hash of its registration token, if one was issued.
    pub token_hash: Option<String>,
    /// When that token expires.
    pub token_expires_at: Option<UnixMillis>,
    /// Why it failed, once it has.
    pub failure: Option<String>,
    /// When it was first recorded.
    pub created_at: UnixMillis,
    /// When the record last changed.
    pub updated_at: UnixMillis,
}

/// A scale request waiting for capacity (table `pending_requests`), keyed by
/// job id within the owner.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingRecord {
    /// The job waiting for an agent.
    pub job_id: JobId,
    /// The requested labels as given.
    pub labels: Vec<String>,
    /// The whole request body, to replay it after a restart.
    pub request: serde_json::Value,
    /// The orchestrator's run id, if any.
    pub run_id: Option<String>,
    /// When it was queued.
    pub created_at: UnixMillis,
}

/// A standalone job (table `jobs`), keyed by job id within the owner: what
/// `GET /v1/jobs/{id}` shows of it, so that the job outlives a crash of the
/// daemon. Names (`state`, `end`) are the server's wire names; the store
/// keeps them as given. The command's environment is never recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRecord {
    /// The job's id.
    pub job_id: JobId,
    /// Its labels (runsOn), normalised.
    pub labels: Vec<String>,
    /// The command (argv).
    pub command: Vec<String>,
    /// Where the job is (`pending`, `spawning`, `running`, `failed`, …).
    pub state: String,
    /// The agent provisioned for it, once there is one.
    pub agent_id: Option<AgentId>,
    /// How it ended, once it has (`exited`, `aborted`, …).
    pub end: Option<String>,
    /// The command's exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that killed the command, when one did.
    pub signal: Option<i32>,
    /// Why it ended other than by its command's own exit.
    pub reason: Option<String>,
    /// Output bytes received when the record was written.
    pub output_bytes: u64,
    /// Output bytes no longer kept (the per-job cap) at that time.
    pub dropped_bytes: u64,
    /// When the job was submitted.
    pub created_at: UnixMillis,
    /// When the record last changed.
    pub updated_at: UnixMillis,
}

/// One event of the SSE stream (table `events`), for replay after a
/// reconnect or a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRecord {
    /// Position in this owner's stream (strictly increasing; the SSE id).
    pub seq: u64,
    /// When it happened.
    pub at: UnixMillis,
    /// The event as JSON text, sent as is.
    pub body: String,
}

/// One issued claim code (table `provision_claims`): what redeeming it
/// yields. The code itself is never stored, only its SHA-256.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRow {
    /// SHA-256 of the code, 32 bytes.
    pub code_hash: [u8; 32],
    /// The agent id the instance registers with.
    pub agent_id: AgentId,
    /// The event scaler that issued it.
    pub scaler: ScalerName,
    /// The labels the minted token is bound to.
    pub labels: Vec<String>,
    /// Where the agent connects (`ws://…/ws`).
    pub gateway_url: String,
    /// Lifetime of the token minted on redemption, in milliseconds.
    pub agent_token_ttl_ms: u64,
    /// When the code was issued.
    pub issued_at: UnixMillis,
    /// The code is refused from this instant on.
    pub expires_at: UnixMillis,
    /// Set once, by the one redemption that succeeded.
    pub consumed_at: Option<UnixMillis>,
}

/// What [`crate::StateStore::redeem_claim`] decided, atomically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimRedemption {
    /// Consumed now; the row as it is after the update.
    Granted(ClaimRow),
    /// No row with that hash for this owner.
    Unknown,
    /// Consumed earlier.
    Consumed,
    /// Past its expiry, never consumed.
    Expired,
}

/// One event of an external provisioner (table `provision_outbox`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    /// Stable across redeliveries; unique per owner.
    pub request_id: String,
    /// The agent the event is about.
    pub agent_id: AgentId,
    /// `scale-up` or `scale-down`.
    pub kind: String,
    /// The event's JSON (a scale-up's without its claim code).
    pub body: String,
    /// When it was recorded.
    pub created_at: UnixMillis,
    /// Set once the provisioner confirmed it.
    pub delivered_at: Option<UnixMillis>,
}
