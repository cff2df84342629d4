//! The one seam through which a backend installs and removes an agent's
//! egress rules: [`EgressRules`], for containers and microVMs alike.
//!
//! The rules themselves are this crate's ([`EgressTable`]); a backend only
//! decides *when*: after the agent's address (and, for a VM, its TAP) is
//! known and before the agent starts (no window with open egress;
//! docs/deviations.md, D-egress-before-start), removed on destroy and on
//! every failed spawn, and swept against what still runs. [`EgressTable`]
//! is the real implementation; [`NoEgressRules`] is for hosts whose
//! isolation lives elsewhere and for tests that do not look at traffic.

use crate::table::{AgentMatch, EgressTable};
use crate::{EgressPolicy, NetPolicyError};
use async_trait::async_trait;
use kici_model::{AgentId, NetworkPolicy};
use std::net::Ipv4Addr;

/// What identifies one agent's traffic on the host, and the network it is
/// on.
///
/// The agent cannot change its address or MAC (containers run without
/// `NET_ADMIN`/`NET_RAW`; a VM's TAP is bound as its port), so matching
/// them on the agent bridge cannot be escaped from inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressTarget {
    pub agent: AgentId,
    /// The address pinned for the agent (from the allocator).
    pub ip: Ipv4Addr,
    /// The agent's MAC (`kici_store::ipam::MacAddress::for_ip(ip).0`).
    pub mac: [u8; 6],
    /// The host-side interface the agent's frames arrive on, when it is
    /// known before the agent starts (a VM's TAP; a container's veth is
    /// not).
    pub port: Option<String>,
    /// The host-side bridge of the agent network.
    pub bridge: String,
    /// The network's gateway (the host as the agent sees it).
    pub gateway: Ipv4Addr,
}

impl EgressTarget {
    /// What the rules match on.
    pub fn agent_match(&self) -> AgentMatch {
        AgentMatch {
            ip: self.ip,
            mac: self.mac,
            port: self.port.clone(),
        }
    }
}

#[async_trait]
pub trait EgressRules: Send + Sync {
    /// Installs `target`'s rules for `policy` (`None` = the default policy:
    /// private and metadata ranges blocked), replacing any it had. Must be
    /// idempotent: a retried spawn installs again.
    async fn install(
        &self,
        target: &EgressTarget,
        policy: Option<&NetworkPolicy>,
    ) -> Result<(), NetPolicyError>;

    /// Removes every rule of `agent`; nothing to remove is success.
    async fn remove(&self, agent: &AgentId) -> Result<(), NetPolicyError>;

    /// Removes the rules of every agent of this instance not in `live` (a
    /// crash left them; a reused address must never inherit an old
    /// allowlist). Returns the agents whose rules were removed.
    async fn sweep_stale(&self, live: &[AgentId]) -> Result<Vec<AgentId>, NetPolicyError>;
}

#[async_trait]
impl EgressRules for EgressTable {
    async fn install(
        &self,
        target: &EgressTarget,
        policy: Option<&NetworkPolicy>,
    ) -> Result<(), NetPolicyError> {
        EgressTable::install(
            self,
            &target.agent,
            &target.agent_match(),
            &EgressPolicy::from_config(policy),
        )
        .await
        .map(drop)
    }

    async fn remove(&self, agent: &AgentId) -> Result<(), NetPolicyError> {
        EgressTable::remove(self, agent).await.map(drop)
    }

    async fn sweep_stale(&self, live: &[AgentId]) -> Result<Vec<AgentId>, NetPolicyError> {
        EgressTable::sweep_stale(self, live).await
    }
}

/// No per-agent rules at all: agents reach whatever the host's forward
/// rules let through (`networkIsolation: false`, tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoEgressRules;

#[async_trait]
impl EgressRules for NoEgressRules {
    async fn install(
        &self,
        _target: &EgressTarget,
        _policy: Option<&NetworkPolicy>,
    ) -> Result<(), NetPolicyError> {
        Ok(())
    }

    async fn remove(&self, _agent: &AgentId) -> Result<(), NetPolicyError> {
        Ok(())
    }

    async fn sweep_stale(&self, _live: &[AgentId]) -> Result<Vec<AgentId>, NetPolicyError> {
        Ok(Vec::new())
    }
}
