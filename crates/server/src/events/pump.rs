//! Fans the engine's event stream out to observers: the SSE replay
//! buffer, the metrics and one structured log line per event with
//! `agent_id`, `scaler` and `job_id` as fields; with a state store, through
//! the [`Persister`] (events recorded before readers see them).
//!
//! Nothing that must happen depends on this stream: a pump that falls
//! behind loses events (SSE readers see a `reset`), never an agent's or a
//! job's end. Control — spawns, destroys, token revocation, standalone
//! jobs' dispatch and end — flows through the engine's effects.

use crate::durable::persist::Persister;
use crate::events::metrics::Metrics;
use crate::events::{EventLog, LoggedEvent};
use kici_engine::runtime::{Runtime, SequencedEvent};
use kici_engine::EngineEvent;
use std::sync::Arc;
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;

/// How long the last events may take to reach the store at a stop.
const FLUSH_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The running pump.
pub struct Pump {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Pump {
    /// Subscribes to `runtime` and starts fanning out.
    pub fn start(runtime: &Runtime, log: Arc<EventLog>, metrics: Arc<Metrics>) -> Self {
        Self::start_recorded(runtime, log, metrics, None)
    }

    /// [`Pump::start`] with a state store: events are numbered after
    /// `last_recorded` (the highest id recorded before this start) and
    /// reach the log through `persister` once recorded; each request that
    /// leaves the pending queue has its record deleted.
    pub fn start_recorded(
        runtime: &Runtime,
        log: Arc<EventLog>,
        metrics: Arc<Metrics>,
        recorded: Option<(Persister, u64)>,
    ) -> Self {
        let mut rx = runtime.subscribe();
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let base = recorded.as_ref().map_or(0, |(_, base)| *base);
            let persister = recorded.map(|(p, _)| p);
            let handle = |event: Arc<SequencedEvent>| {
                metrics.observe(&event);
                log_event(&event);
                let logged = LoggedEvent::render(base + event.id, &event);
                match &persister {
                    Some(p) => p.event(logged, event.at),
                    None => log.push(Arc::new(logged)),
                }
            };
            loop {
                tokio::select! {
                    biased;
                    received = rx.recv() => match received {
                        Ok(event) => handle(event),
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            // Readers see the hole as a `reset`; nothing
                            // else depends on these events.
                            tracing::warn!(missed = n, "event pump fell behind; events dropped");
                        }
                        Err(broadcast::error::RecvError::Closed) => break,
                    },
                    _ = &mut stopped => {
                        // Everything already published is delivered first.
                        while let Ok(event) = rx.try_recv() {
                            handle(event);
                        }
                        break;
                    }
                }
            }
            if let Some(p) = persister {
                if !p.finish(FLUSH_LIMIT).await {
                    tracing::warn!(
                        "not every event or pending-request change was recorded before the stop"
                    );
                }
            }
            log.close();
        });
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// Delivers what was published so far, closes the event log (SSE
    /// streams end) and stops.
    pub async fn finish(mut self) {
        if let Some(stop) = self.stop.take() {
            // The task may already have ended (channel closed): fine.
            let _ = stop.send(());
        }
        if let Err(e) = (&mut self.task).await {
            tracing::error!(error = %e, "event pump failed");
        }
    }
}

fn log_event(e: &SequencedEvent) {
    match &e.event {
        EngineEvent::AgentTransition {
            agent_id,
            scaler,
            backend,
            from,
            to,
            job_id,
            failure_reason,
            cause,
            detail,
            seconds_in_state,
        } => {
            let job_id = job_id.as_ref().map(|j| j.as_str());
            let failure = failure_reason.map(|r| r.as_str());
            if failure.is_some() {
                tracing::warn!(
                    event_id = e.id, agent_id = %agent_id, scaler = %scaler, backend = %backend,
                    job_id, from = %from, to = %to, failure_reason = failure, cause = cause.map(|c| c.as_str()),
                    detail = detail.as_deref(), seconds_in_state = *seconds_in_state,
                    "agent failed"
                );
            } else {
                tracing::info!(
                    event_id = e.id, agent_id = %agent_id, scaler = %scaler, backend = %backend,
                    job_id, from = %from, to = %to, cause = cause.map(|c| c.as_str()),
                    detail = detail.as_deref(), seconds_in_state = *seconds_in_state,
                    "agent state changed"
                );
            }
        }
        EngineEvent::Refused {
            job_id,
            scaler,
            cap,
            detail,
        } => tracing::info!(
            event_id = e.id, job_id = %job_id, scaler = %scaler, cap = %cap, detail = %detail,
            "scale request waits for capacity"
        ),
        EngineEvent::PendingEnded {
            job_id,
            scaler,
            end,
            waited_seconds,
        } => tracing::info!(
            event_id = e.id, job_id = %job_id, scaler = %scaler, end = end.as_str(),
            waited_seconds = *waited_seconds, "scale request left the pending queue"
        ),
        EngineEvent::BreakerChanged {
            scaler,
            label_set,
            state,
        } => tracing::warn!(
            event_id = e.id, scaler = %scaler, label_set = *label_set, state = state.as_str(),
            "spawn circuit breaker changed"
        ),
        EngineEvent::ScalerCordon {
            scaler,
            cordoned,
            draining,
        } => tracing::info!(
            event_id = e.id, scaler = %scaler, cordoned = *cordoned, draining = *draining,
            "scaler switches changed"
        ),
        EngineEvent::Reloaded { added, removed } => tracing::info!(
            event_id = e.id, added = ?added, removed = ?removed, "engine reloaded"
        ),
        EngineEvent::Provision(kici_engine::ProvisionNotice::ScaleUp {
            request_id,
            agent_id,
            scaler,
            job_id,
            ..
        }) => tracing::info!(
            event_id = e.id, agent_id = %agent_id, scaler = %scaler, request_id = %request_id,
            job_id = job_id.as_ref().map(|j| j.as_str()), "scale-up event emitted"
        ),
        EngineEvent::Provision(kici_engine::ProvisionNotice::ScaleDown {
            request_id,
            agent_id,
            scaler,
            reason,
        }) => tracing::info!(
            event_id = e.id, agent_id = %agent_id, scaler = %scaler, request_id = %request_id,
            reason = %reason, "scale-down event emitted"
        ),
    }
}
