//! The hook through which per-agent egress rules are installed before the
//! agent starts and removed when it goes.
//!
//! The rules themselves belong to `kici-netpolicy` (kici-scaler's own
//! nftables table); this backend only decides *when*: after the container
//! is created with its pinned address (so the match is known) and before it
//! starts (no window with open egress, as upstream had; docs/deviations.md,
//! D-egress-before-start), removed on destroy and
//! on every failed spawn. [`NftEgress`] is the real one (kici-scaler's own
//! nftables tables through `kici_netpolicy::EgressTable`); [`NoEgressRules`]
//! is for tests that do not look at traffic.

use async_trait::async_trait;
use kici_model::{AgentId, NetworkPolicy};
use kici_store::MacAddress;
use std::net::Ipv4Addr;

/// What identifies one agent's traffic on the host.
///
/// The MAC is `02:42:` + the address's octets on every runtime: Docker
/// before API 1.44 derives exactly that from the address (and ignores any
/// MAC it is given, verified on 20.10), newer Docker and Podman are given it
/// on the endpoint.
///
/// The container runs with every capability dropped (no `NET_ADMIN`,
/// no `NET_RAW`), so it can change neither its address nor its MAC and
/// cannot forge packets: matching the pinned address on the network's
/// bridge cannot be escaped from inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressTarget {
    pub agent: AgentId,
    /// The address pinned at create time (from the allocator).
    pub ip: Ipv4Addr,
    pub mac: MacAddress,
    /// The host-side bridge interface of the agent network.
    pub bridge: String,
    /// The network's gateway (the host as the agent sees it).
    pub gateway: Ipv4Addr,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("egress rules: {0}")]
pub struct EgressError(pub String);

#[async_trait]
pub trait EgressRules: Send + Sync {
    /// Installs `target`'s rules for `policy` (`None` = the default policy:
    /// private and metadata ranges blocked). Must be idempotent: a retried
    /// spawn installs again.
    async fn install(
        &self,
        target: &EgressTarget,
        policy: Option<&NetworkPolicy>,
    ) -> Result<(), EgressError>;

    /// Removes every rule of `agent`; nothing to remove is success.
    async fn remove(&self, agent: &AgentId) -> Result<(), EgressError>;

    /// Removes the rules of every agent not in `live` (a crash left them;
    /// a reused address must never inherit an old allowlist). Returns the
    /// agents whose rules were removed.
    async fn sweep_stale(&self, live: &[AgentId]) -> Result<Vec<AgentId>, EgressError>;
}

/// No rules at all (`networkIsolation: false`, tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoEgressRules;

#[async_trait]
impl EgressRules for NoEgressRules {
    async fn install(
        &self,
        _target: &EgressTarget,
        _policy: Option<&NetworkPolicy>,
    ) -> Result<(), EgressError> {
        Ok(())
    }

    async fn remove(&self, _agent: &AgentId) -> Result<(), EgressError> {
        Ok(())
    }

    async fn sweep_stale(&self, _live: &[AgentId]) -> Result<Vec<AgentId>, EgressError> {
        Ok(Vec::new())
    }
}

/// Egress rules in kici-scaler's own nftables tables (`kici-netpolicy`),
/// for the agent network's subnet. Build the table once at start-up with
/// `EgressTable::ensure(instance, subnet, TableOptions { gateway_port,
/// agent_bridge: Some(<network bridge>), .. })`.
#[derive(Debug, Clone)]
pub struct NftEgress {
    table: kici_netpolicy::EgressTable,
}

impl NftEgress {
    pub fn new(table: kici_netpolicy::EgressTable) -> Self {
        Self { table }
    }

    pub fn table(&self) -> &kici_netpolicy::EgressTable {
        &self.table
    }
}

#[async_trait]
impl EgressRules for NftEgress {
    async fn install(
        &self,
        target: &EgressTarget,
        policy: Option<&NetworkPolicy>,
    ) -> Result<(), EgressError> {
        let key = kici_netpolicy::AgentMatch {
            ip: target.ip,
            mac: target.mac.0,
            // A container's veth is created at start: not known yet.
            port: None,
        };
        self.table
            .install(
                &target.agent,
                &key,
                &kici_netpolicy::EgressPolicy::from_config(policy),
            )
            .await
            .map(|_| ())
            .map_err(|e| EgressError(e.to_string()))
    }

    async fn remove(&self, agent: &AgentId) -> Result<(), EgressError> {
        self.table
            .remove(agent)
            .await
            .map(|_| ())
            .map_err(|e| EgressError(e.to_string()))
    }

    async fn sweep_stale(&self, live: &[AgentId]) -> Result<Vec<AgentId>, EgressError> {
        self.table
            .sweep_stale(live)
            .await
            .map_err(|e| EgressError(e.to_string()))
    }
}
