//! `GET /v1/events`: the daemon's events as Server-Sent Events.
//!
//! Each SSE event carries `id:` (the stream id), `event:` (the event's
//! type, [`Event::name`]) and `data:` (a [`StampedEvent`] as JSON: `id`,
//! `at` in milliseconds since the Unix epoch, `type` and the event's
//! fields). A reader that missed events gets a `reset` ([`Reset`]) instead.

use crate::names::{
    AgentStateName, BackendName, BreakerName, CapName, FailureReasonName, PendingEndName,
};
use serde::{Deserialize, Serialize};

/// Something that happened in the daemon's engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Event {
    /// An agent changed state.
    #[serde(rename_all = "camelCase")]
    AgentTransition {
        agent_id: String,
        scaler: String,
        backend: BackendName,
        from: AgentStateName,
        to: AgentStateName,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failure_reason: Option<FailureReasonName>,
        /// Why an agent is destroyed without a failure (`job-done`,
        /// `disconnected`, `operator`, …).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cause: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
        /// Seconds spent in `from`.
        seconds_in_state: f64,
    },
    /// A waiting request is refused by `cap` (when it starts waiting, and
    /// again when the scaler or cap in its way changes).
    #[serde(rename_all = "camelCase")]
    Refused {
        job_id: String,
        scaler: String,
        cap: CapName,
        detail: String,
    },
    /// A scale request left the pending queue.
    #[serde(rename_all = "camelCase")]
    PendingEnded {
        job_id: String,
        scaler: String,
        end: PendingEndName,
        waited_seconds: f64,
    },
    /// A label set's circuit breaker changed.
    #[serde(rename_all = "camelCase")]
    BreakerChanged {
        scaler: String,
        label_set: usize,
        state: BreakerName,
    },
    /// A scaler was cordoned, uncordoned or drained.
    #[serde(rename_all = "camelCase")]
    ScalerCordon {
        scaler: String,
        cordoned: bool,
        draining: bool,
    },
    /// The configuration was reloaded.
    #[serde(rename_all = "camelCase")]
    Reloaded {
        added: Vec<String>,
        removed: Vec<String>,
    },
    /// A `type: event` scaler asks for an instance: boot one whose agent
    /// redeems `claimCode` at `claimUrl` (`POST {"claimCode": …}`) before
    /// `expiresAt`. Deduplicate on `requestId`: a redelivery repeats it.
    #[serde(rename_all = "camelCase")]
    ScaleUp {
        request_id: String,
        agent_id: String,
        scaler: String,
        labels: Vec<String>,
        /// `{"requests": {"cpus", "memoryBytes"}, "limits": {…}}`.
        resources: serde_json::Value,
        /// Absent when the event is replayed from the state store (which
        /// never keeps a code); the redelivery after a restart carries it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        claim_code: Option<String>,
        claim_url: String,
        expires_at: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job_id: Option<String>,
    },
    /// A `type: event` scaler's agent is destroyed: tear its instance down.
    #[serde(rename_all = "camelCase")]
    ScaleDown {
        request_id: String,
        agent_id: String,
        scaler: String,
        reason: String,
    },
}

impl Event {
    /// Every event type, as the SSE `event:` names them.
    pub const NAMES: &'static [&'static str] = &[
        "agent-transition",
        "refused",
        "pending-ended",
        "breaker-changed",
        "scaler-cordon",
        "reloaded",
        "scale-up",
        "scale-down",
    ];

    /// The event's type: its SSE `event:` name and its JSON `type`.
    pub fn name(&self) -> &'static str {
        let i = match self {
            Self::AgentTransition { .. } => 0,
            Self::Refused { .. } => 1,
            Self::PendingEnded { .. } => 2,
            Self::BreakerChanged { .. } => 3,
            Self::ScalerCordon { .. } => 4,
            Self::Reloaded { .. } => 5,
            Self::ScaleUp { .. } => 6,
            Self::ScaleDown { .. } => 7,
        };
        Self::NAMES[i]
    }
}

/// An event with its stream id and time: the `data:` of one SSE event (and
/// what the daemon's state store keeps).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StampedEvent {
    /// The stream id (the SSE `id:`), increasing without gaps.
    pub id: u64,
    /// Milliseconds since the Unix epoch.
    pub at: u64,
    /// In a fleet's stream: the host (instance id) the event happened on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(flatten)]
    pub event: Event,
}

/// The SSE `event:` name of a [`Reset`].
pub const RESET_EVENT: &str = "reset";

/// `event: reset` data: events `missedFrom ..= missedTo` are not available
/// (no longer kept, or the reader's `Last-Event-ID` is ahead of the daemon's
/// history); re-read `GET /v1/agents` and `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reset {
    pub missed_from: u64,
    pub missed_to: u64,
    pub reason: String,
}

/// One event of `GET /v1/events`.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// An engine event (boxed: it is far larger than a reset).
    Event(Box<StampedEvent>),
    /// Events were missed; `id` is the last missed one (resume after it).
    Reset { id: u64, reset: Reset },
}

impl StreamEvent {
    /// Reads one SSE event (`event:` name, `id:`, `data:`); `Ok(None)` for
    /// an event type this version does not know.
    pub fn from_sse(
        name: &str,
        id: Option<u64>,
        data: &str,
    ) -> Result<Option<Self>, serde_json::Error> {
        if name == RESET_EVENT {
            let reset: Reset = serde_json::from_str(data)?;
            return Ok(Some(Self::Reset {
                id: id.unwrap_or(reset.missed_to),
                reset,
            }));
        }
        if !Event::NAMES.contains(&name) {
            return Ok(None);
        }
        serde_json::from_str(data).map(|e| Some(Self::Event(Box::new(e))))
    }

    /// The SSE id (what `Last-Event-ID` resumes after).
    pub fn id(&self) -> u64 {
        match self {
            Self::Event(e) => e.id,
            Self::Reset { id, .. } => *id,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_stamped_event_is_flat_and_round_trips() {
        let e = StampedEvent {
            id: 7,
            at: 1_700_000_000_000,
            host: None,
            event: Event::ScalerCordon {
                scaler: "docker".into(),
                cordoned: true,
                draining: false,
            },
        };
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(
            json,
            r#"{"id":7,"at":1700000000000,"type":"scaler-cordon","scaler":"docker","cordoned":true,"draining":false}"#
        );
        assert_eq!(serde_json::from_str::<StampedEvent>(&json).unwrap(), e);
        assert_eq!(e.event.name(), "scaler-cordon");
        // In a fleet's stream the event names its host.
        let hosted = json.replacen(
            r#""at":1700000000000,"#,
            r#""at":1700000000000,"host":"h1","#,
            1,
        );
        let read = serde_json::from_str::<StampedEvent>(&hosted).unwrap();
        assert_eq!(read.host.as_deref(), Some("h1"));
        assert_eq!(serde_json::to_string(&read).unwrap(), hosted);
    }

    #[test]
    fn names_are_the_json_types() {
        let events = [
            Event::AgentTransition {
                agent_id: "a".into(),
                scaler: "s".into(),
                backend: BackendName::Container,
                from: AgentStateName::Booted,
                to: AgentStateName::Registered,
                job_id: None,
                failure_reason: None,
                cause: None,
                detail: None,
                seconds_in_state: 1.5,
            },
            Event::Refused {
                job_id: "j".into(),
                scaler: "s".into(),
                cap: CapName::ScalerCount,
                detail: "d".into(),
            },
            Event::PendingEnded {
                job_id: "j".into(),
                scaler: "s".into(),
                end: PendingEndName::Admitted,
                waited_seconds: 0.0,
            },
            Event::BreakerChanged {
                scaler: "s".into(),
                label_set: 0,
                state: BreakerName::Open,
            },
            Event::ScalerCordon {
                scaler: "s".into(),
                cordoned: false,
                draining: false,
            },
            Event::Reloaded {
                added: vec![],
                removed: vec![],
            },
            Event::ScaleUp {
                request_id: "i.a.scale-up".into(),
                agent_id: "a".into(),
                scaler: "s".into(),
                labels: vec![],
                resources: serde_json::Value::Null,
                claim_code: None,
                claim_url: "http://h/v1/claims".into(),
                expires_at: "2026-12-02T01:15:00.000Z".into(),
                job_id: None,
            },
            Event::ScaleDown {
                request_id: "i.a.scale-down".into(),
                agent_id: "a".into(),
                scaler: "s".into(),
                reason: "job-end".into(),
            },
        ];
        assert_eq!(events.len(), Event::NAMES.len());
        for e in events {
            let json = serde_json::to_value(&e).unwrap();
            assert_eq!(json["type"], e.name());
        }
    }
}
