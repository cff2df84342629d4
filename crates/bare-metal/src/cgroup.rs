//! cgroups of bare-metal agents.
//!
//! This module owns three things:
//!
//! - **Placement** ([`discover`]): where the cgroups go on this host —
//!   found from `/proc/self/mountinfo` and `/proc/self/cgroup`, never
//!   assumed: inside the daemon's own delegated cgroup under systemd on a
//!   pure v2 host (`<own>/agents/…`, the daemon itself in `<own>/daemon`),
//!   else `<v2 mount>/kici-scaler/…`, or wherever `--cgroup-root` says.
//! - **Tracking**: every agent gets a cgroup v2 leaf
//!   `<top>/<tree>/<instance>/<scaler>/<agent id>` ([`CgroupLayout`]). The
//!   child enters it before it execs, so everything the agent ever forks
//!   (including what escapes its process group with `setsid`) is found
//!   there, killed with `cgroup.kill`, and seen gone through
//!   `cgroup.events`. The path is the owner marker: reconcile lists it,
//!   destroy finds it without a handle. Tracking needs no controller, so it
//!   works on hosts whose v2 mount has none (as this project's CI hosts: the
//!   v1 hierarchies hold them).
//! - **Limits** (only for `enforceCgroups: true`; a pids limit whenever the
//!   daemon sets one): memory, CPU and tasks, per dimension on v2 when the
//!   top cgroup offers the controller (enabled down the path through
//!   `cgroup.subtree_control`), else on the v1 hierarchy of the same name
//!   (`<v1 root>/memory`, `<v1 root>/cpu`) at the same relative path. A
//!   limit no controller can enforce is refused ([`LimitError`]), never
//!   silently dropped. Memory limits also forbid swap (`memory.swap.max = 0`
//!   / `memory.memsw.limit_in_bytes`) where the host accounts it, so a limit
//!   kills instead of swapping, and on v2 set `memory.oom.group = 1`, so an
//!   OOM kill takes the whole agent (never half of it, never anything
//!   outside it). Every value written is read back and compared: a kernel
//!   that silently clamps or ignores a limit is an error, not a surprise.
//!
//! Hosts: on this project's dev/CI machines the v2 mount
//! (`/sys/fs/cgroup/unified`) has no controllers, while the memory, cpu and
//! pids controllers sit on v1 hierarchies (`/sys/fs/cgroup/<controller>`).
//! So tracking and killing are v2 (`cgroup.procs`, `cgroup.kill`,
//! `cgroup.events` work there) and limits are v1 — tested for real. The v2
//! limit path is tested for real on a pure-v2 Debian 12 guest with systemd
//! (`scripts/vm-test.sh`) and here on a fake cgroupfs tree. v1-only hosts
//! (no v2 mount at all) cannot track agents and are refused.

use crate::failpoints;
use kici_model::{AgentId, InstanceId, MemoryBytes, MilliCpu, Resources};
use rustix::fd::OwnedFd;
use rustix::process::{Pid, Signal};
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

pub mod discover;

/// The directory under every cgroup root that holds kici-scaler's cgroups.
pub const TREE: &str = "kici-scaler";

/// The CFS period written with every CPU quota (100 ms, the kernel default).
const CPU_PERIOD_US: u64 = 100_000;
/// The kernel refuses quotas below 1 ms.
const MIN_CPU_QUOTA_US: u64 = 1_000;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cgroup {} already exists and still holds processes", .0.display())]
    InUse(PathBuf),
    #[error(
        "cannot enable {controllers} in {}: processes live in that cgroup itself, and cgroup v2 \
         gives controllers to the children only of a cgroup without processes (the \"no internal \
         processes\" rule). Run kici-scaler in a cgroup of its own with delegation (systemd: \
         Delegate=yes, which makes it move into a leaf of its own), or name a cgroup without \
         processes with --cgroup-root",
        path.display()
    )]
    InternalProcesses { path: PathBuf, controllers: String },
    #[error(
        "{} reads back {read:?} after {wrote:?} was written: the kernel did not take the limit",
        path.display()
    )]
    NotApplied {
        path: PathBuf,
        wrote: String,
        read: String,
    },
    /// A failpoint configured to fail ([`crate::failpoints`]).
    #[error("injected failure at {0}")]
    Injected(&'static str),
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CgroupError {
    let path = path.to_owned();
    move |source| CgroupError::Io {
        action,
        path,
        source,
    }
}

/// A limit was asked for that no controller on this host can enforce.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error(
        "a memory limit of {limit} cannot be enforced: the cgroup v2 root {} does not offer \
         the memory controller and there is no cgroup v1 memory hierarchy at {}",
        v2_root.display(), v1_dir.display()
    )]
    NoMemoryController {
        limit: MemoryBytes,
        v2_root: PathBuf,
        v1_dir: PathBuf,
    },
    #[error(
        "a CPU limit of {limit} cannot be enforced: the cgroup v2 root {} does not offer \
         the cpu controller and there is no cgroup v1 cpu hierarchy at {}",
        v2_root.display(), v1_dir.display()
    )]
    NoCpuController {
        limit: MilliCpu,
        v2_root: PathBuf,
        v1_dir: PathBuf,
    },
    #[error(
        "a pids limit of {limit} cannot be enforced: the cgroup v2 root {} does not offer \
         the pids controller and there is no cgroup v1 pids hierarchy at {}",
        v2_root.display(), v1_dir.display()
    )]
    NoPidsController {
        limit: u64,
        v2_root: PathBuf,
        v1_dir: PathBuf,
    },
}

/// A cgroup v1 hierarchy kici-scaler may set limits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V1Controller {
    Memory,
    Cpu,
    Pids,
}

impl V1Controller {
    pub const ALL: [Self; 3] = [Self::Memory, Self::Cpu, Self::Pids];

    /// The hierarchy's directory under the v1 root (`cpu` is a symlink to
    /// `cpu,cpuacct` where the two are co-mounted).
    pub fn dir_name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Cpu => "cpu",
            Self::Pids => "pids",
        }
    }

    /// A file only this controller's hierarchy has at its root (the pids
    /// controller has no files in the root cgroup: `tasks` marks a v1
    /// hierarchy, the directory name which one).
    fn probe_file(self) -> &'static str {
        match self {
            Self::Memory => "memory.limit_in_bytes",
            Self::Cpu => "cpu.cfs_quota_us",
            Self::Pids => "tasks",
        }
    }
}

/// Makes a scaler name safe as one cgroup directory name: `[A-Za-z0-9_-]`,
/// at most 64 characters, never empty and never one of the dot-less v1
/// interface file names. Distinct names may collide; agent ids below them
/// stay unique, so nothing depends on the scaler directory being unique.
pub fn sanitise_scaler_name(name: &str) -> String {
    let mut s: String = name
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || matches!(s.as_str(), "tasks" | "notify_on_release" | "release_agent") {
        s.push('_');
    }
    s
}

/// Where this instance's cgroups live: `<v2 root>/<tree>/<instance>/…`,
/// where the v2 root is the topmost cgroup kici-scaler writes to (the v2
/// mount, or the daemon's own delegated cgroup) and the tree is
/// [`TREE`] or, in a delegated cgroup, [`discover::DELEGATED_TREE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupLayout {
    v2_root: PathBuf,
    v1_root: PathBuf,
    tree: String,
    instance: InstanceId,
}

impl CgroupLayout {
    /// The tree is [`TREE`].
    pub fn new(v2_root: PathBuf, v1_root: PathBuf, instance: InstanceId) -> Self {
        Self {
            v2_root,
            v1_root,
            tree: TREE.to_owned(),
            instance,
        }
    }

    /// Another name for the directory under the v2 root that holds the
    /// instances' trees.
    pub fn with_tree(mut self, tree: impl Into<String>) -> Self {
        self.tree = tree.into();
        self
    }

    pub fn v2_root(&self) -> &Path {
        &self.v2_root
    }

    /// The directory under the v2 root (and each v1 hierarchy) that holds
    /// the instances' trees.
    pub fn tree(&self) -> &str {
        &self.tree
    }

    pub fn v1_dir(&self, controller: V1Controller) -> PathBuf {
        self.v1_root.join(controller.dir_name())
    }

    fn instance_rel(&self) -> PathBuf {
        Path::new(&self.tree).join(self.instance.to_string())
    }

    fn agent_rel(&self, scaler: &str, agent: AgentId) -> PathBuf {
        self.instance_rel()
            .join(sanitise_scaler_name(scaler))
            .join(agent.to_string())
    }

    /// `<v2 root>/<tree>/<instance>`.
    pub fn instance_dir(&self) -> PathBuf {
        self.v2_root.join(self.instance_rel())
    }

    pub fn tracking_dir(&self, scaler: &str, agent: AgentId) -> PathBuf {
        self.v2_root.join(self.agent_rel(scaler, agent))
    }

    pub fn v1_agent_dir(&self, controller: V1Controller, scaler: &str, agent: AgentId) -> PathBuf {
        self.v1_dir(controller).join(self.agent_rel(scaler, agent))
    }

    /// Every `<instance dir>/<scaler>/<leaf>` directory of the v2 tree.
    pub fn tracking_leaves(&self) -> io::Result<Vec<PathBuf>> {
        leaves(&self.instance_dir())
    }

    /// The agent's cgroups as found on disk (for a destroy without handle):
    /// its tracking leaf and the v1 leaves of the same name.
    pub fn find_agent(&self, agent: AgentId) -> AgentCgroups {
        let name = agent.to_string();
        let find = |instance_dir: PathBuf| -> Option<PathBuf> {
            leaves(&instance_dir)
                .ok()?
                .into_iter()
                .find(|leaf| leaf.file_name().is_some_and(|n| n == name.as_str()))
        };
        AgentCgroups {
            tracking: find(self.instance_dir()),
            v1: V1Controller::ALL
                .into_iter()
                .filter_map(|c| Some((c, find(self.v1_dir(c).join(self.instance_rel()))?)))
                .collect(),
        }
    }

    /// Removes this instance's empty scaler and instance directories (v2 and
    /// v1). Directories still holding agents stay (`rmdir` refuses them).
    pub fn prune_empty(&self) {
        let mut instance_dirs = vec![self.instance_dir()];
        instance_dirs.extend(
            V1Controller::ALL
                .into_iter()
                .map(|c| self.v1_dir(c).join(self.instance_rel())),
        );
        for dir in instance_dirs {
            if let Ok(entries) = fs::read_dir(&dir) {
                for entry in entries.flatten() {
                    if entry.file_type().is_ok_and(|t| t.is_dir()) {
                        // Refused while it holds agents: that is the point.
                        let _ = fs::remove_dir(entry.path());
                    }
                }
            }
            let _ = fs::remove_dir(&dir);
        }
    }
}

/// `<dir>/*/*` directories.
fn leaves(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let scalers = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(e),
    };
    for scaler in scalers {
        let scaler = scaler?;
        if !scaler.file_type()?.is_dir() {
            continue;
        }
        for leaf in fs::read_dir(scaler.path())? {
            let leaf = leaf?;
            if leaf.file_type()?.is_dir() {
                found.push(leaf.path());
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Which controllers this host offers for limits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Controllers {
    /// `cgroup.controllers` of the v2 root.
    pub v2: Vec<String>,
    pub v1_memory: bool,
    pub v1_cpu: bool,
    pub v1_pids: bool,
}

impl Controllers {
    pub fn detect(layout: &CgroupLayout) -> Self {
        let v2 = fs::read_to_string(layout.v2_root.join("cgroup.controllers"))
            .map(|s| s.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default();
        let v1 = |c: V1Controller| layout.v1_dir(c).join(c.probe_file()).is_file();
        Self {
            v2,
            v1_memory: v1(V1Controller::Memory),
            v1_cpu: v1(V1Controller::Cpu),
            v1_pids: v1(V1Controller::Pids),
        }
    }

    fn v2_has(&self, controller: &str) -> bool {
        self.v2.iter().any(|c| c == controller)
    }

    pub fn can_limit_memory(&self) -> bool {
        self.v2_has("memory") || self.v1_memory
    }

    pub fn can_limit_cpu(&self) -> bool {
        self.v2_has("cpu") || self.v1_cpu
    }

    pub fn can_limit_pids(&self) -> bool {
        self.v2_has("pids") || self.v1_pids
    }
}

/// The hierarchy that enforces one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hierarchy {
    V2,
    V1,
}

/// Which limits to write, and where.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitPlan {
    pub memory: Option<(MemoryBytes, Hierarchy)>,
    pub cpu: Option<(MilliCpu, Hierarchy)>,
    /// `pids.max`: how many tasks the agent's cgroup may hold.
    pub pids: Option<(u64, Hierarchy)>,
}

impl LimitPlan {
    /// Plans `limits` (a zero dimension is unlimited), v2 first.
    pub fn for_limits(
        limits: Resources,
        controllers: &Controllers,
        layout: &CgroupLayout,
    ) -> Result<Self, LimitError> {
        let mut plan = Self::default();
        if limits.memory > MemoryBytes::ZERO {
            let hierarchy = if controllers.v2_has("memory") {
                Hierarchy::V2
            } else if controllers.v1_memory {
                Hierarchy::V1
            } else {
                return Err(LimitError::NoMemoryController {
                    limit: limits.memory,
                    v2_root: layout.v2_root.clone(),
                    v1_dir: layout.v1_dir(V1Controller::Memory),
                });
            };
            plan.memory = Some((limits.memory, hierarchy));
        }
        if limits.cpu > MilliCpu::ZERO {
            let hierarchy = if controllers.v2_has("cpu") {
                Hierarchy::V2
            } else if controllers.v1_cpu {
                Hierarchy::V1
            } else {
                return Err(LimitError::NoCpuController {
                    limit: limits.cpu,
                    v2_root: layout.v2_root.clone(),
                    v1_dir: layout.v1_dir(V1Controller::Cpu),
                });
            };
            plan.cpu = Some((limits.cpu, hierarchy));
        }
        Ok(plan)
    }

    /// Adds a limit on the number of tasks (processes and threads), v2
    /// first.
    pub fn with_pids(
        mut self,
        max: std::num::NonZeroU64,
        controllers: &Controllers,
        layout: &CgroupLayout,
    ) -> Result<Self, LimitError> {
        let hierarchy = if controllers.v2_has("pids") {
            Hierarchy::V2
        } else if controllers.v1_pids {
            Hierarchy::V1
        } else {
            return Err(LimitError::NoPidsController {
                limit: max.get(),
                v2_root: layout.v2_root.clone(),
                v1_dir: layout.v1_dir(V1Controller::Pids),
            });
        };
        self.pids = Some((max.get(), hierarchy));
        Ok(self)
    }

    fn v2_controllers(&self) -> Vec<&'static str> {
        let mut c = Vec::new();
        if matches!(self.memory, Some((_, Hierarchy::V2))) {
            c.push("memory");
        }
        if matches!(self.cpu, Some((_, Hierarchy::V2))) {
            c.push("cpu");
        }
        if matches!(self.pids, Some((_, Hierarchy::V2))) {
            c.push("pids");
        }
        c
    }
}

/// The CFS quota for `cpu` per `CPU_PERIOD_US`.
pub fn cpu_quota_us(cpu: MilliCpu) -> u64 {
    (cpu.millis().saturating_mul(CPU_PERIOD_US) / 1000).max(MIN_CPU_QUOTA_US)
}

/// Writes one cgroup interface file. Opening with `create` cannot make a
/// missing interface file appear on a real cgroupfs (the kernel refuses), so
/// a missing controller still fails; it lets tests run on a plain directory.
fn write_file(path: &Path, contents: &str) -> Result<(), CgroupError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(io_err("open", path))?;
    file.write_all(contents.as_bytes())
        .map_err(io_err("write", path))
}

/// Writes a limit and reads it back: the limit counts only once the kernel
/// shows it. `expected` is what the file must then read (the kernel rounds
/// byte limits down to whole pages).
fn write_limit(path: &Path, contents: &str, expected: &str) -> Result<(), CgroupError> {
    write_file(path, contents)?;
    let read = fs::read_to_string(path).map_err(io_err("read back", path))?;
    if read.trim() == expected {
        Ok(())
    } else {
        Err(CgroupError::NotApplied {
            path: path.to_owned(),
            wrote: contents.to_owned(),
            read: read.trim().to_owned(),
        })
    }
}

/// A byte limit as the kernel reads it back: whole pages.
fn page_rounded(bytes: u64) -> String {
    let page = rustix::param::page_size() as u64;
    (bytes / page * page).to_string()
}

/// Creates `dir` (its parents too); an existing empty cgroup is reused.
fn make_cgroup(dir: &Path) -> Result<(), CgroupError> {
    if let Some(parent) = dir.parent() {
        fs::create_dir_all(parent).map_err(io_err("create cgroup", parent))?;
    }
    match fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            if procs(dir).map_err(io_err("read", dir))?.is_empty() {
                Ok(())
            } else {
                Err(CgroupError::InUse(dir.to_owned()))
            }
        }
        Err(e) => Err(io_err("create cgroup", dir)(e)),
    }
}

/// Enables `controllers` in `cgroup.subtree_control` of every directory from
/// the v2 root down to the leaf's parent, so the leaf gets their files.
fn enable_v2_controllers(
    root: &Path,
    leaf: &Path,
    controllers: &[&str],
) -> Result<(), CgroupError> {
    let Ok(rel) = leaf.strip_prefix(root) else {
        return Ok(());
    };
    let mut dir = root.to_owned();
    // The root and every directory below it except the leaf itself.
    for component in rel.components() {
        let path = dir.join("cgroup.subtree_control");
        let enabled = fs::read_to_string(&path).unwrap_or_default();
        let missing: Vec<String> = controllers
            .iter()
            .filter(|c| !enabled.split_whitespace().any(|e| e == **c))
            .map(|c| format!("+{c}"))
            .collect();
        if !missing.is_empty() {
            match write_file(&path, &missing.join(" ")) {
                Err(CgroupError::Io { source, .. })
                    if source.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) =>
                {
                    return Err(CgroupError::InternalProcesses {
                        path: dir,
                        controllers: missing.join(" "),
                    })
                }
                other => other?,
            }
        }
        dir.push(component);
    }
    Ok(())
}

/// The cgroups one agent lives in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentCgroups {
    /// The v2 tracking leaf (absent only when a destroy found none).
    pub tracking: Option<PathBuf>,
    /// v1 leaves carrying limits.
    pub v1: Vec<(V1Controller, PathBuf)>,
}

impl AgentCgroups {
    /// Creates the tracking leaf and, per `plan`, the limit settings. On
    /// error, whatever was created is removed again.
    pub fn create(
        layout: &CgroupLayout,
        scaler: &str,
        agent: AgentId,
        plan: &LimitPlan,
    ) -> Result<Self, CgroupError> {
        let tracking = layout.tracking_dir(scaler, agent);
        make_cgroup(&tracking)?;
        let mut cgroups = Self {
            tracking: Some(tracking.clone()),
            v1: Vec::new(),
        };
        let result = failpoints::check(failpoints::SPAWN_CGROUP, CgroupError::Injected)
            .and_then(|()| cgroups.apply_limits(layout, scaler, agent, plan))
            .and_then(|()| failpoints::check(failpoints::SPAWN_LIMITS, CgroupError::Injected));
        if let Err(e) = result {
            let _ = cgroups.remove();
            return Err(e);
        }
        Ok(cgroups)
    }

    fn apply_limits(
        &mut self,
        layout: &CgroupLayout,
        scaler: &str,
        agent: AgentId,
        plan: &LimitPlan,
    ) -> Result<(), CgroupError> {
        let Some(tracking) = self.tracking.clone() else {
            return Ok(());
        };
        let v2 = plan.v2_controllers();
        if !v2.is_empty() {
            enable_v2_controllers(layout.v2_root(), &tracking, &v2)?;
        }
        if let Some((memory, hierarchy)) = plan.memory {
            let bytes = memory.bytes().to_string();
            match hierarchy {
                Hierarchy::V2 => {
                    let pages = page_rounded(memory.bytes());
                    write_limit(&tracking.join("memory.max"), &bytes, &pages)?;
                    // Present only where the kernel accounts swap; without
                    // it the limit would swap instead of killing.
                    let swap = tracking.join("memory.swap.max");
                    if swap.exists() {
                        write_limit(&swap, "0", "0")?;
                    }
                    // An OOM kill takes every process of the agent at once:
                    // no half-killed agent whose leader lives on.
                    write_limit(&tracking.join("memory.oom.group"), "1", "1")?;
                }
                Hierarchy::V1 => {
                    let dir = layout.v1_agent_dir(V1Controller::Memory, scaler, agent);
                    make_cgroup(&dir)?;
                    self.v1.push((V1Controller::Memory, dir.clone()));
                    let pages = page_rounded(memory.bytes());
                    // memsw must stay ≥ the memory limit: memory first.
                    write_limit(&dir.join("memory.limit_in_bytes"), &bytes, &pages)?;
                    let memsw = dir.join("memory.memsw.limit_in_bytes");
                    if memsw.exists() {
                        write_limit(&memsw, &bytes, &pages)?;
                    }
                }
            }
        }
        if let Some((cpu, hierarchy)) = plan.cpu {
            let quota = cpu_quota_us(cpu);
            match hierarchy {
                Hierarchy::V2 => {
                    let max = format!("{quota} {CPU_PERIOD_US}");
                    write_limit(&tracking.join("cpu.max"), &max, &max)?;
                }
                Hierarchy::V1 => {
                    let dir = layout.v1_agent_dir(V1Controller::Cpu, scaler, agent);
                    make_cgroup(&dir)?;
                    self.v1.push((V1Controller::Cpu, dir.clone()));
                    let (period, quota) = (CPU_PERIOD_US.to_string(), quota.to_string());
                    write_limit(&dir.join("cpu.cfs_period_us"), &period, &period)?;
                    write_limit(&dir.join("cpu.cfs_quota_us"), &quota, &quota)?;
                }
            }
        }
        if let Some((max, hierarchy)) = plan.pids {
            let max = max.to_string();
            match hierarchy {
                Hierarchy::V2 => write_limit(&tracking.join("pids.max"), &max, &max)?,
                Hierarchy::V1 => {
                    let dir = layout.v1_agent_dir(V1Controller::Pids, scaler, agent);
                    make_cgroup(&dir)?;
                    self.v1.push((V1Controller::Pids, dir.clone()));
                    write_limit(&dir.join("pids.max"), &max, &max)?;
                }
            }
        }
        Ok(())
    }

    /// `cgroup.procs` of every cgroup, opened close-on-exec, for the child to
    /// write `0` (itself) into before it execs.
    pub fn open_procs(&self) -> Result<Vec<OwnedFd>, CgroupError> {
        self.tracking
            .iter()
            .chain(self.v1.iter().map(|(_, dir)| dir))
            .map(|dir| {
                let path = dir.join("cgroup.procs");
                // std opens with O_CLOEXEC: the agent never inherits these.
                OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map(OwnedFd::from)
                    .map_err(io_err("open", &path))
            })
            .collect()
    }

    /// The tracking cgroup's directory, opened for `clone3(CLONE_INTO_CGROUP)`.
    pub fn open_tracking(&self) -> Result<Option<OwnedFd>, CgroupError> {
        use std::os::unix::fs::OpenOptionsExt;
        self.tracking
            .as_ref()
            .map(|dir| {
                OpenOptions::new()
                    .read(true)
                    .custom_flags(rustix::fs::OFlags::DIRECTORY.bits() as i32)
                    .open(dir)
                    .map(OwnedFd::from)
                    .map_err(io_err("open", dir))
            })
            .transpose()
    }

    /// `cgroup.procs` of the v1 limit cgroups only (close-on-exec).
    pub fn open_v1_procs(&self) -> Result<Vec<OwnedFd>, CgroupError> {
        self.v1
            .iter()
            .map(|(_, dir)| {
                let path = dir.join("cgroup.procs");
                OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map(OwnedFd::from)
                    .map_err(io_err("open", &path))
            })
            .collect()
    }

    /// Removes every (empty) cgroup; already-missing ones are fine.
    pub fn remove(&self) -> Result<(), CgroupError> {
        for dir in self.v1.iter().map(|(_, dir)| dir).chain(&self.tracking) {
            match fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("remove cgroup", dir)(e)),
            }
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.tracking.is_none() && self.v1.is_empty()
    }
}

/// The pids in `dir/cgroup.procs` (empty when the cgroup is gone).
pub fn procs(dir: &Path) -> io::Result<Vec<Pid>> {
    match fs::read_to_string(dir.join("cgroup.procs")) {
        Ok(s) => Ok(s
            .lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .filter_map(Pid::from_raw)
            .collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Does any process live in the cgroup (or below it)? From `cgroup.events`
/// on v2, else from `cgroup.procs`.
pub fn populated(dir: &Path) -> io::Result<bool> {
    match fs::read_to_string(dir.join("cgroup.events")) {
        Ok(events) => Ok(events
            .lines()
            .any(|l| l.split_whitespace().eq(["populated", "1"]))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(!procs(dir)?.is_empty()),
        Err(e) => Err(e),
    }
}

/// Sends `signal` to every process in the cgroup. Membership is the owner
/// proof: a process is in our agent's cgroup only if our agent forked it.
pub fn signal_all(dir: &Path, signal: Signal) -> io::Result<usize> {
    let pids = procs(dir)?;
    for pid in &pids {
        // Gone in the meantime is fine.
        let _ = rustix::process::kill_process(*pid, signal);
    }
    Ok(pids.len())
}

/// Kills everything in the cgroup: `cgroup.kill` where the kernel has it
/// (5.14+), else one SIGKILL sweep over `cgroup.procs` (the caller repeats
/// until the cgroup is empty, catching processes forked meanwhile).
pub fn kill_all(dir: &Path) -> io::Result<()> {
    let kill = dir.join("cgroup.kill");
    if kill.exists() {
        match OpenOptions::new().write(true).open(&kill) {
            Ok(mut f) => return f.write_all(b"1"),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    signal_all(dir, Signal::KILL).map(|_| ())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use kici_model::ScalerType;

    fn fake_v2(controllers: &str) -> (tempfile::TempDir, CgroupLayout) {
        let dir = tempfile::tempdir().unwrap();
        let v2 = dir.path().join("unified");
        fs::create_dir_all(&v2).unwrap();
        fs::write(v2.join("cgroup.controllers"), controllers).unwrap();
        fs::write(v2.join("cgroup.subtree_control"), "").unwrap();
        let layout = CgroupLayout::new(v2, dir.path().join("v1"), InstanceId::random());
        (dir, layout)
    }

    fn limits(millis: u64, bytes: u64) -> Resources {
        Resources::new(
            MilliCpu::from_millis(millis),
            MemoryBytes::from_bytes(bytes),
        )
    }

    #[test]
    fn scaler_names_become_safe_directory_names() {
        assert_eq!(sanitise_scaler_name("metal-1_a"), "metal-1_a");
        assert_eq!(sanitise_scaler_name("../etc"), "___etc");
        assert_eq!(sanitise_scaler_name("cgroup.procs"), "cgroup_procs");
        assert_eq!(sanitise_scaler_name(""), "_");
        assert_eq!(sanitise_scaler_name("tasks"), "tasks_");
        assert_eq!(sanitise_scaler_name(&"x".repeat(100)).len(), 64);
    }

    #[test]
    fn cpu_quota_is_per_100ms_period_with_the_kernel_minimum() {
        assert_eq!(cpu_quota_us(MilliCpu::from_millis(1000)), 100_000);
        assert_eq!(cpu_quota_us(MilliCpu::from_millis(2500)), 250_000);
        assert_eq!(cpu_quota_us(MilliCpu::from_millis(1)), 1_000);
    }

    #[test]
    fn v2_limits_are_written_on_a_fake_cgroupfs() {
        // A fake v2 tree whose root offers memory and cpu (as a delegated
        // production host would). Real v2 limits cannot run here: the v2
        // mount of the CI hosts has no controllers.
        let (_dir, layout) = fake_v2("cpuset cpu io memory pids\n");
        let controllers = Controllers::detect(&layout);
        assert!(controllers.can_limit_memory() && controllers.can_limit_cpu());
        let plan = LimitPlan::for_limits(limits(1500, 50 << 20), &controllers, &layout).unwrap();
        assert_eq!(
            plan,
            LimitPlan {
                memory: Some((MemoryBytes::from_bytes(50 << 20), Hierarchy::V2)),
                cpu: Some((MilliCpu::from_millis(1500), Hierarchy::V2)),
                pids: None,
            }
        );
        let agent = AgentId::random(ScalerType::BareMetal);
        let leaf = layout.tracking_dir("metal", agent);
        // The kernel creates memory.swap.max when swap is accounted.
        fs::create_dir_all(&leaf).unwrap();
        fs::write(leaf.join("memory.swap.max"), "max").unwrap();
        let cgroups = AgentCgroups::create(&layout, "metal", agent, &plan).unwrap();
        assert_eq!(cgroups.tracking.as_deref(), Some(leaf.as_path()));
        assert!(cgroups.v1.is_empty());
        let read = |p: &Path| fs::read_to_string(p).unwrap();
        assert_eq!(read(&leaf.join("memory.max")), "52428800");
        assert_eq!(read(&leaf.join("memory.swap.max")), "0");
        assert_eq!(read(&leaf.join("cpu.max")), "150000 100000");
        // Enabled from the root down to the leaf's parent, not in the leaf
        // (a cgroup with processes may not enable controllers for children).
        let mut dir = layout.v2_root().to_owned();
        for part in [TREE, &layout.instance.to_string(), "metal"] {
            assert_eq!(read(&dir.join("cgroup.subtree_control")), "+memory +cpu");
            dir.push(part);
        }
        assert_eq!(dir, leaf.parent().unwrap());
        assert_eq!(read(&dir.join("cgroup.subtree_control")), "+memory +cpu");
        assert!(!leaf.join("cgroup.subtree_control").exists());
    }

    #[test]
    fn a_delegated_layout_holds_agents_under_its_tree_with_every_v2_limit() {
        let (_dir, layout) = fake_v2("cpu memory pids\n");
        let layout = layout.with_tree(discover::DELEGATED_TREE);
        let plan = LimitPlan::for_limits(
            limits(500, 64 << 20),
            &Controllers::detect(&layout),
            &layout,
        )
        .unwrap()
        .with_pids(
            std::num::NonZeroU64::new(128).unwrap(),
            &Controllers::detect(&layout),
            &layout,
        )
        .unwrap();
        let agent = AgentId::random(ScalerType::BareMetal);
        let cgroups = AgentCgroups::create(&layout, "metal", agent, &plan).unwrap();
        let leaf = cgroups.tracking.clone().unwrap();
        assert_eq!(
            leaf,
            layout
                .v2_root()
                .join("agents")
                .join(layout.instance.to_string())
                .join("metal")
                .join(agent.to_string())
        );
        let read = |name: &str| fs::read_to_string(leaf.join(name)).unwrap();
        assert_eq!(read("memory.max"), (64u64 << 20).to_string());
        assert_eq!(read("memory.oom.group"), "1");
        assert_eq!(read("cpu.max"), "50000 100000");
        assert_eq!(read("pids.max"), "128");
        assert_eq!(layout.find_agent(agent), cgroups);
        assert_eq!(layout.tracking_leaves().unwrap(), vec![leaf]);
    }

    #[test]
    fn a_limit_that_does_not_read_back_is_an_error() {
        let (_dir, layout) = fake_v2("memory\n");
        let agent = AgentId::random(ScalerType::BareMetal);
        let leaf = layout.tracking_dir("s", agent);
        fs::create_dir_all(&leaf).unwrap();
        // Takes every write and reads back empty: a limit that never took.
        std::os::unix::fs::symlink("/dev/null", leaf.join("memory.max")).unwrap();
        let plan = LimitPlan {
            memory: Some((MemoryBytes::from_bytes(8 << 20), Hierarchy::V2)),
            cpu: None,
            pids: None,
        };
        let err = AgentCgroups::create(&layout, "s", agent, &plan).unwrap_err();
        assert!(
            matches!(&err, CgroupError::NotApplied { wrote, read, .. } if wrote == "8388608" && read.is_empty()),
            "{err}"
        );
        assert!(err
            .to_string()
            .contains("the kernel did not take the limit"));
    }

    #[test]
    fn v2_controllers_already_enabled_are_not_written_again() {
        let (_dir, layout) = fake_v2("memory");
        fs::write(
            layout.v2_root().join("cgroup.subtree_control"),
            "cpu memory\n",
        )
        .unwrap();
        let plan = LimitPlan {
            memory: Some((MemoryBytes::from_bytes(1 << 20), Hierarchy::V2)),
            cpu: None,
            pids: None,
        };
        let agent = AgentId::random(ScalerType::BareMetal);
        AgentCgroups::create(&layout, "s", agent, &plan).unwrap();
        assert_eq!(
            fs::read_to_string(layout.v2_root().join("cgroup.subtree_control")).unwrap(),
            "cpu memory\n"
        );
    }

    #[test]
    fn limits_fall_back_to_v1_per_dimension() {
        let (dir, layout) = fake_v2("memory");
        let cpu = dir.path().join("v1/cpu");
        fs::create_dir_all(&cpu).unwrap();
        fs::write(cpu.join("cpu.cfs_quota_us"), "-1").unwrap();
        let controllers = Controllers::detect(&layout);
        assert_eq!(
            LimitPlan::for_limits(limits(500, 1 << 30), &controllers, &layout).unwrap(),
            LimitPlan {
                memory: Some((MemoryBytes::from_bytes(1 << 30), Hierarchy::V2)),
                cpu: Some((MilliCpu::from_millis(500), Hierarchy::V1)),
                pids: None,
            }
        );
    }

    #[test]
    fn pids_limits_go_to_v2_when_offered_else_v1_else_are_refused() {
        let max = std::num::NonZeroU64::new(64).unwrap();
        let (_dir, layout) = fake_v2("pids");
        let plan = LimitPlan::default()
            .with_pids(max, &Controllers::detect(&layout), &layout)
            .unwrap();
        assert_eq!(plan.pids, Some((64, Hierarchy::V2)));
        let agent = AgentId::random(ScalerType::BareMetal);
        let cgroups = AgentCgroups::create(&layout, "s", agent, &plan).unwrap();
        let leaf = cgroups.tracking.clone().unwrap();
        assert_eq!(fs::read_to_string(leaf.join("pids.max")).unwrap(), "64");
        assert_eq!(
            fs::read_to_string(layout.v2_root().join("cgroup.subtree_control")).unwrap(),
            "+pids"
        );

        let (dir, layout) = fake_v2("");
        let controllers = Controllers::detect(&layout);
        assert!(!controllers.can_limit_pids());
        let err = LimitPlan::default()
            .with_pids(max, &controllers, &layout)
            .unwrap_err();
        assert!(err
            .to_string()
            .starts_with("a pids limit of 64 cannot be enforced"));
        let v1 = dir.path().join("v1/pids");
        fs::create_dir_all(&v1).unwrap();
        fs::write(v1.join("tasks"), "").unwrap();
        let plan = LimitPlan::default()
            .with_pids(max, &Controllers::detect(&layout), &layout)
            .unwrap();
        assert_eq!(plan.pids, Some((64, Hierarchy::V1)));
        let cgroups = AgentCgroups::create(&layout, "s", agent, &plan).unwrap();
        let (controller, leaf) = &cgroups.v1[0];
        assert_eq!(*controller, V1Controller::Pids);
        assert_eq!(fs::read_to_string(leaf.join("pids.max")).unwrap(), "64");
        assert_eq!(layout.find_agent(agent), cgroups);
    }

    #[test]
    fn limits_no_controller_can_enforce_are_refused() {
        let (_dir, layout) = fake_v2("");
        let controllers = Controllers::detect(&layout);
        assert!(!controllers.can_limit_memory());
        let err = LimitPlan::for_limits(limits(0, 50 << 20), &controllers, &layout).unwrap_err();
        assert!(matches!(err, LimitError::NoMemoryController { .. }));
        assert!(err
            .to_string()
            .starts_with("a memory limit of 50m cannot be enforced"));
        let err = LimitPlan::for_limits(limits(250, 0), &controllers, &layout).unwrap_err();
        assert!(err.to_string().contains("CPU limit of 250m"));
        // No limits asked: nothing to enforce, nothing refused.
        assert_eq!(
            LimitPlan::for_limits(Resources::ZERO, &controllers, &layout).unwrap(),
            LimitPlan::default()
        );
    }

    #[test]
    fn agents_are_found_by_name_and_pruned_when_empty() {
        let (_dir, layout) = fake_v2("");
        let a = AgentId::random(ScalerType::BareMetal);
        let b = AgentId::random(ScalerType::BareMetal);
        let plan = LimitPlan::default();
        let ca = AgentCgroups::create(&layout, "one", a, &plan).unwrap();
        let cb = AgentCgroups::create(&layout, "two", b, &plan).unwrap();
        assert_eq!(layout.find_agent(a), ca);
        let mut expected = vec![ca.tracking.clone().unwrap(), cb.tracking.clone().unwrap()];
        expected.sort();
        assert_eq!(layout.tracking_leaves().unwrap(), expected);
        ca.remove().unwrap();
        ca.remove().unwrap();
        layout.prune_empty();
        assert!(layout.instance_dir().join("two").exists());
        assert!(!layout.instance_dir().join("one").exists());
        cb.remove().unwrap();
        layout.prune_empty();
        assert!(!layout.instance_dir().exists());
    }
}
