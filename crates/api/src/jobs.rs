//! Standalone jobs: `POST /v1/jobs`, `GET`/`DELETE /v1/jobs/{id}` and the
//! events of `GET /v1/jobs/{id}/logs`.

use crate::names::{EndKind, JobState};
use crate::scale::ResourcesBody;
use kici_protocol::{ChunkData, OutputStream};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST /v1/jobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JobBody {
    /// The job's labels (its runsOn): at least one.
    pub labels: Vec<String>,
    /// The command to run, as argv: at least the program. Run without a
    /// shell; use `["sh", "-c", "…"]` for one.
    pub command: Vec<String>,
    /// Environment for the command (POSIX names), on top of the agent's
    /// minimal base environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// What the job needs; unset dimensions fall back to the label set, then
    /// `defaults.resources`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesBody>,
    /// Kill the command after this many seconds (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub timeout_seconds: Option<u64>,
}

/// The answer to `POST /v1/jobs` and `DELETE /v1/jobs/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct JobAccepted {
    pub job_id: String,
    pub state: JobState,
}

/// `GET /v1/jobs`: the jobs of the host that answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobList {
    /// Running ones and the finished ones still kept, by job id.
    pub jobs: Vec<JobView>,
}

/// A job as the API shows it (`GET /v1/jobs/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct JobView {
    pub job_id: String,
    pub state: JobState,
    /// The job's labels (its runsOn), normalised.
    pub labels: Vec<String>,
    /// The command (argv).
    pub command: Vec<String>,
    /// The agent provisioned for it, once admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// In a fleet: the host (instance id) that runs or ran the job; unset
    /// while it waits in the fleet's queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Set once the job ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<EndKind>,
    /// The command's exit code, when it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that killed the command, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Why the job ended other than by its command's own exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Output bytes received so far (all of them, dropped ones included).
    pub output_bytes: u64,
    /// Output bytes no longer kept (the per-job buffer's cap).
    pub dropped_bytes: u64,
    /// The job's output from before a restart of kici-scaler could not be
    /// read back (its output file was missing or unreadable): the logs
    /// hold only what came after, if anything.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub output_lost: bool,
}

impl JobView {
    /// `kici-scaler run`'s exit code for a finished job: the command's exit
    /// code; 128 + n if signal n killed it; 127 / 126 if it could not be
    /// started (not found / not executable); 125 if kici-scaler could not
    /// run it. `None` while the job has not ended.
    pub fn run_exit_code(&self) -> Option<i32> {
        let end = self.end?;
        if let Some(code) = self.exit_code {
            return Some(code);
        }
        if let Some(signal) = self.signal {
            return Some(128 + signal);
        }
        Some(match end {
            EndKind::StartFailed
                if self
                    .reason
                    .as_deref()
                    .is_some_and(|r| r.contains("(os error 2)")) =>
            {
                127
            }
            EndKind::StartFailed => 126,
            _ => 125,
        })
    }
}

/// `event: output` data of `GET /v1/jobs/{id}/logs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputData {
    pub stream: OutputStream,
    /// Base64 (standard, padded): output is bytes.
    pub data: ChunkData,
}

/// `event: truncated` data of `GET /v1/jobs/{id}/logs`: chunks this reader
/// asked for that the per-job buffer no longer holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Truncated {
    pub missed_from: u64,
    pub missed_to: u64,
    pub reason: String,
}

/// The SSE `event:` names of `GET /v1/jobs/{id}/logs`.
pub mod log_event {
    /// A chunk of output ([`OutputData`](super::OutputData)).
    pub const OUTPUT: &str = "output";
    /// Chunks were dropped ([`Truncated`](super::Truncated)).
    pub const TRUNCATED: &str = "truncated";
    /// The job ended ([`JobView`](super::JobView)); the stream closes.
    pub const END: &str = "end";
}

/// One event of `GET /v1/jobs/{id}/logs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobLogEvent {
    /// A chunk of the job's output; `index` counts from 0 across both
    /// streams (the SSE `id:`).
    Output { index: u64, output: OutputData },
    /// Chunks were dropped before this reader read them.
    Truncated(Truncated),
    /// The job ended: the last event.
    End(Box<JobView>),
}

impl JobLogEvent {
    /// Reads one SSE event (`event:` name, `id:`, `data:`); `Ok(None)` for
    /// an event type this version does not know.
    pub fn from_sse(
        name: &str,
        id: Option<u64>,
        data: &str,
    ) -> Result<Option<Self>, serde_json::Error> {
        Ok(Some(match name {
            log_event::OUTPUT => Self::Output {
                index: id.unwrap_or_default(),
                output: serde_json::from_str(data)?,
            },
            log_event::TRUNCATED => Self::Truncated(serde_json::from_str(data)?),
            log_event::END => Self::End(Box::new(serde_json::from_str(data)?)),
            _ => return Ok(None),
        }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_job_body_sends_only_what_is_set() {
        let body = JobBody {
            labels: vec!["linux".into()],
            command: vec!["true".into()],
            ..JobBody::default()
        };
        assert_eq!(
            serde_json::to_string(&body).unwrap(),
            r#"{"labels":["linux"],"command":["true"]}"#
        );
    }

    #[test]
    fn run_exit_codes() {
        let mut view: JobView = serde_json::from_str(
            r#"{"jobId":"j","state":"failed","labels":[],"command":[],"end":"start-failed",
                "reason":"No such file (os error 2)","outputBytes":0,"droppedBytes":0}"#,
        )
        .unwrap();
        assert_eq!(view.run_exit_code(), Some(127));
        view.reason = None;
        assert_eq!(view.run_exit_code(), Some(126));
        view.signal = Some(9);
        assert_eq!(view.run_exit_code(), Some(137));
        view.end = None;
        assert_eq!(view.run_exit_code(), None);
    }
}
