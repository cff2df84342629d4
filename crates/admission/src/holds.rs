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
    /// Adds `count` agents of `requests` each.
    fn add(&mut self, count: u64, requests: Resources) {
        self.agents = self.agents.saturating_add(count);
        self.cpu = self
            .cpu
            .saturating_add(requests.cpu.millis().saturating_mul(count));
        self.memory = self
            .memory
            .saturating_add(requests.memory.bytes().saturating_mul(count));
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
        self.add_many(scaler, requests, pool, 1);
    }

    /// [`Holds::add`] for `count` identical starved requests at once: the
    /// engine holds for a run of same-shaped requests without visiting
    /// each of them.
    pub fn add_many(
        &mut self,
        scaler: &ScalerName,
        requests: Resources,
        pool: Option<&str>,
        count: u64,
    ) {
        if count == 0 {
            return;
        }
        self.global.add(count, requests);
        self.scalers
            .entry(scaler.clone())
            .or_default()
            .add(count, requests);
        if let Some(pool) = pool {
            self.pools
                .entry(pool.to_owned())
                .or_default()
                .add(count, requests);
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

#[cfg(test)]
mod tests {
    use super::*;
    use kici_model::{MemoryBytes, MilliCpu};

    #[test]
    fn add_many_is_add_repeated() {
        let scaler = ScalerName::new("s");
        let r = Resources::new(
            MilliCpu::from_millis(1500),
            MemoryBytes::from_bytes(1 << 30),
        );
        let mut one_by_one = Holds::none();
        for _ in 0..3 {
            one_by_one.add(&scaler, r, Some("pool"));
        }
        let mut at_once = Holds::none();
        at_once.add_many(&scaler, r, Some("pool"), 3);
        assert_eq!(one_by_one, at_once);
        assert_eq!(at_once.scaler("s").cpu, 4500);
        assert_eq!(at_once.pool("pool").memory, 3 << 30);
        let mut nothing = Holds::none();
        nothing.add_many(&scaler, r, Some("pool"), 0);
        assert_eq!(nothing, Holds::none(), "a count of 0 holds nothing");
    }

    #[test]
    fn add_many_saturates() {
        let scaler = ScalerName::new("s");
        let r = Resources::new(
            MilliCpu::from_millis(u64::MAX / 2),
            MemoryBytes::from_bytes(1),
        );
        let mut h = Holds::none();
        h.add_many(&scaler, r, None, 3);
        assert_eq!(h.global().cpu, u64::MAX);
        assert_eq!(h.global().agents, 3);
    }
}
