//! What the engine writes down about agents, and taking agents back after a
//! restart.
//!
//! Every transition and every new resource handle of an agent produces a
//! [`JournalEntry`]: the agent's [`DurableAgent`] snapshot, or `Forget` once
//! it is gone. The runtime hands them, in order, to the state store. After a
//! crash, [`Engine::recover`] turns each recorded agent back into a managed
//! one: its reservation is re-established once (without cap checks — it runs
//! whether or not it fits), and its state is chosen so that nothing it was
//! doing is silently repeated.

use super::{Agent, Engine};
use crate::backend::ResourceHandle;
use crate::lifecycle::{AgentEvent, AgentState, FailureReason, Mode, StopCause};
use kici_admission::{AdmitError, Demand};
use kici_model::{AgentId, JobId, LabelSet, Resources, ScalerName, ScalerType};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything needed to take an agent back after a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurableAgent {
    pub agent: AgentId,
    pub scaler: ScalerName,
    pub backend: ScalerType,
    pub label_set_index: usize,
    /// The label set's normalised labels: the index alone would point at
    /// another label set after a reload reordered them.
    pub label_set: LabelSet,
    pub state: AgentState,
    pub job: Option<JobId>,
    pub run_id: Option<String>,
    pub mode: Mode,
    pub warm: bool,
    pub requests: Resources,
    pub machine_pool: Option<String>,
    pub handle: Option<ResourceHandle>,
    pub failure: Option<FailureReason>,
    /// How old the agent is at the moment of the snapshot (the runtime
    /// turns it into a wall-clock creation time; `maxLifetime` counts from it).
    pub age: Duration,
}

/// One write for the state store, in the order the engine made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JournalEntry {
    Save(Box<DurableAgent>),
    Forget(AgentId),
}

impl JournalEntry {
    pub fn agent(&self) -> AgentId {
        match self {
            Self::Save(d) => d.agent,
            Self::Forget(a) => *a,
        }
    }
}

/// What [`Engine::recover`] made of a recorded agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovered {
    /// Managed again, in this state.
    Adopted(AgentState),
    /// Its resource is gone (or it was leaving anyway): destroy is issued to
    /// remove what remains, then it is forgotten.
    Releasing,
}

#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("agent {0} is already managed")]
    Duplicate(AgentId),
    #[error("agent {agent}: scaler `{scaler}` is not in the configuration; destroy it directly")]
    UnknownScaler { agent: AgentId, scaler: ScalerName },
    #[error("agent {agent}: re-establishing its reservation failed: {source}")]
    Reservation {
        agent: AgentId,
        #[source]
        source: AdmitError,
    },
}

impl Engine {
    /// The store writes produced since the last call, in order, one per
    /// agent: each entry is the agent's whole durable state, so only its
    /// last one matters, and a spawn then waits for one store write instead
    /// of one per state it passed through within the same call.
    pub fn take_journal(&mut self) -> Vec<JournalEntry> {
        let mut entries = std::mem::take(&mut self.journal);
        if entries.len() > 1 {
            let mut seen = std::collections::HashSet::with_capacity(entries.len());
            // Walking backwards keeps each agent's last entry; the survivors
            // keep their relative order.
            entries.reverse();
            entries.retain(|e| seen.insert(e.agent()));
            entries.reverse();
        }
        entries
    }

    /// `KICI_LABELS` of a managed agent (what its token authorises), for
    /// re-issuing a recovered agent's token scope.
    pub fn agent_labels_of(&self, id: AgentId) -> Option<Vec<String>> {
        let a = self.agents.get(&id)?;
        if !Arc::ptr_eq(&a.config, &self.config) {
            // Created under an older config: its scaler index may not match
            // the router's; the labels would be wrong, so say nothing.
            return None;
        }
        Some(self.router.agent_labels(a.scaler_index, a.label_set))
    }

    /// A managed agent's backend type and its scaler's API-call deadline.
    pub fn agent_backend(&self, id: AgentId) -> Option<(ScalerType, std::time::Duration)> {
        let a = self.agents.get(&id)?;
        Some((a.scaler().kind, a.scaler().ext.deadlines.api_call))
    }

    /// The agent's current snapshot.
    pub fn durable(&self, id: AgentId, now: Instant) -> Option<DurableAgent> {
        self.agents.get(&id).map(|a| snapshot(a, now))
    }

    pub(super) fn journal_agent(&mut self, id: AgentId, now: Instant) {
        let entry = match self.agents.get(&id) {
            Some(a) if a.state != AgentState::Gone => {
                JournalEntry::Save(Box::new(snapshot(a, now)))
            }
            _ => JournalEntry::Forget(id),
        };
        self.journal.push(entry);
    }

    /// Takes back an agent recorded by an earlier run of this instance.
    ///
    /// `alive` is the backend's answer to `adopt`. A live agent keeps
    /// running and counts against the caps again; which state it resumes in:
    ///
    /// - brought up but not yet registered → `booted` (the registration
    ///   deadline starts over);
    /// - orchestrator mode, registered / idle / busy → the same state: its
    ///   connection is to the orchestrator, which our crash did not touch;
    /// - standalone mode with a job → destroyed: the job's connection and
    ///   output were this daemon's and died with it, and running the job a
    ///   second time is not ours to decide;
    /// - standalone warm (no job) → `booted`: the agent reconnects and
    ///   registers again;
    /// - draining or destroying → destroyed.
    ///
    /// A dead agent is destroyed (removing whatever its resource left) and
    /// then forgotten; it holds no reservation.
    pub fn recover(
        &mut self,
        record: DurableAgent,
        alive: bool,
        now: Instant,
    ) -> Result<Recovered, RecoverError> {
        let id = record.agent;
        if self.agents.contains_key(&id) {
            return Err(RecoverError::Duplicate(id));
        }
        let config = Arc::clone(&self.config);
        let Some(scaler_index) = config.scalers.iter().position(|s| s.name == record.scaler) else {
            return Err(RecoverError::UnknownScaler {
                agent: id,
                scaler: record.scaler,
            });
        };
        let scaler = &config.scalers[scaler_index];
        let label_set = scaler
            .label_sets
            .iter()
            .position(|ls| ls.labels == record.label_set)
            .unwrap_or_else(|| {
                record
                    .label_set_index
                    .min(scaler.label_sets.len().saturating_sub(1))
            });
        let target = match (alive, record.state, record.mode, &record.job) {
            (false, ..) => None,
            (true, AgentState::Requested | AgentState::Provisioning | AgentState::Booted, ..) => {
                Some(AgentState::Booted)
            }
            (
                true,
                s @ (AgentState::Registered | AgentState::Idle | AgentState::Busy),
                Mode::Orchestrator,
                _,
            ) => Some(s),
            (true, AgentState::Registered | AgentState::Idle, Mode::Standalone, None) => {
                Some(AgentState::Booted)
            }
            _ => None,
        };
        let reservation = if alive {
            let demand = Demand {
                agent: id,
                scaler: scaler.name.clone(),
                requests: record.requests,
                pool: record.machine_pool.clone(),
            };
            Some(
                self.admission
                    .adopt(demand)
                    .map_err(|source| RecoverError::Reservation { agent: id, source })?,
            )
        } else {
            None
        };
        let created = now.checked_sub(record.age).unwrap_or(now);
        let agent = Agent {
            id,
            config: Arc::clone(&config),
            scaler_index,
            label_set,
            state: AgentState::Requested,
            since: now,
            created,
            seq: self.next_seq,
            reservation,
            job: record.job.clone(),
            run_id: record.run_id,
            mode: record.mode,
            warm: record.warm,
            from_pool: false,
            handle: record.handle,
            failure: record.failure,
            drain_after_job: false,
            destroy: None,
            last_exit_code: None,
        };
        self.next_seq += 1;
        self.agents.insert(id, agent);
        match target {
            Some(state) => {
                if let (Mode::Orchestrator, Some(job)) = (record.mode, &record.job) {
                    // A retried scale request for this job is answered with
                    // this agent instead of spawning a second one.
                    self.jobs.entry(job.clone()).or_insert(super::JobRecord {
                        request: None,
                        agent: Some(id),
                    });
                }
                self.step(id, AgentEvent::Recovered(state), now);
                Ok(Recovered::Adopted(state))
            }
            None => {
                self.step(id, AgentEvent::Recovered(AgentState::Destroying), now);
                let cause = if alive {
                    StopCause::Recovered.as_str()
                } else {
                    "gone-while-down"
                };
                if let Some(a) = self.agents.get(&id) {
                    tracing::info!(agent = %id, scaler = %a.name(), cause, "recovered agent is destroyed");
                }
                self.issue_destroy(id, now);
                Ok(Recovered::Releasing)
            }
        }
    }
}

fn snapshot(a: &Agent, now: Instant) -> DurableAgent {
    DurableAgent {
        agent: a.id,
        scaler: a.name().clone(),
        backend: a.scaler().kind,
        label_set_index: a.label_set,
        label_set: a.scaler().label_sets[a.label_set].labels.clone(),
        state: a.state,
        job: a.job.clone(),
        run_id: a.run_id.clone(),
        mode: a.mode,
        warm: a.warm,
        requests: a.requests(),
        machine_pool: a
            .reservation
            .as_ref()
            .and_then(|r| r.pool().map(str::to_owned)),
        handle: a.handle.clone(),
        failure: a.failure,
        age: now.saturating_duration_since(a.created),
    }
}
