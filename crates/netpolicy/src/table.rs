//! [`EgressTable`]: kici-scaler's tables on one host (or network namespace),
//! seen by one daemon instance for one agent subnet.

use crate::docker_user::{self, DockerUserOutcome};
use crate::nft::Runner;
use crate::{EgressPolicy, NetPolicyError};
use ipnet::Ipv4Net;
use kici_model::ids::{AgentId, InstanceId};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

pub(crate) const FP_ENSURE_TABLE: &str = "netpolicy::ensure::table";
pub(crate) const FP_ENSURE_DOCKER_USER: &str = "netpolicy::ensure::docker_user";
pub(crate) const FP_INSTALL_APPLIED: &str = "netpolicy::install::applied";
pub(crate) const FP_REMOVE_DELETED: &str = "netpolicy::remove::deleted";

/// Whether [`EgressTable::ensure`] adds accepts for the subnet to dockerd's
/// `DOCKER-USER` chain (see [`crate::docker_user`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DockerUserMode {
    /// Leave `DOCKER-USER` alone (the container backend: dockerd already
    /// accepts its own network's egress, and its `enable_icc=false` drop is one
    /// more wall between agents).
    #[default]
    Leave,
    /// Accept the subnet's traffic and its replies where dockerd's FORWARD
    /// DROP would otherwise apply (a Firecracker bridge on a host running
    /// dockerd). A no-op ([`DockerUserOutcome::NoChain`]) without dockerd.
    AcceptSubnet,
}

/// Table-wide settings of one instance's subnet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableOptions {
    /// The agent gateway's TCP port on the host: the one thing on the host an
    /// agent may reach (also under `denyAll`).
    pub gateway_port: Option<u16>,
    /// DNS resolvers agents use. One at a private address gets a udp/tcp 53
    /// exception; one on the host itself is reachable through the input hook.
    pub resolvers: Vec<IpAddr>,
    /// Filter traffic from agents to the host's own addresses (input hook).
    /// Off only for hosts whose services must all be reachable from agents.
    pub protect_host: bool,
    pub docker_user: DockerUserMode,
    /// Run `nft`/`iptables` inside this named network namespace
    /// (`ip netns exec <name> …`); `None` is the daemon's own namespace.
    pub netns: Option<String>,
    /// Bound on every `nft`/`iptables` command.
    pub command_timeout: Duration,
}

impl Default for TableOptions {
    fn default() -> Self {
        Self {
            gateway_port: None,
            resolvers: Vec::new(),
            protect_host: true,
            docker_user: DockerUserMode::Leave,
            netns: None,
            command_timeout: Duration::from_secs(10),
        }
    }
}

/// How an agent's packets are recognised. The pair `ip` + `mac` keys every
/// dispatch rule, so a packet with the agent's MAC but another source
/// address, or the agent's address from another MAC, drops. `port` (a
/// Firecracker TAP) additionally binds both to that bridge port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentMatch {
    pub ip: Ipv4Addr,
    /// The agent's MAC (`kici_store::ipam::MacAddress::for_ip(ip).0`).
    pub mac: [u8; 6],
    /// The host-side interface the agent's frames arrive on, when it is known
    /// before the agent starts (a TAP; a container's veth is not).
    pub port: Option<String>,
}

/// Chains and handles one [`EgressTable::install`] created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledRules {
    pub agent: AgentId,
    /// `(family, chain)` of every per-agent chain.
    pub chains: Vec<(String, String)>,
    /// Rules added, in all chains (dispatch rules included).
    pub rules: usize,
}

/// An agent of this instance that has rules in the tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedRules {
    pub agent: AgentId,
    /// Source addresses its dispatch rules match.
    pub addresses: Vec<Ipv4Addr>,
    /// Tagged rules (per-agent chains and dispatch).
    pub rules: usize,
}

/// Packets and bytes that went through kici-scaler's own rules of one agent
/// (or of the subnet's default drop), summed over both tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RuleCounters {
    pub dropped_packets: u64,
    pub dropped_bytes: u64,
    pub accepted_packets: u64,
    pub accepted_bytes: u64,
}

/// The per-agent chain name: `ag-<instance>-<agent id>` (the input-hook chain
/// adds `-in`). Unique across instances sharing the tables.
pub fn agent_chain_name(instance: InstanceId, agent: &AgentId) -> String {
    format!("ag-{instance}-{agent}")
}

/// kici-scaler's tables as one instance uses them for one agent subnet.
#[derive(Debug, Clone)]
pub struct EgressTable {
    instance: InstanceId,
    subnet: Ipv4Net,
    options: TableOptions,
    runner: Runner,
    docker_user: DockerUserOutcome,
}

impl EgressTable {
    /// Creates (idempotently) both tables, their base chains and dispatch
    /// chains, and the subnet's default drop; then handles `DOCKER-USER` as
    /// [`TableOptions::docker_user`] says.
    pub async fn ensure(
        instance: InstanceId,
        subnet: Ipv4Net,
        options: TableOptions,
    ) -> Result<Self, NetPolicyError> {
        let runner = Runner {
            netns: options.netns.clone(),
            timeout: options.command_timeout,
        };
        let _ = (&runner, instance, subnet, docker_user::docker_user_comment);
        Err(NetPolicyError::Injected(FP_ENSURE_TABLE))
    }

    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    pub fn subnet(&self) -> Ipv4Net {
        self.subnet
    }

    pub fn options(&self) -> &TableOptions {
        &self.options
    }

    /// What `ensure` did about `DOCKER-USER`.
    pub fn docker_user(&self) -> DockerUserOutcome {
        self.docker_user
    }

    /// Installs (or replaces) one agent's rules in one nft transaction. Call
    /// before the agent starts: until then its traffic hits the default drop.
    pub async fn install(
        &self,
        agent: &AgentId,
        key: &AgentMatch,
        policy: &EgressPolicy,
    ) -> Result<InstalledRules, NetPolicyError> {
        let _ = (agent, key, policy, &self.runner);
        Err(NetPolicyError::Injected(FP_INSTALL_APPLIED))
    }

    /// Removes every rule tagged with this instance and `agent` (by handle)
    /// and the agent's chains, in one transaction. Idempotent: returns 0 when
    /// nothing was left.
    pub async fn remove(&self, agent: &AgentId) -> Result<usize, NetPolicyError> {
        let _ = agent;
        Err(NetPolicyError::Injected(FP_REMOVE_DELETED))
    }

    /// Agents of THIS instance with rules in the tables (any subnet).
    pub async fn owned(&self) -> Result<Vec<OwnedRules>, NetPolicyError> {
        Err(NetPolicyError::Injected(FP_REMOVE_DELETED))
    }

    /// Removes the rules of this instance's agents in this subnet that are
    /// not in `live`, so a reused address never inherits an old allowlist.
    /// Never touches another instance's rules. Returns the agents swept.
    pub async fn sweep_stale(&self, live: &[AgentId]) -> Result<Vec<AgentId>, NetPolicyError> {
        let _ = live;
        Err(NetPolicyError::Injected(FP_REMOVE_DELETED))
    }

    /// Counters of `agent`'s rules (this instance's).
    pub async fn counters(&self, agent: &AgentId) -> Result<RuleCounters, NetPolicyError> {
        let _ = agent;
        Err(NetPolicyError::Injected(FP_REMOVE_DELETED))
    }

    /// Counters of this instance's default drop for the subnet (sources
    /// matching no installed agent).
    pub async fn unmatched_counters(&self) -> Result<RuleCounters, NetPolicyError> {
        Err(NetPolicyError::Injected(FP_REMOVE_DELETED))
    }

    /// Removes this instance's subnet-level rules (default drops, and its
    /// `DOCKER-USER` accepts). Agent rules are left to [`Self::remove`] and
    /// [`Self::sweep_stale`]; after this the subnet no longer fails closed.
    pub async fn teardown(&self) -> Result<usize, NetPolicyError> {
        let _ = docker_user::remove_accepts;
        Err(NetPolicyError::Injected(FP_REMOVE_DELETED))
    }
}
