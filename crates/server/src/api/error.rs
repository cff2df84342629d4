//! Every error the control API returns, in one shape:
//! `{"error":{"code":"…","message":"…","field":"labels[1]"}}` (`field` is
//! the JSON path of the offending input, or null).
//!
//! This module also owns [`ApiJson`], the body extractor that turns every
//! way a body can be wrong — wrong content type, malformed JSON, an unknown
//! field, a wrong type, a missing field, too large — into that shape with
//! the field's path, instead of axum's plain-text rejections.

use crate::daemon::serving::{BodyDeadline, ConnectionLimits};
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kici_engine::{AgentError, ScaleError};
use serde::de::DeserializeOwned;

pub use kici_api::{ErrorBody, ErrorCode, ErrorDetail, ReloadErrorBody};

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: String,
    pub field: Option<String>,
    /// Extra lines (`POST /v1/reload`: the configuration errors).
    pub errors: Option<Vec<String>>,
}

impl ApiError {
    /// `code` is an [`ErrorCode`] (a `&str` names one by its wire name).
    pub fn new(status: StatusCode, code: impl Into<ErrorCode>, message: impl Into<String>) -> Self {
        let code = code.into();
        // Every code the daemon answers is one clients can match on: a
        // misspelt name would reach them as `Other`.
        debug_assert!(
            !matches!(code, ErrorCode::Other(_)),
            "unknown error code {code}"
        );
        Self {
            status,
            code,
            message: message.into(),
            field: None,
            errors: None,
        }
    }

    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// 422: the request parsed, but a value is not acceptable.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidValue,
            message,
        )
        .field(field)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized, message)
    }

    pub fn agent_not_found(agent: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorCode::AgentNotFound,
            format!("agent {agent} is not managed by this instance"),
        )
        .field("id")
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.clone(),
                message: self.message.clone(),
                field: self.field.clone(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let detail = self.body().error;
        let mut response = match self.errors {
            Some(errors) => (
                self.status,
                Json(ReloadErrorBody {
                    error: detail,
                    errors,
                }),
            )
                .into_response(),
            None => (self.status, Json(ErrorBody { error: detail })).into_response(),
        };
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// A body value that is not acceptable: 422, naming the field.
impl From<crate::service::requests::Invalid> for ApiError {
    fn from(e: crate::service::requests::Invalid) -> Self {
        Self::invalid(e.field, e.message)
    }
}

/// The engine's agent errors, for the calls that act on one agent.
pub fn agent_error(e: AgentError) -> ApiError {
    match e {
        AgentError::NotOurs(a) => ApiError::agent_not_found(a),
        AgentError::Gone(a) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::AgentGone,
            format!("agent {a} is gone"),
        )
        .field("id"),
        AgentError::UnknownScaler(name) => ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::ScalerNotFound,
            format!("scaler {name:?} is not configured"),
        )
        .field("name"),
        e @ AgentError::WrongJob { .. } => {
            ApiError::new(StatusCode::CONFLICT, ErrorCode::WrongJob, e.to_string()).field("jobId")
        }
        AgentError::Illegal(e) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::IllegalTransition,
            e.to_string(),
        ),
    }
}

/// The engine's refusals of a scale request (`POST /v1/scale` and a
/// standalone job's submission alike): one mapping to status and code.
pub fn scale_error(e: ScaleError) -> ApiError {
    match e {
        ScaleError::Conflict(_) => {
            ApiError::new(StatusCode::CONFLICT, ErrorCode::JobConflict, e.to_string())
                .field("jobId")
        }
        ScaleError::QueueFull(_) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::QueueFull,
            e.to_string(),
        ),
        ScaleError::ShuttingDown => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::ShuttingDown,
            e.to_string(),
        ),
        ScaleError::Admission(_) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::AdmissionFailed,
            e.to_string(),
        ),
    }
}

/// Most bytes a request body may have. The largest legitimate body (a scale
/// request with a few hundred labels) is far below.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A JSON body, rejected in the [`ErrorBody`] shape with the JSON path of
/// the problem. Requires `Content-Type: application/json`: a browser cannot
/// send that cross-origin without a CORS preflight, which this API never
/// answers, so a web page cannot drive a loopback daemon.
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                ErrorCode::UnsupportedMediaType,
                "the body must be JSON, sent with Content-Type: application/json",
            ));
        }
        // The listener's body deadline; a request that did not come
        // through a listener (an in-process test) has the default.
        let deadline = req
            .extensions()
            .get::<BodyDeadline>()
            .map_or(ConnectionLimits::DEFAULT_BODY_TIMEOUT, |d| d.0);
        let read = tokio::time::timeout(deadline, Bytes::from_request(req, state))
            .await
            .map_err(|_| {
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    ErrorCode::BodyTimeout,
                    format!(
                        "the body did not arrive in full within {} s",
                        deadline.as_secs()
                    ),
                )
            })?;
        let bytes = read.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    ErrorCode::PayloadTooLarge,
                    format!("the body is larger than {MAX_BODY_BYTES} bytes"),
                )
            } else {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::UnreadableBody,
                    e.body_text(),
                )
            }
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// Parses `bytes` as one JSON document of type `T`, mapping every error to
/// an [`ApiError`] naming the field.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Syntax first, over the whole body: a broken document is 400 whichever
    // key comes first, never a 422 for a field the parser met before the
    // break. `IgnoredAny` checks without building anything.
    serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::MalformedJson,
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(serde_error)?;
    de.end().map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::MalformedJson,
            format!("the body is not one JSON document: {e}"),
        )
    })?;
    Ok(value)
}

fn serde_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    use serde_json::error::Category;
    let path = e.path().to_string();
    let inner = e.inner();
    let message = inner.to_string();
    // serde_json appends " at line L column C"; the field path says more.
    let message = match message.rfind(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message,
    };
    let at = |name: Option<&str>| -> Option<String> {
        let parent = (path != ".").then_some(path.as_str());
        match (parent, name) {
            (Some(p), Some(n)) => Some(format!("{p}.{n}")),
            (Some(p), None) => Some(p.to_owned()),
            (None, Some(n)) => Some(n.to_owned()),
            (None, None) => None,
        }
    };
    match inner.classify() {
        // Where in a broken document the parser stopped is not a field.
        Category::Syntax | Category::Eof | Category::Io => ApiError {
            field: None,
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                ErrorCode::MalformedJson,
                format!("the body is not valid JSON: {inner}"),
            )
        },
        Category::Data => {
            let quoted = backticked(&message);
            // serde_path_to_error's path already ends at an unknown field,
            // but stops at the parent of a missing one.
            let (code, field) = if message.starts_with("unknown field") {
                (ErrorCode::UnknownField, at(None))
            } else if message.starts_with("missing field") {
                (ErrorCode::MissingField, at(quoted))
            } else if message.starts_with("invalid type") {
                (ErrorCode::InvalidType, at(None))
            } else {
                (ErrorCode::InvalidValue, at(None))
            };
            ApiError {
                field,
                ..ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, message.clone())
            }
        }
    }
}

/// The first `name` in "... `name` ..." (serde's quoting of field names).
fn backticked(message: &str) -> Option<&str> {
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(&message[start..start + len])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    struct Outer {
        #[allow(dead_code)]
        job_id: String,
        #[allow(dead_code)]
        inner: Option<Inner>,
        #[allow(dead_code)]
        #[serde(default)]
        labels: Vec<String>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[allow(dead_code)]
        cpus: Option<f64>,
    }

    fn err(body: &str) -> ApiError {
        parse_json::<Outer>(body.as_bytes()).unwrap_err()
    }

    #[test]
    fn errors_name_the_json_path() {
        let e = err(r#"{"jobId":"a","bogus":1}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("unknown-field", Some("bogus"))
        );
        let e = err(r#"{"jobId":"a","inner":{"cpu":1}}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("unknown-field", Some("inner.cpu"))
        );
        let e = err(r#"{"jobId":"a","inner":{"cpus":"two"}}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("invalid-type", Some("inner.cpus"))
        );
        let e = err(r#"{"jobId":"a","labels":["x",2]}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("invalid-type", Some("labels[1]"))
        );
        let e = err(r#"{}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("missing-field", Some("jobId"))
        );
        assert_eq!(e.status, StatusCode::UNPROCESSABLE_ENTITY);
    }

    #[test]
    fn malformed_json_is_a_400() {
        for body in [r#"{"jobId":"a""#, "", "nope", r#"{"jobId":"a"} {}"#] {
            let e = err(body);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.code, "malformed-json", "{body}");
        }
    }
}
