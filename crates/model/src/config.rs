//! The immutable configuration snapshot.
//!
//! A [`Config`] is what `kici-config` produces from `scalers.yaml` plus
//! `scalers.d/`: every value parsed, every cross-field rule checked. The engine
//! swaps whole snapshots on reload; nothing mutates one.
//!
//! Serialisation (camelCase, the YAML's own field names) exists for the reload
//! diff and for `status`; [`Origin`]s are not serialised.

use crate::ids::{ScalerName, ScalerType};
use crate::labels::{Label, LabelSet};
use crate::origin::Origin;
use crate::resources::{ResourceCap, ResourceRequest};
use ipnet::{IpNet, Ipv4Net};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Config {
    pub global_max_agents: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub defaults: Option<ResourceRequest>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub global_resource_cap: Option<ResourceCap>,
    pub machine_pools: Vec<MachinePool>,
    pub scalers: Vec<ScalerEntry>,
    /// The Firecracker host network; defaults filled in when the block is
    /// absent, exactly as upstream's backends do in code.
    pub firecracker: FirecrackerNetwork,
}

impl Config {
    pub const DEFAULT_GLOBAL_MAX_AGENTS: u32 = 50;

    pub fn scaler(&self, name: &str) -> Option<&ScalerEntry> {
        self.scalers.iter().find(|s| s.name.as_str() == name)
    }

    pub fn machine_pool(&self, name: &str) -> Option<&MachinePool> {
        self.machine_pools.iter().find(|p| p.name == name)
    }
}

/// A resource pool shared by several kici-scaler (or KiCI) processes on one
/// host, accounted in the machine-pool ledger.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MachinePool {
    /// Validated: `[A-Za-z0-9._-]+`, not starting with a dot (used in file names).
    pub name: String,
    pub cap: ResourceCap,
    #[serde(skip)]
    pub origin: Origin,
}

/// One entry of `scalers[]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScalerEntry {
    pub name: ScalerName,
    #[serde(skip)]
    pub origin: Origin,
    #[serde(rename = "type")]
    pub kind: ScalerType,
    pub max_agents: u32,
    pub label_sets: Vec<LabelSetConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub orchestrator_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_pool: Option<WarmPoolConfig>,
    pub mandatory_labels: LabelSet,
    pub roles: Roles,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource_cap: Option<ResourceCap>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine_pool: Option<String>,
    /// Type-specific settings; fields of other types are accepted by the
    /// loader (as upstream) and dropped.
    pub backend: BackendSettings,
    /// Firecracker machine defaults, defaulted for every type as upstream.
    pub vcpu_count: u32,
    pub mem_size_mib: u32,
    #[serde(rename = "x-kici-scaler")]
    pub ext: ScalerExtension,
}

impl ScalerEntry {
    /// The warm pool target when one is enabled with a positive size.
    pub fn warm_target(&self) -> u32 {
        self.warm_pool
            .as_ref()
            .filter(|w| w.enabled)
            .map_or(0, |w| w.size)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum BackendSettings {
    Container(ContainerSettings),
    BareMetal(BareMetalSettings),
    Firecracker(FirecrackerSettings),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerSettings {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_path: Option<PathBuf>,
    pub runtime: ContainerRuntime,
    pub extra_hosts: Vec<String>,
    pub network_isolation: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ContainerRuntime {
    Auto,
    Docker,
    Podman,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BareMetalSettings {
    pub enforce_cgroups: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FirecrackerSettings {
    pub firecracker_path: PathBuf,
    pub jailer_path: PathBuf,
    pub kernel_path: PathBuf,
    pub chroot_base_dir: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub require_sudo: bool,
}

impl FirecrackerSettings {
    pub const DEFAULT_CHROOT_BASE_DIR: &'static str = "/srv/jailer";
}

/// `warmPool`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WarmPoolConfig {
    pub enabled: bool,
    pub size: u32,
    #[serde(serialize_with = "ser_secs")]
    pub idle_timeout: Duration,
}

impl WarmPoolConfig {
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

    /// `KICI_SCALER_IDLE_TIMEOUT` for warm agents: the contract reads
    /// milliseconds.
    pub fn agent_idle_timeout_ms(&self) -> u128 {
        self.idle_timeout.as_millis()
    }
}

/// Which internal job kinds a scaler's agents may run. Execution jobs carry
/// no role label, so every scaler runs them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Roles {
    /// `roles` absent, or containing `all`.
    All,
    /// An explicit list; empty = execution only.
    Only(Vec<Role>),
}

impl Roles {
    /// The `kici:role:*` labels this scaler's agents carry.
    pub fn labels(&self) -> Vec<Label> {
        let roles: &[Role] = match self {
            Roles::All => &Role::ALL,
            Roles::Only(r) => r,
        };
        roles
            .iter()
            .map(|r| Label::auto("role", r.as_str()))
            .collect()
    }

    /// The agent's `KICI_ROLES` value: unset for all roles, `""` for
    /// execution-only, a comma list otherwise.
    pub fn agent_env_value(&self) -> Option<String> {
        match self {
            Roles::All => None,
            Roles::Only(r) => Some(r.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(",")),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Builder,
    InitRunner,
}

impl Role {
    pub const ALL: [Role; 2] = [Role::Builder, Role::InitRunner];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Builder => "builder",
            Role::InitRunner => "init-runner",
        }
    }
}

/// One entry of `labelSets[]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSetConfig {
    /// Normalised; what routing matches on.
    pub labels: LabelSet,
    /// As written (order and case kept): what agents get in `KICI_LABELS`.
    #[serde(skip)]
    pub raw_labels: Vec<String>,
    #[serde(skip)]
    pub origin: Origin,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequest>,
    pub env: BTreeMap<EnvName, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<NetworkPolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backpressure_mode: Option<BackpressureMode>,
    pub backend: LabelSetBackend,
    #[serde(rename = "x-kici-scaler")]
    pub ext: LabelSetExtension,
}

/// The label-set fields that belong to the scaler's type.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum LabelSetBackend {
    #[serde(rename_all = "camelCase")]
    Container {
        image: String,
        image_pull_policy: ImagePullPolicy,
        container_socket: bool,
        volumes: Vec<String>,
    },
    #[serde(rename_all = "camelCase")]
    BareMetal {
        binary_path: PathBuf,
    },
    Firecracker(FirecrackerLabelSet),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FirecrackerLabelSet {
    pub rootfs_path: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_path: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpu_count: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_size_mib: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlay_drive_size_mib: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ImagePullPolicy {
    Always,
    IfNotPresent,
    Never,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackpressureMode {
    Pause,
    Drop,
}

impl BackpressureMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Drop => "drop",
        }
    }
}

/// `networkPolicy`: egress for container and Firecracker agents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    pub allowlist: Vec<IpNet>,
    pub deny_all: bool,
}

/// A POSIX environment variable name (`[A-Za-z_][A-Za-z0-9_]*`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct EnvName(String);

impl EnvName {
    /// Variables the engine sets itself; configuration may not override them
    /// (doing so would break token binding or agent start-up).
    pub const RESERVED: [&'static str; 4] = [
        "KICI_AGENT_ID",
        "KICI_AGENT_TOKEN",
        "KICI_LABELS",
        "KICI_SCALER_MANAGED",
    ];

    pub fn parse(s: &str) -> Option<Self> {
        let mut bytes = s.bytes();
        let first = bytes.next()?;
        let ok = (first.is_ascii_alphabetic() || first == b'_')
            && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
        ok.then(|| Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EnvName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The `firecracker` block: the host bridge network for microVMs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FirecrackerNetwork {
    pub cidr: Ipv4Net,
    pub bridge_name: String,
    pub gateway: Ipv4Addr,
    pub netmask: Ipv4Addr,
    pub table: String,
}

impl Default for FirecrackerNetwork {
    fn default() -> Self {
        Self {
            // Provably valid literals (upstream's defaults).
            cidr: Ipv4Net::new(Ipv4Addr::new(10, 0, 0, 0), 24).unwrap_or_default(),
            bridge_name: "kici-br0".into(),
            gateway: Ipv4Addr::new(10, 0, 0, 1),
            netmask: Ipv4Addr::new(255, 255, 255, 0),
            table: "kici".into(),
        }
    }
}

/// The deadlines of one scaler (each settable under `x-kici-scaler`; the
/// defaults are listed in docs/operations.md, *Deadlines*).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Deadlines {
    /// Requested → booted, image pull included.
    #[serde(serialize_with = "ser_secs")]
    pub provision: Duration,
    /// Booted → registered.
    #[serde(serialize_with = "ser_secs")]
    pub registration: Duration,
    /// A registered agent with no job leaves after this.
    #[serde(serialize_with = "ser_secs")]
    pub pending_dispatch: Duration,
    #[serde(serialize_with = "ser_secs")]
    pub max_lifetime: Duration,
    #[serde(serialize_with = "ser_secs")]
    pub destroy_grace: Duration,
    /// Each Engine / Firecracker API call.
    #[serde(serialize_with = "ser_secs")]
    pub api_call: Duration,
    /// Extra time past a warm agent's own idle timeout before our backstop
    /// timer destroys it.
    #[serde(serialize_with = "ser_secs")]
    pub idle_grace: Duration,
}

impl Deadlines {
    pub fn defaults_for(kind: ScalerType) -> Self {
        Self {
            provision: Duration::from_secs(300),
            registration: Duration::from_secs(120),
            pending_dispatch: Duration::from_secs(60),
            max_lifetime: Duration::from_secs(24 * 3600),
            destroy_grace: Duration::from_secs(match kind {
                ScalerType::Container => 10,
                ScalerType::BareMetal | ScalerType::Firecracker => 5,
            }),
            api_call: Duration::from_secs(30),
            idle_grace: Duration::from_secs(30),
        }
    }
}

/// Exponential backoff after failed spawns, per label set, with a circuit
/// breaker (closed → open after `breaker_threshold` consecutive failures →
/// half-open after `breaker_open` → closed on one success).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BackoffPolicy {
    #[serde(serialize_with = "ser_secs")]
    pub initial: Duration,
    #[serde(serialize_with = "ser_secs")]
    pub max: Duration,
    pub breaker_threshold: u32,
    #[serde(serialize_with = "ser_secs")]
    pub breaker_open: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
            breaker_threshold: 5,
            breaker_open: Duration::from_secs(60),
        }
    }
}

/// A scaler's `x-kici-scaler` object: kici-scaler's own settings, kept out of
/// upstream's strict schema.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScalerExtension {
    pub deadlines: Deadlines,
    pub backoff: BackoffPolicy,
    /// Container scalers: `HostConfig.Ulimits` of this scaler's agents, by
    /// name. Each one set here replaces the daemon's default of that name;
    /// names not set here keep the daemon's default. Empty for other types.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub ulimits: BTreeMap<UlimitName, UlimitValue>,
}

impl ScalerExtension {
    pub fn defaults_for(kind: ScalerType) -> Self {
        Self {
            deadlines: Deadlines::defaults_for(kind),
            backoff: BackoffPolicy::default(),
            ulimits: BTreeMap::new(),
        }
    }
}

/// A resource limit of a container (`setrlimit(2)`'s, named as Docker's
/// `--ulimit` and compose's `ulimits:` name them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UlimitName {
    As,
    Core,
    Cpu,
    Data,
    Fsize,
    Locks,
    Memlock,
    Msgqueue,
    Nice,
    Nofile,
    Nproc,
    Rss,
    Rtprio,
    Rttime,
    Sigpending,
    Stack,
}

impl UlimitName {
    pub const ALL: [UlimitName; 16] = [
        Self::As,
        Self::Core,
        Self::Cpu,
        Self::Data,
        Self::Fsize,
        Self::Locks,
        Self::Memlock,
        Self::Msgqueue,
        Self::Nice,
        Self::Nofile,
        Self::Nproc,
        Self::Rss,
        Self::Rtprio,
        Self::Rttime,
        Self::Sigpending,
        Self::Stack,
    ];

    /// The name as the Engine API takes it (`nofile`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::As => "as",
            Self::Core => "core",
            Self::Cpu => "cpu",
            Self::Data => "data",
            Self::Fsize => "fsize",
            Self::Locks => "locks",
            Self::Memlock => "memlock",
            Self::Msgqueue => "msgqueue",
            Self::Nice => "nice",
            Self::Nofile => "nofile",
            Self::Nproc => "nproc",
            Self::Rss => "rss",
            Self::Rtprio => "rtprio",
            Self::Rttime => "rttime",
            Self::Sigpending => "sigpending",
            Self::Stack => "stack",
        }
    }
}

impl fmt::Display for UlimitName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for UlimitName {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|n| n.as_str() == s).ok_or(())
    }
}

/// One ulimit's soft and hard value: `soft <= hard <= i64::MAX` (the
/// Engine API's type), by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UlimitValue {
    soft: u64,
    hard: u64,
}

impl UlimitValue {
    /// `None` when `soft > hard` or either exceeds `i64::MAX`.
    pub fn new(soft: u64, hard: u64) -> Option<Self> {
        let max = i64::MAX.unsigned_abs();
        (soft <= hard && hard <= max).then_some(Self { soft, hard })
    }

    pub fn soft(self) -> u64 {
        self.soft
    }

    pub fn hard(self) -> u64 {
        self.hard
    }
}

/// A label set's `x-kici-scaler` object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSetExtension {
    /// Container: mount the root filesystem read-only.
    pub read_only_rootfs: bool,
}

fn ser_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}
