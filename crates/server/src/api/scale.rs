//! Scale requests: `POST /v1/scale` and `DELETE /v1/scale/{jobId}`
//! (orchestrator mode; the request's agent is destroyed on disconnect).

use super::error::{scale_error, ApiError, ApiJson, ErrorBody, ErrorCode};
use super::wire::{parse_job, IntoApi, IntoRequest, ScaleAnswer, ScaleBody};
use super::AppState;
use crate::durable::persist::pending_committed;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use kici_engine::ScaleOutcome;

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
    let request = body.clone().into_request()?;
    let job = request.job.clone();
    // A read: nothing starts while the store cannot record it.
    state.store_reachable().await?;
    if let Some(fleet) = state.fleet() {
        // In a fleet the shared queue records the request (committed before
        // this answer) and whichever host serves its pool takes it.
        let (outcome, serving) = fleet
            .enter_scale(&body, request)
            .await
            .map_err(fleet_error)?;
        let status = match outcome {
            ScaleOutcome::Spawning { .. } => StatusCode::ACCEPTED,
            _ => StatusCode::OK,
        };
        tracing::info!(job_id = %job, result = ?outcome, "scale request (fleet)");
        let mut answer = outcome.into_api();
        if let ScaleAnswer::Spawning { hosts, .. } | ScaleAnswer::Pending { hosts, .. } =
            &mut answer
        {
            *hosts = serving;
        }
        return Ok((status, Json(answer)));
    }
    let (outcome, recorded) = state.runtime.request_scale_recorded(request);
    // A request that waits is answered once its record (the engine's
    // journal) is committed: a crash must not forget what was acknowledged.
    pending_committed(&state.runtime, &job, recorded)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                error_text(&e),
            )
        })?;
    let outcome = outcome.map_err(scale_error)?;
    let status = match outcome {
        ScaleOutcome::Spawning { .. } => StatusCode::ACCEPTED,
        _ => StatusCode::OK,
    };
    tracing::info!(job_id = %job, result = ?outcome, "scale request");
    Ok((status, Json(outcome.into_api())))
}

fn fleet_error(e: crate::fleet::EntryError) -> ApiError {
    use crate::fleet::EntryError;
    match e {
        EntryError::Conflict(job) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::JobConflict,
            format!("job {job} was already requested with a different body"),
        )
        .field("jobId"),
        EntryError::Unavailable(m) | EntryError::Body(m) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::StoreUnavailable,
            m,
        ),
    }
}

/// An error and its sources, `: `-separated.
fn error_text(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
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
    let cancelled = match state.fleet() {
        Some(fleet) => fleet.cancel_scale(&job).await.map_err(fleet_error)?,
        None => state.runtime.cancel_scale(&job),
    };
    tracing::info!(job_id = %job, cancelled, "scale request cancelled");
    Ok(StatusCode::NO_CONTENT)
}
