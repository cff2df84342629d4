//! The async driver: runs the engine's effects against backends, feeds their
//! results back, and fires the engine's timers.
//!
//! All engine calls go through [`Runtime::call`], which locks the engine,
//! passes it `now`, and — still under the lock, so that order is kept —
//! publishes the recorded events and launches the recorded effects. Time is
//! tokio's, so tests run with paused time and never sleep.

use crate::backend::{Adoption, Backend, BackendReport, ResourceHandle, SpawnSpec};
use crate::engine::{
    AdmissionHold, AgentError, AgentView, DestroyOrder, DurableAgent, DurablePending, Effect,
    EndedAgent, Engine, EngineEvent, HoldLapsed, HoldRefused, JobEffect, JournalEntry, JournalKey,
    PendingRecovered, RecoverError, Recovered, Registration, ReloadError, ReloadReport, ScaleError,
    ScaleOutcome, SpawnOrder, Status,
};
use crate::journal::{Journal, JournalError, JournalOp, JournalWriter};
use crate::pending::ScaleRequest;
use kici_model::{AgentId, Config, JobId, ScalerType, Secret};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{broadcast, mpsc, oneshot, watch, Notify};
use tokio::task::AbortHandle;

/// Answered once a journal write was applied (or failed).
pub type RecordAck = oneshot::Receiver<Result<(), JournalError>>;

/// How many recorded agents are checked with their backend at once.
const RECOVERY_PARALLELISM: usize = 64;

/// What startup recovery did.
#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    /// Alive and managed again.
    pub adopted: Vec<AgentId>,
    /// Gone (or not resumable): destroyed, then forgotten.
    pub released: Vec<AgentId>,
    pub errors: Vec<String>,
    /// What became of the recorded pending requests.
    pub pending: PendingReport,
}

/// What startup recovery did with the recorded pending requests (see
/// [`Engine::recover_pending`]); every one that does not wait any more has
/// its record forgotten.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingReport {
    /// Waiting again (or admitted at once), in arrival order.
    pub requeued: Vec<JobId>,
    /// Standalone jobs, not run: their submitter's connection died with
    /// the daemon.
    pub standalone_failed: Vec<JobId>,
    /// TTL ran out while the daemon was down.
    pub expired: Vec<JobId>,
    /// Admitted before the crash (a recorded agent holds the job): only
    /// the record was left behind.
    pub already_admitted: Vec<JobId>,
    /// Not taken back (no scaler accepts it any more, too large, an
    /// unreadable record, …), with why.
    pub dropped: Vec<(JobId, String)>,
}

/// Everything a journal recorded before a restart, to be taken back by
/// [`Runtime::recover_and_start`].
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    pub agents: Vec<DurableAgent>,
    /// Oldest first.
    pub pending: Vec<DurablePending>,
    /// Pending records that could not be read back, with why: forgotten.
    pub unreadable_pending: Vec<(JobId, String)>,
}

impl From<Vec<DurableAgent>> for Recorded {
    fn from(agents: Vec<DurableAgent>) -> Self {
        Self {
            agents,
            ..Self::default()
        }
    }
}

/// How often the machine-pool ledger's upkeep runs.
const LEDGER_MAINTENANCE: Duration = Duration::from_secs(30);

/// The agent-facing half of a spawn: where to connect and with what token.
/// The daemon mints tokens; the default connects to the local gateway.
pub trait Bootstrapper: Send + Sync {
    fn bootstrap(&self, order: &SpawnOrder) -> Bootstrap;
    /// The agent is gone: revoke what was minted for it.
    fn revoke(&self, _agent: AgentId) {}
}

#[derive(Debug, Clone, Default)]
pub struct Bootstrap {
    pub orchestrator_url: String,
    pub token: Option<Secret>,
}

/// The scaler's `orchestratorUrl`, else the local agent gateway.
pub struct DefaultBootstrap;

impl Bootstrapper for DefaultBootstrap {
    fn bootstrap(&self, order: &SpawnOrder) -> Bootstrap {
        Bootstrap {
            orchestrator_url: order
                .scaler()
                .orchestrator_url
                .clone()
                .unwrap_or_else(|| "ws://127.0.0.1:7879/ws".into()),
            token: None,
        }
    }
}

/// The port of a coordinator that hands jobs to several hosts (a fleet):
/// what it must know before this host acts, asked at the moment and
/// awaited — never told afterwards through the event stream.
#[async_trait::async_trait]
pub trait Coordinator: Send + Sync {
    /// A last check before a backend creates an agent for a job, after the
    /// agent's record is written: a job this host no longer holds is
    /// refused. `Err(reason)`: the agent must not be created (the spawn
    /// fails before anything exists on the host).
    async fn may_spawn(&self, agent: AgentId, job: Option<&JobId>) -> Result<(), String>;

    /// Before the engine accepts an agent's registration (after which its
    /// job may run): the coordinator records it durably, so that a host
    /// lost later is known to have let the job run and it is not served
    /// again. `Err(reason)`: not recorded — the registration is refused
    /// (the agent may try again), and the job has not run.
    async fn record_registration(&self, agent: AgentId) -> Result<(), String>;

    /// An agent is gone (destroyed, its capacity released). Called once per
    /// agent, from the engine's effect — never from the event stream, which
    /// may drop events for a slow reader. The coordinator records it
    /// itself, retrying as it must.
    async fn agent_ended(&self, ended: EndedAgent);
}

/// An event with its stream position (the SSE `id`) and wall-clock time.
#[derive(Debug, Clone)]
pub struct SequencedEvent {
    pub id: u64,
    pub at: SystemTime,
    pub event: EngineEvent,
}

struct Inner {
    engine: Mutex<Engine>,
    backends: HashMap<ScalerType, Arc<dyn Backend>>,
    bootstrap: Arc<dyn Bootstrapper>,
    events: broadcast::Sender<Arc<SequencedEvent>>,
    next_event: AtomicU64,
    wake: Notify,
    spawns: Mutex<HashMap<AgentId, AbortHandle>>,
    reports: mpsc::UnboundedSender<BackendReport>,
    /// The state store's writer, when the daemon keeps durable state.
    journal: Option<mpsc::UnboundedSender<JournalOp>>,
    /// Standalone jobs' effects, in the engine's order, unbounded: never
    /// dropped, never lagging (see [`Runtime::job_effects`]).
    job_effects: mpsc::UnboundedSender<JobEffect>,
    job_effects_rx: Mutex<Option<mpsc::UnboundedReceiver<JobEffect>>>,
    /// Woken whenever the engine may have become idle (shutdown waits on it).
    settled: Notify,
    /// Set once by `shutdown`; every background task ends when it flips.
    stop: watch::Sender<bool>,
    /// Consulted before every spawn and registration (see
    /// [`Coordinator`]); set at most once.
    gate: std::sync::OnceLock<Arc<dyn Coordinator>>,
}

/// A cheap, cloneable handle on the running engine.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// A timer tick, with the wall clock read now (warm pool schedules).
fn tick_now(engine: &mut Engine, now: Instant) {
    engine.set_wall_clock(now, jiff::Timestamp::now());
    engine.tick(now);
}

/// An error and its sources, `: `-separated (for a detail text).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl Runtime {
    /// Starts the timer and report tasks on the current tokio runtime,
    /// without durable state.
    pub fn start(
        engine: Engine,
        backends: Vec<Arc<dyn Backend>>,
        bootstrap: Arc<dyn Bootstrapper>,
    ) -> Self {
        let rt = Self::build(engine, backends, bootstrap, None);
        rt.start_timers();
        rt
    }

    /// A runtime with durable state, not yet running: subscribe to its
    /// events, then call [`Runtime::recover_and_start`].
    pub fn with_journal(
        engine: Engine,
        backends: Vec<Arc<dyn Backend>>,
        bootstrap: Arc<dyn Bootstrapper>,
        journal: Arc<dyn Journal>,
    ) -> Self {
        let writer = JournalWriter::spawn(journal);
        Self::build(engine, backends, bootstrap, Some(writer))
    }

    /// Takes back what the journal recorded before a restart — the one
    /// entry point for agents and pending requests — then starts the
    /// timers: first every recorded agent (see [`Engine::recover`]), so
    /// that it holds its capacity again; then the pending requests, with
    /// their original arrival (see [`Engine::recover_pending`]), so they
    /// are served ahead of warm pools and never ahead of the agents that
    /// survived; the first tick comes last.
    pub async fn recover_and_start(&self, recorded: impl Into<Recorded>) -> RecoveryReport {
        let recorded = recorded.into();
        let held: HashSet<JobId> = recorded
            .agents
            .iter()
            .filter_map(|d| d.job.clone())
            .collect();
        let mut report = self.recover(recorded.agents).await;
        self.call_quiet(|e, now| {
            let p = &mut report.pending;
            for (job, why) in recorded.unreadable_pending {
                e.forget_pending_record(job.clone());
                p.dropped.push((job, format!("unreadable record: {why}")));
            }
            for record in recorded.pending {
                let job = record.request.job.clone();
                let held = held.contains(&job);
                match e.recover_pending(record, held, now) {
                    PendingRecovered::Requeued => p.requeued.push(job),
                    PendingRecovered::StandaloneNotRun => p.standalone_failed.push(job),
                    PendingRecovered::Expired => p.expired.push(job),
                    PendingRecovered::AlreadyAdmitted => p.already_admitted.push(job),
                    PendingRecovered::Dropped(why) => p.dropped.push((job, why)),
                }
            }
        });
        self.start_timers();
        report
    }

    fn build(
        engine: Engine,
        backends: Vec<Arc<dyn Backend>>,
        bootstrap: Arc<dyn Bootstrapper>,
        journal: Option<mpsc::UnboundedSender<JournalOp>>,
    ) -> Self {
        let ledger = engine.admission().ledger().cloned();
        let (reports, mut report_rx) = mpsc::unbounded_channel();
        let (events, _) = broadcast::channel(engine.settings().event_buffer.max(1));
        let (job_effects, job_effects_rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            engine: Mutex::new(engine),
            backends: backends.into_iter().map(|b| (b.kind(), b)).collect(),
            bootstrap,
            events,
            next_event: AtomicU64::new(1),
            wake: Notify::new(),
            spawns: Mutex::new(HashMap::new()),
            reports,
            journal,
            job_effects,
            job_effects_rx: Mutex::new(Some(job_effects_rx)),
            settled: Notify::new(),
            stop: watch::Sender::new(false),
            gate: std::sync::OnceLock::new(),
        });
        let rt = Self { inner };
        let reporter = rt.clone();
        let mut stop = rt.inner.stop.subscribe();
        tokio::spawn(async move {
            loop {
                let report = tokio::select! {
                    r = report_rx.recv() => match r {
                        Some(report) => report,
                        None => break,
                    },
                    _ = stop.wait_for(|s| *s) => break,
                };
                reporter.call(|e, now| match report {
                    BackendReport::Exited { agent, detail } => {
                        e.agent_exited(agent, false, detail, now)
                    }
                    BackendReport::BootFailure { agent, detail } => {
                        e.agent_exited(agent, true, detail, now)
                    }
                });
            }
        });
        if let Some(ledger) = ledger {
            // Retries queued ledger releases and reaps expired rows of dead
            // instances; file I/O, so off the async workers.
            let mut stop = rt.inner.stop.subscribe();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(LEDGER_MAINTENANCE);
                loop {
                    tokio::select! {
                        _ = every.tick() => {}
                        _ = stop.wait_for(|s| *s) => break,
                    }
                    let l = ledger.clone();
                    if let Ok(report) = tokio::task::spawn_blocking(move || l.maintain()).await {
                        for (pool, error) in report.errors {
                            tracing::warn!(pool = %pool, error = %error, "machine-pool ledger upkeep failed");
                        }
                    }
                }
            });
        }
        rt
    }

    fn start_timers(&self) {
        let timer = self.clone();
        tokio::spawn(async move { timer.run_timers().await });
    }

    async fn run_timers(&self) {
        // The first tick (warm pools fill from the start) runs once the
        // caller of `start` yields, so a subscriber taken right after
        // `start` sees its events.
        self.call_quiet(tick_now);
        let mut stop = self.inner.stop.subscribe();
        loop {
            let next = self.inner.engine.lock().next_deadline(now());
            let notified = self.inner.wake.notified();
            let deadline = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    // No timer: under tokio's paused test clock a far-off
                    // sleep would make time jump to it.
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = deadline => {}
                _ = notified => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            // Not `call`: that would wake this very loop again at once.
            self.call_quiet(tick_now);
        }
    }

    /// Runs `f` on the engine, then publishes its events and launches its
    /// effects (under the lock, so their order is the engine's order).
    pub fn call<R>(&self, f: impl FnOnce(&mut Engine, Instant) -> R) -> R {
        let result = self.call_quiet(f);
        // Deadlines may have moved: let the timer loop recompute.
        self.inner.wake.notify_one();
        result
    }

    fn call_quiet<R>(&self, f: impl FnOnce(&mut Engine, Instant) -> R) -> R {
        self.call_recorded(|e, now| (f(e, now), None)).0
    }

    /// [`Runtime::call_quiet`] where `f` may name one more journal subject
    /// whose write (if this call made one) the caller waits for.
    fn call_recorded<R>(
        &self,
        f: impl FnOnce(&mut Engine, Instant) -> (R, Option<JournalKey>),
    ) -> (R, Option<RecordAck>) {
        let mut engine = self.inner.engine.lock();
        let (result, wanted) = f(&mut engine, now());
        let events = engine.take_events();
        let entries = engine.take_journal();
        let effects = engine.take_effects();
        let mut acked: Vec<JournalKey> = effects
            .iter()
            .filter_map(|e| match e {
                Effect::Spawn(o) => Some(JournalKey::Agent(o.agent)),
                _ => None,
            })
            .collect();
        acked.extend(wanted.clone());
        let mut acks = self.write_journal(entries, &acked);
        for effect in effects {
            let ack = match &effect {
                Effect::Spawn(order) => acks.remove(&JournalKey::Agent(order.agent)),
                _ => None,
            };
            self.execute(effect, ack);
        }
        // After the effects: an observer that sees an event finds what it
        // made happen already done (a `gone` agent's token revoked).
        for event in events {
            self.publish(event);
        }
        if engine.is_idle() {
            self.inner.settled.notify_waiters();
        }
        drop(engine);
        let ack = wanted.and_then(|key| acks.remove(&key));
        (result, ack)
    }

    /// Queues the engine's store writes in order. The last write of each
    /// subject in `acked` carries an acknowledgement: a spawn waits for its
    /// agent's, so no host resource exists that the store does not know
    /// of; a caller answering "pending" waits for its request's.
    fn write_journal(
        &self,
        entries: Vec<JournalEntry>,
        acked: &[JournalKey],
    ) -> HashMap<JournalKey, RecordAck> {
        let mut acks = HashMap::new();
        let Some(writer) = &self.inner.journal else {
            return acks;
        };
        let at = SystemTime::now();
        // `take_journal` left one entry per subject.
        for entry in entries {
            let key = entry.key();
            let ack = if acked.contains(&key) {
                let (tx, rx) = oneshot::channel();
                acks.insert(key, rx);
                Some(tx)
            } else {
                None
            };
            // The writer ends only after every sender is gone.
            let _ = writer.send(JournalOp::Write { entry, at, ack });
        }
        acks
    }

    /// Waits until every store write made so far was applied; `false` when
    /// some are still waiting for the store to come back.
    pub async fn flush_journal(&self) -> bool {
        let Some(writer) = &self.inner.journal else {
            return true;
        };
        let (tx, rx) = oneshot::channel();
        if writer.send(JournalOp::Flush(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    fn publish(&self, event: EngineEvent) {
        tracing::info!(target: "kici_engine::event", event = ?event, "engine event");
        let id = self.inner.next_event.fetch_add(1, Ordering::Relaxed);
        // No subscriber is fine.
        let _ = self.inner.events.send(Arc::new(SequencedEvent {
            id,
            at: SystemTime::now(),
            event,
        }));
    }

    fn execute(&self, effect: Effect, recorded: Option<RecordAck>) {
        match effect {
            Effect::Spawn(order) => self.launch_spawn(order, recorded),
            Effect::Destroy(order) => self.launch_destroy(order),
            Effect::Revoke(agent) => self.inner.bootstrap.revoke(agent),
            // Told, not broadcast: the coordinator hears every end (it
            // retries what it could not record itself).
            Effect::Ended(ended) => {
                if let Some(coordinator) = self.inner.gate.get().cloned() {
                    tokio::spawn(async move { coordinator.agent_ended(ended).await });
                }
            }
            // The receiver lives as long as the runtime (taken or not).
            Effect::Job(job) => {
                let _ = self.inner.job_effects.send(job);
            }
        }
    }

    /// The standalone jobs' effects ([`JobEffect`]), in the engine's order:
    /// the dispatcher of standalone jobs takes this once, before the
    /// runtime's first tick, and must apply every one. `None` once taken.
    /// (An embedding without standalone jobs never gets any.)
    pub fn job_effects(&self) -> Option<mpsc::UnboundedReceiver<JobEffect>> {
        self.inner.job_effects_rx.lock().take()
    }

    fn launch_spawn(&self, order: SpawnOrder, recorded: Option<RecordAck>) {
        let agent = order.agent;
        let kind = order.scaler().kind;
        let Some(backend) = self.inner.backends.get(&kind).cloned() else {
            // Reported asynchronously so the engine lock is not re-entered.
            let rt = self.clone();
            tokio::spawn(async move {
                rt.call(|e, now| {
                    e.spawn_failed(agent, format!("no {kind} backend is running"), now)
                });
            });
            return;
        };
        let bootstrap = self.inner.bootstrap.bootstrap(&order);
        let spec = SpawnSpec {
            agent,
            scaler: Arc::new(order.scaler().clone()),
            label_set_index: order.label_set_index,
            label_set: order.scaler().label_sets[order.label_set_index].clone(),
            agent_labels: order.agent_labels,
            resources: order.resources,
            job: order.job,
            run_id: order.run_id,
            mode: order.mode,
            warm: order.warm,
            idle_timeout_ms: order.idle_timeout_ms,
            orchestrator_url: bootstrap.orchestrator_url,
            token: bootstrap.token,
            reports: self.inner.reports.clone(),
        };
        let rt = self.clone();
        // Hold the map lock across spawn so the task cannot remove its entry
        // before it is inserted.
        let mut spawns = self.inner.spawns.lock();
        let task = tokio::spawn(async move {
            if let Some(recorded) = recorded {
                let written = recorded
                    .await
                    .unwrap_or_else(|_| Err(JournalError::stopped()));
                if let Err(e) = written {
                    // Nothing was created: a resource the store does not
                    // know of could leak on a crash.
                    rt.inner.spawns.lock().remove(&agent);
                    let detail = format!("not spawned: {}", error_chain(&e));
                    rt.call(|e2, now| e2.spawn_failed(agent, detail, now));
                    return;
                }
            }
            crate::failpoints::hit(crate::failpoints::SPAWN_RECORDED);
            if let Some(gate) = rt.inner.gate.get() {
                if let Err(reason) = gate.may_spawn(agent, spec.job.as_ref()).await {
                    rt.inner.spawns.lock().remove(&agent);
                    let detail = format!("not spawned: {reason}");
                    rt.call(|e2, now| e2.spawn_failed(agent, detail, now));
                    return;
                }
            }
            let result = backend.spawn(spec).await;
            if result.is_ok() {
                crate::failpoints::hit(crate::failpoints::SPAWN_BACKEND_DONE);
            }
            rt.inner.spawns.lock().remove(&agent);
            rt.call(|e, now| match result {
                Ok(handle) => e.spawn_succeeded(agent, handle, now),
                Err(err) => e.spawn_failed(agent, err.to_string(), now),
            });
        });
        spawns.insert(agent, task.abort_handle());
    }

    fn launch_destroy(&self, order: DestroyOrder) {
        // A spawn still in flight is cut short; destroy cleans up by name.
        if let Some(task) = self.inner.spawns.lock().remove(&order.agent) {
            task.abort();
        }
        let agent = order.agent;
        let Some(backend) = self.inner.backends.get(&order.backend).cloned() else {
            let rt = self.clone();
            tokio::spawn(async move { rt.call(|e, now| e.destroy_finished(agent, now)) });
            return;
        };
        let rt = self.clone();
        tokio::spawn(async move {
            // The backend's own grace plus a bound on its API calls.
            let limit = order.grace + Duration::from_secs(30);
            let result = tokio::time::timeout(
                limit,
                backend.destroy_because(&agent, order.handle.as_ref(), order.grace, order.reason),
            )
            .await;
            match result {
                Ok(Ok(())) => {
                    crate::failpoints::hit(crate::failpoints::DESTROY_BACKEND_DONE);
                    // `gone` revokes its token (`Effect::Revoke`).
                    rt.call(|e, now| e.destroy_finished(agent, now));
                }
                Ok(Err(err)) => rt.call(|e, now| e.destroy_failed(agent, err.to_string(), now)),
                Err(_) => rt.call(|e, now| {
                    e.destroy_failed(
                        agent,
                        format!("destroy did not finish within {limit:?}"),
                        now,
                    )
                }),
            }
        });
    }

    // ----- recovery ---------------------------------------------------------

    /// Asks each agent's backend whether it still runs, then hands the
    /// answer to the engine. Agents of a scaler the configuration no longer
    /// has are destroyed directly.
    async fn recover(&self, records: Vec<DurableAgent>) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        // Bounded fan-out: a thousand recorded agents must not open a
        // thousand Engine API connections at once.
        let limit = Arc::new(tokio::sync::Semaphore::new(RECOVERY_PARALLELISM));
        let mut tasks = tokio::task::JoinSet::new();
        for record in records {
            let backend = self.inner.backends.get(&record.backend).cloned();
            let reports = self.inner.reports.clone();
            let limit = limit.clone();
            tasks.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let alive = match &backend {
                    // Recorded while it waited for a spawn slot: its spawn
                    // was never ordered (an order waits for the record of
                    // `provisioning`), so nothing of it can exist.
                    _ if record.state == crate::AgentState::Requested => Ok(false),
                    None => Err(format!("no {} backend is running", record.backend)),
                    Some(b) => {
                        let handle = record.handle.clone().unwrap_or_else(|| ResourceHandle {
                            id: String::new(),
                            extra: Default::default(),
                        });
                        b.adopt(&record.agent, &handle, reports)
                            .await
                            .map(|a| a == Adoption::Alive)
                            .map_err(|e| e.to_string())
                    }
                };
                (record, alive)
            });
        }
        while let Some(joined) = tasks.join_next().await {
            let Ok((record, alive)) = joined else {
                report.errors.push("a recovery task panicked".into());
                continue;
            };
            let agent = record.agent;
            let backend = record.backend;
            let alive = match alive {
                Ok(alive) => alive,
                Err(e) => {
                    // Unknown is treated as alive: it keeps its capacity and
                    // is destroyed by its deadlines, never leaked.
                    report
                        .errors
                        .push(format!("{agent}: cannot tell whether it runs: {e}"));
                    true
                }
            };
            match self.call(|e, now| e.recover(record, alive, now)) {
                Ok(Recovered::Adopted(_)) => report.adopted.push(agent),
                Ok(Recovered::Releasing) => report.released.push(agent),
                Err(RecoverError::UnknownScaler { agent, .. }) => {
                    report.released.push(agent);
                    self.destroy_unmanaged(agent, backend).await;
                }
                Err(e) => report.errors.push(e.to_string()),
            }
        }
        report
    }

    /// Destroys a recorded agent the engine cannot manage (its scaler is
    /// gone from the configuration), then forgets its record.
    async fn destroy_unmanaged(&self, agent: AgentId, backend: ScalerType) {
        let Some(b) = self.inner.backends.get(&backend).cloned() else {
            return;
        };
        let grace = Duration::from_secs(5);
        match b.destroy(&agent, None, grace).await {
            Ok(()) => {
                self.inner.bootstrap.revoke(agent);
                if let Some(writer) = &self.inner.journal {
                    let _ = writer.send(JournalOp::Write {
                        entry: JournalEntry::Forget(agent),
                        at: SystemTime::now(),
                        ack: None,
                    });
                }
            }
            Err(e) => {
                tracing::warn!(agent = %agent, error = %e, "destroying a recovered agent of a removed scaler failed; the reconciler retries");
            }
        }
    }

    /// The agent acknowledged its configuration: its backend's
    /// [`Backend::agent_configured`] (Firecracker clears the MMDS), bounded
    /// by the scaler's API-call deadline. Dispatch waits for this.
    pub async fn agent_configured(&self, agent: AgentId) -> Result<(), crate::BackendError> {
        let found = {
            let engine = self.inner.engine.lock();
            engine.agent_backend(agent)
        };
        let Some((kind, limit)) = found else {
            return Err(crate::BackendError::new(
                crate::BackendErrorKind::Unavailable,
                crate::backend::AgentConfiguredError::NotManaged(agent),
            ));
        };
        let Some(backend) = self.inner.backends.get(&kind).cloned() else {
            return Ok(());
        };
        match tokio::time::timeout(limit, backend.agent_configured(&agent)).await {
            Ok(result) => result,
            Err(_) => Err(crate::BackendError::new(
                crate::BackendErrorKind::TimedOut,
                crate::backend::AgentConfiguredError::TimedOut { agent, limit },
            )),
        }
    }

    /// The backends, for the reconciler.
    pub fn backends(&self) -> Vec<Arc<dyn Backend>> {
        self.inner.backends.values().cloned().collect()
    }

    /// Agents the engine manages now (any state but gone).
    pub fn live_agent_ids(&self) -> std::collections::BTreeSet<AgentId> {
        self.inner.engine.lock().live_agent_ids()
    }

    // ----- the engine's API, async-friendly ---------------------------------

    /// Publishes an event a backend produced outside the engine's state
    /// machine (an external provisioner's event) on the event stream,
    /// numbered like every other.
    pub fn announce(&self, notice: crate::engine::ProvisionNotice) {
        self.publish(EngineEvent::Provision(notice));
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<SequencedEvent>> {
        self.inner.events.subscribe()
    }

    pub fn request_scale(&self, request: ScaleRequest) -> Result<ScaleOutcome, ScaleError> {
        self.call(|e, now| e.request_scale(request, now))
    }

    /// [`Runtime::request_scale`], and — when the request entered the
    /// pending queue just now (a retry of a waiting job is not recorded
    /// again) and the runtime keeps a journal — the acknowledgement of its
    /// record: a caller answers "pending" only once that is committed.
    pub fn request_scale_recorded(
        &self,
        request: ScaleRequest,
    ) -> (Result<ScaleOutcome, ScaleError>, Option<RecordAck>) {
        let job = request.job.clone();
        let (outcome, ack) = self.call_recorded(|e, now| {
            let known = e.is_pending(&job);
            let outcome = e.request_scale(request, now);
            let queued =
                matches!(outcome, Ok(ScaleOutcome::Pending { .. })) && !known && e.is_pending(&job);
            (outcome, queued.then(|| JournalKey::Pending(job.clone())))
        });
        self.inner.wake.notify_one();
        (outcome, ack)
    }

    /// [`Runtime::request_scale`] for a request some other queue keeps:
    /// served now (an agent spawning, or a warm one taken) or not at all —
    /// a request that would wait is not queued here and is answered
    /// `Pending { position: 0 }`, leaving nothing behind.
    pub fn request_scale_now(&self, request: ScaleRequest) -> Result<ScaleOutcome, ScaleError> {
        self.call(|e, now| e.request_scale_now(request, now))
    }

    /// Sets aside what `request` needs here, recording nothing (see
    /// [`Engine::hold`]).
    pub fn hold(&self, request: &ScaleRequest) -> Result<AdmissionHold, HoldRefused> {
        self.call_quiet(|e, now| e.hold(request, now))
    }

    /// Admits the request `hold` was taken for (see [`Engine::admit_held`]).
    pub fn admit_held(&self, hold: AdmissionHold) -> Result<ScaleOutcome, HoldLapsed> {
        self.call(|e, now| e.admit_held(hold, now))
    }

    /// Installs the coordinator every spawn and registration is checked
    /// with (see [`Coordinator`]). `false` if one was installed already.
    pub fn set_coordinator(&self, coordinator: Arc<dyn Coordinator>) -> bool {
        self.inner.gate.set(coordinator).is_ok()
    }

    /// The coordinator installed by [`Runtime::set_coordinator`], if any.
    pub fn coordinator(&self) -> Option<Arc<dyn Coordinator>> {
        self.inner.gate.get().cloned()
    }

    pub fn cancel_scale(&self, job: &JobId) -> bool {
        self.call(|e, now| e.cancel_scale(job, now))
    }

    pub fn agent_registered(&self, agent: AgentId) -> Result<Registration, AgentError> {
        self.call(|e, now| e.agent_registered(agent, now))
    }

    pub fn job_started(&self, agent: AgentId, job: JobId) -> Result<(), AgentError> {
        self.call(|e, now| e.job_started(agent, job, now))
    }

    pub fn job_completed(
        &self,
        agent: AgentId,
        job: &JobId,
        exit_code: Option<i32>,
    ) -> Result<(), AgentError> {
        self.call(|e, now| e.job_completed(agent, job, exit_code, now))
    }

    pub fn agent_disconnected(&self, agent: AgentId) -> Result<(), AgentError> {
        self.call(|e, now| e.agent_disconnected(agent, now))
    }

    pub fn destroy_agent(&self, agent: AgentId) -> Result<(), AgentError> {
        self.call(|e, now| e.destroy_agent(agent, now))
    }

    pub fn cordon(&self, scaler: &str) -> Result<(), AgentError> {
        self.call(|e, _| e.cordon(scaler))
    }

    pub fn uncordon(&self, scaler: &str) -> Result<(), AgentError> {
        self.call(|e, now| e.uncordon(scaler, now))
    }

    pub fn drain(&self, scaler: &str) -> Result<(), AgentError> {
        self.call(|e, now| e.drain(scaler, now))
    }

    pub fn status(&self) -> Status {
        self.call(|e, now| e.status(now))
    }

    pub fn agents(&self, all: bool) -> Vec<AgentView> {
        self.call(|e, now| e.agents(all, now))
    }

    pub fn agent(&self, agent: AgentId) -> Option<AgentView> {
        self.call(|e, now| e.agent(agent, now))
    }

    /// Validates the new config against every backend, then applies it
    /// atomically. On any error nothing changes.
    pub async fn reload(&self, config: Arc<Config>) -> Result<ReloadReport, Vec<String>> {
        let mut errors = Vec::new();
        for scaler in &config.scalers {
            match self.inner.backends.get(&scaler.kind) {
                // Backends start with the daemon, for the types its
                // configuration used then; a reload only swaps the
                // configuration.
                None => errors.push(format!(
                    "{}: scalers[name={}]: the {} backend was not started: the daemon started \
                     without a {} scaler, and a reload cannot start a backend; restart the \
                     daemon to add it",
                    scaler.origin, scaler.name, scaler.kind, scaler.kind
                )),
                Some(b) => {
                    if let Err(errs) = b.validate(scaler).await {
                        errors.extend(
                            errs.into_iter()
                                .map(|e| format!("scalers[name={}]: {e}", scaler.name)),
                        );
                    }
                }
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        self.call(|e, now| e.reload(config, now))
            .map_err(|e: ReloadError| vec![e.to_string()])
    }

    /// Stops the runtime's tasks and leaves every agent as it is: running,
    /// recorded, for the next start to re-adopt (only meaningful with a
    /// journal). Pending store writes are flushed first.
    pub async fn detach(&self) -> bool {
        let flushed = self.flush_journal().await;
        self.inner.stop.send_replace(true);
        flushed
    }

    /// Stops admitting, cancels pending requests, destroys every agent and
    /// waits (up to `limit`) until all are gone. Returns whether all are.
    pub async fn shutdown(&self, limit: Duration) -> bool {
        self.call(|e, now| e.shutdown(now));
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            // Registered before the check, so a release in between wakes it.
            let settled = self.inner.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if self.inner.engine.lock().is_idle() {
                break;
            }
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                break;
            }
        }
        // Every agent's `Forget` reaches the store before the daemon exits.
        let flushed = self.flush_journal().await;
        if !flushed {
            tracing::warn!(
                "state store writes still pending at shutdown; the next start reconciles them"
            );
        }
        self.inner.stop.send_replace(true);
        self.inner.engine.lock().is_idle()
    }
}
