//! The lifecycle engine of kici-scaler: what happens to a scale request and
//! to an agent, from admission to release.
//!
//! This crate owns the agent state machine, the pending queue, warm pools,
//! spawn backoff, every deadline, cordon/drain and reload. It asks
//! `kici-routing` where a request goes and `kici-admission` whether it fits;
//! it reaches the host only through two ports it defines: [`Backend`]
//! (containers, processes, microVMs: `kici-bare-metal`, `kici-container`, `kici-firecracker`
//! implement it) and [`Journal`] (durable state: the daemon backs it with
//! `kici-store`). An embedding program builds an [`Engine`], hands it to a
//! [`runtime::Runtime`] with its backends, and calls the runtime.
//!
//! - [`lifecycle`]: the agent state machine (one enum, one `transition`).
//! - [`breaker`]: per-label-set spawn backoff and circuit breaker.
//! - [`pending`]: scale requests waiting for capacity.
//! - [`engine`]: the synchronous engine tying routing, admission, agents,
//!   warm pools, deadlines and reload together; it emits effects and events.
//! - [`journal`]: the port to the state store and its ordered writer.
//! - [`backend`]: the `Backend` trait backends implement.
//! - [`runtime`]: the async driver that runs effects against backends and
//!   fires timers.
//! - [`memory_backend`]: an in-memory backend with failure injection, for
//!   tests of everything above the backends; [`testing`]: spawn specs for
//!   backend tests.
//!
//! One standalone job's agent, on the in-memory backend (the workspace's
//! `examples/embed` program does the same with real processes). The calls
//! after `Booted` are the ones the daemon's agent gateway makes when the
//! agent registers, takes its job and reports its end:
//!
//! ```
//! use kici_admission::Admission;
//! use kici_engine::memory_backend::MemoryBackend;
//! use kici_engine::runtime::{DefaultBootstrap, Runtime};
//! use kici_engine::{AgentState, Engine, EngineEvent, EngineSettings, Mode, ScaleOutcome, ScaleRequest};
//! use kici_model::{AgentId, JobId, LabelSet, ScalerType};
//! use kici_routing::HostPlatform;
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! let yaml = r#"
//! version: 1
//! scalers:
//!   - name: metal
//!     type: bare-metal
//!     maxAgents: 1
//!     labelSets:
//!       - labels: [linux]
//!         binaryPath: /usr/local/bin/kici-agent
//! "#;
//! let config = Arc::new(kici_config::load_documents(&[("scalers.yaml", yaml)]).unwrap().config);
//! let tokio = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
//! tokio.block_on(async {
//!     let backend = Arc::new(MemoryBackend::new(ScalerType::BareMetal));
//!     let admission = Admission::new(&config, None).unwrap();
//!     let engine = Engine::new(config.clone(), admission, HostPlatform::current(), EngineSettings::default());
//!     let runtime = Runtime::start(engine, vec![backend.clone()], Arc::new(DefaultBootstrap));
//!     let mut events = runtime.subscribe();
//!     // Waits for `agent` to reach `state`, returning the states it passed.
//!     let mut seen = Vec::new();
//!     let mut reach = async |agent: AgentId, state: AgentState| {
//!         while seen.last() != Some(&state) {
//!             let event = events.recv().await.unwrap();
//!             if let EngineEvent::AgentTransition { agent_id, to, .. } = &event.event {
//!                 if *agent_id == agent {
//!                     seen.push(*to);
//!                 }
//!             }
//!         }
//!     };
//!
//!     let job: JobId = "job-1".parse().unwrap();
//!     let request = ScaleRequest {
//!         job: job.clone(),
//!         run_id: None,
//!         labels: LabelSet::parse(["linux"]).unwrap(),
//!         exclude: LabelSet::default(),
//!         resources: None,
//!         mode: Mode::Standalone,
//!     };
//!     let Ok(ScaleOutcome::Spawning { agent_id, .. }) = runtime.request_scale(request) else {
//!         panic!("no agent");
//!     };
//!     reach(agent_id, AgentState::Booted).await; // the backend created it
//!     let registration = runtime.agent_registered(agent_id).unwrap();
//!     assert_eq!(registration.bound_job_id, Some(job.clone()));
//!     runtime.job_started(agent_id, job.clone()).unwrap();
//!     runtime.job_completed(agent_id, &job, Some(0)).unwrap();
//!     reach(agent_id, AgentState::Gone).await; // destroyed, capacity released
//!     drop(reach);
//!     assert_eq!(seen, [
//!         AgentState::Provisioning,
//!         AgentState::Booted,
//!         AgentState::Registered,
//!         AgentState::Busy,
//!         AgentState::Destroying,
//!         AgentState::Gone,
//!     ]);
//!     assert!(backend.live().is_empty());
//!     assert!(runtime.shutdown(Duration::from_secs(5)).await);
//! });
//! ```

pub mod backend;
pub mod breaker;
pub mod engine;
pub mod failpoints;
pub mod journal;
pub mod lifecycle;
pub mod memory_backend;
pub mod pending;
pub mod runtime;
pub mod testing;

pub use backend::{
    Adoption, Backend, BackendError, BackendErrorKind, BackendReport, DestroyReason, OwnedResource,
    ProblemKind, ResourceHandle, ScalerProblem, ScalerProblems, SpawnSpec,
};
pub use breaker::{Breaker, BreakerState};
pub use engine::{
    AdmissionHold, AgentError, AgentView, DestroyOrder, DurableAgent, DurablePending, Effect,
    EndedAgent, Engine, EngineEvent, EngineSettings, HoldLapsed, HoldRefused, JobEffect, JobLost,
    JournalEntry, JournalKey, PendingRecovered, ProvisionNotice, RecoverError, Recovered,
    Registration, ReloadReport, ScaleError, ScaleOutcome, SpawnOrder, Status, TransitionCause,
    WarmSource,
};
pub use journal::{Journal, JournalError, JournalErrorKind};
pub use lifecycle::{transition, AgentEvent, AgentState, FailureReason, Mode, StopCause};
pub use pending::{PendingEnd, ScaleRequest};
