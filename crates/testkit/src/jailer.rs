//! `fake-jailer`: Firecracker's jailer contract, for tests.
//!
//! What it does, in the real jailer's order (docs/jailer.md, src/jailer/src/env.rs):
//! validate the arguments (`--id` 1..=64 of `[A-Za-z0-9-]`, `--exec-file` an
//! existing file whose canonical name contains `firecracker`, `--chroot-base-dir`
//! an existing directory, numeric `--uid/--gid`, cgroup and resource-limit
//! syntax); create `<chroot_base>/<exec_file_name>/<id>/root`; put the exec file
//! into it (hard link, copy across file systems); join `--netns`; set resource
//! limits (`no-file` defaults to 2048); create the cgroups and move itself in;
//! chroot; create `/`, `/dev`, `/dev/net`, `/run` 0700 owned by uid:gid;
//! `mknod` `/dev/net/tun` and `/dev/kvm` 0600 owned by uid:gid (fails when they
//! exist: a chroot cannot be reused); clear the environment; with
//! `--daemonize` start a new session with stdio on `/dev/null`; with
//! `--new-pid-ns` fork into a new PID namespace, write the child's pid to
//! `/<exec_file_name>.pid` (create-new) and exit 0, otherwise exec in place. The
//! exec file runs as uid:gid with `--id <id> --start-time-us … --start-time-cpu-us
//! … --parent-cpu-time-us …` followed by the arguments after `--`.
//!
//! Test-only knobs (read before the environment is cleared; the real jailer has none):
//! - `KICI_TESTKIT_CGROUP_ROOT=<dir>`: cgroups are created under this directory
//!   instead of the host's cgroup mounts (v2: `<dir>/<parent>/<id>`, v1:
//!   `<dir>/<controller>/<parent>/<id>`), so tests need not touch the real hierarchy.
//!   The same path may instead be written into a file `testkit-cgroup-root` next
//!   to the fake-jailer binary (for callers that clear the jailer's environment).
//! - `KICI_TESTKIT_GUEST_DIR=<dir>`, or a directory `testkit-guest` next to the
//!   fake-jailer binary: its `guest-agent`, `testkit-guest-mode` and `testkit-vmm-mode` files are put
//!   into the jail, where `fc-sim`'s simulated guest finds them.
//!
//! Deviations: a plain `chroot` instead of a mount namespace plus `pivot_root`;
//! inherited file descriptors above 2 are not closed (std opens everything
//! close-on-exec); no NUMA `--node`, no landlock.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::sys::resource::{setrlimit, Resource};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{chown, Gid, Uid};

use crate::guest::{GUEST_AGENT_FILE, GUEST_MODE_FILE, VMM_MODE_FILE};
use crate::sim::validate_instance_id;

/// Env override for the cgroup root (test only).
pub const CGROUP_ROOT_ENV: &str = "KICI_TESTKIT_CGROUP_ROOT";
/// File next to the fake-jailer binary holding the cgroup root override (test only).
pub const CGROUP_ROOT_FILE: &str = "testkit-cgroup-root";
/// Env naming a directory whose guest files are put into the jail (test only).
pub const GUEST_DIR_ENV: &str = "KICI_TESTKIT_GUEST_DIR";
/// Directory next to the fake-jailer binary with guest files (test only).
pub const GUEST_DIR_BESIDE_JAILER: &str = "testkit-guest";
/// The jailer's default `--resource-limit no-file`.
pub const DEFAULT_NO_FILE: u64 = 2048;

/// Everything that makes the jailer stop.
#[derive(Debug, thiserror::Error)]
pub enum JailerError {
    #[error("Arguments parsing error: Found argument '{0}' which wasn't expected, or isn't valid in this context.")]
    UnexpectedArgument(String),
    #[error("Arguments parsing error: Argument '{0}' required, but not found.")]
    MissingArgument(&'static str),
    #[error(
        "Arguments parsing error: The argument '{0}' requires a value, but none was supplied."
    )]
    MissingValue(String),
    #[error("Arguments parsing error: The argument '{0}' was provided more than once.")]
    Duplicate(String),
    #[error("Invalid instance ID: {0}")]
    InvalidInstanceId(String),
    #[error("Failed to canonicalize path {0}: {1}")]
    Canonicalize(PathBuf, std::io::Error),
    #[error("{0} is not a file")]
    NotAFile(PathBuf),
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
    #[error(
        "Invalid filename. The filename of `--exec-file` option must contain \"firecracker\": {0}"
    )]
    ExecFileName(String),
    #[error("Invalid uid: {0}")]
    Uid(String),
    #[error("Invalid gid: {0}")]
    Gid(String),
    #[error("Invalid format for cgroups: {0}")]
    CgroupFormat(String),
    #[error("Invalid cgroup version: {0}")]
    CgroupVersion(String),
    #[error("Parent cgroup path is invalid. Path should not be absolute or contain '..' or '.'")]
    CgroupParentPath,
    #[error("Cgroup error: {0}")]
    Cgroup(String),
    #[error("Invalid format for resources limits: {0}")]
    ResLimitFormat(String),
    #[error("Invalid limit value for resource: {0}: {1}")]
    ResLimitValue(String, String),
    #[error("Invalid resource argument: {0}")]
    ResLimitArgument(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("{0}: {1}")]
    Sys(String, nix::Error),
    #[error("Failed to exec into Firecracker: {0}")]
    Exec(std::io::Error),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JailerError {
    let what = what.into();
    move |e| JailerError::Io(what, e)
}

fn sys(what: impl Into<String>) -> impl FnOnce(nix::Error) -> JailerError {
    let what = what.into();
    move |e| JailerError::Sys(what, e)
}

/// One `--cgroup <file>=<value>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupSetting {
    pub file: String,
    pub value: String,
}

impl CgroupSetting {
    fn controller(&self) -> &str {
        self.file.split('.').next().unwrap_or(&self.file)
    }
}

/// Validated jailer arguments.
#[derive(Debug, Clone)]
pub struct JailerArgs {
    pub id: String,
    pub exec_file: PathBuf,
    pub exec_file_name: String,
    pub chroot_base: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub netns: Option<PathBuf>,
    pub daemonize: bool,
    pub new_pid_ns: bool,
    pub cgroups: Vec<CgroupSetting>,
    pub cgroup_version: u8,
    pub parent_cgroup: String,
    pub no_file: u64,
    pub fsize: Option<u64>,
    pub extra_args: Vec<String>,
}

impl JailerArgs {
    /// `<chroot_base>/<exec_file_name>/<id>/root`.
    pub fn chroot_dir(&self) -> PathBuf {
        self.chroot_base
            .join(&self.exec_file_name)
            .join(&self.id)
            .join("root")
    }

    pub fn parse(args: &[String]) -> Result<Self, JailerError> {
        const SINGLE: &[&str] = &[
            "id",
            "exec-file",
            "uid",
            "gid",
            "chroot-base-dir",
            "netns",
            "cgroup-version",
            "parent-cgroup",
        ];
        const MULTI: &[&str] = &["cgroup", "resource-limit"];
        const FLAGS: &[&str] = &["daemonize", "new-pid-ns"];
        let mut single: BTreeMap<&str, String> = BTreeMap::new();
        let mut multi: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let mut flags: Vec<&str> = Vec::new();
        let mut extra = Vec::new();
        let mut i = 0;
        while i < args.len() {
            let a = args[i].as_str();
            if a == "--" {
                extra = args[i + 1..].to_vec();
                break;
            }
            let name = a
                .strip_prefix("--")
                .ok_or_else(|| JailerError::UnexpectedArgument(a.to_string()))?;
            if let Some(k) = SINGLE.iter().find(|k| **k == name) {
                let v = value_of(args, i, name)?;
                if single.insert(k, v).is_some() {
                    return Err(JailerError::Duplicate(name.to_string()));
                }
                i += 2;
            } else if let Some(k) = MULTI.iter().find(|k| **k == name) {
                let v = value_of(args, i, name)?;
                multi.entry(k).or_default().push(v);
                i += 2;
            } else if let Some(k) = FLAGS.iter().find(|k| **k == name) {
                if flags.contains(k) {
                    return Err(JailerError::Duplicate(name.to_string()));
                }
                flags.push(k);
                i += 1;
            } else {
                return Err(JailerError::UnexpectedArgument(a.to_string()));
            }
        }

        let id = single
            .remove("id")
            .ok_or(JailerError::MissingArgument("id"))?;
        validate_instance_id(&id).map_err(JailerError::InvalidInstanceId)?;
        let exec_raw = single
            .remove("exec-file")
            .ok_or(JailerError::MissingArgument("exec-file"))?;
        let exec_file = fs::canonicalize(&exec_raw)
            .map_err(|e| JailerError::Canonicalize(PathBuf::from(&exec_raw), e))?;
        if !exec_file.is_file() {
            return Err(JailerError::NotAFile(exec_file));
        }
        let exec_file_name = exec_file
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if !exec_file_name.contains("firecracker") {
            return Err(JailerError::ExecFileName(exec_file_name));
        }
        let base_raw = single
            .remove("chroot-base-dir")
            .unwrap_or_else(|| "/srv/jailer".to_string());
        let chroot_base = fs::canonicalize(&base_raw)
            .map_err(|e| JailerError::Canonicalize(PathBuf::from(&base_raw), e))?;
        if !chroot_base.is_dir() {
            return Err(JailerError::NotADirectory(chroot_base));
        }
        let uid_raw = single
            .remove("uid")
            .ok_or(JailerError::MissingArgument("uid"))?;
        let uid = uid_raw
            .parse::<u32>()
            .map_err(|_| JailerError::Uid(uid_raw))?;
        let gid_raw = single
            .remove("gid")
            .ok_or(JailerError::MissingArgument("gid"))?;
        let gid = gid_raw
            .parse::<u32>()
            .map_err(|_| JailerError::Gid(gid_raw))?;

        let parent_cgroup = single
            .remove("parent-cgroup")
            .unwrap_or_else(|| exec_file_name.clone());
        if Path::new(&parent_cgroup).components().any(|c| {
            matches!(
                c,
                Component::CurDir | Component::ParentDir | Component::RootDir
            )
        }) {
            return Err(JailerError::CgroupParentPath);
        }
        let version_raw = single
            .remove("cgroup-version")
            .unwrap_or_else(|| "1".to_string());
        let cgroup_version = match version_raw.parse::<u8>() {
            Ok(v @ (1 | 2)) => v,
            _ => return Err(JailerError::CgroupVersion(version_raw)),
        };
        let mut cgroups = Vec::new();
        for cg in multi.remove("cgroup").unwrap_or_default() {
            match cg.split_once('=') {
                Some((file, value))
                    if !file.is_empty()
                        && !value.is_empty()
                        && !value.contains('=')
                        && file.contains('.') =>
                {
                    cgroups.push(CgroupSetting {
                        file: file.to_string(),
                        value: value.to_string(),
                    });
                }
                _ => return Err(JailerError::CgroupFormat(cg)),
            }
        }
        let mut no_file = DEFAULT_NO_FILE;
        let mut fsize = None;
        for rl in multi.remove("resource-limit").unwrap_or_default() {
            let (name, value) = rl
                .split_once('=')
                .ok_or_else(|| JailerError::ResLimitFormat(rl.clone()))?;
            let v = value
                .parse::<u64>()
                .map_err(|e| JailerError::ResLimitValue(value.to_string(), e.to_string()))?;
            match name {
                "no-file" => no_file = v,
                "fsize" => fsize = Some(v),
                other => return Err(JailerError::ResLimitArgument(other.to_string())),
            }
        }
        Ok(Self {
            id,
            exec_file,
            exec_file_name,
            chroot_base,
            uid,
            gid,
            netns: single.remove("netns").map(PathBuf::from),
            daemonize: flags.contains(&"daemonize"),
            new_pid_ns: flags.contains(&"new-pid-ns"),
            cgroups,
            cgroup_version,
            parent_cgroup,
            no_file,
            fsize,
            extra_args: extra,
        })
    }

    /// The directories the cgroups go to (for cleanup assertions).
    pub fn cgroup_dirs(&self, root_override: Option<&Path>) -> Result<Vec<PathBuf>, JailerError> {
        let mut dirs = Vec::new();
        for cg in &self.cgroups {
            let dir = self.cgroup_dir(cg, root_override)?;
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        Ok(dirs)
    }

    fn cgroup_dir(
        &self,
        cg: &CgroupSetting,
        root_override: Option<&Path>,
    ) -> Result<PathBuf, JailerError> {
        let base = match (root_override, self.cgroup_version) {
            (Some(root), 2) => root.to_path_buf(),
            (Some(root), _) => root.join(cg.controller()),
            (None, v) => cgroup_mount(v, cg.controller())?,
        };
        Ok(base.join(&self.parent_cgroup).join(&self.id))
    }
}

fn value_of(args: &[String], i: usize, name: &str) -> Result<String, JailerError> {
    args.get(i + 1)
        .filter(|v| !v.starts_with("--"))
        .cloned()
        .ok_or_else(|| JailerError::MissingValue(name.to_string()))
}

/// The mount point of the cgroup hierarchy for `controller` (v1) or the unified one (v2).
fn cgroup_mount(version: u8, controller: &str) -> Result<PathBuf, JailerError> {
    let mounts = fs::read_to_string("/proc/mounts").map_err(io("reading /proc/mounts"))?;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [_, target, fstype, options, ..] = f.as_slice() else {
            continue;
        };
        if version == 2 && *fstype == "cgroup2" {
            return Ok(PathBuf::from(target));
        }
        if version == 1 && *fstype == "cgroup" && options.split(',').any(|o| o == controller) {
            return Ok(PathBuf::from(target));
        }
    }
    Err(JailerError::Cgroup(format!(
        "no cgroup v{version} hierarchy found for controller {controller}"
    )))
}

fn write_file(path: &Path, value: &str) -> Result<(), JailerError> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(io(format!("Failed to write to {}", path.display())))
}

fn setup_cgroups(args: &JailerArgs, root_override: Option<&Path>) -> Result<(), JailerError> {
    let me = std::process::id().to_string();
    let mut joined = Vec::new();
    for cg in &args.cgroups {
        let dir = args.cgroup_dir(cg, root_override)?;
        if args.cgroup_version == 2 {
            // v2: enable the controller along the path to the parent.
            let mount = match root_override {
                Some(r) => r.to_path_buf(),
                None => cgroup_mount(2, cg.controller())?,
            };
            let mut level = mount.clone();
            for part in Path::new(&args.parent_cgroup).components() {
                fs::create_dir_all(&level)
                    .map_err(io(format!("Failed to create {}", level.display())))?;
                write_file(
                    &level.join("cgroup.subtree_control"),
                    &format!("+{}", cg.controller()),
                )?;
                level.push(part);
            }
            fs::create_dir_all(&level)
                .map_err(io(format!("Failed to create {}", level.display())))?;
            write_file(
                &level.join("cgroup.subtree_control"),
                &format!("+{}", cg.controller()),
            )?;
        }
        fs::create_dir_all(&dir).map_err(io(format!("Failed to create {}", dir.display())))?;
        write_file(&dir.join(&cg.file), &cg.value)?;
        if !joined.contains(&dir) {
            joined.push(dir);
        }
    }
    for dir in joined {
        let procs = if args.cgroup_version == 2 {
            "cgroup.procs"
        } else {
            "tasks"
        };
        write_file(&dir.join(procs), &me)?;
    }
    Ok(())
}

/// Put the exec file into the jail: hard link, copy when linking is impossible.
fn place_file(src: &Path, dst: &Path) -> Result<(), JailerError> {
    if dst.exists() {
        fs::remove_file(dst).map_err(io(format!("Failed to replace {}", dst.display())))?;
    }
    if fs::hard_link(src, dst).is_err() {
        fs::copy(src, dst).map_err(io(format!(
            "Failed to copy {} to {}",
            src.display(),
            dst.display()
        )))?;
    }
    Ok(())
}

fn jailed_folder(path: &str, uid: u32, gid: u32) -> Result<(), JailerError> {
    fs::create_dir_all(path).map_err(io(format!("Failed to create directory {path}")))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o700))
        .map_err(io(format!("Failed to change permissions on {path}")))?;
    chown(path, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
        .map_err(sys(format!("Failed to change owner for {path}")))
}

fn mknod_and_own(
    path: &str,
    major: u64,
    minor: u64,
    uid: u32,
    gid: u32,
) -> Result<(), JailerError> {
    mknod(
        path,
        SFlag::S_IFCHR,
        Mode::S_IRUSR | Mode::S_IWUSR,
        makedev(major, minor),
    )
    .map_err(sys(format!(
        "Failed to create {path} via mknod inside the jail"
    )))?;
    chown(path, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
        .map_err(sys(format!("Failed to change owner for {path}")))
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Run the jailer; returns the exit code (only when it does not exec).
pub fn main_with_args(args: &[String]) -> i32 {
    match run(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("Jailer error: {e}");
            1
        }
    }
}

/// `KICI_TESTKIT_CGROUP_ROOT`, else the path in `testkit-cgroup-root` next to the binary
/// (for backends that spawn the jailer with a cleared environment).
fn cgroup_root_override() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os(CGROUP_ROOT_ENV) {
        return Some(PathBuf::from(d));
    }
    let exe = std::env::current_exe().ok()?;
    let text = fs::read_to_string(exe.parent()?.join(CGROUP_ROOT_FILE)).ok()?;
    let path = text.trim();
    (!path.is_empty()).then(|| PathBuf::from(path))
}

fn guest_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os(GUEST_DIR_ENV) {
        return Some(PathBuf::from(d));
    }
    let exe = std::env::current_exe().ok()?;
    let beside = exe.parent()?.join(GUEST_DIR_BESIDE_JAILER);
    beside.is_dir().then_some(beside)
}

fn run(raw: &[String]) -> Result<(), JailerError> {
    let start_us = now_us();
    let args = JailerArgs::parse(raw)?;
    let cgroup_root = cgroup_root_override();
    let guest_files = guest_dir();

    let chroot_dir = args.chroot_dir();
    fs::create_dir_all(&chroot_dir).map_err(io(format!(
        "Failed to create directory {}",
        chroot_dir.display()
    )))?;
    place_file(&args.exec_file, &chroot_dir.join(&args.exec_file_name))?;
    if let Some(dir) = &guest_files {
        for name in [GUEST_AGENT_FILE, GUEST_MODE_FILE, VMM_MODE_FILE] {
            let src = dir.join(name);
            if src.exists() {
                place_file(&src, &chroot_dir.join(name))?;
            }
        }
    }

    if let Some(netns) = &args.netns {
        let f = fs::File::open(netns).map_err(io(format!("Failed to open {}", netns.display())))?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(sys("Failed to join network namespace"))?;
    }
    setrlimit(Resource::RLIMIT_NOFILE, args.no_file, args.no_file)
        .map_err(sys("Failed to set the no-file resource limit"))?;
    if let Some(fsize) = args.fsize {
        setrlimit(Resource::RLIMIT_FSIZE, fsize, fsize)
            .map_err(sys("Failed to set the fsize resource limit"))?;
    }
    setup_cgroups(&args, cgroup_root.as_deref())?;

    let dev_null = if args.daemonize {
        Some(
            OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
                .map_err(io("Failed to open /dev/null"))?,
        )
    } else {
        None
    };

    nix::unistd::chroot(&chroot_dir).map_err(sys(format!(
        "Failed to chroot into {}",
        chroot_dir.display()
    )))?;
    std::env::set_current_dir("/").map_err(io("Failed to chdir into the chroot root"))?;
    for folder in ["/", "/dev", "/dev/net", "/run"] {
        jailed_folder(folder, args.uid, args.gid)?;
    }
    mknod_and_own("/dev/net/tun", 10, 200, args.uid, args.gid)?;
    mknod_and_own("/dev/kvm", 10, 232, args.uid, args.gid)?;

    // The real jailer clears its environment before exec.
    let mut command = Command::new(PathBuf::from("/").join(&args.exec_file_name));
    command
        .env_clear()
        .args(["--id", &args.id])
        .args(["--start-time-us", &start_us.to_string()])
        .args(["--start-time-cpu-us", "0"])
        .args([
            "--parent-cpu-time-us",
            &now_us().saturating_sub(start_us).to_string(),
        ])
        .args(&args.extra_args)
        .uid(args.uid)
        .gid(args.gid);

    if let Some(null) = dev_null {
        nix::unistd::setsid().map_err(sys("Failed to daemonize: setsid"))?;
        let out = null
            .try_clone()
            .map_err(io("Failed to duplicate /dev/null"))?;
        let err = null
            .try_clone()
            .map_err(io("Failed to duplicate /dev/null"))?;
        command
            .stdin(Stdio::from(null))
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
    }

    if args.new_pid_ns {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID)
            .map_err(sys("Failed to create a new PID namespace"))?;
        let child = command.spawn().map_err(JailerError::Exec)?;
        let pid_file = format!("/{}.pid", args.exec_file_name);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&pid_file)
            .map_err(io(format!("Failed to open file {pid_file}")))?;
        write!(f, "{}", child.id()).map_err(io(format!("Failed to write to {pid_file}")))?;
        // Like the real jailer, exit at once: the VMM is not our child to supervise.
        return Ok(());
    }
    Err(JailerError::Exec(command.exec()))
}

#[cfg(test)]
mod firecracker_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn argument_rules() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("firecracker");
        fs::write(&exe, b"x").unwrap();
        let base = dir.path().display();
        let ok = JailerArgs::parse(&argv(&format!(
            "--id vm-1 --exec-file {} --uid 10 --gid 11 --chroot-base-dir {base} --new-pid-ns --cgroup cpu.weight=50 --cgroup-version 2 -- --api-sock /run/x --level Warning",
            exe.display()
        )))
        .unwrap();
        assert_eq!(
            ok.chroot_dir(),
            dir.path()
                .canonicalize()
                .unwrap()
                .join("firecracker/vm-1/root")
        );
        assert_eq!(ok.extra_args, argv("--api-sock /run/x --level Warning"));
        assert_eq!(ok.parent_cgroup, "firecracker");
        let bad = |s: String| JailerArgs::parse(&argv(&s)).unwrap_err();
        assert!(matches!(
            bad(format!(
                "--id bad_id --exec-file {} --uid 1 --gid 1 --chroot-base-dir {base}",
                exe.display()
            )),
            JailerError::InvalidInstanceId(_)
        ));
        assert!(matches!(
            bad(format!(
                "--id {} --exec-file {} --uid 1 --gid 1 --chroot-base-dir {base}",
                "a".repeat(65),
                exe.display()
            )),
            JailerError::InvalidInstanceId(_)
        ));
        assert!(matches!(
            bad(format!(
                "--id a --exec-file {} --uid 1 --gid 1 --chroot-base-dir {base} --bogus",
                exe.display()
            )),
            JailerError::UnexpectedArgument(_)
        ));
        assert!(matches!(
            bad(format!(
                "--id a --exec-file {base} --uid 1 --gid 1 --chroot-base-dir {base}"
            )),
            JailerError::NotAFile(_)
        ));
        let other = dir.path().join("vmm");
        fs::write(&other, b"x").unwrap();
        assert!(matches!(
            bad(format!(
                "--id a --exec-file {} --uid 1 --gid 1 --chroot-base-dir {base}",
                other.display()
            )),
            JailerError::ExecFileName(_)
        ));
        assert!(matches!(
            bad(format!(
                "--id a --exec-file {} --uid x --gid 1 --chroot-base-dir {base}",
                exe.display()
            )),
            JailerError::Uid(_)
        ));
        assert!(matches!(
            bad(format!(
                "--id a --exec-file {} --uid 1 --gid 1 --chroot-base-dir {base} --cgroup nodot",
                exe.display()
            )),
            JailerError::CgroupFormat(_)
        ));
        assert!(matches!(
            bad(format!("--id a --exec-file {} --uid 1 --gid 1 --chroot-base-dir {base} --parent-cgroup ../x", exe.display())),
            JailerError::CgroupParentPath
        ));
        assert!(matches!(
            bad(format!("--id a --exec-file {} --uid 1 --gid 1 --chroot-base-dir {base} --resource-limit cpu=1", exe.display())),
            JailerError::ResLimitArgument(_)
        ));
        assert!(matches!(
            bad(format!("--exec-file {} --uid 1 --gid 1", exe.display())),
            JailerError::MissingArgument("id")
        ));
    }
}
