//! kici-scaler's bare-metal backend, and the agent environment every
//! backend builds.
//!
//! This crate owns agents as host processes: [`BareMetalBackend`] implements
//! [`kici_engine::Backend`] (validate, spawn, destroy, list what it owns,
//! adopt after a restart) with one session, one tracking cgroup and one log
//! directory per agent. It also owns the agent's bootstrap environment — the
//! `KICI_*` contract and its precedence ([`agent_env`]) — and the log
//! forwarding, which the container and Firecracker backends (`kici-container`,
//! `kici-firecracker`) reuse.
//!
//! - [`bare_metal`]: agents as host processes (own session, tracking cgroup,
//!   limits, log files, pidfd exit watch) — [`BareMetalBackend`].
//! - [`env`](mod@env): the agent environment, one precedence for every backend.
//! - [`cgroup`]: tracking cgroups (v2) and limits (v2 or v1), and where they
//!   go on this host ([`cgroup::discover`]).
//! - [`logs`]: log files followed and forwarded as wrapped `tracing` events,
//!   with bounded retention.
//! - [`process`]: pid + start time identity (see docs/deviations.md,
//!   D-pid-identity).
//! - [`launch`]: fork/exec straight into the tracking cgroup (`clone3`).
//! - [`failpoints`]: the named failpoints of every step ([`FAILPOINTS`]).
//!
//! What an agent is started with, computed without starting it:
//!
//! ```
//! use kici_backends::{agent_env, ForwardedEnv, SystemEnv};
//! use kici_engine::testing::{scaler_from_yaml, spawn_spec};
//! use kici_model::{ScalerType, Secret};
//!
//! let scaler = scaler_from_yaml(r#"
//! version: 1
//! scalers:
//!   - name: metal
//!     type: bare-metal
//!     maxAgents: 1
//!     labelSets:
//!       - labels: [linux]
//!         binaryPath: /usr/local/bin/kici-agent
//!         env: { RUST_LOG: info }
//! "#, "metal");
//! let (mut spec, _reports) = spawn_spec(&scaler, 0);
//! spec.token = Some(Secret::new("kat_0123"));
//!
//! // The daemon's own environment: only the allowlist and the
//! // KICI_AGENT_ENV_* variables (prefix stripped) reach an agent.
//! let daemon = [
//!     ("PATH", "/usr/bin:/bin"),
//!     ("DATABASE_URL", "postgres://secret"),
//!     ("KICI_AGENT_ENV_HTTP_PROXY", "http://proxy:3128"),
//! ];
//! let system = SystemEnv::from_vars(daemon);
//! let forwarded = ForwardedEnv::from_vars(daemon).unwrap();
//! let env = agent_env(&spec, ScalerType::BareMetal, &system, &forwarded);
//! let get = |name: &str| env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
//!
//! assert_eq!(get("KICI_AGENT_ID"), Some(spec.agent.to_string().as_str()));
//! assert_eq!(get("KICI_AGENT_TOKEN"), Some("kat_0123"));
//! assert_eq!(get("KICI_EXECUTION_MODE"), Some("bare-metal"));
//! assert_eq!(get("HTTP_PROXY"), Some("http://proxy:3128"));
//! assert_eq!(get("RUST_LOG"), Some("info"));
//! assert_eq!(get("PATH"), Some("/usr/bin:/bin"));
//! assert_eq!(get("DATABASE_URL"), None);
//! ```
//!
//! Starting agents needs a cgroup v2 directory the process may write (root,
//! or a delegated systemd unit); the backend finds it itself. The workspace's
//! `examples/embed` program runs a whole job this way; in short:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use kici_backends::{BareMetalBackend, BareMetalOptions};
//! use kici_engine::Backend;
//! use kici_engine::testing::{scaler_from_yaml, spawn_spec};
//! use std::time::Duration;
//!
//! let options = BareMetalOptions::new(
//!     "0a1b2c3d".parse()?,               // this instance's id
//!     "/var/lib/my-program".into(),      // agents' directories go below
//!     std::env::vars().collect(),        // allowlisted and forwarded parts only
//! );
//! let backend = BareMetalBackend::new(options)?;
//! let scaler = scaler_from_yaml("version: 1\nscalers:\n  - name: metal\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [linux]\n        binaryPath: /bin/true\n", "metal");
//! backend.validate(&scaler).await.map_err(|problems| problems.join("; "))?;
//! let (spec, mut reports) = spawn_spec(&scaler, 0);
//! let agent = spec.agent;
//! let handle = backend.spawn(spec).await?;      // running in its own cgroup
//! println!("{:?}", reports.recv().await);       // Exited { detail: "exit status 0", .. }
//! backend.destroy(&agent, Some(&handle), Duration::from_secs(5)).await?;
//! # Ok(()) }
//! ```

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
