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
    /// `platform`: the OS and architecture of this pool's agents, when
    /// declared. A non-default one (not linux / not x64) taints the pool:
    /// routing then sends it only jobs that ask for those labels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub platform: Option<ScalerPlatform>,
    /// `maxConcurrentSpawns`: at most this many spawns of this scaler in
    /// flight at once (image pull, create, start); the rest wait their turn.
    /// Orthogonal to `max_agents`.
    pub max_concurrent_spawns: u32,
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
    /// `maxConcurrentSpawns` when the entry does not set it (upstream's
    /// default).
    pub const DEFAULT_MAX_CONCURRENT_SPAWNS: u32 = 8;

    /// The warm pool target when one is enabled with a positive size.
    pub fn warm_target(&self) -> u32 {
        self.warm_pool
            .as_ref()
            .filter(|w| w.enabled)
            .map_or(0, |w| w.size)
    }

    /// How long a warm agent stays idle before it leaves: upstream's
    /// `warmPool.idleTimeoutSeconds`, or its default when only a schedule
    /// or a forecast (`x-kici-scaler.warmPool`) fills the pool.
    pub fn warm_idle_timeout(&self) -> Duration {
        self.warm_pool
            .as_ref()
            .map_or(WarmPoolConfig::DEFAULT_IDLE_TIMEOUT, |w| w.idle_timeout)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum BackendSettings {
    Container(ContainerSettings),
    BareMetal(BareMetalSettings),
    Firecracker(FirecrackerSettings),
    Event(EventSettings),
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

/// A `type: event` scaler: spawning emits a scale-up event with a claim
/// code, destroying a scale-down event; nothing runs on this host.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EventSettings {
    /// Upstream's workflow refs (kept and reported; kici-scaler delivers to
    /// `provisioner` and to the event stream instead).
    pub provisioning_targets: Vec<String>,
    /// How long a claim code can be redeemed after its scale-up.
    #[serde(serialize_with = "ser_secs")]
    pub claim_ttl: Duration,
    /// How long the token minted on redemption lives; `None`: the agent's
    /// `maxLifetimeSeconds`.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_opt_secs"
    )]
    pub agent_token_ttl: Option<Duration>,
    /// `x-kici-scaler.provisioner`; `None`: events go to the event stream
    /// only (a pull-style consumer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provisioner: Option<ProvisionerSettings>,
}

impl EventSettings {
    /// `claimTtlSeconds` when absent (upstream's default).
    pub const DEFAULT_CLAIM_TTL: Duration = Duration::from_secs(300);
}

/// Where a `type: event` scaler's events are delivered besides the event
/// stream, as validated by the configuration loader. At least one target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProvisionerSettings {
    pub target: ProvisionerTarget,
    /// `env`: literal variables for the command's environment.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// `passEnv`: variables the command gets from the daemon's environment
    /// (names only; their values are read at delivery).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pass_env: Vec<String>,
    /// Bound on one delivery attempt.
    #[serde(serialize_with = "ser_secs")]
    pub timeout: Duration,
    /// Attempts per event (≥ 1).
    pub max_attempts: u32,
}

/// `command`, `webhook`, or both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProvisionerTarget {
    Command(Vec<String>),
    Webhook(ProvisionerWebhook),
    Both {
        command: Vec<String>,
        webhook: ProvisionerWebhook,
    },
}

impl ProvisionerTarget {
    pub fn command(&self) -> Option<&[String]> {
        match self {
            Self::Command(c) | Self::Both { command: c, .. } => Some(c),
            Self::Webhook(_) => None,
        }
    }

    pub fn webhook(&self) -> Option<&ProvisionerWebhook> {
        match self {
            Self::Webhook(w) | Self::Both { webhook: w, .. } => Some(w),
            Self::Command(_) => None,
        }
    }
}

/// A signed `POST` target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProvisionerWebhook {
    /// An absolute http(s) URL without credentials.
    pub url: String,
    /// The environment variable holding the signing secret (never the secret).
    pub secret_env: String,
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

/// `platform: {os, arch}` of a scaler entry: what its agents run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct ScalerPlatform {
    pub os: PlatformOs,
    pub arch: PlatformArch,
}

impl ScalerPlatform {
    /// The platform every pool is assumed to have unless told otherwise; it
    /// taints nothing.
    pub const DEFAULT: ScalerPlatform = ScalerPlatform {
        os: PlatformOs::Linux,
        arch: PlatformArch::X64,
    };

    /// The plain taint tokens of this platform, os first: `macos` or
    /// `windows` for a non-Linux OS, `arm64` for a non-x64 architecture.
    /// A tainted pool takes only jobs whose labels name every token, so that
    /// a generic job never lands on an exotic machine by accident.
    pub fn taints(self) -> Vec<Label> {
        let mut out = Vec::with_capacity(2);
        if self.os != PlatformOs::Linux {
            out.push(Label::from_valid_literal(self.os.as_str()));
        }
        if self.arch != PlatformArch::X64 {
            out.push(Label::from_valid_literal(self.arch.as_str()));
        }
        out
    }
}

impl fmt::Display for ScalerPlatform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os.as_str(), self.arch.as_str())
    }
}

/// `platform.os`, in upstream's (Node.js-derived) names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PlatformOs {
    Linux,
    Macos,
    Windows,
}

impl PlatformOs {
    pub const ALL: [PlatformOs; 3] = [Self::Linux, Self::Macos, Self::Windows];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Linux => "linux",
            Self::Macos => "macos",
            Self::Windows => "windows",
        }
    }
}

/// `platform.arch`, in upstream's (Node.js) names: `x64` is x86_64, `arm64`
/// is aarch64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PlatformArch {
    X64,
    Arm64,
}

impl PlatformArch {
    pub const ALL: [PlatformArch; 2] = [Self::X64, Self::Arm64];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::X64 => "x64",
            Self::Arm64 => "arm64",
        }
    }
}

/// Plain labels that taint the label set naming them even without a
/// `platform` field (upstream's legacy rule, kept for configurations written
/// before `platform` existed): a label set with `macos` only takes jobs that
/// ask for `macos`.
pub const LEGACY_PLATFORM_TAINT_LABELS: [&str; 3] = ["macos", "windows", "arm64"];

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
    /// An event scaler's label set has no backend fields: the provisioner
    /// decides what to boot from the event's labels and resources.
    Event,
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
    /// `hostAccess`: the services on the host itself an agent may reach.
    /// `None` when not written: the class default applies (DNS on the
    /// network's gateway, the agent gateway's port). `Some` replaces that
    /// default outright; `Some(vec![])` denies every host service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_access: Option<Vec<HostAccess>>,
}

/// One `networkPolicy.hostAccess` entry, written
/// `<address|cidr|*>[:<port|*>]`: `10.0.0.1:53`, `*:7879`, `172.29.0.0/16`.
/// Agent networks are IPv4, so the addresses are too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostAccess {
    /// The host addresses it opens (host bits cleared); `None` for `*`,
    /// every address of the host.
    pub addr: Option<Ipv4Net>,
    /// The TCP/UDP port; `None` for `*` or no port, every port.
    pub port: Option<u16>,
}

/// Why a `hostAccess` entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry:?} is not a host access entry: {why}; expected <address|cidr|*>[:<port|*>], such as \"10.0.0.1:53\", \"*:7879\" or \"172.29.0.0/16\"")]
pub struct HostAccessError {
    pub entry: String,
    pub why: &'static str,
}

impl std::str::FromStr for HostAccess {
    type Err = HostAccessError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why| HostAccessError {
            entry: s.to_owned(),
            why,
        };
        if s.contains('[') || s.matches(':').count() > 1 {
            return Err(bad("IPv6 is not supported (agent networks are IPv4)"));
        }
        let (addr, port) = match s.split_once(':') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr = match addr {
            "" => return Err(bad("the address is missing")),
            "*" => None,
            a if a.contains('/') => Some(
                a.parse::<Ipv4Net>()
                    .map_err(|_| bad("the address is not an IPv4 CIDR"))?
                    .trunc(),
            ),
            a => Some(Ipv4Net::from(
                a.parse::<Ipv4Addr>()
                    .map_err(|_| bad("the address is not an IPv4 address"))?,
            )),
        };
        let port = match port {
            None | Some("*") => None,
            Some("") => return Err(bad("the port after ':' is missing")),
            Some(p) => {
                if !p.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad("the port is not a number"));
                }
                match p.parse::<u16>() {
                    Ok(n) if n > 0 => Some(n),
                    _ => return Err(bad("the port must be between 1 and 65535")),
                }
            }
        };
        Ok(Self { addr, port })
    }
}

impl fmt::Display for HostAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            None => f.write_str("*")?,
            Some(net) if net.prefix_len() == 32 => write!(f, "{}", net.addr())?,
            Some(net) => write!(f, "{net}")?,
        }
        match self.port {
            Some(p) => write!(f, ":{p}"),
            None => Ok(()),
        }
    }
}

impl Serialize for HostAccess {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
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
    /// `autoProvisionHost`: `serve` provisions (or heals) this bridge at
    /// start-up, as `firecracker provision` does, instead of refusing to
    /// start without it.
    pub auto_provision_host: bool,
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
            auto_provision_host: true,
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
                ScalerType::BareMetal | ScalerType::Firecracker | ScalerType::Event => 5,
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
    /// In a fleet: most agents of this pool across every host serving it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet_max_agents: Option<u32>,
    /// In a fleet: CPU and memory of this pool across every host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet_resource_cap: Option<crate::ResourceCap>,
    /// Bare-metal scalers: the host user (and group) the agents run as;
    /// `None`: the daemon's own user. Names, resolved by the backend on
    /// this host when it starts and on reload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_user: Option<AgentUser>,
    /// `warmPool`: a schedule of warm pool sizes and/or a forecast; outside
    /// every period and without a forecast, upstream's `warmPool` applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_pool: Option<crate::WarmPolicy>,
}

/// `x-kici-scaler.user` / `.group` of a bare-metal scaler: who its agents
/// run as. Names as `getpwnam(3)` / `getgrnam(3)` take them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentUser {
    pub user: String,
    /// The primary group; `None`: the user's own (its passwd entry's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

impl ScalerExtension {
    pub fn defaults_for(kind: ScalerType) -> Self {
        Self {
            deadlines: Deadlines::defaults_for(kind),
            backoff: BackoffPolicy::default(),
            ulimits: BTreeMap::new(),
            fleet_max_agents: None,
            fleet_resource_cap: None,
            agent_user: None,
            warm_pool: None,
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

fn ser_opt_secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn platform_taints_are_the_non_default_parts() {
        let p = |os, arch| ScalerPlatform { os, arch }.taints();
        let s = |v: Vec<Label>| v.iter().map(|l| l.to_string()).collect::<Vec<_>>();
        assert!(p(PlatformOs::Linux, PlatformArch::X64).is_empty());
        assert_eq!(
            s(p(PlatformOs::Macos, PlatformArch::Arm64)),
            ["macos", "arm64"]
        );
        assert_eq!(s(p(PlatformOs::Windows, PlatformArch::X64)), ["windows"]);
        assert_eq!(s(p(PlatformOs::Linux, PlatformArch::Arm64)), ["arm64"]);
        assert_eq!(ScalerPlatform::DEFAULT.to_string(), "linux/x64");
    }

    #[test]
    fn host_access_entries() {
        let ok = |s: &str| s.parse::<HostAccess>().unwrap().to_string();
        assert_eq!(ok("*"), "*");
        assert_eq!(ok("*:53"), "*:53");
        assert_eq!(ok("*:*"), "*");
        assert_eq!(ok("10.0.0.1:53"), "10.0.0.1:53");
        assert_eq!(ok("10.0.0.1"), "10.0.0.1");
        assert_eq!(ok("172.29.1.2/16:7879"), "172.29.0.0/16:7879");
        let why = |s: &str| s.parse::<HostAccess>().unwrap_err().why;
        assert_eq!(why(""), "the address is missing");
        assert_eq!(why(":53"), "the address is missing");
        assert_eq!(why("host.local:53"), "the address is not an IPv4 address");
        assert_eq!(why("10.0.0.0/33"), "the address is not an IPv4 CIDR");
        assert_eq!(why("10.0.0.1:"), "the port after ':' is missing");
        assert_eq!(why("10.0.0.1:0"), "the port must be between 1 and 65535");
        assert_eq!(
            why("10.0.0.1:70000"),
            "the port must be between 1 and 65535"
        );
        assert_eq!(why("10.0.0.1:+53"), "the port is not a number");
        assert_eq!(
            why("[::1]:53"),
            "IPv6 is not supported (agent networks are IPv4)"
        );
        assert_eq!(
            why("::1"),
            "IPv6 is not supported (agent networks are IPv4)"
        );
        let e = "x".parse::<HostAccess>().unwrap_err().to_string();
        assert!(e.starts_with("\"x\" is not a host access entry: the address is not an IPv4 address; expected <address|cidr|*>[:<port|*>]"), "{e}");
    }
}
