//! `kici-scaler-net`: the bridge network every agent container joins.
//!
//! Ours, not upstream's `kici-agent-net`, so both can share one dockerd.
//! Created when missing with the configured subnet, the subnet's first host
//! address as gateway, inter-container communication off
//! (`enable_icc=false`) and a fixed bridge interface name (the egress rules
//! match on it). An existing network is checked — driver, subnet, gateway,
//! ICC — and any mismatch is a start-up error naming what differs (upstream
//! reused whatever it found; docs/deviations.md, D-container-network). Agent addresses come from our allocator
//! and are pinned at create time, so the rules exist before the agent runs.

use crate::runtime::{Connection, RuntimeKind};
use bollard::models::{Ipam, IpamConfig, NetworkCreateRequest};
use bollard::query_parameters::ListNetworksOptions;
use kici_store::Ipv4Pool;
use std::collections::HashMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::time::Duration;

pub const DEFAULT_NETWORK_NAME: &str = "kici-scaler-net";
pub const DEFAULT_SUBNET: &str = "172.29.0.0/16";
pub const DEFAULT_BRIDGE: &str = "kici-scaler0";

const OPT_ICC: &str = "com.docker.network.bridge.enable_icc";
const OPT_BRIDGE_NAME: &str = "com.docker.network.bridge.name";
/// The label a network we created carries (never `kici-managed`).
pub const NETWORK_LABEL: &str = "dev.kici.scaler.network";

/// Which network agents join.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkSettings {
    pub name: String,
    pub pool: Ipv4Pool,
    /// The host-side bridge interface (≤ 15 bytes).
    pub bridge: String,
}

impl Default for NetworkSettings {
    fn default() -> Self {
        Self {
            name: DEFAULT_NETWORK_NAME.into(),
            // A valid literal: 172.29.0.0/16 has no host bits and is /29 or shorter.
            pool: DEFAULT_SUBNET
                .parse()
                .unwrap_or_else(|_| unreachable!("the default subnet is valid")),
            bridge: DEFAULT_BRIDGE.into(),
        }
    }
}

impl NetworkSettings {
    pub fn gateway(&self) -> Ipv4Addr {
        self.pool.gateway()
    }
}

/// The network as the runtime has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkInfo {
    pub id: String,
    /// The host-side bridge interface the rules match on.
    pub bridge: String,
    pub gateway: Ipv4Addr,
    pub created: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("network {name} on {endpoint}: {call}: {reason}")]
    Api {
        name: String,
        endpoint: String,
        call: &'static str,
        reason: String,
    },
    #[error(
        "network {name} exists on {endpoint} but is not as kici-scaler needs it: {}; \
         remove it (docker network rm {name}) or configure another network name/subnet",
        problems.join("; ")
    )]
    Mismatch {
        name: String,
        endpoint: String,
        problems: Vec<String>,
    },
}

impl fmt::Display for NetworkInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (bridge {}, gateway {})",
            self.id, self.bridge, self.gateway
        )
    }
}

/// Finds or creates the network and checks it.
pub async fn ensure(
    conn: &Connection,
    settings: &NetworkSettings,
    deadline: Duration,
) -> Result<NetworkInfo, NetworkError> {
    if let Some(info) = inspect_checked(conn, settings, deadline).await? {
        return Ok(info);
    }
    let api = |call, reason: String| NetworkError::Api {
        name: settings.name.clone(),
        endpoint: conn.endpoint.to_string(),
        call,
        reason,
    };
    let mut options = HashMap::from([(OPT_ICC.to_owned(), "false".to_owned())]);
    options.insert(OPT_BRIDGE_NAME.to_owned(), settings.bridge.clone());
    let request = NetworkCreateRequest {
        name: settings.name.clone(),
        driver: Some("bridge".into()),
        ipam: Some(Ipam {
            driver: Some("default".into()),
            config: Some(vec![IpamConfig {
                subnet: Some(settings.pool.network().to_string()),
                gateway: Some(settings.gateway().to_string()),
                ..Default::default()
            }]),
            options: None,
        }),
        options: Some(options),
        labels: Some(HashMap::from([(
            NETWORK_LABEL.to_owned(),
            "true".to_owned(),
        )])),
        ..Default::default()
    };
    match tokio::time::timeout(deadline, conn.docker.create_network(request)).await {
        Err(_) => {
            return Err(api(
                "POST /networks/create",
                format!("no answer within {deadline:?}"),
            ))
        }
        Ok(Ok(_)) => {}
        // Someone created it concurrently: check theirs.
        Ok(Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 409, ..
        })) => {}
        Ok(Err(e)) => return Err(api("POST /networks/create", e.to_string())),
    }
    let info = inspect_checked(conn, settings, deadline)
        .await?
        .ok_or_else(|| api("GET /networks", "created, but not found afterwards".into()))?;
    tracing::info!(network = %settings.name, endpoint = %conn.endpoint, info = %info, "created the agent network");
    Ok(NetworkInfo {
        created: true,
        ..info
    })
}

/// The network if it exists (exact name: the list filter is a substring
/// match), checked against `settings`.
async fn inspect_checked(
    conn: &Connection,
    settings: &NetworkSettings,
    deadline: Duration,
) -> Result<Option<NetworkInfo>, NetworkError> {
    let api = |call, reason: String| NetworkError::Api {
        name: settings.name.clone(),
        endpoint: conn.endpoint.to_string(),
        call,
        reason,
    };
    let filters = HashMap::from([("name".to_owned(), vec![settings.name.clone()])]);
    let list = tokio::time::timeout(
        deadline,
        conn.docker.list_networks(Some(ListNetworksOptions {
            filters: Some(filters),
        })),
    )
    .await
    .map_err(|_| api("GET /networks", format!("no answer within {deadline:?}")))?
    .map_err(|e| api("GET /networks", e.to_string()))?;
    let Some(network) = list
        .into_iter()
        .find(|n| n.name.as_deref() == Some(settings.name.as_str()))
    else {
        return Ok(None);
    };
    let id = network.id.clone().unwrap_or_default();
    let mut problems = Vec::new();
    if network.driver.as_deref() != Some("bridge") {
        problems.push(format!(
            "driver is {:?}, expected bridge",
            network.driver.as_deref().unwrap_or("")
        ));
    }
    let configs = network
        .ipam
        .as_ref()
        .and_then(|i| i.config.clone())
        .unwrap_or_default();
    let want_subnet = settings.pool.network().to_string();
    let want_gateway = settings.gateway().to_string();
    let ipv4: Vec<&IpamConfig> = configs
        .iter()
        .filter(|c| c.subnet.as_deref().is_some_and(|s| !s.contains(':')))
        .collect();
    match ipv4.as_slice() {
        [only] => {
            if only.subnet.as_deref() != Some(want_subnet.as_str()) {
                problems.push(format!(
                    "subnet is {}, expected {want_subnet}",
                    only.subnet.as_deref().unwrap_or("")
                ));
            }
            // Podman omits an explicit gateway when it is the default one.
            if let Some(gw) = only.gateway.as_deref().filter(|g| !g.is_empty()) {
                if gw != want_gateway {
                    problems.push(format!("gateway is {gw}, expected {want_gateway}"));
                }
            }
        }
        other => problems.push(format!(
            "has {} IPv4 subnets, expected exactly {want_subnet}",
            other.len()
        )),
    }
    let options = network.options.clone().unwrap_or_default();
    let icc_off = options.get(OPT_ICC).map(String::as_str) == Some("false");
    // Podman's compat layer does not report bridge driver options back;
    // there isolation between containers is its default behaviour.
    if !icc_off && conn.kind == RuntimeKind::Docker {
        problems.push(format!(
            "{OPT_ICC} is {:?}, expected \"false\" (containers could reach each other)",
            options.get(OPT_ICC).map(String::as_str).unwrap_or("unset")
        ));
    }
    let bridge_option = options.get(OPT_BRIDGE_NAME).filter(|b| !b.is_empty());
    if conn.kind == RuntimeKind::Docker && bridge_option != Some(&settings.bridge) {
        problems.push(format!(
            "bridge interface is {}, expected {} (the egress rules match on it)",
            bridge_option.map_or_else(
                || format!("br-{}", id.get(..12).unwrap_or(&id)),
                Clone::clone
            ),
            settings.bridge
        ));
    }
    if !problems.is_empty() {
        return Err(NetworkError::Mismatch {
            name: settings.name.clone(),
            endpoint: conn.endpoint.to_string(),
            problems,
        });
    }
    let bridge = match options.get(OPT_BRIDGE_NAME) {
        Some(name) if !name.is_empty() => name.clone(),
        // Podman honours the bridge name at create but its compat inspect
        // does not report driver options back.
        _ if conn.kind == RuntimeKind::Podman => settings.bridge.clone(),
        _ => format!("br-{}", id.get(..12).unwrap_or(&id)),
    };
    Ok(Some(NetworkInfo {
        id,
        bridge,
        gateway: settings.gateway(),
        created: false,
    }))
}
