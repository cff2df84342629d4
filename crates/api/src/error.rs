//! The one error shape every control API error answer has —
//! `{"error":{"code":"…","message":"…","field":"labels[1]"}}` — and the
//! [`ErrorCode`]s it carries.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Declares [`ErrorCode`] with each code's wire name, written once.
macro_rules! error_codes {
    ($( $(#[$doc:meta])* $variant:ident = $name:literal, )*) => {
        /// A stable, kebab-case identifier of what went wrong (the `code` of
        /// an error answer). A code this version does not know (a newer
        /// daemon's) is kept as [`ErrorCode::Other`].
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ErrorCode {
            $( $(#[$doc])* $variant, )*
            /// A code this version of the crate does not know.
            Other(String),
        }

        impl ErrorCode {
            /// Every code this version knows.
            pub const KNOWN: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code's wire name.
            pub fn as_str(&self) -> &str {
                match self {
                    $( ErrorCode::$variant => $name, )*
                    ErrorCode::Other(s) => s,
                }
            }

            /// The code named `name` (a name this version does not know is
            /// [`ErrorCode::Other`]).
            pub fn parse(name: &str) -> Self {
                match name {
                    $( $name => ErrorCode::$variant, )*
                    other => ErrorCode::Other(other.to_owned()),
                }
            }
        }
    };
}

error_codes! {
    // The body and its fields.
    /// The body is not valid JSON, or not one JSON document (400).
    MalformedJson = "malformed-json",
    /// A field the type does not have (422).
    UnknownField = "unknown-field",
    /// A required field is missing (422).
    MissingField = "missing-field",
    /// A field has the wrong JSON type (422).
    InvalidType = "invalid-type",
    /// A value parsed but is not acceptable (422).
    InvalidValue = "invalid-value",
    /// The body is not `application/json` (415).
    UnsupportedMediaType = "unsupported-media-type",
    /// The body is larger than the daemon accepts (413).
    PayloadTooLarge = "payload-too-large",
    /// The body did not arrive in time (408).
    BodyTimeout = "body-timeout",
    /// The body could not be read (400).
    UnreadableBody = "unreadable-body",
    /// `Last-Event-ID` is not a number (400).
    InvalidLastEventId = "invalid-last-event-id",
    // Access.
    /// The bearer token is missing or wrong (401).
    Unauthorized = "unauthorized",
    /// A mutating request from a web page (an `Origin` header) (403).
    CrossOrigin = "cross-origin",
    /// No such route (404).
    NoRoute = "no-route",
    /// The route does not take this method (405).
    MethodNotAllowed = "method-not-allowed",
    /// The HTTP request itself is malformed (400).
    BadRequest = "bad-request",
    /// The request URI is too long (414).
    UriTooLong = "uri-too-long",
    /// The request head is too large (431).
    HeadersTooLarge = "headers-too-large",
    // Agents and scalers.
    /// Not an agent id (400).
    InvalidAgentId = "invalid-agent-id",
    /// Not an agent of this instance (404).
    AgentNotFound = "agent-not-found",
    /// The agent is gone (409).
    AgentGone = "agent-gone",
    /// The agent runs another job (409).
    WrongJob = "wrong-job",
    /// The report is not legal in the agent's state (409).
    IllegalTransition = "illegal-transition",
    /// The agent token is not valid for this agent (401).
    InvalidAgentToken = "invalid-agent-token",
    /// The backend could not clear the agent's bootstrap data (500).
    BootstrapNotCleared = "bootstrap-not-cleared",
    /// No such scaler (404).
    ScalerNotFound = "scaler-not-found",
    // Scale requests and jobs.
    /// The job id was requested with a different body (409).
    JobConflict = "job-conflict",
    /// The pending queue is full (503).
    QueueFull = "queue-full",
    /// The daemon is shutting down (503).
    ShuttingDown = "shutting-down",
    /// The state store is unreachable (503).
    StoreUnavailable = "store-unavailable",
    /// Admission failed (the machine-pool ledger) (500).
    AdmissionFailed = "admission-failed",
    /// No label set accepts the job's labels (`POST /v1/jobs`, 422).
    NoBackend = "no-backend",
    /// The job can never fit under a cap (`POST /v1/jobs`, 422).
    TooLarge = "too-large",
    /// No such job (404).
    JobNotFound = "job-not-found",
    /// In a fleet: the job is being taken in by a host right now and could
    /// not be cancelled in time; retry (503).
    JobMoving = "job-moving",
    // Operations.
    /// `POST /v1/reload` refused the new configuration (422).
    InvalidConfig = "invalid-config",
    /// `GET /v1/fleet` on a daemon that is not in a fleet (404).
    NotAFleet = "not-a-fleet",
    /// Another host of the fleet owns the agent or request and could not be
    /// reached (502).
    PeerUnavailable = "peer-unavailable",
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for ErrorCode {
    fn from(name: &str) -> Self {
        Self::parse(name)
    }
}

impl PartialEq<&str> for ErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<str> for ErrorCode {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(Self::parse(&name))
    }
}

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// A stable, kebab-case identifier (`unknown-field`, `agent-not-found`, ...).
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub code: ErrorCode,
    /// What was wrong, for a person.
    pub message: String,
    /// The JSON path of the offending input (`labels[1]`,
    /// `resources.requests.cpus`), a path parameter's name, or null.
    pub field: Option<String>,
}

/// `POST /v1/reload` refused: the error shape plus every configuration
/// error, one per line as `validate` prints them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReloadErrorBody {
    pub error: ErrorDetail,
    pub errors: Vec<String>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_ones_are_kept() {
        for code in ErrorCode::KNOWN {
            assert_eq!(&ErrorCode::parse(code.as_str()), code);
            let json = serde_json::to_string(code).unwrap();
            assert_eq!(&serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
        let newer: ErrorCode = serde_json::from_str(r#""rate-limited""#).unwrap();
        assert_eq!(newer, ErrorCode::Other("rate-limited".into()));
        assert_eq!(newer, "rate-limited");
    }

    #[test]
    fn an_error_without_a_field_reads() {
        let body: ErrorBody =
            serde_json::from_str(r#"{"error":{"code":"bad-request","message":"m"}}"#).unwrap();
        assert_eq!(body.error.code, ErrorCode::BadRequest);
        assert_eq!(body.error.field, None);
    }
}
