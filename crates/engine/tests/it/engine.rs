#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The engine as a state machine: every test drives it with an explicit
//! clock and asserts its answers, effects, events and capacity accounting.

use crate::common;

use common::*;
use kici_admission::Cap;
use kici_engine::{
    AgentError, AgentState, BreakerState, Effect, Engine, EngineEvent, EngineSettings,
    FailureReason, HoldLapsed, HoldRefused, JobEffect, JobLost, Mode, PendingEnd, ResourceHandle,
    ScaleError, ScaleOutcome, StopCause,
};
use kici_model::{AgentId, MemoryBytes, MilliCpu, ResourceRequest, ResourceSpec};
use std::time::Duration;

fn destroy_orders(e: &mut Engine) -> Vec<AgentId> {
    e.take_effects()
        .into_iter()
        .filter_map(|f| match f {
            Effect::Destroy(o) => Some(o.agent),
            _ => None,
        })
        .collect()
}

fn split_effects(e: &mut Engine) -> (Vec<AgentId>, Vec<AgentId>) {
    let (mut spawns, mut destroys) = (Vec::new(), Vec::new());
    for f in e.take_effects() {
        match f {
            Effect::Spawn(o) => spawns.push(o.agent),
            Effect::Destroy(o) => destroys.push(o.agent),
            Effect::Revoke(_) | Effect::Ended(_) | Effect::Job(_) => {}
        }
    }
    (spawns, destroys)
}

fn state(e: &Engine, a: AgentId, now: std::time::Instant) -> AgentState {
    e.agent(a, now).unwrap().state
}

/// Backend up + registration, no job started.
fn register(e: &mut Engine, a: AgentId, now: std::time::Instant) -> kici_engine::Registration {
    e.spawn_succeeded(
        a,
        ResourceHandle {
            id: format!("h-{a}"),
            ..Default::default()
        },
        now,
    );
    e.agent_registered(a, now).unwrap()
}

/// Backend up + registration + job dispatched.
fn bring_up(e: &mut Engine, a: AgentId, now: std::time::Instant) {
    let reg = register(e, a, now);
    if let Some(job) = reg.bound_job_id {
        e.job_started(a, job, now).unwrap();
    }
}

fn finish_destroy(e: &mut Engine, now: std::time::Instant) -> Vec<AgentId> {
    let ids = destroy_orders(e);
    for a in &ids {
        e.destroy_finished(*a, now);
    }
    ids
}

#[test]
fn job_bound_agent_runs_its_job_and_releases_everything() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(BASIC);
    let out = e
        .request_scale(request("j1", &["linux", "docker"]), now)
        .unwrap();
    let a = spawned(&out);
    assert!(a.to_string().starts_with("scaler-container-"));
    match &out {
        ScaleOutcome::Spawning { scaler, warm, .. } => {
            assert_eq!(scaler.as_str(), "docker");
            assert!(!warm);
        }
        _ => unreachable!(),
    }
    let effects = e.take_effects();
    // A standalone job: its dispatcher is told the agent, then the spawn.
    let [Effect::Job(JobEffect::Bound { job: bound, agent }), Effect::Spawn(order)] =
        effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!((bound.as_str(), *agent), ("j1", a));
    assert_eq!(order.job.as_ref().unwrap().as_str(), "j1");
    assert_eq!(order.resources.requests.cpu, MilliCpu::from_millis(1000));
    assert!(order
        .agent_labels
        .contains(&"kici:agent:container".to_string()));
    assert!(order
        .agent_labels
        .contains(&"kici:scaler:docker".to_string()));
    assert_eq!(state(&e, a, now), AgentState::Provisioning);
    assert_eq!(usage_of(&e, "docker").agents, 1);

    e.spawn_succeeded(
        a,
        ResourceHandle {
            id: "c1".into(),
            ..Default::default()
        },
        now,
    );
    assert_eq!(state(&e, a, now), AgentState::Booted);
    let reg = e.agent_registered(a, now).unwrap();
    assert_eq!(reg.bound_job_id.as_ref().unwrap().as_str(), "j1");
    assert!(reg.mandatory_labels.is_empty());
    e.job_started(a, job("j1"), now).unwrap();
    assert_eq!(state(&e, a, now), AgentState::Busy);
    e.job_completed(a, &job("j1"), Some(0), now).unwrap();
    assert_eq!(state(&e, a, now), AgentState::Destroying);
    assert_eq!(finish_destroy(&mut e, now), [a]);
    assert_eq!(state(&e, a, now), AgentState::Gone);
    assert_eq!(usage_of(&e, "docker").agents, 0);
    assert_eq!(usage_of(&e, "docker").cpu, MilliCpu::ZERO);
    assert!(e.agents(false, now).is_empty());
    assert_eq!(e.agents(true, now).len(), 1);

    let transitions: Vec<(AgentState, AgentState)> = e
        .take_events()
        .into_iter()
        .filter_map(|ev| match ev {
            EngineEvent::AgentTransition { from, to, .. } => Some((from, to)),
            _ => None,
        })
        .collect();
    use AgentState::*;
    assert_eq!(
        transitions,
        [
            (Requested, Provisioning),
            (Provisioning, Booted),
            (Booted, Registered),
            (Registered, Busy),
            (Busy, Destroying),
            (Destroying, Gone)
        ]
    );
}

#[test]
fn no_backend_is_explained() {
    let mut e = engine(BASIC);
    let out = e
        .request_scale(request("j1", &["windows"]), Clock::new().now())
        .unwrap();
    let ScaleOutcome::NoBackend { explanation } = out else {
        panic!("{out:?}")
    };
    assert!(
        explanation.contains("not-superset:windows"),
        "{explanation}"
    );
    assert!(e.take_effects().is_empty());
}

#[test]
fn count_cap_keeps_request_pending_until_a_release_wakes_it() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(BASIC);
    let a1 = spawned(&e.request_scale(request("j1", &["local"]), now).unwrap());
    let _a2 = spawned(&e.request_scale(request("j2", &["local"]), now).unwrap());
    let out = e.request_scale(request("j3", &["local"]), now).unwrap();
    assert_eq!(out, ScaleOutcome::Pending { position: 1 });
    let out = e.request_scale(request("j4", &["local"]), now).unwrap();
    assert_eq!(out, ScaleOutcome::Pending { position: 2 });
    assert!(e.take_events().iter().any(|ev| matches!(
        ev,
        EngineEvent::Refused {
            cap: Cap::ScalerCount,
            ..
        }
    )));
    spawn_orders(&mut e);
    // Release of a1 admits j3 (the oldest), without any tick.
    bring_up(&mut e, a1, now);
    e.agent_disconnected(a1, now).unwrap();
    finish_destroy(&mut e, now);
    let spawned_now = spawn_orders(&mut e);
    assert_eq!(spawned_now.len(), 1);
    let a3 = spawned(&e.request_scale(request("j3", &["local"]), now).unwrap());
    assert_eq!(spawned_now[0], a3);
    assert_eq!(
        e.request_scale(request("j4", &["local"]), now).unwrap(),
        ScaleOutcome::Pending { position: 1 }
    );
}

/// `(scaler's oldest pending, global oldest pending)` at `now`.
fn oldest_pending(
    e: &Engine,
    scaler: &str,
    now: std::time::Instant,
) -> (Option<Duration>, Option<Duration>) {
    let status = e.status(now);
    let s = status
        .scalers
        .iter()
        .find(|s| s.name.as_str() == scaler)
        .unwrap();
    (s.oldest_pending, status.oldest_pending)
}

#[test]
fn status_tells_how_long_the_oldest_pending_request_has_waited() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    let secs = |s: u64| Some(Duration::from_secs(s));
    // `local` takes two agents: both admitted, nothing waits.
    let a1 = spawned(
        &e.request_scale(request("j1", &["local"]), clock.now())
            .unwrap(),
    );
    spawned(
        &e.request_scale(request("j2", &["local"]), clock.now())
            .unwrap(),
    );
    assert_eq!(oldest_pending(&e, "local", clock.now()), (None, None));

    e.request_scale(request("j3", &["local"]), clock.now())
        .unwrap();
    clock.advance(10);
    // Of another shape (its own queue inside the pending queue).
    let mut smaller = request("j4", &["local"]);
    smaller.resources = Some(ResourceRequest::flat(ResourceSpec {
        cpus: Some(MilliCpu::from_millis(500)),
        memory: None,
    }));
    e.request_scale(smaller, clock.now()).unwrap();
    assert_eq!(e.pending_len(), 2);
    // The age is the oldest request's, and grows with the clock.
    let now = clock.advance(5);
    assert_eq!(oldest_pending(&e, "local", now), (secs(15), secs(15)));
    let now = clock.advance(30);
    assert_eq!(oldest_pending(&e, "local", now), (secs(45), secs(45)));
    // Another scaler's younger request: its own age; the global one stays
    // the oldest of all.
    for j in ["d1", "d2"] {
        spawned(&e.request_scale(request(j, &["docker"]), now).unwrap());
    }
    e.request_scale(request("d3", &["docker"]), now).unwrap();
    let now = clock.advance(2);
    assert_eq!(oldest_pending(&e, "docker", now), (secs(2), secs(47)));

    // Cancelling the oldest: the next one's age.
    assert!(e.cancel_scale(&job("j3"), now));
    assert_eq!(oldest_pending(&e, "local", now), (secs(37), secs(37)));
    // A release admits the last one: nothing of `local` waits any more.
    bring_up(&mut e, a1, now);
    e.agent_disconnected(a1, now).unwrap();
    finish_destroy(&mut e, now);
    assert_eq!(e.pending_len(), 1, "only docker's request waits");
    assert_eq!(oldest_pending(&e, "local", now), (None, secs(2)));
    assert!(e.cancel_scale(&job("d3"), now));
    assert_eq!(oldest_pending(&e, "docker", now), (None, None));
}

#[test]
fn global_cap_counts_admitted_agents_across_scalers() {
    let yaml = BASIC.replace("globalMaxAgents: 10", "globalMaxAgents: 2");
    let now = Clock::new().now();
    let mut e = engine(&yaml);
    spawned(&e.request_scale(request("j1", &["local"]), now).unwrap());
    spawned(&e.request_scale(request("j2", &["docker"]), now).unwrap());
    assert!(matches!(
        e.request_scale(request("j3", &["docker"]), now).unwrap(),
        ScaleOutcome::Pending { .. }
    ));
    let refused: Vec<Cap> = e
        .take_events()
        .into_iter()
        .filter_map(|ev| match ev {
            EngineEvent::Refused { cap, .. } => Some(cap),
            _ => None,
        })
        .collect();
    assert_eq!(refused, [Cap::GlobalCount]);
}

#[test]
fn resource_caps_refuse_and_too_large_is_immediate() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    // docker: resourceCap.maxCpu 2, 1 cpu per agent.
    spawned(&e.request_scale(request("j1", &["docker"]), now).unwrap());
    spawned(&e.request_scale(request("j2", &["docker"]), now).unwrap());
    assert!(matches!(
        e.request_scale(request("j3", &["docker"]), now).unwrap(),
        ScaleOutcome::Pending { .. }
    ));
    let mut big = request("j4", &["docker"]);
    big.resources = Some(ResourceRequest::flat(ResourceSpec {
        cpus: Some(MilliCpu::from_millis(3000)),
        memory: None,
    }));
    let out = e.request_scale(big, now).unwrap();
    let ScaleOutcome::TooLarge { cap, detail } = out else {
        panic!("{out:?}")
    };
    assert_eq!(cap, Cap::ScalerCpu);
    assert!(!detail.is_empty());
    // A too-large request is not kept.
    assert_eq!(e.pending_len(), 1);
}

#[test]
fn same_job_id_is_deduplicated_and_a_different_body_conflicts() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    let first = e.request_scale(request("j1", &["docker"]), now).unwrap();
    let again = e.request_scale(request("j1", &["docker"]), now).unwrap();
    assert_eq!(first, again);
    assert_eq!(spawn_orders(&mut e).len(), 1, "no duplicate spawn");
    let err = e.request_scale(request("j1", &["local"]), now).unwrap_err();
    assert_eq!(err, ScaleError::Conflict(job("j1")));
    // Pending requests are deduplicated too.
    for j in ["j2", "j3"] {
        e.request_scale(request(j, &["local"]), now).unwrap();
    }
    let p1 = e.request_scale(request("j4", &["local"]), now).unwrap();
    let p2 = e.request_scale(request("j4", &["local"]), now).unwrap();
    assert_eq!(p1, p2);
    assert_eq!(e.pending_len(), 1);
}

#[test]
fn cancel_removes_pending_or_stops_an_unregistered_agent() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    let a1 = spawned(&e.request_scale(request("j1", &["local"]), now).unwrap());
    spawned(&e.request_scale(request("j2", &["local"]), now).unwrap());
    e.request_scale(request("j3", &["local"]), now).unwrap();
    assert!(e.cancel_scale(&job("j3"), now));
    assert_eq!(e.pending_len(), 0);
    assert!(e.take_events().iter().any(|ev| matches!(
        ev,
        EngineEvent::PendingEnded {
            end: PendingEnd::Cancelled,
            ..
        }
    )));
    assert!(e.cancel_scale(&job("j1"), now));
    assert_eq!(state(&e, a1, now), AgentState::Destroying);
    assert_eq!(finish_destroy(&mut e, now), [a1]);
    assert!(!e.cancel_scale(&job("nope"), now));
    // The job id is free again.
    assert!(matches!(
        e.request_scale(request("j1", &["local"]), now).unwrap(),
        ScaleOutcome::Spawning { .. }
    ));
}

#[test]
fn provision_timeout_destroys_backs_off_and_requeues_the_job() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    let a = spawned(
        &e.request_scale(orchestrator_request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    spawn_orders(&mut e);
    assert!(e.next_deadline(clock.now()).is_some());
    let now = clock.advance(299);
    e.tick(now);
    assert_eq!(state(&e, a, now), AgentState::Provisioning);
    let now = clock.advance(1);
    e.tick(now);
    let view = e.agent(a, now).unwrap();
    assert_eq!(view.state, AgentState::Destroying);
    assert_eq!(view.failure_reason, Some(FailureReason::ProvisionTimeout));
    // The job is pending again, waiting out the backoff (1 s).
    assert_eq!(e.pending_len(), 1);
    assert_eq!(
        e.request_scale(orchestrator_request("j1", &["docker"]), now)
            .unwrap(),
        ScaleOutcome::Pending { position: 1 }
    );
    finish_destroy(&mut e, now);
    assert!(spawn_orders(&mut e).is_empty(), "backoff holds the retry");
    let now = clock.advance(1);
    e.tick(now);
    assert_eq!(spawn_orders(&mut e).len(), 1, "retried after backoff");
}

/// An orchestrator job whose agent registered and then waited past the
/// pending-dispatch timeout (nobody dispatched it, or it went elsewhere)
/// ends: the request is not admitted again by itself, so the job id never
/// gets a second agent.
#[test]
fn a_job_whose_agent_waited_past_pending_dispatch_ends_and_gets_no_second_agent() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    let a = spawned(
        &e.request_scale(orchestrator_request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    assert_eq!(spawn_orders(&mut e).len(), 1);
    let now = clock.now();
    register(&mut e, a, now);
    let now = clock.advance(60);
    e.tick(now);
    let view = e.agent(a, now).unwrap();
    assert_eq!(view.state, AgentState::Destroying);
    assert_eq!(
        view.failure_reason,
        Some(FailureReason::PendingDispatchTimeout)
    );
    assert_eq!(e.pending_len(), 0, "not back in the queue");
    finish_destroy(&mut e, now);
    for _ in 0..5 {
        let now = clock.advance(60);
        e.tick(now);
        assert!(spawn_orders(&mut e).is_empty(), "no second agent");
    }
    // A new request for the job id is a new request.
    assert!(matches!(
        e.request_scale(orchestrator_request("j1", &["docker"]), clock.now())
            .unwrap(),
        ScaleOutcome::Spawning { .. }
    ));
}

/// A cancel of a bound request whose agent registered but has not started
/// the job destroys the agent, and nothing comes back.
#[test]
fn a_cancel_of_a_registered_unstarted_agent_destroys_it_and_nothing_comes_back() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    let a = spawned(
        &e.request_scale(orchestrator_request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    spawn_orders(&mut e);
    let now = clock.now();
    register(&mut e, a, now);
    assert!(e.cancel_scale(&job("j1"), now), "cancelled");
    assert_eq!(state(&e, a, now), AgentState::Destroying);
    assert_eq!(destroy_orders(&mut e), vec![a]);
    e.destroy_finished(a, now);
    assert_eq!(e.pending_len(), 0);
    for _ in 0..3 {
        let now = clock.advance(60);
        e.tick(now);
        assert!(spawn_orders(&mut e).is_empty(), "nothing comes back");
    }
}

/// An agent that exits after it registered (its dispatcher may have given
/// it the job) ends its request; one that exits before registering is
/// retried after the backoff.
#[test]
fn only_an_agent_that_never_registered_gives_its_job_back() {
    let clock = Clock::new();
    let mut e = engine(BASIC);
    let a = spawned(
        &e.request_scale(orchestrator_request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    spawn_orders(&mut e);
    let now = clock.now();
    register(&mut e, a, now);
    e.agent_exited(a, false, "exited 1".into(), now);
    assert_eq!(e.pending_len(), 0, "registered: the request ended");

    let b = spawned(
        &e.request_scale(orchestrator_request("j2", &["docker"]), now)
            .unwrap(),
    );
    spawn_orders(&mut e);
    e.spawn_succeeded(
        b,
        ResourceHandle {
            id: format!("h-{b}"),
            ..Default::default()
        },
        now,
    );
    e.agent_exited(b, false, "exited 1".into(), now);
    assert_eq!(e.pending_len(), 1, "never registered: back in the queue");
}

/// The job effects among the engine's effects since the last call.
fn job_effects(e: &mut Engine) -> Vec<JobEffect> {
    e.take_effects()
        .into_iter()
        .filter_map(|f| match f {
            Effect::Job(j) => Some(j),
            _ => None,
        })
        .collect()
}

#[test]
fn a_standalone_job_whose_agent_fails_ends_and_is_never_requeued() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    let a = spawned(
        &e.request_scale(request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    assert_eq!(
        job_effects(&mut e),
        [JobEffect::Bound {
            job: job("j1"),
            agent: a
        }]
    );
    let now = clock.advance(300);
    e.tick(now);
    assert_eq!(state(&e, a, now), AgentState::Destroying);
    // The engine ends the job itself; nothing waits in the queue.
    assert_eq!(
        job_effects(&mut e),
        [JobEffect::Ended {
            job: job("j1"),
            lost: JobLost::AgentFailed {
                agent: a,
                reason: FailureReason::ProvisionTimeout,
                detail: None
            }
        }]
    );
    assert_eq!(e.pending_len(), 0);
    e.destroy_finished(a, now);
    let now = clock.advance(60);
    e.tick(now);
    assert!(spawn_orders(&mut e).is_empty(), "never retried");
}

#[test]
fn a_standalone_job_ends_once_whatever_ends_it() {
    let clock = Clock::new();
    let now = clock.now();
    // Its agent disconnects mid-job: one end, naming the stop.
    let mut e = engine(BASIC);
    let a = spawned(&e.request_scale(request("j1", &["docker"]), now).unwrap());
    bring_up(&mut e, a, now);
    e.job_started(a, job("j1"), now).unwrap();
    job_effects(&mut e);
    e.agent_disconnected(a, now).unwrap();
    e.destroy_finished(a, now);
    let effects = e.take_effects();
    let ends: Vec<_> = effects
        .iter()
        .filter(|f| matches!(f, Effect::Job(JobEffect::Ended { .. })))
        .collect();
    assert!(
        matches!(
            ends.as_slice(),
            [Effect::Job(JobEffect::Ended {
                lost: JobLost::AgentStopped {
                    cause: StopCause::Disconnected,
                    ..
                },
                ..
            })]
        ),
        "{effects:?}"
    );
    assert!(
        effects
            .iter()
            .any(|f| matches!(f, Effect::Revoke(x) if *x == a)),
        "gone revokes the token: {effects:?}"
    );

    // Its command ended: no end from the engine.
    let b = spawned(&e.request_scale(request("j2", &["docker"]), now).unwrap());
    bring_up(&mut e, b, now);
    e.job_started(b, job("j2"), now).unwrap();
    e.job_completed(b, &job("j2"), Some(3), now).unwrap();
    e.destroy_finished(b, now);
    assert!(!job_effects(&mut e)
        .iter()
        .any(|j| matches!(j, JobEffect::Ended { .. })));

    // Waiting, then shut down: the pending end.
    let mut e = engine(BASIC);
    let _ = e.request_scale(request("j3", &["docker"]), now).unwrap();
    let _ = e.request_scale(request("j4", &["docker"]), now).unwrap();
    let _ = e.request_scale(request("j5", &["docker"]), now).unwrap();
    job_effects(&mut e);
    e.shutdown(now);
    let ends: Vec<JobEffect> = job_effects(&mut e);
    assert_eq!(ends.len(), 3, "{ends:?}");
    assert!(ends.iter().any(|j| matches!(
        j,
        JobEffect::Ended {
            lost: JobLost::Pending(PendingEnd::Cancelled),
            ..
        }
    )));
}

#[test]
fn registration_timeout_is_a_failure() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    let a = spawned(
        &e.request_scale(request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    e.spawn_succeeded(a, ResourceHandle::default(), clock.now());
    let now = clock.advance(120);
    e.tick(now);
    assert_eq!(
        e.agent(a, now).unwrap().failure_reason,
        Some(FailureReason::RegistrationTimeout)
    );
}

#[test]
fn breaker_opens_after_consecutive_failures_and_closes_on_success() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    e.request_scale(orchestrator_request("j1", &["docker"]), clock.now())
        .unwrap();
    for _ in 0..5 {
        let ids = spawn_orders(&mut e);
        assert_eq!(ids.len(), 1);
        e.spawn_failed(ids[0], "image not found".into(), clock.now());
        finish_destroy(&mut e, clock.now());
        // Wait out whatever backoff applies (1, 2, 4, 8 s; then the breaker).
        let now = clock.advance(8);
        e.tick(now);
    }
    let status = e.status(clock.now());
    let docker = status
        .scalers
        .iter()
        .find(|s| s.name.as_str() == "docker")
        .unwrap();
    assert_eq!(docker.label_sets[0].breaker, BreakerState::Open);
    assert_eq!(docker.label_sets[0].consecutive_failures, 5);
    assert!(spawn_orders(&mut e).is_empty());
    // Half-open after 60 s: exactly one probe.
    let now = clock.advance(60);
    e.tick(now);
    let probe = spawn_orders(&mut e);
    assert_eq!(probe.len(), 1);
    bring_up(&mut e, probe[0], now);
    let status = e.status(now);
    let docker = status
        .scalers
        .iter()
        .find(|s| s.name.as_str() == "docker")
        .unwrap();
    assert_eq!(docker.label_sets[0].breaker, BreakerState::Closed);
    assert!(e.take_events().iter().any(|ev| matches!(
        ev,
        EngineEvent::BreakerChanged {
            state: BreakerState::Open,
            ..
        }
    )));
}

const WARM: &str = r#"
version: 1
scalers:
  - name: warm
    type: bare-metal
    maxAgents: 3
    warmPool: { enabled: true, size: 2, idleTimeoutSeconds: 60 }
    labelSets:
      - labels: [linux, warm]
        binaryPath: /usr/bin/kici-agent-lite
        resources: { cpus: 1, memory: 1g }
"#;

#[test]
fn warm_pool_fills_serves_a_job_and_is_replaced_once() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(WARM);
    e.tick(now);
    let warm = spawn_orders(&mut e);
    assert_eq!(warm.len(), 2, "pool fills to size");
    // Filling counts in-flight spawns: another tick spawns nothing.
    e.tick(now);
    assert!(spawn_orders(&mut e).is_empty());
    for a in &warm {
        bring_up(&mut e, *a, now);
        assert_eq!(state(&e, *a, now), AgentState::Idle);
    }
    assert_eq!(
        usage_of(&e, "warm").agents,
        2,
        "warm agents hold reservations"
    );
    let out = e.request_scale(request("j1", &["warm"]), now).unwrap();
    let ScaleOutcome::Spawning {
        agent_id,
        warm: true,
        ..
    } = out
    else {
        panic!("{out:?}")
    };
    assert_eq!(agent_id, warm[0], "oldest idle agent first");
    assert_eq!(state(&e, agent_id, now), AgentState::Busy);
    // Exactly one replacement.
    assert_eq!(spawn_orders(&mut e).len(), 1);
    // The cap (3) holds: a second job takes the other warm agent; the
    // replacement for that one is refused by the cap, not over-spawned.
    let out = e.request_scale(request("j2", &["warm"]), now).unwrap();
    assert!(matches!(out, ScaleOutcome::Spawning { warm: true, .. }));
    assert!(spawn_orders(&mut e).is_empty());
    assert_eq!(usage_of(&e, "warm").agents, 3);
}

#[test]
fn warm_idle_agents_are_drained_after_ttl_plus_grace_and_refilled() {
    let mut clock = Clock::new();
    let mut e = engine(WARM);
    e.tick(clock.now());
    let warm = spawn_orders(&mut e);
    for a in &warm {
        bring_up(&mut e, *a, clock.now());
    }
    let now = clock.advance(60 + 29);
    e.tick(now);
    assert_eq!(state(&e, warm[0], now), AgentState::Idle);
    let now = clock.advance(1);
    e.tick(now);
    assert_eq!(state(&e, warm[0], now), AgentState::Destroying);
    let (mut spawns, destroys) = split_effects(&mut e);
    assert_eq!(destroys.len(), 2);
    // maxAgents 3: while both old agents still hold their slots, one refill fits.
    assert_eq!(spawns.len(), 1);
    for a in destroys {
        e.destroy_finished(a, now);
    }
    spawns.extend(split_effects(&mut e).0);
    assert_eq!(spawns.len(), 2, "refilled to size after release, no more");
}

#[test]
fn warm_spawn_env_has_idle_timeout_in_milliseconds() {
    let now = Clock::new().now();
    let mut e = engine(WARM);
    e.tick(now);
    let effects = e.take_effects();
    let Effect::Spawn(order) = &effects[0] else {
        panic!()
    };
    assert!(order.warm);
    assert_eq!(order.idle_timeout_ms, Some(60_000));
}

#[test]
fn orchestrator_mode_agent_goes_idle_after_job_and_leaves_on_disconnect() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    let mut req = request("j1", &["docker"]);
    req.mode = Mode::Orchestrator;
    let a = spawned(&e.request_scale(req, now).unwrap());
    bring_up(&mut e, a, now);
    e.job_completed(a, &job("j1"), Some(0), now).unwrap();
    assert_eq!(state(&e, a, now), AgentState::Idle);
    // It may take another queued job from the orchestrator.
    e.job_started(a, job("j9"), now).unwrap();
    assert_eq!(state(&e, a, now), AgentState::Busy);
    e.agent_disconnected(a, now).unwrap();
    assert_eq!(state(&e, a, now), AgentState::Destroying);
    // Idempotent.
    e.agent_disconnected(a, now).unwrap();
    assert_eq!(destroy_orders(&mut e), [a]);
}

#[test]
fn max_lifetime_ends_even_a_busy_agent() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    let a = spawned(
        &e.request_scale(request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    bring_up(&mut e, a, clock.now());
    let now = clock.advance(24 * 3600);
    e.tick(now);
    let v = e.agent(a, now).unwrap();
    assert_eq!(v.state, AgentState::Destroying);
    assert_eq!(v.failure_reason, Some(FailureReason::LifetimeExceeded));
}

#[test]
fn unknown_and_gone_agents_are_errors() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    let stranger: AgentId = "scaler-container-00000000".parse().unwrap();
    assert_eq!(
        e.agent_registered(stranger, now),
        Err(AgentError::NotOurs(stranger))
    );
    let a = spawned(&e.request_scale(request("j1", &["docker"]), now).unwrap());
    e.destroy_agent(a, now).unwrap();
    finish_destroy(&mut e, now);
    assert_eq!(e.agent_registered(a, now), Err(AgentError::Gone(a)));
}

#[test]
fn starved_request_holds_capacity_against_younger_ones() {
    let yaml = r#"
version: 1
scalers:
  - name: s
    type: bare-metal
    maxAgents: 10
    resourceCap: { maxCpu: 4 }
    labelSets:
      - labels: [s]
        binaryPath: /bin/agent
"#;
    let mut clock = Clock::new();
    let mut e = engine(yaml);
    let cpus = |n: u64| {
        Some(ResourceRequest::flat(ResourceSpec {
            cpus: Some(MilliCpu::from_millis(n * 1000)),
            memory: None,
        }))
    };
    let mut r = request("small-1", &["s"]);
    r.resources = cpus(3);
    let holder = spawned(&e.request_scale(r, clock.now()).unwrap());
    let mut big = request("big", &["s"]);
    big.resources = cpus(4);
    assert!(matches!(
        e.request_scale(big, clock.now()).unwrap(),
        ScaleOutcome::Pending { .. }
    ));
    // Young: a small request may still pass the waiting big one.
    let mut r = request("small-2", &["s"]);
    r.resources = cpus(1);
    let passer = spawned(&e.request_scale(r, clock.now()).unwrap());
    // After the starvation threshold the big one holds what it needs.
    let now = clock.advance(300);
    for a in [holder, passer] {
        bring_up(&mut e, a, now);
        e.job_completed(a, &e.agent(a, now).unwrap().job_id.unwrap(), Some(0), now)
            .unwrap();
    }
    spawn_orders(&mut e);
    e.destroy_finished(holder, now);
    // 3 cpus are free, the big request needs 4: younger 1-cpu requests must wait.
    let mut r = request("small-3", &["s"]);
    r.resources = cpus(1);
    assert!(matches!(
        e.request_scale(r, now).unwrap(),
        ScaleOutcome::Pending { .. }
    ));
    e.destroy_finished(passer, now);
    let out = e
        .request_scale(
            {
                let mut b = request("big", &["s"]);
                b.resources = cpus(4);
                b
            },
            now,
        )
        .unwrap();
    assert!(matches!(out, ScaleOutcome::Spawning { .. }), "{out:?}");
}

#[test]
fn cordon_and_drain() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    let busy = spawned(&e.request_scale(request("j1", &["docker"]), now).unwrap());
    bring_up(&mut e, busy, now);
    e.cordon("docker").unwrap();
    let out = e.request_scale(request("j2", &["docker"]), now).unwrap();
    let ScaleOutcome::NoBackend { explanation } = out else {
        panic!("{out:?}")
    };
    assert!(explanation.contains("cordoned"), "{explanation}");
    assert!(e.status(now).scalers.iter().any(|s| s.cordoned));
    e.uncordon("docker", now).unwrap();
    assert!(matches!(
        e.request_scale(request("j2", &["docker"]), now).unwrap(),
        ScaleOutcome::Spawning { .. }
    ));
    e.drain("docker", now).unwrap();
    // Busy agents finish their job, then leave; they are never drained early.
    assert_eq!(state(&e, busy, now), AgentState::Busy);
    e.job_completed(busy, &job("j1"), Some(0), now).unwrap();
    assert_eq!(state(&e, busy, now), AgentState::Destroying);
    assert_eq!(
        e.cordon("nope"),
        Err(AgentError::UnknownScaler("nope".into()))
    );
}

#[test]
fn reload_removes_a_scaler_its_pending_requests_and_idle_agents() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    let busy = spawned(&e.request_scale(request("j1", &["local"]), now).unwrap());
    bring_up(&mut e, busy, now);
    spawned(&e.request_scale(request("j2", &["local"]), now).unwrap());
    e.request_scale(request("j3", &["local"]), now).unwrap();
    assert_eq!(e.pending_len(), 1);
    let without_local = r#"
version: 1
globalMaxAgents: 10
scalers:
  - name: docker
    type: container
    maxAgents: 5
    labelSets:
      - labels: [linux, docker]
        image: agent:latest
"#;
    let report = e.reload(config(without_local), now).unwrap();
    assert_eq!(report.removed, ["local"]);
    assert!(
        report
            .changes
            .iter()
            .any(|c| c.contains("scalers[name=local]")),
        "{:?}",
        report.changes
    );
    assert_eq!(report.cancelled, ["j3"]);
    assert_eq!(e.pending_len(), 0);
    // Busy finishes, then leaves; it is not killed by the reload.
    assert_eq!(state(&e, busy, now), AgentState::Busy);
    e.job_completed(busy, &job("j1"), Some(0), now).unwrap();
    assert_eq!(state(&e, busy, now), AgentState::Destroying);
    // Routing no longer knows `local`.
    assert!(matches!(
        e.request_scale(request("j4", &["local"]), now).unwrap(),
        ScaleOutcome::NoBackend { .. }
    ));
    // A type change is a remove plus an add.
    let retyped = without_local
        .replace("type: container", "type: bare-metal")
        .replace("image: agent:latest", "binaryPath: /bin/a");
    let report = e.reload(config(&retyped), now).unwrap();
    assert_eq!(report.removed, ["docker"]);
    assert_eq!(report.added, ["docker"]);
}

#[test]
fn shutdown_cancels_pending_and_destroys_every_agent() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    let a = spawned(&e.request_scale(request("j1", &["local"]), now).unwrap());
    bring_up(&mut e, a, now);
    spawned(&e.request_scale(request("j2", &["local"]), now).unwrap());
    e.request_scale(request("j3", &["local"]), now).unwrap();
    e.take_effects();
    e.shutdown(now);
    assert_eq!(e.pending_len(), 0);
    assert_eq!(destroy_orders(&mut e).len(), 2);
    assert_eq!(
        e.request_scale(request("j4", &["local"]), now),
        Err(ScaleError::ShuttingDown)
    );
}

#[test]
fn destroy_failure_is_retried_and_capacity_stays_held_until_gone() {
    let mut clock = Clock::new();
    let settings = EngineSettings {
        destroy_retry: Duration::from_secs(30),
        ..Default::default()
    };
    let mut e = engine_with(BASIC, settings);
    let a = spawned(
        &e.request_scale(request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    e.destroy_agent(a, clock.now()).unwrap();
    assert_eq!(destroy_orders(&mut e), [a]);
    e.destroy_failed(a, "engine busy".into(), clock.now());
    assert_eq!(usage_of(&e, "docker").agents, 1);
    let now = clock.advance(30);
    e.tick(now);
    assert_eq!(destroy_orders(&mut e), [a], "destroy re-issued");
    e.destroy_finished(a, now);
    assert_eq!(usage_of(&e, "docker").agents, 0);
}

/// A failed destroy goes out again after 1 s, then 2, 4, … capped at
/// `destroy_retry`; one that never answers is ordered again only after
/// `destroy_retry`.
#[test]
fn failed_destroys_back_off_from_one_second_to_the_retry_cap() {
    let mut clock = Clock::new();
    let settings = EngineSettings {
        destroy_retry: Duration::from_secs(10),
        ..Default::default()
    };
    let mut e = engine_with(BASIC, settings);
    let a = spawned(
        &e.request_scale(request("j1", &["docker"]), clock.now())
            .unwrap(),
    );
    e.destroy_agent(a, clock.now()).unwrap();
    assert_eq!(destroy_orders(&mut e), [a]);
    // Unanswered: nothing until destroy_retry.
    e.tick(clock.advance(9));
    assert!(destroy_orders(&mut e).is_empty(), "in flight, not yet due");
    e.tick(clock.advance(1));
    assert_eq!(destroy_orders(&mut e), [a], "unanswered: ordered again");
    for wait in [1u64, 2, 4, 8, 10, 10] {
        e.destroy_failed(a, "refused".into(), clock.now());
        clock.0 += Duration::from_secs(wait) - Duration::from_millis(1);
        e.tick(clock.now());
        assert!(destroy_orders(&mut e).is_empty(), "before {wait} s");
        clock.0 += Duration::from_millis(1);
        e.tick(clock.now());
        assert_eq!(destroy_orders(&mut e), [a], "after {wait} s");
    }
    assert_eq!(usage_of(&e, "docker").agents, 1, "held until gone");
    e.destroy_finished(a, clock.now());
    assert_eq!(usage_of(&e, "docker").agents, 0);
}

#[test]
fn early_exit_before_registration_is_a_failure() {
    let now = Clock::new().now();
    let mut e = engine(BASIC);
    let a = spawned(&e.request_scale(request("j1", &["docker"]), now).unwrap());
    e.spawn_succeeded(a, ResourceHandle::default(), now);
    e.agent_exited(a, false, "exit 1".into(), now);
    assert_eq!(
        e.agent(a, now).unwrap().failure_reason,
        Some(FailureReason::ExitedEarly)
    );
}

#[test]
fn pending_requests_expire_after_their_ttl() {
    let mut clock = Clock::new();
    let settings = EngineSettings {
        pending_ttl: Duration::from_secs(10),
        ..Default::default()
    };
    let mut e = engine_with(BASIC, settings);
    for j in ["j1", "j2", "j3"] {
        e.request_scale(request(j, &["local"]), clock.now())
            .unwrap();
    }
    assert_eq!(e.pending_len(), 1);
    let now = clock.advance(10);
    e.tick(now);
    assert_eq!(e.pending_len(), 0);
    assert!(e.take_events().iter().any(|ev| matches!(
        ev,
        EngineEvent::PendingEnded {
            end: PendingEnd::Expired,
            ..
        }
    )));
}

#[test]
fn memory_caps_use_exact_bytes() {
    let yaml = r#"
version: 1
globalResourceCap: { maxMemory: 2g }
scalers:
  - name: s
    type: bare-metal
    maxAgents: 10
    labelSets:
      - labels: [s]
        binaryPath: /bin/agent
"#;
    let now = Clock::new().now();
    let mut e = engine(yaml);
    let mem = |s: &str| {
        Some(ResourceRequest::flat(ResourceSpec {
            cpus: None,
            memory: Some(s.parse::<MemoryBytes>().unwrap()),
        }))
    };
    let mut r = request("a", &["s"]);
    r.resources = mem("1500m");
    spawned(&e.request_scale(r, now).unwrap());
    let mut r = request("b", &["s"]);
    r.resources = mem("1g");
    assert!(matches!(
        e.request_scale(r, now).unwrap(),
        ScaleOutcome::Pending { .. }
    ));
    let mut r = request("c", &["s"]);
    r.resources = mem("548m");
    assert!(
        matches!(
            e.request_scale(r, now).unwrap(),
            ScaleOutcome::Spawning { .. }
        ),
        "exactly at the cap is allowed"
    );
}

#[test]
fn reload_shrinking_the_warm_pool_destroys_the_newest_idle_agents() {
    let yaml = WARM
        .replace("maxAgents: 3", "maxAgents: 6")
        .replace("size: 2", "size: 4");
    let now = Clock::new().now();
    let mut e = engine(&yaml);
    e.tick(now);
    let warm = spawn_orders(&mut e);
    assert_eq!(warm.len(), 4);
    for a in &warm {
        bring_up(&mut e, *a, now);
    }
    let report = e
        .reload(config(&yaml.replace("size: 4", "size: 2")), now)
        .unwrap();
    assert!(
        report
            .changes
            .iter()
            .any(|c| c.contains("warmPool.size: 4 -> 2")),
        "{:?}",
        report.changes
    );
    let mut destroyed = destroy_orders(&mut e);
    destroyed.sort();
    let mut newest = warm[2..].to_vec();
    newest.sort();
    assert_eq!(destroyed, newest, "the two newest go, the two oldest stay");
    for a in &warm[..2] {
        assert_eq!(state(&e, *a, now), AgentState::Idle);
    }
}

#[test]
fn warm_spawns_respect_the_breaker() {
    let now = Clock::new().now();
    let mut e = engine(WARM);
    e.tick(now);
    let warm = spawn_orders(&mut e);
    assert_eq!(warm.len(), 2);
    for a in &warm {
        e.spawn_failed(*a, "no such binary".into(), now);
    }
    for a in destroy_orders(&mut e) {
        e.destroy_finished(a, now);
    }
    // Backing off: no immediate re-spawn storm.
    e.tick(now);
    assert!(spawn_orders(&mut e).is_empty());
    let status = e.status(now);
    assert_eq!(status.scalers[0].label_sets[0].consecutive_failures, 2);
}

#[test]
fn a_restored_request_keeps_its_place_its_expiry_and_its_dedupe() {
    let clock = Clock::new();
    let settings = EngineSettings {
        pending_ttl: Duration::from_secs(100),
        ..EngineSettings::default()
    };
    let mut e = engine_with(BASIC, settings);
    let now = clock.now();
    let local = ["linux", "local"];
    spawned(&e.request_scale(request("a", &local), now).unwrap());
    spawned(&e.request_scale(request("b", &local), now).unwrap());
    assert_eq!(
        e.request_scale(request("new", &local), now).unwrap(),
        ScaleOutcome::Pending { position: 1 }
    );
    // Recorded 60 s before a restart: ahead of the one that arrived now.
    assert_eq!(
        e.restore_pending(request("old", &local), Duration::from_secs(60), now)
            .unwrap(),
        Some(ScaleOutcome::Pending { position: 1 })
    );
    assert!(e.is_pending(&job("old")) && e.is_pending(&job("new")));
    // Dedupe by job id as before the restart.
    assert_eq!(
        e.request_scale(request("old", &local), now).unwrap(),
        ScaleOutcome::Pending { position: 1 }
    );
    assert!(matches!(
        e.request_scale(request("old", &["linux", "docker"]), now),
        Err(ScaleError::Conflict(_))
    ));
    // Its TTL ran out while the daemon was down: nothing is queued.
    assert_eq!(
        e.restore_pending(request("stale", &local), Duration::from_secs(100), now)
            .unwrap(),
        None
    );
    assert!(!e.is_pending(&job("stale")));
    // It expires 100 s after its arrival (40 s from now); the new one later.
    e.take_events();
    let later = now + Duration::from_secs(41);
    e.tick(later);
    assert!(!e.is_pending(&job("old")));
    assert!(e.is_pending(&job("new")));
    assert!(e.take_events().iter().any(|ev| matches!(
        ev,
        EngineEvent::PendingEnded { job_id, end: PendingEnd::Expired, .. } if *job_id == job("old")
    )));
}

/// A request some other queue keeps (a fleet's): served now or left
/// entirely, never queued here; `classify` says where it would go without
/// admitting anything.
#[test]
fn request_scale_now_serves_now_or_leaves_nothing_behind() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(BASIC);
    let (scaler, resources) = e
        .classify(&orchestrator_request("c", &["linux", "local"]))
        .unwrap();
    assert_eq!(scaler.as_str(), "local");
    assert_eq!(resources.requests.cpu, MilliCpu::from_millis(1000));
    assert_eq!(usage_of(&e, "local").agents, 0, "classify admits nothing");
    assert!(matches!(
        e.classify(&orchestrator_request("x", &["windows"])),
        Err(ScaleOutcome::NoBackend { .. })
    ));

    let a1 = spawned(
        &e.request_scale_now(orchestrator_request("n1", &["linux", "local"]), now)
            .unwrap(),
    );
    let a2 = spawned(
        &e.request_scale_now(orchestrator_request("n2", &["linux", "local"]), now)
            .unwrap(),
    );
    assert_ne!(a1, a2);
    assert!(!e.has_agent_slot("local"), "maxAgents 2 reached");
    assert!(e.has_agent_slot("docker"));
    assert!(!e.has_agent_slot("unknown"));
    // Full (maxAgents 2): not served, and not kept either.
    let third = e
        .request_scale_now(orchestrator_request("n3", &["linux", "local"]), now)
        .unwrap();
    assert_eq!(third, ScaleOutcome::Pending { position: 0 });
    assert!(!e.is_pending(&job("n3")));
    assert!(
        e.job_outcome(&job("n3")).is_none(),
        "no record of n3 remains"
    );
    // A repeat of a served job answers as before (no second agent).
    let again = e
        .request_scale_now(orchestrator_request("n1", &["linux", "local"]), now)
        .unwrap();
    assert_eq!(spawned(&again), a1);
    assert!(
        matches!(e.job_outcome(&job("n1")), Some(ScaleOutcome::Spawning { agent_id, .. }) if agent_id == a1)
    );
    assert_eq!(usage_of(&e, "local").agents, 2);
}

/// A registering agent is told its whole gate — the scaler's
/// `mandatoryLabels` and its label set's platform taints — so the
/// orchestrator holds later jobs to it: a macOS pool's agent on a Linux host
/// is never given a job that does not ask for macos.
#[test]
fn registration_tells_the_agent_its_platform_taints_too() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(
        "version: 1\nscalers:\n  - name: mac\n    type: bare-metal\n    maxAgents: 2\n    mandatoryLabels: [trusted]\n    labelSets:\n      - labels: [trusted, macos, arm64]\n        binaryPath: /bin/true\n",
    );
    let out = e
        .request_scale(
            orchestrator_request("j1", &["trusted", "macos", "arm64"]),
            now,
        )
        .unwrap();
    let a = spawned(&out);
    e.spawn_succeeded(
        a,
        ResourceHandle {
            id: "p1".into(),
            ..Default::default()
        },
        now,
    );
    let reg = e.agent_registered(a, now).unwrap();
    let told: Vec<&str> = reg.mandatory_labels.iter().map(|l| l.as_str()).collect();
    assert_eq!(told, ["arm64", "macos", "trusted"]);
    assert_eq!(&reg.mandatory_labels, e.router().gate(0, 0));
}

/// The job a gone agent is listed with (`GET /v1/agents?all=true`).
fn gone_job(e: &Engine, a: AgentId, now: std::time::Instant) -> Option<String> {
    let view = e
        .agents(true, now)
        .into_iter()
        .find(|v| v.agent_id == a)
        .expect("the agent is listed");
    assert_eq!(view.state, AgentState::Gone, "{view:?}");
    view.job_id.map(|j| j.to_string())
}

/// An ended agent is listed with the job it served, whichever way it went:
/// its job completed (standalone, orchestrator, taken from the warm pool),
/// it waited past the pending-dispatch timeout, its request was cancelled,
/// it failed before registering (its job went back to the queue), an
/// operator destroyed it while busy.
#[test]
fn an_ended_agent_keeps_the_job_it_served_on_every_way_to_gone() {
    let mut clock = Clock::new();
    let mut e = engine(BASIC);
    let now = clock.now();

    // Standalone, completed.
    let a = spawned(&e.request_scale(request("s1", &["docker"]), now).unwrap());
    bring_up(&mut e, a, now);
    e.job_completed(a, &job("s1"), Some(0), now).unwrap();
    finish_destroy(&mut e, now);
    assert_eq!(gone_job(&e, a, now).as_deref(), Some("s1"), "standalone");

    // Orchestrator, completed, then its connection closed while idle.
    let a = spawned(
        &e.request_scale(orchestrator_request("o1", &["docker"]), now)
            .unwrap(),
    );
    bring_up(&mut e, a, now);
    e.job_completed(a, &job("o1"), Some(0), now).unwrap();
    assert_eq!(state(&e, a, now), AgentState::Idle);
    assert_eq!(e.agent(a, now).unwrap().job_id, None, "idle: no job now");
    e.agent_disconnected(a, now).unwrap();
    finish_destroy(&mut e, now);
    assert_eq!(gone_job(&e, a, now).as_deref(), Some("o1"), "orchestrator");

    // Orchestrator, registered, nobody dispatched it.
    let a = spawned(
        &e.request_scale(orchestrator_request("o2", &["docker"]), now)
            .unwrap(),
    );
    register(&mut e, a, now);
    let now = clock.advance(60);
    e.tick(now);
    assert_eq!(
        e.agent(a, now).unwrap().failure_reason,
        Some(FailureReason::PendingDispatchTimeout)
    );
    finish_destroy(&mut e, now);
    assert_eq!(
        gone_job(&e, a, now).as_deref(),
        Some("o2"),
        "pending-dispatch timeout"
    );

    // Cancelled while registered and unstarted.
    let a = spawned(
        &e.request_scale(orchestrator_request("o3", &["docker"]), now)
            .unwrap(),
    );
    register(&mut e, a, now);
    assert!(e.cancel_scale(&job("o3"), now));
    finish_destroy(&mut e, now);
    assert_eq!(gone_job(&e, a, now).as_deref(), Some("o3"), "cancelled");

    // Destroyed by an operator while busy.
    let a = spawned(&e.request_scale(request("s2", &["docker"]), now).unwrap());
    bring_up(&mut e, a, now);
    e.destroy_agent(a, now).unwrap();
    finish_destroy(&mut e, now);
    assert_eq!(gone_job(&e, a, now).as_deref(), Some("s2"), "operator");

    // Failed before it registered: its job goes back to the queue.
    let a = spawned(
        &e.request_scale(orchestrator_request("o4", &["docker"]), now)
            .unwrap(),
    );
    e.take_effects();
    e.spawn_failed(a, "no image".into(), now);
    finish_destroy(&mut e, now);
    assert_eq!(e.pending_len(), 1, "given back");
    assert_eq!(gone_job(&e, a, now).as_deref(), Some("o4"), "spawn failed");

    // Taken from the warm pool, its job completed.
    let mut e = engine(WARM);
    e.tick(now);
    let warm = spawn_orders(&mut e);
    for a in &warm {
        bring_up(&mut e, *a, now);
    }
    let a = spawned(&e.request_scale(request("w1", &["warm"]), now).unwrap());
    e.job_completed(a, &job("w1"), Some(0), now).unwrap();
    finish_destroy(&mut e, now);
    assert_eq!(gone_job(&e, a, now).as_deref(), Some("w1"), "warm");
}

/// A hold sets capacity aside and records nothing else: no job, no agent,
/// no event, no spawn. Dropped, the capacity is free again; admitted, the
/// agent it named is created for the job.
#[test]
fn a_hold_records_nothing_until_admitted_and_frees_its_capacity_when_dropped() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(BASIC);
    e.take_events();
    let r1 = orchestrator_request("h1", &["linux", "local"]);
    let h1 = e.hold(&r1, now).unwrap();
    assert!(!h1.warm());
    assert_eq!(usage_of(&e, "local").agents, 1, "the hold reserves");
    assert!(e.job_outcome(&job("h1")).is_none(), "no job recorded");
    assert!(e.agents(true, now).is_empty(), "no agent recorded");
    assert!(e.take_events().is_empty(), "no event");
    assert!(spawn_orders(&mut e).is_empty(), "no spawn");
    // maxAgents 2: a second hold fits, a third is refused (not now).
    let h2 = e
        .hold(&orchestrator_request("h2", &["linux", "local"]), now)
        .unwrap();
    assert_eq!(
        e.hold(&orchestrator_request("h3", &["linux", "local"]), now)
            .unwrap_err(),
        HoldRefused::NotNow
    );
    drop(h2);
    assert_eq!(usage_of(&e, "local").agents, 1, "dropped: released");
    // Admitted: the agent named by the hold serves the job.
    let agent = h1.agent();
    let out = e.admit_held(h1, now).unwrap();
    assert_eq!(spawned(&out), agent);
    assert_eq!(spawn_orders(&mut e), vec![agent]);
    assert_eq!(
        usage_of(&e, "local").agents,
        1,
        "the reservation moved to the agent"
    );
    // Known now: no second hold for the job.
    assert_eq!(e.hold(&r1, now).unwrap_err(), HoldRefused::Known);
    // Final answers stay final.
    assert!(matches!(
        e.hold(&orchestrator_request("w", &["windows"]), now),
        Err(HoldRefused::Final(ScaleOutcome::NoBackend { .. }))
    ));
    // A cordoned scaler holds nothing: routing skips it, as for any request.
    e.cordon("local").unwrap();
    assert!(matches!(
        e.hold(&orchestrator_request("h4", &["linux", "local"]), now),
        Err(HoldRefused::Final(ScaleOutcome::NoBackend { .. }))
    ));
}

/// A hold on an idle warm agent keeps it from other jobs while it lives;
/// admitted, the warm agent takes the job; dropped, the agent is free again.
#[test]
fn a_hold_sets_a_warm_agent_aside_until_admitted_or_dropped() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(WARM);
    e.tick(now);
    let warm = spawn_orders(&mut e);
    for a in &warm {
        bring_up(&mut e, *a, now);
    }
    let h1 = e.hold(&request("j1", &["warm"]), now).unwrap();
    assert!(h1.warm());
    assert_eq!(h1.agent(), warm[0], "oldest idle agent first");
    // Another job gets the other warm agent, not the held one.
    let h2 = e.hold(&request("j2", &["warm"]), now).unwrap();
    assert_eq!(h2.agent(), warm[1]);
    // Nothing bound while held.
    assert_eq!(state(&e, warm[0], now), AgentState::Idle);
    drop(h2);
    let h3 = e.hold(&request("j3", &["warm"]), now).unwrap();
    assert_eq!(h3.agent(), warm[1], "a dropped hold frees its agent");
    let out = e.admit_held(h1, now).unwrap();
    assert!(
        matches!(out, ScaleOutcome::Spawning { agent_id, warm: true, .. } if agent_id == warm[0])
    );
    assert_eq!(state(&e, warm[0], now), AgentState::Busy);
    // The held agent went away meanwhile: the hold lapses, nothing recorded.
    e.destroy_agent(warm[1], now).unwrap();
    assert_eq!(
        e.admit_held(h3, now).unwrap_err(),
        HoldLapsed::WarmAgentGone(warm[1])
    );
    assert!(e.job_outcome(&job("j3")).is_none());
}

/// A reload between the hold and its admission lapses the hold (its route
/// was computed under the old configuration); nothing is recorded.
#[test]
fn a_hold_lapses_across_a_reload() {
    let clock = Clock::new();
    let now = clock.now();
    let mut e = engine(BASIC);
    let h = e
        .hold(&orchestrator_request("r1", &["linux", "local"]), now)
        .unwrap();
    e.reload(config(BASIC), now).unwrap();
    assert_eq!(e.admit_held(h, now).unwrap_err(), HoldLapsed::Reloaded);
    assert!(e.job_outcome(&job("r1")).is_none());
    assert_eq!(usage_of(&e, "local").agents, 0);
}
