//! kici-scaler's bare-metal backend: agents as host processes.
//!
//! [`BareMetalBackend`] implements [`kici_engine::Backend`] (validate,
//! spawn, destroy, list what it owns, adopt after a restart) with one
//! session, one tracking cgroup and one log directory per agent. What it
//! shares with the other backends — the agent environment, log forwarding,
//! process identity — lives in `kici-host`.
//!
//! - [`bare_metal`]: agents as host processes (own session, tracking cgroup,
//!   limits, log files, pidfd exit watch) — [`BareMetalBackend`].
//! - [`cgroup`]: tracking cgroups (v2) and limits (v2 or v1), and where they
//!   go on this host ([`cgroup::discover`]).
//! - [`launch`]: fork/exec straight into the tracking cgroup (`clone3`).
//! - [`failpoints`]: the named failpoints of every step ([`FAILPOINTS`]).
//!
//! Starting agents needs a cgroup v2 directory the process may write (root,
//! or a delegated systemd unit); the backend finds it itself. The workspace's
//! `examples/embed` program runs a whole job this way; in short:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use kici_bare_metal::{BareMetalBackend, BareMetalOptions};
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
//! backend.validate(&scaler).await?;                // every problem, typed
//! let (spec, mut reports) = spawn_spec(&scaler, 0);
//! let agent = spec.agent;
//! let handle = backend.spawn(spec).await?;      // running in its own cgroup
//! println!("{:?}", reports.recv().await);       // Exited { detail: "exit status 0", .. }
//! backend.destroy(&agent, Some(&handle), Duration::from_secs(5)).await?;
//! # Ok(()) }
//! ```

pub mod bare_metal;
pub mod cgroup;
pub mod failpoints;
pub mod launch;

pub use bare_metal::user::{Credentials, UserError};
pub use bare_metal::{
    AdoptError, BareMetalBackend, BareMetalError, BareMetalOptions, BareMetalProblem,
    BareMetalSetupError, DestroyError, SpawnError, SpawnMethod,
};
pub use failpoints::FAILPOINTS;
