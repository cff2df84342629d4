//! Agents: the lifecycle reports an orchestrator sends (`registered`,
//! `config-ack`, `job-started`, `job-complete`, `disconnected`), operator
//! destroy, and the agent views.
//!
//! The reports are idempotent: a retried report, or one that arrives after
//! the agent is already gone, gets the same success answer.

use super::error::{agent_error, ApiError, ApiJson, ErrorBody, ErrorCode};
use super::wire::{
    AgentList, AgentObject, JobCompleteBody, JobStartedBody, RegisteredBody, RegistrationAnswer,
};
use super::{parse_agent, AppState};
use crate::gateway::enrolment::Refusal;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::Json;

/// An agent registered: check its token.
///
/// The orchestrator relays the token the agent presented; it must be the one
/// minted for this agent id, unexpired and not revoked. The answer tells the
/// orchestrator which job the agent was spawned for and which labels a job
/// must carry to be dispatched to it.
#[utoipa::path(
    post,
    path = "/v1/agents/{id}/registered",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id, scaler-<type>-<8 hex>")),
    request_body = RegisteredBody,
    responses(
        (status = 200, description = "Registered", body = RegistrationAnswer),
        (status = 400, description = "Malformed JSON or agent id", body = ErrorBody),
        (status = 401, description = "Bad, expired or foreign agent token (or bearer token)", body = ErrorBody),
        (status = 404, description = "Not an agent of this instance", body = ErrorBody),
        (status = 409, description = "The agent cannot register in its state", body = ErrorBody),
        (status = 415, description = "Not application/json", body = ErrorBody),
        (status = 422, description = "A field is invalid", body = ErrorBody),
        (status = 503, description = "In a fleet: the registration could not be recorded; retry", body = ErrorBody)
    )
)]
pub async fn registered(
    State(state): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<RegisteredBody>,
) -> Result<Json<RegistrationAnswer>, ApiError> {
    let agent = parse_agent(&id)?;
    Ok(Json(state.service().registered(agent, body).await?))
}

/// The agent acknowledged its configuration.
#[utoipa::path(
    post,
    path = "/v1/agents/{id}/config-ack",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    responses(
        (status = 204, description = "Recorded"),
        (status = 400, description = "Not an agent id", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "Not an agent of this instance", body = ErrorBody),
        (status = 500, description = "The backend could not clear the agent's bootstrap data (the agent is destroyed)", body = ErrorBody)
    )
)]
pub async fn config_ack(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let agent = parse_agent(&id)?;
    state.service().config_ack(agent).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The control API's answer to a refused registration.
pub(crate) fn refusal_error(refusal: Refusal) -> ApiError {
    match refusal {
        Refusal::NotOurs(agent) => ApiError::agent_not_found(agent),
        Refusal::Token(_) | Refusal::ForeignToken { .. } | Refusal::LabelsOutOfScope(_) => {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                ErrorCode::InvalidAgentToken,
                "the agent token is not valid for this agent (wrong, expired or revoked)",
            )
            .field("token")
        }
        Refusal::Engine { source, .. } => agent_error(source),
        // The fleet's database did not take the registration: retryable.
        Refusal::Unrecorded { .. } => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::StoreUnavailable,
            refusal.to_string(),
        ),
    }
}

/// The orchestrator dispatched a job to the agent.
#[utoipa::path(
    post,
    path = "/v1/agents/{id}/job-started",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    request_body = JobStartedBody,
    responses(
        (status = 204, description = "Recorded (also when already recorded)"),
        (status = 400, description = "Malformed JSON or agent id", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "Not an agent of this instance", body = ErrorBody),
        (status = 409, description = "Busy with another job, gone, or not ready for a job", body = ErrorBody),
        (status = 415, description = "Not application/json", body = ErrorBody),
        (status = 422, description = "A field is invalid", body = ErrorBody)
    )
)]
pub async fn job_started(
    State(state): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<JobStartedBody>,
) -> Result<StatusCode, ApiError> {
    let agent = parse_agent(&id)?;
    state.service().job_started(agent, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The agent's job ended.
///
/// In orchestrator mode the agent goes idle and may take another job; its
/// scaler draining sends it away instead.
#[utoipa::path(
    post,
    path = "/v1/agents/{id}/job-complete",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    request_body = JobCompleteBody,
    responses(
        (status = 204, description = "Recorded (also when already recorded or the agent is gone)"),
        (status = 400, description = "Malformed JSON or agent id", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "Not an agent of this instance", body = ErrorBody),
        (status = 409, description = "The agent runs another job", body = ErrorBody),
        (status = 415, description = "Not application/json", body = ErrorBody),
        (status = 422, description = "A field is invalid", body = ErrorBody)
    )
)]
pub async fn job_complete(
    State(state): State<AppState>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<JobCompleteBody>,
) -> Result<StatusCode, ApiError> {
    let agent = parse_agent(&id)?;
    state.service().job_complete(agent, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The agent's connection closed: it is destroyed.
#[utoipa::path(
    post,
    path = "/v1/agents/{id}/disconnected",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    responses(
        (status = 204, description = "The agent is being (or was) destroyed"),
        (status = 400, description = "Not an agent id", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "Not an agent of this instance", body = ErrorBody)
    )
)]
pub async fn disconnected(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let agent = parse_agent(&id)?;
    state.service().disconnected(agent).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Every live agent (`?all=true`: also the recently gone ones). In a fleet,
/// every host's agents, each with its `host` (`?local=true`: this host's
/// only).
#[utoipa::path(
    get,
    path = "/v1/agents",
    tag = "agents",
    params(
        ("all" = Option<bool>, Query, description = "Include gone agents"),
        ("local" = Option<bool>, Query, description = "In a fleet: only this host's agents")
    ),
    responses(
        (status = 200, description = "The agents, oldest first", body = AgentList),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 422, description = "Unknown or invalid query parameter", body = ErrorBody)
    )
)]
pub async fn list_agents(
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
) -> Result<Json<AgentList>, ApiError> {
    let query = AgentsQuery::parse(query.as_deref())?;
    Ok(Json(state.service().agents(query.all, query.local).await))
}

/// The query of `GET /v1/agents`.
#[derive(Debug, Default, PartialEq, Eq)]
struct AgentsQuery {
    all: bool,
    local: bool,
}

impl AgentsQuery {
    /// `all` and `local`, each `true|false|1|0` (or bare: true); anything
    /// else is refused by name.
    fn parse(query: Option<&str>) -> Result<Self, ApiError> {
        let on = super::query_flags(query, &["all", "local"])?;
        Ok(Self {
            all: on.contains(&"all"),
            local: on.contains(&"local"),
        })
    }
}

/// One agent (live or recently gone).
#[utoipa::path(
    get,
    path = "/v1/agents/{id}",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    responses(
        (status = 200, description = "The agent", body = AgentObject),
        (status = 400, description = "Not an agent id", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "Not an agent of this instance", body = ErrorBody)
    )
)]
pub async fn get_agent(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<AgentObject>, ApiError> {
    let agent = parse_agent(&id)?;
    Ok(Json(state.service().agent(agent).await?))
}

/// Destroy an agent now (operator action), whatever it is doing.
#[utoipa::path(
    delete,
    path = "/v1/agents/{id}",
    tag = "agents",
    params(("id" = String, Path, description = "Agent id")),
    responses(
        (status = 202, description = "Destroying (or already gone)"),
        (status = 400, description = "Not an agent id", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "Not an agent of this instance", body = ErrorBody)
    )
)]
pub async fn delete_agent(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let agent = parse_agent(&id)?;
    state.service().destroy_agent(agent).await?;
    Ok(StatusCode::ACCEPTED)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn the_all_and_local_parameters() {
        let q = |s| AgentsQuery::parse(s);
        assert_eq!(q(None).unwrap(), AgentsQuery::default());
        assert!(q(Some("all=true")).unwrap().all);
        assert!(q(Some("all")).unwrap().all);
        assert!(!q(Some("all=false")).unwrap().all);
        assert_eq!(
            q(Some("all=true&local=1")).unwrap(),
            AgentsQuery {
                all: true,
                local: true
            }
        );
        assert_eq!(
            q(Some("all=yes")).unwrap_err().field.as_deref(),
            Some("all")
        );
        assert_eq!(
            q(Some("local=maybe")).unwrap_err().field.as_deref(),
            Some("local")
        );
        assert_eq!(q(Some("al=1")).unwrap_err().code, "unknown-field");
    }
}
