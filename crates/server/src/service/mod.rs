//! What the control API's handlers ask of this daemon, answered alone or as
//! one host of a fleet — chosen once, at start-up, when the daemon builds
//! its API state (and, with a PostgreSQL state store, has joined its
//! fleet). The handlers parse the request, call the [`Service`] and shape
//! the answer; none of them asks whether the daemon is in a fleet.
//!
//! - [`local`]: a daemon on its own — the engine, the job book and the
//!   event log of this process.
//! - [`fleet`]: a host of a fleet — requests enter the fleet's queue, reads
//!   gather every live host's part, and a call about one agent or one
//!   request that another host owns is carried there with the typed client
//!   (signed with the fleet key) and answered as the owner answered; what
//!   this host holds itself is answered by the local part.
//! - [`requests`]: request bodies into the engine's requests, and a scale
//!   request's body as the fleet's queue stores it — one conversion for the
//!   HTTP entry and a fleet host's claim.
//!
//! **An enum, not a trait.** There are exactly two ways to serve, both
//! known here, and the fleet way is the local way plus the fleet (it holds
//! a [`Local`] and falls back to it for what this host holds). A closed
//! enum keeps that visible: each operation is one `match` with both arms
//! side by side, the compiler checks that a new operation serves both, the
//! async operations (several return streams) need no boxed futures or
//! `async_trait`, and nothing outside this crate plugs in a third way.
//!
//! Errors are the control API's [`ApiError`]: status, stable code, message
//! and field, the shape every answer takes — also an answer a fleet peer
//! gave, relayed as it gave it.

pub mod fleet;
pub mod local;
pub mod requests;

use crate::api::error::ApiError;
use axum::response::sse::Event;
use futures_util::stream::BoxStream;
use kici_api::{
    AgentList, AgentObject, FleetObject, JobAccepted, JobBody, JobCompleteBody, JobStartedBody,
    JobView, RegisteredBody, RegistrationAnswer, ScaleAnswer, ScaleBody, StatusObject,
};
use kici_model::{AgentId, JobId};
use std::convert::Infallible;

pub use fleet::Fleet;
pub use local::Local;

/// A stream of Server-Sent Events (job output, engine events).
pub type EventStream = BoxStream<'static, Result<Event, Infallible>>;

/// This daemon's way of serving the control API. Cheap to clone.
#[derive(Clone)]
pub enum Service {
    /// On its own.
    Local(Local),
    /// As one host of a fleet.
    Fleet(Fleet),
}

impl Service {
    /// The local part: this process's engine, jobs, events and store.
    pub fn local(&self) -> &Local {
        match self {
            Self::Local(l) => l,
            Self::Fleet(f) => f.local(),
        }
    }

    /// Checks that the state store answers (a read): a request it could
    /// not record must not start anything.
    pub async fn store_reachable(&self) -> Result<(), ApiError> {
        self.local().store_reachable().await
    }

    // ------------------------------------------------------------- scale

    /// `POST /v1/scale`.
    pub async fn scale(&self, body: ScaleBody) -> Result<ScaleAnswer, ApiError> {
        match self {
            Self::Local(l) => l.scale(body).await,
            Self::Fleet(f) => f.scale(body).await,
        }
    }

    /// `DELETE /v1/scale/{jobId}`.
    pub async fn cancel_scale(&self, job: &JobId) -> Result<(), ApiError> {
        match self {
            Self::Local(l) => l.cancel_scale(job),
            Self::Fleet(f) => f.cancel_scale(job).await,
        }
    }

    // -------------------------------------------------------------- jobs

    /// `POST /v1/jobs`.
    pub async fn submit_job(&self, body: JobBody) -> Result<JobAccepted, ApiError> {
        match self {
            Self::Local(l) => l.submit_job(body).await,
            Self::Fleet(f) => f.submit_job(body).await,
        }
    }

    /// `GET /v1/jobs/{id}`.
    pub async fn job(&self, id: &JobId) -> Result<JobView, ApiError> {
        match self {
            Self::Local(l) => l.job(id),
            Self::Fleet(f) => f.job(id).await,
        }
    }

    /// `DELETE /v1/jobs/{id}`.
    pub async fn cancel_job(&self, id: &JobId) -> Result<JobAccepted, ApiError> {
        match self {
            Self::Local(l) => l.cancel_job(id),
            Self::Fleet(f) => f.cancel_job(id).await,
        }
    }

    /// `GET /v1/jobs/{id}/logs`: the job's output from chunk `next` on.
    pub async fn job_logs(&self, id: JobId, next: u64) -> Result<EventStream, ApiError> {
        match self {
            Self::Local(l) => l.job_logs(id, next),
            Self::Fleet(f) => f.job_logs(id, next).await,
        }
    }

    // ------------------------------------------------------------ agents

    /// `GET /v1/agents` (`all`: also the recently gone; `local`: in a
    /// fleet, this host's only).
    pub async fn agents(&self, all: bool, local: bool) -> AgentList {
        match self {
            Self::Local(l) => l.agents(all),
            Self::Fleet(f) => f.agents(all, local).await,
        }
    }

    /// `GET /v1/agents/{id}`.
    pub async fn agent(&self, agent: AgentId) -> Result<AgentObject, ApiError> {
        match self {
            Self::Local(l) => l.agent(agent),
            Self::Fleet(f) => f.agent(agent).await,
        }
    }

    /// `DELETE /v1/agents/{id}`.
    pub async fn destroy_agent(&self, agent: AgentId) -> Result<(), ApiError> {
        match self {
            Self::Local(l) => l.destroy_agent(agent),
            Self::Fleet(f) => f.destroy_agent(agent).await,
        }
    }

    /// `POST /v1/agents/{id}/registered`.
    pub async fn registered(
        &self,
        agent: AgentId,
        body: RegisteredBody,
    ) -> Result<RegistrationAnswer, ApiError> {
        match self {
            Self::Local(l) => l.registered(agent, body).await,
            Self::Fleet(f) => f.registered(agent, body).await,
        }
    }

    /// `POST /v1/agents/{id}/config-ack`.
    pub async fn config_ack(&self, agent: AgentId) -> Result<(), ApiError> {
        match self {
            Self::Local(l) => l.config_ack(agent).await,
            Self::Fleet(f) => f.config_ack(agent).await,
        }
    }

    /// `POST /v1/agents/{id}/job-started`.
    pub async fn job_started(&self, agent: AgentId, body: JobStartedBody) -> Result<(), ApiError> {
        match self {
            Self::Local(l) => l.job_started(agent, &body),
            Self::Fleet(f) => f.job_started(agent, body).await,
        }
    }

    /// `POST /v1/agents/{id}/job-complete`.
    pub async fn job_complete(
        &self,
        agent: AgentId,
        body: JobCompleteBody,
    ) -> Result<(), ApiError> {
        match self {
            Self::Local(l) => l.job_complete(agent, &body),
            Self::Fleet(f) => f.job_complete(agent, body).await,
        }
    }

    /// `POST /v1/agents/{id}/disconnected`.
    pub async fn disconnected(&self, agent: AgentId) -> Result<(), ApiError> {
        match self {
            Self::Local(l) => l.disconnected(agent),
            Self::Fleet(f) => f.disconnected(agent).await,
        }
    }

    // -------------------------------------------------------- operations

    /// `GET /v1/status` (`local`: in a fleet, this host's only).
    pub async fn status(&self, local: bool) -> StatusObject {
        match self {
            Self::Local(l) => l.status(),
            Self::Fleet(f) => f.status(local).await,
        }
    }

    /// `GET /v1/events` without `Last-Event-ID`: the events from now on —
    /// in a fleet, every live host's.
    pub fn events_from_now(&self) -> EventStream {
        match self {
            Self::Local(l) => l.events_from_now(),
            Self::Fleet(f) => f.events_from_now(),
        }
    }

    /// `GET /v1/fleet`: 404 `not-a-fleet` on its own.
    pub async fn fleet_view(&self) -> Result<FleetObject, ApiError> {
        match self {
            Self::Local(_) => Err(local::not_a_fleet()),
            Self::Fleet(f) => f.view().await,
        }
    }

    /// How this daemon checks a call signed by a fleet peer: refused (with
    /// why) when it is in no fleet.
    pub fn peer_auth(&self) -> Result<&crate::fleet::auth::PeerAuth, &'static str> {
        match self {
            Self::Local(_) => Err("a fleet signature, but this host is in no fleet"),
            Self::Fleet(f) => Ok(f.host().auth()),
        }
    }
}
