//! Capacity set aside for starved pending requests.
//!
//! Pending requests are served oldest first among those that fit; one that
//! has waited longer than `starvationSeconds` must not be overtaken forever
//! by smaller, younger ones. The engine builds a [`Holds`] from the starved
//! requests older than the one it is trying, and admission then checks that
//! request against `limit - used - held` on every cap.

use crate::admission::Demand;
use kici_model::{Resources, ScalerName};
use std::collections::HashMap;

/// An amount held in one scope: agents, milli-CPU, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Held {
    pub agents: u64,
    pub cpu: u64,
    pub memory: u64,
}

impl Held {
    fn add(&mut self, agents: u64, requests: Resources) {
        self.agents = self.agents.saturating_add(agents);
        self.cpu = self.cpu.saturating_add(requests.cpu.millis());
        self.memory = self.memory.saturating_add(requests.memory.bytes());
    }
}

/// Capacity held for older starved requests, per scope.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holds {
    global: Held,
    scalers: HashMap<ScalerName, Held>,
    pools: HashMap<String, Held>,
}

impl Holds {
    /// Nothing held: the request competes for everything that is free.
    pub fn none() -> Self {
        Self::default()
    }

    /// Holds what one starved request needs: one agent and its requests in
    /// its scaler and globally, its requests in its machine pool.
    pub fn add(&mut self, scaler: &ScalerName, requests: Resources, pool: Option<&str>) {
        self.global.add(1, requests);
        self.scalers
            .entry(scaler.clone())
            .or_default()
            .add(1, requests);
        if let Some(pool) = pool {
            self.pools
                .entry(pool.to_owned())
                .or_default()
                .add(1, requests);
        }
    }

    /// [`Holds::add`] for a demand.
    pub fn add_demand(&mut self, demand: &Demand) {
        self.add(&demand.scaler, demand.requests, demand.pool.as_deref());
    }

    pub fn is_empty(&self) -> bool {
        self.global == Held::default()
    }

    pub(crate) fn global(&self) -> Held {
        self.global
    }

    pub(crate) fn scaler(&self, name: &str) -> Held {
        self.scalers.get(name).copied().unwrap_or_default()
    }

    pub(crate) fn pool(&self, name: &str) -> Held {
        self.pools.get(name).copied().unwrap_or_default()
    }
}
