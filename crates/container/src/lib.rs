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
//! - [`reference`]: image references, validated as the Engine parses them;
//! - [`auth`]: registry credentials from `config.json` (`X-Registry-Auth`);
//! - [`egress`]: the hook that installs egress rules before start;
//! - [`logs`]: the Engine log stream forwarded like bare-metal output;
//! - [`states`]: inspect and list answers with Podman's own container
//!   states (`stopped`) read as their Docker equivalents.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod auth;
pub mod backend;
pub mod create;
pub mod egress;
pub mod logs;
pub mod network;
pub mod reference;
pub mod runtime;
pub mod states;

#[cfg(test)]
mod test_support;

pub use backend::{agent_mac, ContainerBackend, ContainerOptions, ContainerSetupError, HostCheck};
pub use create::{container_name, Ulimit, LABEL_AGENT, LABEL_INSTANCE, LABEL_JOB, LABEL_SCALER};
pub use egress::{EgressError, EgressRules, EgressTarget, NftEgress, NoEgressRules};
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
