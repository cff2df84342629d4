//! [`EventBackend`]: the engine's backend for `type: event` scalers. It runs
//! nothing on this host.
//!
//! - **spawn**: issue a claim (its hash in the store), record the scale-up
//!   in the outbox, put it on the event stream, deliver it to the scaler's
//!   provisioner. Delivered = spawned: the agent stays `provisioning` until
//!   it registers (the engine frees its spawn slot and starts the
//!   registration deadline); a delivery that gives up is a spawn failure
//!   (backoff, breaker) and the engine's destroy follows.
//! - **destroy**: record the scale-down (with the engine's reason), void
//!   the agent's claims, put it on the stream, deliver it; once confirmed
//!   the agent's outbox rows go. Unconfirmed, the destroy fails (the engine
//!   retries it) and the rows stay for the next start and the reconciler.
//!   An agent with nothing recorded (its spawn never got as far as a
//!   scale-up, or its scale-down was already confirmed) has nothing to
//!   tear down.
//! - **list_owned**: every agent with outbox rows (a scale-up whose
//!   scale-down was never confirmed): an instance that may still exist.

use crate::provisioning::hub::{stored, Provisioning};
use async_trait::async_trait;
use kici_engine::{
    Adoption, Backend, BackendError, BackendErrorKind, DestroyReason, FailureReason, OwnedResource,
    ProblemKind, ResourceHandle, ScalerProblem, ScalerProblems, SpawnSpec, StopCause,
};
use kici_model::{AgentId, BackendSettings, ProvisionerSettings, ScalerEntry, ScalerType};
use kici_provision::{
    ClaimRecord, ClaimSpec, ClaimStore, Deliverer, EventKind, EventResources, ProvisionEvent,
    RequestId, ScaleDown, ScaleDownReason, ScaleUp, Timestamp,
};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

/// The backend of every `type: event` scaler of the daemon.
#[derive(Clone)]
pub struct EventBackend {
    hub: Arc<Provisioning>,
}

/// What went wrong, as the backend's own typed error.
#[derive(Debug, thiserror::Error)]
pub enum EventBackendError {
    #[error("scaler {0} is not a type: event scaler")]
    NotEvent(String),
    #[error("the daemon did not finish starting")]
    NotBound,
    #[error("state store: {0}")]
    Store(String),
    #[error("provisioner: {0}")]
    Provisioner(String),
    #[error("the scale-up was not delivered: {0}")]
    ScaleUpUndelivered(String),
    #[error("the scale-down was not delivered: {0}")]
    ScaleDownUndelivered(String),
}

fn err(kind: BackendErrorKind, e: EventBackendError) -> BackendError {
    BackendError::new(kind, e)
}

/// The engine's reason, as the scale-down says it.
pub fn scale_down_reason(reason: DestroyReason) -> ScaleDownReason {
    match reason {
        DestroyReason::Failed(f) => match f {
            FailureReason::RegistrationTimeout | FailureReason::ProvisionTimeout => {
                ScaleDownReason::SpawnTimeout
            }
            FailureReason::ProvisionError | FailureReason::BootFailure => {
                ScaleDownReason::SpawnFailed
            }
            FailureReason::ExitedEarly => ScaleDownReason::Disconnect,
            FailureReason::LifetimeExceeded => ScaleDownReason::LifetimeExceeded,
            FailureReason::PendingDispatchTimeout => ScaleDownReason::PendingDispatchTimeout,
        },
        DestroyReason::Stopped(c) => match c {
            StopCause::JobDone => ScaleDownReason::JobEnd,
            StopCause::Disconnected => ScaleDownReason::Disconnect,
            StopCause::Operator => ScaleDownReason::Operator,
            StopCause::Shutdown => ScaleDownReason::Shutdown,
            StopCause::IdleExpired | StopCause::ScaleIn => ScaleDownReason::Idle,
            StopCause::Removed => ScaleDownReason::Drain,
            StopCause::Cancelled => ScaleDownReason::Cancelled,
            StopCause::Recovered => ScaleDownReason::Orphaned,
        },
        DestroyReason::JobCompleted => ScaleDownReason::JobEnd,
    }
}

/// The delivery targets of a scaler's `provisioner` block (`None`: the
/// event stream only). The webhook secret and the command's `passEnv`
/// variables are read from the environment.
pub fn deliverer(p: &ProvisionerSettings) -> Result<Deliverer, String> {
    let mut block = serde_json::Map::new();
    if let Some(argv) = p.target.command() {
        block.insert("command".into(), argv.into());
    }
    if let Some(w) = p.target.webhook() {
        block.insert(
            "webhook".into(),
            serde_json::json!({"url": w.url, "secretEnv": w.secret_env}),
        );
    }
    if !p.env.is_empty() {
        block.insert("env".into(), serde_json::json!(p.env));
    }
    if !p.pass_env.is_empty() {
        block.insert("passEnv".into(), serde_json::json!(p.pass_env));
    }
    block.insert("timeoutSeconds".into(), p.timeout.as_secs().max(1).into());
    block.insert("maxAttempts".into(), p.max_attempts.into());
    let config = kici_provision::parse_provisioner(&serde_json::Value::Object(block))
        .map_err(|e| e.to_string())?;
    Deliverer::new(&config, |name| std::env::var(name).ok()).map_err(|e| e.to_string())
}

fn deliverer_of(scaler: &ScalerEntry) -> Result<Option<Deliverer>, EventBackendError> {
    match &scaler.backend {
        BackendSettings::Event(es) => match &es.provisioner {
            None => Ok(None),
            Some(p) => deliverer(p)
                .map(Some)
                .map_err(EventBackendError::Provisioner),
        },
        _ => Err(EventBackendError::NotEvent(scaler.name.to_string())),
    }
}

impl EventBackend {
    pub fn new(hub: Arc<Provisioning>) -> Self {
        Self { hub }
    }

    pub fn hub(&self) -> &Arc<Provisioning> {
        &self.hub
    }

    async fn scale_down(
        &self,
        agent: &AgentId,
        reason: ScaleDownReason,
    ) -> Result<(), BackendError> {
        let hub = &self.hub;
        let lock = hub.agent_lock(*agent);
        let _held = lock.lock().await;
        let store_err = |e: kici_store::StoreError| {
            err(
                BackendErrorKind::Unavailable,
                EventBackendError::Store(e.to_string()),
            )
        };
        let rows: Vec<_> = hub
            .store
            .outbox()
            .await
            .map_err(store_err)?
            .into_iter()
            .filter(|r| r.agent_id == *agent)
            .collect();
        // The code dies with the agent, first: nothing can redeem it while
        // the teardown is under way.
        if let Err(e) = hub.claims.invalidate(&agent.to_string()).await {
            tracing::warn!(agent_id = %agent, error = %e, "cannot void the agent's claim code; it stays single-use and expires");
        }
        let Some(up) = rows.iter().find(|r| r.kind == EventKind::ScaleUp.as_str()) else {
            // No scale-up on record: nothing was asked for, or its
            // scale-down was confirmed already.
            hub.forget_lock(*agent);
            return Ok(());
        };
        // A scale-down recorded earlier (before a restart) is sent as it
        // was, with its first reason.
        let recorded = rows
            .iter()
            .find(|r| r.kind == EventKind::ScaleDown.as_str())
            .and_then(|r| hub.rebuild(r));
        let scaler = hub
            .rebuild(up)
            .map(|e| e.scaler().to_owned())
            .unwrap_or_default();
        let event = match recorded {
            Some(e) => e,
            None => {
                let e = ProvisionEvent::ScaleDown(ScaleDown {
                    request_id: RequestId::derive(
                        &hub.instance.to_string(),
                        &agent.to_string(),
                        EventKind::ScaleDown,
                    ),
                    agent_id: agent.to_string(),
                    scaler: scaler.clone(),
                    reason,
                });
                hub.record(&e, kici_store::UnixMillis::now())
                    .await
                    .map_err(store_err)?;
                e
            }
        };
        let binding = hub
            .binding()
            .await
            .ok_or_else(|| err(BackendErrorKind::Unavailable, EventBackendError::NotBound))?;
        hub.announce(&binding, &event);
        // The scaler's current provisioner (a reload may have changed it;
        // one removed by a reload leaves the event stream only).
        let config_scaler = binding
            .runtime
            .call(|e, _| e.config().scaler(&scaler).cloned());
        let deliverer = match config_scaler.as_ref().map(deliverer_of) {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(err(BackendErrorKind::Destroy, e)),
            None => None,
        };
        hub.deliver(deliverer.as_ref(), &event)
            .await
            .map_err(|why| {
                err(
                    BackendErrorKind::Destroy,
                    EventBackendError::ScaleDownUndelivered(why),
                )
            })?;
        if let Err(e) = hub.store.delete_outbox_agent(agent).await {
            tracing::warn!(agent_id = %agent, error = %e, "cannot clear the agent's provisioner outbox; the reconciler will send its scale-down again");
        }
        hub.forget_lock(*agent);
        Ok(())
    }
}

#[async_trait]
impl Backend for EventBackend {
    fn kind(&self) -> ScalerType {
        ScalerType::Event
    }

    async fn validate(&self, scaler: &ScalerEntry) -> Result<(), ScalerProblems> {
        match deliverer_of(scaler) {
            Ok(_) => Ok(()),
            Err(e) => Err(ScalerProblem::new(ProblemKind::Setting, e).into()),
        }
    }

    async fn spawn(&self, spec: SpawnSpec) -> Result<ResourceHandle, BackendError> {
        let hub = &self.hub;
        let agent = spec.agent;
        let scaler = &spec.scaler;
        let BackendSettings::Event(es) = &scaler.backend else {
            return Err(err(
                BackendErrorKind::Provision,
                EventBackendError::NotEvent(scaler.name.to_string()),
            ));
        };
        let deliverer = deliverer_of(scaler).map_err(|e| err(BackendErrorKind::Provision, e))?;
        let binding = hub
            .binding()
            .await
            .ok_or_else(|| err(BackendErrorKind::Unavailable, EventBackendError::NotBound))?;
        let lock = hub.agent_lock(agent);
        let _held = lock.lock().await;
        let now = Timestamp::now();
        let (code, record) = ClaimRecord::issue_derived(
            ClaimSpec {
                agent_id: agent.to_string(),
                scaler: scaler.name.to_string(),
                labels: spec.agent_labels.clone(),
                gateway_url: spec.orchestrator_url.clone(),
                agent_token_ttl: es
                    .agent_token_ttl
                    .unwrap_or(scaler.ext.deadlines.max_lifetime),
                claim_ttl: es.claim_ttl,
            },
            &hub.key,
            now,
        );
        let expires_at = record.expires_at;
        let store_err = |e: String| err(BackendErrorKind::Provision, EventBackendError::Store(e));
        // Old claims go as new ones come: a day past their expiry.
        let _ = hub
            .claims
            .purge(Timestamp::from_unix_millis(
                now.unix_millis().saturating_sub(86_400_000),
            ))
            .await;
        hub.claims
            .insert(record)
            .await
            .map_err(|e| store_err(e.to_string()))?;
        let event = ProvisionEvent::ScaleUp(ScaleUp {
            request_id: RequestId::derive(
                &hub.instance.to_string(),
                &agent.to_string(),
                EventKind::ScaleUp,
            ),
            agent_id: agent.to_string(),
            scaler: scaler.name.to_string(),
            labels: spec.agent_labels.clone(),
            resources: EventResources::from(&spec.resources),
            claim_code: code,
            claim_url: binding.claim_url.clone(),
            expires_at,
            job_id: spec.job.as_ref().map(ToString::to_string),
        });
        // Recorded before it is delivered: a crash from here on leaves a
        // row to deliver again and an instance to tear down.
        hub.record(&event, stored(now))
            .await
            .map_err(|e| store_err(e.to_string()))?;
        hub.announce(&binding, &event);
        hub.deliver(deliverer.as_ref(), &event)
            .await
            .map_err(|why| {
                err(
                    BackendErrorKind::Provision,
                    EventBackendError::ScaleUpUndelivered(why),
                )
            })?;
        Ok(ResourceHandle {
            id: event.request_id().to_string(),
            extra: Default::default(),
        })
    }

    async fn destroy(
        &self,
        agent: &AgentId,
        _handle: Option<&ResourceHandle>,
        _grace: Duration,
    ) -> Result<(), BackendError> {
        // Called without a reason by the reconciler (an instance no live
        // agent owns) and by sweeps.
        self.scale_down(agent, ScaleDownReason::Orphaned).await
    }

    async fn destroy_because(
        &self,
        agent: &AgentId,
        _handle: Option<&ResourceHandle>,
        _grace: Duration,
        reason: DestroyReason,
    ) -> Result<(), BackendError> {
        self.scale_down(agent, scale_down_reason(reason)).await
    }

    async fn list_owned(&self) -> Result<Vec<OwnedResource>, BackendError> {
        let rows = self.hub.store.outbox().await.map_err(|e| {
            err(
                BackendErrorKind::Unavailable,
                EventBackendError::Store(e.to_string()),
            )
        })?;
        Ok(rows
            .into_iter()
            .filter(|r| r.kind == EventKind::ScaleUp.as_str())
            .map(|r| OwnedResource {
                agent: Some(r.agent_id),
                handle: ResourceHandle {
                    id: r.request_id,
                    extra: Default::default(),
                },
                created_at: UNIX_EPOCH
                    + Duration::from_millis(u64::try_from(r.created_at.0).unwrap_or(0)),
            })
            .collect())
    }

    async fn adopt(
        &self,
        agent: &AgentId,
        _handle: &ResourceHandle,
        _reports: kici_engine::backend::ReportSender,
    ) -> Result<Adoption, BackendError> {
        // The instance is elsewhere: it is as alive as its scale-up is
        // unretracted. Whether it registers again is the engine's deadline.
        let rows = self.hub.store.outbox().await.map_err(|e| {
            err(
                BackendErrorKind::Unavailable,
                EventBackendError::Store(e.to_string()),
            )
        })?;
        let up = rows
            .iter()
            .any(|r| r.agent_id == *agent && r.kind == EventKind::ScaleUp.as_str());
        let down = rows
            .iter()
            .any(|r| r.agent_id == *agent && r.kind == EventKind::ScaleDown.as_str());
        Ok(if up && !down {
            Adoption::Alive
        } else {
            Adoption::Gone
        })
    }
}
