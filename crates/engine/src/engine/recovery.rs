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

use super::{Agent, Engine, ScaleOutcome};
use crate::backend::ResourceHandle;
use crate::lifecycle::{AgentEvent, AgentState, FailureReason, Mode, StopCause};
use crate::pending::ScaleRequest;
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

/// A scale request waiting in the pending queue, as recorded: enough to
/// queue it again after a restart, in its place and with its expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurablePending {
    pub request: ScaleRequest,
    /// How long it had waited at the moment of the snapshot (the runtime
    /// turns it into a wall-clock arrival time; `pendingTtl` counts from it).
    pub waited: Duration,
}

/// One write for the state store, in the order the engine made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JournalEntry {
    /// An agent's whole durable state.
    Save(Box<DurableAgent>),
    /// The agent is gone.
    Forget(AgentId),
    /// A scale request entered the pending queue.
    SavePending(Box<DurablePending>),
    /// The request left the queue (admitted, cancelled, expired, …), or a
    /// recorded one was not taken back.
    ForgetPending(JobId),
}

/// What a journal entry is about: entries with the same key replace one
/// another (each carries its subject's whole state).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum JournalKey {
    Agent(AgentId),
    Pending(JobId),
}

impl std::fmt::Display for JournalKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Agent(a) => write!(f, "agent {a}"),
            Self::Pending(j) => write!(f, "pending request {j}"),
        }
    }
}

impl JournalEntry {
    pub fn key(&self) -> JournalKey {
        match self {
            Self::Save(d) => JournalKey::Agent(d.agent),
            Self::Forget(a) => JournalKey::Agent(*a),
            Self::SavePending(p) => JournalKey::Pending(p.request.job.clone()),
            Self::ForgetPending(j) => JournalKey::Pending(j.clone()),
        }
    }

    /// The agent the entry is about, if it is about an agent.
    pub fn agent(&self) -> Option<AgentId> {
        match self.key() {
            JournalKey::Agent(a) => Some(a),
            JournalKey::Pending(_) => None,
        }
    }
}

/// What became of one recorded pending request at start-up
/// ([`Engine::recover_pending`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PendingRecovered {
    /// Waiting again in its place (or admitted at once).
    Requeued,
    /// A standalone job: not run after a restart (its submitter's
    /// connection died with the old daemon); its record is forgotten.
    StandaloneNotRun,
    /// Its TTL ran out while the daemon was down.
    Expired,
    /// A recorded agent already holds its job: it was admitted just before
    /// the crash, only the record was left behind.
    AlreadyAdmitted,
    /// Not taken back (no scaler accepts it any more, too large, …): why.
    Dropped(String),
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
            // Walking backwards keeps each subject's last entry; the
            // survivors keep their relative order.
            entries.reverse();
            entries.retain(|e| seen.insert(e.key()));
            entries.reverse();
        }
        entries
    }

    /// Takes back a scale request recorded before a restart: must run
    /// after the recorded agents were recovered (`held`: a recorded agent
    /// holds its job) and before the first tick.
    ///
    /// - Orchestrator mode: re-queued as if it had arrived `waited` ago
    ///   ([`Engine::restore_pending`]): same place, same expiry, same dedupe
    ///   by job id; its record stays as it is.
    /// - Standalone mode: **not** re-queued. Its submitter lost its
    ///   connection when the daemon died and was told the job failed;
    ///   running it later, unseen, could run it twice if the user
    ///   re-submits (the same decision as for a standalone agent with a
    ///   job, which [`Engine::recover`] destroys).
    ///
    /// Every record that does not wait afterwards is forgotten (a journal
    /// entry, in order with every later one).
    pub fn recover_pending(
        &mut self,
        recorded: DurablePending,
        held: bool,
        now: Instant,
    ) -> PendingRecovered {
        let job = recorded.request.job.clone();
        let outcome = if held {
            PendingRecovered::AlreadyAdmitted
        } else if recorded.request.mode == Mode::Standalone {
            PendingRecovered::StandaloneNotRun
        } else {
            match self.restore_pending(recorded.request, recorded.waited, now) {
                // Admitted at once: leaving the queue forgot the record.
                Ok(Some(ScaleOutcome::Pending { .. } | ScaleOutcome::Spawning { .. })) => {
                    return PendingRecovered::Requeued
                }
                Ok(None) => PendingRecovered::Expired,
                Ok(Some(ScaleOutcome::NoBackend { explanation })) => {
                    PendingRecovered::Dropped(format!("no-backend: {explanation}"))
                }
                Ok(Some(ScaleOutcome::TooLarge { cap, detail })) => {
                    PendingRecovered::Dropped(format!("too-large ({cap}): {detail}"))
                }
                Err(e) => PendingRecovered::Dropped(e.to_string()),
            }
        };
        self.journal.push(JournalEntry::ForgetPending(job));
        outcome
    }

    /// Forgets the record of a pending request that could not be read back.
    pub fn forget_pending_record(&mut self, job: JobId) {
        self.journal.push(JournalEntry::ForgetPending(job));
    }

    /// Records a request that just entered the pending queue.
    pub(super) fn journal_pending(
        &mut self,
        request: &ScaleRequest,
        enqueued: Instant,
        now: Instant,
    ) {
        self.journal
            .push(JournalEntry::SavePending(Box::new(DurablePending {
                request: request.clone(),
                waited: now.saturating_duration_since(enqueued),
            })));
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
            gate: self.router.gate(scaler_index, label_set).clone(),
            state: AgentState::Requested,
            since: now,
            created,
            delivered_at: None,
            seq: self.next_seq,
            reservation,
            job: record.job.clone(),
            last_job: None,
            run_id: record.run_id,
            mode: record.mode,
            warm: record.warm,
            from_pool: false,
            handle: record.handle,
            failure: record.failure,
            drain_after_job: false,
            destroy: None,
            stop_cause: None,
            last_exit_code: None,
            queued_spawn: None,
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
                if let Some(a) = self.agents.get_mut(&id) {
                    a.stop_cause.get_or_insert(StopCause::Recovered);
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
