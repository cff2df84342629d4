//! The host bridge VMs attach to: checked and provisioned from the config's
//! `firecracker` block alone (the daemon's `firecracker provision|verify`
//! and `doctor` call this). IP forwarding, NAT and forward rules are
//! kici-netpolicy's.

use crate::backend::BRIDGE_TAG;
use crate::tap::{LinkError, Netlink};
use kici_model::FirecrackerNetwork;

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
