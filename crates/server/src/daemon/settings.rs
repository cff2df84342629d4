//! The daemon's own settings (not `scalers.yaml`): where it listens, where
//! its state lives, engine timings, shutdown grace.
//!
//! Each setting comes from, in order of precedence: its `serve` flag, its
//! `KICI_SCALER_*` environment variable (clap reads both), the
//! `--daemon-config` file (TOML or YAML, by extension), the default here.
//! [`DaemonSettings`] is the resolved, validated result; nothing downstream
//! re-checks a value.
//!
//! The backend tuning knobs ([`BackendArgs`]: container ulimits, the
//! bare-metal pids cap and log retention) are shared with `kici-scaler run`,
//! which has flags and environment but no daemon-config file.

use crate::cli::log_format::AgentLogFormat;
use crate::daemon::serving::ConnectionLimits;
use clap::Args;
use kici_container::Ulimit;
use kici_engine::EngineSettings;
use serde::Deserialize;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

/// The control API's unix socket for root (systemd's `RuntimeDirectory`).
pub const SYSTEM_API_SOCKET: &str = "/run/kici-scaler/api.sock";
/// The socket's file name under `$XDG_RUNTIME_DIR/kici-scaler/` for other users.
const API_SOCKET_NAME: &str = "api.sock";
/// The shortest API token accepted: 32 bytes, so that a token is at least
/// as hard to guess as the 256-bit secrets the daemon mints itself.
pub const MIN_API_TOKEN_BYTES: usize = 32;
pub const DEFAULT_GATEWAY_LISTEN: &str = "127.0.0.1:7879";
/// Reconcile interval and age threshold: 120 s (see docs/operations.md).
const DEFAULT_RECONCILE_SECONDS: u64 = 120;
/// The Firecracker backend's own orphan sweep: upstream's 15 minutes.
const DEFAULT_FIRECRACKER_SWEEP_SECONDS: u64 = kici_firecracker::DEFAULT_SWEEP_INTERVAL.as_secs();
/// Longest reconcile or Firecracker sweep interval accepted: a day
/// (anything longer is a typo, and a huge one would overflow the timer).
const MAX_INTERVAL_SECONDS: u64 = 24 * 60 * 60;
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(60);
pub const DEFAULT_EVENT_REPLAY: usize = 10_000;
/// The environment variable holding the control API's bearer token.
pub const API_TOKEN_ENV: &str = "KICI_SCALER_API_TOKEN";

/// Where the control API (or a client) listens / connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    /// `unix:/path`.
    Unix(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    #[error("{0:?} is not an address: expected IP:PORT (e.g. 127.0.0.1:7878, [::1]:7878, localhost:7878) or unix:/path")]
    Invalid(String),
    #[error("unix:{0:?}: a unix socket path must not be empty")]
    EmptyUnixPath(String),
}

impl FromStr for ListenAddr {
    type Err = AddrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(AddrError::EmptyUnixPath(path.to_owned()));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        parse_socket_addr(s).map(Self::Tcp)
    }
}

/// `IP:PORT`, or `localhost:PORT` (loopback; no resolver involved).
pub fn parse_socket_addr(s: &str) -> Result<SocketAddr, AddrError> {
    if let Some(port) = s.strip_prefix("localhost:") {
        let port: u16 = port.parse().map_err(|_| AddrError::Invalid(s.to_owned()))?;
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    s.parse().map_err(|_| AddrError::Invalid(s.to_owned()))
}

impl ListenAddr {
    /// A TCP bind reachable from other hosts.
    pub fn is_remote(&self) -> bool {
        match self {
            Self::Tcp(addr) => !addr.ip().is_loopback(),
            Self::Unix(_) => false,
        }
    }

    /// Any TCP bind, loopback included, requires a bearer token: every local
    /// user can reach a loopback port, and the API runs jobs as the agents'
    /// user. Only the unix socket (mode 0600, the daemon's user) is served
    /// without one.
    pub fn needs_token(&self) -> bool {
        matches!(self, Self::Tcp(_))
    }
}

/// Where the control API listens when `--listen` is not given, and where the
/// client commands look for it: `/run/kici-scaler/api.sock` for root,
/// `$XDG_RUNTIME_DIR/kici-scaler/api.sock` for other users (the per-user
/// runtime dir only its owner can write), else the system path (which a
/// non-root `serve` then cannot create, and says so).
pub fn default_api_socket() -> PathBuf {
    if !rustix::process::geteuid().is_root() {
        if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
            if dir.is_absolute() {
                return dir.join("kici-scaler").join(API_SOCKET_NAME);
            }
        }
    }
    PathBuf::from(SYSTEM_API_SOCKET)
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(addr) => write!(f, "{addr}"),
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// The durable-state store URL: `sqlite:PATH` or `postgres://…`.
pub use kici_store::StoreUrl;

/// `kici-scaler serve` flags. Every daemon setting is `Option` here so that a
/// missing flag (and variable) falls through to the daemon-config file.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// The main configuration file (scalers.yaml).
    #[arg(long, value_name = "FILE", env = "KICI_SCALER_CONFIG_PATH")]
    pub config: Option<PathBuf>,
    /// Drop-in directory (*.yaml / *.yml merged after the main file).
    #[arg(long, value_name = "DIR", env = "KICI_SCALER_CONFIG_DIR")]
    pub config_dir: Option<PathBuf>,
    /// The daemon's own settings, TOML (.toml) or YAML (.yaml/.yml); keys are
    /// the long flag names (e.g. `listen`, `pending-ttl-seconds`).
    #[arg(long, value_name = "FILE", env = "KICI_SCALER_DAEMON_CONFIG")]
    pub daemon_config: Option<PathBuf>,
    /// Control API address: unix:/path or IP:PORT [default: unix:/run/kici-scaler/api.sock
    /// for root, unix:$XDG_RUNTIME_DIR/kici-scaler/api.sock for other users].
    /// Any TCP address, loopback included, requires KICI_SCALER_API_TOKEN.
    #[arg(long, value_name = "ADDR", env = "KICI_SCALER_LISTEN")]
    pub listen: Option<String>,
    /// Agent gateway address (WebSocket /ws); agents of scalers without an
    /// orchestratorUrl connect here [default: 127.0.0.1:7879].
    #[arg(long, value_name = "ADDR", env = "KICI_SCALER_GATEWAY_LISTEN")]
    pub gateway_listen: Option<String>,
    /// Claim redemption listener (POST /v1/claims only, no API token), for
    /// the instances of type: event scalers: IP:PORT [default: none; event
    /// scalers need it].
    #[arg(long, value_name = "ADDR", env = "KICI_SCALER_CLAIMS_LISTEN")]
    pub claims_listen: Option<String>,
    // Also the --help text, where <…> is a placeholder, not an HTML tag.
    #[allow(rustdoc::invalid_html_tags)]
    /// The claimUrl scale-up events carry (how instances reach
    /// --claims-listen) [default: http://<claims-listen>/v1/claims].
    #[arg(long, value_name = "URL", env = "KICI_SCALER_CLAIMS_URL")]
    pub claims_url: Option<String>,
    /// State directory: instance id, machine-id copy, lock
    /// [default: /var/lib/kici-scaler].
    #[arg(long, value_name = "DIR", env = "KICI_SCALER_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    // Also the --help text, where <…> is a placeholder, not an HTML tag.
    #[allow(rustdoc::invalid_html_tags)]
    /// Durable state store URL: sqlite:PATH or postgres://USER@HOST/DB
    /// [default: sqlite:<state-dir>/state.db].
    #[arg(long, value_name = "URL", env = "KICI_SCALER_STATE")]
    pub state: Option<String>,
    /// PEM certificate chain: serve the control API over TLS (with --tls-key).
    #[arg(long, value_name = "FILE", env = "KICI_SCALER_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, value_name = "FILE", env = "KICI_SCALER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// How long a scale request waits for capacity before it expires
    /// [default: 3600].
    #[arg(long, value_name = "SECONDS", env = "KICI_SCALER_PENDING_TTL_SECONDS")]
    pub pending_ttl_seconds: Option<u64>,
    /// After this long in the queue, a request holds the capacity it needs
    /// [default: 300].
    #[arg(long, value_name = "SECONDS", env = "KICI_SCALER_STARVATION_SECONDS")]
    pub starvation_seconds: Option<u64>,
    /// Most pending scale requests kept [default: 10000].
    #[arg(long, value_name = "N", env = "KICI_SCALER_MAX_PENDING")]
    pub max_pending: Option<usize>,
    /// On SIGTERM/SIGINT, how long to wait for every agent to be destroyed
    /// [default: 60].
    #[arg(
        long,
        value_name = "SECONDS",
        env = "KICI_SCALER_SHUTDOWN_GRACE_SECONDS"
    )]
    pub shutdown_grace_seconds: Option<u64>,
    /// Machine-pool ledger directory (shared by every process on the host).
    #[arg(long, value_name = "DIR", env = "KICI_MACHINE_LEDGER_DIR")]
    pub machine_ledger_dir: Option<PathBuf>,
    /// Events kept for `GET /v1/events` resumption (Last-Event-ID)
    /// [default: 10000].
    #[arg(long, value_name = "N", env = "KICI_SCALER_EVENT_REPLAY")]
    pub event_replay: Option<usize>,
    /// How often the reconciler compares the store with the host (1 to
    /// 86400) [default: 120].
    #[arg(
        long,
        value_name = "SECONDS",
        env = "KICI_SCALER_RECONCILE_INTERVAL_SECONDS"
    )]
    pub reconcile_interval_seconds: Option<u64>,
    /// Unowned resources younger than this are never reaped (they may
    /// belong to a spawn in flight) [default: 120].
    #[arg(
        long,
        value_name = "SECONDS",
        env = "KICI_SCALER_RECONCILE_AGE_SECONDS"
    )]
    pub reconcile_age_seconds: Option<u64>,
    /// How often the Firecracker backend sweeps this instance's orphaned
    /// VM directories, TAPs, IP leases and egress rules (1 to 86400)
    /// [default: 900].
    #[arg(
        long,
        value_name = "SECONDS",
        env = "KICI_SCALER_FIRECRACKER_SWEEP_INTERVAL_SECONDS"
    )]
    pub firecracker_sweep_interval_seconds: Option<u64>,
    /// A connection must send a complete request head within this; it is
    /// also how long an idle keep-alive connection stays open (1 to 3600)
    /// [default: 10].
    #[arg(
        long,
        value_name = "SECONDS",
        env = "KICI_SCALER_HTTP_HEADER_TIMEOUT_SECONDS"
    )]
    pub http_header_timeout_seconds: Option<u64>,
    /// A request body must arrive in full within this, or the request is
    /// answered 408 (1 to 3600) [default: 30].
    #[arg(
        long,
        value_name = "SECONDS",
        env = "KICI_SCALER_HTTP_BODY_TIMEOUT_SECONDS"
    )]
    pub http_body_timeout_seconds: Option<u64>,
    /// Most connections the control API serves at once; more wait until
    /// one ends (lowered to a quarter of the open-file limit)
    /// [default: 1024].
    #[arg(long, value_name = "N", env = "KICI_SCALER_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Most connections each agent gateway listener serves at once (one per
    /// agent); more wait until one ends (lowered to a quarter of the
    /// open-file limit) [default: 4096].
    #[arg(long, value_name = "N", env = "KICI_SCALER_GATEWAY_MAX_CONNECTIONS")]
    pub gateway_max_connections: Option<usize>,
    /// With a PostgreSQL --state: every connection this host holds to the
    /// database, its session (identity lock, fleet leadership and LISTEN)
    /// included; at least 2. Hosts × this must fit the server's
    /// max_connections (see docs/fleet.md) [default: 4].
    #[arg(long, value_name = "N", env = "KICI_SCALER_DATABASE_CONNECTIONS")]
    pub database_connections: Option<u32>,
    /// How forwarded agent output is logged: wrapped (the agent's line as
    /// the string field `line` of the daemon's own event) or upstream
    /// (KiCI's shape: a JSON line's own fields at the top level, with
    /// service, agentId, scaler, jobId, logsSource and stream set by the
    /// daemon over the agent's) [default: wrapped].
    #[arg(
        long,
        value_name = "FORMAT",
        env = "KICI_SCALER_AGENT_LOG_FORMAT",
        value_enum
    )]
    pub agent_log_format: Option<AgentLogFormat>,
    /// Mint a new instance id when the state dir belongs to another machine
    /// or its identity is unreadable.
    #[arg(long)]
    pub reset_identity: bool,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub fleet: crate::fleet::settings::FleetArgs,
    /// Test builds only: an in-memory backend for every scaler type.
    #[cfg(feature = "memory-backends")]
    #[arg(long, hide = true)]
    pub memory_backends: bool,
}

/// The `--daemon-config` file: the long flag names as keys.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DaemonFile {
    pub config: Option<PathBuf>,
    pub config_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub gateway_listen: Option<String>,
    pub claims_listen: Option<String>,
    pub claims_url: Option<String>,
    pub state_dir: Option<PathBuf>,
    pub state: Option<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub pending_ttl_seconds: Option<u64>,
    pub starvation_seconds: Option<u64>,
    pub max_pending: Option<usize>,
    pub shutdown_grace_seconds: Option<u64>,
    pub machine_ledger_dir: Option<PathBuf>,
    pub event_replay: Option<usize>,
    pub reconcile_interval_seconds: Option<u64>,
    pub reconcile_age_seconds: Option<u64>,
    pub firecracker_sweep_interval_seconds: Option<u64>,
    pub http_header_timeout_seconds: Option<u64>,
    pub http_body_timeout_seconds: Option<u64>,
    pub max_connections: Option<usize>,
    pub gateway_max_connections: Option<usize>,
    pub database_connections: Option<u32>,
    pub agent_log_format: Option<AgentLogFormat>,
    pub container_ulimits: Option<Vec<String>>,
    pub bare_metal_pids_max: Option<NumberOrWord>,
    pub bare_metal_log_keep_bytes: Option<NumberOrWord>,
    pub bare_metal_work_dir: Option<PathBuf>,
    pub container_network: Option<String>,
    pub container_subnet: Option<String>,
    pub container_bridge: Option<String>,
    pub cgroup_root: Option<PathBuf>,
    pub fleet: Option<String>,
    pub no_fleet: Option<bool>,
    pub advertise_url: Option<String>,
    pub fleet_key_file: Option<PathBuf>,
    pub fleet_ca_cert: Option<PathBuf>,
    pub fleet_lease_seconds: Option<u64>,
    pub fleet_placement: Option<String>,
    pub fleet_max_agents: Option<u32>,
    pub fleet_max_cpu: Option<f64>,
    pub fleet_max_memory: Option<String>,
}

impl DaemonFile {
    fn fleet_file(&self) -> crate::fleet::settings::FleetFile {
        crate::fleet::settings::FleetFile {
            fleet: self.fleet.clone(),
            no_fleet: self.no_fleet,
            advertise_url: self.advertise_url.clone(),
            fleet_key_file: self.fleet_key_file.clone(),
            fleet_ca_cert: self.fleet_ca_cert.clone(),
            fleet_lease_seconds: self.fleet_lease_seconds,
            fleet_placement: self.fleet_placement.clone(),
            fleet_max_agents: self.fleet_max_agents,
            fleet_max_cpu: self.fleet_max_cpu,
            fleet_max_memory: self.fleet_max_memory.clone(),
        }
    }
}

/// A daemon-config value written as a number or a word (`4096`, `"max"`,
/// `"16m"`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum NumberOrWord {
    Number(u64),
    Word(String),
}

impl fmt::Display for NumberOrWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Word(w) => f.write_str(w),
        }
    }
}

/// A cap that may be lifted: a positive number, or `max` for none (the
/// word cgroups use for `pids.max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Max,
    At(NonZeroU64),
}

impl Limit {
    /// `None` for no limit.
    pub fn get(self) -> Option<NonZeroU64> {
        match self {
            Self::Max => None,
            Self::At(n) => Some(n),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected a positive number, a size like 16m, or max (no limit)")]
pub struct LimitError(String);

impl FromStr for Limit {
    type Err = LimitError;
    /// `max`; a plain number; or a size with a `k`/`m`/`g` unit (binary,
    /// as memory sizes in the configuration).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || LimitError(s.to_owned());
        let s = s.trim();
        if s.eq_ignore_ascii_case("max") {
            return Ok(Self::Max);
        }
        let n = if s.bytes().all(|b| b.is_ascii_digit()) {
            s.parse::<u64>().map_err(|_| bad())?
        } else {
            s.parse::<kici_model::MemoryBytes>()
                .map_err(|_| bad())?
                .bytes()
        };
        NonZeroU64::new(n).map(Self::At).ok_or_else(bad)
    }
}

/// Backend tuning flags, shared by `serve` and `run`.
#[derive(Debug, Clone, Default, Args)]
pub struct BackendArgs {
    /// A ulimit of every agent container, NAME=SOFT:HARD (repeatable, or
    /// comma-separated in the variable). Podman on hosts where root cannot
    /// raise hard limits needs nofile=20000:20000,nproc=4096:4096
    /// [default: none, the runtime's own].
    #[arg(
        long = "container-ulimit",
        value_name = "NAME=SOFT:HARD",
        env = "KICI_SCALER_CONTAINER_ULIMITS",
        value_delimiter = ','
    )]
    pub container_ulimits: Option<Vec<Ulimit>>,
    /// pids.max of every bare-metal agent's cgroup (a fork-bomb guard), or
    /// max for none [default: max].
    #[arg(long, value_name = "N|max", env = "KICI_SCALER_BARE_METAL_PIDS_MAX")]
    pub bare_metal_pids_max: Option<Limit>,
    /// How much of each bare-metal agent's log file stays on disk while it
    /// runs (bytes, or a size like 16m), or max to keep it all
    /// [default: 16m].
    #[arg(
        long,
        value_name = "SIZE|max",
        env = "KICI_SCALER_BARE_METAL_LOG_KEEP_BYTES"
    )]
    pub bare_metal_log_keep_bytes: Option<Limit>,
    // Also the --help text, where <…> is a placeholder, not an HTML tag.
    #[allow(rustdoc::invalid_html_tags)]
    /// Where bare-metal agents' working directories go (as
    /// DIR/<instance>/<agent>, each owned by the agent's user, mode 0700);
    /// outside the state dir, which agents must not enter
    /// [default: <state-dir>-work].
    #[arg(long, value_name = "DIR", env = "KICI_SCALER_BARE_METAL_WORK_DIR")]
    pub bare_metal_work_dir: Option<PathBuf>,
    /// The Docker/Podman network agent containers join (created when
    /// missing, checked when present) [default: kici-scaler-net].
    #[arg(long, value_name = "NAME", env = "KICI_SCALER_CONTAINER_NETWORK")]
    pub container_network: Option<String>,
    /// Its IPv4 subnet, /29 or larger; the first address is the gateway
    /// [default: 172.29.0.0/16].
    #[arg(long, value_name = "CIDR", env = "KICI_SCALER_CONTAINER_SUBNET")]
    pub container_subnet: Option<kici_store::Ipv4Pool>,
    /// Its host-side bridge interface, which the egress rules match on
    /// (at most 15 bytes) [default: kici-scaler0].
    #[arg(long, value_name = "IFNAME", env = "KICI_SCALER_CONTAINER_BRIDGE")]
    pub container_bridge: Option<String>,
    // Also the --help text, where <…> is a placeholder, not an HTML tag.
    #[allow(rustdoc::invalid_html_tags)]
    /// The cgroup v2 directory bare-metal agents' cgroups go under (as
    /// PATH/kici-scaler/<instance>/…), instead of where discovery puts them
    /// (the daemon's own delegated cgroup under systemd, else the v2 mount).
    #[arg(long, value_name = "PATH", env = "KICI_SCALER_CGROUP_ROOT")]
    pub cgroup_root: Option<PathBuf>,
}

/// The backends' tuning, resolved ([`BackendArgs`] over the daemon-config
/// file over the defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendTuning {
    /// `HostConfig.Ulimits` of every agent container.
    pub container_ulimits: Vec<Ulimit>,
    /// `pids.max` of every bare-metal agent; `None`: no limit.
    pub bare_metal_pids_max: Option<NonZeroU64>,
    /// Disk kept of each bare-metal agent log; `None`: all of it.
    pub bare_metal_log_keep_bytes: Option<NonZeroU64>,
    /// Bare-metal agents' work root; `None`: beside the state dir
    /// ([`kici_bare_metal::BareMetalOptions::default_work_root`]).
    pub bare_metal_work_dir: Option<PathBuf>,
    /// The agent containers' network.
    pub container_network: kici_container::NetworkSettings,
    /// Between two sweeps of the Firecracker backend's own orphans.
    pub firecracker_sweep_interval: Duration,
    /// The reconcile age threshold: the Firecracker sweep spares anything
    /// of an agent younger than this too.
    pub orphan_min_age: Duration,
    /// `--cgroup-root`: where bare-metal cgroups go; `None`: discovered.
    pub cgroup_root: Option<PathBuf>,
}

impl Default for BackendTuning {
    fn default() -> Self {
        Self {
            container_ulimits: Vec::new(),
            bare_metal_pids_max: None,
            bare_metal_log_keep_bytes: NonZeroU64::new(
                kici_bare_metal::BareMetalOptions::DEFAULT_LOG_KEEP_BYTES,
            ),
            bare_metal_work_dir: None,
            container_network: kici_container::NetworkSettings::default(),
            firecracker_sweep_interval: kici_firecracker::DEFAULT_SWEEP_INTERVAL,
            orphan_min_age: Duration::from_secs(DEFAULT_RECONCILE_SECONDS),
            cgroup_root: None,
        }
    }
}

impl BackendArgs {
    /// Flags/env over `file` over the defaults; every problem of the file's
    /// values in `errors` (clap has checked the flags already).
    pub fn resolve(&self, file: &DaemonFile, errors: &mut Vec<String>) -> BackendTuning {
        let defaults = BackendTuning::default();
        let container_ulimits = match (&self.container_ulimits, &file.container_ulimits) {
            (Some(flags), _) => flags.clone(),
            (None, Some(raw)) => raw
                .iter()
                .filter_map(|u| {
                    u.parse::<Ulimit>()
                        .map_err(|e| errors.push(format!("container-ulimits: {e}")))
                        .ok()
                })
                .collect(),
            (None, None) => defaults.container_ulimits,
        };
        let mut limit = |name: &str, flag: Option<Limit>, raw: &Option<NumberOrWord>| {
            flag.or_else(|| {
                raw.as_ref().and_then(|v| {
                    v.to_string()
                        .parse::<Limit>()
                        .map_err(|e| errors.push(format!("{name}: {e}")))
                        .ok()
                })
            })
        };
        let pids = limit(
            "bare-metal-pids-max",
            self.bare_metal_pids_max,
            &file.bare_metal_pids_max,
        );
        let log_keep = limit(
            "bare-metal-log-keep-bytes",
            self.bare_metal_log_keep_bytes,
            &file.bare_metal_log_keep_bytes,
        );
        let mut container_network = defaults.container_network.clone();
        if let Some(name) = self
            .container_network
            .clone()
            .or_else(|| file.container_network.clone())
        {
            if name.is_empty() {
                errors.push("container-network must not be empty".to_owned());
            }
            container_network.name = name;
        }
        match (&self.container_subnet, &file.container_subnet) {
            (Some(pool), _) => container_network.pool = *pool,
            (None, Some(raw)) => match raw.parse::<kici_store::Ipv4Pool>() {
                Ok(pool) => container_network.pool = pool,
                Err(e) => errors.push(format!("container-subnet: {raw:?}: {e}")),
            },
            (None, None) => {}
        }
        if let Some(bridge) = self
            .container_bridge
            .clone()
            .or_else(|| file.container_bridge.clone())
        {
            let valid = !bridge.is_empty()
                && bridge.len() <= 15
                && !bridge
                    .bytes()
                    .any(|b| b == b'/' || b == b'*' || b.is_ascii_whitespace() || b == 0);
            if !valid {
                errors.push(format!(
                    "container-bridge: {bridge:?}: an interface name of 1 to 15 bytes without '/', '*' or spaces"
                ));
            }
            container_network.bridge = bridge;
        }
        BackendTuning {
            container_network,
            container_ulimits,
            bare_metal_pids_max: pids.map_or(defaults.bare_metal_pids_max, Limit::get),
            bare_metal_log_keep_bytes: log_keep
                .map_or(defaults.bare_metal_log_keep_bytes, Limit::get),
            cgroup_root: self
                .cgroup_root
                .clone()
                .or_else(|| file.cgroup_root.clone()),
            bare_metal_work_dir: self
                .bare_metal_work_dir
                .clone()
                .or_else(|| file.bare_metal_work_dir.clone()),
            ..defaults
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("cannot read the daemon config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: the daemon config must end in .toml, .yaml or .yml")]
    UnknownFormat { path: PathBuf },
    #[error("{0}")]
    Invalid(String),
}

impl DaemonFile {
    pub fn load(path: &Path) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path).map_err(|source| SettingsError::Read {
            path: path.to_owned(),
            source,
        })?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let parse_err = |message: String| SettingsError::Parse {
            path: path.to_owned(),
            message,
        };
        match ext {
            "toml" => toml::from_str(&text).map_err(|e| parse_err(e.to_string())),
            "yaml" | "yml" => {
                // An empty YAML file is an empty mapping, not an error.
                if text.trim().is_empty() {
                    return Ok(Self::default());
                }
                serde_norway::from_str(&text).map_err(|e| parse_err(e.to_string()))
            }
            _ => Err(SettingsError::UnknownFormat {
                path: path.to_owned(),
            }),
        }
    }
}

/// TLS certificate and key files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Every daemon setting, resolved and validated.
#[derive(Debug, Clone)]
pub struct DaemonSettings {
    pub config: PathBuf,
    pub config_dir: Option<PathBuf>,
    pub listen: ListenAddr,
    pub gateway_listen: SocketAddr,
    /// Where claim codes are redeemed, and the URL events name for it.
    pub claims: Option<ClaimsListen>,
    pub state_dir: PathBuf,
    pub state: StoreUrl,
    pub tls: Option<TlsFiles>,
    pub engine: EngineSettings,
    pub shutdown_grace: Duration,
    pub machine_ledger_dir: Option<PathBuf>,
    pub event_replay: usize,
    pub reset_identity: bool,
    /// Between reconcile passes.
    pub reconcile_every: Duration,
    /// Reconcile age threshold: unowned resources younger than this are spared.
    pub reconcile_age: Duration,
    /// Container ulimits, bare-metal pids and log caps.
    pub backends: BackendTuning,
    /// The control API's connection bounds.
    pub api_limits: ConnectionLimits,
    /// Each agent gateway listener's connection bounds.
    pub gateway_limits: ConnectionLimits,
    /// PostgreSQL state only: every connection the host holds, its session
    /// included.
    pub database_connections: u32,
    /// The fleet this host joins (PostgreSQL state only).
    pub fleet: Option<crate::fleet::settings::FleetSettings>,
    /// The shape of forwarded agent output in the log.
    pub agent_log_format: AgentLogFormat,
}

impl DaemonSettings {
    /// Flags/env (`args`) over the file over the defaults. Every problem is
    /// reported, one per line.
    pub fn resolve(args: &ServeArgs, file: Option<&DaemonFile>) -> Result<Self, SettingsError> {
        let empty = DaemonFile::default();
        let file = file.unwrap_or(&empty);
        let mut errors = Vec::new();

        let config = args.config.clone().or_else(|| file.config.clone());
        if config.is_none() {
            errors.push("--config is required (or KICI_SCALER_CONFIG_PATH, or `config` in the daemon config)".to_owned());
        }
        let listen = match args.listen.as_ref().or(file.listen.as_ref()) {
            Some(raw) => raw
                .parse::<ListenAddr>()
                .map_err(|e| errors.push(format!("listen: {e}")))
                .ok(),
            None => Some(ListenAddr::Unix(default_api_socket())),
        };
        let gateway_raw = pick(
            &args.gateway_listen,
            &file.gateway_listen,
            DEFAULT_GATEWAY_LISTEN.to_owned(),
        );
        let gateway_listen = parse_socket_addr(&gateway_raw)
            .map_err(|e| errors.push(format!("gateway-listen: {e}")))
            .ok();
        let claims = resolve_claims(args, file, &mut errors);
        let state_dir = pick(
            &args.state_dir,
            &file.state_dir,
            PathBuf::from(crate::daemon::identity::DEFAULT_STATE_DIR),
        );
        let state = match args.state.as_ref().or(file.state.as_ref()) {
            Some(raw) => raw
                .parse::<StoreUrl>()
                .map_err(|e| errors.push(format!("state: {e}")))
                .ok(),
            None => Some(StoreUrl::Sqlite(state_dir.join("state.db"))),
        };
        let tls = match (
            args.tls_cert.clone().or_else(|| file.tls_cert.clone()),
            args.tls_key.clone().or_else(|| file.tls_key.clone()),
        ) {
            (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
            (None, None) => None,
            _ => {
                errors.push("tls-cert and tls-key must be given together".to_owned());
                None
            }
        };
        if tls.is_some() && matches!(listen, Some(ListenAddr::Unix(_))) {
            errors
                .push("TLS is for TCP listeners; a unix socket is served in plain HTTP".to_owned());
        }

        let defaults = EngineSettings::default();
        let mut positive = |name: &str, v: Option<u64>, default: Duration| match v {
            None => default,
            Some(0) => {
                errors.push(format!("{name} must be at least 1"));
                default
            }
            Some(s) => Duration::from_secs(s),
        };
        let pending_ttl = positive(
            "pending-ttl-seconds",
            args.pending_ttl_seconds.or(file.pending_ttl_seconds),
            defaults.pending_ttl,
        );
        let starvation = positive(
            "starvation-seconds",
            args.starvation_seconds.or(file.starvation_seconds),
            defaults.starvation,
        );
        let max_pending = pick(&args.max_pending, &file.max_pending, defaults.max_pending);
        if max_pending == 0 {
            errors.push("max-pending must be at least 1".to_owned());
        }
        let event_replay = pick(&args.event_replay, &file.event_replay, DEFAULT_EVENT_REPLAY);
        if event_replay == 0 {
            errors.push("event-replay must be at least 1".to_owned());
        }
        let shutdown_grace = args
            .shutdown_grace_seconds
            .or(file.shutdown_grace_seconds)
            .map_or(DEFAULT_SHUTDOWN_GRACE, Duration::from_secs);

        let reconcile_every = pick(
            &args.reconcile_interval_seconds,
            &file.reconcile_interval_seconds,
            DEFAULT_RECONCILE_SECONDS,
        );
        check_interval("reconcile-interval-seconds", reconcile_every, &mut errors);
        let reconcile_age = pick(
            &args.reconcile_age_seconds,
            &file.reconcile_age_seconds,
            DEFAULT_RECONCILE_SECONDS,
        );
        let firecracker_sweep = pick(
            &args.firecracker_sweep_interval_seconds,
            &file.firecracker_sweep_interval_seconds,
            DEFAULT_FIRECRACKER_SWEEP_SECONDS,
        );
        check_interval(
            "firecracker-sweep-interval-seconds",
            firecracker_sweep,
            &mut errors,
        );
        let header_timeout = pick(
            &args.http_header_timeout_seconds,
            &file.http_header_timeout_seconds,
            ConnectionLimits::DEFAULT_HEADER_TIMEOUT.as_secs(),
        );
        check_timeout("http-header-timeout-seconds", header_timeout, &mut errors);
        let body_timeout = pick(
            &args.http_body_timeout_seconds,
            &file.http_body_timeout_seconds,
            ConnectionLimits::DEFAULT_BODY_TIMEOUT.as_secs(),
        );
        check_timeout("http-body-timeout-seconds", body_timeout, &mut errors);
        let max_connections = pick(
            &args.max_connections,
            &file.max_connections,
            ConnectionLimits::DEFAULT_API_CONNECTIONS,
        );
        let gateway_max_connections = pick(
            &args.gateway_max_connections,
            &file.gateway_max_connections,
            ConnectionLimits::DEFAULT_GATEWAY_CONNECTIONS,
        );
        for (field, n) in [
            ("max-connections", max_connections),
            ("gateway-max-connections", gateway_max_connections),
        ] {
            if n == 0 {
                errors.push(format!("{field} must be at least 1"));
            }
        }
        let api_limits = ConnectionLimits {
            max_connections,
            header_timeout: Duration::from_secs(header_timeout),
            body_timeout: Duration::from_secs(body_timeout),
        };
        let gateway_limits = ConnectionLimits {
            max_connections: gateway_max_connections,
            ..api_limits
        };
        let database_connections = pick(
            &args.database_connections,
            &file.database_connections,
            DEFAULT_DATABASE_CONNECTIONS,
        );
        if !(MIN_DATABASE_CONNECTIONS..=MAX_DATABASE_CONNECTIONS).contains(&database_connections) {
            errors.push(format!(
                "database-connections: {database_connections} is out of range; expected {MIN_DATABASE_CONNECTIONS} to {MAX_DATABASE_CONNECTIONS} (one is the host's session, the rest serve queries)"
            ));
        } else if (args.database_connections.is_some() || file.database_connections.is_some())
            && !matches!(state, Some(StoreUrl::Postgres(_)))
        {
            errors.push(
                "database-connections applies to a PostgreSQL --state only (SQLite is a file, not a server)"
                    .to_owned(),
            );
        }
        let mut backends = args.backend.resolve(file, &mut errors);
        backends.firecracker_sweep_interval = Duration::from_secs(firecracker_sweep);
        backends.orphan_min_age = Duration::from_secs(reconcile_age);
        let listen_text = listen.as_ref().map(ListenAddr::to_string);
        let fleet = args.fleet.resolve(
            &file.fleet_file(),
            matches!(state, Some(StoreUrl::Postgres(_))),
            listen_text.as_deref(),
            &mut errors,
        );

        match (config, listen, gateway_listen, state) {
            (Some(config), Some(listen), Some(gateway_listen), Some(state))
                if errors.is_empty() =>
            {
                Ok(Self {
                    config,
                    config_dir: args.config_dir.clone().or_else(|| file.config_dir.clone()),
                    listen,
                    gateway_listen,
                    claims,
                    state_dir,
                    state,
                    tls,
                    engine: EngineSettings {
                        pending_ttl,
                        starvation,
                        max_pending,
                        // In a fleet its queue re-queues a failed spawn's
                        // request, under the fleet's caps.
                        requeue_unstarted: fleet.is_none(),
                        ..defaults
                    },
                    shutdown_grace,
                    machine_ledger_dir: args
                        .machine_ledger_dir
                        .clone()
                        .or_else(|| file.machine_ledger_dir.clone()),
                    event_replay,
                    reset_identity: args.reset_identity,
                    reconcile_every: Duration::from_secs(reconcile_every),
                    reconcile_age: Duration::from_secs(reconcile_age),
                    backends,
                    api_limits,
                    gateway_limits,
                    database_connections,
                    fleet,
                    agent_log_format: pick(
                        &args.agent_log_format,
                        &file.agent_log_format,
                        AgentLogFormat::default(),
                    ),
                })
            }
            _ => Err(SettingsError::Invalid(errors.join("\n"))),
        }
    }
}

/// `--claims-listen` and the URL instances reach it at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimsListen {
    pub addr: SocketAddr,
    /// `http(s)://…/v1/claims`, as scale-up events carry it.
    pub url: String,
}

fn resolve_claims(
    args: &ServeArgs,
    file: &DaemonFile,
    errors: &mut Vec<String>,
) -> Option<ClaimsListen> {
    let raw = args
        .claims_listen
        .clone()
        .or_else(|| file.claims_listen.clone());
    let url = args.claims_url.clone().or_else(|| file.claims_url.clone());
    let Some(raw) = raw else {
        if url.is_some() {
            errors.push("claims-url: needs --claims-listen (the listener it points at)".to_owned());
        }
        return None;
    };
    let addr = match parse_socket_addr(&raw) {
        Ok(a) => a,
        Err(e) => {
            errors.push(format!("claims-listen: {e}"));
            return None;
        }
    };
    let url = match url {
        Some(u) if u.starts_with("http://") || u.starts_with("https://") => u,
        Some(u) => {
            errors.push(format!(
                "claims-url: expected an http:// or https:// URL, got {u:?}"
            ));
            return None;
        }
        None if addr.ip().is_unspecified() => {
            errors.push(format!(
                "claims-listen: {addr} is not an address instances can be told; set --claims-url to the URL they reach it at"
            ));
            return None;
        }
        None => format!("http://{addr}/v1/claims"),
    };
    Some(ClaimsListen { addr, url })
}

fn pick<T: Clone>(flag: &Option<T>, file: &Option<T>, default: T) -> T {
    flag.clone().or_else(|| file.clone()).unwrap_or(default)
}

/// A connection deadline: 1 s to an hour. Zero would close every
/// connection at once; a client that needs more than an hour to send a
/// request head or body is a stalled one.
fn check_timeout(field: &str, seconds: u64, errors: &mut Vec<String>) {
    if seconds == 0 {
        errors.push(format!("{field} must be at least 1"));
    } else if seconds > MAX_TIMEOUT_SECONDS {
        errors.push(format!(
            "{field}: {seconds} is more than an hour; at most {MAX_TIMEOUT_SECONDS}"
        ));
    }
}

const MAX_TIMEOUT_SECONDS: u64 = 3600;

/// A PostgreSQL host's connections: the session and three for queries.
pub const DEFAULT_DATABASE_CONNECTIONS: u32 = 4;
/// The session and one for queries.
const MIN_DATABASE_CONNECTIONS: u32 = 2;
/// Far above what a host can use, far below a server's limit.
const MAX_DATABASE_CONNECTIONS: u32 = 100;

/// A periodic task's interval: 1 s to a day. Zero would spin; a timer
/// further out than the clock can count would panic when armed, and a
/// sweep less than daily is not one.
fn check_interval(field: &str, seconds: u64, errors: &mut Vec<String>) {
    if seconds == 0 {
        errors.push(format!("{field} must be at least 1"));
    } else if seconds > MAX_INTERVAL_SECONDS {
        errors.push(format!(
            "{field}: {seconds} is more than a day; at most {MAX_INTERVAL_SECONDS}"
        ));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn args() -> ServeArgs {
        ServeArgs {
            config: Some("scalers.yaml".into()),
            ..ServeArgs::default()
        }
    }

    #[test]
    fn defaults_apply_when_nothing_is_given() {
        let s = DaemonSettings::resolve(&args(), None).unwrap();
        // The tests run as root: the system socket.
        assert_eq!(s.listen, ListenAddr::Unix(SYSTEM_API_SOCKET.into()));
        assert!(!s.listen.needs_token());
        assert_eq!(s.gateway_listen, "127.0.0.1:7879".parse().unwrap());
        assert_eq!(s.state_dir, PathBuf::from("/var/lib/kici-scaler"));
        assert_eq!(
            s.state,
            StoreUrl::Sqlite("/var/lib/kici-scaler/state.db".into())
        );
        assert_eq!(s.engine.pending_ttl, Duration::from_secs(3600));
        assert_eq!(s.engine.starvation, Duration::from_secs(300));
        assert_eq!(s.shutdown_grace, DEFAULT_SHUTDOWN_GRACE);
        assert_eq!(s.event_replay, 10_000);
        assert!(s.tls.is_none());
    }

    #[test]
    fn flags_beat_the_file_which_beats_the_defaults() {
        let file: DaemonFile = toml::from_str(
            "listen = \"unix:/run/k.sock\"\npending-ttl-seconds = 60\nmax-pending = 5\nstate-dir = \"/srv/k\"\n",
        )
        .unwrap();
        let mut a = args();
        a.pending_ttl_seconds = Some(30);
        let s = DaemonSettings::resolve(&a, Some(&file)).unwrap();
        assert_eq!(s.listen, ListenAddr::Unix("/run/k.sock".into()));
        assert_eq!(s.engine.pending_ttl, Duration::from_secs(30));
        assert_eq!(s.engine.max_pending, 5);
        assert_eq!(s.state, StoreUrl::Sqlite("/srv/k/state.db".into()));
    }

    #[test]
    fn the_fleet_key_file_and_ca_come_from_the_daemon_config_and_flags_beat_it() {
        let file: DaemonFile = toml::from_str(
            "state = \"postgres://k@db/k\"\nfleet-key-file = \"/etc/k/fleet.key\"\nfleet-ca-cert = \"/etc/k/ca.pem\"\n",
        )
        .unwrap();
        let s = DaemonSettings::resolve(&args(), Some(&file)).unwrap();
        let fleet = s.fleet.unwrap();
        assert_eq!(fleet.key_file, Some(PathBuf::from("/etc/k/fleet.key")));
        assert_eq!(fleet.ca_cert, Some(PathBuf::from("/etc/k/ca.pem")));
        let mut a = args();
        a.fleet.fleet_key_file = Some("/run/k.key".into());
        let s = DaemonSettings::resolve(&a, Some(&file)).unwrap();
        assert_eq!(s.fleet.unwrap().key_file, Some(PathBuf::from("/run/k.key")));
        // With SQLite there is no fleet: the settings are refused by name.
        let alone: DaemonFile = toml::from_str("fleet-key-file = \"/etc/k/fleet.key\"\n").unwrap();
        let e = DaemonSettings::resolve(&args(), Some(&alone)).unwrap_err();
        assert!(
            e.to_string()
                .contains("fleet-key-file: a fleet needs a PostgreSQL"),
            "{e}"
        );
    }

    #[test]
    fn yaml_and_toml_files_carry_the_same_keys() {
        let y: DaemonFile =
            serde_norway::from_str("listen: 0.0.0.0:9000\nshutdown-grace-seconds: 5\n").unwrap();
        let t: DaemonFile =
            toml::from_str("listen = \"0.0.0.0:9000\"\nshutdown-grace-seconds = 5\n").unwrap();
        assert_eq!(y, t);
        assert!(toml::from_str::<DaemonFile>("lisen = \"x\"\n").is_err());
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let a = ServeArgs {
            listen: Some("nowhere".into()),
            state: Some("mysql://db".into()),
            tls_cert: Some("c.pem".into()),
            pending_ttl_seconds: Some(0),
            ..ServeArgs::default()
        };
        let SettingsError::Invalid(msg) = DaemonSettings::resolve(&a, None).unwrap_err() else {
            panic!("not Invalid");
        };
        for needle in [
            "--config",
            "listen:",
            "state:",
            "tls-key",
            "pending-ttl-seconds",
        ] {
            assert!(msg.contains(needle), "{needle} missing from {msg}");
        }
    }

    #[test]
    fn backend_tuning_from_flags_env_file_and_defaults() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            backend: BackendArgs,
        }
        use clap::Parser;
        let s = DaemonSettings::resolve(&args(), None).unwrap();
        assert_eq!(s.backends, BackendTuning::default());
        assert_eq!(
            s.backends.bare_metal_log_keep_bytes,
            NonZeroU64::new(16 << 20)
        );
        assert_eq!(s.backends.bare_metal_pids_max, None);

        let file: DaemonFile = toml::from_str(
            "container-ulimits = [\"nofile=20000:20000\", \"nproc=4096:4096\"]\n\
             bare-metal-pids-max = 512\nbare-metal-log-keep-bytes = \"1m\"\n",
        )
        .unwrap();
        let s = DaemonSettings::resolve(&args(), Some(&file)).unwrap();
        assert_eq!(
            s.backends.container_ulimits,
            vec![
                "nofile=20000:20000".parse().unwrap(),
                "nproc=4096:4096".parse().unwrap()
            ]
        );
        assert_eq!(s.backends.bare_metal_pids_max, NonZeroU64::new(512));
        assert_eq!(
            s.backends.bare_metal_log_keep_bytes,
            NonZeroU64::new(1 << 20)
        );
        let yaml: DaemonFile = serde_norway::from_str(
            "container-ulimits: [nofile=20000:20000, nproc=4096:4096]\n\
             bare-metal-pids-max: 512\nbare-metal-log-keep-bytes: 1m\n",
        )
        .unwrap();
        assert_eq!(yaml, file);

        // Flags beat the file; `max` lifts a cap the file sets.
        let mut a = args();
        a.backend = Cli::try_parse_from([
            "x",
            "--container-ulimit",
            "nofile=10:20",
            "--bare-metal-pids-max",
            "max",
            "--bare-metal-log-keep-bytes",
            "4096",
        ])
        .unwrap()
        .backend;
        let s = DaemonSettings::resolve(&a, Some(&file)).unwrap();
        assert_eq!(
            s.backends.container_ulimits,
            vec!["nofile=10:20".parse().unwrap()]
        );
        assert_eq!(s.backends.bare_metal_pids_max, None);
        assert_eq!(s.backends.bare_metal_log_keep_bytes, NonZeroU64::new(4096));

        // The variable is comma-separated and beaten by the flag. (Its
        // name is read by no other test.)
        std::env::set_var("KICI_SCALER_CONTAINER_ULIMITS", "nofile=1:2,nproc=3:3");
        let from_env = Cli::try_parse_from(["x"]).unwrap().backend;
        let from_flag = Cli::try_parse_from(["x", "--container-ulimit", "core=0:0"])
            .unwrap()
            .backend;
        std::env::remove_var("KICI_SCALER_CONTAINER_ULIMITS");
        assert_eq!(
            from_env.container_ulimits.unwrap(),
            vec!["nofile=1:2".parse().unwrap(), "nproc=3:3".parse().unwrap()]
        );
        assert_eq!(
            from_flag.container_ulimits.unwrap(),
            vec!["core=0:0".parse().unwrap()]
        );

        // The agent network: default, file, flag.
        let s = DaemonSettings::resolve(&args(), None).unwrap();
        assert_eq!(s.backends.container_network.name, "kici-scaler-net");
        assert_eq!(
            s.backends.container_network.pool.to_string(),
            "172.29.0.0/16"
        );
        assert_eq!(s.backends.container_network.bridge, "kici-scaler0");
        let net: DaemonFile = toml::from_str(
            "container-network = \"ci-net\"\ncontainer-subnet = \"10.77.0.0/24\"\n\
             container-bridge = \"ci0\"\n",
        )
        .unwrap();
        let mut a = args();
        a.backend = Cli::try_parse_from(["x", "--container-subnet", "10.78.0.0/24"])
            .unwrap()
            .backend;
        let s = DaemonSettings::resolve(&a, Some(&net)).unwrap();
        assert_eq!(s.backends.container_network.name, "ci-net");
        assert_eq!(
            s.backends.container_network.pool.to_string(),
            "10.78.0.0/24"
        );
        assert_eq!(s.backends.container_network.bridge, "ci0");
        assert!(Cli::try_parse_from(["x", "--container-subnet", "10.0.0.1/24"]).is_err());

        // Bad values: clap refuses flags; the file's are reported together.
        assert!(Cli::try_parse_from(["x", "--container-ulimit", "nofile"]).is_err());
        assert!(Cli::try_parse_from(["x", "--bare-metal-pids-max", "0"]).is_err());
        let bad: DaemonFile = toml::from_str(
            "container-ulimits = [\"nofile=9:1\"]\nbare-metal-pids-max = 0\n\
             bare-metal-log-keep-bytes = \"lots\"\ncontainer-subnet = \"10.0.0.0/33\"\n\
             container-bridge = \"a-name-far-too-long\"\n",
        )
        .unwrap();
        let SettingsError::Invalid(msg) = DaemonSettings::resolve(&args(), Some(&bad)).unwrap_err()
        else {
            panic!("not Invalid");
        };
        for needle in [
            "container-ulimits:",
            "bare-metal-pids-max:",
            "bare-metal-log-keep-bytes:",
            "container-subnet:",
            "container-bridge:",
        ] {
            assert!(msg.contains(needle), "{needle} missing from {msg}");
        }
    }

    #[test]
    fn firecracker_sweep_interval_from_flag_file_default_and_its_bounds() {
        let s = DaemonSettings::resolve(&args(), None).unwrap();
        assert_eq!(
            s.backends.firecracker_sweep_interval,
            Duration::from_secs(15 * 60)
        );
        // The sweep spares what the reconciler spares.
        assert_eq!(s.backends.orphan_min_age, s.reconcile_age);

        let file: DaemonFile =
            toml::from_str("firecracker-sweep-interval-seconds = 30\nreconcile-age-seconds = 7\n")
                .unwrap();
        let yaml: DaemonFile = serde_norway::from_str(
            "firecracker-sweep-interval-seconds: 30\nreconcile-age-seconds: 7\n",
        )
        .unwrap();
        assert_eq!(yaml, file);
        let s = DaemonSettings::resolve(&args(), Some(&file)).unwrap();
        assert_eq!(
            s.backends.firecracker_sweep_interval,
            Duration::from_secs(30)
        );
        assert_eq!(s.backends.orphan_min_age, Duration::from_secs(7));
        let mut a = args();
        a.firecracker_sweep_interval_seconds = Some(2);
        let s = DaemonSettings::resolve(&a, Some(&file)).unwrap();
        assert_eq!(
            s.backends.firecracker_sweep_interval,
            Duration::from_secs(2)
        );
        a.firecracker_sweep_interval_seconds = Some(24 * 60 * 60);
        assert!(DaemonSettings::resolve(&a, None).is_ok());

        for (bad, says) in [
            (0, "at least 1"),
            (86_401, "at most 86400"),
            (u64::MAX, "at most"),
        ] {
            let mut a = args();
            a.firecracker_sweep_interval_seconds = Some(bad);
            let SettingsError::Invalid(msg) = DaemonSettings::resolve(&a, None).unwrap_err() else {
                panic!("not Invalid");
            };
            assert!(
                msg.contains("firecracker-sweep-interval-seconds") && msg.contains(says),
                "{bad}: {msg}"
            );
            // The reconciler's timer has the same bounds.
            let mut a = args();
            a.reconcile_interval_seconds = Some(bad);
            let SettingsError::Invalid(msg) = DaemonSettings::resolve(&a, None).unwrap_err() else {
                panic!("not Invalid");
            };
            assert!(
                msg.contains("reconcile-interval-seconds") && msg.contains(says),
                "{bad}: {msg}"
            );
        }
    }

    #[test]
    fn addresses() {
        assert!(!"127.0.0.1:1".parse::<ListenAddr>().unwrap().is_remote());
        assert!(!"[::1]:1".parse::<ListenAddr>().unwrap().is_remote());
        assert!(!"localhost:1".parse::<ListenAddr>().unwrap().is_remote());
        assert!(!"unix:/tmp/x".parse::<ListenAddr>().unwrap().is_remote());
        assert!("0.0.0.0:1".parse::<ListenAddr>().unwrap().is_remote());
        assert!("unix:".parse::<ListenAddr>().is_err());
        assert!("example.com:80".parse::<ListenAddr>().is_err());
    }
}
