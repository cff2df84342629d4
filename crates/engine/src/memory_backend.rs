//! An in-memory [`Backend`] with failure injection.
//!
//! It stands in for containers, processes and VMs in the engine's own tests
//! (the real backends are tested against the real Docker, processes and the
//! Firecracker simulator in their own crates). It records every call and can
//! be told to fail or hang the next spawns or destroys, or to report an
//! agent's exit.

use crate::backend::{
    Adoption, Backend, BackendError, BackendErrorKind, BackendReport, OwnedResource, ProblemKind,
    ReportSender, ResourceHandle, ScalerProblem, ScalerProblems, SpawnSpec,
};
use async_trait::async_trait;
use kici_model::{AgentId, ScalerEntry, ScalerType};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

#[derive(Default)]
struct State {
    live: BTreeMap<AgentId, SpawnSpec>,
    /// Resources that exist without a spawn of this process (left by an
    /// earlier daemon), with the report channel once adopted.
    survivors: BTreeMap<AgentId, Option<ReportSender>>,
    spawned: Vec<AgentId>,
    destroyed: Vec<AgentId>,
    fail_spawns: u32,
    fail_destroys: u32,
    fail_configured: u32,
    configured: Vec<AgentId>,
    hang_spawns: bool,
    validate_errors: Vec<String>,
}

pub struct MemoryBackend {
    kind: ScalerType,
    state: Mutex<State>,
}

impl MemoryBackend {
    pub fn new(kind: ScalerType) -> Self {
        Self {
            kind,
            state: Mutex::new(State::default()),
        }
    }

    /// The next `n` spawns fail with a provision error.
    pub fn fail_next_spawns(&self, n: u32) {
        self.state.lock().fail_spawns = n;
    }

    /// The next `n` destroys fail (the resource stays).
    pub fn fail_next_destroys(&self, n: u32) {
        self.state.lock().fail_destroys = n;
    }

    /// The next `n` `agent_configured` calls fail (bootstrap data not
    /// cleared).
    pub fn fail_next_configured(&self, n: u32) {
        self.state.lock().fail_configured = n;
    }

    /// Every agent `agent_configured` succeeded for, in order.
    pub fn configured(&self) -> Vec<AgentId> {
        self.state.lock().configured.clone()
    }

    /// Spawns never return (a hung image pull or boot).
    pub fn hang_spawns(&self, hang: bool) {
        self.state.lock().hang_spawns = hang;
    }

    /// `validate` reports these errors for every scaler.
    pub fn set_validate_errors(&self, errors: Vec<String>) {
        self.state.lock().validate_errors = errors;
    }

    /// Agents whose resource exists now.
    pub fn live(&self) -> Vec<AgentId> {
        self.state.lock().live.keys().copied().collect()
    }

    /// The spec of a live agent.
    pub fn spec(&self, agent: AgentId) -> Option<SpawnSpec> {
        self.state.lock().live.get(&agent).cloned()
    }

    /// Every agent `spawn` was called for, in order.
    pub fn spawned(&self) -> Vec<AgentId> {
        self.state.lock().spawned.clone()
    }

    /// Every agent whose destroy succeeded, in order.
    pub fn destroyed(&self) -> Vec<AgentId> {
        self.state.lock().destroyed.clone()
    }

    /// A resource left on the "host" by an earlier daemon: `list_owned`
    /// finds it and `adopt` reports it alive.
    pub fn plant(&self, agent: AgentId) {
        self.state.lock().survivors.insert(agent, None);
    }

    /// The agent's process ends by itself (reported, resource kept until destroy).
    pub fn exit(&self, agent: AgentId, detail: &str) -> bool {
        let state = self.state.lock();
        let reports = match state.live.get(&agent) {
            Some(spec) => &spec.reports,
            None => match state.survivors.get(&agent) {
                Some(Some(reports)) => reports,
                _ => return false,
            },
        };
        reports
            .send(BackendReport::Exited {
                agent,
                detail: detail.to_owned(),
            })
            .is_ok()
    }
}

/// The failures a test makes the memory backend report, each with the kind
/// a real backend would report it with.
#[derive(Debug, thiserror::Error)]
pub enum InjectedFailure {
    #[error("injected spawn failure")]
    Spawn,
    #[error("injected destroy failure")]
    Destroy,
    #[error("injected: bootstrap data not cleared")]
    Configured,
    /// A validation problem, as the test worded it.
    #[error("{0}")]
    Validation(String),
}

#[async_trait]
impl Backend for MemoryBackend {
    fn kind(&self) -> ScalerType {
        self.kind
    }

    async fn validate(&self, _scaler: &ScalerEntry) -> Result<(), ScalerProblems> {
        let errors = self.state.lock().validate_errors.clone();
        ScalerProblems::check(
            errors
                .into_iter()
                .map(|e| ScalerProblem::new(ProblemKind::Host, InjectedFailure::Validation(e)))
                .collect(),
        )
    }

    async fn spawn(&self, spec: SpawnSpec) -> Result<ResourceHandle, BackendError> {
        let hang = {
            let mut s = self.state.lock();
            s.spawned.push(spec.agent);
            if s.fail_spawns > 0 {
                s.fail_spawns -= 1;
                return Err(BackendError::new(
                    BackendErrorKind::Provision,
                    InjectedFailure::Spawn,
                ));
            }
            s.hang_spawns
        };
        if hang {
            std::future::pending::<()>().await;
        }
        let handle = ResourceHandle {
            id: format!("mem-{}", spec.agent),
            extra: BTreeMap::new(),
        };
        self.state.lock().live.insert(spec.agent, spec);
        Ok(handle)
    }

    async fn destroy(
        &self,
        agent: &AgentId,
        _handle: Option<&ResourceHandle>,
        _grace: Duration,
    ) -> Result<(), BackendError> {
        let mut s = self.state.lock();
        if s.fail_destroys > 0 {
            s.fail_destroys -= 1;
            return Err(BackendError::new(
                BackendErrorKind::Destroy,
                InjectedFailure::Destroy,
            ));
        }
        s.live.remove(agent);
        s.survivors.remove(agent);
        s.destroyed.push(*agent);
        Ok(())
    }

    async fn list_owned(&self) -> Result<Vec<OwnedResource>, BackendError> {
        let s = self.state.lock();
        Ok(s.live
            .keys()
            .chain(s.survivors.keys())
            .map(|a| OwnedResource {
                agent: Some(*a),
                handle: ResourceHandle {
                    id: format!("mem-{a}"),
                    extra: BTreeMap::new(),
                },
                created_at: SystemTime::now(),
            })
            .collect())
    }

    async fn agent_configured(&self, agent: &AgentId) -> Result<(), BackendError> {
        let mut s = self.state.lock();
        if s.fail_configured > 0 {
            s.fail_configured -= 1;
            return Err(BackendError::new(
                BackendErrorKind::Unavailable,
                InjectedFailure::Configured,
            ));
        }
        s.configured.push(*agent);
        Ok(())
    }

    async fn adopt(
        &self,
        agent: &AgentId,
        _handle: &ResourceHandle,
        reports: ReportSender,
    ) -> Result<Adoption, BackendError> {
        let mut s = self.state.lock();
        match s.survivors.get_mut(agent) {
            Some(slot) => {
                *slot = Some(reports);
                Ok(Adoption::Alive)
            }
            None => Ok(Adoption::Gone),
        }
    }
}
