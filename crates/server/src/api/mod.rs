//! The control API (docs/operations.md, *Control API*): HTTP/JSON under `/v1`, SSE events,
//! `/metrics`, `/healthz`, `/readyz`, `/openapi.json`.
//!
//! Every route is declared once, with its OpenAPI description, through
//! `utoipa-axum`: the router and the document come from the same list, so
//! they cannot disagree. Handlers live with their concept:
//!
//! - [`scale`]: `POST /v1/scale`, `DELETE /v1/scale/{jobId}`;
//! - [`agents`]: the agent lifecycle reports and agent views;
//! - [`scalers`]: cordon / uncordon / drain;
//! - [`ops`]: status, reload, health, readiness, metrics, the document;
//! - [`stream`]: `GET /v1/events`;
//! - [`jobs`]: standalone jobs, `/v1/jobs*`, joined through
//!   [`router_with`]'s `extra` routes (as any further group would be);
//! - [`relay`]: SSE streams a task feeds (what a fleet host relays);
//! - [`ui`]: the web console at `/ui/` (static; outside the guard).
//!
//! Handlers parse the request and call the daemon's [`Service`] (alone, or
//! as a host of a fleet: chosen once, when the state is built), so none of
//! them asks whether the daemon is in a fleet. The guard accepts a fleet
//! peer's signature on the calls `kici_api::ROUTES` flags as peer calls,
//! looked up by the route the router matched.
//!
//! The agent gateway (`/ws`) has its own listener (see [`crate::gateway`]).

pub mod agents;
pub mod error;
pub mod jobs;
pub mod ops;
pub mod relay;
pub mod scale;
pub mod scalers;
pub mod stream;
pub mod ui;
pub mod wire;

use crate::daemon::reload::Reload;
use crate::events::metrics::Metrics;
use crate::events::EventLog;
use crate::gateway::token::{Secret, TokenStore};
use crate::jobs::JobBook;
use crate::service::{Local, Service};
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use error::{ApiError, ErrorCode, MAX_BODY_BYTES};
use kici_engine::runtime::Runtime;
use kici_model::InstanceId;
use kici_store::StateStore;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::OpenApi as OpenApiDoc;
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// What every handler reaches. Cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

pub struct Shared {
    pub runtime: Runtime,
    pub instance: InstanceId,
    pub tokens: Arc<TokenStore>,
    pub events: Arc<EventLog>,
    /// Standalone jobs (`/v1/jobs*`).
    pub jobs: Arc<JobBook>,
    pub metrics: Arc<Metrics>,
    pub reloader: Arc<dyn Reload>,
    /// `KICI_SCALER_API_TOKEN`; when set, every request must carry it.
    pub api_token: Option<Secret>,
    /// How this daemon serves: alone or as a host of a fleet, chosen when
    /// the state is built.
    service: Service,
    /// Start-up finished and not shutting down.
    ready: AtomicBool,
    /// The OpenAPI document, serialised once.
    openapi_json: parking_lot::RwLock<Arc<str>>,
}

impl AppState {
    /// The agent lifecycle policy the agent reports go through.
    pub fn enrolment(&self) -> crate::gateway::enrolment::Enrolment {
        crate::gateway::enrolment::Enrolment::new(self.runtime.clone(), Arc::clone(&self.tokens))
    }

    /// The state of a daemon on its own.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        runtime: Runtime,
        instance: InstanceId,
        tokens: Arc<TokenStore>,
        events: Arc<EventLog>,
        jobs: Arc<JobBook>,
        metrics: Arc<Metrics>,
        reloader: Arc<dyn Reload>,
        api_token: Option<Secret>,
    ) -> Self {
        let local = Local::new(runtime, instance, tokens, events, jobs);
        Self::serving(Service::Local(local), metrics, reloader, api_token)
    }

    /// The state of a daemon that serves as `service` says (alone, or as a
    /// host of a fleet): the one place where that is chosen.
    pub fn serving(
        service: Service,
        metrics: Arc<Metrics>,
        reloader: Arc<dyn Reload>,
        api_token: Option<Secret>,
    ) -> Self {
        let local = service.local().clone();
        Self(Arc::new(Shared {
            runtime: local.runtime,
            instance: local.instance,
            tokens: local.tokens,
            events: local.events,
            jobs: local.jobs,
            metrics,
            reloader,
            api_token,
            service,
            ready: AtomicBool::new(false),
            openapi_json: parking_lot::RwLock::new(Arc::from("{}")),
        }))
    }

    /// The state store every new scale request must be able to reach.
    pub fn set_store(&self, store: Arc<dyn StateStore>) {
        self.0.service.local().set_store(store);
    }

    /// Checks that the state store answers (bounded by its pool's acquire
    /// timeout, 1 s by default; a read, nothing is written): a request it
    /// could not record must not start anything.
    pub async fn store_reachable(&self) -> Result<(), ApiError> {
        self.0.service.store_reachable().await
    }

    /// What the handlers ask of this daemon.
    pub fn service(&self) -> &Service {
        &self.0.service
    }

    pub fn set_ready(&self, ready: bool) {
        self.0.ready.store(ready, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.0.ready.load(Ordering::Acquire)
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The document's frame; paths and schemas are added from the routes.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "kici-scaler control API",
        description = "Provision ephemeral CI agents by job labels. JSON, camelCase, \
                       unknown fields rejected; every error is {\"error\":{\"code\",\"message\",\"field\"}}. \
                       A bearer token (KICI_SCALER_API_TOKEN) is required on every request when the daemon \
                       has one, always on a non-loopback listener."
    ),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    components(schemas(error::ErrorBody, error::ErrorDetail)),
    tags(
        (name = "scale", description = "Scale requests (orchestrator mode)"),
        (name = "jobs", description = "Standalone jobs: kici-scaler provisions an agent, runs a command on it and streams its output"),
        (name = "agents", description = "Agents and their lifecycle reports"),
        (name = "scalers", description = "Operator switches per scaler"),
        (name = "operations", description = "Status, reload, events, health, metrics")
    )
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut OpenApiDoc) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// Every documented route, and the document they make.
pub fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(scale::request_scale))
        .routes(routes!(scale::cancel_scale))
        .routes(routes!(agents::registered))
        .routes(routes!(agents::config_ack))
        .routes(routes!(agents::job_started))
        .routes(routes!(agents::job_complete))
        .routes(routes!(agents::disconnected))
        .routes(routes!(agents::list_agents))
        .routes(routes!(agents::get_agent, agents::delete_agent))
        .routes(routes!(scalers::cordon))
        .routes(routes!(scalers::uncordon))
        .routes(routes!(scalers::drain))
        .routes(routes!(ops::status))
        .routes(routes!(ops::reload))
        .routes(routes!(stream::events))
        .routes(routes!(ops::fleet))
        .routes(routes!(ops::metrics))
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::openapi))
}

/// The OpenAPI document (what `GET /openapi.json` of [`router`] serves).
pub fn openapi() -> OpenApiDoc {
    let mut doc = api_routes().merge(jobs::routes()).into_openapi();
    add_common_responses(&mut doc);
    doc
}

/// Answers the guard and the body extractor can give on any route: 401
/// (bearer token), 403 (cross-origin, on every method but GET), 413 (a body
/// too large, on routes that take one). Added to every operation that does
/// not already describe them.
fn add_common_responses(doc: &mut OpenApiDoc) {
    use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
    let error = |description: &str| {
        RefOr::T(
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("ErrorBody")))
                        .build(),
                )
                .build(),
        )
    };
    for item in doc.paths.paths.values_mut() {
        let ops = [
            (&mut item.get, false),
            (&mut item.post, true),
            (&mut item.put, true),
            (&mut item.delete, true),
            (&mut item.patch, true),
        ];
        for (op, mutating) in ops {
            let Some(op) = op else { continue };
            let has_body = op.request_body.is_some();
            let responses = &mut op.responses.responses;
            responses
                .entry("401".to_owned())
                .or_insert_with(|| error("Missing or wrong bearer token"));
            if mutating {
                responses
                    .entry("403".to_owned())
                    .or_insert_with(|| error("Refused: sent by a web page (an Origin header)"));
            }
            if has_body {
                responses
                    .entry("413".to_owned())
                    .or_insert_with(|| error("The body is too large"));
            }
        }
    }
}

/// The control API's router: every route of [`api_routes`] plus the
/// standalone jobs.
pub fn router(state: AppState) -> Router {
    router_with(state, jobs::routes())
}

/// The router plus `extra` routes (the agent gateway and standalone jobs
/// plug in here); their OpenAPI paths join the document.
pub fn router_with(state: AppState, extra: OpenApiRouter<AppState>) -> Router {
    let (router, mut doc) = api_routes().merge(extra).split_for_parts();
    add_common_responses(&mut doc);
    let json = doc
        .to_json()
        .unwrap_or_else(|e| format!("{{\"error\":\"cannot encode the OpenAPI document: {e}\"}}"));
    *state.openapi_json.write() = Arc::from(json);
    router
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
        // The console's page and assets hold no data: no token (a browser
        // cannot send one with a navigation). Merged after the guard so
        // that only these few paths skip it.
        .merge(ui::routes())
}

async fn no_route(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ErrorCode::NoRoute,
        format!("no route for {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::MethodNotAllowed,
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// Bearer token (when the daemon has one) — or, on the calls fleet hosts
/// make on each other, the fleet's signature instead — and the
/// cross-origin guard, for every request, before routing.
async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let request = if request.headers().contains_key(crate::fleet::auth::HEADER) {
        match peer_signed(&state, request).await {
            Ok(request) => request,
            Err(refused) => return refused,
        }
    } else if let Some(expected) = &state.api_token {
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            });
        let ok = presented.is_some_and(|p| expected.matches(p.trim()));
        if !ok {
            return ApiError::unauthorized(
                "a bearer token is required (Authorization: Bearer $KICI_SCALER_API_TOKEN)",
            )
            .into_response();
        }
        request
    } else {
        request
    };
    // A browser page may POST to a loopback daemon without a preflight when
    // the request has no body or a "simple" content type; it always sends
    // Origin then. API clients and orchestrators do not. The console (this
    // daemon's own page) sends its own origin, and is let through: see
    // [`own_origin`].
    if request.method() != Method::GET
        && request.headers().contains_key(header::ORIGIN)
        && !own_origin(request.headers(), state.api_token.is_some())
    {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::CrossOrigin,
            "requests from web pages (with an Origin header) are refused",
        )
        .into_response();
    }
    next.run(request).await
}

/// Whether a request's `Origin` is this daemon's own, that is the console
/// served at `/ui/` by this daemon: the origin is `http(s)://` + the
/// request's `Host`. A page elsewhere could only match by pointing a name
/// it controls at this address (DNS rebinding); so without a token (which
/// that page cannot know) the host must also be an address or `localhost`,
/// which no foreign page can be served from.
fn own_origin(headers: &axum::http::HeaderMap, token_checked: bool) -> bool {
    let (Some(origin), Some(host)) = (
        headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()),
        headers.get(header::HOST).and_then(|v| v.to_str().ok()),
    ) else {
        return false;
    };
    let Some(origin_host) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        return false;
    };
    if !origin_host.eq_ignore_ascii_case(host) {
        return false;
    }
    if token_checked {
        return true;
    }
    // `host[:port]`, `[v6]:port`.
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok()
}

/// A call signed with the fleet key (see [`crate::fleet::auth`]): let
/// through, instead of with the API token, when it is one of the calls
/// hosts make on each other and its signature verifies — which needs its
/// body, read here and handed on. Anything else is refused 401.
async fn peer_signed(state: &AppState, request: Request) -> Result<Request, Response> {
    use crate::fleet::auth::{unix_now, HEADER};
    let refuse = |why: String| {
        tracing::warn!(reason = %why, "fleet: a peer call refused");
        ApiError::unauthorized(why).into_response()
    };
    let auth = state
        .service()
        .peer_auth()
        .map_err(|why| refuse(why.to_owned()))?;
    let uri = request.uri();
    // The route the router matched (none for a path it does not serve),
    // and what the route table says of it.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .and_then(|m| kici_api::Route::find(request.method().as_str(), m.as_str()));
    if !route.is_some_and(|r| r.peer_callable(uri.query())) {
        return Err(refuse(format!(
            "the fleet signature is accepted only on the calls hosts make on each other, not on {} {}",
            request.method(),
            uri.path()
        )));
    }
    let path = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |p| p.as_str().to_owned());
    let header = request
        .headers()
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::PayloadTooLarge,
            format!("the body is larger than {MAX_BODY_BYTES} bytes"),
        )
        .into_response());
    };
    match auth.check(&header, parts.method.as_str(), &path, &body, unix_now()) {
        Ok(from) => {
            tracing::debug!(from = %from, method = %parts.method, path, "fleet: a peer call");
            Ok(Request::from_parts(parts, axum::body::Body::from(body)))
        }
        Err(refusal) => Err(refuse(refusal.to_string())),
    }
}

/// The boolean query flags of a read (`?all=true&local`): each one of
/// `known`, `true|false|1|0` or bare (true); anything else is refused by
/// name. Returns the flags that are on.
pub(crate) fn query_flags(
    query: Option<&str>,
    known: &[&'static str],
) -> Result<Vec<&'static str>, ApiError> {
    let mut on = Vec::new();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
        let Some(flag) = known.iter().find(|k| **k == key) else {
            let expected: Vec<String> = known.iter().map(|k| format!("`{k}`")).collect();
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::UnknownField,
                format!(
                    "unknown query parameter {key:?}: expected {}",
                    expected.join(" or ")
                ),
            )
            .field(key));
        };
        match value {
            "true" | "1" | "" => on.push(*flag),
            "false" | "0" => on.retain(|f| f != flag),
            other => {
                return Err(ApiError::invalid(
                    key,
                    format!("{key} must be true or false, got {other:?}"),
                ))
            }
        }
    }
    Ok(on)
}

/// Parses an agent id path parameter.
pub fn parse_agent(raw: &str) -> Result<kici_model::AgentId, ApiError> {
    raw.parse().map_err(|e: kici_model::IdError| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidAgentId,
            e.to_string(),
        )
        .field("id")
    })
}

#[cfg(test)]
mod tests {
    use super::own_origin;
    use axum::http::{header, HeaderMap, HeaderValue};

    fn headers(origin: &'static str, host: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::ORIGIN, HeaderValue::from_static(origin));
        h.insert(header::HOST, HeaderValue::from_static(host));
        h
    }

    /// The guard reads what a peer may call from the route the router
    /// matched ([`kici_api::Route::find`]): every route the router serves
    /// must be in the table, and every route of the table served.
    #[test]
    fn the_router_serves_exactly_the_route_table() {
        let doc = super::api_routes()
            .merge(super::jobs::routes())
            .into_openapi();
        let mut served = Vec::new();
        for (path, item) in &doc.paths.paths {
            for (method, op) in [
                ("GET", &item.get),
                ("POST", &item.post),
                ("PUT", &item.put),
                ("DELETE", &item.delete),
                ("PATCH", &item.patch),
            ] {
                if op.is_some() {
                    assert!(
                        kici_api::Route::find(method, path).is_some(),
                        "{method} {path} is served but not in kici_api::ROUTES"
                    );
                    served.push((method, path.as_str()));
                }
            }
        }
        served.sort();
        let mut table: Vec<(&str, &str)> = kici_api::ROUTES
            .iter()
            .map(|r| (r.method, r.path))
            .collect();
        table.sort();
        assert_eq!(served, table);
    }

    #[test]
    fn the_console_is_its_own_origin() {
        for (origin, host) in [
            ("http://127.0.0.1:7878", "127.0.0.1:7878"),
            ("http://localhost:7878", "localhost:7878"),
            ("http://[::1]:7878", "[::1]:7878"),
            ("https://10.0.0.5:7878", "10.0.0.5:7878"),
        ] {
            assert!(own_origin(&headers(origin, host), false), "{origin}");
        }
        // Another page; or a name that could be anyone's (DNS rebinding)
        // when no token vouches for the caller.
        for (origin, host) in [
            ("http://evil.example", "127.0.0.1:7878"),
            ("http://127.0.0.1:7879", "127.0.0.1:7878"),
            ("http://evil.example:7878", "evil.example:7878"),
            ("null", "127.0.0.1:7878"),
        ] {
            assert!(!own_origin(&headers(origin, host), false), "{origin}");
        }
        assert!(own_origin(
            &headers("https://ci.example:7878", "ci.example:7878"),
            true
        ));
        assert!(!own_origin(&HeaderMap::new(), true));
    }
}
