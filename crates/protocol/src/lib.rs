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
//! The handshake follows the KiCI agent protocol (upstream-contract.md §2):
//! message names are KiCI's dotted names in a `type` field, fields are
//! camelCase, and every message rejects unknown fields (each direction is
//! received by someone). Timestamps are milliseconds since the Unix epoch.
//!
//! | direction | `type` | Rust | contract |
//! |---|---|---|---|
//! | agent → gateway | `auth.request` | [`AuthRequest`] | §2.2 |
//! | gateway → agent | `auth.success` / `auth.failure` | [`AuthSuccess`] / [`AuthFailure`] | §2.2 |
//! | agent → gateway | `agent.register` | [`Register`] | §2.3 |
//! | gateway → agent | `register.ack` | [`RegisterAck`] | §2.4 |
//! | agent → gateway | `config.ack` | [`ConfigAck`] | §2.5 |
//! | agent → gateway | `heartbeat` | [`Heartbeat`] | §2.8 |
//! | gateway → agent | `job.dispatch` | [`JobDispatch`] | §2.6, **standalone shape** |
//! | agent → gateway | `job.ack` / `job.reject` | [`JobAck`] / [`JobReject`] | §2.6 |
//! | agent → gateway | `job.status` | [`JobStatus`] | §2.7, **standalone fields added** |
//! | agent → gateway | `log.chunk` | [`OutputChunk`] | §2.7 names it; **shape is ours** |
//! | gateway → agent | `job.cancel` | [`JobCancel`] | §2.6 names it |
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
//! `agent.metrics` and `rate.limit.warning` are not part of this protocol:
//! the connection heartbeat covers liveness and a standalone job has no steps.

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
    AgentMessage, AuthFailure, AuthRequest, AuthSuccess, ConfigAck, GatewayMessage, Heartbeat,
    InFlightJob, JobAck, JobCancel, JobDispatch, JobProgress, JobReject, JobStatus, PropertyValue,
    Register, RegisterAck, RejectReason,
};
pub use token::{AgentToken, TokenError};
pub use wire::UnixMillis;

/// The protocol version an agent announces in `auth.request` (KiCI's
/// constant, 1; the gateway refuses lower versions with close code 4005).
pub const PROTOCOL_VERSION: std::num::NonZeroU32 = std::num::NonZeroU32::MIN;

/// The largest text frame either side needs to accept. A `job.dispatch` is
/// bounded by [`MAX_JOB_SPEC_BYTES`] of raw strings, which JSON escaping can
/// grow at most sixfold (`\u0001`), plus its envelope; a `log.chunk` by the
/// base64 form of [`MAX_OUTPUT_CHUNK_BYTES`]; everything else is small. A
/// receiver should configure its WebSocket with this limit so that a peer
/// cannot make it buffer more.
pub const MAX_FRAME_BYTES: usize = 6 * MAX_JOB_SPEC_BYTES + 64 * 1024;

/// The endpoint path agents connect to (KiCI's; peers use `/ws/peer`).
pub const AGENT_WS_PATH: &str = "/ws";
