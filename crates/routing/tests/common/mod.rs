//! Test-only builders for `kici_model::Config` (shared by the tests and the
//! bench via `#[path]`). kici-config is not a dependency: routing only needs
//! the snapshot types.
#![allow(dead_code)]

use kici_model::{
    BackendSettings, BareMetalSettings, Config, ContainerRuntime, ContainerSettings,
    FirecrackerLabelSet, FirecrackerNetwork, FirecrackerSettings, ImagePullPolicy, LabelSet,
    LabelSetBackend, LabelSetConfig, LabelSetExtension, Origin, Roles, ScalerEntry,
    ScalerExtension, ScalerName, ScalerPlatform, ScalerType,
};
use std::collections::BTreeMap;

pub fn labels(raw: &[&str]) -> LabelSet {
    LabelSet::parse(raw.iter().copied()).expect("test labels are valid")
}

/// A scaler entry under construction.
pub struct ScalerBuilder {
    entry: ScalerEntry,
}

pub fn scaler(name: &str, kind: ScalerType) -> ScalerBuilder {
    let backend = match kind {
        ScalerType::Container => BackendSettings::Container(ContainerSettings {
            host: None,
            socket_path: None,
            runtime: ContainerRuntime::Auto,
            extra_hosts: Vec::new(),
            network_isolation: true,
        }),
        ScalerType::BareMetal => BackendSettings::BareMetal(BareMetalSettings {
            enforce_cgroups: false,
        }),
        ScalerType::Event => BackendSettings::Event(kici_model::EventSettings {
            provisioning_targets: Vec::new(),
            claim_ttl: kici_model::EventSettings::DEFAULT_CLAIM_TTL,
            agent_token_ttl: None,
            provisioner: None,
        }),
        ScalerType::Firecracker => BackendSettings::Firecracker(FirecrackerSettings {
            firecracker_path: "/usr/bin/firecracker".into(),
            jailer_path: "/usr/bin/jailer".into(),
            kernel_path: "/srv/vmlinux".into(),
            chroot_base_dir: FirecrackerSettings::DEFAULT_CHROOT_BASE_DIR.into(),
            uid: 1000,
            gid: 1000,
            require_sudo: false,
        }),
    };
    ScalerBuilder {
        entry: ScalerEntry {
            name: ScalerName::new(name),
            origin: Origin::synthetic(),
            kind,
            max_agents: 10,
            label_sets: Vec::new(),
            orchestrator_url: None,
            warm_pool: None,
            mandatory_labels: LabelSet::default(),
            platform: None,
            max_concurrent_spawns: ScalerEntry::DEFAULT_MAX_CONCURRENT_SPAWNS,
            roles: Roles::All,
            resource_cap: None,
            machine_pool: None,
            backend,
            vcpu_count: 2,
            mem_size_mib: 512,
            ext: ScalerExtension::defaults_for(kind),
        },
    }
}

pub fn container(name: &str) -> ScalerBuilder {
    scaler(name, ScalerType::Container)
}

pub fn bare_metal(name: &str) -> ScalerBuilder {
    scaler(name, ScalerType::BareMetal)
}

pub fn firecracker(name: &str) -> ScalerBuilder {
    scaler(name, ScalerType::Firecracker)
}

impl ScalerBuilder {
    /// Adds a label set; `raw` is kept as written in `raw_labels`.
    pub fn set(mut self, raw: &[&str]) -> Self {
        let backend = match self.entry.kind {
            ScalerType::Container => LabelSetBackend::Container {
                image: "ghcr.io/kici/agent:latest".into(),
                image_pull_policy: ImagePullPolicy::Always,
                container_socket: false,
                volumes: Vec::new(),
            },
            ScalerType::BareMetal => LabelSetBackend::BareMetal {
                binary_path: "/usr/local/bin/kici-agent".into(),
            },
            ScalerType::Firecracker => LabelSetBackend::Firecracker(FirecrackerLabelSet {
                rootfs_path: "/srv/rootfs.ext4".into(),
                kernel_path: None,
                vcpu_count: None,
                mem_size_mib: None,
                overlay_drive_size_mib: None,
            }),
            ScalerType::Event => LabelSetBackend::Event,
        };
        self.entry.label_sets.push(LabelSetConfig {
            labels: labels(raw),
            raw_labels: raw.iter().map(|s| s.to_string()).collect(),
            origin: Origin::synthetic(),
            resources: None,
            env: BTreeMap::new(),
            network_policy: None,
            backpressure_mode: None,
            backend,
            ext: LabelSetExtension::default(),
        });
        self
    }

    pub fn mandatory(mut self, raw: &[&str]) -> Self {
        self.entry.mandatory_labels = labels(raw);
        self
    }

    pub fn platform(mut self, platform: Option<ScalerPlatform>) -> Self {
        self.entry.platform = platform;
        self
    }

    pub fn roles(mut self, roles: Roles) -> Self {
        self.entry.roles = roles;
        self
    }

    pub fn build(self) -> ScalerEntry {
        self.entry
    }
}

pub fn config(scalers: impl IntoIterator<Item = ScalerBuilder>) -> Config {
    Config {
        global_max_agents: Config::DEFAULT_GLOBAL_MAX_AGENTS,
        defaults: None,
        global_resource_cap: None,
        machine_pools: Vec::new(),
        scalers: scalers.into_iter().map(ScalerBuilder::build).collect(),
        firecracker: FirecrackerNetwork::default(),
    }
}
