//! Standalone jobs (docs/deviations.md, D-standalone-mode): `POST /v1/jobs`,
//! `GET /v1/jobs/{id}`, `GET /v1/jobs/{id}/logs`, `DELETE /v1/jobs/{id}`.
//!
//! kici-scaler is the dispatcher here: it provisions an agent for the job,
//! sends it the command over the agent gateway, collects its output and
//! exit, and destroys the agent when the job ends (see [`crate::jobs`]).
//! These routes join the control API through [`super::router_with`].

use super::error::{scale_error, ApiError, ApiJson, ErrorBody};
use super::relay::{relay, Relay};
use super::wire::{parse_job, parse_labels, IntoResourceRequest};
use super::AppState;
use crate::jobs::{self, JobBook, JobRequest, JobView, Read, SubmitError};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, KeepAliveStream, Sse};
use axum::Json;
use futures_util::stream::{self, BoxStream, Stream, StreamExt};
use kici_api::{OutputData, Truncated};
use kici_model::JobId;
use kici_protocol::{JobSpec, JobSpecError};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this module, for [`super::router_with`].
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(submit_job, list_jobs))
        .routes(routes!(get_job, cancel_job))
        .routes(routes!(job_logs))
}

pub use kici_api::{JobAccepted, JobBody, JobList};

/// This host's standalone jobs: the running ones and the finished ones it
/// still keeps (the same views as `GET /v1/jobs/{id}`), by job id.
#[utoipa::path(
    get,
    path = "/v1/jobs",
    tag = "jobs",
    responses((status = 200, description = "The jobs", body = JobList))
)]
pub async fn list_jobs(State(state): State<AppState>) -> Json<JobList> {
    let mut jobs = state.jobs.list();
    jobs.sort_by(|a, b| a.job_id.cmp(&b.job_id));
    Json(JobList { jobs })
}

/// A job body parsed into the book's request; every problem names its
/// field.
pub(crate) trait IntoJobRequest {
    fn into_request(self, job: JobId) -> Result<JobRequest, ApiError>;
}

impl IntoJobRequest for JobBody {
    fn into_request(self, job: JobId) -> Result<JobRequest, ApiError> {
        // As for `POST /v1/scale`: no labels routes like upstream does.
        let labels = parse_labels("labels", &self.labels)?;
        let resources = match self.resources {
            Some(r) => r.into_request("resources")?,
            None => None,
        };
        let spec = JobSpec::new(
            job,
            self.command,
            self.env.unwrap_or_default(),
            self.timeout_seconds,
        )
        .map_err(|e| {
            let field = match &e {
                JobSpecError::EmptyArgv | JobSpecError::TooLarge { .. } => "command".to_owned(),
                JobSpecError::NulByte(at) => match at.strip_prefix("argv") {
                    Some(index) => format!("command{index}"),
                    None => at.replacen("env ", "env.", 1),
                },
                JobSpecError::BadEnvName(name) => format!("env.{name}"),
                JobSpecError::ZeroTimeout => "timeoutSeconds".to_owned(),
            };
            ApiError::invalid(field, e.to_string())
        })?;
        Ok(JobRequest {
            labels,
            resources,
            spec,
        })
    }
}

fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::NoBackend(explanation) => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "no-backend", explanation)
                .field("labels")
        }
        SubmitError::TooLarge { cap, detail } => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "too-large",
            format!("the job can never fit under {cap}: {detail}"),
        )
        .field("resources"),
        SubmitError::Scale(e) => scale_error(e),
        SubmitError::Store(e) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable", e)
        }
    }
}

fn job_not_found(id: &JobId) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "job-not-found",
        format!("no job {id} (unknown, or finished long enough ago to be forgotten)"),
    )
    .field("id")
}

/// Run a command on a fresh agent (standalone mode).
///
/// Routes the labels, admits against every cap and provisions an agent;
/// the agent receives the command over the agent gateway, streams its
/// output and reports its exit, and is destroyed when the job ends. A job
/// that does not fit now waits (`pending`) until capacity frees. The job is
/// recorded in the state store before the answer: if kici-scaler crashes,
/// it is still shown after the restart (ended, with why).
#[utoipa::path(
    post,
    path = "/v1/jobs",
    tag = "jobs",
    request_body = JobBody,
    responses(
        (status = 202, description = "Accepted: `pending` or `spawning`", body = JobAccepted),
        (status = 400, description = "Malformed JSON", body = ErrorBody),
        (status = 415, description = "Not application/json", body = ErrorBody),
        (status = 422, description = "A field is invalid, or `no-backend` / `too-large` (`message` says why)", body = ErrorBody),
        (status = 500, description = "Admission failed (machine-pool ledger)", body = ErrorBody),
        (status = 503, description = "Shutting down, the pending queue is full, or the state store is unreachable", body = ErrorBody)
    )
)]
pub async fn submit_job(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<JobBody>,
) -> Result<(StatusCode, Json<JobAccepted>), ApiError> {
    let request = body.clone().into_request(JobBook::mint_id())?;
    if let Some(fleet) = state.fleet() {
        // In a fleet the shared queue records the job (committed before
        // the answer); a host serving its pool claims and runs it.
        let view = fleet
            .enter_job(&body, &request)
            .await
            .map_err(submit_error)?;
        return Ok((
            StatusCode::ACCEPTED,
            Json(JobAccepted {
                job_id: view.job_id,
                state: view.state,
            }),
        ));
    }
    // A durable book commits the job's record before anything starts: that
    // write is the store's check.
    if !state.jobs.is_durable() {
        state.store_reachable().await?;
    }
    let view = jobs::submit_recorded(&state.runtime, &state.jobs, request)
        .await
        .map_err(submit_error)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(JobAccepted {
            job_id: view.job_id,
            state: view.state,
        }),
    ))
}

/// One job: its state, agent, and how it ended.
///
/// A job that had not ended when kici-scaler crashed is shown after the
/// restart as `failed`, `end: aborted`, with the reason (`kici-scaler
/// restarted while the job ran`, or before it started); its agent was
/// destroyed by the recovery.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, description = "The job", body = JobView),
        (status = 404, description = "Unknown job", body = ErrorBody),
        (status = 422, description = "Not a job id", body = ErrorBody)
    )
)]
pub async fn get_job(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    let id = parse_job("id", &id)?;
    if let Some(view) = state.jobs.view(&id) {
        return Ok(Json(view));
    }
    // In a fleet, a job another live host runs was carried there before
    // this handler; what is left is answered from the queue.
    match state.fleet() {
        Some(fleet) => fleet
            .job_whereabouts(&id)
            .await
            .map_err(fleet_unavailable)?
            .map(|w| Json(w.view))
            .ok_or_else(|| job_not_found(&id)),
        None => Err(job_not_found(&id)),
    }
}

fn fleet_unavailable(e: kici_fleet::FleetError) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        format!("the fleet's database: {e}"),
    )
}

/// Cancel a job.
///
/// A pending job leaves the queue; a job whose agent exists has its agent
/// destroyed (with its command). Idempotent: a finished job keeps its end
/// and the answer carries it.
#[utoipa::path(
    delete,
    path = "/v1/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 202, description = "Cancelled (or already finished: its final state)", body = JobAccepted),
        (status = 404, description = "Unknown job", body = ErrorBody),
        (status = 422, description = "Not a job id", body = ErrorBody)
    )
)]
pub async fn cancel_job(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<JobAccepted>), ApiError> {
    let id = parse_job("id", &id)?;
    let view = match state.fleet() {
        Some(fleet) => cancel_in_fleet(&state, &fleet, &id).await?,
        None => jobs::cancel(&state.runtime, &state.jobs, &id, CANCELLED),
    }
    .ok_or_else(|| job_not_found(&id))?;
    Ok((
        StatusCode::ACCEPTED,
        Json(JobAccepted {
            job_id: view.job_id,
            state: view.state,
        }),
    ))
}

const CANCELLED: &str = "cancelled through the API";

/// How long a cancel waits for a job that is between the queue and a host
/// (claimed, not yet taken in) to land somewhere it can be cancelled.
const CANCEL_SETTLE: Duration = Duration::from_secs(5);

/// Cancels a job wherever it is in the fleet: here, in the queue, or on
/// the live host that holds it (carried there). A job moving from the
/// queue to a host is followed until it lands.
async fn cancel_in_fleet(
    state: &AppState,
    fleet: &crate::fleet::FleetHost,
    id: &JobId,
) -> Result<Option<JobView>, ApiError> {
    use crate::fleet::peer::OwnedBy;
    let deadline = tokio::time::Instant::now() + CANCEL_SETTLE;
    loop {
        if state.jobs.view(id).is_some() {
            return Ok(jobs::cancel(&state.runtime, &state.jobs, id, CANCELLED));
        }
        if let Some(view) = fleet
            .cancel_queued_job(id)
            .await
            .map_err(fleet_unavailable)?
        {
            return Ok(Some(view));
        }
        let Some(place) = fleet.job_whereabouts(id).await.map_err(fleet_unavailable)? else {
            return Ok(None);
        };
        if place.view.state.is_terminal() {
            return Ok(Some(place.view));
        }
        if place.owner.is_some() {
            let path = format!("/v1/jobs/{id}");
            let answer = fleet
                .forward(
                    &OwnedBy::Job(id.to_string()),
                    &axum::http::Method::DELETE,
                    &path,
                    bytes::Bytes::new(),
                )
                .await
                .map_err(|e| {
                    ApiError::new(StatusCode::BAD_GATEWAY, "peer-unavailable", e.to_string())
                })?;
            if let Some((status, body)) = answer {
                if status != 404 {
                    let accepted: JobAccepted = serde_json::from_slice(&body).map_err(|e| {
                        ApiError::new(
                            StatusCode::BAD_GATEWAY,
                            "peer-unavailable",
                            format!("the job's host answered {status} unreadably: {e}"),
                        )
                    })?;
                    let mut view = place.view;
                    view.state = accepted.state;
                    return Ok(Some(view));
                }
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "job-moving",
                format!("job {id} is being taken in by a host of the fleet; retry the cancel"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The job's output, streamed as Server-Sent Events.
///
/// Everything kept so far, then live output until the job ends; then one
/// `end` event and the stream closes. Events: `output` (`id:` the chunk's
/// index, from 0; `data:` `{"stream":"stdout"|"stderr","data":"<base64>"}`
/// — the bytes as the command wrote them, in order across both streams);
/// `truncated` (`{"missedFrom","missedTo","reason"}`: chunks this reader
/// asked for that the per-job buffer, 4 MiB, no longer holds); `end`
/// (`data:` the job, as `GET /v1/jobs/{id}`). `Last-Event-ID` resumes after
/// that chunk. After a restart of kici-scaler, a job's output from before
/// it is read back from the state dir, unless the job says `outputLost`.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/logs",
    tag = "jobs",
    params(
        ("id" = String, Path, description = "The job id"),
        ("Last-Event-ID" = Option<u64>, Header, description = "Resume after this chunk index")
    ),
    responses(
        (status = 200, description = "An SSE stream: `output` events, then `end`", content_type = "text/event-stream", body = String),
        (status = 400, description = "Last-Event-ID is not a number", body = ErrorBody),
        (status = 404, description = "Unknown job", body = ErrorBody),
        (status = 422, description = "Not a job id", body = ErrorBody)
    )
)]
pub async fn job_logs(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Sse<KeepAliveStream<BoxStream<'static, Result<Event, Infallible>>>>, ApiError> {
    let id = parse_job("id", &id)?;
    let next = match headers.get("last-event-id") {
        None => 0,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(|last| last.saturating_add(1))
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid-last-event-id",
                    "Last-Event-ID must be a chunk index (a number)",
                )
                .field("Last-Event-ID")
            })?,
    };
    let keep_alive = KeepAlive::new().interval(Duration::from_secs(15));
    if state.jobs.view(&id).is_some() {
        return Ok(
            Sse::new(follow(Arc::clone(&state.jobs), id, next).boxed()).keep_alive(keep_alive)
        );
    }
    let Some(fleet) = state.fleet() else {
        return Err(job_not_found(&id));
    };
    if fleet
        .job_whereabouts(&id)
        .await
        .map_err(fleet_unavailable)?
        .is_none()
    {
        return Err(job_not_found(&id));
    }
    Ok(Sse::new(follow_in_fleet(state, fleet, id, next).boxed()).keep_alive(keep_alive))
}

/// A fleet job's output, wherever it runs: waits while it is queued,
/// relays its host's stream (resuming after the last chunk relayed if
/// that host goes away), or follows it here once this host took it in;
/// its end from the queue when its host can no longer tell.
fn follow_in_fleet(
    state: AppState,
    fleet: crate::fleet::FleetHost,
    id: JobId,
    mut next: u64,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    let (relay, events) = relay(64);
    tokio::spawn(async move {
        loop {
            if state.jobs.view(&id).is_some() {
                relay
                    .pipe(follow(Arc::clone(&state.jobs), id.clone(), next))
                    .await;
                return;
            }
            match relay.unless_left(fleet.job_whereabouts(&id)).await {
                None | Some(Ok(None)) => return,
                Some(Ok(Some(place))) => {
                    if let Some(owner) = &place.owner {
                        let relayed = relay_job_logs(&fleet, owner, &id, &mut next, &relay).await;
                        if relayed == Relayed::Ended {
                            return;
                        }
                    }
                    // Its host cannot tell any more: the end the queue has.
                    if place.view.state.is_terminal() {
                        relay.send(end_event(&place.view)).await;
                        return;
                    }
                }
                Some(Err(e)) => {
                    tracing::debug!(job_id = %id, error = %e, "job logs: reading the fleet failed; retrying")
                }
            }
            if !relay.pause(Duration::from_millis(200)).await {
                return;
            }
        }
    });
    events
}

/// How a relay of a job's log stream from its host stopped.
#[derive(Debug, PartialEq, Eq)]
enum Relayed {
    /// The job's end was relayed (or the reader left): done.
    Ended,
    /// The host did not answer, or its stream broke before the end.
    Broke,
}

/// Relays job `id`'s output from chunk `next` on from `owner`, advancing
/// `next` past every chunk relayed.
async fn relay_job_logs(
    fleet: &crate::fleet::FleetHost,
    owner: &kici_fleet::Owner,
    id: &JobId,
    next: &mut u64,
    relay: &Relay,
) -> Relayed {
    let opened = fleet.job_logs_at(owner, id, next.checked_sub(1));
    let mut logs = match relay.unless_left(opened).await {
        None => return Relayed::Ended,
        Some(Err(_)) => return Relayed::Broke,
        Some(Ok(logs)) => logs,
    };
    loop {
        let event = match relay.unless_left(logs.next()).await {
            None => return Relayed::Ended,
            Some(Some(Ok(event))) => event,
            Some(_) => return Relayed::Broke,
        };
        let relayed = match event {
            kici_api::JobLogEvent::Output { index, output } => {
                *next = index + 1;
                chunk_event(index, &output)
            }
            kici_api::JobLogEvent::Truncated(t) => {
                *next = t.missed_to + 1;
                truncated_event(&t)
            }
            kici_api::JobLogEvent::End(view) => {
                relay.send(end_event(&view)).await;
                return Relayed::Ended;
            }
        };
        if !relay.send(relayed).await {
            return Relayed::Ended;
        }
    }
}

fn end_event(view: &JobView) -> Event {
    Event::default()
        .event("end")
        .json_data(view)
        .unwrap_or_else(|_| Event::default().event("end"))
}

fn truncated_event(t: &Truncated) -> Event {
    Event::default()
        .event("truncated")
        .json_data(t)
        .unwrap_or_else(|_| Event::default().event("truncated"))
}

fn output_event(chunk: &jobs::Chunk) -> Event {
    chunk_event(
        chunk.index,
        &OutputData {
            stream: chunk.stream,
            data: chunk.data.clone(),
        },
    )
}

fn chunk_event(index: u64, data: &OutputData) -> Event {
    Event::default()
        .id(index.to_string())
        .event("output")
        .json_data(data)
        .unwrap_or_else(|_| Event::default().comment("unencodable chunk"))
}

/// The job's output from chunk `next` on, then its end.
fn follow(
    jobs: Arc<JobBook>,
    id: JobId,
    next: u64,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    struct Cursor {
        jobs: Arc<JobBook>,
        id: JobId,
        next: u64,
        queued: VecDeque<Event>,
        done: bool,
    }
    let start = Cursor {
        jobs,
        id,
        next,
        queued: VecDeque::new(),
        done: false,
    };
    stream::unfold(start, |mut c| async move {
        loop {
            if let Some(event) = c.queued.pop_front() {
                return Some((Ok(event), c));
            }
            if c.done {
                return None;
            }
            match c.jobs.read(&c.id, c.next) {
                None => return None,
                Some(Read::Chunks { missed, chunks }) => {
                    if let Some((from, to)) = missed {
                        let data = Truncated {
                            missed_from: from,
                            missed_to: to,
                            reason: format!(
                                "the job wrote more than the {} bytes kept per job; these chunks were dropped",
                                jobs::OUTPUT_CAP_BYTES
                            ),
                        };
                        c.queued.push_back(truncated_event(&data));
                        c.next = to + 1;
                    }
                    for chunk in &chunks {
                        c.queued.push_back(output_event(chunk));
                        c.next = chunk.index + 1;
                    }
                }
                Some(Read::Wait(mut changed)) => {
                    // The book (and this job) may be dropped meanwhile: the
                    // next read says so.
                    let _ = changed.changed().await;
                }
                Some(Read::End(view)) => {
                    c.done = true;
                    c.queued.push_back(end_event(&view));
                }
            }
        }
    })
}
