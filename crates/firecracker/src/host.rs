//! The host side of the Firecracker network, from the config's
//! `firecracker` block alone: [`HostNetwork`] is the bridge VMs attach to
//! (what `serve` checks at start-up), [`HostSetup`] the bridge plus the
//! host's forwarding for it (IP forwarding, NAT, forward accepts,
//! `DOCKER-USER`; the rules themselves are kici-netpolicy's
//! [`HostForwarding`]) — what `kici-scaler firecracker
//! provision|verify|teardown` runs.

use crate::backend::BRIDGE_TAG;
use crate::tap::{LinkError, Netlink};
use kici_model::FirecrackerNetwork;
use kici_netpolicy::{ForwardingStatus, HostForwarding, NetPolicyError};
use std::time::Duration;

/// What is in place for the bridge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeStatus {
    pub exists: bool,
    pub up: bool,
    /// The gateway with the pool's prefix is assigned to the bridge.
    pub gateway_assigned: bool,
    /// The bridge carries our owner tag as ifalias.
    pub tagged: bool,
}

impl BridgeStatus {
    pub fn healthy(&self) -> bool {
        self.exists && self.up && self.gateway_assigned
    }

    /// What is missing, for operators.
    pub fn problems(&self, network: &FirecrackerNetwork) -> Vec<String> {
        let bridge = &network.bridge_name;
        let mut out = Vec::new();
        if !self.exists {
            out.push(format!("{bridge} does not exist"));
            return out;
        }
        if !self.up {
            out.push(format!("{bridge} is not up"));
        }
        if !self.gateway_assigned {
            out.push(format!(
                "{}/{} is not assigned to {bridge}",
                network.gateway,
                network.cidr.prefix_len()
            ));
        }
        if !self.tagged {
            out.push(format!(
                "{bridge} does not carry the owner tag {BRIDGE_TAG:?} (not created by kici-scaler)"
            ));
        }
        out
    }
}

/// The bridge side of the host network.
pub struct HostNetwork<'a> {
    pub network: &'a FirecrackerNetwork,
}

impl HostNetwork<'_> {
    /// Reads the bridge's state; changes nothing.
    pub async fn check(&self) -> Result<BridgeStatus, LinkError> {
        let netlink = Netlink::connect()?;
        let Some(link) = netlink.get(&self.network.bridge_name).await? else {
            return Ok(BridgeStatus {
                exists: false,
                up: false,
                gateway_assigned: false,
                tagged: false,
            });
        };
        let addresses = netlink.addresses(&self.network.bridge_name).await?;
        Ok(BridgeStatus {
            exists: true,
            up: link.up,
            gateway_assigned: addresses
                .contains(&(self.network.gateway, self.network.cidr.prefix_len())),
            tagged: link.alias.as_deref() == Some(BRIDGE_TAG),
        })
    }

    /// Creates the bridge (tagged, up) with the gateway address; idempotent,
    /// and never touches the bridge's ports (running VMs keep their TAPs).
    pub async fn provision(&self) -> Result<BridgeStatus, LinkError> {
        let netlink = Netlink::connect()?;
        netlink
            .ensure_bridge(&self.network.bridge_name, BRIDGE_TAG)
            .await?;
        netlink
            .ensure_address(
                &self.network.bridge_name,
                self.network.gateway,
                self.network.cidr.prefix_len(),
            )
            .await?;
        self.check().await
    }

    /// Deletes the bridge, only if it carries our tag; `Ok(false)` otherwise.
    pub async fn teardown(&self) -> Result<bool, LinkError> {
        let status = self.check().await?;
        if !status.exists || !status.tagged {
            return Ok(false);
        }
        Netlink::connect()?.delete(&self.network.bridge_name).await
    }
}

/// Why host setup could not be read or changed.
#[derive(Debug, thiserror::Error)]
pub enum HostSetupError {
    #[error("bridge: {0}")]
    Link(#[from] LinkError),
    #[error("forwarding rules: {0}")]
    Rules(#[from] NetPolicyError),
}

/// Everything the host needs for the Firecracker network, read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSetupStatus {
    pub bridge: BridgeStatus,
    pub forwarding: ForwardingStatus,
}

/// What [`HostSetup::teardown`] removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTeardown {
    /// The bridge was ours and is gone.
    pub bridge_removed: bool,
    /// NAT, forward and `DOCKER-USER` rules removed.
    pub rules_removed: usize,
}

/// The bridge and the host forwarding for it.
pub struct HostSetup<'a> {
    pub network: &'a FirecrackerNetwork,
    /// The interface to masquerade on; `None`: the default route's, or any
    /// interface but the bridge without a default route.
    pub uplink: Option<String>,
}

impl HostSetupStatus {
    /// Everything in place: the bridge (ours, up, with the gateway) and
    /// the forwarding.
    pub fn healthy(&self) -> bool {
        self.bridge.healthy() && self.bridge.tagged && self.forwarding.healthy()
    }

    /// What is missing, one line each.
    pub fn problems(&self, setup: &HostSetup<'_>) -> Vec<String> {
        let mut out = self.bridge.problems(setup.network);
        out.extend(self.forwarding.problems(&setup.forwarding()));
        out
    }
}

impl HostSetup<'_> {
    const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

    /// The forwarding rules' side, for this network.
    pub fn forwarding(&self) -> HostForwarding {
        HostForwarding {
            bridge: self.network.bridge_name.clone(),
            subnet: self.network.cidr,
            uplink: self.uplink.clone(),
            netns: None,
            command_timeout: Self::COMMAND_TIMEOUT,
        }
    }

    fn bridge(&self) -> HostNetwork<'_> {
        HostNetwork {
            network: self.network,
        }
    }

    /// Reads everything; changes nothing.
    pub async fn verify(&self) -> Result<HostSetupStatus, HostSetupError> {
        Ok(HostSetupStatus {
            bridge: self.bridge().check().await?,
            forwarding: self.forwarding().check().await?,
        })
    }

    /// Bridge, then forwarding; idempotent. Never touches the bridge's
    /// ports nor any per-VM rule (those live in other chains).
    pub async fn provision(&self) -> Result<HostSetupStatus, HostSetupError> {
        let bridge = self.bridge().provision().await?;
        let forwarding = self.forwarding().provision().await?;
        Ok(HostSetupStatus { bridge, forwarding })
    }

    /// Removes this network's NAT, forward and `DOCKER-USER` rules, and the
    /// bridge if kici-scaler created it (its owner tag). IP forwarding
    /// stays on: other things on the host may route.
    pub async fn teardown(&self) -> Result<HostTeardown, HostSetupError> {
        let rules_removed = self.forwarding().teardown().await?;
        let bridge_removed = self.bridge().teardown().await?;
        Ok(HostTeardown {
            bridge_removed,
            rules_removed,
        })
    }
}
