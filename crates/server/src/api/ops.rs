//! Operations: status, reload, health, readiness, metrics and the OpenAPI
//! document.

use super::error::{ApiError, ErrorBody, ErrorCode, ReloadErrorBody};
use super::wire::{Health, IntoApi, Readiness, ReloadAnswer, StatusObject};
use super::AppState;
use axum::extract::{RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

/// Per scaler: agents by state, caps used and free, warm target and idle,
/// pending requests, cordon/drain; per label set: the breaker. In a fleet,
/// the other live hosts' status too, under `hosts` (`?local=true`: this
/// host's only).
#[utoipa::path(
    get,
    path = "/v1/status",
    tag = "operations",
    params(
        ("local" = Option<bool>, Query, description = "In a fleet: only this host's status")
    ),
    responses(
        (status = 200, description = "The status", body = StatusObject),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 422, description = "Unknown or invalid query parameter", body = ErrorBody)
    )
)]
pub async fn status(
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
) -> Result<Json<StatusObject>, ApiError> {
    let local = super::query_flags(query.as_deref(), &["local"])?.contains(&"local");
    Ok(Json(state.service().status(local).await))
}

/// The fleet this daemon belongs to: its hosts (state, epoch, lease age,
/// leader) and pools (hosts serving each, agents, capacity, queue depth),
/// read from the fleet's database — the same answer from every host.
#[utoipa::path(
    get,
    path = "/v1/fleet",
    tag = "operations",
    responses(
        (status = 200, description = "The fleet", body = kici_api::FleetObject),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "This daemon is not in a fleet (its state store is not PostgreSQL)", body = ErrorBody),
        (status = 503, description = "The fleet's database is unreachable", body = ErrorBody)
    )
)]
pub async fn fleet(State(state): State<AppState>) -> Result<Json<kici_api::FleetObject>, ApiError> {
    state.service().fleet_view().await.map(Json)
}

/// Re-read the configuration files and apply them, all or nothing.
///
/// The new configuration is validated (files, then every backend) before
/// anything changes; on any error nothing changes and every error is listed.
/// Same as SIGHUP.
#[utoipa::path(
    post,
    path = "/v1/reload",
    tag = "operations",
    responses(
        (status = 200, description = "Applied; what changed", body = ReloadAnswer),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 422, description = "Refused; nothing changed", body = ReloadErrorBody)
    )
)]
pub async fn reload(State(state): State<AppState>) -> Result<Json<ReloadAnswer>, ApiError> {
    match state.reloader.reload().await {
        Ok(report) => Ok(Json(ReloadAnswer {
            diff: report.into_api(),
        })),
        Err(errors) => Err(ApiError {
            errors: Some(errors),
            ..ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidConfig,
                "the new configuration was refused; nothing changed",
            )
        }),
    }
}

/// Prometheus metrics (text exposition format).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses(
        (status = 200, description = "Every kici_orch_scaler_* series", content_type = "text/plain", body = String),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody)
    )
)]
pub async fn metrics(State(state): State<AppState>) -> Response {
    let config = state.runtime.call(|e, _| Arc::clone(e.config()));
    let status = state.runtime.status();
    let agents = state.runtime.agents(false);
    let text = state.metrics.scrape(&config, &status, &agents);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Liveness: the process answers.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses(
        (status = 200, description = "Alive", body = Health),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody)
    )
)]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".to_owned(),
    })
}

/// Readiness: start-up finished (state dir, configuration, backends,
/// engine) and the daemon is not shutting down.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Ready", body = Readiness),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 503, description = "Not ready", body = Readiness)
    )
)]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Readiness>) {
    if state.is_ready() {
        (
            StatusCode::OK,
            Json(Readiness {
                ready: true,
                reason: None,
            }),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Readiness {
                ready: false,
                reason: Some("starting or shutting down".to_owned()),
            }),
        )
    }
}

/// This document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses(
        (status = 200, description = "The OpenAPI 3.1 document", content_type = "application/json", body = Object),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody)
    )
)]
pub async fn openapi(State(state): State<AppState>) -> Response {
    let json = state.openapi_json.read().clone();
    (
        [(header::CONTENT_TYPE, "application/json")],
        json.to_string(),
    )
        .into_response()
}
