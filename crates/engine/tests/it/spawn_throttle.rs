#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `maxConcurrentSpawns`: at most that many backend spawns of a scaler in
//! flight; admitted agents beyond it wait in admission order. Counted at
//! the backend (a backend whose spawns block until the test lets them go)
//! and in the engine's own books (status).

use crate::common;

use async_trait::async_trait;
use common::*;
use kici_engine::backend::ReportSender;
use kici_engine::runtime::{DefaultBootstrap, Runtime};
use kici_engine::{
    Adoption, AgentState, Backend, BackendError, Engine, EngineEvent, FailureReason, OwnedResource,
    ResourceHandle, ScaleOutcome, ScalerProblems, SpawnSpec,
};
use kici_model::{AgentId, ScalerEntry, ScalerType};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

const THROTTLED: &str = r#"
version: 1
globalMaxAgents: 100
scalers:
  - name: metal
    type: bare-metal
    maxAgents: 60
    maxConcurrentSpawns: 3
    labelSets:
      - labels: [linux]
        binaryPath: /usr/bin/kici-agent-lite
"#;

/// Counts the spawns running inside it; each blocks until the test adds a
/// permit to `gate`.
#[derive(Default)]
struct Books {
    running: usize,
    most: usize,
    started: Vec<AgentId>,
    finished: usize,
}

struct GatedBackend {
    gate: Semaphore,
    books: Mutex<Books>,
}

impl GatedBackend {
    fn new() -> Self {
        Self {
            gate: Semaphore::new(0),
            books: Mutex::new(Books::default()),
        }
    }
}

#[async_trait]
impl Backend for GatedBackend {
    fn kind(&self) -> ScalerType {
        ScalerType::BareMetal
    }

    async fn validate(&self, _scaler: &ScalerEntry) -> Result<(), ScalerProblems> {
        Ok(())
    }

    async fn spawn(&self, spec: SpawnSpec) -> Result<ResourceHandle, BackendError> {
        {
            let mut b = self.books.lock();
            b.running += 1;
            b.most = b.most.max(b.running);
            b.started.push(spec.agent);
        }
        let permit = self.gate.acquire().await.expect("gate open");
        permit.forget();
        {
            let mut b = self.books.lock();
            b.running -= 1;
            b.finished += 1;
        }
        Ok(ResourceHandle {
            id: format!("gated-{}", spec.agent),
            extra: BTreeMap::new(),
        })
    }

    async fn destroy(
        &self,
        _agent: &AgentId,
        _handle: Option<&ResourceHandle>,
        _grace: Duration,
    ) -> Result<(), BackendError> {
        Ok(())
    }

    async fn list_owned(&self) -> Result<Vec<OwnedResource>, BackendError> {
        Ok(Vec::new())
    }

    async fn adopt(
        &self,
        _agent: &AgentId,
        _handle: &ResourceHandle,
        _reports: ReportSender,
    ) -> Result<Adoption, BackendError> {
        Ok(Adoption::Gone)
    }
}

/// Polls `done` every 5 ms for up to 30 s.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_requests_never_run_more_than_the_limit_and_all_spawn_in_order() {
    let backend = Arc::new(GatedBackend::new());
    let rt = Runtime::start(
        engine(THROTTLED),
        vec![backend.clone() as Arc<dyn Backend>],
        Arc::new(DefaultBootstrap),
    );
    let mut events = rt.subscribe();
    // The order requests really entered the engine: each task takes this
    // lock around its call, so the list is the engine's arrival order
    // while the 50 tasks still race for it.
    let arrivals: Arc<Mutex<Vec<AgentId>>> = Arc::default();
    let mut tasks = Vec::new();
    for i in 0..50 {
        let rt = rt.clone();
        let arrivals = arrivals.clone();
        tasks.push(tokio::spawn(async move {
            let mut order = arrivals.lock();
            let outcome = rt
                .request_scale(orchestrator_request(&format!("job-{i}"), &["linux"]))
                .unwrap();
            order.push(spawned(&outcome));
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let arrivals = arrivals.lock().clone();
    assert_eq!(arrivals.len(), 50);

    wait_until("three spawns reach the backend", || {
        backend.books.lock().started.len() == 3
    })
    .await;
    // Nothing else starts while those three hang.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(backend.books.lock().started.len(), 3);
    let status = rt.status();
    let metal = &status.scalers[0];
    assert_eq!(metal.max_concurrent_spawns, 3);
    assert_eq!((metal.spawns_in_flight, metal.spawns_waiting), (3, 47));
    assert_eq!(metal.agents.spawning, 50, "every request was admitted");
    let states: Vec<AgentState> = arrivals
        .iter()
        .map(|a| rt.agent(*a).unwrap().state)
        .collect();
    assert!(states[..3].iter().all(|s| *s == AgentState::Provisioning));
    assert!(states[3..].iter().all(|s| *s == AgentState::Requested));

    // Let them go one at a time (the gate is fair: the oldest spawn ends,
    // and exactly one waiting spawn takes its slot), then all at once.
    for released in 1..=25 {
        backend.gate.add_permits(1);
        wait_until("a waiting spawn takes the freed slot", || {
            let b = backend.books.lock();
            b.finished == released && b.started.len() == 3 + released
        })
        .await;
    }
    backend.gate.add_permits(25);
    wait_until("all fifty spawned", || backend.books.lock().finished == 50).await;

    let (most, started) = {
        let books = backend.books.lock();
        (books.most, books.started.clone())
    };
    assert_eq!(most, 3, "at most three spawns ran at once, and three did");
    // Spawns started together (the first three; the last burst) are
    // started in admission order too, but each runs on a task of its own:
    // which of two reaches the backend first is the scheduler's choice.
    // Released one by one, each slot goes to the oldest waiting agent.
    let mut first = started[..3].to_vec();
    first.sort();
    let mut oldest = arrivals[..3].to_vec();
    oldest.sort();
    assert_eq!(first, oldest);
    assert_eq!(
        started[3..28],
        arrivals[3..28],
        "released one by one: reached the backend in admission order"
    );
    let mut reached = started;
    reached.sort();
    let mut all = arrivals.clone();
    all.sort();
    assert_eq!(reached, all, "every admitted agent spawned exactly once");
    let mut ordered = Vec::new();
    while let Ok(event) = events.try_recv() {
        if let EngineEvent::AgentTransition {
            agent_id,
            to: AgentState::Provisioning,
            ..
        } = event.event
        {
            ordered.push(agent_id);
        }
    }
    assert_eq!(ordered, arrivals, "spawns were started in admission order");
    wait_until("every agent booted", || {
        arrivals
            .iter()
            .all(|a| rt.agent(*a).unwrap().state == AgentState::Booted)
    })
    .await;
    let metal = &rt.status().scalers[0];
    assert_eq!((metal.spawns_in_flight, metal.spawns_waiting), (0, 0));
    assert!(rt.shutdown(Duration::from_secs(10)).await);
}

fn handle(a: AgentId) -> ResourceHandle {
    ResourceHandle {
        id: format!("h-{a}"),
        ..Default::default()
    }
}

const ONE_AT_A_TIME: &str = r#"
version: 1
scalers:
  - name: metal
    type: bare-metal
    maxAgents: 10
    maxConcurrentSpawns: 1
    labelSets:
      - labels: [linux]
        binaryPath: /usr/bin/kici-agent-lite
"#;

fn admit(e: &mut Engine, id: &str, now: Instant) -> AgentId {
    match e
        .request_scale(orchestrator_request(id, &["linux"]), now)
        .unwrap()
    {
        ScaleOutcome::Spawning { agent_id, .. } => agent_id,
        other => panic!("{id}: {other:?}"),
    }
}

#[test]
fn a_waiting_agents_provision_deadline_starts_with_its_spawn() {
    let mut clock = Clock::new();
    let mut e = engine(ONE_AT_A_TIME);
    let a = admit(&mut e, "a", clock.now());
    let b = admit(&mut e, "b", clock.now());
    assert_eq!(spawn_orders(&mut e), [a], "b waits for a's slot");
    // a takes almost its whole provisioning deadline (300 s).
    let now = clock.advance(299);
    e.tick(now);
    e.spawn_succeeded(a, handle(a), now);
    assert_eq!(spawn_orders(&mut e), [b], "a booted: b's turn");
    assert_eq!(e.agent(b, now).unwrap().state, AgentState::Provisioning);
    // 300 s after b was admitted, but 2 s into its spawn: still provisioning.
    let now = clock.advance(2);
    e.tick(now);
    assert_eq!(e.agent(b, now).unwrap().state, AgentState::Provisioning);
    // Its own 300 s run out: timed out.
    let now = clock.advance(299);
    e.tick(now);
    let view = e.agent(b, now).unwrap();
    assert_eq!(view.state, AgentState::Destroying);
    assert_eq!(view.failure_reason, Some(FailureReason::ProvisionTimeout));
}

#[test]
fn every_way_out_of_provisioning_frees_the_slot_and_a_cancelled_waiter_never_spawns() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(ONE_AT_A_TIME);
    let ids: Vec<AgentId> = ["a", "b", "c", "d", "e"]
        .iter()
        .map(|j| admit(&mut e, j, now))
        .collect();
    assert_eq!(spawn_orders(&mut e), [ids[0]]);
    let status = |e: &Engine| {
        let s = &e.status(now).scalers[0];
        (s.spawns_in_flight, s.spawns_waiting)
    };
    assert_eq!(status(&e), (1, 4));

    // The waiting "c" is cancelled: it leaves the queue without a spawn.
    assert!(e.cancel_scale(&job("c"), now));
    assert_eq!(e.agent(ids[2], now).unwrap().state, AgentState::Destroying);
    assert!(spawn_orders(&mut e).is_empty());
    assert_eq!(status(&e), (1, 3));

    // A failed spawn frees the slot: b starts.
    e.spawn_failed(ids[0], "boom".into(), now);
    assert_eq!(spawn_orders(&mut e), [ids[1]]);
    assert_eq!(status(&e), (1, 2));

    // An operator stop of the spawning agent frees it: d starts (the
    // orchestrator job of a, re-queued after its failure, waits in the
    // pending queue for the breaker's backoff and comes later).
    e.destroy_agent(ids[1], now).unwrap();
    let started = spawn_orders(&mut e);
    assert_eq!(started, [ids[3]]);
    assert_eq!(e.agent(ids[1], now).unwrap().state, AgentState::Destroying);

    // Booting frees it: e starts; nothing waits any more.
    e.spawn_succeeded(ids[3], handle(ids[3]), now);
    assert_eq!(spawn_orders(&mut e), [ids[4]]);
    assert_eq!(status(&e), (1, 0));
    e.spawn_succeeded(ids[4], handle(ids[4]), now);
    assert_eq!(status(&e), (0, 0));
}

#[test]
fn a_reload_that_raises_the_limit_starts_waiting_spawns_at_once() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(ONE_AT_A_TIME);
    let ids: Vec<AgentId> = ["a", "b", "c"]
        .iter()
        .map(|j| admit(&mut e, j, now))
        .collect();
    assert_eq!(spawn_orders(&mut e), [ids[0]]);
    let raised = ONE_AT_A_TIME.replace("maxConcurrentSpawns: 1", "maxConcurrentSpawns: 3");
    e.reload(config(&raised), now).unwrap();
    assert_eq!(spawn_orders(&mut e), [ids[1], ids[2]]);
    let s = &e.status(now).scalers[0];
    assert_eq!((s.spawns_in_flight, s.spawns_waiting), (3, 0));
}

const EXTERNAL: &str = r#"
version: 1
scalers:
  - name: cloud
    type: event
    maxAgents: 10
    maxConcurrentSpawns: 1
    labelSets:
      - labels: [cloud]
    x-kici-scaler:
      registrationTimeoutSeconds: 60
"#;

/// An external (`event`) agent stays `provisioning` from its scale-up until
/// it registers: the delivery ends its spawn (the next one starts) but not
/// its provisioning, and the registration deadline runs from the delivery.
#[test]
fn an_external_agent_is_provisioning_until_it_registers_without_holding_a_spawn_slot() {
    let mut clock = Clock::new();
    let now = clock.now();
    let mut e = engine(EXTERNAL);
    let admit = |e: &mut Engine, id: &str| match e
        .request_scale(orchestrator_request(id, &["cloud"]), now)
        .unwrap()
    {
        ScaleOutcome::Spawning { agent_id, .. } => agent_id,
        other => panic!("{id}: {other:?}"),
    };
    let (a, b, c) = (admit(&mut e, "a"), admit(&mut e, "b"), admit(&mut e, "c"));
    assert_eq!(spawn_orders(&mut e), [a]);
    let status = |e: &Engine, now| {
        let s = &e.status(now).scalers[0];
        (s.spawns_in_flight, s.spawns_waiting)
    };
    assert_eq!(status(&e, now), (1, 2));

    // a's scale-up is delivered: still provisioning; b's spawn starts.
    e.spawn_succeeded(a, handle(a), now);
    assert_eq!(e.agent(a, now).unwrap().state, AgentState::Provisioning);
    assert_eq!(spawn_orders(&mut e), [b]);
    assert_eq!(status(&e, now), (1, 1));

    // a registers: registered; the books do not move (its slot was freed).
    e.agent_registered(a, now).unwrap();
    assert_eq!(e.agent(a, now).unwrap().state, AgentState::Registered);
    assert_eq!(status(&e, now), (1, 1));

    // b is delivered and never registers: 60 s after the delivery (not the
    // 300 s provisioning deadline) it fails as a registration timeout.
    e.spawn_succeeded(b, handle(b), now);
    assert_eq!(spawn_orders(&mut e), [c]);
    let later = clock.advance(59);
    e.tick(later);
    assert_eq!(e.agent(b, later).unwrap().state, AgentState::Provisioning);
    let later = clock.advance(2);
    e.tick(later);
    let view = e.agent(b, later).unwrap();
    assert_eq!(view.state, AgentState::Destroying);
    assert_eq!(
        view.failure_reason,
        Some(FailureReason::RegistrationTimeout)
    );
    // c's spawn is still the one in flight: b's end freed nothing twice.
    assert_eq!(status(&e, later), (1, 0));
}
