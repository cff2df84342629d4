//! Per-agent egress policy in kici-scaler's own nftables tables.
//!
//! This crate owns everything kici-scaler puts into netfilter for agents
//! (containers on `kici-scaler-net`, Firecracker microVMs on their bridge):
//!
//! * two tables named [`TABLE_NAME`]: `inet kici_scaler` (hooks `forward` and
//!   `input`: routed egress and traffic to the host's own addresses) and
//!   `bridge kici_scaler` (hooks `prerouting`: ARP and TAP/port binding, and
//!   `forward`: agent-to-agent frames, which never reach the `inet` hooks
//!   when `bridge-nf-call-iptables` is 0);
//! * per agent, regular chains named after the instance and agent id
//!   ([`agent_chain_name`]) and dispatch rules keyed by
//!   `ip saddr . ether saddr` (and, for a TAP, its bridge port), every rule
//!   commented `kici-scaler:<instance>:<agent id>` and removed by handle;
//! * per subnet, a default drop: traffic from the agent subnet that matches no
//!   installed agent is dropped, so a gap fails closed (with
//!   [`TableOptions::agent_bridge`], anything routed from the agents' bridge
//!   that matches no agent, whatever its source address);
//! * optionally, `iptables` accepts in dockerd's `DOCKER-USER` chain
//!   ([`docker_user`]);
//! * per agent bridge, the host's forwarding: `ip_forward`, NAT and forward
//!   accepts in base chains of their own ([`host`]).
//!
//! Netfilter facts this layout relies on: an `accept` ends evaluation only for
//! its own base chain, a `drop` in any table is final. So our accepts never
//! weaken anyone else's drops, and our drops hold whatever other tables say.
//!
//! Everything is applied through the `nftables` crate's JSON schema piped to
//! `nft -j -f -` (one atomic transaction per operation), never through rule
//! text.
//!
//! # What an agent may reach
//!
//! * Routed egress (inet `forward`) and bridged frames (bridge `forward`):
//!   [`default_blocked_v4`] dropped unless an allowlist entry at least as
//!   specific covers the destination; DNS (udp/tcp 53) to a private resolver
//!   allowed; everything else accepted. `denyAll`: everything dropped.
//! * The host itself (inet `input`): only the agent gateway's TCP port (on
//!   any host address), DNS to a resolver, and replies to flows the host
//!   opened. The allowlist never opens the host.
//! * IPv6: none (every IPv6 packet from an agent's MAC drops).
//!
//! # How a backend uses it
//!
//! Backends hold an `Arc<dyn` [`EgressRules`]`>` (an [`EgressTable`], or
//! [`NoEgressRules`]) and call it with an [`EgressTarget`]; underneath, per
//! agent:
//!
//! ```no_run
//! # async fn spawn() -> Result<(), kici_netpolicy::NetPolicyError> {
//! use kici_model::ids::{AgentId, InstanceId, ScalerType};
//! use kici_netpolicy::{AgentMatch, EgressPolicy, EgressTable, TableOptions};
//!
//! let instance: InstanceId = "0a1b2c3d".parse().expect("instance id");
//! // Once at start-up, per agent subnet:
//! let table = EgressTable::ensure(
//!     instance,
//!     "172.29.0.0/16".parse().expect("subnet"),
//!     TableOptions { gateway_port: Some(8700), ..TableOptions::default() },
//! )
//! .await?;
//! // Then at start-up, after recovering the live agents from the store:
//! let live: Vec<AgentId> = Vec::new();
//! table.sweep_stale(&live).await?;
//!
//! // Per spawn, BEFORE the agent starts (until then its traffic is dropped):
//! let agent = AgentId::random(ScalerType::Container);
//! let ip = "172.29.0.5".parse().expect("ip");
//! let key = AgentMatch {
//!     ip,
//!     // The MAC the container/VM is given: kici_store::ipam::MacAddress::for_ip(ip).0
//!     mac: [0x06, 0x00, 0xac, 29, 0, 5],
//!     // Firecracker: Some(tap name); containers: None (the veth is not known yet).
//!     port: None,
//! };
//! table.install(&agent, &key, &EgressPolicy::from_config(None)).await?;
//! // Per destroy (idempotent):
//! table.remove(&agent).await?;
//! # Ok(()) }
//! ```
//!
//! The agent's MAC must be the one given here: containers set it on their
//! endpoint, Firecracker as the guest MAC. Firecracker also passes its TAP as
//! [`AgentMatch::port`] (a guest has root and could change both its MAC and
//! its address) and, on a host with dockerd, [`DockerUserMode::AcceptSubnet`].

pub mod docker_user;
mod error;
pub mod host;
mod layout;
mod nft;
mod nftjson;
mod policy;
mod rules;
mod table;

pub use docker_user::{DockerUserOutcome, DockerUserState};
pub use error::NetPolicyError;
pub use host::{ForwardingStatus, HostForwarding, Uplink};
pub use layout::{agent_chain_name, agent_comment};
pub use policy::{default_blocked_v4, EgressPolicy};
pub use rules::{EgressRules, EgressTarget, NoEgressRules};
pub use table::{
    AgentMatch, DockerUserMode, EgressTable, InstalledRules, OwnedRules, RuleCounters, TableOptions,
};

/// The name of both of kici-scaler's tables (`inet` and `bridge` family).
/// Shared by every instance on a host; rules carry their instance in comments.
pub const TABLE_NAME: &str = "kici_scaler";

/// Failpoint names (docs/ARCHITECTURE.md, failpoints), each right after its step's side effect.
pub const FAILPOINTS: &[&str] = &[
    table::FP_ENSURE_TABLE,
    table::FP_ENSURE_DOCKER_USER,
    table::FP_INSTALL_APPLIED,
    table::FP_REMOVE_DELETED,
    table::FP_SWEEP_DELETED,
];
