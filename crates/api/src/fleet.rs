//! The fleet: `GET /v1/fleet`, the same from every host of a fleet.

use serde::{Deserialize, Serialize};

/// The fleet as its database knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct FleetObject {
    /// The fleet's name (`--fleet`).
    pub fleet: String,
    /// The host that answered.
    pub answered_by: String,
    /// Every host that has not left, oldest first.
    pub hosts: Vec<FleetHostObject>,
    /// Every pool (scaler name) some live host serves.
    pub pools: Vec<FleetPoolObject>,
    /// Pools of the answering host's configuration that it does not serve
    /// because live hosts define them differently, with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused_pools: Vec<String>,
}

/// One host of the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct FleetHostObject {
    pub instance_id: String,
    pub hostname: String,
    /// Its control API as peers reach it (`--advertise-url`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// `up`, `leaving` (handing over at shutdown) or `lost` (lease expired).
    pub state: String,
    /// Incremented every time the host (re)takes its lease.
    pub epoch: i64,
    /// Seconds since the lease was last renewed.
    pub lease_age_seconds: f64,
    /// Whether it is the fleet's leader.
    pub leader: bool,
    pub version: String,
    /// The pools it serves.
    pub pools: Vec<String>,
}

/// One pool (a scaler name) across the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct FleetPoolObject {
    pub name: String,
    /// Live hosts serving it.
    pub hosts: Vec<String>,
    /// Its agents and claimed requests across the fleet.
    pub agents: u64,
    /// Summed capacity of the live hosts serving it (`maxAgents` each),
    /// bounded by `fleetMaxAgents`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    /// `capacity - agents`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free: Option<u64>,
    /// Requests waiting in the queue.
    pub queue_depth: u64,
}
