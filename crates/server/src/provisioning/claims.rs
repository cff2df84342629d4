//! The `--claims-listen` listener: `POST /v1/claims` and nothing else.
//!
//! It is a listener of its own, not a route of the control API, so an
//! operator exposes exactly this to the instances (a firewall rule, a
//! reverse proxy) and nothing of the API. It needs no API token: the claim
//! code is the credential. Each source address is rate-limited (the TCP
//! peer's; behind a proxy, every instance shares the proxy's budget); a
//! refusal names its reason (`unknown`, `consumed`, `expired`) and nothing
//! else about codes.

use crate::daemon::serving::{ConnectionLimits, Listener, ListenerMetrics, ListenerName, Server};
use crate::provisioning::hub::{Provisioning, Redeem};
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use kici_provision::claim::{ClaimErrorBody, ClaimErrorDetail, ClaimRequest};
use std::net::SocketAddr;
use std::sync::Arc;

/// The largest body taken (a request is `{"claimCode": "kcc_…"}`).
const MAX_BODY: usize = 4 * 1024;

/// The listener's routes.
pub fn router(hub: Arc<Provisioning>) -> Router {
    Router::new()
        .route("/v1/claims", post(redeem))
        .fallback(|| async {
            plain(
                StatusCode::NOT_FOUND,
                "no-route",
                "this listener serves POST /v1/claims only",
            )
        })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(hub)
}

/// Serves [`router`] on `listener` with the daemon's connection bounds
/// (header and body deadlines, a cap on open connections): this is the one
/// listener meant to face networks the operator does not control.
pub fn serve(
    listener: std::net::TcpListener,
    hub: Arc<Provisioning>,
    limits: ConnectionLimits,
    metrics: ListenerMetrics,
) -> std::io::Result<Server> {
    Ok(Server::start(
        ListenerName::Claims,
        Listener::tcp(listener)?,
        None,
        router(hub),
        limits,
        metrics,
    ))
}

fn plain(status: StatusCode, code: &str, message: &str) -> Response {
    let body = ClaimErrorBody {
        error: ClaimErrorDetail {
            code: code.to_owned(),
            message: message.to_owned(),
            reason: None,
        },
    };
    (status, axum::Json(body)).into_response()
}

async fn redeem(
    State(hub): State<Arc<Provisioning>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: Bytes,
) -> Response {
    let request: ClaimRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(_) => {
            return plain(
                StatusCode::BAD_REQUEST,
                "invalid-body",
                "expected {\"claimCode\": \"kcc_…\"}",
            )
        }
    };
    match hub.redeem(peer.ip(), request.claim_code.expose()).await {
        Ok(creds) => {
            tracing::info!(agent_id = %creds.agent_id, source = %peer.ip(), "claim code redeemed");
            (StatusCode::OK, axum::Json(creds)).into_response()
        }
        Err(Redeem::Limited(after)) => {
            let mut r = plain(
                StatusCode::TOO_MANY_REQUESTS,
                "rate-limited",
                "too many claim attempts from this address",
            );
            if let Ok(v) = header::HeaderValue::from_str(&after.as_secs().max(1).to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            r
        }
        Err(Redeem::Failed(e)) => {
            tracing::info!(source = %peer.ip(), refusal = %e, "claim refused");
            let status =
                StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, axum::Json(e.body())).into_response()
        }
    }
}
