//! The async driver: runs the engine's effects against backends, feeds their
//! results back, and fires the engine's timers.
//!
//! All engine calls go through [`Runtime::call`], which locks the engine,
//! passes it `now`, and — still under the lock, so that order is kept —
//! publishes the recorded events and launches the recorded effects. Time is
//! tokio's, so tests run with paused time and never sleep.

use crate::backend::{Backend, BackendReport, SpawnSpec};
use crate::engine::{
    AgentError, AgentView, DestroyOrder, Effect, Engine, EngineEvent, Registration, ReloadError,
    ReloadReport, ScaleError, ScaleOutcome, SpawnOrder, Status,
};
use crate::pending::ScaleRequest;
use kici_model::{AgentId, Config, JobId, ScalerType, Secret};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{broadcast, mpsc, watch, Notify};
use tokio::task::AbortHandle;

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

/// An event with its stream position (the SSE `id`) and wall-clock time.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SequencedEvent {
    pub id: u64,
    #[serde(serialize_with = "ser_time")]
    pub at: SystemTime,
    #[serde(flatten)]
    pub event: EngineEvent,
}

fn ser_time<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    let ms = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    s.serialize_u128(ms)
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
    /// Set once by `shutdown`; every background task ends when it flips.
    stop: watch::Sender<bool>,
}

/// A cheap, cloneable handle on the running engine.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl Runtime {
    /// Starts the timer and report tasks on the current tokio runtime.
    pub fn start(
        engine: Engine,
        backends: Vec<Arc<dyn Backend>>,
        bootstrap: Arc<dyn Bootstrapper>,
    ) -> Self {
        let ledger = engine.admission().ledger().cloned();
        let (reports, mut report_rx) = mpsc::unbounded_channel();
        let (events, _) = broadcast::channel(4096);
        let inner = Arc::new(Inner {
            engine: Mutex::new(engine),
            backends: backends.into_iter().map(|b| (b.kind(), b)).collect(),
            bootstrap,
            events,
            next_event: AtomicU64::new(1),
            wake: Notify::new(),
            spawns: Mutex::new(HashMap::new()),
            reports,
            stop: watch::Sender::new(false),
        });
        let rt = Self { inner };
        let timer = rt.clone();
        tokio::spawn(async move { timer.run_timers().await });
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

    async fn run_timers(&self) {
        // The first tick (warm pools fill from the start) runs once the
        // caller of `start` yields, so a subscriber taken right after
        // `start` sees its events.
        self.call_quiet(|e, now| e.tick(now));
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
            self.call_quiet(|e, now| e.tick(now));
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
        let mut engine = self.inner.engine.lock();
        let result = f(&mut engine, now());
        for event in engine.take_events() {
            self.publish(event);
        }
        for effect in engine.take_effects() {
            self.execute(effect);
        }
        drop(engine);
        result
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

    fn execute(&self, effect: Effect) {
        match effect {
            Effect::Spawn(order) => self.launch_spawn(order),
            Effect::Destroy(order) => self.launch_destroy(order),
        }
    }

    fn launch_spawn(&self, order: SpawnOrder) {
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
            let result = backend.spawn(spec).await;
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
                backend.destroy(&agent, order.handle.as_ref(), order.grace),
            )
            .await;
            match result {
                Ok(Ok(())) => {
                    rt.inner.bootstrap.revoke(agent);
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

    // ----- the engine's API, async-friendly ---------------------------------

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<SequencedEvent>> {
        self.inner.events.subscribe()
    }

    pub fn request_scale(&self, request: ScaleRequest) -> Result<ScaleOutcome, ScaleError> {
        self.call(|e, now| e.request_scale(request, now))
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
                None => errors.push(format!(
                    "scalers[name={}]: no {} backend is available on this host",
                    scaler.name, scaler.kind
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

    /// Stops admitting, cancels pending requests, destroys every agent and
    /// waits (up to `limit`) until all are gone. Returns whether all are.
    pub async fn shutdown(&self, limit: Duration) -> bool {
        let mut events = self.subscribe();
        self.call(|e, now| e.shutdown(now));
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if self.inner.engine.lock().is_idle() {
                break;
            }
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Err(_) => break,
                Ok(Err(broadcast::error::RecvError::Closed)) => break,
                Ok(_) => {}
            }
        }
        self.inner.stop.send_replace(true);
        self.inner.engine.lock().is_idle()
    }
}
