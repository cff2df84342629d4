//! The seam to per-VM egress rules (kici-netpolicy owns the nftables side).
//!
//! The backend installs a VM's rules after its TAP exists and before the
//! guest boots, removes them on destroy and on every failed spawn, and asks
//! the sweep to drop rules of agents no longer live. Rules are keyed on the
//! TAP (`iifname`), the leased IP and MAC (anti-spoofing).

use async_trait::async_trait;
use kici_model::{AgentId, NetworkPolicy};
use kici_store::ipam::MacAddress;
use std::collections::HashSet;
use std::net::Ipv4Addr;

/// The VM a rule set is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmMatch {
    pub ip: Ipv4Addr,
    pub mac: MacAddress,
    pub tap: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EgressError(pub String);

#[async_trait]
pub trait EgressRules: Send + Sync {
    /// Installs `agent`'s rules (replacing any it had).
    async fn install(
        &self,
        agent: &AgentId,
        vm: &VmMatch,
        policy: Option<&NetworkPolicy>,
    ) -> Result<(), EgressError>;

    /// Removes `agent`'s rules; none is not an error.
    async fn remove(&self, agent: &AgentId) -> Result<(), EgressError>;

    /// Removes the rules of every agent of this instance not in `live`;
    /// returns how many agents' rules went.
    async fn sweep_stale(&self, live: &HashSet<AgentId>) -> Result<usize, EgressError>;
}

/// The real rules: kici-netpolicy's tables for the Firecracker subnet
/// (create it with `agent_bridge` = the Firecracker bridge and
/// `DockerUserMode::AcceptSubnet`). The TAP is bound as the agent's port,
/// so neither its address nor its MAC can be forged through another port.
pub struct NetPolicyEgress(pub kici_netpolicy::EgressTable);

#[async_trait]
impl EgressRules for NetPolicyEgress {
    async fn install(
        &self,
        agent: &AgentId,
        vm: &VmMatch,
        policy: Option<&NetworkPolicy>,
    ) -> Result<(), EgressError> {
        let key = kici_netpolicy::AgentMatch {
            ip: vm.ip,
            mac: vm.mac.0,
            port: Some(vm.tap.clone()),
        };
        self.0
            .install(
                agent,
                &key,
                &kici_netpolicy::EgressPolicy::from_config(policy),
            )
            .await
            .map(drop)
            .map_err(|e| EgressError(e.to_string()))
    }

    async fn remove(&self, agent: &AgentId) -> Result<(), EgressError> {
        self.0
            .remove(agent)
            .await
            .map(drop)
            .map_err(|e| EgressError(e.to_string()))
    }

    async fn sweep_stale(&self, live: &HashSet<AgentId>) -> Result<usize, EgressError> {
        let live: Vec<AgentId> = live.iter().copied().collect();
        self.0
            .sweep_stale(&live)
            .await
            .map(|gone| gone.len())
            .map_err(|e| EgressError(e.to_string()))
    }
}

/// No per-VM rules at all: VMs reach whatever the host's forward rules let
/// through. For hosts whose isolation lives elsewhere, and for tests; the
/// backend warns when it is constructed with it.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoEgressRules;

#[async_trait]
impl EgressRules for NoEgressRules {
    async fn install(
        &self,
        _: &AgentId,
        _: &VmMatch,
        _: Option<&NetworkPolicy>,
    ) -> Result<(), EgressError> {
        Ok(())
    }

    async fn remove(&self, _: &AgentId) -> Result<(), EgressError> {
        Ok(())
    }

    async fn sweep_stale(&self, _: &HashSet<AgentId>) -> Result<usize, EgressError> {
        Ok(0)
    }
}
