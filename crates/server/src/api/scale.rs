//! Scale requests: `POST /v1/scale` and `DELETE /v1/scale/{jobId}`
//! (orchestrator mode; the request's agent is destroyed on disconnect).

use super::error::{ApiError, ApiJson, ErrorBody};
use super::wire::{parse_job, ScaleAnswer, ScaleBody};
use super::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;

/// Ask for an agent for one job.
///
/// Routes the labels to a scaler label set, admits against every cap and
/// starts provisioning. A request that does not fit now waits in the pending
/// queue; one that can never fit is `too-large`. Retrying with the same
/// `jobId` and the same body returns the current answer without a second
/// spawn; a different body for a `jobId` still in flight is a 409.
#[utoipa::path(
    post,
    path = "/v1/scale",
    tag = "scale",
    request_body = ScaleBody,
    responses(
        (status = 202, description = "An agent is being provisioned (`spawning`)", body = ScaleAnswer),
        (status = 200, description = "`pending`, `too-large` or `no-backend`", body = ScaleAnswer),
        (status = 400, description = "Malformed JSON", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 409, description = "The jobId was requested with a different body", body = ErrorBody),
        (status = 415, description = "Not application/json", body = ErrorBody),
        (status = 422, description = "A field is invalid (`field` names it)", body = ErrorBody),
        (status = 500, description = "Admission failed (machine-pool ledger)", body = ErrorBody),
        (status = 503, description = "Shutting down, the pending queue is full, or the state store is unreachable", body = ErrorBody)
    )
)]
pub async fn request_scale(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<ScaleBody>,
) -> Result<(StatusCode, Json<ScaleAnswer>), ApiError> {
    let answer = state.service().scale(body).await?;
    let status = match answer {
        ScaleAnswer::Spawning { .. } => StatusCode::ACCEPTED,
        _ => StatusCode::OK,
    };
    Ok((status, Json(answer)))
}

/// Cancel a scale request.
///
/// Cancels the request while it is pending, or destroys its agent while that
/// has not registered yet. Idempotent: nothing to cancel is also a 204.
#[utoipa::path(
    delete,
    path = "/v1/scale/{jobId}",
    tag = "scale",
    params(("jobId" = String, Path, description = "The job id of the scale request")),
    responses(
        (status = 204, description = "Cancelled, or nothing was left to cancel"),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 422, description = "Not a job id", body = ErrorBody)
    )
)]
pub async fn cancel_scale(
    State(state): State<AppState>,
    Path(job_id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let job = parse_job("jobId", &job_id)?;
    state.service().cancel_scale(&job).await?;
    Ok(StatusCode::NO_CONTENT)
}
