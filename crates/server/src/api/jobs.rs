//! Standalone jobs (docs/deviations.md, D-standalone-mode): `POST /v1/jobs`,
//! `GET /v1/jobs/{id}`, `GET /v1/jobs/{id}/logs`, `DELETE /v1/jobs/{id}`.
//!
//! kici-scaler is the dispatcher here: it provisions an agent for the job,
//! sends it the command over the agent gateway, collects its output and
//! exit, and destroys the agent when the job ends (see [`crate::jobs`]).
//! These routes join the control API through [`super::router_with`].

use super::error::{scale_error, ApiError, ApiJson, ErrorBody};
use super::wire::parse_job;
use super::AppState;
use crate::jobs::{self, JobBook, JobView, Read, SubmitError};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, KeepAliveStream, Sse};
use axum::Json;
use futures_util::stream::{self, BoxStream, Stream};
use kici_api::{OutputData, Truncated};
use kici_model::JobId;
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

pub(crate) fn submit_error(e: SubmitError) -> ApiError {
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

pub(crate) fn job_not_found(id: &JobId) -> ApiError {
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
    Ok((
        StatusCode::ACCEPTED,
        Json(state.service().submit_job(body).await?),
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
    Ok(Json(state.service().job(&id).await?))
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
    Ok((
        StatusCode::ACCEPTED,
        Json(state.service().cancel_job(&id).await?),
    ))
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
    Ok(Sse::new(state.service().job_logs(id, next).await?).keep_alive(keep_alive))
}

pub(crate) fn end_event(view: &JobView) -> Event {
    Event::default()
        .event("end")
        .json_data(view)
        .unwrap_or_else(|_| Event::default().event("end"))
}

pub(crate) fn truncated_event(t: &Truncated) -> Event {
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

pub(crate) fn chunk_event(index: u64, data: &OutputData) -> Event {
    Event::default()
        .id(index.to_string())
        .event("output")
        .json_data(data)
        .unwrap_or_else(|_| Event::default().comment("unencodable chunk"))
}

/// The job's output from chunk `next` on, then its end.
pub(crate) fn follow(
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
