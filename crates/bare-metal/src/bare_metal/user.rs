//! Who an agent runs as: a scaler's `x-kici-scaler.user` / `.group`,
//! resolved on this host ([`Credentials::resolve`]), and the switch to it in
//! the child between fork and exec ([`Switch::apply`]).
//!
//! The switch drops the daemon's user for good (real, effective and saved
//! ids, and the supplementary groups): the agent cannot read the daemon's
//! state dir (mode 0700), its `/proc/<pid>/environ` (the kernel's ptrace
//! access check refuses another uid), other agents' work dirs, or signal the
//! daemon. It is a separate user, not a sandbox: the agent still sees
//! whatever that user may see on the host.

use kici_model::AgentUser;
use nix::unistd::{Group, User};
use rustix::process::{Gid, Uid};
use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Linux capability numbers (`linux/capability.h`).
const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;

/// A named user, resolved: its ids and groups, and whether this daemon
/// switches to it (it is not already that user).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups: every group the user is a member of (as
    /// `initgroups(3)` would set them), the primary group included.
    pub groups: Vec<u32>,
    /// The user's home directory from its passwd entry.
    pub home: PathBuf,
    /// `false` when the daemon already runs as exactly this user and group
    /// (an unprivileged daemon naming itself): nothing to switch.
    pub switch: bool,
}

/// Why a scaler's agent user cannot be used. Each names the field path.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("x-kici-scaler.user: no user {0:?} on this host")]
    UnknownUser(String),
    #[error("x-kici-scaler.group: no group {0:?} on this host")]
    UnknownGroup(String),
    #[error("x-kici-scaler.{field}: cannot look up {name:?}: {source}")]
    Lookup {
        field: &'static str,
        name: String,
        source: nix::Error,
    },
    #[error("x-kici-scaler.user: cannot list the groups of {name:?}: {source}")]
    Groups { name: String, source: nix::Error },
    #[error(
        "x-kici-scaler.user: agents cannot run as {name:?} (uid {uid}, gid {gid}): this daemon runs as uid {daemon_uid}, gid {daemon_gid} without CAP_SETUID and CAP_SETGID; run kici-scaler as root (the packaged service does) or drop x-kici-scaler.user"
    )]
    NotPermitted {
        name: String,
        uid: u32,
        gid: u32,
        daemon_uid: u32,
        daemon_gid: u32,
    },
}

impl Credentials {
    /// Looks `spec` up (`getpwnam_r`, `getgrnam_r`, `getgrouplist`) and
    /// checks this daemon may become it. Blocking (NSS).
    pub fn resolve(spec: &AgentUser) -> Result<Self, UserError> {
        let user = User::from_name(&spec.user)
            .map_err(|source| UserError::Lookup {
                field: "user",
                name: spec.user.clone(),
                source,
            })?
            .ok_or_else(|| UserError::UnknownUser(spec.user.clone()))?;
        let gid = match &spec.group {
            None => user.gid,
            Some(name) => {
                Group::from_name(name)
                    .map_err(|source| UserError::Lookup {
                        field: "group",
                        name: name.clone(),
                        source,
                    })?
                    .ok_or_else(|| UserError::UnknownGroup(name.clone()))?
                    .gid
            }
        };
        // The config loader refuses names with NUL (control characters).
        let c_name = CString::new(spec.user.as_bytes())
            .map_err(|_| UserError::UnknownUser(spec.user.clone()))?;
        let mut groups: Vec<u32> = nix::unistd::getgrouplist(&c_name, gid)
            .map_err(|source| UserError::Groups {
                name: spec.user.clone(),
                source,
            })?
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        groups.sort_unstable();
        groups.dedup();
        let uid = user.uid.as_raw();
        let gid = gid.as_raw();
        let daemon_uid = rustix::process::geteuid().as_raw();
        let daemon_gid = rustix::process::getegid().as_raw();
        let switch = if may_switch_ids() {
            true
        } else if uid == daemon_uid && gid == daemon_gid {
            false
        } else {
            return Err(UserError::NotPermitted {
                name: spec.user.clone(),
                uid,
                gid,
                daemon_uid,
                daemon_gid,
            });
        };
        Ok(Self {
            name: spec.user.clone(),
            uid,
            gid,
            groups,
            home: user.dir,
            switch,
        })
    }

    /// What the child does before exec; `None` when there is nothing to
    /// switch.
    pub fn switch(&self) -> Option<Switch> {
        self.switch.then(|| Switch {
            uid: Uid::from_raw(self.uid),
            gid: Gid::from_raw(self.gid),
            groups: self.groups.iter().map(|g| Gid::from_raw(*g)).collect(),
        })
    }

    /// The first directory on the way to `path` this user may not search,
    /// or `path` itself when the user lacks `last_bits` on it (`rwx` bits
    /// as `0o4`/`0o2`/`0o1`), with its mode and owner. Root may go anywhere.
    pub fn denied_on_path(&self, path: &Path, last_bits: u32) -> Option<Denied> {
        if self.uid == 0 {
            return None;
        }
        let mut steps: Vec<&Path> = path.ancestors().collect();
        steps.reverse();
        let last = steps.len().saturating_sub(1);
        for (i, step) in steps.into_iter().enumerate() {
            let Ok(meta) = std::fs::metadata(step) else {
                // Missing: created later by the daemon, or reported elsewhere.
                return None;
            };
            let bits = if i == last { last_bits } else { 0o1 };
            let granted = if meta.uid() == self.uid {
                (meta.mode() >> 6) & 0o7
            } else if self.gid == meta.gid() || self.groups.contains(&meta.gid()) {
                (meta.mode() >> 3) & 0o7
            } else {
                meta.mode() & 0o7
            };
            if granted & bits != bits {
                return Some(Denied {
                    path: step.to_owned(),
                    mode: meta.mode() & 0o7777,
                    uid: meta.uid(),
                    gid: meta.gid(),
                });
            }
        }
        None
    }
}

/// A directory or file a user may not reach, as [`Credentials::denied_on_path`]
/// found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    pub path: PathBuf,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is mode {:04o}, owned by uid {} gid {}",
            self.path.display(),
            self.mode,
            self.uid,
            self.gid
        )
    }
}

/// Whether this process may set any uid and gid: root, or CAP_SETUID and
/// CAP_SETGID in its effective set (a unit granting them to another user).
fn may_switch_ids() -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|eff| eff & (1 << CAP_SETUID) != 0 && eff & (1 << CAP_SETGID) != 0)
}

/// The ids the child takes, prepared before the fork: the child itself
/// must not allocate.
#[derive(Debug, Clone)]
pub struct Switch {
    uid: Uid,
    gid: Gid,
    groups: Vec<Gid>,
}

impl Switch {
    /// `setgroups`, `setresgid`, `setresuid` — in that order, since the
    /// last one gives up the right to do the others.
    ///
    /// Only between fork and exec: these are the raw system calls, which on
    /// Linux change the calling thread only — exactly the process in a
    /// freshly forked (single-threaded) child, whereas the C library's
    /// wrappers would try to signal the parent's other threads. No
    /// allocation, no lock: async-signal-safe.
    pub fn apply(&self) -> Result<(), rustix::io::Errno> {
        rustix::thread::set_thread_groups(&self.groups)?;
        rustix::thread::set_thread_res_gid(self.gid, self.gid, self.gid)?;
        rustix::thread::set_thread_res_uid(self.uid, self.uid, self.uid)
    }
}
