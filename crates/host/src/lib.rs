//! What every kici-scaler backend shares on the host.
//!
//! The bare-metal, container and Firecracker backends (`kici-bare-metal`,
//! `kici-container`, `kici-firecracker`) each own their kind of resource;
//! this crate owns what they all need around an agent, once:
//!
//! - [`env`](mod@env): the agent's bootstrap environment — the `KICI_*`
//!   contract and its precedence, one for every backend ([`agent_env`]).
//! - [`logs`]: agent output followed from files and forwarded as wrapped
//!   `tracing` events (target [`logs::TARGET`]), with bounded retention.
//! - [`process`]: pid + start time identity (see docs/deviations.md,
//!   D-pid-identity).
//! - [`notify`]: waiting for a file (or a pidfd) to change without polling.
//!
//! What an agent is started with, computed without starting it:
//!
//! ```
//! use kici_host::{agent_env, ForwardedEnv, SystemEnv};
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

pub mod env;
pub mod logs;
pub mod notify;
pub mod process;

pub use env::{agent_env, ForwardedEnv, ForwardedEnvError, ForwardedEnvProblem, SystemEnv};
