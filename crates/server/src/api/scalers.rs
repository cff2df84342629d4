//! Operator switches per scaler: cordon, uncordon, drain. They survive
//! reloads (by scaler name) but not a restart.

use super::error::{agent_error, ApiError, ErrorBody};
use super::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;

/// Stop routing new requests to the scaler; its agents are untouched.
#[utoipa::path(
    post,
    path = "/v1/scalers/{name}/cordon",
    tag = "scalers",
    params(("name" = String, Path, description = "Scaler name")),
    responses(
        (status = 204, description = "Cordoned"),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "No such scaler", body = ErrorBody)
    )
)]
pub async fn cordon(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.runtime.cordon(&name).map_err(agent_error)?;
    tracing::info!(scaler = %name, "scaler cordoned");
    Ok(StatusCode::NO_CONTENT)
}

/// Route to the scaler again (also ends a drain).
#[utoipa::path(
    post,
    path = "/v1/scalers/{name}/uncordon",
    tag = "scalers",
    params(("name" = String, Path, description = "Scaler name")),
    responses(
        (status = 204, description = "Uncordoned"),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "No such scaler", body = ErrorBody)
    )
)]
pub async fn uncordon(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.runtime.uncordon(&name).map_err(agent_error)?;
    tracing::info!(scaler = %name, "scaler uncordoned");
    Ok(StatusCode::NO_CONTENT)
}

/// Cordon, cancel the scaler's pending requests, destroy its idle agents;
/// busy agents finish their job, then leave.
#[utoipa::path(
    post,
    path = "/v1/scalers/{name}/drain",
    tag = "scalers",
    params(("name" = String, Path, description = "Scaler name")),
    responses(
        (status = 204, description = "Draining"),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "No such scaler", body = ErrorBody)
    )
)]
pub async fn drain(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.runtime.drain(&name).map_err(agent_error)?;
    tracing::info!(scaler = %name, "scaler draining");
    Ok(StatusCode::NO_CONTENT)
}
