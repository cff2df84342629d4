//! `kici-scaler doctor`: what the bare-metal backend needs on this host
//! (where its cgroups go and why — [`kici_bare_metal::cgroup::discover`] —,
//! and, when a daemon holds the state dir, where the running daemon's go),
//! for each container scaler what `serve` checks at start-up (the
//! runtime answers, `kici-scaler-net` is as expected — created when missing,
//! as `serve` would —, the label sets' images parse, limits fit the host),
//! and for Firecracker scalers `/dev/kvm`, the host network `firecracker
//! provision` sets up, nftables, each scaler's binaries, images, jailer user
//! and `sun_path` budget, and free space under the chroot base.
//!
//! This module owns the checks and their report. Each check is one
//! [`CheckRow`] (`ok`, `warn` or `fail` with a detail); the command exits
//! [`exit::ERROR`](crate::cli::exit::ERROR) when any row is `fail`.
//!
//! The checks reuse what the daemon itself runs: the configuration loader,
//! [`SearchPath`] for `binaryPath`,
//! [`kici_bare_metal::cgroup`] for the cgroup layout and controllers, and
//! [`kici_admission::ledger::resolve_dir`] for the machine-pool ledger. They
//! probe by doing (create and remove a cgroup, a file), but never disturb a
//! running daemon: a state dir whose lock is held is reported as in use,
//! without touching the lock.

use crate::cli::{CliError, ConfigArgs, Outcome};
use crate::daemon::agent_binary::SearchPath;
use crate::daemon::identity::{DEFAULT_STATE_DIR, LOCK_FILE};
use clap::Args;
use kici_bare_metal::cgroup::discover::{self, Case, DiscoveryError, Placement};
use kici_bare_metal::cgroup::{CgroupLayout, Controllers, V1Controller};
use kici_bare_metal::BareMetalOptions;
use kici_model::{BackendSettings, Config, InstanceId, LabelSetBackend, ScalerType};
use rustix::fs::Access;
use serde::Serialize;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The state directory the daemon would use [default: /var/lib/kici-scaler].
    #[arg(long, value_name = "DIR", env = "KICI_SCALER_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Print one JSON document `{"ok", "checks": [{"check", "status", "detail"}]}`.
    #[arg(long)]
    pub json: bool,
    /// The daemon's backend settings (the container network is checked).
    #[command(flatten)]
    pub backend: crate::daemon::settings::BackendArgs,
}

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, but something is degraded or worth knowing.
    Warn,
    /// The bare-metal backend cannot work as configured.
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckRow {
    pub check: String,
    pub status: Status,
    pub detail: String,
}

impl CheckRow {
    fn new(check: impl Into<String>, status: Status, detail: impl Into<String>) -> Self {
        Self {
            check: check.into(),
            status,
            detail: detail.into(),
        }
    }
}

/// `doctor --json`.
#[derive(Debug, Serialize)]
pub struct DoctorReport {
    /// No row is `fail`.
    pub ok: bool,
    pub checks: Vec<CheckRow>,
}

/// Where the checks look (what discovery finds for this process,
/// injectable for tests).
#[derive(Debug, Clone)]
pub struct HostPaths {
    /// The topmost cgroup v2 directory the daemon would write to.
    pub cgroup_v2_root: PathBuf,
    pub cgroup_v1_root: PathBuf,
    /// The directory under `cgroup_v2_root` holding instance trees.
    pub cgroup_tree: String,
    /// What discovery found, as a report row (`None`: not asked).
    pub placement: Option<CheckRow>,
    /// `--cgroup-root`, also applied to a running daemon's discovery.
    pub cgroup_override: Option<PathBuf>,
    pub proc_locks: PathBuf,
}

impl Default for HostPaths {
    fn default() -> Self {
        Self::discover(None)
    }
}

impl HostPaths {
    /// This process's placement (or `--cgroup-root`'s).
    pub fn discover(override_root: Option<&Path>) -> Self {
        let placement = discover::host_placement(override_root);
        let mut host = Self {
            cgroup_v2_root: PathBuf::new(),
            cgroup_v1_root: PathBuf::from(BareMetalOptions::DEFAULT_CGROUP_V1_ROOT),
            cgroup_tree: kici_bare_metal::cgroup::TREE.to_owned(),
            placement: None,
            cgroup_override: override_root.map(Path::to_path_buf),
            proc_locks: PathBuf::from("/proc/locks"),
        };
        if let Ok(p) = &placement {
            host.cgroup_v2_root = p.top.clone();
            host.cgroup_v1_root = p.v1_root.clone();
            host.cgroup_tree = p.tree.clone();
        }
        host.placement = Some(placement_row(PLACEMENT_CHECK, &placement, true));
        host
    }
}

const PLACEMENT_CHECK: &str = "cgroup placement";

/// One row for a placement: the case, why, where agents go, what is
/// missing. `needed`: a bare-metal scaler depends on it (a refusal fails).
pub fn placement_row(
    check: &str,
    placement: &Result<Placement, DiscoveryError>,
    needed: bool,
) -> CheckRow {
    match placement {
        Ok(p) => {
            let mut detail = format!(
                "{}: {}; agents under {}/<instance>/<scaler>/<agent id>",
                p.case,
                p.reason,
                p.tree_dir().display()
            );
            if let Some(leaf) = &p.daemon_leaf {
                detail.push_str(&format!("; daemon in {}", leaf.display()));
            }
            let status = match &p.advice {
                Some(advice) => {
                    detail.push_str(&format!("; {advice}"));
                    Status::Warn
                }
                None => Status::Ok,
            };
            CheckRow::new(check, status, detail)
        }
        Err(e) => CheckRow::new(
            check,
            if needed { Status::Fail } else { Status::Warn },
            e.to_string(),
        ),
    }
}

/// The placement of the daemon running as `pid` (read from its `/proc`).
fn daemon_placement_row(pid: &str, override_root: Option<&Path>) -> Option<CheckRow> {
    let proc_dir = Path::new("/proc").join(pid);
    if !proc_dir.is_dir() {
        return None;
    }
    let check = format!("{PLACEMENT_CHECK} (running daemon, pid {pid})");
    let placement = discover::placement_of(&proc_dir, override_root).map(|(_, p)| p);
    let mut row = placement_row(&check, &placement, true);
    if let Ok(p) = &placement {
        if p.case == Case::SystemdDelegated {
            if let Some(leaf) = &p.daemon_leaf {
                let inside = fs::read_to_string(leaf.join("cgroup.procs"))
                    .is_ok_and(|procs| procs.lines().any(|l| l.trim() == pid));
                if !inside {
                    row.status = Status::Warn;
                    row.detail.push_str(&format!(
                        "; pid {pid} is not in {} (a daemon older than this one?)",
                        leaf.display()
                    ));
                }
            }
        }
    }
    Some(row)
}

/// `kici-scaler doctor`.
pub fn doctor(args: &DoctorArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR));
    let mut problems = Vec::new();
    let tuning = args.backend.resolve(
        &crate::daemon::settings::DaemonFile::default(),
        &mut problems,
    );
    let mut report = run_checks(
        &args.config,
        &state_dir,
        &HostPaths::discover(tuning.cgroup_root.as_deref()),
        &tuning.container_network,
    );
    if let Ok(loaded) = kici_config::load(&args.config.config, args.config.config_dir.as_deref()) {
        let work_root = tuning
            .bare_metal_work_dir
            .clone()
            .unwrap_or_else(|| BareMetalOptions::default_work_root(&state_dir));
        let rows = agent_user_checks(&loaded.config, &work_root);
        report.ok &= rows.iter().all(|r| r.status != Status::Fail);
        report.checks.extend(rows);
    }
    for p in problems {
        report
            .checks
            .push(CheckRow::new("settings", Status::Fail, p));
        report.ok = false;
    }
    if args.json {
        serde_json::to_writer(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        for row in &report.checks {
            writeln!(
                out,
                "{:<4} {}: {}",
                row.status.as_str(),
                row.check,
                row.detail
            )?;
        }
    }
    Ok(if report.ok {
        Outcome::Ok
    } else {
        Outcome::Failed
    })
}

/// Per bare-metal scaler, who its agents run as: `warn` when no
/// `x-kici-scaler.user` is named and this runs as root (so would a root
/// `serve`'s agents), `fail` when the named user or group does not exist,
/// cannot be switched to, or cannot reach its work directories.
pub fn agent_user_checks(config: &Config, work_root: &Path) -> Vec<CheckRow> {
    let root = rustix::process::geteuid().is_root();
    config
        .scalers
        .iter()
        .filter(|s| s.kind == ScalerType::BareMetal)
        .map(|s| {
            let check = format!("agent user ({})", s.name);
            let Some(user) = &s.ext.agent_user else {
                return if root {
                    CheckRow::new(check, Status::Warn, crate::cli::ROOT_AGENTS_WARNING)
                } else {
                    CheckRow::new(
                        check,
                        Status::Ok,
                        format!(
                            "agents run as the daemon's own user (uid {})",
                            rustix::process::geteuid().as_raw()
                        ),
                    )
                };
            };
            match kici_bare_metal::Credentials::resolve(user) {
                Err(e) => CheckRow::new(check, Status::Fail, e.to_string()),
                Ok(c) => match c.denied_on_path(work_root, 0o1).filter(|_| c.switch) {
                    Some(denied) => CheckRow::new(
                        check,
                        Status::Fail,
                        format!(
                            "{:?} cannot reach the work root {}: {denied}",
                            c.name,
                            work_root.display()
                        ),
                    ),
                    None => CheckRow::new(
                        check,
                        Status::Ok,
                        format!(
                            "agents run as {} (uid {}, gid {}, groups {:?}), work dirs under {}",
                            c.name,
                            c.uid,
                            c.gid,
                            c.groups,
                            work_root.display()
                        ),
                    ),
                },
            }
        })
        .collect()
}

/// Every check, in report order.
pub fn run_checks(
    config: &ConfigArgs,
    state_dir: &Path,
    host: &HostPaths,
    container_network: &kici_container::NetworkSettings,
) -> DoctorReport {
    let mut checks = Vec::new();
    let loaded = kici_config::load(&config.config, config.config_dir.as_deref());
    let config = match loaded {
        Ok(loaded) => {
            let c = &loaded.config;
            let label_sets: usize = c.scalers.iter().map(|s| s.label_sets.len()).sum();
            let (status, warnings) = if loaded.warnings.is_empty() {
                (Status::Ok, String::new())
            } else {
                let w: Vec<String> = loaded.warnings.iter().map(ToString::to_string).collect();
                (Status::Warn, format!("; warnings: {}", w.join("; ")))
            };
            checks.push(CheckRow::new(
                "config",
                status,
                format!(
                    "{} scaler(s), {label_sets} label set(s) from {}{warnings}",
                    c.scalers.len(),
                    config.config.display()
                ),
            ));
            Some(loaded.config)
        }
        Err(errors) => {
            let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
            checks.push(CheckRow::new("config", Status::Fail, lines.join("; ")));
            None
        }
    };
    if let Some(config) = &config {
        checks.extend(binary_checks(config, &SearchPath::current()));
    }
    let has_bare_metal = config.as_ref().is_none_or(|c| {
        c.scalers
            .iter()
            .any(|s| matches!(s.kind, ScalerType::BareMetal))
    });
    if let Some(row) = &host.placement {
        let mut row = row.clone();
        if !has_bare_metal && row.status == Status::Fail {
            row.status = Status::Warn;
        }
        checks.push(row);
    }
    if let Some(pid) = lock_holder(&state_dir.join(LOCK_FILE), &host.proc_locks) {
        checks.extend(daemon_placement_row(&pid, host.cgroup_override.as_deref()));
    }
    checks.push(cgroup_tracking_check(host, has_bare_metal));
    if let Some(config) = &config {
        checks.extend(cgroup_controllers_check(config, host));
    }
    checks.push(state_dir_check(state_dir, &host.proc_locks));
    if let Some(config) = &config {
        checks.push(ledger_check(config));
        checks.extend(container_checks(config, container_network));
        checks.extend(firecracker_checks(config, Path::new(KVM_DEVICE)));
    }
    DoctorReport {
        ok: checks.iter().all(|r| r.status != Status::Fail),
        checks,
    }
}

/// Refuses every lease: the container checks never spawn.
struct NoLeases;

#[async_trait::async_trait]
impl kici_store::IpAllocator for NoLeases {
    async fn allocate(
        &self,
        _pool: &kici_store::Ipv4Pool,
        _agent: &kici_model::AgentId,
    ) -> Result<kici_store::Lease, kici_store::AllocError> {
        Err(kici_store::AllocError::Store(
            "doctor spawns nothing".to_owned(),
        ))
    }
    async fn release_agent(
        &self,
        _agent: &kici_model::AgentId,
    ) -> Result<u64, kici_store::AllocError> {
        Ok(0)
    }
    async fn release_ip(
        &self,
        _network: ipnet::Ipv4Net,
        _ip: std::net::Ipv4Addr,
    ) -> Result<bool, kici_store::AllocError> {
        Ok(false)
    }
    async fn leases(&self) -> Result<Vec<kici_store::Lease>, kici_store::AllocError> {
        Ok(Vec::new())
    }
}

/// One row per container scaler: [`kici_container::ContainerBackend::check_host`],
/// the check `serve` runs at start-up.
pub fn container_checks(
    config: &Config,
    network: &kici_container::NetworkSettings,
) -> Vec<CheckRow> {
    let scalers: Vec<_> = config
        .scalers
        .iter()
        .filter(|s| s.kind == ScalerType::Container)
        .collect();
    if scalers.is_empty() {
        return Vec::new();
    }
    let fail_all = |why: String| vec![CheckRow::new("container", Status::Fail, why)];
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail_all(format!("cannot start an async runtime: {e}")),
    };
    let mut options = kici_container::ContainerOptions::new(
        InstanceId::random(),
        std::sync::Arc::new(NoLeases),
        Vec::new(),
    );
    options.network = network.clone();
    let backend = match kici_container::ContainerBackend::new(options) {
        Ok(b) => b,
        Err(e) => return fail_all(e.to_string()),
    };
    scalers
        .into_iter()
        .map(|scaler| {
            let check = runtime.block_on(backend.check_host(scaler));
            let name = format!("container[{}]", scaler.name);
            if check.is_ok() {
                CheckRow::new(
                    name,
                    Status::Ok,
                    format!(
                        "{} {} (API {}) at {}; network {}",
                        check.runtime.map_or("runtime", |k| k.as_str()),
                        check.version.unwrap_or_default(),
                        check.api_version.unwrap_or_default(),
                        check.endpoint.unwrap_or_default(),
                        check.network.unwrap_or_default()
                    ),
                )
            } else {
                CheckRow::new(name, Status::Fail, check.messages().join("; "))
            }
        })
        .collect()
}

/// Where KVM lives; a parameter of [`firecracker_checks`] so tests can point
/// it elsewhere.
pub const KVM_DEVICE: &str = "/dev/kvm";

/// Below this much free space under a chroot base, spawns are refused
/// (upstream's guard, enforced by the backend at each spawn).
pub const CHROOT_MIN_FREE_BYTES: u64 = kici_firecracker::chroot::MIN_FREE_BYTES;

/// The rows for Firecracker scalers (none when the config has none).
pub fn firecracker_checks(config: &Config, kvm: &Path) -> Vec<CheckRow> {
    let scalers: Vec<_> = config
        .scalers
        .iter()
        .filter(|s| s.kind == ScalerType::Firecracker)
        .collect();
    if scalers.is_empty() {
        return Vec::new();
    }
    let mut rows = vec![kvm_check(kvm)];
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            rows.push(CheckRow::new(
                "firecracker",
                Status::Fail,
                format!("cannot start an async runtime: {e}"),
            ));
            return rows;
        }
    };
    rows.push(runtime.block_on(firecracker_network_check(config)));
    rows.push(nftables_check());
    let options = kici_firecracker::FirecrackerOptions::new(
        InstanceId::random(),
        config.firecracker.clone(),
        std::sync::Arc::new(NoLeases),
        std::sync::Arc::new(kici_netpolicy::NoEgressRules),
        Vec::new(),
    );
    match kici_firecracker::FirecrackerBackend::new(options) {
        Err(e) => rows.push(CheckRow::new("firecracker", Status::Fail, e.to_string())),
        Ok(backend) => {
            use kici_engine::Backend as _;
            for scaler in &scalers {
                let name = format!("firecracker[{}]", scaler.name);
                rows.push(match runtime.block_on(backend.validate(scaler)) {
                    Ok(()) => CheckRow::new(
                        name,
                        Status::Ok,
                        "binaries executable, images readable by the jailer user, jailer user not root, API socket path fits sun_path",
                    ),
                    Err(problems) => CheckRow::new(name, Status::Fail, problems.to_string()),
                });
            }
        }
    }
    let mut bases: Vec<&Path> = scalers
        .iter()
        .filter_map(|s| match &s.backend {
            BackendSettings::Firecracker(f) => Some(f.chroot_base_dir.as_path()),
            _ => None,
        })
        .collect();
    bases.sort();
    bases.dedup();
    rows.extend(bases.into_iter().map(chroot_space_check));
    rows
}

/// Firecracker needs KVM: the device must exist, be a character device and
/// open read-write (the jailer makes its own node of the same device).
fn kvm_check(kvm: &Path) -> CheckRow {
    use std::os::unix::fs::FileTypeExt;
    const CHECK: &str = "firecracker /dev/kvm";
    let shown = kvm.display();
    match fs::metadata(kvm) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => CheckRow::new(
            CHECK,
            Status::Fail,
            format!("{shown} not found: Firecracker needs KVM (a bare-metal host, or nested virtualization enabled)"),
        ),
        Err(e) => CheckRow::new(CHECK, Status::Fail, format!("{shown}: {e}")),
        Ok(m) if !m.file_type().is_char_device() => CheckRow::new(
            CHECK,
            Status::Fail,
            format!("{shown} is not a character device"),
        ),
        Ok(_) => match OpenOptions::new().read(true).write(true).open(kvm) {
            Ok(_) => CheckRow::new(CHECK, Status::Ok, format!("{shown} opens read-write")),
            Err(e) => CheckRow::new(
                CHECK,
                Status::Fail,
                format!("{shown} does not open read-write: {e}"),
            ),
        },
    }
}

/// What `kici-scaler firecracker provision` sets up (bridge with its owner
/// tag and gateway, IP forwarding, NAT, forward accepts), read only.
async fn firecracker_network_check(config: &Config) -> CheckRow {
    const CHECK: &str = "firecracker host network";
    let network = &config.firecracker;
    let setup = kici_firecracker::HostSetup {
        network,
        uplink: None,
    };
    match setup.verify().await {
        Err(e) => CheckRow::new(
            CHECK,
            Status::Fail,
            format!("bridge {}: {e}", network.bridge_name),
        ),
        Ok(status) if status.healthy() => CheckRow::new(
            CHECK,
            Status::Ok,
            format!(
                "bridge {} (ours, up, {}), forwarding and NAT for {} in place",
                network.bridge_name, network.gateway, network.cidr
            ),
        ),
        Ok(status) => CheckRow::new(
            CHECK,
            Status::Fail,
            format!(
                "bridge {}: {}; run `kici-scaler firecracker provision --config <file>` as root",
                network.bridge_name,
                status.problems(&setup).join("; ")
            ),
        ),
    }
}

/// Per-VM isolation rules live in nftables: the kernel must answer.
fn nftables_check() -> CheckRow {
    const CHECK: &str = "nftables";
    match std::process::Command::new("nft")
        .args(["-j", "list", "tables"])
        .output()
    {
        Ok(out) if out.status.success() => {
            CheckRow::new(CHECK, Status::Ok, "nft lists the ruleset")
        }
        Ok(out) => CheckRow::new(
            CHECK,
            Status::Fail,
            format!(
                "nft -j list tables: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ),
        Err(e) => CheckRow::new(
            CHECK,
            Status::Fail,
            format!("cannot run nft (install nftables): {e}"),
        ),
    }
}

/// Free space on the filesystem that holds (or will hold) `base`.
fn chroot_space_check(base: &Path) -> CheckRow {
    let check = format!("firecracker chroot space {}", base.display());
    // The base may not exist yet: the filesystem is its nearest ancestor's.
    let Some(existing) = base.ancestors().find(|p| p.exists()) else {
        return CheckRow::new(check, Status::Fail, "no ancestor of it exists");
    };
    match rustix::fs::statvfs(existing) {
        Err(e) => CheckRow::new(check, Status::Fail, format!("{}: {e}", existing.display())),
        Ok(st) => {
            let free = st.f_bavail.saturating_mul(st.f_frsize);
            let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
            let detail = format!(
                "{:.1} GiB free on the filesystem of {} (at least {:.0} GiB needed)",
                gib(free),
                existing.display(),
                gib(CHROOT_MIN_FREE_BYTES)
            );
            let status = if free >= CHROOT_MIN_FREE_BYTES {
                Status::Ok
            } else {
                Status::Fail
            };
            CheckRow::new(check, status, detail)
        }
    }
}

/// One row per bare-metal label set: its `binaryPath` resolves, as the
/// daemon resolves it, to an executable file.
pub fn binary_checks(config: &Config, search: &SearchPath) -> Vec<CheckRow> {
    let mut rows = Vec::new();
    for scaler in &config.scalers {
        for (i, label_set) in scaler.label_sets.iter().enumerate() {
            let LabelSetBackend::BareMetal { binary_path } = &label_set.backend else {
                continue;
            };
            let check = format!("binaryPath scalers[name={}].labelSets[{i}]", scaler.name);
            let row = match search.resolve(binary_path) {
                Err(why) => CheckRow::new(check, Status::Fail, why),
                Ok(found) => {
                    let shown = if found == *binary_path {
                        found.display().to_string()
                    } else {
                        format!("{} -> {}", binary_path.display(), found.display())
                    };
                    match executable_file(&found) {
                        Ok(()) => CheckRow::new(check, Status::Ok, format!("{shown}: executable")),
                        Err(why) => CheckRow::new(check, Status::Fail, format!("{shown}: {why}")),
                    }
                }
            };
            rows.push(row);
        }
    }
    rows
}

fn executable_file(path: &Path) -> Result<(), String> {
    let meta = fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_owned());
    }
    rustix::fs::access(path, Access::EXEC_OK)
        .map_err(|e| format!("not executable by this user ({e})"))
}

/// The v2 mount tracks every agent: a probe cgroup under `kici-scaler/`
/// must be creatable, with `cgroup.procs` (and `cgroup.kill`) writable.
fn cgroup_tracking_check(host: &HostPaths, needed: bool) -> CheckRow {
    const CHECK: &str = "cgroup v2 tracking";
    let missing = if needed { Status::Fail } else { Status::Warn };
    let root = &host.cgroup_v2_root;
    if root.as_os_str().is_empty() {
        return CheckRow::new(
            CHECK,
            missing,
            "no cgroup v2 directory for agents on this host (see the cgroup placement row)",
        );
    }
    if !root.join("cgroup.procs").is_file() {
        return CheckRow::new(
            CHECK,
            missing,
            format!(
                "no cgroup v2 mount at {} (bare-metal agents are tracked and killed through it)",
                root.display()
            ),
        );
    }
    // A fresh instance id: the probe can never meet a daemon's own tree.
    let layout = CgroupLayout::new(
        root.clone(),
        host.cgroup_v1_root.clone(),
        InstanceId::random(),
    )
    .with_tree(host.cgroup_tree.clone());
    let probe = layout.instance_dir();
    let tree = root.join(layout.tree());
    let tree_existed = tree.is_dir();
    let result = probe_cgroup(&probe);
    // Removes the probe and the tree directory if only the probe needed it.
    layout.prune_empty();
    if !tree_existed {
        let _ = fs::remove_dir(&tree);
    }
    match result {
        Ok(None) => CheckRow::new(
            CHECK,
            Status::Ok,
            format!(
                "{}: probe cgroup created and removed; cgroup.procs and cgroup.kill writable",
                root.join(layout.tree()).display()
            ),
        ),
        Ok(Some(note)) => CheckRow::new(
            CHECK,
            Status::Warn,
            format!("{}: {note}", root.join(layout.tree()).display()),
        ),
        Err(e) => CheckRow::new(CHECK, missing, e),
    }
}

/// `Ok(Some(note))`: usable, but degraded.
fn probe_cgroup(dir: &Path) -> Result<Option<String>, String> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let open = |name: &str| {
        let path = dir.join(name);
        // Opened for writing, nothing written: proves the permission only.
        OpenOptions::new()
            .write(true)
            .open(&path)
            .map(drop)
            .map_err(|e| (path, e))
    };
    open("cgroup.procs")
        .map_err(|(p, e)| format!("cannot open {} for writing: {e}", p.display()))?;
    match open("cgroup.kill") {
        Ok(()) => Ok(None),
        Err((p, e)) if e.kind() == io::ErrorKind::NotFound => Ok(Some(format!(
            "{} missing (kernel before 5.14): destroy falls back to SIGKILL sweeps",
            p.display()
        ))),
        Err((p, e)) => Err(format!("cannot open {} for writing: {e}", p.display())),
    }
}

/// For scalers with `enforceCgroups: true`: memory and cpu controllers.
fn cgroup_controllers_check(config: &Config, host: &HostPaths) -> Option<CheckRow> {
    let enforcing: Vec<String> = config
        .scalers
        .iter()
        .filter(|s| matches!(&s.backend, BackendSettings::BareMetal(b) if b.enforce_cgroups))
        .map(|s| s.name.to_string())
        .collect();
    if enforcing.is_empty() {
        return None;
    }
    let layout = CgroupLayout::new(
        host.cgroup_v2_root.clone(),
        host.cgroup_v1_root.clone(),
        InstanceId::random(),
    )
    .with_tree(host.cgroup_tree.clone());
    let found = Controllers::detect(&layout);
    let where_ = |v2: &str, v1: V1Controller, v1_ok: bool| {
        if found.v2.iter().any(|c| c == v2) {
            format!("{v2}: v2 ({})", host.cgroup_v2_root.display())
        } else if v1_ok {
            format!("{v2}: v1 ({})", layout.v1_dir(v1).display())
        } else {
            format!("{v2}: none")
        }
    };
    let detail = format!(
        "enforceCgroups on {}; {}, {}",
        enforcing.join(", "),
        where_("memory", V1Controller::Memory, found.v1_memory),
        where_("cpu", V1Controller::Cpu, found.v1_cpu),
    );
    let status = match (found.can_limit_memory(), found.can_limit_cpu()) {
        (true, true) => Status::Ok,
        (false, false) => Status::Fail,
        // Limits in the missing dimension are refused at spawn.
        _ => Status::Warn,
    };
    Some(CheckRow::new("cgroup controllers", status, detail))
}

/// The state dir is creatable and writable, or in use by a running daemon
/// (whose lock is left alone).
fn state_dir_check(dir: &Path, proc_locks: &Path) -> CheckRow {
    const CHECK: &str = "state dir";
    let lock = dir.join(LOCK_FILE);
    if let Some(pid) = lock_holder(&lock, proc_locks) {
        return CheckRow::new(
            CHECK,
            Status::Ok,
            format!("{}: in use by pid {pid}", dir.display()),
        );
    }
    let existed = dir.is_dir();
    // The daemon's own mode: the dir will hold the store and token hashes.
    if let Err(e) = fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        return CheckRow::new(
            CHECK,
            Status::Fail,
            format!("cannot create {}: {e}", dir.display()),
        );
    }
    match probe_file(dir) {
        Ok(()) => CheckRow::new(
            CHECK,
            Status::Ok,
            format!(
                "{}: writable{}",
                dir.display(),
                if existed { "" } else { " (created)" }
            ),
        ),
        Err(e) => CheckRow::new(
            CHECK,
            Status::Fail,
            format!("{}: not writable: {e}", dir.display()),
        ),
    }
}

fn probe_file(dir: &Path) -> io::Result<()> {
    let probe = dir.join(format!(".doctor-probe-{}", std::process::id()));
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&probe)?;
    fs::remove_file(&probe)
}

/// The pid holding a `flock` on `lock`, read from `/proc/locks` rather than
/// by trying the lock (which a starting daemon could then find taken).
fn lock_holder(lock: &Path, proc_locks: &Path) -> Option<String> {
    let meta = fs::metadata(lock).ok()?;
    let dev = meta.dev();
    let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    let table = fs::read_to_string(proc_locks).ok()?;
    let lock_pid = table.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // `1: FLOCK ADVISORY WRITE <pid> <maj>:<min>:<ino> 0 EOF`; waiters
        // are `1: -> FLOCK …` and hold nothing.
        let [_, "FLOCK", _, _, pid, id, ..] = fields.as_slice() else {
            return None;
        };
        let mut parts = id.split(':');
        let maj = u32::from_str_radix(parts.next()?, 16).ok()?;
        let min = u32::from_str_radix(parts.next()?, 16).ok()?;
        let ino: u64 = parts.next()?.parse().ok()?;
        (maj == major && min == minor && ino == meta.ino()).then(|| (*pid).to_owned())
    })?;
    // The daemon writes its pid into the lock file; prefer that (the kernel's
    // view may be another pid namespace's).
    let written = fs::read_to_string(lock)
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .map(|p| p.to_string());
    Some(written.unwrap_or(lock_pid))
}

/// The machine-pool ledger's directory, when the config has pools.
fn ledger_check(config: &Config) -> CheckRow {
    const CHECK: &str = "machine-pool ledger";
    if config.machine_pools.is_empty() {
        return CheckRow::new(CHECK, Status::Ok, "not needed (no machinePools)");
    }
    match kici_admission::ledger::resolve_dir(None) {
        Ok(dir) => match probe_file(&dir) {
            Ok(()) => CheckRow::new(CHECK, Status::Ok, format!("{}: writable", dir.display())),
            Err(e) => CheckRow::new(
                CHECK,
                Status::Fail,
                format!("{}: not writable: {e}", dir.display()),
            ),
        },
        Err(e) => CheckRow::new(CHECK, Status::Fail, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn kvm_must_be_a_character_device_that_opens_read_write() {
        let dir = tempfile::tempdir().unwrap();
        let missing = kvm_check(&dir.path().join("kvm"));
        assert_eq!(missing.status, Status::Fail);
        assert!(missing.detail.contains("needs KVM"), "{}", missing.detail);
        let file = dir.path().join("plain");
        fs::write(&file, b"").unwrap();
        let plain = kvm_check(&file);
        assert_eq!(plain.status, Status::Fail);
        assert!(
            plain.detail.contains("not a character device"),
            "{}",
            plain.detail
        );
        // Any character device that opens read-write passes the probe.
        assert_eq!(kvm_check(Path::new("/dev/null")).status, Status::Ok);
    }

    #[test]
    fn chroot_space_is_read_from_the_nearest_existing_ancestor() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("not/yet/made");
        let row = chroot_space_check(&base);
        assert!(
            row.detail.contains(&dir.path().display().to_string()),
            "{}",
            row.detail
        );
        let st = rustix::fs::statvfs(dir.path()).unwrap();
        let expected = if st.f_bavail * st.f_frsize >= CHROOT_MIN_FREE_BYTES {
            Status::Ok
        } else {
            Status::Fail
        };
        assert_eq!(row.status, expected);
    }

    #[test]
    fn firecracker_rows_name_every_problem_of_a_scaler_and_its_host() {
        let dir = tempfile::tempdir().unwrap();
        let bridge = format!("kdt{:08x}", rand::random::<u32>());
        let yaml = format!(
            "version: 1
firecracker:
  cidr: 10.213.90.0/24
  bridgeName: {bridge}
scalers:
  - name: fc
    type: firecracker
    maxAgents: 2
    firecrackerPath: {d}/firecracker
    jailerPath: {d}/jailer
    kernelPath: {d}/vmlinux
    chrootBaseDir: {d}/jail
    uid: 0
    gid: 0
    labelSets:
      - labels: [fc]
        rootfsPath: {d}/rootfs.ext4
",
            d = dir.path().display()
        );
        let cfg = dir.path().join("fc.yaml");
        fs::write(&cfg, yaml).unwrap();
        let config = kici_config::load(&cfg, None).unwrap().config;
        let rows = firecracker_checks(&config, &dir.path().join("kvm"));
        let row = |name: &str| {
            rows.iter()
                .find(|r| r.check == name)
                .unwrap_or_else(|| panic!("no row {name} in {rows:?}"))
        };
        assert_eq!(row("firecracker /dev/kvm").status, Status::Fail);
        let net = row("firecracker host network");
        assert_eq!(net.status, Status::Fail);
        assert!(
            net.detail.contains("firecracker provision"),
            "{}",
            net.detail
        );
        let scaler = row("firecracker[fc]");
        assert_eq!(scaler.status, Status::Fail);
        for what in [
            "jailerPath",
            "firecrackerPath",
            "kernelPath",
            "rootfsPath",
            "root",
        ] {
            assert!(
                scaler.detail.contains(what),
                "{what} missing from {}",
                scaler.detail
            );
        }
        assert!(rows
            .iter()
            .any(|r| r.check.starts_with("firecracker chroot space")));
        assert!(rows.iter().any(|r| r.check == "nftables"));
        // No Firecracker scaler, no Firecracker rows.
        fs::write(&cfg, "version: 1\nscalers: []\n").unwrap();
        let plain = kici_config::load(&cfg, None).unwrap().config;
        assert!(firecracker_checks(&plain, Path::new("/dev/kvm")).is_empty());
    }

    #[test]
    fn a_held_lock_is_reported_with_the_pid_written_in_it() {
        let dir = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        let lock = dir.path().join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock)
            .unwrap();
        fs::write(&lock, "4242\n").unwrap();
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
        let row = state_dir_check(dir.path(), Path::new("/proc/locks"));
        assert_eq!(row.status, Status::Ok);
        assert!(row.detail.ends_with("in use by pid 4242"), "{}", row.detail);
        drop(file);
        let row = state_dir_check(dir.path(), Path::new("/proc/locks"));
        assert_eq!(row.status, Status::Ok);
        assert!(row.detail.ends_with(": writable"), "{}", row.detail);
    }

    #[test]
    fn an_uncreatable_state_dir_fails() {
        let row = state_dir_check(
            Path::new("/proc/kici-scaler-doctor"),
            Path::new("/proc/locks"),
        );
        assert_eq!(row.status, Status::Fail);
        assert!(row.detail.contains("cannot create"), "{}", row.detail);
    }

    #[test]
    fn the_placement_row_names_the_case_the_paths_and_what_is_missing() {
        let facts = discover::Facts {
            systemd: true,
            delegated: true,
            uid: 0,
        };
        let mountinfo = "28 21 0:25 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let decide = |cgroup: &str, facts, over: Option<&Path>| {
            discover::decide(
                &discover::parse(mountinfo, cgroup),
                facts,
                over,
                Path::new("/proc/self/mountinfo"),
            )
        };
        let service = "0::/system.slice/kici-scaler.service\n";
        let row = placement_row("p", &decide(service, facts, None), true);
        assert_eq!(row.status, Status::Ok);
        assert!(
            row.detail
                .starts_with("pure cgroup v2, systemd, delegated: "),
            "{}",
            row.detail
        );
        assert!(row.detail.contains(
            "agents under /sys/fs/cgroup/system.slice/kici-scaler.service/agents/<instance>"
        ));
        assert!(row
            .detail
            .ends_with("daemon in /sys/fs/cgroup/system.slice/kici-scaler.service/daemon"));

        let undelegated = discover::Facts {
            delegated: false,
            ..facts
        };
        let row = placement_row("p", &decide(service, undelegated, None), true);
        assert_eq!(row.status, Status::Warn);
        assert!(
            row.detail
                .contains("not delegated: add Delegate=yes to the unit (kici-scaler.service)"),
            "{}",
            row.detail
        );

        let row = placement_row(
            "p",
            &decide(service, undelegated, Some(Path::new("/srv/cg"))),
            true,
        );
        assert_eq!(row.status, Status::Ok);
        assert!(row.detail.starts_with("override (--cgroup-root): "));

        let user = discover::Facts {
            uid: 1000,
            ..undelegated
        };
        let scope = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/x.scope\n";
        let refused = decide(scope, user, None);
        assert_eq!(placement_row("p", &refused, true).status, Status::Fail);
        assert_eq!(placement_row("p", &refused, false).status, Status::Warn);
    }

    #[test]
    fn cgroup_root_names_the_case_and_the_probe_runs_there() {
        // This project's hosts: a real cgroup v2 directory of our own.
        let Some(v2) = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(Path::new)
            .find(|p| p.join("cgroup.procs").is_file())
        else {
            return;
        };
        let root = v2.join(format!("kici-doctor-test-{:08x}", rand::random::<u32>()));
        fs::create_dir(&root).unwrap();
        let host = HostPaths::discover(Some(&root));
        let row = host.placement.clone().unwrap();
        assert_eq!(row.status, Status::Ok);
        assert!(
            row.detail.starts_with("override (--cgroup-root): "),
            "{}",
            row.detail
        );
        let tracking = cgroup_tracking_check(&host, true);
        let removed = fs::remove_dir(&root);
        assert_ne!(tracking.status, Status::Fail, "{}", tracking.detail);
        assert!(
            tracking
                .detail
                .starts_with(&root.join("kici-scaler").display().to_string()),
            "{}",
            tracking.detail
        );
        // The probe left nothing behind: the directory it was given empties.
        removed.unwrap();
    }

    #[test]
    fn a_missing_v2_mount_fails_only_when_bare_metal_needs_it() {
        let host = HostPaths {
            cgroup_v2_root: PathBuf::from("/nonexistent/cgroup"),
            ..HostPaths::default()
        };
        assert_eq!(cgroup_tracking_check(&host, true).status, Status::Fail);
        assert_eq!(cgroup_tracking_check(&host, false).status, Status::Warn);
    }
}
