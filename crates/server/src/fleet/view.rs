//! The fleet as `GET /v1/fleet` and `kici-scaler fleet` show it, read from
//! the database (the same from every host).

use super::FleetHost;
use kici_api::{FleetHostObject, FleetObject, FleetPoolObject};
use kici_fleet::FleetError;
use std::collections::BTreeSet;

impl FleetHost {
    /// Hosts (except those that left) and every pool a live host serves.
    pub async fn view(&self) -> Result<FleetObject, FleetError> {
        let hosts = kici_fleet::membership::hosts(self.fleet()).await?;
        let hosts: Vec<_> = hosts.into_iter().filter(|h| h.state != "left").collect();
        let pools: BTreeSet<String> = hosts
            .iter()
            .filter(|h| h.state == "up")
            .flat_map(|h| h.pools.iter().cloned())
            .collect();
        let mut pool_objects = Vec::with_capacity(pools.len());
        for name in pools {
            let loads = self.queue().pool_loads(&name).await?;
            let usage = self.queue().pool_usage(&name).await?;
            let depth = self.queue().depth(&name).await?;
            let capacity: Option<u64> = loads
                .iter()
                .map(|l| l.capacity.map(u64::from))
                .sum::<Option<u64>>();
            let fleet_cap = self
                .0
                .runtime
                .call(|e, _| {
                    e.config()
                        .scaler(&name)
                        .and_then(|s| s.ext.fleet_max_agents)
                })
                .map(u64::from);
            let capacity = match (capacity, fleet_cap) {
                (Some(c), Some(f)) => Some(c.min(f)),
                (c, f) => c.or(f),
            };
            pool_objects.push(FleetPoolObject {
                hosts: loads.iter().map(|l| l.host.to_string()).collect(),
                agents: usage.agents,
                free: capacity.map(|c| c.saturating_sub(usage.agents)),
                capacity,
                queue_depth: depth,
                name,
            });
        }
        Ok(FleetObject {
            fleet: self.fleet().name().to_owned(),
            answered_by: self.instance().to_string(),
            hosts: hosts
                .into_iter()
                .map(|h| FleetHostObject {
                    lease_age_seconds: h.lease_age_ms.max(0) as f64 / 1000.0,
                    instance_id: h.instance_id,
                    hostname: h.hostname,
                    url: h.url,
                    state: h.state,
                    epoch: h.epoch,
                    leader: h.leader,
                    version: h.version,
                    pools: h.pools,
                })
                .collect(),
            pools: pool_objects,
            refused_pools: self.refused_pools().to_vec(),
        })
    }
}
