//! kici-scaler's backends.
//!
//! - [`bare_metal`]: agents as host processes (own session, tracking cgroup,
//!   limits, log files, pidfd exit watch) — [`BareMetalBackend`].
//! - [`env`]: the agent environment, one precedence for every backend.
//! - [`cgroup`]: tracking cgroups (v2) and limits (v2 or v1).
//! - [`logs`]: log files followed and forwarded as wrapped `tracing` events,
//!   with bounded retention.
//! - [`process`]: pid + start time identity.
//! - [`launch`]: fork/exec straight into the tracking cgroup (`clone3`).
//! - [`failpoints`]: the named failpoints of every step ([`FAILPOINTS`]).
//!
//! The container and Firecracker backends will live here too and reuse
//! [`env`] and [`logs`].

pub mod bare_metal;
pub mod cgroup;
pub mod env;
pub mod failpoints;
pub mod launch;
pub mod logs;
mod notify;
pub mod process;

#[cfg(test)]
mod test_support;

pub use bare_metal::{BareMetalBackend, BareMetalOptions, BareMetalSetupError, SpawnMethod};
pub use env::{agent_env, ForwardedEnv, ForwardedEnvError, ForwardedEnvProblem, SystemEnv};
pub use failpoints::FAILPOINTS;
