//! A daemon on its own: every operation answered by this process's engine,
//! job book and event log.

use super::requests;
use super::EventStream;
use crate::api::error::{agent_error, scale_error, ApiError, ErrorCode};
use crate::api::wire::{status_object, IntoApi};
use crate::durable::persist::pending_committed;
use crate::events::EventLog;
use crate::gateway::enrolment::{Enrolment, Via};
use crate::gateway::token::TokenStore;
use crate::jobs::{self, JobBook};
use axum::http::StatusCode;
use futures_util::StreamExt;
use kici_api::{
    AgentList, AgentObject, JobAccepted, JobBody, JobCompleteBody, JobStartedBody, JobView,
    RegisteredBody, RegistrationAnswer, ScaleAnswer, ScaleBody, StatusObject,
};
use kici_engine::runtime::Runtime;
use kici_engine::{AgentError, AgentState};
use kici_model::{AgentId, InstanceId, JobId};
use kici_store::StateStore;
use std::sync::Arc;

/// What a cancelled job's reason says.
pub(crate) const CANCELLED: &str = "cancelled through the API";

/// This process's engine, jobs, events and state store. Cheap to clone.
#[derive(Clone)]
pub struct Local {
    pub(crate) runtime: Runtime,
    pub(crate) instance: InstanceId,
    pub(crate) tokens: Arc<TokenStore>,
    pub(crate) events: Arc<EventLog>,
    pub(crate) jobs: Arc<JobBook>,
    /// The durable state store (`None` in `run` and in tests without one);
    /// set once the daemon opened it.
    store: Arc<parking_lot::RwLock<Option<Arc<dyn StateStore>>>>,
}

impl Local {
    pub fn new(
        runtime: Runtime,
        instance: InstanceId,
        tokens: Arc<TokenStore>,
        events: Arc<EventLog>,
        jobs: Arc<JobBook>,
    ) -> Self {
        Self {
            runtime,
            instance,
            tokens,
            events,
            jobs,
            store: Arc::default(),
        }
    }

    /// The state store every new scale request must be able to reach.
    pub fn set_store(&self, store: Arc<dyn StateStore>) {
        *self.store.write() = Some(store);
    }

    /// Checks that the state store answers (bounded by its pool's acquire
    /// timeout, 1 s by default; a read, nothing is written).
    pub async fn store_reachable(&self) -> Result<(), ApiError> {
        let store = self.store.read().clone();
        match store {
            None => Ok(()),
            Some(store) => store.reachable().await.map_err(|e| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorCode::StoreUnavailable,
                    e.to_string(),
                )
            }),
        }
    }

    /// The agent lifecycle policy the agent reports go through.
    pub fn enrolment(&self) -> Enrolment {
        Enrolment::new(self.runtime.clone(), Arc::clone(&self.tokens))
    }

    /// Whether this host holds `agent` (live or remembered gone).
    pub(crate) fn knows_agent(&self, agent: AgentId) -> bool {
        self.runtime.agent(agent).is_some()
    }

    /// Whether this host holds job `job` (a standalone job in its book, or
    /// a scale request its engine knows).
    pub(crate) fn knows_job(&self, job: &JobId) -> bool {
        self.jobs.view(job).is_some() || self.runtime.call(|e, _| e.job_outcome(job)).is_some()
    }

    // ------------------------------------------------------------- scale

    pub(super) async fn scale(&self, body: ScaleBody) -> Result<ScaleAnswer, ApiError> {
        let request = requests::scale_request(body)?;
        let job = request.job.clone();
        // A read: nothing starts while the store cannot record it.
        self.store_reachable().await?;
        let (outcome, recorded) = self.runtime.request_scale_recorded(request);
        // A request that waits is answered once its record (the engine's
        // journal) is committed: a crash must not forget what was
        // acknowledged.
        pending_committed(&self.runtime, &job, recorded)
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorCode::StoreUnavailable,
                    error_text(&e),
                )
            })?;
        let outcome = outcome.map_err(scale_error)?;
        tracing::info!(job_id = %job, result = ?outcome, "scale request");
        Ok(outcome.into_api())
    }

    pub(super) fn cancel_scale(&self, job: &JobId) -> Result<(), ApiError> {
        let cancelled = self.runtime.cancel_scale(job);
        tracing::info!(job_id = %job, cancelled, "scale request cancelled");
        Ok(())
    }

    // -------------------------------------------------------------- jobs

    pub(super) async fn submit_job(&self, body: JobBody) -> Result<JobAccepted, ApiError> {
        let request = requests::job_request(body, JobBook::mint_id())?;
        // A durable book commits the job's record before anything starts:
        // that write is the store's check.
        if !self.jobs.is_durable() {
            self.store_reachable().await?;
        }
        let view = jobs::submit_recorded(&self.runtime, &self.jobs, request)
            .await
            .map_err(crate::api::jobs::submit_error)?;
        Ok(accepted(view))
    }

    pub(super) fn job(&self, id: &JobId) -> Result<JobView, ApiError> {
        self.jobs
            .view(id)
            .ok_or_else(|| crate::api::jobs::job_not_found(id))
    }

    pub(super) fn cancel_job(&self, id: &JobId) -> Result<JobAccepted, ApiError> {
        jobs::cancel(&self.runtime, &self.jobs, id, CANCELLED)
            .map(accepted)
            .ok_or_else(|| crate::api::jobs::job_not_found(id))
    }

    /// The output of a job this host holds; `None` when it holds none.
    pub(crate) fn job_logs_here(&self, id: &JobId, next: u64) -> Option<EventStream> {
        self.jobs
            .view(id)
            .map(|_| crate::api::jobs::follow(Arc::clone(&self.jobs), id.clone(), next).boxed())
    }

    pub(super) fn job_logs(&self, id: JobId, next: u64) -> Result<EventStream, ApiError> {
        self.job_logs_here(&id, next)
            .ok_or_else(|| crate::api::jobs::job_not_found(&id))
    }

    // ------------------------------------------------------------ agents

    /// This host's agents, oldest first.
    pub(crate) fn agents(&self, all: bool) -> AgentList {
        AgentList {
            agents: self
                .runtime
                .agents(all)
                .into_iter()
                .map(IntoApi::into_api)
                .collect(),
            unreachable_hosts: Vec::new(),
        }
    }

    pub(crate) fn agent(&self, agent: AgentId) -> Result<AgentObject, ApiError> {
        let view = self
            .runtime
            .agent(agent)
            .ok_or_else(|| ApiError::agent_not_found(agent))?;
        Ok(view.into_api())
    }

    pub(crate) fn destroy_agent(&self, agent: AgentId) -> Result<(), ApiError> {
        match self.runtime.destroy_agent(agent) {
            Ok(()) | Err(AgentError::Gone(_)) => {
                tracing::info!(agent_id = %agent, "agent destroy requested by the operator");
                Ok(())
            }
            Err(e) => Err(agent_error(e)),
        }
    }

    pub(crate) async fn registered(
        &self,
        agent: AgentId,
        body: RegisteredBody,
    ) -> Result<RegistrationAnswer, ApiError> {
        use crate::api::agents::refusal_error;
        let enrolment = self.enrolment();
        enrolment
            .verify(agent, &body.token)
            .map_err(refusal_error)?;
        let registration = enrolment
            .register(agent, Via::Orchestrator)
            .await
            .map_err(refusal_error)?;
        Ok(RegistrationAnswer {
            bound_job_id: registration.bound_job_id.map(|j| j.to_string()),
            mandatory_labels: registration
                .mandatory_labels
                .iter()
                .map(|l| l.to_string())
                .collect(),
        })
    }

    pub(crate) async fn config_ack(&self, agent: AgentId) -> Result<(), ApiError> {
        if self.runtime.agent(agent).is_none() {
            return Err(ApiError::agent_not_found(agent));
        }
        // Firecracker clears (and verifies) the MMDS here: the orchestrator
        // must not dispatch before this answers 204.
        self.enrolment()
            .configured(agent, Via::Orchestrator)
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ErrorCode::BootstrapNotCleared,
                    e.source.to_string(),
                )
            })
    }

    pub(crate) fn job_started(
        &self,
        agent: AgentId,
        body: &JobStartedBody,
    ) -> Result<(), ApiError> {
        let job = crate::api::wire::parse_job("jobId", &body.job_id)?;
        match self.runtime.job_started(agent, job.clone()) {
            Ok(()) => {
                tracing::info!(agent_id = %agent, job_id = %job, "job started");
                Ok(())
            }
            Err(AgentError::NotOurs(_)) if self.is_gone(agent) => {
                Err(agent_error(AgentError::Gone(agent)))
            }
            Err(e) => Err(agent_error(e)),
        }
    }

    pub(crate) fn job_complete(
        &self,
        agent: AgentId,
        body: &JobCompleteBody,
    ) -> Result<(), ApiError> {
        let job = crate::api::wire::parse_job("jobId", &body.job_id)?;
        match self.runtime.job_completed(agent, &job, body.exit_code) {
            Ok(()) => {
                tracing::info!(agent_id = %agent, job_id = %job, exit_code = body.exit_code, "job complete");
                Ok(())
            }
            Err(AgentError::NotOurs(_) | AgentError::Gone(_)) if self.is_gone(agent) => Ok(()),
            Err(e) => Err(agent_error(e)),
        }
    }

    pub(crate) fn disconnected(&self, agent: AgentId) -> Result<(), ApiError> {
        self.enrolment()
            .disconnected(agent, Via::Orchestrator)
            .map_err(agent_error)
    }

    /// Whether the engine remembers `agent` as gone.
    fn is_gone(&self, agent: AgentId) -> bool {
        self.runtime
            .agent(agent)
            .is_some_and(|v| v.state == AgentState::Gone)
    }

    // -------------------------------------------------------- operations

    pub(crate) fn status(&self) -> StatusObject {
        status_object(self.instance, &self.runtime.status())
    }

    pub(super) fn events_from_now(&self) -> EventStream {
        crate::api::stream::follow(Arc::clone(&self.events), self.events.newest_id(), None).boxed()
    }
}

/// `GET /v1/fleet` on a daemon that is in no fleet.
pub(super) fn not_a_fleet() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ErrorCode::NotAFleet,
        "this daemon is not in a fleet: a fleet is the daemons sharing one PostgreSQL state store (--state postgres://…)",
    )
}

/// The answer to a job accepted (or cancelled): its id and state.
pub(crate) fn accepted(view: JobView) -> JobAccepted {
    JobAccepted {
        job_id: view.job_id,
        state: view.state,
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
