//! The messages of each direction, as one tagged enum per direction.
//!
//! Each payload is its own struct (so handlers take `&Register`, not a
//! variant), and each struct rejects unknown fields.

use crate::job::{JobEnd, JobResult, JobSpec, OutputChunk};
use crate::token::AgentToken;
use crate::wire::{self, UnixMillis};
use kici_model::{AgentId, JobId, LabelSet};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::num::NonZeroU32;

/// Everything an agent sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum AgentMessage {
    #[serde(rename = "auth.request")]
    AuthRequest(AuthRequest),
    #[serde(rename = "agent.register")]
    Register(Box<Register>),
    #[serde(rename = "config.ack")]
    ConfigAck(ConfigAck),
    #[serde(rename = "heartbeat")]
    Heartbeat(Heartbeat),
    #[serde(rename = "job.ack")]
    JobAck(JobAck),
    #[serde(rename = "job.reject")]
    JobReject(JobReject),
    #[serde(rename = "job.status")]
    JobStatus(JobStatus),
    #[serde(rename = "log.chunk")]
    OutputChunk(OutputChunk),
    /// Before `auth.request`: redeem a `type: event` scaler's claim code.
    #[serde(rename = "scaler.claim-credentials")]
    ClaimCredentials(ClaimCredentials),
}

/// Everything the gateway sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum GatewayMessage {
    #[serde(rename = "auth.success")]
    AuthSuccess(AuthSuccess),
    #[serde(rename = "auth.failure")]
    AuthFailure(AuthFailure),
    #[serde(rename = "register.ack")]
    RegisterAck(RegisterAck),
    #[serde(rename = "job.dispatch")]
    JobDispatch(JobDispatch),
    #[serde(rename = "job.cancel")]
    JobCancel(JobCancel),
    #[serde(rename = "scaler.claim-credentials.response")]
    ClaimCredentialsResponse(ClaimCredentialsResponse),
}

impl AgentMessage {
    /// The dotted `type` name.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::AuthRequest(_) => "auth.request",
            Self::Register(_) => "agent.register",
            Self::ConfigAck(_) => "config.ack",
            Self::Heartbeat(_) => "heartbeat",
            Self::JobAck(_) => "job.ack",
            Self::JobReject(_) => "job.reject",
            Self::JobStatus(_) => "job.status",
            Self::OutputChunk(_) => "log.chunk",
            Self::ClaimCredentials(_) => "scaler.claim-credentials",
        }
    }

    pub fn to_json(&self) -> String {
        // Serializing these types cannot fail: every map key is a string
        // and no custom Serialize impl returns an error.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

impl GatewayMessage {
    /// Every `type` the gateway sends.
    pub const TYPES: [&'static str; 5] = [
        "auth.success",
        "auth.failure",
        "register.ack",
        "job.dispatch",
        "job.cancel",
    ];

    /// The dotted `type` name.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::AuthSuccess(_) => "auth.success",
            Self::AuthFailure(_) => "auth.failure",
            Self::RegisterAck(_) => "register.ack",
            Self::JobDispatch(_) => "job.dispatch",
            Self::JobCancel(_) => "job.cancel",
            Self::ClaimCredentialsResponse(_) => "scaler.claim-credentials.response",
        }
    }

    pub fn to_json(&self) -> String {
        // As for AgentMessage: infallible for these types.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

// ---------------------------------------------------------------------------
// Handshake

/// `scaler.claim-credentials`: exchange a claim code for credentials, on a
/// connection that has not authenticated yet (the code is the
/// credential). The connection stays unauthenticated: `auth.request`
/// follows, within the same deadline.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimCredentials {
    pub request_id: String,
    /// Single use; redacted in `Debug`.
    pub claim_code: String,
}

impl std::fmt::Debug for ClaimCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimCredentials")
            .field("request_id", &self.request_id)
            .field("claim_code", &"<redacted>")
            .finish()
    }
}

/// `scaler.claim-credentials.response`: `credentials` or `error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimCredentialsResponse {
    pub request_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<ClaimedAgentCredentials>,
    /// Why there are none (the refusal's reason: `unknown`, `consumed`,
    /// `expired`, or a failure's kind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What a redeemed code yields (upstream's field names).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimedAgentCredentials {
    /// Redacted in `Debug`.
    pub agent_token: String,
    pub agent_id: String,
    /// The WebSocket URL to connect with the token.
    pub orchestrator_url: String,
    pub labels: Vec<String>,
}

impl std::fmt::Debug for ClaimedAgentCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimedAgentCredentials")
            .field("agent_token", &"<redacted>")
            .field("agent_id", &self.agent_id)
            .field("orchestrator_url", &self.orchestrator_url)
            .field("labels", &self.labels)
            .finish()
    }
}

/// `auth.request`: the agent's first frame when it has a token.
///
/// `protocolVersion` is any unsigned integer on the wire: one outside
/// [`crate::SUPPORTED_PROTOCOL_VERSIONS`] is the gateway's to refuse with
/// its own close code (4005), not a malformed message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuthRequest {
    pub token: AgentToken,
    pub protocol_version: u32,
}

/// `auth.success`: the token is valid; the next frame must be
/// `agent.register`.
///
/// Gateway → agent messages accept unknown fields (a newer gateway may add
/// some; the agent reads what it knows), unlike agent → gateway ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthSuccess {
    pub connection_id: String,
}

/// `auth.failure`: sent before the gateway closes with 4010 (or 4005).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthFailure {
    pub reason: String,
}

/// A job the agent was still running when it (re)connected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InFlightJob {
    pub job_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
}

/// A value in `agent.register.properties` (KiCI: string, number or bool).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PropertyValue {
    Bool(bool),
    Integer(i64),
    Float(f64),
    Text(String),
}

/// `agent.register`. Only `messageId`, `agentId` and `labels` are required;
/// the optional fields are KiCI's, so a KiCI agent's registration parses.
/// `labels` is the full list: the bootstrap `KICI_LABELS` plus the agent's
/// own `kici:os:*`, `kici:arch:*`, `kici:host:*` and role labels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Register {
    pub message_id: String,
    #[serde(deserialize_with = "wire::from_str")]
    pub agent_id: AgentId,
    #[serde(deserialize_with = "wire::label_set")]
    pub labels: LabelSet,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Absent ⇒ 1 (KiCI agents never send it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<NonZeroU32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_flight_jobs: Vec<InFlightJob>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os_release: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_memory_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_as_user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_as_uid: Option<u32>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, PropertyValue>,
    /// What the agent advertises it supports (KiCI 0.9's agent sends its
    /// flags here); read by no one here, accepted so its registration
    /// parses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<serde_json::Map<String, serde_json::Value>>,
}

impl Register {
    /// A registration with only the required fields; set the optional ones
    /// directly.
    pub fn new(message_id: String, agent_id: AgentId, labels: LabelSet) -> Self {
        Self {
            message_id,
            agent_id,
            labels,
            platform: None,
            arch: None,
            version: None,
            max_concurrency: None,
            in_flight_jobs: Vec::new(),
            hostname: None,
            os_release: None,
            os_version: None,
            total_memory_mb: None,
            cpu_count: None,
            node_version: None,
            running_as_user: None,
            running_as_uid: None,
            properties: BTreeMap::new(),
            capabilities: None,
        }
    }

    /// KiCI's message id form: `register-<agentId>-<ms>`.
    pub fn message_id_for(agent_id: AgentId, at: UnixMillis) -> String {
        format!("register-{agent_id}-{}", at.0)
    }
}

/// `register.ack`. `pendingDispatch` is only written when true (a job is
/// bound to this agent and will follow); it then arms the agent's
/// pending-dispatch window instead of its idle window. `warmPool` likewise,
/// for an agent spawned for a warm pool (no job bound): KiCI's agent then
/// keeps its idle window. `capabilities` are the flags the gateway
/// advertises to agents (KiCI's field; see [`RegisterAck::capabilities`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegisterAck {
    #[serde(deserialize_with = "wire::from_str")]
    pub agent_id: AgentId,
    #[serde(deserialize_with = "wire::label_set")]
    pub labels: LabelSet,
    #[serde(default)]
    pub scaler_managed: bool,
    #[serde(default)]
    pub capabilities: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "wire::is_false")]
    pub pending_dispatch: bool,
    #[serde(default, skip_serializing_if = "wire::is_false")]
    pub warm_pool: bool,
}

impl RegisterAck {
    /// The capabilities this gateway advertises: none. KiCI's orchestrator
    /// advertises flags for features of its own job protocol (artifact
    /// upload acknowledgements); this gateway implements none of them, and
    /// an agent must not rely on one it does not get.
    pub fn capabilities() -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
}

/// `config.ack`: sent by a scaler-managed agent right after `register.ack`;
/// the gateway clears Firecracker MMDS before dispatching.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigAck {
    pub message_id: String,
    #[serde(deserialize_with = "wire::from_str")]
    pub agent_id: AgentId,
}

impl ConfigAck {
    /// KiCI's message id form: `config-ack-<agentId>-<ms>`.
    pub fn message_id_for(agent_id: AgentId, at: UnixMillis) -> String {
        format!("config-ack-{agent_id}-{}", at.0)
    }
}

/// `heartbeat`: every 30 s while registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Heartbeat {
    pub timestamp: UnixMillis,
}

// ---------------------------------------------------------------------------
// Jobs

/// `job.dispatch` (standalone shape): one job, nested under `job`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobDispatch {
    pub message_id: String,
    pub job: JobSpec,
    pub timestamp: UnixMillis,
}

/// `job.cancel`: stop the job (the agent kills its process group and
/// reports `job.status` `cancelled`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobCancel {
    #[serde(deserialize_with = "wire::from_str")]
    pub job_id: JobId,
    pub reason: String,
}

/// `job.ack`: the agent accepted the dispatch (sent before it starts it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobAck {
    pub message_id: String,
    #[serde(deserialize_with = "wire::from_str")]
    pub job_id: JobId,
    pub timestamp: UnixMillis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RejectReason {
    /// Already running a job (agents run one at a time).
    Busy,
    /// Shutting down.
    Draining,
}

/// `job.reject`: the agent refused the dispatch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobReject {
    pub message_id: String,
    #[serde(deserialize_with = "wire::from_str")]
    pub job_id: JobId,
    pub reason: RejectReason,
    pub timestamp: UnixMillis,
}

/// Where a job is, as far as `job.status` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobProgress {
    /// The process started (state `running`; counts as an ack).
    Running,
    /// The job ended (a terminal state).
    Finished(JobEnd),
}

/// `job.status`.
///
/// Wire form: `{"type":"job.status","messageId","jobId","state","timestamp"}`
/// with, on terminal states only, `reason`, `result` and (spawn failures
/// only) `error`. The combinations are checked on deserialization:
///
/// | progress | `state` | `reason` | `result` | `error` |
/// |---|---|---|---|---|
/// | running | `running` | — | — | — |
/// | completed, exit 0 | `success` | `completed` | `{exitCode:0}` | — |
/// | completed otherwise | `failed` | `completed` | exit code or signal | — |
/// | timed out | `failed` | `timed-out` | how the killed process ended | — |
/// | cancelled | `cancelled` | `cancelled` | how the killed process ended | — |
/// | could not start | `failed` | `spawn-failed` | — | why |
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "JobStatusWire", into = "JobStatusWire")]
pub struct JobStatus {
    pub message_id: String,
    pub job_id: JobId,
    pub timestamp: UnixMillis,
    pub progress: JobProgress,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum WireState {
    Running,
    Success,
    Failed,
    Cancelled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum WireReason {
    Completed,
    TimedOut,
    Cancelled,
    SpawnFailed,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JobStatusWire {
    message_id: String,
    #[serde(deserialize_with = "wire::from_str")]
    job_id: JobId,
    state: WireState,
    timestamp: UnixMillis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<WireReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<JobResult>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job.status: {0}")]
pub struct JobStatusError(&'static str);

impl TryFrom<JobStatusWire> for JobStatus {
    type Error = JobStatusError;
    fn try_from(w: JobStatusWire) -> Result<Self, Self::Error> {
        use WireReason as R;
        use WireState as S;
        let progress = match (w.state, w.reason, w.result, w.error) {
            (S::Running, None, None, None) => JobProgress::Running,
            (S::Running, ..) => {
                return Err(JobStatusError(
                    "state running carries no reason, result or error",
                ))
            }
            (state, Some(R::Completed), Some(r), None) => {
                let expected = if r.is_success() {
                    S::Success
                } else {
                    S::Failed
                };
                if state != expected {
                    return Err(JobStatusError(
                        "a completed job's state is success iff its exit code is 0",
                    ));
                }
                JobProgress::Finished(JobEnd::Completed(r))
            }
            (S::Failed, Some(R::TimedOut), Some(r), None) => {
                JobProgress::Finished(JobEnd::TimedOut(r))
            }
            (S::Cancelled, Some(R::Cancelled), Some(r), None) => {
                JobProgress::Finished(JobEnd::Cancelled(r))
            }
            (S::Failed, Some(R::SpawnFailed), None, Some(error)) => {
                JobProgress::Finished(JobEnd::SpawnFailed { error })
            }
            _ => return Err(JobStatusError(
                "state, reason, result and error do not fit together (see the kici-protocol docs)",
            )),
        };
        Ok(JobStatus {
            message_id: w.message_id,
            job_id: w.job_id,
            timestamp: w.timestamp,
            progress,
        })
    }
}

impl From<JobStatus> for JobStatusWire {
    fn from(s: JobStatus) -> Self {
        let (state, reason, result, error) = match s.progress {
            JobProgress::Running => (WireState::Running, None, None, None),
            JobProgress::Finished(end) => match end {
                JobEnd::Completed(r) => (
                    if r.is_success() {
                        WireState::Success
                    } else {
                        WireState::Failed
                    },
                    Some(WireReason::Completed),
                    Some(r),
                    None,
                ),
                JobEnd::TimedOut(r) => {
                    (WireState::Failed, Some(WireReason::TimedOut), Some(r), None)
                }
                JobEnd::Cancelled(r) => (
                    WireState::Cancelled,
                    Some(WireReason::Cancelled),
                    Some(r),
                    None,
                ),
                JobEnd::SpawnFailed { error } => (
                    WireState::Failed,
                    Some(WireReason::SpawnFailed),
                    None,
                    Some(error),
                ),
            },
        };
        Self {
            message_id: s.message_id,
            job_id: s.job_id,
            state,
            timestamp: s.timestamp,
            reason,
            result,
            error,
        }
    }
}
