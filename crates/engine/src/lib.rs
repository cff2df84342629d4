//! The lifecycle engine of kici-scaler.
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
    Adoption, Backend, BackendError, BackendReport, OwnedResource, ResourceHandle, SpawnSpec,
};
pub use breaker::{Breaker, BreakerState};
pub use engine::{
    AgentError, AgentView, DestroyOrder, DurableAgent, Effect, Engine, EngineEvent, EngineSettings,
    JournalEntry, RecoverError, Recovered, Registration, ReloadReport, ScaleError, ScaleOutcome,
    SpawnOrder, Status,
};
pub use journal::{Journal, JournalError};
pub use lifecycle::{transition, AgentEvent, AgentState, FailureReason, Mode, StopCause};
pub use pending::{PendingEnd, ScaleRequest};
