//! Standalone jobs in a fleet: one queue for them too.
//!
//! `POST /v1/jobs` on any host routes the job, writes it to the fleet's
//! queue (kind `job`) and answers `pending`; the hosts serving its pool
//! claim it like a scale request (FIFO with the pool's scale requests,
//! under the same fleet caps) and the claiming host runs it as on a single
//! host: its [`JobBook`](crate::jobs::JobBook) has the job's state and
//! output from then on. The job's environment is not part of the queued
//! body: it travels as the request's secret, which the database erases
//! when the request finishes.
//!
//! When the job ends, its final view (JSON) is the request's outcome, so
//! any host can show it after its host left. A job whose host is lost
//! while it ran ends `aborted` with one reason wherever it is read
//! ([`jobs::HOST_LOST_WHILE_RUNNING`]; the queue's outcome says `host
//! lost`): whether the leader gave it up after the host's lease expired,
//! the host itself found it aborted by its own restart, or the host, cut
//! off, found it given up when it came back. One whose agent had not
//! registered yet is served again (its command never started).

use super::FleetHost;
use crate::jobs::{self, JobRequest, JobView, SubmitError};
use kici_api::{EndKind, JobBody, JobState};
use kici_fleet::{Claim, FleetError, NewRequest, Owner, RequestKind, RequestState};
use kici_model::JobId;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long a host waits, once a job's agent ended, for the job's own end
/// to be recorded before it finishes the request with what it has.
const JOB_END_WAIT: Duration = Duration::from_secs(5);

/// Where a job of the fleet is, as any host can tell.
#[derive(Debug, Clone)]
pub struct Whereabouts {
    /// The job as the queue shows it: pending until a host took it in,
    /// then what that host knew when it ended.
    pub view: JobView,
    /// The live host other than this one that holds it (or ran it: it may
    /// still have its output), if one does.
    pub owner: Option<Owner>,
}

/// The view of a job that no host has taken in yet.
fn pending_view(job_id: &str, body: &JobBody) -> JobView {
    JobView {
        job_id: job_id.to_owned(),
        state: JobState::Pending,
        labels: body.labels.clone(),
        command: body.command.clone(),
        agent_id: None,
        host: None,
        end: None,
        exit_code: None,
        signal: None,
        reason: None,
        output_bytes: 0,
        dropped_bytes: 0,
        output_lost: false,
    }
}

/// `view`, ended as `state` with `end` and why.
fn ended(mut view: JobView, state: JobState, end: EndKind, reason: String) -> JobView {
    view.state = state;
    view.end = Some(end);
    view.reason = Some(reason);
    view
}

/// A job's final view as its request's outcome (what [`ended_view`] reads
/// back).
pub(super) fn recorded(view: &JobView) -> String {
    // Plain data (strings, numbers, enums): encoding cannot fail.
    serde_json::to_string(view).unwrap_or_default()
}

/// The view of a finished job from its request's outcome: the view its
/// host recorded, or (when the host could not) an end made of the outcome.
fn ended_view(job_id: &str, body: &JobBody, outcome: Option<&str>, host: Option<&str>) -> JobView {
    if let Some(view) = outcome.and_then(|o| serde_json::from_str::<JobView>(o).ok()) {
        return view;
    }
    let mut view = pending_view(job_id, body);
    view.host = host.map(str::to_owned);
    let (state, end, reason) = match outcome {
        Some("cancelled") => (
            JobState::Cancelled,
            EndKind::Cancelled,
            "cancelled before a host took it".to_owned(),
        ),
        Some(kici_fleet::EXPIRED) => (
            JobState::Failed,
            EndKind::Aborted,
            "no capacity within the pending TTL: no host of the fleet took the job in time"
                .to_owned(),
        ),
        Some(kici_fleet::HOST_LOST) => (
            JobState::Failed,
            EndKind::Aborted,
            jobs::HOST_LOST_WHILE_RUNNING.to_owned(),
        ),
        Some(other) => (JobState::Failed, EndKind::Aborted, other.to_owned()),
        None => (JobState::Failed, EndKind::Aborted, "ended".to_owned()),
    };
    ended(view, state, end, reason)
}

/// A queued body, read back; a body this binary cannot read is shown
/// without labels and command rather than failing the read.
fn queued_body(raw: &str) -> JobBody {
    serde_json::from_str(raw).unwrap_or_default()
}

impl FleetHost {
    /// A job submitted to this host: routed with the local configuration
    /// (no pool → `no-backend`, can never fit → `too-large`, nothing
    /// queued), written to the fleet's queue (committed before the
    /// answer), and answered `pending`. `body` is the job as submitted
    /// (its environment travels apart, as the request's secret).
    pub async fn enter_job(
        &self,
        body: &JobBody,
        request: &JobRequest,
    ) -> Result<JobView, SubmitError> {
        let inner = &self.0;
        let job = request.spec.job_id().clone();
        let routing = request.scale_request();
        let (pool, resources) = match inner.runtime.call(|e, _| e.classify(&routing)) {
            Ok(route) => route,
            Err(outcome) => {
                return Err(SubmitError::refusal(outcome)
                    .unwrap_or_else(|| SubmitError::Store("routing gave no route".to_owned())))
            }
        };
        let queued = JobBody {
            labels: request.labels.iter().map(|l| l.to_string()).collect(),
            env: None,
            ..body.clone()
        };
        let secret = body
            .env
            .as_ref()
            .filter(|env| !env.is_empty())
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| SubmitError::Store(e.to_string()))?;
        let new = NewRequest {
            job_id: job.to_string(),
            kind: RequestKind::Job,
            pool: pool.as_str().to_owned(),
            body: serde_json::to_string(&queued).map_err(|e| SubmitError::Store(e.to_string()))?,
            answer: String::new(),
            cpu: resources.requests.cpu,
            memory: resources.requests.memory,
            entry_host: inner.instance.to_string(),
            secret,
        };
        inner
            .queue
            .enqueue(&new)
            .await
            .map_err(|e| SubmitError::Store(e.to_string()))?;
        if self.serves(pool.as_str()) {
            inner.wake.notify_one();
        }
        tracing::info!(job_id = %job, pool = %pool, "job queued for the fleet");
        Ok(pending_view(job.as_str(), &queued))
    }

    /// Runs a claimed job here, or gives it back: no capacity now → back
    /// to the queue at its place; refused for good → finished with why.
    pub(super) async fn serve_job(&self, claim: Claim) {
        let inner = &self.0;
        let request = match job_request(&claim) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(job_id = %claim.job_id, error = %e, "fleet: a claimed job is unreadable here; given back");
                self.give_back(&claim, "error").await;
                return;
            }
        };
        let job = request.spec.job_id().clone();
        inner.claimed.lock().insert(job.clone(), claim.clone());
        match jobs::submit_now(&inner.runtime, &inner.jobs, request).await {
            Ok(Some((agent_id, warm))) => {
                inner.bound.lock().insert(agent_id, job.clone());
                inner.metrics.fleet_claim("started");
                if warm {
                    self.bind_warm(&job, agent_id).await;
                }
            }
            Ok(None) => {
                inner.claimed.lock().remove(&job);
                inner.busy.lock().insert(claim.pool.clone(), Instant::now());
                self.give_back(&claim, "released").await;
            }
            Err(SubmitError::Store(e)) => {
                inner.claimed.lock().remove(&job);
                tracing::warn!(job_id = %job, error = %e, "fleet: the job could not be recorded here; given back");
                self.give_back(&claim, "error").await;
            }
            Err(refusal) => {
                inner.claimed.lock().remove(&job);
                inner.metrics.fleet_claim("refused");
                let view = ended(
                    pending_view(&claim.job_id, &queued_body(&claim.body)),
                    JobState::Failed,
                    EndKind::Aborted,
                    refusal.to_string(),
                );
                let outcome = recorded(&view);
                if let Err(e) = inner
                    .queue
                    .complete(&claim.instance, &claim.job_id, &outcome)
                    .await
                {
                    tracing::warn!(job_id = %job, error = %e, "fleet: finishing a refused job failed");
                }
            }
        }
    }

    /// What a request's outcome is when its agent ended: for a job, the
    /// job's final view (once recorded); else `fallback`.
    pub(super) async fn outcome_of(&self, job: &JobId, fallback: &str) -> String {
        match self.0.jobs.wait_end(job, JOB_END_WAIT).await {
            Some(view) => recorded(&view),
            None => fallback.to_owned(),
        }
    }

    /// The outcome of job `job_id` if this host's book shows it ended.
    pub(super) fn ended_here(&self, job_id: &str) -> Option<String> {
        let job = job_id.parse::<JobId>().ok()?;
        let view = self.0.jobs.view(&job)?;
        view.state.is_terminal().then(|| recorded(&view))
    }

    /// Where job `id` is in the fleet (`None`: not a job of this fleet, or
    /// purged). For a job this host runs, ask its book instead.
    pub async fn job_whereabouts(&self, id: &JobId) -> Result<Option<Whereabouts>, FleetError> {
        let Some(request) = self.0.queue.lookup(id.as_str()).await? else {
            return Ok(None);
        };
        if request.kind != RequestKind::Job {
            return Ok(None);
        }
        let body = queued_body(&request.body);
        let me = self.0.instance.to_string();
        let view = match request.state {
            RequestState::Finished => ended_view(
                id.as_str(),
                &body,
                request.outcome.as_deref(),
                request.host.as_deref(),
            ),
            _ => pending_view(id.as_str(), &body),
        };
        let owner = match request.state {
            RequestState::Claimed | RequestState::Started | RequestState::Finished
                if request.host.as_ref() != Some(&me) =>
            {
                self.0.queue.job_owner(id.as_str()).await?
            }
            _ => None,
        };
        Ok(Some(Whereabouts { view, owner }))
    }

    /// Cancels a job still waiting in the fleet's queue; its final view,
    /// or `None` when it is not waiting there (a host holds it, or it
    /// ended).
    pub async fn cancel_queued_job(&self, id: &JobId) -> Result<Option<JobView>, FleetError> {
        if !self.0.queue.cancel_queued(id.as_str()).await? {
            return Ok(None);
        }
        tracing::info!(job_id = %id, "queued job cancelled");
        Ok(self.job_whereabouts(id).await?.map(|w| w.view))
    }
}

/// The job a claim carries: its queued body, its environment from the
/// claim's secret, its id from the claim.
fn job_request(claim: &Claim) -> Result<JobRequest, String> {
    let mut body: JobBody = serde_json::from_str(&claim.body).map_err(|e| e.to_string())?;
    if let Some(secret) = &claim.secret {
        let env: BTreeMap<String, String> =
            serde_json::from_str(secret).map_err(|e| format!("environment: {e}"))?;
        body.env = Some(env);
    }
    let id: JobId = claim.job_id.parse().map_err(|e| format!("job id: {e}"))?;
    crate::service::requests::job_request(body, id).map_err(|e| e.message)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn body() -> JobBody {
        JobBody {
            labels: vec!["linux".into()],
            command: vec!["true".into()],
            ..JobBody::default()
        }
    }

    #[test]
    fn a_finished_job_shows_its_recorded_view_or_an_end_made_of_the_outcome() {
        let mut recorded = pending_view("job-1", &body());
        recorded.state = JobState::Succeeded;
        recorded.end = Some(EndKind::Exited);
        recorded.exit_code = Some(0);
        let json = serde_json::to_string(&recorded).unwrap();
        assert_eq!(ended_view("job-1", &body(), Some(&json), None), recorded);

        let lost = ended_view("job-1", &body(), Some(kici_fleet::HOST_LOST), Some("h1"));
        assert_eq!(lost.host.as_deref(), Some("h1"));
        assert_eq!(
            (lost.state, lost.end),
            (JobState::Failed, Some(EndKind::Aborted))
        );
        assert_eq!(lost.reason.as_deref(), Some(jobs::HOST_LOST_WHILE_RUNNING));
        assert_eq!(lost.command, ["true"]);

        let cancelled = ended_view("job-1", &body(), Some("cancelled"), None);
        assert_eq!(
            (cancelled.state, cancelled.end),
            (JobState::Cancelled, Some(EndKind::Cancelled))
        );
    }
}
