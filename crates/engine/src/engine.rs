//! The engine: scale requests, agents, warm pools, deadlines, reload.
//!
//! [`Engine`] is a synchronous state machine. Every method takes `now` and
//! records what must happen outside as [`Effect`]s (spawn, destroy) and what
//! happened as [`EngineEvent`]s; the async [`crate::runtime`] executes the
//! effects against real backends and feeds results back. Keeping I/O out of
//! here makes every timer injectable (tests pass `now`) and every interleaving
//! reproducible.
//!
//! Capacity is held by [`Reservation`] guards owned by agent records: an
//! agent's reservation is dropped exactly once, when the agent reaches `gone`.
//!
//! This module holds the engine's types, scale requests and admission, the
//! transitions (with the effects they order), shutdown and the views; its
//! submodules each add one part of [`Engine`]'s behaviour: `warm` (warm
//! pools), `spawns` (the `maxConcurrentSpawns` throttle), `reports` (what
//! backends and agents report), `timers`
//! (deadlines), `switches` (cordon, drain), `reload`, and `recovery` (the
//! journal and taking agents and pending requests back after a restart).

use crate::backend::{DestroyReason, ResourceHandle};
use crate::breaker::{Breaker, BreakerState};
use crate::lifecycle::{
    transition, AgentEvent, AgentState, FailureReason, IllegalTransition, Mode, StopCause,
};
use crate::pending::{Admitter, Attempt, PendingEnd, PendingEntry, PendingQueue, ScaleRequest};
use kici_admission::{Admission, AdmitError, Cap, Demand, Holds, Reservation};
use kici_model::{
    AgentId, Config, EffectiveResources, JobId, LabelSet, Resources, ScalerEntry, ScalerName,
    ScalerType,
};
use kici_routing::{CordonSet, HostPlatform, Route, Router};
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod capacity;
mod hold;
mod recovery;
mod reload;
mod reports;
mod spawns;
mod switches;
mod timers;
mod warm;
pub use capacity::WarmSource;
pub use hold::{AdmissionHold, HoldLapsed, HoldRefused};
pub use recovery::{
    DurableAgent, DurablePending, JournalEntry, JournalKey, PendingRecovered, RecoverError,
    Recovered,
};

/// A gone agent as last seen, kept for `GET /v1/agents?all=true`.
#[derive(Debug, Clone)]
struct GoneAgent {
    view: AgentView,
    /// When it reached `gone`.
    since: Instant,
}

impl GoneAgent {
    /// Its view with the clocks still running: its age counts from its
    /// creation, its time in `gone` from its release.
    fn view_at(&self, now: Instant) -> AgentView {
        let in_state = now.saturating_duration_since(self.since).as_secs_f64();
        AgentView {
            age_seconds: self.view.age_seconds + in_state,
            state_seconds: in_state,
            ..self.view.clone()
        }
    }
}

/// Daemon-wide engine settings (not per scaler).
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// How long a pending request waits before it expires.
    pub pending_ttl: Duration,
    /// After this long in the queue, a request holds the capacity it needs.
    pub starvation: Duration,
    /// Most pending requests kept; beyond, new requests are refused.
    pub max_pending: usize,
    /// How many `gone` agents stay visible (`GET /v1/agents?all=true`).
    pub gone_history: usize,
    /// A failed destroy is retried after 1 s, then after twice the previous
    /// wait, at most this long; a destroy that never answers is issued again
    /// after this long.
    pub destroy_retry: Duration,
    /// The agent's own idle window after a job when no warm pool sets one
    /// (`KICI_SCALER_IDLE_TIMEOUT`'s contract default, 5 s).
    pub agent_idle_default: Duration,
    /// How many events the runtime's event stream buffers for each
    /// observer; a slower observer misses the oldest (it is told how
    /// many). Nothing that must happen depends on it: control flows
    /// through effects.
    pub event_buffer: usize,
    /// Whether an orchestrator job whose agent failed before it registered
    /// goes back to this engine's own queue. Off in a fleet: there the
    /// fleet's queue takes it back (the engine's own queue would admit it
    /// again outside the fleet's caps), and the engine just lets it go.
    pub requeue_unstarted: bool,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            pending_ttl: Duration::from_secs(3600),
            starvation: Duration::from_secs(300),
            max_pending: 10_000,
            gone_history: 1000,
            destroy_retry: Duration::from_secs(30),
            agent_idle_default: Duration::from_secs(5),
            event_buffer: 4096,
            requeue_unstarted: true,
        }
    }
}

/// The answer to a scale request (`POST /v1/scale`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScaleOutcome {
    Spawning {
        agent_id: AgentId,
        scaler: ScalerName,
        backend: ScalerType,
        warm: bool,
    },
    Pending {
        position: usize,
    },
    TooLarge {
        cap: Cap,
        detail: String,
    },
    NoBackend {
        explanation: String,
    },
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ScaleError {
    #[error("job {0} was already requested with a different body")]
    Conflict(JobId),
    #[error("the pending queue is full ({0} requests)")]
    QueueFull(usize),
    /// The machine-pool ledger (or the admission layer) failed; nothing
    /// was reserved. The admission error is kept whole (`source()`).
    #[error("admission failed")]
    Admission(#[source] Arc<AdmitError>),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

impl PartialEq for ScaleError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Conflict(a), Self::Conflict(b)) => a == b,
            (Self::QueueFull(a), Self::QueueFull(b)) => a == b,
            // The admission error has no equality of its own: the same
            // failure, or one that reads the same.
            (Self::Admission(a), Self::Admission(b)) => {
                Arc::ptr_eq(a, b) || a.to_string() == b.to_string()
            }
            (Self::ShuttingDown, Self::ShuttingDown) => true,
            _ => false,
        }
    }
}

impl Eq for ScaleError {}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    #[error("agent {0} is not managed by this instance")]
    NotOurs(AgentId),
    #[error("agent {0} is gone")]
    Gone(AgentId),
    #[error("scaler {0:?} is not configured")]
    UnknownScaler(String),
    #[error("agent {agent} is busy with job {current}, not {given}")]
    WrongJob {
        agent: AgentId,
        current: JobId,
        given: JobId,
    },
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
}

/// What a registering agent is told (`POST /v1/agents/{id}/registered`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub bound_job_id: Option<JobId>,
    pub mandatory_labels: LabelSet,
}

/// What the outside world must do, in the order the engine decided it.
/// Every effect is executed (never dropped, never reordered): control flows
/// through effects, never through [`EngineEvent`]s, which are for observers
/// (SSE, metrics, logs) and may be lost by a slow one.
#[derive(Debug, Clone)]
pub enum Effect {
    Spawn(SpawnOrder),
    Destroy(DestroyOrder),
    /// The agent is gone: revoke what was minted for it (its token).
    Revoke(AgentId),
    /// The agent is gone: a coordinator that handed it a job must learn
    /// how it ended (see `runtime::Coordinator::agent_ended`).
    Ended(EndedAgent),
    /// Something happened to a standalone job that its dispatcher must act
    /// on. Orchestrator-mode jobs never produce one: their dispatcher is
    /// the orchestrator.
    Job(JobEffect),
}

/// An agent that is gone, as a coordinator needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedAgent {
    pub agent: AgentId,
    /// The job it served or was bound to, if any.
    pub job: Option<JobId>,
    /// Why it failed, if it did.
    pub failure: Option<FailureReason>,
}

impl EndedAgent {
    /// Whether it ended before anybody could have given it its job (it
    /// never came up, or never registered): the job may be served again.
    pub fn before_dispatch(&self) -> bool {
        self.failure.is_some_and(FailureReason::before_dispatch)
    }
}

/// What a standalone job's dispatcher (the daemon's job book and agent
/// gateway) must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEffect {
    /// The job was admitted: `agent` is being provisioned for it and will
    /// be handed it once it registers (the registration names the job).
    Bound { job: JobId, agent: AgentId },
    /// An idle warm agent took the job: it is already connected, so the
    /// dispatcher sends it the job on its open connection.
    Dispatch { job: JobId, agent: AgentId },
    /// The job cannot run to its end any more; it is never re-queued (a
    /// standalone job is not retried on another agent).
    Ended { job: JobId, lost: JobLost },
}

/// Why a standalone job ended without its command's own end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobLost {
    /// It left the pending queue without an agent (cancelled, expired, no
    /// scaler accepts it or it no longer fits after a reload).
    Pending(PendingEnd),
    /// Its request was cancelled while its agent was being provisioned.
    Cancelled { agent: AgentId },
    /// Its agent failed before the job ended.
    AgentFailed {
        agent: AgentId,
        reason: FailureReason,
        detail: Option<String>,
    },
    /// Its agent was stopped before the job ended.
    AgentStopped { agent: AgentId, cause: StopCause },
}

/// Why an agent changed state, when it was not its own doing: what
/// stopped it, or a destroy being retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransitionCause {
    Stop(StopCause),
    /// A destroy failed and is retried (`destroying` → `destroying`).
    DestroyRetry,
}

impl TransitionCause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop(c) => c.as_str(),
            Self::DestroyRetry => "destroy-retry",
        }
    }
}

impl std::fmt::Display for TransitionCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Ask a backend to bring an agent up.
#[derive(Debug, Clone)]
pub struct SpawnOrder {
    pub agent: AgentId,
    pub config: Arc<Config>,
    pub scaler_index: usize,
    pub label_set_index: usize,
    pub agent_labels: Vec<String>,
    pub resources: EffectiveResources,
    pub job: Option<JobId>,
    pub run_id: Option<String>,
    pub mode: Mode,
    pub warm: bool,
    pub idle_timeout_ms: Option<u128>,
}

impl SpawnOrder {
    pub fn scaler(&self) -> &ScalerEntry {
        &self.config.scalers[self.scaler_index]
    }
}

/// Ask a backend to tear an agent down.
#[derive(Debug, Clone)]
pub struct DestroyOrder {
    pub agent: AgentId,
    pub backend: ScalerType,
    pub handle: Option<ResourceHandle>,
    pub grace: Duration,
    /// Why: a backend that reports teardowns elsewhere (an external
    /// provisioner) passes it on.
    pub reason: DestroyReason,
}

/// Something that happened; the source of SSE events, metrics and the store.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    AgentTransition {
        agent_id: AgentId,
        scaler: ScalerName,
        backend: ScalerType,
        from: AgentState,
        to: AgentState,
        job_id: Option<JobId>,
        failure_reason: Option<FailureReason>,
        cause: Option<TransitionCause>,
        detail: Option<String>,
        /// Seconds spent in `from`.
        seconds_in_state: f64,
    },
    /// A waiting request is refused by `cap`: when it starts waiting, and
    /// again only when the scaler or cap in its way changes — never at
    /// every admission pass (each event is a log line and a metric
    /// increment downstream).
    Refused {
        job_id: JobId,
        scaler: ScalerName,
        cap: Cap,
        detail: String,
    },
    PendingEnded {
        job_id: JobId,
        scaler: ScalerName,
        end: PendingEnd,
        waited_seconds: f64,
    },
    BreakerChanged {
        scaler: ScalerName,
        label_set: usize,
        state: BreakerState,
    },
    ScalerCordon {
        scaler: ScalerName,
        cordoned: bool,
        draining: bool,
    },
    Reloaded {
        added: Vec<String>,
        removed: Vec<String>,
    },
    /// A `type: event` scaler's event for its external provisioner,
    /// published by its backend ([`crate::runtime::Runtime::announce`]) so
    /// that the event stream carries it to pull-style consumers.
    Provision(ProvisionNotice),
}

/// One external provisioning event as the event stream shows it.
#[derive(Debug, Clone, PartialEq)]
pub enum ProvisionNotice {
    ScaleUp {
        request_id: String,
        agent_id: AgentId,
        scaler: ScalerName,
        labels: Vec<String>,
        resources: kici_model::EffectiveResources,
        /// Redacted in `Debug` (engine events are logged).
        claim_code: kici_model::Secret,
        claim_url: String,
        /// RFC 3339, UTC, milliseconds.
        expires_at: String,
        job_id: Option<JobId>,
    },
    ScaleDown {
        request_id: String,
        agent_id: AgentId,
        scaler: ScalerName,
        reason: String,
    },
}

/// One managed agent.
#[derive(Debug)]
struct Agent {
    id: AgentId,
    /// The config snapshot the agent was created under; it keeps its
    /// deadlines and label set even if a reload removes its scaler.
    config: Arc<Config>,
    scaler_index: usize,
    label_set: usize,
    /// Every label a job must carry to run on it: its scaler's
    /// `mandatoryLabels` plus its label set's platform taints (the
    /// router's gate when it was created), told to it at registration so
    /// that later jobs are held to the same gate.
    gate: LabelSet,
    state: AgentState,
    since: Instant,
    created: Instant,
    /// When an external (`event`) agent's scale-up was delivered: the
    /// instance boots elsewhere, so the agent stays `provisioning` until it
    /// registers, but its spawn is over — its throttle slot is free and the
    /// registration deadline runs from here.
    delivered_at: Option<Instant>,
    /// Creation order; breaks ties between agents created at the same instant.
    seq: u64,
    /// Released exactly once, when the agent reaches `gone`.
    reservation: Option<Reservation>,
    /// The job it is bound to or running now.
    job: Option<JobId>,
    /// The last job it was bound to once `job` let go of it (completed,
    /// ended, cancelled, given back): its gone view names the job it
    /// served.
    last_job: Option<JobId>,
    run_id: Option<String>,
    mode: Mode,
    /// Counts toward its label set's warm pool (spawned warm, not yet taken).
    warm: bool,
    /// Was taken from the warm pool by a job (reported as `warm: true`).
    from_pool: bool,
    handle: Option<ResourceHandle>,
    failure: Option<FailureReason>,
    /// Destroy after the current job (scaler draining, scaler removed).
    drain_after_job: bool,
    destroy: Option<DestroyProgress>,
    /// What stopped it, when something did (a failure is in `failure`).
    stop_cause: Option<StopCause>,
    last_exit_code: Option<i32>,
    /// Its spawn, while it waits for a slot of its scaler's spawn throttle.
    queued_spawn: Option<SpawnOrder>,
}

/// Where an agent's destroy stands (set from its first destroy order on).
#[derive(Debug, Clone, Copy)]
enum DestroyProgress {
    /// Ordered at `since`; `failures` attempts failed before this one.
    InFlight { since: Instant, failures: u32 },
    /// The last of `failures` attempts failed; the next is ordered at `at`.
    Backoff { at: Instant, failures: u32 },
}

impl DestroyProgress {
    fn failures(self) -> u32 {
        match self {
            Self::InFlight { failures, .. } | Self::Backoff { failures, .. } => failures,
        }
    }
}

/// The wait after the `failures`-th failed destroy: 1 s, doubling, capped
/// at `cap`. A transient refusal (an engine busy for a moment, a runtime
/// answering in a state it cannot name yet) is retried within seconds,
/// inside a shutdown's grace; a lasting one is not hammered.
fn destroy_backoff(failures: u32, cap: Duration) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    Duration::from_secs(1u64 << exp).min(cap)
}

impl Agent {
    fn scaler(&self) -> &ScalerEntry {
        &self.config.scalers[self.scaler_index]
    }

    fn name(&self) -> &ScalerName {
        &self.scaler().name
    }

    fn requests(&self) -> Resources {
        self.reservation
            .as_ref()
            .map(|r| r.requests())
            .unwrap_or_default()
    }

    /// Lets go of its job (completed, ended, cancelled, given back),
    /// remembering it for the agent's last view.
    fn release_job(&mut self) -> Option<JobId> {
        let job = self.job.take();
        if job.is_some() {
            self.last_job.clone_from(&job);
        }
        job
    }

    fn idle_ttl(&self, settings: &EngineSettings) -> Duration {
        let scaler = self.scaler();
        let own = if self.warm {
            scaler.warm_idle_timeout()
        } else {
            settings.agent_idle_default
        };
        own + scaler.ext.deadlines.idle_grace
    }

    /// The next instant at which this agent's state must change on its own.
    fn deadline(&self, settings: &EngineSettings) -> Option<Instant> {
        let d = &self.scaler().ext.deadlines;
        let lifetime = self.created + d.max_lifetime;
        let own = match self.state {
            // Waiting for a spawn slot: the wait is bounded by the spawns
            // ahead of it (each bounded by its own deadline), and is not
            // provisioning time.
            AgentState::Requested => None,
            AgentState::Provisioning => Some(match self.delivered_at {
                Some(delivered) => delivered + d.registration,
                None => self.since + d.provision,
            }),
            AgentState::Booted => Some(self.since + d.registration),
            AgentState::Registered => Some(self.since + d.pending_dispatch),
            AgentState::Idle => Some(self.since + self.idle_ttl(settings)),
            AgentState::Busy | AgentState::Draining => None,
            AgentState::Destroying => {
                return self.destroy.map(|d| match d {
                    DestroyProgress::InFlight { since, .. } => since + settings.destroy_retry,
                    DestroyProgress::Backoff { at, .. } => at,
                })
            }
            AgentState::Gone => return None,
        };
        Some(own.map_or(lifetime, |o| o.min(lifetime)))
    }
}

/// A read-only view of an agent for the API.
#[derive(Debug, Clone)]
pub struct AgentView {
    pub agent_id: AgentId,
    pub state: AgentState,
    pub scaler: ScalerName,
    pub backend: ScalerType,
    pub label_set_index: usize,
    pub job_id: Option<JobId>,
    pub resources: Resources,
    pub warm: bool,
    pub mode: Mode,
    pub failure_reason: Option<FailureReason>,
    pub exit_code: Option<i32>,
    pub age_seconds: f64,
    pub state_seconds: f64,
}

/// Where a job is (a job id has at most one record while unfinished).
#[derive(Debug, Clone)]
struct JobRecord {
    /// `None` for the job of an agent taken back after a restart: the store
    /// keeps the agent, not the request, so a retried request is matched by
    /// its job id alone (answered with that agent, never spawned twice).
    request: Option<ScaleRequest>,
    agent: Option<AgentId>,
}

/// Per-scaler operator switches, kept across reloads by name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ScalerSwitches {
    cordoned: bool,
    draining: bool,
}

/// The engine state.
pub struct Engine {
    config: Arc<Config>,
    router: Router,
    host: HostPlatform,
    admission: Admission,
    settings: EngineSettings,
    agents: HashMap<AgentId, Agent>,
    gone: VecDeque<GoneAgent>,
    jobs: HashMap<JobId, JobRecord>,
    pending: PendingQueue,
    /// Keyed by (scaler name, normalised label set) so history survives reload.
    breakers: HashMap<(ScalerName, LabelSet), Breaker>,
    switches: HashMap<ScalerName, ScalerSwitches>,
    cordons: CordonSet,
    /// Per scaler name: spawns in flight and agents waiting for a slot.
    spawn_queues: HashMap<ScalerName, spawns::SpawnQueue>,
    effects: Vec<Effect>,
    events: Vec<EngineEvent>,
    journal: Vec<JournalEntry>,
    shutting_down: bool,
    next_seq: u64,
    /// Warm pool targets from schedules and forecasts.
    capacity: capacity::Capacity,
    /// Warm agents set aside by live [`AdmissionHold`]s.
    warm_holds: hold::WarmHolds,
}

impl Engine {
    pub fn new(
        config: Arc<Config>,
        admission: Admission,
        host: HostPlatform,
        settings: EngineSettings,
    ) -> Self {
        let router = Router::new(&config, &host);
        let mut engine = Self {
            config,
            router,
            host,
            admission,
            settings,
            agents: HashMap::new(),
            gone: VecDeque::new(),
            jobs: HashMap::new(),
            pending: PendingQueue::default(),
            breakers: HashMap::new(),
            switches: HashMap::new(),
            cordons: CordonSet::none(),
            spawn_queues: HashMap::new(),
            effects: Vec::new(),
            events: Vec::new(),
            journal: Vec::new(),
            shutting_down: false,
            next_seq: 0,
            capacity: capacity::Capacity::default(),
            warm_holds: hold::WarmHolds::new(),
        };
        engine.rebuild_breakers();
        engine
    }

    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    pub fn settings(&self) -> &EngineSettings {
        &self.settings
    }

    /// Effects recorded since the last call.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<EngineEvent> {
        std::mem::take(&mut self.events)
    }

    // ----- scale requests ---------------------------------------------------

    /// Routes, admits and (when capacity allows) spawns for one job.
    pub fn request_scale(
        &mut self,
        request: ScaleRequest,
        now: Instant,
    ) -> Result<ScaleOutcome, ScaleError> {
        self.request_scale_arrived(request, now, now, true)
    }

    /// Re-queues a scale request recorded before a restart, as if it had
    /// arrived `waited` ago: it keeps its place among older and younger
    /// requests and expires when it would have (`pending_ttl` after its
    /// arrival). `None`: its TTL ran out while the daemon was down and
    /// nothing was queued. Otherwise exactly [`Engine::request_scale`]
    /// (routing against the current configuration, warm agents, dedupe by
    /// job id).
    pub fn restore_pending(
        &mut self,
        request: ScaleRequest,
        waited: Duration,
        now: Instant,
    ) -> Result<Option<ScaleOutcome>, ScaleError> {
        if waited >= self.settings.pending_ttl {
            return Ok(None);
        }
        // An arrival before the monotonic clock's origin (a request older
        // than the host's uptime) is clamped to now; its expiry still
        // counts from the recorded arrival below.
        let arrived = now.checked_sub(waited).unwrap_or(now);
        // Its record is there already, as it was.
        self.request_scale_arrived(request, arrived, now, false)
            .map(Some)
    }

    /// Where `request` would go, without admitting it: its scaler and the
    /// resources it would reserve, or the final answer when no scaler can
    /// take it (`NoBackend`) or it can never fit here (`TooLarge`). For a
    /// host that records requests in a shared queue before any host serves
    /// them.
    pub fn classify(
        &self,
        request: &ScaleRequest,
    ) -> Result<(ScalerName, EffectiveResources), ScaleOutcome> {
        let (route, resources) = self.route_request(request)?;
        Ok((self.config.scalers[route.scaler].name.clone(), resources))
    }

    /// [`Engine::classify`] with the route itself.
    fn route_request(
        &self,
        request: &ScaleRequest,
    ) -> Result<(Route, EffectiveResources), ScaleOutcome> {
        let Some(route) = self
            .router
            .route(&request.labels, &request.exclude, &self.cordons)
        else {
            return Err(ScaleOutcome::NoBackend {
                explanation: self.explain_no_backend(request),
            });
        };
        let resources = self.resolve_resources(request, route);
        let scaler = &self.config.scalers[route.scaler];
        if let Some(too_large) = self.admission.too_large(
            scaler.name.as_str(),
            resources.requests,
            scaler.machine_pool.as_deref(),
        ) {
            return Err(ScaleOutcome::TooLarge {
                cap: too_large.cap,
                detail: too_large.detail,
            });
        }
        Ok((route, resources))
    }

    /// Whether an agent of `scaler` fits under the count caps now (the
    /// scaler's `maxAgents` and `globalMaxAgents`; CPU and memory are
    /// checked on admission, once a request's size is known).
    pub fn has_agent_slot(&self, scaler: &str) -> bool {
        let usage = self.admission.usage();
        let free =
            |u: &kici_admission::ScopeUsage| u.caps.max_agents.is_none_or(|max| u.agents < max);
        free(&usage.global) && usage.scalers.get(scaler).is_some_and(free)
    }

    /// [`Engine::request_scale`] without the pending queue: a request that
    /// cannot be served now is taken back out (its record too) and answered
    /// `Pending { position: 0 }`. For requests queued elsewhere (a fleet's
    /// shared queue), which must not also wait here.
    pub fn request_scale_now(
        &mut self,
        request: ScaleRequest,
        now: Instant,
    ) -> Result<ScaleOutcome, ScaleError> {
        let job = request.job.clone();
        let known = self.jobs.contains_key(&job);
        let outcome = self.request_scale_arrived(request, now, now, false)?;
        if matches!(outcome, ScaleOutcome::Pending { .. }) && !known {
            self.pending.remove(&job);
            self.jobs.remove(&job);
            return Ok(ScaleOutcome::Pending { position: 0 });
        }
        Ok(outcome)
    }

    /// The answer a repeat of `job`'s scale request would get now, if the
    /// engine knows the job (waiting, or bound to a live agent).
    pub fn job_outcome(&self, job: &JobId) -> Option<ScaleOutcome> {
        self.jobs
            .get(job)
            .map(|record| self.current_outcome(job, record.agent))
    }

    /// Whether `job` waits in the pending queue.
    pub fn is_pending(&self, job: &JobId) -> bool {
        self.pending.contains(job)
    }

    fn request_scale_arrived(
        &mut self,
        request: ScaleRequest,
        arrived: Instant,
        now: Instant,
        record: bool,
    ) -> Result<ScaleOutcome, ScaleError> {
        if self.shutting_down {
            return Err(ScaleError::ShuttingDown);
        }
        if let Some(record) = self.jobs.get(&request.job) {
            if record
                .request
                .as_ref()
                .is_some_and(|known| *known != request)
            {
                return Err(ScaleError::Conflict(request.job));
            }
            return Ok(self.current_outcome(&request.job, record.agent));
        }
        let Some(route) = self
            .router
            .route(&request.labels, &request.exclude, &self.cordons)
        else {
            return Ok(ScaleOutcome::NoBackend {
                explanation: self.explain_no_backend(&request),
            });
        };
        let resources = self.resolve_resources(&request, route);
        let config = Arc::clone(&self.config);
        let scaler = &config.scalers[route.scaler];
        if let Some(too_large) = self.admission.too_large(
            scaler.name.as_str(),
            resources.requests,
            scaler.machine_pool.as_deref(),
        ) {
            return Ok(ScaleOutcome::TooLarge {
                cap: too_large.cap,
                detail: too_large.detail,
            });
        }
        self.record_arrival(route.scaler, route.label_set, arrived);
        if let Some(agent) = self.take_warm(route, &request, resources, now) {
            return Ok(self.current_outcome(&request.job, Some(agent)));
        }
        if self.pending.len() >= self.settings.max_pending {
            return Err(ScaleError::QueueFull(self.pending.len()));
        }
        let job = request.job.clone();
        self.jobs.insert(
            job.clone(),
            JobRecord {
                request: Some(request.clone()),
                agent: None,
            },
        );
        if record {
            self.journal_pending(&request, arrived, now);
        }
        self.pending.insert(PendingEntry {
            scaler: scaler.name.clone(),
            scaler_index: route.scaler,
            label_set: route.label_set,
            resources,
            enqueued: arrived,
            expires: arrived + self.settings.pending_ttl,
            request,
            refused_for: None,
        });
        if let Err(e) = self.serve_pending(now) {
            // The ledger failed: undo this request entirely, its record
            // included (the two collapse into one delete), report it.
            self.pending.remove(&job);
            self.jobs.remove(&job);
            self.journal.push(JournalEntry::ForgetPending(job));
            return Err(e);
        }
        let agent = self.jobs.get(&job).and_then(|r| r.agent);
        Ok(self.current_outcome(&job, agent))
    }

    fn current_outcome(&self, job: &JobId, agent: Option<AgentId>) -> ScaleOutcome {
        if let Some(a) = agent.and_then(|id| self.agents.get(&id)) {
            return ScaleOutcome::Spawning {
                agent_id: a.id,
                scaler: a.name().clone(),
                backend: a.scaler().kind,
                warm: a.warm || a.from_pool,
            };
        }
        ScaleOutcome::Pending {
            position: self.pending.position(job).unwrap_or(0),
        }
    }

    fn explain_no_backend(&self, request: &ScaleRequest) -> String {
        let explanation = self
            .router
            .explain(&request.labels, &request.exclude, &self.cordons);
        let reasons: Vec<String> = explanation
            .candidates
            .iter()
            .map(|c| format!("{}[{}]: {}", c.scaler_name, c.label_set, c.reason))
            .collect();
        if reasons.is_empty() {
            format!("no scaler is configured for labels [{}]", request.labels)
        } else {
            format!(
                "no label set accepts labels [{}] (exclude [{}]): {}",
                request.labels,
                request.exclude,
                reasons.join("; ")
            )
        }
    }

    fn resolve_resources(&self, request: &ScaleRequest, route: Route) -> EffectiveResources {
        let scaler = &self.config.scalers[route.scaler];
        let ls = &scaler.label_sets[route.label_set];
        EffectiveResources::resolve(&[
            request.resources.as_ref(),
            ls.resources.as_ref(),
            self.config.defaults.as_ref(),
        ])
    }

    /// Cancels a pending request, or the bound agent if its job has not
    /// started (it is still spawning, or registered and waiting for the
    /// job). Returns whether anything was cancelled.
    pub fn cancel_scale(&mut self, job: &JobId, now: Instant) -> bool {
        if let Some(entry) = self.pending.remove(job) {
            self.jobs.remove(job);
            self.pending_ended(&entry, PendingEnd::Cancelled, now);
            return true;
        }
        let Some(agent) = self.jobs.get(job).and_then(|r| r.agent) else {
            return false;
        };
        // Still spawning, or registered and waiting for the job to start:
        // the agent exists for this job alone, which nobody will run now.
        let early = self.agents.get(&agent).is_some_and(|a| {
            a.state.is_spawning()
                || (a.state == AgentState::Registered && a.mode == Mode::Orchestrator)
        });
        if early {
            self.jobs.remove(job);
            let mut standalone = false;
            if let Some(a) = self.agents.get_mut(&agent) {
                a.release_job();
                standalone = a.mode == Mode::Standalone;
            }
            self.stop(agent, StopCause::Cancelled, now);
            if standalone {
                self.effects.push(Effect::Job(JobEffect::Ended {
                    job: job.clone(),
                    lost: JobLost::Cancelled { agent },
                }));
            }
        }
        early
    }

    /// Serves the pending queue: oldest first among those that fit; a request
    /// older than the starvation threshold that does not fit holds what it
    /// needs so younger ones cannot take it. Runs on every arrival, release
    /// and tick, so it tries one request per shape of waiting request (see
    /// [`PendingQueue::plan`]) and reports a refusal only when a request's
    /// reason changed — never a visit and a report per waiting request.
    fn serve_pending(&mut self, now: Instant) -> Result<(), ScaleError> {
        if self.pending.is_empty() || self.shutting_down {
            return Ok(());
        }
        let plan = {
            let mut admitter = PassAdmitter {
                engine: self,
                now,
                drawn: Vec::new(),
            };
            self.pending
                .plan(now, self.settings.starvation, &mut admitter)
        };
        for (job, scaler, refusal) in self.pending.record_refusals(&plan.refused) {
            self.events.push(EngineEvent::Refused {
                job_id: job,
                scaler,
                cap: refusal.cap,
                detail: refusal.to_string(),
            });
        }
        for (shape, _) in &plan.too_large {
            for entry in self.pending.take_shape(shape) {
                self.jobs.remove(&entry.request.job);
                self.pending_ended(&entry, PendingEnd::TooLarge, now);
            }
        }
        for (job, (reservation, agent)) in plan.admitted {
            // Planned from this very queue, nothing removed since: present.
            // Were it not, dropping the reservation releases it.
            let Some(entry) = self.pending.remove(&job) else {
                continue;
            };
            self.pending_ended(&entry, PendingEnd::Admitted, now);
            if let Some(record) = self.jobs.get_mut(&entry.request.job) {
                record.agent = Some(agent);
            }
            self.start_agent(
                agent,
                entry.scaler_index,
                entry.label_set,
                reservation,
                entry.resources,
                Some(entry.request),
                now,
            );
        }
        match plan.error {
            Some(e) => Err(ScaleError::Admission(Arc::new(e))),
            None => Ok(()),
        }
    }

    fn fresh_agent_id(&self, kind: ScalerType, also: &[AgentId]) -> AgentId {
        loop {
            let id = AgentId::random(kind);
            let taken = self.agents.contains_key(&id)
                || self.gone.iter().any(|g| g.view.agent_id == id)
                || also.contains(&id);
            if !taken {
                return id;
            }
        }
    }

    fn pending_ended(&mut self, entry: &PendingEntry, end: PendingEnd, now: Instant) {
        self.journal
            .push(JournalEntry::ForgetPending(entry.request.job.clone()));
        if entry.request.mode == Mode::Standalone && end != PendingEnd::Admitted {
            self.effects.push(Effect::Job(JobEffect::Ended {
                job: entry.request.job.clone(),
                lost: JobLost::Pending(end),
            }));
        }
        self.events.push(EngineEvent::PendingEnded {
            job_id: entry.request.job.clone(),
            scaler: entry.scaler.clone(),
            end,
            waited_seconds: now.saturating_duration_since(entry.enqueued).as_secs_f64(),
        });
    }

    /// Creates the agent record (it owns the reservation) and asks for a spawn.
    #[allow(clippy::too_many_arguments)]
    fn start_agent(
        &mut self,
        id: AgentId,
        scaler_index: usize,
        label_set: usize,
        reservation: Reservation,
        resources: EffectiveResources,
        request: Option<ScaleRequest>,
        now: Instant,
    ) {
        // Unbound spawns are exactly the warm-pool ones.
        let warm = request.is_none();
        let config = Arc::clone(&self.config);
        let scaler = &config.scalers[scaler_index];
        let key = (
            scaler.name.clone(),
            scaler.label_sets[label_set].labels.clone(),
        );
        if let Some(b) = self.breakers.get_mut(&key) {
            b.on_attempt(now);
        }
        // The contract reads milliseconds.
        let idle_timeout_ms = warm.then(|| scaler.warm_idle_timeout().as_millis());
        let (job, run_id, mode) = match request {
            Some(r) => (Some(r.job), r.run_id, r.mode),
            None => (None, None, Mode::Orchestrator),
        };
        let order = SpawnOrder {
            agent: id,
            config: Arc::clone(&config),
            scaler_index,
            label_set_index: label_set,
            agent_labels: self.router.agent_labels(scaler_index, label_set),
            resources,
            job: job.clone(),
            run_id: run_id.clone(),
            mode,
            warm,
            idle_timeout_ms,
        };
        let agent = Agent {
            id,
            config,
            scaler_index,
            label_set,
            gate: self.router.gate(scaler_index, label_set).clone(),
            state: AgentState::Requested,
            since: now,
            created: now,
            delivered_at: None,
            seq: self.next_seq,
            reservation: Some(reservation),
            job,
            last_job: None,
            run_id,
            mode,
            warm,
            from_pool: false,
            handle: None,
            failure: None,
            drain_after_job: false,
            destroy: None,
            stop_cause: None,
            last_exit_code: None,
            queued_spawn: None,
        };
        self.next_seq += 1;
        self.agents.insert(id, agent);
        if let (Mode::Standalone, Some(job)) = (mode, order.job.clone()) {
            self.effects
                .push(Effect::Job(JobEffect::Bound { job, agent: id }));
        }
        self.queue_spawn(order, now);
    }

    // ----- transitions ------------------------------------------------------

    /// Applies one lifecycle event and records it.
    fn apply(
        &mut self,
        agent: AgentId,
        event: AgentEvent,
        now: Instant,
        cause: Option<TransitionCause>,
        detail: Option<String>,
    ) -> Result<AgentState, AgentError> {
        let a = self
            .agents
            .get_mut(&agent)
            .ok_or(AgentError::NotOurs(agent))?;
        let from = a.state;
        let to = transition(from, event)?;
        let seconds_in_state = now.saturating_duration_since(a.since).as_secs_f64();
        a.state = to;
        a.since = now;
        let failure = match event {
            AgentEvent::Failed(r) => {
                a.failure = Some(r);
                Some(r)
            }
            _ => None,
        };
        let scaler = a.name().clone();
        self.events.push(EngineEvent::AgentTransition {
            agent_id: agent,
            scaler: scaler.clone(),
            backend: a.scaler().kind,
            from,
            to,
            job_id: a.job.clone(),
            failure_reason: failure,
            cause,
            detail,
            seconds_in_state,
        });
        let freed = self.track_spawn(agent, &scaler, from, to);
        self.journal_agent(agent, now);
        if freed {
            self.dispatch_spawns(&scaler, now);
        }
        Ok(to)
    }

    /// Applies an event the engine itself knows to be legal here; an error
    /// is a bug, logged loudly rather than ignored.
    fn step(&mut self, agent: AgentId, event: AgentEvent, now: Instant) {
        if let Err(e) = self.apply(agent, event, now, None, None) {
            tracing::error!(agent = %agent, error = %e, "engine bug: illegal internal transition");
        }
    }

    fn breaker_key(&self, agent: AgentId) -> Option<(ScalerName, LabelSet)> {
        let a = self.agents.get(&agent)?;
        Some((
            a.name().clone(),
            a.scaler().label_sets[a.label_set].labels.clone(),
        ))
    }

    fn breaker_changed(&mut self, agent: AgentId, state: BreakerState) {
        if let Some(a) = self.agents.get(&agent) {
            self.events.push(EngineEvent::BreakerChanged {
                scaler: a.name().clone(),
                label_set: a.label_set,
                state,
            });
        }
    }

    /// A failure: destroy, back off the label set, then re-queue an
    /// orchestrator job whose agent never registered, end an orchestrator
    /// job whose dispatcher had its chance, or end a standalone one.
    fn fail(
        &mut self,
        agent: AgentId,
        reason: FailureReason,
        detail: Option<String>,
        now: Instant,
    ) {
        // Before the transition: whether the agent ever registered (an agent
        // failing in a spawning state never could take a job).
        let never_registered = self
            .agents
            .get(&agent)
            .is_some_and(|a| a.state.is_spawning());
        let Ok(_) = self.apply(agent, AgentEvent::Failed(reason), now, None, detail.clone()) else {
            return;
        };
        if reason.counts_against_label_set() {
            if let Some(key) = self.breaker_key(agent) {
                let mut opened = None;
                if let Some(b) = self.breakers.get_mut(&key) {
                    let was = b.state(now);
                    b.on_failure(now);
                    let is = b.state(now);
                    if was != is {
                        opened = Some(is);
                    }
                }
                if let Some(state) = opened {
                    self.breaker_changed(agent, state);
                }
            }
        }
        if !self.end_standalone_job(agent, |agent| JobLost::AgentFailed {
            agent,
            reason,
            detail,
        }) {
            if never_registered && reason.before_dispatch() && self.settings.requeue_unstarted {
                self.requeue_unstarted_job(agent, now);
            } else {
                self.end_orchestrator_job(agent);
            }
        }
        self.issue_destroy(agent, now);
    }

    /// An orchestrator job whose agent registered and then failed (it
    /// waited past the pending-dispatch timeout, outlived its lifetime, or
    /// exited): its dispatcher had its chance to give it the job, so the
    /// request ends here and is never admitted again by itself. Only a new
    /// request for the job id brings it back.
    fn end_orchestrator_job(&mut self, agent: AgentId) {
        let Some(a) = self.agents.get_mut(&agent) else {
            return;
        };
        let Some(job) = a.release_job() else {
            return;
        };
        if self.jobs.get(&job).is_some_and(|r| r.agent == Some(agent)) {
            self.jobs.remove(&job);
        }
    }

    /// A standalone agent leaves with its job unfinished: the job ends
    /// (it is never re-queued: its submitter is told at once, and running
    /// it on another agent is not ours to decide). Returns whether the
    /// agent is a standalone one. The agent keeps the job id for its last
    /// events and view.
    fn end_standalone_job(
        &mut self,
        agent: AgentId,
        lost: impl FnOnce(AgentId) -> JobLost,
    ) -> bool {
        let Some(a) = self.agents.get(&agent) else {
            return false;
        };
        if a.mode != Mode::Standalone {
            return false;
        }
        if let Some(job) = a.job.clone() {
            if self.jobs.get(&job).is_some_and(|r| r.agent == Some(agent)) {
                self.jobs.remove(&job);
            }
            self.effects.push(Effect::Job(JobEffect::Ended {
                job,
                lost: lost(agent),
            }));
        }
        true
    }

    /// An orchestrator job whose agent failed before starting it is not
    /// lost: it goes back to the queue with its original arrival time (and
    /// waits for backoff).
    fn requeue_unstarted_job(&mut self, agent: AgentId, now: Instant) {
        let Some(a) = self.agents.get_mut(&agent) else {
            return;
        };
        let Some(job) = a.release_job() else {
            return;
        };
        let Some(record) = self.jobs.get_mut(&job) else {
            return;
        };
        record.agent = None;
        let Some(request) = record.request.clone() else {
            // Taken back after a restart, its request unknown: the
            // orchestrator's retry brings it again.
            self.jobs.remove(&job);
            return;
        };
        let enqueued = a.created;
        let Some(route) = self
            .router
            .route(&request.labels, &request.exclude, &self.cordons)
        else {
            self.jobs.remove(&job);
            return;
        };
        let resources = self.resolve_resources(&request, route);
        self.journal_pending(&request, enqueued, now);
        self.pending.insert(PendingEntry {
            scaler: self.config.scalers[route.scaler].name.clone(),
            scaler_index: route.scaler,
            label_set: route.label_set,
            resources,
            enqueued,
            expires: (enqueued + self.settings.pending_ttl).max(now),
            request,
            // A new wait: its first refusal is reported again.
            refused_for: None,
        });
    }

    fn stop(&mut self, agent: AgentId, cause: StopCause, now: Instant) {
        // The first reason sticks: a later stop of an agent already being
        // destroyed does not change why it went.
        if let Some(a) = self.agents.get_mut(&agent) {
            if a.failure.is_none() && a.stop_cause.is_none() && a.destroy.is_none() {
                a.stop_cause = Some(cause);
            }
        }
        if self
            .apply(
                agent,
                AgentEvent::Stop(cause),
                now,
                Some(TransitionCause::Stop(cause)),
                None,
            )
            .is_ok()
        {
            self.end_standalone_job(agent, |agent| JobLost::AgentStopped { agent, cause });
            self.issue_destroy(agent, now);
        }
    }

    fn drain_idle(&mut self, agent: AgentId, cause: StopCause, now: Instant) {
        if self
            .apply(
                agent,
                AgentEvent::Drain(cause),
                now,
                Some(TransitionCause::Stop(cause)),
                None,
            )
            .is_ok()
        {
            self.stop(agent, cause, now);
        }
    }

    fn issue_destroy(&mut self, agent: AgentId, now: Instant) {
        let Some(a) = self.agents.get_mut(&agent) else {
            return;
        };
        a.destroy = Some(DestroyProgress::InFlight {
            since: now,
            failures: a.destroy.map_or(0, DestroyProgress::failures),
        });
        let reason = match (a.failure, a.stop_cause) {
            (Some(f), _) => DestroyReason::Failed(f),
            (None, Some(c)) => DestroyReason::Stopped(c),
            (None, None) => DestroyReason::JobCompleted,
        };
        self.effects.push(Effect::Destroy(DestroyOrder {
            agent,
            backend: a.scaler().kind,
            handle: a.handle.clone(),
            grace: a.scaler().ext.deadlines.destroy_grace,
            reason,
        }));
    }

    // ----- shutdown -----------------------------------------------------------

    /// Stop admitting, cancel every pending request, destroy every agent.
    pub fn shutdown(&mut self, now: Instant) {
        self.shutting_down = true;
        let entries = self.pending.take_where(|_| true);
        for entry in entries {
            self.jobs.remove(&entry.request.job);
            self.pending_ended(&entry, PendingEnd::Cancelled, now);
        }
        let ids: Vec<AgentId> = self
            .agents
            .values()
            .filter(|a| !matches!(a.state, AgentState::Destroying | AgentState::Gone))
            .map(|a| a.id)
            .collect();
        for id in ids {
            self.stop(id, StopCause::Shutdown, now);
        }
    }

    /// True once shut down and every agent is gone.
    pub fn is_idle(&self) -> bool {
        self.agents.is_empty()
    }

    // ----- views ---------------------------------------------------------------

    fn view(&self, a: &Agent, now: Instant) -> AgentView {
        AgentView {
            agent_id: a.id,
            state: a.state,
            scaler: a.name().clone(),
            backend: a.scaler().kind,
            label_set_index: a.label_set,
            job_id: a.job.clone(),
            resources: a.requests(),
            warm: a.warm,
            mode: a.mode,
            failure_reason: a.failure,
            exit_code: a.last_exit_code,
            age_seconds: now.saturating_duration_since(a.created).as_secs_f64(),
            state_seconds: now.saturating_duration_since(a.since).as_secs_f64(),
        }
    }

    /// Live agents (and, with `all`, recently gone ones).
    pub fn agents(&self, all: bool, now: Instant) -> Vec<AgentView> {
        let mut v: Vec<AgentView> = self.agents.values().map(|a| self.view(a, now)).collect();
        v.sort_by(|a, b| b.age_seconds.total_cmp(&a.age_seconds));
        if all {
            v.extend(self.gone.iter().map(|g| g.view_at(now)));
        }
        v
    }

    pub fn agent(&self, id: AgentId, now: Instant) -> Option<AgentView> {
        self.agents.get(&id).map(|a| self.view(a, now)).or_else(|| {
            self.gone
                .iter()
                .find(|g| g.view.agent_id == id)
                .map(|g| g.view_at(now))
        })
    }

    /// The backend handle of a live agent (for the runtime).
    pub fn handle_of(&self, id: AgentId) -> Option<&ResourceHandle> {
        self.agents.get(&id).and_then(|a| a.handle.as_ref())
    }

    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Per-scaler status (`GET /v1/status`).
    pub fn status(&self, now: Instant) -> Status {
        let usage = self.admission.usage();
        let oldest = self.pending.oldest_per_scaler();
        let age = |at: Instant| now.saturating_duration_since(at);
        let scalers = self
            .config
            .scalers
            .iter()
            .enumerate()
            .map(|(si, s)| {
                let mut counts = StateCounts::default();
                for a in self.agents.values().filter(|a| a.name() == &s.name) {
                    counts.add(a.state);
                }
                let warm_idle = self
                    .agents
                    .values()
                    .filter(|a| a.name() == &s.name && a.warm && a.state == AgentState::Idle)
                    .count();
                let switches = self.switches.get(&s.name).copied().unwrap_or_default();
                let (warm_target, warm_source) = self.warm_plan_of(s);
                let (spawns_in_flight, spawns_waiting) = self.spawn_counts(&s.name);
                let label_sets = s
                    .label_sets
                    .iter()
                    .enumerate()
                    .map(|(li, ls)| {
                        let b = self.breakers.get(&(s.name.clone(), ls.labels.clone()));
                        LabelSetStatus {
                            index: li,
                            labels: self.router.enriched(si, li).clone(),
                            breaker: b.map_or(BreakerState::Closed, |b| b.state(now)),
                            consecutive_failures: b.map_or(0, |b| b.consecutive_failures()),
                        }
                    })
                    .collect();
                ScalerStatus {
                    name: s.name.clone(),
                    backend: s.kind,
                    agents: counts,
                    usage: usage.scalers.get(&s.name).cloned(),
                    warm_target,
                    warm_source,
                    warm_idle,
                    pending: self.pending.count_for(s.name.as_str()),
                    oldest_pending: oldest.get(&s.name).copied().map(age),
                    max_concurrent_spawns: s.max_concurrent_spawns,
                    spawns_in_flight,
                    spawns_waiting,
                    cordoned: switches.cordoned,
                    draining: switches.draining,
                    label_sets,
                }
            })
            .collect();
        Status {
            global: usage.global,
            global_max_agents: self.config.global_max_agents,
            pending: self.pending.len(),
            // Over every waiting request, as `pending` counts them.
            oldest_pending: oldest.values().min().copied().map(age),
            scalers,
        }
    }

    /// Names of every scaler with at least one live agent (for reconcile).
    pub fn live_agent_ids(&self) -> BTreeSet<AgentId> {
        self.agents.keys().copied().collect()
    }
}

/// How many agent ids one admission attempt draws before it gives up for
/// this pass: ids have 32 random bits and the engine skips those it knows,
/// so a second collision means admission knows ids the engine does not.
const ID_DRAWS: usize = 2;

/// The engine's half of an admission pass: what the queue cannot know
/// (switches, breakers, agent ids) and the reservation itself.
struct PassAdmitter<'a> {
    engine: &'a Engine,
    now: Instant,
    /// Ids of this pass's admissions: their agents do not exist yet.
    drawn: Vec<AgentId>,
}

impl Admitter for PassAdmitter<'_> {
    type Admitted = (Reservation, AgentId);

    fn pool(&self, entry: &PendingEntry) -> Option<&str> {
        self.engine.config.scalers[entry.scaler_index]
            .machine_pool
            .as_deref()
    }

    fn attempt(&mut self, entry: &PendingEntry, holds: &Holds) -> Attempt<Self::Admitted> {
        let engine = self.engine;
        let switches = engine
            .switches
            .get(&entry.scaler)
            .copied()
            .unwrap_or_default();
        if switches.cordoned || switches.draining {
            return Attempt::Skip;
        }
        let scaler = &engine.config.scalers[entry.scaler_index];
        let key = (
            entry.scaler.clone(),
            scaler.label_sets[entry.label_set].labels.clone(),
        );
        if engine
            .breakers
            .get(&key)
            .is_some_and(|b| b.check(self.now).is_err())
        {
            return Attempt::Skip;
        }
        for _ in 0..ID_DRAWS {
            let agent = engine.fresh_agent_id(scaler.kind, &self.drawn);
            let demand = Demand {
                agent,
                scaler: scaler.name.clone(),
                requests: entry.resources.requests,
                pool: scaler.machine_pool.clone(),
            };
            match engine.admission.try_reserve(demand, holds) {
                Ok(reservation) => {
                    self.drawn.push(agent);
                    return Attempt::Admitted((reservation, agent));
                }
                Err(AdmitError::Refused(refusal)) => return Attempt::Refused(refusal),
                Err(AdmitError::TooLarge(t)) => return Attempt::TooLarge(t.detail),
                // A colliding id: draw another.
                Err(AdmitError::DuplicateAgent(_)) => {}
                Err(
                    e @ (AdmitError::Ledger(_)
                    | AdmitError::UnknownScaler(_)
                    | AdmitError::PoolMismatch { .. }),
                ) => return Attempt::Stop(e),
            }
        }
        // Still colliding: the next pass draws again.
        Attempt::Skip
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReloadError {
    #[error("admission: {0}")]
    Admission(String),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadReport {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Pending jobs that no longer have a scaler.
    pub cancelled: Vec<String>,
    /// Every changed field, `path: old -> new`.
    pub changes: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateCounts {
    pub spawning: usize,
    pub registered: usize,
    pub idle: usize,
    pub busy: usize,
    pub draining: usize,
    pub destroying: usize,
    pub active: usize,
}

impl StateCounts {
    fn add(&mut self, s: AgentState) {
        match s {
            AgentState::Requested | AgentState::Provisioning | AgentState::Booted => {
                self.spawning += 1
            }
            AgentState::Registered => self.registered += 1,
            AgentState::Idle => self.idle += 1,
            AgentState::Busy => self.busy += 1,
            AgentState::Draining => self.draining += 1,
            AgentState::Destroying => self.destroying += 1,
            AgentState::Gone => return,
        }
        self.active += 1;
    }
}

#[derive(Debug, Clone)]
pub struct LabelSetStatus {
    pub index: usize,
    pub labels: LabelSet,
    pub breaker: BreakerState,
    pub consecutive_failures: u32,
}

#[derive(Debug, Clone)]
pub struct ScalerStatus {
    pub name: ScalerName,
    pub backend: ScalerType,
    pub agents: StateCounts,
    /// `None` until the admission layer knows the scaler.
    pub usage: Option<kici_admission::ScopeUsage>,
    /// Over every label set.
    pub warm_target: u32,
    /// Where the target comes from now (upstream's size, a period of the
    /// schedule, the forecast).
    pub warm_source: WarmSource,
    pub warm_idle: usize,
    pub pending: usize,
    /// How long the oldest of `pending` has waited, at the status's `now`;
    /// `None` when nothing waits.
    pub oldest_pending: Option<Duration>,
    /// `maxConcurrentSpawns`.
    pub max_concurrent_spawns: u32,
    /// Backend spawns running now (agents in `provisioning`).
    pub spawns_in_flight: usize,
    /// Admitted agents waiting for a spawn slot (in `requested`).
    pub spawns_waiting: usize,
    pub cordoned: bool,
    pub draining: bool,
    pub label_sets: Vec<LabelSetStatus>,
}

#[derive(Debug, Clone)]
pub struct Status {
    pub global: kici_admission::ScopeUsage,
    pub global_max_agents: u32,
    pub pending: usize,
    /// How long the oldest pending request (of any scaler) has waited;
    /// `None` when nothing waits.
    pub oldest_pending: Option<Duration>,
    pub scalers: Vec<ScalerStatus>,
}
