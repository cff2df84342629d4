//! Standalone jobs (docs/deviations.md, D-standalone-mode): `POST /v1/jobs`,
//! `GET /v1/jobs/{id}`, `GET /v1/jobs/{id}/logs`, `DELETE /v1/jobs/{id}`.
//!
//! kici-scaler is the dispatcher here: it provisions an agent for the job,
//! sends it the command over the agent gateway, collects its output and
//! exit, and destroys the agent when the job ends (see [`crate::jobs`]).
//! These routes join the control API through [`super::router_with`].

use super::error::{scale_error, ApiError, ApiJson, ErrorBody};
use super::wire::{parse_job, parse_labels, IntoResourceRequest};
use super::AppState;
use crate::jobs::{self, JobBook, JobRequest, JobView, Read, SubmitError};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::Json;
use futures_util::stream::{self, Stream};
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
        .routes(routes!(submit_job))
        .routes(routes!(get_job, cancel_job))
        .routes(routes!(job_logs))
}

pub use kici_api::{JobAccepted, JobBody};

/// A job body parsed into the book's request; every problem names its
/// field.
trait IntoJobRequest {
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
    let request = body.into_request(JobBook::mint_id())?;
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
    state
        .jobs
        .view(&id)
        .map(Json)
        .ok_or_else(|| job_not_found(&id))
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
    let view = jobs::cancel(
        &state.runtime,
        &state.jobs,
        &id,
        "cancelled through the API",
    )
    .ok_or_else(|| job_not_found(&id))?;
    Ok((
        StatusCode::ACCEPTED,
        Json(JobAccepted {
            job_id: view.job_id,
            state: view.state,
        }),
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
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
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
    if state.jobs.view(&id).is_none() {
        return Err(job_not_found(&id));
    }
    Ok(Sse::new(follow(Arc::clone(&state.jobs), id, next))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

fn output_event(chunk: &jobs::Chunk) -> Event {
    let data = OutputData {
        stream: chunk.stream,
        data: chunk.data.clone(),
    };
    Event::default()
        .id(chunk.index.to_string())
        .event("output")
        .json_data(&data)
        .unwrap_or_else(|_| Event::default().comment("unencodable chunk"))
}

/// The job's output from chunk `next` on, then its end.
fn follow(
    jobs: Arc<JobBook>,
    id: JobId,
    next: u64,
) -> impl Stream<Item = Result<Event, Infallible>> {
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
                        c.queued.push_back(
                            Event::default()
                                .event("truncated")
                                .json_data(&data)
                                .unwrap_or_else(|_| Event::default().event("truncated")),
                        );
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
                    c.queued.push_back(
                        Event::default()
                            .event("end")
                            .json_data(&*view)
                            .unwrap_or_else(|_| Event::default().event("end")),
                    );
                }
            }
        }
    })
}
