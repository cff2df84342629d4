//! Configurations and demands built in code for admission's tests and
//! benches (only the fields admission reads matter; the rest is defaulted).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use kici_admission::Demand;
use kici_model::{
    AgentId, BackendSettings, BareMetalSettings, Config, FirecrackerNetwork, LabelSet, MachinePool,
    MemoryBytes, MilliCpu, Origin, ResourceCap, Resources, Roles, ScalerEntry, ScalerExtension,
    ScalerName, ScalerType,
};

pub const GIB: u64 = 1 << 30;

pub fn cap(cpu_millis: Option<u64>, memory_bytes: Option<u64>) -> Option<ResourceCap> {
    if cpu_millis.is_none() && memory_bytes.is_none() {
        return None;
    }
    Some(ResourceCap {
        max_cpu: cpu_millis.map(MilliCpu::from_millis),
        max_memory: memory_bytes.map(MemoryBytes::from_bytes),
    })
}

/// A configuration under construction.
#[derive(Clone)]
pub struct ConfigBuilder(Config);

impl ConfigBuilder {
    pub fn new(global_max_agents: u32) -> Self {
        Self(Config {
            global_max_agents,
            defaults: None,
            global_resource_cap: None,
            machine_pools: Vec::new(),
            scalers: Vec::new(),
            firecracker: FirecrackerNetwork::default(),
        })
    }

    pub fn global_cap(mut self, cpu_millis: Option<u64>, memory_bytes: Option<u64>) -> Self {
        self.0.global_resource_cap = cap(cpu_millis, memory_bytes);
        self
    }

    pub fn pool(mut self, name: &str, cpu_millis: Option<u64>, memory_bytes: Option<u64>) -> Self {
        self.0.machine_pools.push(MachinePool {
            name: name.to_owned(),
            cap: cap(cpu_millis, memory_bytes).unwrap_or_default(),
            origin: Origin::synthetic(),
        });
        self
    }

    pub fn scaler(
        mut self,
        name: &str,
        max_agents: u32,
        cpu_millis: Option<u64>,
        memory_bytes: Option<u64>,
        pool: Option<&str>,
    ) -> Self {
        self.0.scalers.push(ScalerEntry {
            name: ScalerName::new(name),
            origin: Origin::synthetic(),
            kind: ScalerType::BareMetal,
            max_agents,
            label_sets: Vec::new(),
            orchestrator_url: None,
            warm_pool: None,
            mandatory_labels: LabelSet::default(),
            platform: None,
            max_concurrent_spawns: ScalerEntry::DEFAULT_MAX_CONCURRENT_SPAWNS,
            roles: Roles::All,
            resource_cap: cap(cpu_millis, memory_bytes),
            machine_pool: pool.map(str::to_owned),
            backend: BackendSettings::BareMetal(BareMetalSettings {
                enforce_cgroups: false,
            }),
            vcpu_count: 2,
            mem_size_mib: 512,
            ext: ScalerExtension::defaults_for(ScalerType::BareMetal),
        });
        self
    }

    pub fn build(self) -> Config {
        self.0
    }
}

pub fn res(cpu_millis: u64, memory_bytes: u64) -> Resources {
    Resources::new(
        MilliCpu::from_millis(cpu_millis),
        MemoryBytes::from_bytes(memory_bytes),
    )
}

pub fn agent(n: u32) -> AgentId {
    AgentId::new(ScalerType::BareMetal, n.to_be_bytes())
}

pub fn demand(
    n: u32,
    scaler: &str,
    cpu_millis: u64,
    memory_bytes: u64,
    pool: Option<&str>,
) -> Demand {
    Demand {
        agent: agent(n),
        scaler: ScalerName::new(scaler),
        requests: res(cpu_millis, memory_bytes),
        pool: pool.map(str::to_owned),
    }
}
