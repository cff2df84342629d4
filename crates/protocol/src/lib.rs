//! The agent ⇄ gateway protocol and the agent bootstrap contract, as types.
//!
//! This crate owns the *wire vocabulary* between an ephemeral agent and the
//! kici-scaler agent gateway (WebSocket at `/ws`, JSON text frames): every
//! message in each direction ([`AgentMessage`], [`GatewayMessage`]), the close
//! codes ([`CloseCode`]), the standalone-mode job ([`JobSpec`]), its output
//! ([`OutputChunk`]) and its end ([`JobEnd`], [`JobResult`]); and the
//! agent's bootstrap environment ([`bootstrap::Bootstrap`]). It does no I/O:
//! the gateway (kici-scaler) and the reference agent (`kici-agent-lite`) both
//! build on it, so the two sides cannot drift apart.
//!
//! # Names and shapes
//!
//! The handshake follows the KiCI agent protocol as KiCI's own agent speaks
//! it: message names are KiCI's dotted names in a `type` field, fields are
//! camelCase. What an agent sends rejects unknown fields (the gateway
//! checks what it is told); what the gateway sends accepts them (the agent
//! reads the fields it knows, so a newer gateway may add some). Timestamps
//! are milliseconds since the Unix epoch.
//!
//! | direction | `type` | Rust | shape |
//! |---|---|---|---|
//! | agent → gateway | `auth.request` | [`AuthRequest`] | KiCI's |
//! | gateway → agent | `auth.success` / `auth.failure` | [`AuthSuccess`] / [`AuthFailure`] | KiCI's |
//! | agent → gateway | `agent.register` | [`Register`] | KiCI's |
//! | gateway → agent | `register.ack` | [`RegisterAck`] | KiCI's |
//! | agent → gateway | `config.ack` | [`ConfigAck`] | KiCI's |
//! | agent → gateway | `heartbeat` | [`Heartbeat`] | KiCI's |
//! | gateway → agent | `job.dispatch` | [`JobDispatch`] | KiCI's name, **standalone shape** |
//! | agent → gateway | `job.ack` / `job.reject` | [`JobAck`] / [`JobReject`] | KiCI's |
//! | agent → gateway | `job.status` | [`JobStatus`] | KiCI's, **standalone fields added** |
//! | agent → gateway | `log.chunk` | [`OutputChunk`] | KiCI's name, **shape is ours** |
//! | gateway → agent | `job.cancel` | [`JobCancel`] | KiCI's name |
//!
//! What we add for standalone mode (KiCI's job messages carry a repository,
//! a ref and a job config; ours carry a command):
//!
//! - `job.dispatch` carries one nested `job` object ([`JobSpec`]: `jobId`,
//!   `argv`, `env`, `timeoutSeconds?`) instead of KiCI's repository fields.
//! - `job.status` adds, on its terminal states, `reason`
//!   (`completed | timed-out | cancelled | spawn-failed`), `result`
//!   (`{exitCode, signal}`, exactly one non-null) and, for `spawn-failed`,
//!   `error`.
//! - `log.chunk` is `{jobId, seq, stream, data}`: `seq` counts the job's
//!   chunks from 0 across both streams, `stream` is `stdout | stderr`, `data`
//!   is standard base64 (output is bytes, not necessarily UTF-8) of at most
//!   [`MAX_OUTPUT_CHUNK_BYTES`] raw bytes.
//!
//! KiCI's `job.heartbeat`, `step.status`, `agent.status`, `agent.log`,
//! `agent.metrics`, `run.event`, `job.context`, `job.concurrency.report` and
//! `event.emit` are not part of this protocol (the connection heartbeat
//! covers liveness and a standalone job has no steps); a KiCI agent sends
//! them, so the gateway accepts and ignores them ([`IGNORED_AGENT_MESSAGES`]).
//! Gateway messages the agent does not know (KiCI's `rate.limit.warning`,
//! `error`) are ignored by it likewise.
//! Why kici-scaler dispatches jobs at all: see docs/deviations.md,
//! D-standalone-mode.
//!
//! ```
//! use kici_protocol::bootstrap::Bootstrap;
//! use kici_protocol::{AgentMessage, GatewayMessage, JobDispatch, JobSpec, UnixMillis};
//! use std::collections::BTreeMap;
//!
//! // The agent's side: its bootstrap environment, checked against the contract.
//! let token = format!("kat_{}", "ab".repeat(32));
//! let env: BTreeMap<String, String> = [
//!     ("KICI_ORCHESTRATOR_URL", "ws://127.0.0.1:7879/ws"),
//!     ("KICI_AGENT_ID", "scaler-bare-metal-0a1b2c3d"),
//!     ("KICI_LABELS", "linux,kici:agent:bare-metal"),
//!     ("KICI_SCALER_MANAGED", "1"),
//!     ("KICI_AGENT_TOKEN", token.as_str()),
//! ]
//! .into_iter()
//! .map(|(k, v)| (k.to_owned(), v.to_owned()))
//! .collect();
//! let bootstrap = Bootstrap::from_env(&env).unwrap();
//! assert_eq!(bootstrap.agent_id.to_string(), "scaler-bare-metal-0a1b2c3d");
//! assert!(format!("{bootstrap:?}").contains("<redacted>")); // never in a log
//!
//! // Its first frame, as the gateway reads it; unknown fields are refused.
//! let frame = format!(r#"{{"type":"auth.request","token":"{token}","protocolVersion":1}}"#);
//! let AgentMessage::AuthRequest(auth) = AgentMessage::from_json(&frame).unwrap() else {
//!     panic!("not an auth.request");
//! };
//! assert_eq!(auth.token.expose(), token);
//! let extra = frame.replace(r#""protocolVersion":1"#, r#""protocolVersion":1,"x":0"#);
//! assert!(AgentMessage::from_json(&extra).is_err());
//!
//! // The gateway's side: a standalone job, sent as one text frame.
//! let job = JobSpec::new("job-1".parse().unwrap(), vec!["make".into(), "test".into()], BTreeMap::new(), Some(600)).unwrap();
//! let dispatch = GatewayMessage::JobDispatch(JobDispatch {
//!     message_id: "dispatch-1".into(),
//!     job,
//!     timestamp: UnixMillis(0),
//! });
//! let text = dispatch.to_json();
//! assert!(text.starts_with(r#"{"type":"job.dispatch""#));
//! assert_eq!(GatewayMessage::from_json(&text).unwrap(), dispatch);
//! ```

mod close;
mod job;
mod messages;
mod token;
mod wire;

pub mod bootstrap;

pub use close::CloseCode;
pub use job::{
    ChunkData, ChunkTooLarge, JobEnd, JobResult, JobResultError, JobSpec, JobSpecError,
    OutputChunk, OutputStream, MAX_JOB_SPEC_BYTES, MAX_OUTPUT_CHUNK_BYTES,
};
pub use messages::{
    AgentMessage, AuthFailure, AuthRequest, AuthSuccess, ClaimCredentials,
    ClaimCredentialsResponse, ClaimedAgentCredentials, ConfigAck, GatewayMessage, Heartbeat,
    InFlightJob, JobAck, JobCancel, JobDispatch, JobProgress, JobReject, JobStatus, PropertyValue,
    Register, RegisterAck, RejectReason,
};
pub use token::{AgentToken, TokenError};
pub use wire::UnixMillis;

/// The protocol version an agent announces in `auth.request` (KiCI's
/// constant, 1).
pub const PROTOCOL_VERSION: u32 = 1;

/// The `protocolVersion`s the gateway speaks. KiCI's minimum is 1; an agent
/// announcing a version outside this range gets `auth.failure`
/// ("Unsupported protocol version") and close 4005, KiCI's code for it.
/// The upper bound is ours: a version above the one this gateway speaks
/// would be answered in a protocol its agent does not expect.
pub const SUPPORTED_PROTOCOL_VERSIONS: std::ops::RangeInclusive<u32> = 1..=PROTOCOL_VERSION;

/// The largest text frame either side needs to accept. A `job.dispatch` is
/// bounded by [`MAX_JOB_SPEC_BYTES`] of raw strings, which JSON escaping can
/// grow at most sixfold (`\u0001`), plus its envelope; a `log.chunk` by the
/// base64 form of [`MAX_OUTPUT_CHUNK_BYTES`]; everything else is small. A
/// receiver should configure its WebSocket with this limit so that a peer
/// cannot make it buffer more.
pub const MAX_FRAME_BYTES: usize = 6 * MAX_JOB_SPEC_BYTES + 64 * 1024;

/// Agent → orchestrator messages of KiCI's protocol that this one does not
/// use: notifications that need no answer. The gateway accepts each, does
/// nothing with it and counts it; any other unknown `type` is an invalid
/// message (4003).
pub const IGNORED_AGENT_MESSAGES: [&str; 9] = [
    "agent.status",
    "agent.log",
    "agent.metrics",
    "job.heartbeat",
    "step.status",
    "run.event",
    "job.context",
    "job.concurrency.report",
    "event.emit",
];

/// The `type` of a JSON message, when it is an object with a string `type`
/// (read without parsing the rest: for messages a side does not know).
pub fn message_type(text: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Typed {
        #[serde(rename = "type")]
        kind: String,
    }
    serde_json::from_str::<Typed>(text).ok().map(|t| t.kind)
}

/// The endpoint path agents connect to (KiCI's; peers use `/ws/peer`).
pub const AGENT_WS_PATH: &str = "/ws";
