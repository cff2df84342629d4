#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Model-based test: random interleavings of requests (orchestrator and
//! standalone), spawn results, registrations, job ends, disconnects,
//! destroys (succeeding or failing), cancels, cordons, reloads and clock
//! jumps. After every step the capacity books must balance exactly (no
//! leak, no double release, no cap exceeded), a waiting request is never
//! reported refused twice in a row for the same reason, a standalone job is
//! spawned for at most once and ends at most once (its command's end, or
//! one effect telling its dispatcher), a token is revoked once its agent is
//! gone; a final shutdown must release everything and end every job.
//!
//! This is the deterministic-scheduler check of the engine: every
//! interleaving proptest generates is replayable from its seed.

use crate::common;

use common::*;
use kici_admission::Cap;
use kici_engine::ScaleOutcome;
use kici_engine::{AgentState, Effect, Engine, EngineEvent, JobEffect, Mode, ResourceHandle};
use kici_model::{AgentId, JobId, MilliCpu, ResourceRequest, ResourceSpec, ScalerName};
use proptest::prelude::*;
use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

const CONFIG_A: &str = r#"
version: 1
globalMaxAgents: 6
globalResourceCap: { maxCpu: 5 }
scalers:
  - name: small
    type: bare-metal
    maxAgents: 3
    resourceCap: { maxCpu: 3 }
    warmPool: { enabled: true, size: 1, idleTimeoutSeconds: 30 }
    labelSets:
      - labels: [linux, small]
        binaryPath: /bin/agent
        resources: { cpus: 1 }
  - name: big
    type: container
    maxAgents: 4
    labelSets:
      - labels: [linux, big]
        image: agent:1
        resources: { cpus: 2 }
"#;

const CONFIG_B: &str = r#"
version: 1
globalMaxAgents: 6
globalResourceCap: { maxCpu: 5 }
scalers:
  - name: big
    type: container
    maxAgents: 4
    labelSets:
      - labels: [linux, big]
        image: agent:2
        resources: { cpus: 2 }
  - name: other
    type: bare-metal
    maxAgents: 2
    labelSets:
      - labels: [linux, small]
        binaryPath: /bin/agent
        resources: { cpus: 1 }
"#;

#[derive(Debug, Clone)]
enum Op {
    Request {
        job: u8,
        big: bool,
        cpus: Option<u8>,
        orchestrator: bool,
    },
    SpawnOk(u8),
    SpawnFail(u8),
    Register(u8),
    Complete(u8),
    Disconnect(u8),
    OperatorDestroy(u8),
    DestroyOk(u8),
    DestroyFail(u8),
    Cancel(u8),
    Cordon(bool),
    Reload(bool),
    Advance(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..12, any::<bool>(), prop::option::of(1u8..4), any::<bool>())
            .prop_map(|(job, big, cpus, orchestrator)| Op::Request { job, big, cpus, orchestrator }),
        3 => any::<u8>().prop_map(Op::SpawnOk),
        1 => any::<u8>().prop_map(Op::SpawnFail),
        3 => any::<u8>().prop_map(Op::Register),
        2 => any::<u8>().prop_map(Op::Complete),
        1 => any::<u8>().prop_map(Op::Disconnect),
        1 => any::<u8>().prop_map(Op::OperatorDestroy),
        3 => any::<u8>().prop_map(Op::DestroyOk),
        1 => any::<u8>().prop_map(Op::DestroyFail),
        1 => (0u8..12).prop_map(Op::Cancel),
        1 => any::<bool>().prop_map(Op::Cordon),
        1 => any::<bool>().prop_map(Op::Reload),
        2 => (1u16..400).prop_map(Op::Advance),
    ]
}

/// What the simulated backend (and the standalone jobs' dispatcher) has
/// been asked to do.
#[derive(Default)]
struct World {
    spawning: Vec<AgentId>,
    destroying: Vec<AgentId>,
    spawned_ever: BTreeSet<AgentId>,
    /// Standalone jobs submitted and not ended yet, with the agents spawned
    /// for them so far.
    standalone: HashMap<JobId, Vec<AgentId>>,
    /// Agents whose token was revoked.
    revoked: BTreeSet<AgentId>,
    /// Agents whose end a coordinator was told of.
    ended: BTreeSet<AgentId>,
}

impl World {
    /// A standalone request was accepted (pending or spawning): a new
    /// submission unless it is a retry of one still running.
    fn submitted(&mut self, job: JobId) {
        self.standalone.entry(job).or_default();
    }

    /// A standalone job's agent reported its end.
    fn completed(&mut self, job: &JobId) {
        assert!(
            self.standalone.remove(job).is_some(),
            "standalone job {job} completed but was not running"
        );
    }

    fn absorb(&mut self, e: &mut Engine, now: Instant) {
        for f in e.take_effects() {
            match f {
                Effect::Spawn(o) => {
                    assert!(
                        self.spawned_ever.insert(o.agent),
                        "agent id reused: {}",
                        o.agent
                    );
                    self.spawning.push(o.agent);
                    if let (Mode::Standalone, Some(job)) = (o.mode, &o.job) {
                        let agents = self.standalone.get_mut(job).unwrap_or_else(|| {
                            panic!("spawn for standalone job {job} not running")
                        });
                        agents.push(o.agent);
                        // Never re-queued after its agent failed: one agent
                        // per submission.
                        assert_eq!(agents.len(), 1, "standalone job {job} spawned twice");
                    }
                }
                Effect::Destroy(o) => {
                    self.spawning.retain(|a| *a != o.agent);
                    if !self.destroying.contains(&o.agent) {
                        self.destroying.push(o.agent);
                    }
                }
                Effect::Revoke(agent) => {
                    assert!(self.revoked.insert(agent), "{agent} revoked twice");
                    assert!(
                        e.agent(agent, now)
                            .is_some_and(|v| v.state == AgentState::Gone),
                        "{agent} revoked before it is gone"
                    );
                }
                Effect::Ended(ended) => {
                    assert!(
                        self.ended.insert(ended.agent),
                        "{} ended twice",
                        ended.agent
                    );
                    assert!(
                        e.agent(ended.agent, now)
                            .is_some_and(|v| v.state == AgentState::Gone),
                        "{} ended before it is gone",
                        ended.agent
                    );
                }
                Effect::Job(JobEffect::Bound { job, agent }) => {
                    assert!(
                        self.standalone.contains_key(&job),
                        "{job} bound but not running"
                    );
                    assert!(
                        e.agent(agent, now).is_some(),
                        "{job} bound to unknown {agent}"
                    );
                }
                Effect::Job(JobEffect::Dispatch { job, agent }) => {
                    assert!(
                        self.standalone.contains_key(&job),
                        "{job} dispatched but not running"
                    );
                    let view = e.agent(agent, now).unwrap();
                    assert_eq!(view.job_id.as_ref(), Some(&job));
                    assert!(view.warm || view.state == AgentState::Busy);
                }
                Effect::Job(JobEffect::Ended { job, .. }) => {
                    // Exactly once per submission, and only for one that
                    // did not complete.
                    assert!(
                        self.standalone.remove(&job).is_some(),
                        "standalone job {job} ended twice or after it completed"
                    );
                }
            }
        }
    }
}

fn pick<T: Copy>(v: &[T], i: u8) -> Option<T> {
    (!v.is_empty()).then(|| v[i as usize % v.len()])
}

fn live_in(e: &Engine, now: Instant, states: &[AgentState]) -> Vec<AgentId> {
    e.agents(false, now)
        .into_iter()
        .filter(|a| states.contains(&a.state))
        .map(|a| a.agent_id)
        .collect()
}

/// The books balance: admission usage equals the sum over live agents.
fn check_books(e: &Engine, now: Instant) {
    let agents = e.agents(false, now);
    let usage = e.admission().usage();
    assert_eq!(
        usage.global.agents as usize,
        agents.len(),
        "global agent count"
    );
    let cpu: u64 = agents.iter().map(|a| a.resources.cpu.millis()).sum();
    assert_eq!(usage.global.cpu, MilliCpu::from_millis(cpu), "global cpu");
    for (name, scope) in &usage.scalers {
        let n = agents.iter().filter(|a| a.scaler == *name).count();
        assert_eq!(scope.agents as usize, n, "agents of {name}");
    }
    // Caps of the current config hold (reloads here never shrink them).
    assert!(agents.len() <= 6);
    assert!(cpu <= 5000, "global cpu cap exceeded: {cpu}");
    for (name, max, max_cpu) in [
        ("small", 3, Some(3000)),
        ("big", 4, None),
        ("other", 2, None),
    ] {
        let mine: Vec<_> = agents
            .iter()
            .filter(|a| a.scaler.as_str() == name)
            .collect();
        assert!(mine.len() <= max, "{name}: {} agents", mine.len());
        if let Some(m) = max_cpu {
            assert!(mine.iter().map(|a| a.resources.cpu.millis()).sum::<u64>() <= m);
        }
    }
    for a in &agents {
        assert_ne!(a.state, AgentState::Gone);
    }
}

/// What each waiting request was last reported refused for.
#[derive(Default)]
struct Refusals(HashMap<JobId, (ScalerName, Cap)>);

impl Refusals {
    /// A request is refused (an event, a log line, a metric increment)
    /// once per reason it waits for: never twice in a row for the same
    /// scaler and cap while it stays pending.
    fn absorb(&mut self, e: &mut Engine) {
        for event in e.take_events() {
            match event {
                EngineEvent::Refused {
                    job_id,
                    scaler,
                    cap,
                    ..
                } => {
                    let reason = (scaler, cap);
                    assert_ne!(
                        self.0.get(&job_id),
                        Some(&reason),
                        "{job_id} reported refused again for the same reason"
                    );
                    self.0.insert(job_id, reason);
                }
                EngineEvent::PendingEnded { job_id, .. } => {
                    self.0.remove(&job_id);
                }
                _ => {}
            }
        }
    }
}

fn run(ops: Vec<Op>) {
    let mut clock = Clock::new();
    let mut e = engine(CONFIG_A);
    let mut world = World::default();
    let mut refusals = Refusals::default();
    let mut config_b = false;
    for op in ops {
        let now = clock.now();
        match op {
            Op::Request {
                job,
                big,
                cpus,
                orchestrator,
            } => {
                let mut r = request(
                    &format!("j{job}"),
                    &["linux", if big { "big" } else { "small" }],
                );
                r.resources = cpus.map(|c| {
                    ResourceRequest::flat(ResourceSpec {
                        cpus: Some(MilliCpu::from_millis(c as u64 * 1000)),
                        memory: None,
                    })
                });
                r.mode = if orchestrator {
                    Mode::Orchestrator
                } else {
                    Mode::Standalone
                };
                let job = r.job.clone();
                let outcome = e.request_scale(r, now);
                if !orchestrator
                    && matches!(
                        outcome,
                        Ok(ScaleOutcome::Pending { .. } | ScaleOutcome::Spawning { .. })
                    )
                {
                    world.submitted(job);
                }
            }
            Op::SpawnOk(i) => {
                if let Some(a) = pick(&world.spawning, i) {
                    world.spawning.retain(|x| *x != a);
                    e.spawn_succeeded(
                        a,
                        ResourceHandle {
                            id: a.to_string(),
                            ..Default::default()
                        },
                        now,
                    );
                }
            }
            Op::SpawnFail(i) => {
                if let Some(a) = pick(&world.spawning, i) {
                    world.spawning.retain(|x| *x != a);
                    e.spawn_failed(a, "boom".into(), now);
                }
            }
            Op::Register(i) => {
                let booted = live_in(&e, now, &[AgentState::Booted, AgentState::Provisioning]);
                if let Some(a) = pick(&booted, i) {
                    let reg = e.agent_registered(a, now).unwrap();
                    if let Some(job) = reg.bound_job_id {
                        e.job_started(a, job, now).unwrap();
                    }
                }
            }
            Op::Complete(i) => {
                if let Some(a) = pick(&live_in(&e, now, &[AgentState::Busy]), i) {
                    let view = e.agent(a, now).unwrap();
                    let job = view.job_id.unwrap();
                    e.job_completed(a, &job, Some(0), now).unwrap();
                    if view.mode == Mode::Standalone {
                        world.completed(&job);
                    }
                }
            }
            Op::Disconnect(i) => {
                let all: Vec<AgentId> = e.agents(false, now).iter().map(|a| a.agent_id).collect();
                if let Some(a) = pick(&all, i) {
                    e.agent_disconnected(a, now).unwrap();
                }
            }
            Op::OperatorDestroy(i) => {
                let all: Vec<AgentId> = e.agents(false, now).iter().map(|a| a.agent_id).collect();
                if let Some(a) = pick(&all, i) {
                    e.destroy_agent(a, now).unwrap();
                }
            }
            Op::DestroyOk(i) => {
                if let Some(a) = pick(&world.destroying, i) {
                    world.destroying.retain(|x| *x != a);
                    e.destroy_finished(a, now);
                }
            }
            Op::DestroyFail(i) => {
                if let Some(a) = pick(&world.destroying, i) {
                    world.destroying.retain(|x| *x != a);
                    e.destroy_failed(a, "busy".into(), now);
                }
            }
            Op::Cancel(j) => {
                e.cancel_scale(&job(&format!("j{j}")), now);
            }
            Op::Cordon(on) => {
                let name = if config_b { "other" } else { "small" };
                if on {
                    e.cordon(name).unwrap();
                } else {
                    e.uncordon(name, now).unwrap();
                }
            }
            Op::Reload(b) => {
                if b != config_b {
                    e.reload(config(if b { CONFIG_B } else { CONFIG_A }), now)
                        .unwrap();
                    config_b = b;
                }
            }
            Op::Advance(s) => {
                let now = clock.advance(s as u64);
                e.tick(now);
            }
        }
        world.absorb(&mut e, clock.now());
        refusals.absorb(&mut e);
        check_books(&e, clock.now());
    }
    // Shutdown releases everything once the backend has done its part.
    let now = clock.advance(1);
    e.shutdown(now);
    world.absorb(&mut e, now);
    // Destroys that failed earlier are re-issued after the retry delay.
    for _ in 0..3 {
        for a in std::mem::take(&mut world.destroying) {
            e.destroy_finished(a, clock.now());
        }
        let now = clock.advance(31);
        e.tick(now);
        world.absorb(&mut e, now);
    }
    let now = clock.now();
    assert!(e.is_idle(), "agents left: {:?}", e.agents(false, now));
    let usage = e.admission().usage();
    assert_eq!(usage.global.agents, 0);
    assert_eq!(usage.global.cpu, MilliCpu::ZERO);
    assert_eq!(e.pending_len(), 0);
    // Every standalone job reached an end: its command's, or one the
    // engine told its dispatcher about.
    assert!(
        world.standalone.is_empty(),
        "standalone jobs without an end: {:?}",
        world.standalone.keys().collect::<Vec<_>>()
    );
    // Every agent that existed is gone and its token revoked.
    assert_eq!(world.revoked, world.spawned_ever);
    assert_eq!(world.ended, world.spawned_ever, "every end told once");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn books_balance_under_any_interleaving(ops in prop::collection::vec(op(), 1..120)) {
        run(ops);
    }
}
