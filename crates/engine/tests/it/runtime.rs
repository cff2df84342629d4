#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The async runtime against the in-memory backend, on tokio's paused clock:
//! timers fire as time is advanced, nothing sleeps for real.

use crate::common;

use common::*;
use kici_engine::memory_backend::MemoryBackend;
use kici_engine::runtime::{DefaultBootstrap, Runtime};
use kici_engine::{AgentState, Backend, FailureReason, ScaleOutcome};
use kici_model::ScalerType;
use std::sync::Arc;
use std::time::Duration;

struct Setup {
    rt: Runtime,
    docker: Arc<MemoryBackend>,
    local: Arc<MemoryBackend>,
}

fn setup(yaml: &str) -> Setup {
    let docker = Arc::new(MemoryBackend::new(ScalerType::Container));
    let local = Arc::new(MemoryBackend::new(ScalerType::BareMetal));
    let backends: Vec<Arc<dyn Backend>> = vec![docker.clone(), local.clone()];
    let rt = Runtime::start(engine(yaml), backends, Arc::new(DefaultBootstrap));
    Setup { rt, docker, local }
}

/// Lets spawned tasks run (paused time auto-advances only when all idle).
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn full_job_lifecycle_through_a_backend() {
    let s = setup(BASIC);
    let a = spawned(&s.rt.request_scale(request("j1", &["docker"])).unwrap());
    settle().await;
    assert_eq!(s.docker.live(), [a]);
    let spec = s.docker.spec(a).unwrap();
    assert_eq!(spec.orchestrator_url, "ws://127.0.0.1:7879/ws");
    assert_eq!(spec.job.as_ref().unwrap().as_str(), "j1");
    assert_eq!(s.rt.agent(a).unwrap().state, AgentState::Booted);
    let reg = s.rt.agent_registered(a).unwrap();
    s.rt.job_started(a, reg.bound_job_id.unwrap()).unwrap();
    s.rt.job_completed(a, &job("j1"), Some(0)).unwrap();
    settle().await;
    assert!(s.docker.live().is_empty());
    assert_eq!(s.docker.destroyed(), [a]);
    assert_eq!(s.rt.agent(a).unwrap().state, AgentState::Gone);
    assert_eq!(s.rt.status().global.agents, 0);
}

#[tokio::test(start_paused = true)]
async fn hung_spawn_times_out_is_destroyed_and_retried_after_backoff() {
    let s = setup(BASIC);
    s.docker.hang_spawns(true);
    let a = spawned(
        &s.rt
            .request_scale(orchestrator_request("j1", &["docker"]))
            .unwrap(),
    );
    settle().await;
    // Only the spawn already in flight hangs.
    s.docker.hang_spawns(false);
    tokio::time::sleep(Duration::from_secs(300)).await;
    settle().await;
    let view = s.rt.agent(a).unwrap();
    assert_eq!(view.state, AgentState::Gone);
    assert_eq!(view.failure_reason, Some(FailureReason::ProvisionTimeout));
    assert!(
        s.docker.destroyed().contains(&a),
        "destroy ran for the cut-short spawn"
    );
    // The job was re-queued and is retried once the 1 s backoff passed.
    assert_eq!(s.docker.spawned().len(), 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    settle().await;
    let spawned_ids = s.docker.spawned();
    assert_eq!(spawned_ids.len(), 2, "{spawned_ids:?}");
    assert_eq!(s.docker.live(), [spawned_ids[1]]);
}

#[tokio::test(start_paused = true)]
async fn failed_destroy_is_retried_until_it_succeeds() {
    let s = setup(BASIC);
    let a = spawned(&s.rt.request_scale(request("j1", &["docker"])).unwrap());
    settle().await;
    s.docker.fail_next_destroys(2);
    s.rt.destroy_agent(a).unwrap();
    settle().await;
    assert_eq!(s.rt.agent(a).unwrap().state, AgentState::Destroying);
    assert_eq!(
        s.rt.status().global.agents,
        1,
        "capacity held while the resource exists"
    );
    tokio::time::sleep(Duration::from_secs(61)).await;
    settle().await;
    assert_eq!(s.rt.agent(a).unwrap().state, AgentState::Gone);
    assert!(s.docker.live().is_empty());
    assert_eq!(s.rt.status().global.agents, 0);
}

#[tokio::test(start_paused = true)]
async fn agent_exit_before_registration_is_reported_and_released() {
    let s = setup(BASIC);
    let a = spawned(&s.rt.request_scale(request("j1", &["local"])).unwrap());
    settle().await;
    assert!(s.local.exit(a, "exit status 3"));
    settle().await;
    let v = s.rt.agent(a).unwrap();
    assert_eq!(v.failure_reason, Some(FailureReason::ExitedEarly));
    assert_eq!(v.state, AgentState::Gone);
}

#[tokio::test(start_paused = true)]
async fn reload_is_all_or_nothing_against_backend_validation() {
    let s = setup(BASIC);
    s.docker
        .set_validate_errors(vec!["image registry unreachable".into()]);
    let smaller = BASIC.replace("maxAgents: 5", "maxAgents: 1");
    let errors = s.rt.reload(config(&smaller)).await.unwrap_err();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("docker") && e.contains("unreachable")),
        "{errors:?}"
    );
    // Nothing changed: two docker agents still fit.
    spawned(&s.rt.request_scale(request("j1", &["docker"])).unwrap());
    spawned(&s.rt.request_scale(request("j2", &["docker"])).unwrap());
    s.docker.set_validate_errors(vec![]);
    s.rt.reload(config(&smaller)).await.unwrap();
    assert!(matches!(
        s.rt.request_scale(request("j3", &["docker"])).unwrap(),
        ScaleOutcome::Pending { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn shutdown_destroys_everything_and_waits() {
    let s = setup(BASIC);
    for j in ["j1", "j2"] {
        spawned(&s.rt.request_scale(request(j, &["docker"])).unwrap());
    }
    spawned(&s.rt.request_scale(request("j3", &["local"])).unwrap());
    settle().await;
    assert!(s.rt.shutdown(Duration::from_secs(30)).await);
    assert!(s.docker.live().is_empty());
    assert!(s.local.live().is_empty());
    assert_eq!(s.rt.status().global.agents, 0);
}

#[tokio::test(start_paused = true)]
async fn events_stream_in_order_with_increasing_ids() {
    let s = setup(BASIC);
    let mut rx = s.rt.subscribe();
    let a = spawned(&s.rt.request_scale(request("j1", &["docker"])).unwrap());
    settle().await;
    let mut ids = Vec::new();
    let mut states = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        ids.push(ev.id);
        if let kici_engine::EngineEvent::AgentTransition { agent_id, to, .. } = &ev.event {
            assert_eq!(*agent_id, a);
            states.push(*to);
        }
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    assert_eq!(states, [AgentState::Provisioning, AgentState::Booted]);
}

#[tokio::test(start_paused = true)]
async fn a_subscriber_taken_right_after_start_sees_the_first_warm_spawns() {
    let docker = Arc::new(MemoryBackend::new(ScalerType::Container));
    let local = Arc::new(MemoryBackend::new(ScalerType::BareMetal));
    let backends: Vec<Arc<dyn Backend>> = vec![docker, local.clone()];
    let warm = r#"
version: 1
scalers:
  - name: warm
    type: bare-metal
    maxAgents: 2
    warmPool: { enabled: true, size: 1 }
    labelSets:
      - labels: [warm]
        binaryPath: /bin/agent
"#;
    let rt = Runtime::start(engine(warm), backends, Arc::new(DefaultBootstrap));
    let mut rx = rt.subscribe();
    settle().await;
    let first = rx
        .try_recv()
        .expect("the first tick's events are delivered");
    assert_eq!(first.id, 1);
    assert_eq!(local.live().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn config_ack_reaches_the_agents_backend_and_its_failure_is_reported() {
    let s = setup(BASIC);
    let a = spawned(&s.rt.request_scale(request("j1", &["docker"])).unwrap());
    settle().await;
    s.rt.agent_registered(a).unwrap();
    s.docker.fail_next_configured(1);
    assert!(s.rt.agent_configured(a).await.is_err());
    assert!(s.docker.configured().is_empty());
    s.rt.agent_configured(a).await.unwrap();
    assert_eq!(s.docker.configured(), [a]);
    assert!(
        s.local.configured().is_empty(),
        "only the agent's own backend"
    );
    let stranger = kici_model::AgentId::new(ScalerType::Container, [9, 9, 9, 9]);
    assert!(s.rt.agent_configured(stranger).await.is_err());
}

/// A coordinator that records what it is told.
#[derive(Default)]
struct Recorder {
    ended: parking_lot::Mutex<Vec<kici_engine::EndedAgent>>,
}

#[async_trait::async_trait]
impl kici_engine::runtime::Coordinator for Recorder {
    async fn may_spawn(
        &self,
        _agent: kici_model::AgentId,
        _job: Option<&kici_model::JobId>,
    ) -> Result<(), String> {
        Ok(())
    }

    async fn record_registration(&self, _agent: kici_model::AgentId) -> Result<(), String> {
        Ok(())
    }

    async fn agent_ended(&self, ended: kici_engine::EndedAgent) {
        self.ended.lock().push(ended);
    }
}

/// Every agent's end reaches the coordinator, once, with its job and how
/// it ended — also when the event stream overflows: the stream is for
/// observers and drops what a slow reader did not take (here a one-event
/// buffer that nobody reads), and a coordinator that followed it missed
/// ends, finishing them later from a sweep that no longer knew the agent
/// failed before its job could run (so the job was never served again).
#[tokio::test(start_paused = true)]
async fn every_end_reaches_the_coordinator_even_when_the_event_stream_overflows() {
    let docker = Arc::new(MemoryBackend::new(ScalerType::Container));
    let local = Arc::new(MemoryBackend::new(ScalerType::BareMetal));
    let backends: Vec<Arc<dyn Backend>> = vec![docker.clone(), local.clone()];
    let settings = kici_engine::EngineSettings {
        event_buffer: 1,
        ..Default::default()
    };
    let rt = Runtime::start(
        engine_with(BASIC, settings),
        backends,
        Arc::new(DefaultBootstrap),
    );
    let recorder = Arc::new(Recorder::default());
    assert!(rt.set_coordinator(recorder.clone()));
    let mut observer = rt.subscribe();
    // Two spawns fail (before dispatch); one agent serves its job.
    docker.fail_next_spawns(2);
    let failed: Vec<_> = ["f1", "f2"]
        .iter()
        .map(|j| spawned(&rt.request_scale_now(request(j, &["docker"])).unwrap()))
        .collect();
    let served = spawned(&rt.request_scale_now(request("ok", &["local"])).unwrap());
    settle().await;
    let reg = rt.agent_registered(served).unwrap();
    rt.job_started(served, reg.bound_job_id.unwrap()).unwrap();
    rt.job_completed(served, &job("ok"), Some(0)).unwrap();
    for _ in 0..50 {
        settle().await;
        tokio::time::advance(Duration::from_millis(100)).await;
    }
    assert!(
        matches!(
            observer.try_recv(),
            Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_))
        ),
        "the observer's stream overflowed"
    );
    let ended = recorder.ended.lock().clone();
    let mut agents: Vec<_> = ended.iter().map(|e| e.agent).collect();
    agents.sort();
    let mut expected = failed.clone();
    expected.push(served);
    expected.sort();
    assert_eq!(agents, expected, "each end told once: {ended:?}");
    for e in &ended {
        if e.agent == served {
            assert_eq!(e.job, Some(job("ok")));
            assert!(!e.before_dispatch(), "{e:?}");
        } else {
            assert!(
                e.before_dispatch(),
                "a failed spawn ends before dispatch: {e:?}"
            );
            assert!(e.job.is_some(), "{e:?}");
        }
    }
}
