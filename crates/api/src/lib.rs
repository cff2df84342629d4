//! The kici-scaler control API as types, and a typed client.
//!
//! This crate owns the *wire contract* of kici-scaler's control API
//! (HTTP/JSON under `/v1`, SSE events, `/healthz`, `/readyz`): every
//! request body, answer body, error body and SSE event, with `serde` both
//! ways, exactly as the daemon sends and reads them (camelCase fields,
//! request bodies refuse unknown fields, optional fields are left out when
//! unset). The daemon builds its answers and its OpenAPI document from
//! these types (feature `openapi`); the `kici-scaler` CLI and the daemon's
//! tests talk to it through the typed [`Client`] (feature `client`).
//!
//! | module | routes |
//! |---|---|
//! | [`scale`] | `POST /v1/scale` ([`ScaleBody`] → [`ScaleAnswer`]), `DELETE /v1/scale/{jobId}` |
//! | [`jobs`] | `POST /v1/jobs` ([`JobBody`] → [`JobAccepted`]), `GET`/`DELETE /v1/jobs/{id}` ([`JobView`]), `GET /v1/jobs/{id}/logs` ([`JobLogEvent`]) |
//! | [`agents`] | `/v1/agents*`: the lifecycle reports and the agent views ([`AgentObject`]) |
//! | [`status`] | `GET /v1/status` ([`StatusObject`]), `POST /v1/reload`, `/healthz`, `/readyz` |
//! | [`events`] | `GET /v1/events` ([`StreamEvent`]) |
//! | [`error`] | every error answer ([`ErrorBody`], [`ErrorCode`]) |
//! | [`names`] | every enumerated name (agent and job states, backends, caps, …), each spelled once |
//! | [`routes`] | every route ([`ROUTES`]) |
//!
//! Ids and labels are plain strings here: the daemon checks them and
//! answers `invalid-value` naming the field.
//!
//! ```
//! use kici_api::{AgentStateName, ErrorBody, ErrorCode, ScaleAnswer, ScaleBody};
//!
//! // A request body, as the daemon reads it: unset fields are left out.
//! let body = ScaleBody {
//!     job_id: "job-1".into(),
//!     labels: vec!["linux".into(), "x64".into()],
//!     ..ScaleBody::default()
//! };
//! assert_eq!(
//!     serde_json::to_string(&body).unwrap(),
//!     r#"{"jobId":"job-1","labels":["linux","x64"]}"#
//! );
//!
//! // An answer, tagged by `result`.
//! let answer: ScaleAnswer = serde_json::from_str(
//!     r#"{"result":"spawning","agentId":"scaler-container-0a1b2c3d",
//!         "scaler":"docker","backend":"container","warm":false}"#,
//! )
//! .unwrap();
//! assert!(matches!(answer, ScaleAnswer::Spawning { warm: false, .. }));
//!
//! // An error answer: its code is an enum to match on.
//! let error: ErrorBody = serde_json::from_str(
//!     r#"{"error":{"code":"unknown-field","message":"unknown field `lables`","field":"lables"}}"#,
//! )
//! .unwrap();
//! assert_eq!(error.error.code, ErrorCode::UnknownField);
//!
//! // State names are spelled once, here.
//! assert_eq!(AgentStateName::Busy.as_str(), "busy");
//! assert_eq!("half-open".parse::<kici_api::BreakerName>().unwrap().as_str(), "half-open");
//! ```

pub mod agents;
#[cfg(feature = "client")]
pub mod client;
pub mod error;
pub mod events;
pub mod fleet;
pub mod jobs;
pub mod names;
pub mod routes;
pub mod scale;
pub mod sse;
pub mod status;

pub use agents::{
    AgentList, AgentObject, JobCompleteBody, JobStartedBody, RegisteredBody, RegistrationAnswer,
    ResourcesObject, UnreachableHost,
};
#[cfg(feature = "client")]
pub use client::{ApiError, Client, ErrorAnswer, Events, JobLogs, RawReply, RequestSigner};
pub use error::{ErrorBody, ErrorCode, ErrorDetail, ReloadErrorBody};
pub use events::{Event, Reset, StampedEvent, StreamEvent, RESET_EVENT};
pub use fleet::{FleetHostObject, FleetObject, FleetPoolObject};
pub use jobs::{JobAccepted, JobBody, JobList, JobLogEvent, JobView, OutputData, Truncated};
pub use kici_protocol::{ChunkData, OutputStream};
pub use names::{
    AgentStateName, BackendName, BreakerName, CapName, EndKind, FailureReasonName, JobState,
    ModeName, PendingEndName, UnknownName,
};
pub use routes::{Owned, PeerCall, Route, ROUTES};
pub use scale::{ResourceSpecBody, ResourcesBody, ScaleAnswer, ScaleBody};
pub use status::{
    AgentCounts, FreeObject, Health, LabelSetStatusObject, Readiness, ReloadAnswer, ReloadDiff,
    ScalerStatusObject, SpawnsObject, StatusObject, UsageObject, WarmSourceObject,
};
