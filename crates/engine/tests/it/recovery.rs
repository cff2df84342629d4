#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Durable state through the journal, and taking agents back after a
//! restart, against the in-memory backend on tokio's paused clock.

use crate::common;

use async_trait::async_trait;
use common::*;
use kici_engine::memory_backend::MemoryBackend;
use kici_engine::runtime::{DefaultBootstrap, Runtime};
use kici_engine::{
    AgentState, Backend, DurableAgent, Journal, JournalEntry, JournalError, Mode, ScaleRequest,
};
use kici_model::{AgentId, ScalerType};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

/// The store as the journal sees it: the newest record per agent.
#[derive(Default)]
struct MemoryJournal {
    rows: Mutex<BTreeMap<AgentId, DurableAgent>>,
    /// Pending requests, through the same journal.
    pending: Mutex<BTreeMap<kici_model::JobId, kici_engine::DurablePending>>,
    down: AtomicBool,
    writes: Mutex<Vec<(AgentId, Option<AgentState>)>>,
}

#[async_trait]
impl Journal for MemoryJournal {
    async fn write(&self, entry: &JournalEntry, _at: SystemTime) -> Result<(), JournalError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(JournalError::new(
                kici_engine::JournalErrorKind::Unavailable,
                std::io::Error::other("store down"),
            ));
        }
        let mut rows = self.rows.lock();
        match entry {
            JournalEntry::Save(d) => {
                self.writes.lock().push((d.agent, Some(d.state)));
                rows.insert(d.agent, (**d).clone());
            }
            JournalEntry::Forget(a) => {
                self.writes.lock().push((*a, None));
                rows.remove(a);
            }
            JournalEntry::SavePending(p) => {
                self.pending
                    .lock()
                    .insert(p.request.job.clone(), (**p).clone());
            }
            JournalEntry::ForgetPending(job) => {
                self.pending.lock().remove(job);
            }
        }
        Ok(())
    }
}

impl MemoryJournal {
    fn records(&self) -> Vec<DurableAgent> {
        self.rows.lock().values().cloned().collect()
    }
    fn state_of(&self, a: AgentId) -> Option<AgentState> {
        self.rows.lock().get(&a).map(|d| d.state)
    }
}

struct Daemon {
    rt: Runtime,
    docker: Arc<MemoryBackend>,
    local: Arc<MemoryBackend>,
}

async fn start(
    journal: Arc<MemoryJournal>,
    survivors: &[AgentId],
) -> (Daemon, kici_engine::runtime::RecoveryReport) {
    start_with(journal, survivors, &BASIC.replace("maxCpu: 2", "maxCpu: 4")).await
}

async fn start_with(
    journal: Arc<MemoryJournal>,
    survivors: &[AgentId],
    yaml: &str,
) -> (Daemon, kici_engine::runtime::RecoveryReport) {
    let docker = Arc::new(MemoryBackend::new(ScalerType::Container));
    let local = Arc::new(MemoryBackend::new(ScalerType::BareMetal));
    for a in survivors {
        docker.plant(*a);
    }
    let backends: Vec<Arc<dyn Backend>> = vec![docker.clone(), local.clone()];
    let records = kici_engine::runtime::Recorded {
        agents: journal.records(),
        pending: journal.pending.lock().values().cloned().collect(),
        unreadable_pending: Vec::new(),
    };
    let rt = Runtime::with_journal(engine(yaml), backends, Arc::new(DefaultBootstrap), journal);
    let report = rt.recover_and_start(records).await;
    (Daemon { rt, docker, local }, report)
}

async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

fn orchestrator(id: &str, raw: &[&str]) -> ScaleRequest {
    ScaleRequest {
        mode: Mode::Orchestrator,
        ..request(id, raw)
    }
}

#[tokio::test(start_paused = true)]
async fn every_transition_is_recorded_and_a_gone_agent_forgotten() {
    let journal = Arc::new(MemoryJournal::default());
    let (d, _) = start(journal.clone(), &[]).await;
    let a = spawned(&d.rt.request_scale(request("j1", &["docker"])).unwrap());
    settle().await;
    assert!(d.rt.flush_journal().await);
    let row = journal.rows.lock().get(&a).cloned().unwrap();
    assert_eq!(row.state, AgentState::Booted);
    assert_eq!(row.handle.as_ref().unwrap().id, format!("mem-{a}"));
    assert_eq!(row.scaler.as_str(), "docker");
    assert_eq!(row.requests.memory.bytes(), 512 * 1024 * 1024);
    assert_eq!(row.job.as_ref().unwrap().as_str(), "j1");
    d.rt.destroy_agent(a).unwrap();
    settle().await;
    assert!(d.rt.flush_journal().await);
    assert_eq!(journal.state_of(a), None, "forgotten once gone");
    let states: Vec<_> = journal
        .writes
        .lock()
        .iter()
        .filter(|(x, _)| *x == a)
        .map(|(_, s)| *s)
        .collect();
    assert_eq!(
        states,
        [
            Some(AgentState::Provisioning),
            Some(AgentState::Booted),
            Some(AgentState::Destroying),
            None
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn nothing_is_spawned_that_the_store_did_not_record() {
    let journal = Arc::new(MemoryJournal::default());
    let (d, _) = start(journal.clone(), &[]).await;
    journal.down.store(true, Ordering::SeqCst);
    let a = spawned(&d.rt.request_scale(request("j1", &["docker"])).unwrap());
    settle().await;
    assert!(d.docker.spawned().is_empty(), "backend never asked");
    let view = d.rt.agent(a).unwrap();
    assert!(matches!(
        view.state,
        AgentState::Destroying | AgentState::Gone
    ));
    assert_eq!(
        view.failure_reason,
        Some(kici_engine::FailureReason::ProvisionError)
    );
    // The store returns: the queued writes land, the failed agent is forgotten.
    journal.down.store(false, Ordering::SeqCst);
    tokio::time::advance(std::time::Duration::from_secs(2)).await;
    settle().await;
    assert!(d.rt.flush_journal().await);
    assert_eq!(journal.state_of(a), None);
}

#[tokio::test(start_paused = true)]
async fn restart_adopts_live_agents_and_releases_dead_ones_exactly_once() {
    let journal = Arc::new(MemoryJournal::default());
    let (d, _) = start(journal.clone(), &[]).await;
    // Orchestrator-mode busy agent, standalone busy agent, one that will die.
    let busy = spawned(&d.rt.request_scale(orchestrator("o1", &["docker"])).unwrap());
    let standalone = spawned(&d.rt.request_scale(request("s1", &["docker"])).unwrap());
    let dead = spawned(&d.rt.request_scale(orchestrator("o2", &["docker"])).unwrap());
    settle().await;
    for (a, j) in [(busy, "o1"), (standalone, "s1")] {
        d.rt.agent_registered(a).unwrap();
        d.rt.job_started(a, job(j)).unwrap();
    }
    settle().await;
    assert!(d.rt.flush_journal().await);
    assert_eq!(journal.records().len(), 3);
    // Crash: the runtime is dropped without shutdown; the resources of
    // `busy` and `standalone` survive, `dead` does not.
    drop(d);

    let (d2, report) = start(journal.clone(), &[busy, standalone]).await;
    settle().await;
    assert_eq!(report.adopted, [busy]);
    let mut released = report.released.clone();
    released.sort();
    let mut expected = vec![standalone, dead];
    expected.sort();
    assert_eq!(released, expected);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(d2.rt.agent(busy).unwrap().state, AgentState::Busy);
    // The adopted agent counts once against its scaler: 1 cpu of maxCpu 4.
    let status = d2.rt.status();
    let docker = status
        .scalers
        .iter()
        .find(|s| s.name.as_str() == "docker")
        .unwrap();
    let usage = docker.usage.as_ref().unwrap();
    assert_eq!(usage.agents, 1);
    assert_eq!(usage.cpu.millis(), 1000);
    assert_eq!(docker.agents.busy, 1);
    // The standalone job's agent and the dead one were destroyed and forgotten.
    let mut destroyed = d2.docker.destroyed();
    destroyed.sort();
    assert_eq!(destroyed, expected);
    assert!(d2.rt.flush_journal().await);
    assert_eq!(
        journal
            .records()
            .iter()
            .map(|r| r.agent)
            .collect::<Vec<_>>(),
        [busy]
    );
    assert!(d2.docker.spawned().is_empty(), "recovery creates nothing");
    // The orchestrator retrying its request after the restart gets the
    // adopted agent back (by job id: the request itself was not kept),
    // not a second agent.
    let again = d2
        .rt
        .request_scale(orchestrator("o1", &["docker"]))
        .unwrap();
    assert_eq!(spawned(&again), busy);
    settle().await;
    assert!(
        d2.docker.spawned().is_empty(),
        "a retried request spawns nothing"
    );
    // The adopted agent's exit is still noticed.
    assert!(d2.docker.exit(busy, "exited"));
    settle().await;
    assert_eq!(d2.rt.agent(busy).unwrap().state, AgentState::Gone);
    assert!(d2.local.spawned().is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_agent_recorded_waiting_for_a_spawn_slot_is_released_without_asking_the_backend() {
    let yaml = BASIC.replace("maxCpu: 2", "maxCpu: 4").replace(
        "    maxAgents: 5\n",
        "    maxAgents: 5\n    maxConcurrentSpawns: 1\n",
    );
    let journal = Arc::new(MemoryJournal::default());
    let (d, _) = start_with(journal.clone(), &[], &yaml).await;
    d.docker.hang_spawns(true);
    let first = spawned(&d.rt.request_scale(orchestrator("o1", &["docker"])).unwrap());
    let waiting = spawned(&d.rt.request_scale(orchestrator("o2", &["docker"])).unwrap());
    settle().await;
    assert!(d.rt.flush_journal().await);
    assert_eq!(journal.state_of(first), Some(AgentState::Provisioning));
    assert_eq!(journal.state_of(waiting), Some(AgentState::Requested));
    assert_eq!(d.docker.spawned(), [first], "only one spawn in flight");
    drop(d);

    // Even were something found under its name, a record of an agent that
    // never got its spawn is not adopted: it is released and forgotten.
    let (d2, report) = start_with(journal.clone(), &[waiting], &yaml).await;
    settle().await;
    assert!(report.adopted.is_empty(), "{:?}", report.adopted);
    let mut released = report.released.clone();
    released.sort();
    let mut both = vec![first, waiting];
    both.sort();
    assert_eq!(released, both);
    assert!(d2.rt.flush_journal().await);
    assert!(journal.records().is_empty());
    assert_eq!(d2.rt.status().global.agents, 0, "no capacity held");
}

#[tokio::test(start_paused = true)]
async fn a_recovered_agent_awaiting_registration_keeps_its_deadline() {
    let journal = Arc::new(MemoryJournal::default());
    let (d, _) = start(journal.clone(), &[]).await;
    let a = spawned(&d.rt.request_scale(orchestrator("o1", &["docker"])).unwrap());
    settle().await;
    assert!(d.rt.flush_journal().await);
    drop(d);
    let (d2, report) = start(journal.clone(), &[a]).await;
    assert_eq!(report.adopted, [a]);
    assert_eq!(d2.rt.agent(a).unwrap().state, AgentState::Booted);
    // Never registers: destroyed at registrationTimeout (120 s default).
    tokio::time::advance(std::time::Duration::from_secs(121)).await;
    settle().await;
    assert_eq!(d2.docker.destroyed(), [a]);
    let view = d2.rt.agent(a).unwrap();
    assert_eq!(view.state, AgentState::Gone);
    assert_eq!(
        view.failure_reason,
        Some(kici_engine::FailureReason::RegistrationTimeout)
    );
}

#[tokio::test(start_paused = true)]
async fn pending_requests_go_through_the_journal_and_come_back_with_the_agents() {
    let journal = Arc::new(MemoryJournal::default());
    let (d, _) = start(journal.clone(), &[]).await;
    // `local` holds two agents: the third request waits, recorded.
    let a = spawned(&d.rt.request_scale(orchestrator("j1", &["local"])).unwrap());
    let _b = spawned(&d.rt.request_scale(orchestrator("j2", &["local"])).unwrap());
    let (outcome, ack) = d.rt.request_scale_recorded(orchestrator("j3", &["local"]));
    assert_eq!(
        outcome.unwrap(),
        kici_engine::ScaleOutcome::Pending { position: 1 }
    );
    ack.expect("a queued request is acknowledged once recorded")
        .await
        .unwrap()
        .unwrap();
    // A retry is not recorded again; a standalone one waits too.
    assert!(d
        .rt
        .request_scale_recorded(orchestrator("j3", &["local"]))
        .1
        .is_none());
    let (_, ack) = d.rt.request_scale_recorded(request("s1", &["local"]));
    ack.unwrap().await.unwrap().unwrap();
    assert!(d.rt.flush_journal().await);
    assert_eq!(
        journal
            .pending
            .lock()
            .keys()
            .map(|j| j.as_str())
            .collect::<Vec<_>>(),
        ["j3", "s1"]
    );
    // The crash: the next daemon takes back agents and requests in one go.
    d.rt.detach().await;
    drop(d);
    let (d, report) = start(journal.clone(), &[]).await;
    assert_eq!(report.pending.requeued, [job("j3")]);
    assert_eq!(report.pending.standalone_failed, [job("s1")]);
    settle().await;
    assert!(d.rt.flush_journal().await);
    // The recorded agents' processes are gone (nothing planted): released,
    // and the freed capacity admits j3, whose record goes with it.
    let _ = a;
    assert!(
        journal.pending.lock().is_empty(),
        "{:?}",
        journal.pending.lock().keys()
    );
    assert!(d
        .rt
        .agents(false)
        .iter()
        .any(|v| v.job_id.as_ref() == Some(&job("j3"))));
}
