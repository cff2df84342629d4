//! Per-agent egress policy in kici-scaler's own nftables tables.
//!
//! This crate owns everything kici-scaler puts into netfilter for agents
//! (containers on `kici-scaler-net`, Firecracker microVMs on their bridge):
//!
//! * two tables named [`TABLE_NAME`]: `inet kici_scaler` (hooks `forward` and
//!   `input`: routed egress and traffic to the host's own addresses) and
//!   `bridge kici_scaler` (hooks `prerouting` and `forward`: the TAP/port
//!   binding and agent-to-agent frames that never reach the `inet` hooks when
//!   `bridge-nf-call-iptables` is 0);
//! * per agent, regular chains named after the instance and agent id
//!   ([`agent_chain_name`]) and dispatch rules keyed by
//!   `ip saddr . ether saddr` (and, for a TAP, its bridge port), every rule
//!   commented `kici-scaler:<instance>:<agent id>` and removed by handle;
//! * per subnet, a default drop: traffic from the agent subnet that matches no
//!   installed agent is dropped, so a gap fails closed;
//! * optionally, `iptables` accepts in dockerd's `DOCKER-USER` chain
//!   ([`docker_user`]).
//!
//! Netfilter facts this layout relies on: an `accept` ends evaluation only for
//! its own base chain, a `drop` in any table is final. So our accepts never
//! weaken anyone else's drops, and our drops hold whatever other tables say.
//!
//! Everything is applied through the `nftables` crate's JSON schema piped to
//! `nft -j -f -` (one atomic transaction per operation), never through rule
//! text.

pub mod docker_user;
mod error;
mod layout;
mod nft;
mod nftjson;
mod policy;
mod table;

pub use docker_user::DockerUserOutcome;
pub use error::NetPolicyError;
pub use layout::{agent_chain_name, agent_comment};
pub use policy::{default_blocked_v4, EgressPolicy};
pub use table::{
    AgentMatch, DockerUserMode, EgressTable, InstalledRules, OwnedRules, RuleCounters, TableOptions,
};

/// The name of both of kici-scaler's tables (`inet` and `bridge` family).
/// Shared by every instance on a host; rules carry their instance in comments.
pub const TABLE_NAME: &str = "kici_scaler";

/// Failpoint names (see the failpoints contract in the workspace brief).
pub const FAILPOINTS: &[&str] = &[
    table::FP_ENSURE_TABLE,
    table::FP_ENSURE_DOCKER_USER,
    table::FP_INSTALL_APPLIED,
    table::FP_REMOVE_DELETED,
];
