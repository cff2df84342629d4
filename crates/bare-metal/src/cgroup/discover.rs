//! Where kici-scaler's cgroups go on this host, found rather than assumed.
//!
//! Hosts differ in three ways that matter here:
//!
//! - **The hierarchy**: pure cgroup v2 (every current distribution with
//!   systemd: one `cgroup2` mount at `/sys/fs/cgroup`), hybrid (controllers
//!   on v1 hierarchies, a controller-less `cgroup2` mount beside them, often
//!   `/sys/fs/cgroup/unified`), or v1 only (no `cgroup2` mount at all).
//! - **Who owns the tree**: under systemd on a pure v2 host, systemd owns
//!   every cgroup; a service may create cgroups only inside its own cgroup,
//!   and only when that cgroup is delegated to it (`Delegate=yes`). v2 also
//!   forbids processes in a cgroup whose children get controllers (the "no
//!   internal processes" rule), so a delegated daemon first moves itself into
//!   a leaf of its own.
//! - **The operator**, who may name the directory outright (`--cgroup-root`).
//!
//! [`parse`] reads the two files that say all of it, `/proc/self/mountinfo`
//! and `/proc/self/cgroup`, and [`decide`] turns what they say plus a few
//! facts ([`Facts`]: systemd running, the delegation mark, the user) into a
//! [`Placement`]. Both are pure functions, tested on real hosts' files. The
//! I/O edge is [`host_placement`] / [`placement_of`] (read the files and the
//! facts) and [`Placement::enter_daemon_leaf`] (the move).
//!
//! | case | agents under | daemon |
//! |---|---|---|
//! | systemd, delegated | `<own>/agents/<instance>/<scaler>/<agent id>` | moves into `<own>/daemon` |
//! | systemd, not delegated, root | `<v2 mount>/kici-scaler/…` (outside systemd's tree; doctor says what to fix) | stays |
//! | systemd, not delegated, other users | refused: nothing is writable (the error says how to get a delegated scope) | — |
//! | pure v2 without systemd, hybrid | `<v2 mount>/kici-scaler/…` | stays |
//! | `--cgroup-root PATH` | `PATH/kici-scaler/…` | stays |
//! | v1 only | refused | — |

use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The leaf a delegated daemon moves itself into.
pub const DAEMON_LEAF: &str = "daemon";
/// The directory under a delegated cgroup that holds the agents' trees.
pub const DELEGATED_TREE: &str = "agents";
/// Where v1 hierarchies are mounted when mountinfo names none (their probes
/// then find nothing, which is the truth).
const DEFAULT_V1_ROOT: &str = "/sys/fs/cgroup";
/// systemd's own test for "booted with systemd" (`sd_booted()`).
const SYSTEMD_RUNTIME_DIR: &str = "/run/systemd/system";
/// The extended attributes systemd sets on a cgroup it delegates: the
/// `trusted.` one (readable by root only) by the system manager, the
/// `user.` one by managers that cannot set `trusted.` (a user's manager).
const DELEGATE_XATTRS: [&str; 2] = ["trusted.delegate", "user.delegate"];

/// The controllers of cgroup v1 (a v1 mount naming none of them, like
/// systemd's `name=systemd` tracking hierarchy, holds no controller).
const V1_CONTROLLERS: [&str; 14] = [
    "cpu",
    "cpuacct",
    "cpuset",
    "memory",
    "devices",
    "freezer",
    "net_cls",
    "net_prio",
    "blkio",
    "perf_event",
    "hugetlb",
    "pids",
    "rdma",
    "misc",
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiscoveryError {
    #[error(
        "only cgroup v1 is mounted here (no cgroup2 in {mountinfo}): bare-metal agents are \
         tracked and killed through cgroup v2. Boot with systemd.unified_cgroup_hierarchy=1 \
         (pure v2), or mount cgroup2 beside v1 (mount -t cgroup2 none /sys/fs/cgroup/unified)"
    )]
    V1Only { mountinfo: String },
    #[error(
        "no cgroup hierarchy is mounted (nothing of type cgroup2 or cgroup in {mountinfo}): \
         bare-metal agents need cgroup v2; mount it (mount -t cgroup2 none /sys/fs/cgroup)"
    )]
    NoCgroups { mountinfo: String },
    #[error(
        "kici-scaler runs as uid {uid} in the cgroup {own}, which systemd has not delegated \
         to it, so it may create no cgroup for its agents. Run it in a delegated scope: \
         `systemd-run --user --scope -p Delegate=yes kici-scaler …` (or as a unit with \
         Delegate=yes), run it as root, or name a writable cgroup v2 directory with \
         --cgroup-root"
    )]
    NotDelegated { own: String, uid: u32 },
    #[error("cannot read {}: {message}", path.display())]
    Read { path: PathBuf, message: String },
}

/// Which cgroup hierarchies the host mounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HierarchyKind {
    /// One `cgroup2` mount, no v1 hierarchy with a controller.
    PureV2,
    /// A `cgroup2` mount beside v1 hierarchies that hold the controllers.
    Hybrid,
    V1Only,
    None,
}

/// What `/proc/<pid>/mountinfo` and `/proc/<pid>/cgroup` say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub kind: HierarchyKind,
    /// Where the cgroup2 hierarchy is mounted.
    pub v2_mount: Option<PathBuf>,
    /// Where the v1 hierarchies are mounted (`<root>/memory`, …).
    pub v1_root: Option<PathBuf>,
    /// The process's v2 cgroup as `/proc/<pid>/cgroup` names it (`0::` line).
    pub own: Option<String>,
    /// That cgroup's directory, when it lies inside the mounted subtree.
    pub own_dir: Option<PathBuf>,
    /// The systemd unit cgroup the process belongs to (its own cgroup, or
    /// the parent when the process already sits in the unit's
    /// [`DAEMON_LEAF`]), as a directory; `None` when the cgroup's name is not
    /// a unit's (`*.service`, `*.scope`).
    pub unit_dir: Option<PathBuf>,
    /// The unit's name (`kici-scaler.service`).
    pub unit: Option<String>,
}

/// What the two files cannot say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    /// systemd is the init system (`/run/systemd/system` exists).
    pub systemd: bool,
    /// The unit's cgroup carries systemd's delegation mark.
    pub delegated: bool,
    /// The process's effective uid.
    pub uid: u32,
}

/// Which rule placed the cgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// `--cgroup-root`.
    Override,
    /// Pure v2 under systemd, the unit's cgroup delegated.
    SystemdDelegated,
    /// Pure v2 under systemd, not delegated, running as root.
    SystemdNotDelegated,
    /// Pure v2 without systemd.
    PureV2,
    /// Hybrid host.
    Hybrid,
}

impl Case {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Override => "override (--cgroup-root)",
            Self::SystemdDelegated => "pure cgroup v2, systemd, delegated",
            Self::SystemdNotDelegated => "pure cgroup v2, systemd, not delegated",
            Self::PureV2 => "pure cgroup v2 without systemd",
            Self::Hybrid => "hybrid (cgroup v2 for tracking, v1 controllers)",
        }
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where this process puts its agents' cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub case: Case,
    /// The topmost cgroup directory kici-scaler writes to: controllers are
    /// enabled from its `cgroup.subtree_control` down.
    pub top: PathBuf,
    /// The directory under [`Placement::top`] holding the instances' trees.
    pub tree: String,
    /// The leaf the daemon moves itself into first (delegated case only).
    pub daemon_leaf: Option<PathBuf>,
    /// Where v1 hierarchies are mounted (limits on hybrid hosts).
    pub v1_root: PathBuf,
    /// Why this case, in words (for `doctor` and the start-up log).
    pub reason: String,
    /// What is missing for the intended setup, and how to get it.
    pub advice: Option<String>,
}

impl Placement {
    /// `<top>/<tree>`: the directory whose children are instance trees.
    pub fn tree_dir(&self) -> PathBuf {
        self.top.join(&self.tree)
    }
}

/// Decodes mountinfo's octal escapes (`\040` is a space).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.len() == 3 && digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One mountinfo line's fields that matter here.
struct Mount {
    root: String,
    mount_point: PathBuf,
    fstype: String,
    super_options: String,
}

fn parse_mount(line: &str) -> Option<Mount> {
    // `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL…] - FSTYPE SOURCE SUPEROPTIONS`
    let (left, right) = line.split_once(" - ")?;
    let left: Vec<&str> = left.split(' ').collect();
    let right: Vec<&str> = right.split(' ').collect();
    if left.len() < 6 || right.is_empty() {
        return None;
    }
    Some(Mount {
        root: unescape(left[3]),
        mount_point: PathBuf::from(unescape(left[4])),
        fstype: right[0].to_owned(),
        super_options: right.get(2).copied().unwrap_or("").to_owned(),
    })
}

/// Is this cgroup directory name a systemd unit's?
fn is_unit_name(name: &str) -> bool {
    name.ends_with(".service") || name.ends_with(".scope")
}

/// Reads the two files' contents. Never fails: what they do not say stays
/// `None` ([`decide`] turns that into the right refusal).
pub fn parse(mountinfo: &str, proc_cgroup: &str) -> Hierarchy {
    let mounts: Vec<Mount> = mountinfo.lines().filter_map(parse_mount).collect();
    let v2_mounts: Vec<&Mount> = mounts.iter().filter(|m| m.fstype == "cgroup2").collect();
    let v1_with_controllers: Vec<&Mount> = mounts
        .iter()
        .filter(|m| m.fstype == "cgroup")
        .filter(|m| {
            m.super_options
                .split(',')
                .any(|o| V1_CONTROLLERS.contains(&o))
        })
        .collect();
    let own = proc_cgroup.lines().find_map(|line| {
        let rest = line.strip_prefix("0::")?;
        // A cgroup removed under a process reads "… (deleted)".
        Some(rest.trim_end_matches(" (deleted)").to_owned())
    });
    // Several cgroup2 mounts (bind mounts, a container's view): the one whose
    // mounted subtree holds our cgroup, the conventional places first.
    let rank = |m: &&Mount| match m.mount_point.to_str() {
        Some("/sys/fs/cgroup") => 0,
        Some("/sys/fs/cgroup/unified") => 1,
        _ => 2,
    };
    let mut ordered = v2_mounts.clone();
    ordered.sort_by_key(rank);
    let holds_own = |m: &&&Mount| {
        own.as_deref()
            .is_some_and(|own| relative_to(own, &m.root).is_some())
    };
    let v2 = ordered
        .iter()
        .find(holds_own)
        .or_else(|| ordered.first())
        .copied();
    let kind = match (v2.is_some(), !v1_with_controllers.is_empty()) {
        (true, false) => HierarchyKind::PureV2,
        (true, true) => HierarchyKind::Hybrid,
        (false, true) => HierarchyKind::V1Only,
        (false, false) => HierarchyKind::None,
    };
    let v1_root = v1_with_controllers
        .iter()
        .find(|m| m.super_options.split(',').any(|o| o == "memory"))
        .or_else(|| v1_with_controllers.first())
        .and_then(|m| m.mount_point.parent())
        .map(Path::to_path_buf);
    let own_dir = match (v2, own.as_deref()) {
        (Some(m), Some(own)) => relative_to(own, &m.root).map(|rel| {
            let mut dir = m.mount_point.clone();
            dir.extend(rel.split('/').filter(|c| !c.is_empty()));
            dir
        }),
        _ => None,
    };
    let (unit_dir, unit) = match (&own_dir, own.as_deref()) {
        (Some(dir), Some(own)) => unit_of(dir, own),
        _ => (None, None),
    };
    Hierarchy {
        kind,
        v2_mount: v2.map(|m| m.mount_point.clone()),
        v1_root,
        own,
        own_dir,
        unit_dir,
        unit,
    }
}

/// `own` below the mount's `root`, or `None` when it lies outside.
fn relative_to<'a>(own: &'a str, root: &str) -> Option<&'a str> {
    if root == "/" {
        return Some(own);
    }
    let rest = own.strip_prefix(root)?;
    (rest.is_empty() || rest.starts_with('/')).then_some(rest)
}

/// The unit cgroup of a process in `own`: `own` itself when its name is a
/// unit's, its parent when `own` is that unit's [`DAEMON_LEAF`] (a daemon
/// that already moved).
fn unit_of(own_dir: &Path, own: &str) -> (Option<PathBuf>, Option<String>) {
    let mut parts: Vec<&str> = own.split('/').filter(|c| !c.is_empty()).collect();
    let mut dir = own_dir.to_path_buf();
    if parts.last() == Some(&DAEMON_LEAF)
        && parts.len() >= 2
        && is_unit_name(parts[parts.len() - 2])
    {
        parts.pop();
        dir.pop();
    }
    match parts.last() {
        Some(name) if is_unit_name(name) => (Some(dir), Some((*name).to_owned())),
        _ => (None, None),
    }
}

/// Decides the placement. `override_root` is `--cgroup-root`.
pub fn decide(
    hierarchy: &Hierarchy,
    facts: Facts,
    override_root: Option<&Path>,
    mountinfo_path: &Path,
) -> Result<Placement, DiscoveryError> {
    let v1_root = hierarchy
        .v1_root
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_V1_ROOT));
    let shared = |case: Case, top: PathBuf, reason: String, advice: Option<String>| Placement {
        case,
        top,
        tree: super::TREE.to_owned(),
        daemon_leaf: None,
        v1_root: v1_root.clone(),
        reason,
        advice,
    };
    if let Some(root) = override_root {
        return Ok(shared(
            Case::Override,
            root.to_path_buf(),
            format!("--cgroup-root {} names the directory", root.display()),
            None,
        ));
    }
    let shown = mountinfo_path.display().to_string();
    let v2_mount = match (hierarchy.kind, &hierarchy.v2_mount) {
        (HierarchyKind::V1Only, _) => return Err(DiscoveryError::V1Only { mountinfo: shown }),
        (HierarchyKind::None, _) | (_, None) => {
            return Err(DiscoveryError::NoCgroups { mountinfo: shown })
        }
        (_, Some(mount)) => mount.clone(),
    };
    if hierarchy.kind == HierarchyKind::Hybrid {
        return Ok(shared(
            Case::Hybrid,
            v2_mount.clone(),
            format!(
                "cgroup2 is mounted at {} beside cgroup v1 hierarchies under {} (which hold the \
                 controllers): agents are tracked in v2, limited in v1 where v2 lacks the \
                 controller",
                v2_mount.display(),
                v1_root.display()
            ),
            None,
        ));
    }
    let own = hierarchy.own.clone().unwrap_or_else(|| "?".to_owned());
    match (&hierarchy.unit_dir, &hierarchy.unit, facts.systemd) {
        (Some(unit_dir), Some(unit), true) if facts.delegated => Ok(Placement {
            case: Case::SystemdDelegated,
            top: unit_dir.clone(),
            tree: DELEGATED_TREE.to_owned(),
            daemon_leaf: Some(unit_dir.join(DAEMON_LEAF)),
            v1_root,
            reason: format!(
                "pure cgroup v2 at {} under systemd; {unit} ({}) is delegated to kici-scaler: \
                 it moves itself into {DAEMON_LEAF}/ and creates agents under {DELEGATED_TREE}/",
                v2_mount.display(),
                unit_dir.display()
            ),
            advice: None,
        }),
        (Some(unit_dir), Some(unit), true) => {
            if facts.uid != 0 {
                return Err(DiscoveryError::NotDelegated {
                    own,
                    uid: facts.uid,
                });
            }
            Ok(shared(
                Case::SystemdNotDelegated,
                v2_mount.clone(),
                format!(
                    "pure cgroup v2 at {} under systemd; kici-scaler runs in {unit} ({}), \
                     which is not delegated to it: agents go to {}, outside systemd's tree",
                    v2_mount.display(),
                    unit_dir.display(),
                    v2_mount.join(super::TREE).display()
                ),
                Some(format!(
                    "not delegated: add Delegate=yes to the unit ({unit}), or start kici-scaler \
                     with `systemd-run -p Delegate=yes …`; until then systemd neither accounts \
                     nor stops the agents with the unit, and only root can do this"
                )),
            ))
        }
        _ if facts.systemd => Ok(shared(
            Case::SystemdNotDelegated,
            v2_mount.clone(),
            format!(
                "pure cgroup v2 at {} under systemd; kici-scaler's cgroup {own} is no unit's: \
                 agents go to {}, outside systemd's tree",
                v2_mount.display(),
                v2_mount.join(super::TREE).display()
            ),
            Some(
                "not delegated: run kici-scaler as a unit with Delegate=yes (the packaged \
                 kici-scaler.service), or under `systemd-run -p Delegate=yes …`"
                    .to_owned(),
            ),
        )),
        _ => Ok(shared(
            Case::PureV2,
            v2_mount.clone(),
            format!(
                "pure cgroup v2 at {} without systemd: agents go to {}",
                v2_mount.display(),
                v2_mount.join(super::TREE).display()
            ),
            None,
        )),
    }
}

/// Reads a file of `/proc` for [`placement_of`].
fn read(path: &Path) -> Result<String, DiscoveryError> {
    fs::read_to_string(path).map_err(|e| DiscoveryError::Read {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// Does `dir` carry systemd's delegation mark?
pub fn delegation_mark(dir: &Path) -> bool {
    DELEGATE_XATTRS.iter().any(|name| {
        let mut buf = [0u8; 16];
        match rustix::fs::getxattr(dir, *name, &mut buf[..]) {
            Ok(n) => {
                let value = &buf[..n.min(buf.len())];
                value == b"1" || value == b"1\0"
            }
            Err(_) => false,
        }
    })
}

/// Is this unit cgroup inside a user's service manager
/// (`…/user@<uid>.service/…`)?
fn is_user_manager_unit(dir: &Path) -> bool {
    dir.components().any(|c| {
        c.as_os_str()
            .to_str()
            .is_some_and(|name| name.starts_with("user@") && name.ends_with(".service"))
    })
}

/// Asks the service manager whether `unit` is delegated. The mark on the
/// cgroup is the quick answer, but a user's manager cannot set `trusted.`
/// attributes, and systemd before 254 sets no `user.` one: there the
/// manager's own word is the only one (`systemctl [--user] show
/// -p Delegate`).
fn manager_says_delegated(unit: &str, user_manager: bool) -> bool {
    let mut cmd = std::process::Command::new("systemctl");
    if user_manager {
        cmd.arg("--user");
    }
    cmd.args(["show", "--property=Delegate", "--value", unit])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    cmd.output().is_ok_and(|out| {
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "yes"
    })
}

/// The placement of the process whose `/proc` directory is `proc_dir`
/// (`/proc/self`, or a running daemon's `/proc/<pid>`).
pub fn placement_of(
    proc_dir: &Path,
    override_root: Option<&Path>,
) -> Result<(Hierarchy, Placement), DiscoveryError> {
    let mountinfo_path = proc_dir.join("mountinfo");
    let hierarchy = parse(&read(&mountinfo_path)?, &read(&proc_dir.join("cgroup"))?);
    // /proc/<pid> belongs to the process's effective uid.
    let uid = fs::metadata(proc_dir)
        .map(|m| m.uid())
        .unwrap_or_else(|_| rustix::process::geteuid().as_raw());
    let systemd = Path::new(SYSTEMD_RUNTIME_DIR).is_dir();
    let delegated = match (&hierarchy.unit_dir, &hierarchy.unit) {
        (Some(dir), Some(unit)) if systemd => {
            delegation_mark(dir) || manager_says_delegated(unit, is_user_manager_unit(dir))
        }
        _ => false,
    };
    let facts = Facts {
        systemd,
        delegated,
        uid,
    };
    let placement = decide(&hierarchy, facts, override_root, &mountinfo_path)?;
    Ok((hierarchy, placement))
}

/// This process's placement.
pub fn host_placement(override_root: Option<&Path>) -> Result<Placement, DiscoveryError> {
    placement_of(Path::new("/proc/self"), override_root).map(|(_, p)| p)
}

#[derive(Debug, thiserror::Error)]
pub enum EnterError {
    #[error("cannot create the daemon's own cgroup {}: {source}", path.display())]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot move kici-scaler (pid {pid}) into {}: {source}", path.display())]
    Move {
        path: PathBuf,
        pid: u32,
        source: io::Error,
    },
}

impl Placement {
    /// In the delegated case, moves this whole process (every thread) into
    /// [`Placement::daemon_leaf`], so that the unit's cgroup holds no process
    /// and may enable controllers for the agents' subtree. Returns the pids
    /// still left in the unit's cgroup (a wrapper that did not `exec`, say):
    /// as long as any remain, limits cannot be enabled. Elsewhere a no-op.
    pub fn enter_daemon_leaf(&self) -> Result<Vec<u32>, EnterError> {
        let Some(leaf) = &self.daemon_leaf else {
            return Ok(Vec::new());
        };
        match fs::create_dir(leaf) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(source) => {
                return Err(EnterError::Create {
                    path: leaf.clone(),
                    source,
                })
            }
        }
        let pid = std::process::id();
        let procs = leaf.join("cgroup.procs");
        fs::write(&procs, pid.to_string()).map_err(|source| EnterError::Move {
            path: procs.clone(),
            pid,
            source,
        })?;
        let left = fs::read_to_string(self.top.join("cgroup.procs"))
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default();
        Ok(left)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A CI host of this project: hybrid, no systemd, v1 controllers under
    /// /sys/fs/cgroup, controller-less cgroup2 at /sys/fs/cgroup/unified.
    const HYBRID_MOUNTINFO: &str = include_str!("samples/hybrid-nosystemd.mountinfo");
    const HYBRID_CGROUP: &str = include_str!("samples/hybrid-nosystemd.cgroup");
    /// Debian 12 (kernel 6.1, systemd 252) booted pure v2: the cgroup2 line
    /// as the guest of scripts/vm-test.sh shows it.
    const DEBIAN12_MOUNTINFO: &str = include_str!("samples/debian12-systemd.mountinfo");
    const DEBIAN12_SERVICE: &str = "0::/system.slice/kici-scaler.service\n";
    const DEBIAN12_MOVED: &str = "0::/system.slice/kici-scaler.service/daemon\n";
    const DEBIAN12_SESSION: &str = "0::/user.slice/user-0.slice/session-1.scope\n";
    const DEBIAN12_USER_SCOPE: &str =
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/run-r3b1e.scope\n";
    /// A Docker container on a pure v2 host (private cgroup namespace).
    const CONTAINER_MOUNTINFO: &str = include_str!("samples/docker-v2.mountinfo");
    /// Ubuntu 20.04 / Debian 10: systemd in hybrid mode.
    const HYBRID_SYSTEMD_MOUNTINFO: &str = include_str!("samples/hybrid-systemd.mountinfo");
    const HYBRID_SYSTEMD_CGROUP: &str = include_str!("samples/hybrid-systemd.cgroup");
    /// CentOS 7: v1 only.
    const V1_MOUNTINFO: &str = include_str!("samples/v1-only.mountinfo");
    const V1_CGROUP: &str = include_str!("samples/v1-only.cgroup");

    const ROOT: Facts = Facts {
        systemd: true,
        delegated: false,
        uid: 0,
    };

    fn place(mountinfo: &str, cgroup: &str, facts: Facts) -> Result<Placement, DiscoveryError> {
        decide(
            &parse(mountinfo, cgroup),
            facts,
            None,
            Path::new("/proc/self/mountinfo"),
        )
    }

    #[test]
    fn this_projects_ci_host_is_hybrid_with_todays_paths() {
        let h = parse(HYBRID_MOUNTINFO, HYBRID_CGROUP);
        assert_eq!(h.kind, HierarchyKind::Hybrid);
        assert_eq!(
            h.v2_mount.as_deref(),
            Some(Path::new("/sys/fs/cgroup/unified"))
        );
        assert_eq!(h.v1_root.as_deref(), Some(Path::new("/sys/fs/cgroup")));
        assert_eq!(h.own.as_deref(), Some("/"));
        let p = place(
            HYBRID_MOUNTINFO,
            HYBRID_CGROUP,
            Facts {
                systemd: false,
                ..ROOT
            },
        )
        .unwrap();
        assert_eq!(p.case, Case::Hybrid);
        assert_eq!(
            p.tree_dir(),
            Path::new("/sys/fs/cgroup/unified/kici-scaler")
        );
        assert_eq!(p.v1_root, Path::new("/sys/fs/cgroup"));
        assert_eq!(p.daemon_leaf, None);
        assert_eq!(p.advice, None);
    }

    #[test]
    fn a_hybrid_systemd_host_keeps_todays_paths_even_in_a_delegated_unit() {
        let p = place(
            HYBRID_SYSTEMD_MOUNTINFO,
            HYBRID_SYSTEMD_CGROUP,
            Facts {
                delegated: true,
                ..ROOT
            },
        )
        .unwrap();
        assert_eq!(p.case, Case::Hybrid);
        assert_eq!(
            p.tree_dir(),
            Path::new("/sys/fs/cgroup/unified/kici-scaler")
        );
    }

    #[test]
    fn a_delegated_service_on_pure_v2_gets_its_own_subtree() {
        let h = parse(DEBIAN12_MOUNTINFO, DEBIAN12_SERVICE);
        assert_eq!(h.kind, HierarchyKind::PureV2);
        assert_eq!(h.v2_mount.as_deref(), Some(Path::new("/sys/fs/cgroup")));
        assert_eq!(h.unit.as_deref(), Some("kici-scaler.service"));
        let unit = Path::new("/sys/fs/cgroup/system.slice/kici-scaler.service");
        assert_eq!(h.unit_dir.as_deref(), Some(unit));
        let delegated = Facts {
            delegated: true,
            ..ROOT
        };
        let p = place(DEBIAN12_MOUNTINFO, DEBIAN12_SERVICE, delegated).unwrap();
        assert_eq!(p.case, Case::SystemdDelegated);
        assert_eq!(p.top, unit);
        assert_eq!(p.tree_dir(), unit.join("agents"));
        assert_eq!(
            p.daemon_leaf.as_deref(),
            Some(unit.join("daemon").as_path())
        );
        // A daemon that already moved (or `doctor` reading its /proc/<pid>)
        // finds the same unit.
        assert_eq!(
            place(DEBIAN12_MOUNTINFO, DEBIAN12_MOVED, delegated).unwrap(),
            p
        );
    }

    #[test]
    fn an_undelegated_unit_falls_back_to_the_root_for_root_and_says_what_to_add() {
        let p = place(DEBIAN12_MOUNTINFO, DEBIAN12_SERVICE, ROOT).unwrap();
        assert_eq!(p.case, Case::SystemdNotDelegated);
        assert_eq!(p.tree_dir(), Path::new("/sys/fs/cgroup/kici-scaler"));
        let advice = p.advice.unwrap();
        assert!(
            advice.starts_with("not delegated: add Delegate=yes to the unit (kici-scaler.service)"),
            "{advice}"
        );
        // A login session's scope as root: the same fallback.
        let p = place(DEBIAN12_MOUNTINFO, DEBIAN12_SESSION, ROOT).unwrap();
        assert_eq!(p.case, Case::SystemdNotDelegated);
        assert!(p.reason.contains("session-1.scope"), "{}", p.reason);
    }

    #[test]
    fn a_user_gets_a_delegated_scope_or_a_refusal_saying_how_to_get_one() {
        let user = Facts {
            systemd: true,
            delegated: false,
            uid: 1000,
        };
        let err = place(DEBIAN12_MOUNTINFO, DEBIAN12_USER_SCOPE, user).unwrap_err();
        assert!(matches!(
            err,
            DiscoveryError::NotDelegated { uid: 1000, .. }
        ));
        assert!(
            err.to_string()
                .contains("systemd-run --user --scope -p Delegate=yes"),
            "{err}"
        );
        let p = place(
            DEBIAN12_MOUNTINFO,
            DEBIAN12_USER_SCOPE,
            Facts {
                delegated: true,
                ..user
            },
        )
        .unwrap();
        assert_eq!(p.case, Case::SystemdDelegated);
        assert_eq!(
            p.tree_dir(),
            Path::new(
                "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/app.slice/\
                 run-r3b1e.scope/agents"
            )
        );
    }

    #[test]
    fn pure_v2_without_systemd_uses_the_mount_root() {
        let h = parse(CONTAINER_MOUNTINFO, "0::/\n");
        assert_eq!(h.kind, HierarchyKind::PureV2);
        assert_eq!(h.own_dir.as_deref(), Some(Path::new("/sys/fs/cgroup")));
        let p = place(
            CONTAINER_MOUNTINFO,
            "0::/\n",
            Facts {
                systemd: false,
                ..ROOT
            },
        )
        .unwrap();
        assert_eq!(p.case, Case::PureV2);
        assert_eq!(p.tree_dir(), Path::new("/sys/fs/cgroup/kici-scaler"));
    }

    #[test]
    fn v1_only_and_cgroup_less_hosts_are_refused_with_the_fix() {
        let err = place(V1_MOUNTINFO, V1_CGROUP, ROOT).unwrap_err();
        assert!(matches!(err, DiscoveryError::V1Only { .. }));
        assert!(
            err.to_string()
                .contains("systemd.unified_cgroup_hierarchy=1"),
            "{err}"
        );
        let err = place("", "", ROOT).unwrap_err();
        assert!(matches!(err, DiscoveryError::NoCgroups { .. }));
    }

    #[test]
    fn the_override_wins_everywhere_but_keeps_the_v1_root() {
        let p = decide(
            &parse(HYBRID_MOUNTINFO, HYBRID_CGROUP),
            ROOT,
            Some(Path::new("/srv/cg")),
            Path::new("/proc/self/mountinfo"),
        )
        .unwrap();
        assert_eq!(p.case, Case::Override);
        assert_eq!(p.tree_dir(), Path::new("/srv/cg/kici-scaler"));
        assert_eq!(p.v1_root, Path::new("/sys/fs/cgroup"));
        // Even on a host whose own discovery would refuse.
        let p = decide(
            &parse(V1_MOUNTINFO, V1_CGROUP),
            ROOT,
            Some(Path::new("/srv/cg")),
            Path::new("/proc/self/mountinfo"),
        )
        .unwrap();
        assert_eq!(p.case, Case::Override);
    }

    #[test]
    fn a_cgroup_outside_the_mounted_subtree_has_no_directory() {
        // A bind mount of a sub-hierarchy: only cgroups below its root are
        // reachable through it.
        let mountinfo = "30 25 0:26 /lxc/c1 /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n";
        let h = parse(mountinfo, "0::/lxc/c1/init.scope\n");
        assert_eq!(
            h.own_dir.as_deref(),
            Some(Path::new("/sys/fs/cgroup/init.scope"))
        );
        let h = parse(mountinfo, "0::/elsewhere\n");
        assert_eq!(h.own_dir, None);
        assert_eq!(h.unit_dir, None);
    }

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape(r"/mnt/with\040space"), "/mnt/with space");
        assert_eq!(unescape(r"/a\\b"), r"/a\\b");
        assert_eq!(unescape(r"/end\04"), r"/end\04");
        let mountinfo =
            "40 31 0:38 / /srv/cg\\040v2 rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            parse(mountinfo, "0::/\n").v2_mount.as_deref(),
            Some(Path::new("/srv/cg v2"))
        );
    }

    #[test]
    fn units_of_a_users_manager_are_told_apart() {
        assert!(is_user_manager_unit(Path::new(
            "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/app.slice/run-r1.scope"
        )));
        assert!(!is_user_manager_unit(Path::new(
            "/sys/fs/cgroup/system.slice/kici-scaler.service"
        )));
    }

    #[test]
    fn the_daemon_leaf_is_entered_on_a_plain_directory() {
        let dir = tempfile::tempdir().unwrap();
        let unit = dir.path().join("kici-scaler.service");
        fs::create_dir(&unit).unwrap();
        fs::write(unit.join("cgroup.procs"), "").unwrap();
        let p = Placement {
            case: Case::SystemdDelegated,
            top: unit.clone(),
            tree: DELEGATED_TREE.to_owned(),
            daemon_leaf: Some(unit.join(DAEMON_LEAF)),
            v1_root: PathBuf::from(DEFAULT_V1_ROOT),
            reason: String::new(),
            advice: None,
        };
        assert_eq!(p.enter_daemon_leaf().unwrap(), Vec::<u32>::new());
        assert_eq!(
            fs::read_to_string(unit.join("daemon/cgroup.procs")).unwrap(),
            std::process::id().to_string()
        );
        // Elsewhere nothing moves.
        let shared = Placement {
            daemon_leaf: None,
            ..p
        };
        assert!(shared.enter_daemon_leaf().unwrap().is_empty());
    }
}
