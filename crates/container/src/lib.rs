//! kici-scaler's container backend: agents as Docker or Podman containers,
//! driven through the Engine API with bollard (never a CLI).
//!
//! - [`backend`]: [`ContainerBackend`], the [`kici_engine::Backend`]
//!   (spawn, destroy, list_owned, adopt, validate) and
//!   [`ContainerBackend::check_host`] for `serve` start-up and `doctor`;
//! - [`runtime`]: finding and connecting to a runtime (`auto`, `docker`,
//!   `podman`, `unix://`, `tcp://` with TLS), API version negotiation;
//! - [`network`]: `kici-scaler-net`, created or checked;
//! - [`create`]: the create body (limits, hardening, labels, address);
//! - [`reference`](mod@reference): image references, validated as the Engine parses them;
//! - [`auth`]: registry credentials from `config.json` (`X-Registry-Auth`);
//! - [`logs`]: the Engine log stream forwarded like bare-metal output;
//! - [`states`]: inspect and list answers with Podman's own container
//!   states (`stopped`) read as their Docker equivalents.
//!
//! This crate owns agents as containers: their names and owner labels (never
//! upstream's `kici-managed`, see docs/deviations.md, D-owner-labels), the
//! agent network, pulls with registry credentials, hardening, the per-agent
//! egress rules installed before start (through `kici_netpolicy::EgressRules`;
//! docs/deviations.md, D-egress-before-start), and clean-up that leaves nothing. It
//! builds the agent's environment with `kici-host` and leases addresses
//! with `kici-store`'s IP allocator.
//!
//! ```
//! use kici_container::{container_name, ImageReference};
//! use kici_model::{AgentId, ScalerType};
//!
//! // Image references are read as the Engine reads them, before any pull.
//! let image = ImageReference::parse("registry.local:5000/kici/agent:1.2").unwrap();
//! assert_eq!(image.registry(), "registry.local:5000"); // whose credentials
//! assert_eq!(image.repository(), "registry.local:5000/kici/agent");
//! assert_eq!(image.pull_tag(), "1.2");
//! assert!(ImageReference::parse("Kici/Agent").is_err()); // upper case
//!
//! // Every container is named after its agent.
//! let agent: AgentId = "scaler-container-0a1b2c3d".parse().unwrap();
//! assert_eq!(container_name(&agent), "kici-scaler-container-0a1b2c3d");
//! ```
//!
//! Starting agents needs a Docker Engine or a Podman API socket:
//! [`ContainerBackend::check_host`] says what is missing.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod auth;
pub mod backend;
pub mod create;
pub mod logs;
pub mod network;
pub mod reference;
pub mod runtime;
pub mod states;

#[cfg(test)]
mod test_support;

pub use backend::{
    agent_mac, ContainerBackend, ContainerError, ContainerOptions, ContainerProblem,
    ContainerSetupError, HostCheck, StepError,
};
pub use create::{container_name, Ulimit, LABEL_AGENT, LABEL_INSTANCE, LABEL_JOB, LABEL_SCALER};
pub use network::NetworkSettings;
pub use reference::ImageReference;
pub use runtime::{Endpoint, RuntimeKind, TlsFiles};

/// Every failpoint of this crate, each placed right after its step's side
/// effect (so a crash there leaves exactly that side effect behind).
pub const FAILPOINTS: &[&str] = &[
    "kici_container::spawn::lease",
    "kici_container::spawn::pull",
    "kici_container::spawn::create",
    "kici_container::spawn::rules",
    "kici_container::spawn::start",
    "kici_container::destroy::stop",
    "kici_container::destroy::remove",
    "kici_container::destroy::rules",
    "kici_container::destroy::lease",
];
