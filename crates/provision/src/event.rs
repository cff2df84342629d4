//! The two events an external provisioner receives, as JSON objects:
//!
//! ```json
//! {"event": "scale-up", "requestId": "0a1b2c3d.scaler-event-4e5f6a7b.scale-up",
//!  "agentId": "scaler-event-4e5f6a7b", "scaler": "cloud",
//!  "labels": ["linux", "x64"],
//!  "resources": {"requests": {"cpus": 2.0, "memoryBytes": 4294967296},
//!                "limits": {"cpus": 2.0, "memoryBytes": 4294967296}},
//!  "claimCode": "kcc_…", "claimUrl": "https://ci.example.com/v1/claims",
//!  "expiresAt": "2026-12-02T01:15:00.000Z", "jobId": "build-42"}
//!
//! {"event": "scale-down", "requestId": "0a1b2c3d.scaler-event-4e5f6a7b.scale-down",
//!  "agentId": "scaler-event-4e5f6a7b", "scaler": "cloud", "reason": "job-end"}
//! ```
//!
//! `jobId` is absent for a warm-pool spawn. Fields are camelCase; a
//! receiver should ignore fields it does not know (later versions may add
//! some). Both directions are implemented (`Serialize` for the daemon,
//! `Deserialize` for receivers written in Rust and for the tests).
//!
//! **Delivery is at least once.** The daemon records an event before it
//! delivers it and delivers it again after a crash, so a provisioner may see
//! one twice; the `requestId` is derived from the daemon instance, the agent
//! id and the kind ([`RequestId::derive`]), so a redelivery carries the same
//! id and a provisioner deduplicates on it.

use crate::claim::ClaimCode;
use crate::time::Timestamp;
use kici_model::EffectiveResources;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Which of the two events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventKind {
    ScaleUp,
    ScaleDown,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ScaleUp => "scale-up",
            Self::ScaleDown => "scale-down",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event's correlation id, stable across redeliveries.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(String);

impl RequestId {
    /// `<instance>.<agent id>.<kind>`: the same inputs give the same id, so
    /// an event rebuilt after a crash (or redelivered from the outbox) is
    /// recognisable as the one already sent. The daemon instance is part of
    /// it because agent ids are unique only among one daemon's agents.
    pub fn derive(instance: &str, agent_id: &str, kind: EventKind) -> Self {
        Self(format!("{instance}.{agent_id}.{kind}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One side of an agent's resources: cores (as operators write them) and
/// bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceAmount {
    pub cpus: f64,
    pub memory_bytes: u64,
}

/// What the agent was admitted with (`requests`, counted against caps) and
/// what it may use (`limits`); a provisioner sizes the instance from these.
/// Zero on a dimension means nothing was asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EventResources {
    pub requests: ResourceAmount,
    pub limits: ResourceAmount,
}

impl From<&EffectiveResources> for EventResources {
    fn from(r: &EffectiveResources) -> Self {
        let side = |x: &kici_model::Resources| ResourceAmount {
            cpus: x.cpu.as_cores(),
            memory_bytes: x.memory.bytes(),
        };
        Self {
            requests: side(&r.requests),
            limits: side(&r.limits),
        }
    }
}

/// Boot an instance whose agent redeems `claim_code` at `claim_url` before
/// `expires_at` and registers as `agent_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScaleUp {
    pub request_id: RequestId,
    pub agent_id: String,
    pub scaler: String,
    pub labels: Vec<String>,
    pub resources: EventResources,
    /// Single use; redacted in `Debug`.
    pub claim_code: ClaimCode,
    /// The full URL to redeem the code at (`POST {"claimCode": …}`).
    pub claim_url: String,
    /// The code is refused from this instant on.
    pub expires_at: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
}

/// Tear down the instance booted for `agent_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScaleDown {
    pub request_id: RequestId,
    pub agent_id: String,
    pub scaler: String,
    pub reason: ScaleDownReason,
}

/// Either event, tagged by `"event"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum ProvisionEvent {
    ScaleUp(ScaleUp),
    ScaleDown(ScaleDown),
}

impl ProvisionEvent {
    pub fn kind(&self) -> EventKind {
        match self {
            Self::ScaleUp(_) => EventKind::ScaleUp,
            Self::ScaleDown(_) => EventKind::ScaleDown,
        }
    }

    pub fn request_id(&self) -> &RequestId {
        match self {
            Self::ScaleUp(e) => &e.request_id,
            Self::ScaleDown(e) => &e.request_id,
        }
    }

    pub fn agent_id(&self) -> &str {
        match self {
            Self::ScaleUp(e) => &e.agent_id,
            Self::ScaleDown(e) => &e.agent_id,
        }
    }

    pub fn scaler(&self) -> &str {
        match self {
            Self::ScaleUp(e) => &e.scaler,
            Self::ScaleDown(e) => &e.scaler,
        }
    }

    /// The JSON body a provisioner receives (the claim code in clear: the
    /// provisioner needs it). Never log it.
    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    pub fn from_json(body: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }
}

impl From<ScaleUp> for ProvisionEvent {
    fn from(e: ScaleUp) -> Self {
        Self::ScaleUp(e)
    }
}

impl From<ScaleDown> for ProvisionEvent {
    fn from(e: ScaleDown) -> Self {
        Self::ScaleDown(e)
    }
}

/// Why an agent is torn down. The wire strings are upstream's where it has
/// one (`spawn-timeout`, `heartbeat-timeout`, `shutdown`); a reason this
/// version does not know is kept as [`ScaleDownReason::Other`] so a
/// receiver built against it still reads a newer daemon's events.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ScaleDownReason {
    /// The agent never registered within the registration deadline.
    SpawnTimeout,
    /// The scale-up could not be delivered (retries spent); the scale-down
    /// is sent anyway in case the provisioner acted on an attempt.
    SpawnFailed,
    /// The agent stopped answering on its connection.
    HeartbeatTimeout,
    /// Its job ended and the agent is not kept (standalone mode).
    JobEnd,
    /// Its connection closed.
    Disconnect,
    /// An operator deleted it.
    Operator,
    /// The scale request it served was cancelled.
    Cancelled,
    /// Idle TTL or scale-in of a warm agent.
    Idle,
    /// Its scaler drained or a reload removed it.
    Drain,
    /// `maxLifetimeSeconds` passed.
    LifetimeExceeded,
    /// It registered, but no job came within the pending-dispatch window.
    PendingDispatchTimeout,
    /// The daemon is shutting down.
    Shutdown,
    /// The reconciler found an agent whose scale-down was never confirmed.
    Orphaned,
    /// A reason this version does not name.
    Other(String),
}

impl ScaleDownReason {
    pub fn as_str(&self) -> &str {
        match self {
            Self::SpawnTimeout => "spawn-timeout",
            Self::SpawnFailed => "spawn-failed",
            Self::HeartbeatTimeout => "heartbeat-timeout",
            Self::JobEnd => "job-end",
            Self::Disconnect => "disconnect",
            Self::Operator => "operator",
            Self::Cancelled => "cancelled",
            Self::Idle => "idle",
            Self::Drain => "drain",
            Self::LifetimeExceeded => "lifetime-exceeded",
            Self::PendingDispatchTimeout => "pending-dispatch-timeout",
            Self::Shutdown => "shutdown",
            Self::Orphaned => "orphaned",
            Self::Other(s) => s,
        }
    }

    /// Every named reason (for metrics label pre-registration and docs).
    pub const NAMED: [Self; 13] = [
        Self::SpawnTimeout,
        Self::SpawnFailed,
        Self::HeartbeatTimeout,
        Self::JobEnd,
        Self::Disconnect,
        Self::Operator,
        Self::Cancelled,
        Self::Idle,
        Self::Drain,
        Self::LifetimeExceeded,
        Self::PendingDispatchTimeout,
        Self::Shutdown,
        Self::Orphaned,
    ];

    pub fn parse(s: &str) -> Self {
        Self::NAMED
            .iter()
            .find(|r| r.as_str() == s)
            .cloned()
            .unwrap_or_else(|| Self::Other(s.to_owned()))
    }
}

impl fmt::Display for ScaleDownReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ScaleDownReason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ScaleDownReason {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(Self::parse(&s))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn up() -> ScaleUp {
        ScaleUp {
            request_id: RequestId::derive("0a1b2c3d", "scaler-event-4e5f6a7b", EventKind::ScaleUp),
            agent_id: "scaler-event-4e5f6a7b".into(),
            scaler: "cloud".into(),
            labels: vec!["linux".into(), "x64".into()],
            resources: EventResources {
                requests: ResourceAmount {
                    cpus: 2.0,
                    memory_bytes: 4 << 30,
                },
                limits: ResourceAmount {
                    cpus: 2.5,
                    memory_bytes: 4 << 30,
                },
            },
            claim_code: ClaimCode::from_wire("kcc_abc").unwrap(),
            claim_url: "https://ci.example.com/v1/claims".into(),
            expires_at: Timestamp::from_unix_millis(1_764_638_100_000),
            job_id: Some("build-42".into()),
        }
    }

    #[test]
    fn scale_up_json_shape() {
        let v: serde_json::Value =
            serde_json::from_slice(&ProvisionEvent::from(up()).to_json().unwrap()).unwrap();
        assert_eq!(
            v,
            json!({
                "event": "scale-up",
                "requestId": "0a1b2c3d.scaler-event-4e5f6a7b.scale-up",
                "agentId": "scaler-event-4e5f6a7b",
                "scaler": "cloud",
                "labels": ["linux", "x64"],
                "resources": {
                    "requests": {"cpus": 2.0, "memoryBytes": 4294967296u64},
                    "limits": {"cpus": 2.5, "memoryBytes": 4294967296u64}
                },
                "claimCode": "kcc_abc",
                "claimUrl": "https://ci.example.com/v1/claims",
                "expiresAt": "2025-12-02T01:15:00.000Z",
                "jobId": "build-42"
            })
        );
    }

    #[test]
    fn both_events_round_trip() {
        let mut warm = up();
        warm.job_id = None;
        let events = [
            ProvisionEvent::from(up()),
            ProvisionEvent::from(warm),
            ProvisionEvent::from(ScaleDown {
                request_id: RequestId::derive(
                    "0a1b2c3d",
                    "scaler-event-4e5f6a7b",
                    EventKind::ScaleDown,
                ),
                agent_id: "scaler-event-4e5f6a7b".into(),
                scaler: "cloud".into(),
                reason: ScaleDownReason::SpawnTimeout,
            }),
        ];
        for e in events {
            let body = e.to_json().unwrap();
            assert_eq!(ProvisionEvent::from_json(&body).unwrap(), e);
        }
    }

    #[test]
    fn scale_down_json_shape_and_unknown_fields_tolerated() {
        let body = br#"{"event":"scale-down","requestId":"i.a.scale-down","agentId":"a",
            "scaler":"cloud","reason":"hibernate","addedLater":true}"#;
        let e = ProvisionEvent::from_json(body).unwrap();
        let ProvisionEvent::ScaleDown(d) = &e else {
            panic!("not a scale-down: {e:?}")
        };
        assert_eq!(d.reason, ScaleDownReason::Other("hibernate".into()));
        assert_eq!(e.kind(), EventKind::ScaleDown);
        let v: serde_json::Value = serde_json::from_slice(&e.to_json().unwrap()).unwrap();
        assert_eq!(v["reason"], "hibernate");
    }

    #[test]
    fn reasons_parse_back_to_themselves() {
        for r in ScaleDownReason::NAMED {
            assert_eq!(ScaleDownReason::parse(r.as_str()), r);
        }
    }

    #[test]
    fn request_id_is_stable_and_distinct_per_kind() {
        let a = RequestId::derive("0a1b2c3d", "scaler-event-4e5f6a7b", EventKind::ScaleUp);
        assert_eq!(
            a,
            RequestId::derive("0a1b2c3d", "scaler-event-4e5f6a7b", EventKind::ScaleUp)
        );
        assert_ne!(
            a,
            RequestId::derive("0a1b2c3d", "scaler-event-4e5f6a7b", EventKind::ScaleDown)
        );
        assert_ne!(
            a,
            RequestId::derive("99999999", "scaler-event-4e5f6a7b", EventKind::ScaleUp)
        );
    }

    #[test]
    fn debug_never_shows_the_claim_code() {
        let text = format!("{:?}", ProvisionEvent::from(up()));
        assert!(!text.contains("kcc_abc"), "{text}");
    }
}
