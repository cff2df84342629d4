//! A host of a fleet: requests enter the fleet's queue, reads gather every
//! live host's part, and a call about one agent or one request is answered
//! where it lives — here when this host holds it, else on the live host
//! that owns it, called with the typed client and signed with the fleet key
//! (see [`crate::fleet::peer`]), else from the queue. The coordination
//! itself is [`FleetHost`]'s.
//!
//! A call is carried to another host only when this host does not know the
//! agent or job and the database names another live host as its owner, so
//! a carried call never bounces: the owner knows it, or answers 404 and
//! this host answers from what it has.

use super::local::{accepted, Local};
use super::requests::{self, StoredScale};
use super::EventStream;
use crate::api::error::{ApiError, ErrorCode};
use crate::api::relay::{relay, Relay};
use crate::api::wire::IntoApi;
use crate::fleet::peer::{PeerError, PEER_CALL_TIMEOUT};
use crate::fleet::{EntryError, FleetHost};
use axum::http::StatusCode;
use axum::response::sse::Event;
use futures_util::StreamExt;
use kici_api::{
    AgentList, AgentObject, FleetObject, JobAccepted, JobBody, JobCompleteBody, JobStartedBody,
    JobView, Owned, RegisteredBody, RegistrationAnswer, ScaleAnswer, ScaleBody, StatusObject,
    StreamEvent, RESET_EVENT,
};
use kici_model::{AgentId, JobId};
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// How long a cancel waits for a job that is between the queue and a host
/// (claimed, not yet taken in) to land somewhere it can be cancelled.
const CANCEL_SETTLE: Duration = Duration::from_secs(5);

/// How often the fleet-wide event stream looks for hosts it does not
/// follow yet (joined since, or whose stream broke).
const FLEET_STREAM_REFRESH: Duration = Duration::from_secs(2);

/// This host's local part and its place in the fleet. Cheap to clone.
#[derive(Clone)]
pub struct Fleet {
    local: Local,
    host: FleetHost,
}

impl Fleet {
    pub fn new(local: Local, host: FleetHost) -> Self {
        Self { local, host }
    }

    pub fn local(&self) -> &Local {
        &self.local
    }

    pub fn host(&self) -> &FleetHost {
        &self.host
    }

    /// Carries a call about `what` (`id`) to the live host that owns it —
    /// when this host does not know it and another host does: `Some` of
    /// its answer. `None`: answer here (no other owner, or the owner does
    /// not know it — not yet, or no longer). An error answer of the owner
    /// is relayed as it gave it; an owner that cannot be reached is 502
    /// `peer-unavailable`.
    async fn at_owner<T, F, Fut>(
        &self,
        what: Owned,
        id: &str,
        call: F,
    ) -> Result<Option<T>, ApiError>
    where
        F: FnOnce(kici_api::Client) -> Fut,
        Fut: Future<Output = Result<T, kici_api::ApiError>>,
    {
        let known_here = match what {
            Owned::Agent => id
                .parse::<AgentId>()
                .is_ok_and(|a| self.local.knows_agent(a)),
            Owned::Job => id.parse::<JobId>().is_ok_and(|j| self.local.knows_job(&j)),
        };
        if known_here {
            return Ok(None);
        }
        let Some(owner) = self.host.owner_of(what, id).await.map_err(peer_error)? else {
            return Ok(None);
        };
        let answer = tokio::time::timeout(PEER_CALL_TIMEOUT, call(owner.client.clone()))
            .await
            .map_err(|_| {
                peer_error(owner.unreachable(format!("no answer within {PEER_CALL_TIMEOUT:?}")))
            })?;
        tracing::debug!(owner = %owner.instance, ?what, id, ok = answer.is_ok(), "fleet: call carried to the owner");
        match answer {
            Ok(answer) => Ok(Some(answer)),
            Err(kici_api::ApiError::Api(refused)) if refused.status == 404 => Ok(None),
            Err(kici_api::ApiError::Api(refused)) => Err(relayed(*refused)),
            Err(e) => Err(peer_error(owner.unreachable(e.to_string()))),
        }
    }

    // ------------------------------------------------------------- scale

    /// In a fleet the shared queue records the request (committed before
    /// this answer) and whichever host serves its pool takes it.
    pub(super) async fn scale(&self, body: ScaleBody) -> Result<ScaleAnswer, ApiError> {
        let request = requests::scale_request(body.clone())?;
        let job = request.job.clone();
        // A read: nothing starts while the store cannot record it.
        self.local.store_reachable().await?;
        let (outcome, serving) = self
            .host
            .enter_scale(&StoredScale(body), request)
            .await
            .map_err(entry_error)?;
        tracing::info!(job_id = %job, result = ?outcome, "scale request (fleet)");
        let mut answer: ScaleAnswer = outcome.into_api();
        if let ScaleAnswer::Spawning { hosts, .. } | ScaleAnswer::Pending { hosts, .. } =
            &mut answer
        {
            *hosts = serving;
        }
        Ok(answer)
    }

    /// Cancelled on the host that holds it, or wherever this host can reach
    /// it: in the queue, or here.
    pub(super) async fn cancel_scale(&self, job: &JobId) -> Result<(), ApiError> {
        let carried = self
            .at_owner(Owned::Job, job.as_str(), |c| async move {
                c.cancel_scale(job.as_str()).await
            })
            .await?;
        if carried.is_none() {
            let cancelled = self.host.cancel_scale(job).await.map_err(entry_error)?;
            tracing::info!(job_id = %job, cancelled, "scale request cancelled");
        }
        Ok(())
    }

    // -------------------------------------------------------------- jobs

    /// In a fleet the shared queue records the job (committed before the
    /// answer); a host serving its pool claims and runs it.
    pub(super) async fn submit_job(&self, body: JobBody) -> Result<JobAccepted, ApiError> {
        let request = requests::job_request(body.clone(), crate::jobs::JobBook::mint_id())?;
        let view = self
            .host
            .enter_job(&body, &request)
            .await
            .map_err(crate::api::jobs::submit_error)?;
        Ok(accepted(view))
    }

    /// Here, on the live host that holds it, or from the queue.
    pub(super) async fn job(&self, id: &JobId) -> Result<JobView, ApiError> {
        if let Some(view) = self.local.jobs.view(id) {
            return Ok(view);
        }
        if let Some(view) = self
            .at_owner(Owned::Job, id.as_str(), |c| async move {
                c.job(id.as_str()).await
            })
            .await?
        {
            return Ok(view);
        }
        self.host
            .job_whereabouts(id)
            .await
            .map_err(fleet_unavailable)?
            .map(|w| w.view)
            .ok_or_else(|| crate::api::jobs::job_not_found(id))
    }

    /// Cancels a job wherever it is in the fleet: here, in the queue, or on
    /// the live host that holds it (carried there). A job moving from the
    /// queue to a host is followed until it lands.
    pub(super) async fn cancel_job(&self, id: &JobId) -> Result<JobAccepted, ApiError> {
        // Held by another live host: cancelled there, answered as it
        // answered.
        if let Some(answer) = self
            .at_owner(Owned::Job, id.as_str(), |c| async move {
                c.cancel_job(id.as_str()).await
            })
            .await?
        {
            return Ok(answer);
        }
        let deadline = tokio::time::Instant::now() + CANCEL_SETTLE;
        loop {
            if self.local.jobs.view(id).is_some() {
                return self.local.cancel_job(id);
            }
            if let Some(view) = self
                .host
                .cancel_queued_job(id)
                .await
                .map_err(fleet_unavailable)?
            {
                return Ok(accepted(view));
            }
            let Some(place) = self
                .host
                .job_whereabouts(id)
                .await
                .map_err(fleet_unavailable)?
            else {
                return Err(crate::api::jobs::job_not_found(id));
            };
            if place.view.state.is_terminal() {
                return Ok(accepted(place.view));
            }
            if place.owner.is_some() {
                let carried = self
                    .at_owner(Owned::Job, id.as_str(), |c| async move {
                        c.cancel_job(id.as_str()).await
                    })
                    .await?;
                if let Some(answer) = carried {
                    return Ok(JobAccepted {
                        job_id: place.view.job_id,
                        state: answer.state,
                    });
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorCode::JobMoving,
                    format!("job {id} is being taken in by a host of the fleet; retry the cancel"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Followed here when this host holds the job, else wherever it is.
    pub(super) async fn job_logs(&self, id: JobId, next: u64) -> Result<EventStream, ApiError> {
        if let Some(here) = self.local.job_logs_here(&id, next) {
            return Ok(here);
        }
        if self
            .host
            .job_whereabouts(&id)
            .await
            .map_err(fleet_unavailable)?
            .is_none()
        {
            return Err(crate::api::jobs::job_not_found(&id));
        }
        Ok(follow_in_fleet(self.clone(), id, next).boxed())
    }

    // ------------------------------------------------------------ agents

    /// Every host's agents, each with its `host` (`local`: this host's
    /// only); a host that did not answer is named under `unreachableHosts`.
    pub(super) async fn agents(&self, all: bool, local: bool) -> AgentList {
        let mut list = self.local.agents(all);
        let me = self.local.instance.to_string();
        for a in &mut list.agents {
            a.host = Some(me.clone());
        }
        if !local {
            let (lists, unreachable) = self
                .host
                .gather_reachable(move |c| async move { c.local_agents(all).await })
                .await;
            list.agents.extend(lists.into_iter().flat_map(|l| l.agents));
            list.unreachable_hosts = unreachable;
            list.agents.sort_by(|a, b| {
                b.age_seconds
                    .total_cmp(&a.age_seconds)
                    .then_with(|| a.agent_id.cmp(&b.agent_id))
            });
        }
        list
    }

    pub(super) async fn agent(&self, agent: AgentId) -> Result<AgentObject, ApiError> {
        let id = agent.to_string();
        let i = id.as_str();
        match self
            .at_owner(Owned::Agent, &id, |c| async move { c.agent(i).await })
            .await?
        {
            Some(view) => Ok(view),
            None => self.local.agent(agent),
        }
    }

    pub(super) async fn destroy_agent(&self, agent: AgentId) -> Result<(), ApiError> {
        let id = agent.to_string();
        let i = id.as_str();
        match self
            .at_owner(
                Owned::Agent,
                &id,
                |c| async move { c.destroy_agent(i).await },
            )
            .await?
        {
            Some(()) => Ok(()),
            None => self.local.destroy_agent(agent),
        }
    }

    pub(super) async fn registered(
        &self,
        agent: AgentId,
        body: RegisteredBody,
    ) -> Result<RegistrationAnswer, ApiError> {
        let id = agent.to_string();
        let i = id.as_str();
        let sent = &body;
        match self
            .at_owner(
                Owned::Agent,
                &id,
                |c| async move { c.registered(i, sent).await },
            )
            .await?
        {
            Some(answer) => Ok(answer),
            None => self.local.registered(agent, body).await,
        }
    }

    pub(super) async fn config_ack(&self, agent: AgentId) -> Result<(), ApiError> {
        let id = agent.to_string();
        let i = id.as_str();
        match self
            .at_owner(Owned::Agent, &id, |c| async move { c.config_ack(i).await })
            .await?
        {
            Some(()) => Ok(()),
            None => self.local.config_ack(agent).await,
        }
    }

    pub(super) async fn job_started(
        &self,
        agent: AgentId,
        body: JobStartedBody,
    ) -> Result<(), ApiError> {
        let id = agent.to_string();
        let i = id.as_str();
        let sent = &body;
        match self
            .at_owner(Owned::Agent, &id, |c| async move {
                c.job_started(i, sent).await
            })
            .await?
        {
            Some(()) => Ok(()),
            None => self.local.job_started(agent, &body),
        }
    }

    pub(super) async fn job_complete(
        &self,
        agent: AgentId,
        body: JobCompleteBody,
    ) -> Result<(), ApiError> {
        let id = agent.to_string();
        let i = id.as_str();
        let sent = &body;
        match self
            .at_owner(Owned::Agent, &id, |c| async move {
                c.job_complete(i, sent).await
            })
            .await?
        {
            Some(()) => Ok(()),
            None => self.local.job_complete(agent, &body),
        }
    }

    pub(super) async fn disconnected(&self, agent: AgentId) -> Result<(), ApiError> {
        let id = agent.to_string();
        let i = id.as_str();
        match self
            .at_owner(
                Owned::Agent,
                &id,
                |c| async move { c.disconnected(i).await },
            )
            .await?
        {
            Some(()) => Ok(()),
            None => self.local.disconnected(agent),
        }
    }

    // -------------------------------------------------------- operations

    /// This host's status with every other live host's under `hosts`
    /// (`local`: this host's only).
    pub(super) async fn status(&self, local: bool) -> StatusObject {
        let mut status = self.local.status();
        if !local {
            let (hosts, unreachable) = self
                .host
                .gather_reachable(|c| async move { c.local_status().await })
                .await;
            status.hosts = hosts;
            status
                .hosts
                .sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
            status.unreachable_hosts = unreachable;
        }
        status
    }

    /// The fleet's events from now on: this host's and every other live
    /// host's (`?local=true` streams relayed), each with its `host`.
    /// Without SSE ids: ids are per host, so a reader that resumes does so
    /// on one host (`Last-Event-ID` gives that host's own stream).
    pub(super) fn events_from_now(&self) -> EventStream {
        let (relay, events) = relay(256);
        let me = self.local.instance.to_string();
        let log = Arc::clone(&self.local.events);
        let own = crate::api::stream::follow(Arc::clone(&log), log.newest_id(), Some(me));
        let local = relay.clone();
        tokio::spawn(async move { local.pipe(own).await });
        let host = self.host.clone();
        tokio::spawn(async move {
            let following = Arc::new(parking_lot::Mutex::new(std::collections::HashSet::new()));
            loop {
                if let Some(Ok(peers)) = relay.unless_left(host.live_peers()).await {
                    for peer in peers {
                        let Some(url) = peer.url else { continue };
                        if !following.lock().insert(peer.instance_id.clone()) {
                            continue;
                        }
                        let (relay, host, following) =
                            (relay.clone(), host.clone(), Arc::clone(&following));
                        tokio::spawn(async move {
                            relay_peer_events(&host, &url, &peer.instance_id, &relay).await;
                            following.lock().remove(&peer.instance_id);
                        });
                    }
                }
                if !relay.pause(FLEET_STREAM_REFRESH).await {
                    return;
                }
            }
        });
        events.boxed()
    }

    pub(super) async fn view(&self) -> Result<FleetObject, ApiError> {
        self.host.view().await.map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::StoreUnavailable,
                format!("reading the fleet: {e}"),
            )
        })
    }
}

/// Relays one peer's own events, each with its `host`, until its stream
/// ends or the reader leaves.
async fn relay_peer_events(host: &FleetHost, url: &str, instance: &str, relay: &Relay) {
    let Some(Ok(mut events)) = relay.unless_left(host.events_at(url, instance)).await else {
        return;
    };
    loop {
        let (name, json) = match relay.unless_left(events.next()).await {
            Some(Some(Ok(StreamEvent::Event(e)))) => (e.event.name(), serde_json::to_string(&e)),
            Some(Some(Ok(StreamEvent::Reset { reset, .. }))) => {
                (RESET_EVENT, serde_json::to_string(&reset))
            }
            _ => return,
        };
        let Ok(json) = json else { continue };
        if !relay
            .send(crate::api::stream::hosted_event(name, &json, instance))
            .await
        {
            return;
        }
    }
}

/// A fleet job's output, wherever it runs: waits while it is queued,
/// relays its host's stream (resuming after the last chunk relayed if
/// that host goes away), or follows it here once this host took it in;
/// its end from the queue when its host can no longer tell.
fn follow_in_fleet(
    fleet: Fleet,
    id: JobId,
    mut next: u64,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> + Send {
    use crate::api::jobs::{end_event, follow};
    let (relay, events) = relay(64);
    tokio::spawn(async move {
        let jobs = Arc::clone(&fleet.local.jobs);
        loop {
            if jobs.view(&id).is_some() {
                relay
                    .pipe(follow(Arc::clone(&jobs), id.clone(), next))
                    .await;
                return;
            }
            match relay.unless_left(fleet.host.job_whereabouts(&id)).await {
                None | Some(Ok(None)) => return,
                Some(Ok(Some(place))) => {
                    if let Some(owner) = &place.owner {
                        let relayed =
                            relay_job_logs(&fleet.host, owner, &id, &mut next, &relay).await;
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
    host: &FleetHost,
    owner: &kici_fleet::Owner,
    id: &JobId,
    next: &mut u64,
    relay: &Relay,
) -> Relayed {
    use crate::api::jobs::{chunk_event, end_event, truncated_event};
    let opened = host.job_logs_at(owner, id, next.checked_sub(1));
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

/// An error answer a peer gave, relayed as it gave it.
fn relayed(answer: kici_api::ErrorAnswer) -> ApiError {
    ApiError {
        status: StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY),
        code: answer.error.code,
        message: answer.error.message,
        field: answer.error.field,
        errors: (!answer.errors.is_empty()).then_some(answer.errors),
    }
}

fn peer_error(e: PeerError) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        ErrorCode::PeerUnavailable,
        e.to_string(),
    )
}

fn entry_error(e: EntryError) -> ApiError {
    match e {
        EntryError::Conflict(job) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::JobConflict,
            format!("job {job} was already requested with a different body"),
        )
        .field("jobId"),
        EntryError::Unavailable(m) | EntryError::Body(m) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::StoreUnavailable,
            m,
        ),
    }
}

fn fleet_unavailable(e: kici_fleet::FleetError) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::StoreUnavailable,
        format!("the fleet's database: {e}"),
    )
}
