//! The daemon instance's identity and its state directory.
//!
//! This module owns `--state-dir` (default [`DEFAULT_STATE_DIR`]): creating
//! it, holding its lock for the whole life of the process, and the files that
//! make the instance identifiable:
//!
//! - `lock`: an exclusive `flock` held while the [`StateDir`] lives, so only
//!   one daemon uses a state dir; the holder writes its pid into it so a
//!   second starter can say who is in the way.
//! - `instance-id`: 8 lowercase hex ([`InstanceId`]), minted on first start.
//!   Every resource and row the daemon creates carries it as its owner.
//! - `machine-id`: a copy of the host's `/etc/machine-id`. When the live one
//!   differs, this state dir was copied from another machine (a cloned image)
//!   and its instance id would be shared by two hosts, each sweeping the
//!   other's resources; start is refused unless the operator asks for a reset.
//!
//! Files are replaced atomically (temp file, fsync, rename, fsync of the dir),
//! so a crash never leaves a half-written identity.

use kici_model::{IdError, InstanceId};
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Where the daemon keeps its state unless told otherwise.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/kici-scaler";

/// The host's machine id, as systemd and D-Bus define it.
pub const HOST_MACHINE_ID: &str = "/etc/machine-id";

/// File names inside the state dir.
pub const LOCK_FILE: &str = "lock";
pub const INSTANCE_ID_FILE: &str = "instance-id";
pub const MACHINE_ID_FILE: &str = "machine-id";

/// The state dir is private: it will hold the store and token hashes.
const STATE_DIR_MODE: u32 = 0o700;
/// The lock file's mode when this process creates it.
const LOCK_FILE_MODE: u32 = 0o600;

/// Why a state dir could not be opened. Each message names the file involved
/// and, where the operator can fix something, how.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("cannot create state dir {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },

    #[error("state dir {dir} is in use by another kici-scaler process ({holder}); stop it or choose another --state-dir")]
    InUse { dir: PathBuf, holder: LockHolder },

    #[error("cannot lock {path}: {source}")]
    Lock { path: PathBuf, source: io::Error },

    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },

    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },

    #[error("{path} is corrupt: {source}; restore it, or start with --reset-identity to mint a new instance id (resources the old id owns are then no longer recognised as ours)")]
    CorruptInstanceId { path: PathBuf, source: IdError },

    #[error("cannot read the machine id from {path}: {source} (create one with `systemd-machine-id-setup` or `dbus-uuidgen --ensure={path}`)")]
    MachineIdUnreadable { path: PathBuf, source: io::Error },

    #[error("{path} does not hold a machine id (expected 32 hex digits, found {found:?})")]
    BadMachineId { path: PathBuf, found: String },

    #[error("state dir {dir} was created on another machine: its machine-id copy is {recorded} but {live_path} says {live} (a cloned image?); start with --reset-identity to give this machine its own instance id")]
    MachineIdMismatch {
        dir: PathBuf,
        recorded: String,
        live: String,
        live_path: PathBuf,
    },
}

/// Who holds a state dir's lock, as far as its lock file tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockHolder {
    Pid(u32),
    /// The holder has not written its pid yet, or wrote something else.
    Unknown,
}

impl fmt::Display for LockHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockHolder::Pid(pid) => write!(f, "pid {pid}"),
            LockHolder::Unknown => f.write_str("pid unknown"),
        }
    }
}

/// How this start came by its instance id (worth a log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentitySource {
    /// Read from `instance-id`, machine id unchanged.
    Existing,
    /// First start in this state dir.
    Created,
    /// `reset` replaced an identity that did not fit this machine (or a
    /// corrupt `instance-id`); `previous` is the id it replaced, if readable.
    Reset { previous: Option<InstanceId> },
}

/// An open, locked state dir. The lock is released when this is dropped (or
/// the process dies: the kernel drops `flock`s with the last descriptor).
#[derive(Debug)]
pub struct StateDir {
    path: PathBuf,
    instance_id: InstanceId,
    machine_id: String,
    source: IdentitySource,
    /// Held, never read: its open descriptor *is* the lock.
    _lock: File,
}

impl StateDir {
    /// Opens (creating if needed) the state dir at `path`, checked against the
    /// host's [`HOST_MACHINE_ID`]. `reset` allows replacing an identity that
    /// belongs to another machine or is unreadable.
    pub fn open(path: &Path, reset: bool) -> Result<StateDir, IdentityError> {
        Self::open_with_machine_id(path, Path::new(HOST_MACHINE_ID), reset)
    }

    /// [`StateDir::open`] with the live machine id read from `machine_id_file`
    /// (tests point it at a file of their own).
    pub fn open_with_machine_id(
        path: &Path,
        machine_id_file: &Path,
        reset: bool,
    ) -> Result<StateDir, IdentityError> {
        create_private_dir(path)?;
        let lock = acquire_lock(path)?;
        let live = read_machine_id(machine_id_file)?;

        let id_path = path.join(INSTANCE_ID_FILE);
        let copy_path = path.join(MACHINE_ID_FILE);
        let recorded = read_optional(&copy_path)?.map(|s| s.trim().to_owned());
        let stored = read_optional(&id_path)?.map(|s| {
            s.trim_end_matches('\n')
                .parse::<InstanceId>()
                .map_err(|source| IdentityError::CorruptInstanceId {
                    path: id_path.clone(),
                    source,
                })
        });

        let mismatch = recorded.as_deref().is_some_and(|r| r != live);
        let (instance_id, source) = match (stored, mismatch, reset) {
            (Some(Ok(id)), false, _) => (id, IdentitySource::Existing),
            // No id was ever minted here, so there is none to have been cloned.
            (None, _, _) => (InstanceId::random(), IdentitySource::Created),
            (Some(Err(e)), _, false) => return Err(e),
            (Some(Ok(_)), true, false) => {
                return Err(IdentityError::MachineIdMismatch {
                    dir: path.to_owned(),
                    recorded: recorded.unwrap_or_default(),
                    live,
                    live_path: machine_id_file.to_owned(),
                })
            }
            (Some(stored), _, true) => (
                InstanceId::random(),
                IdentitySource::Reset {
                    previous: stored.ok(),
                },
            ),
        };

        // Instance id first, machine-id copy second: a crash in between leaves
        // the old copy, so the next start refuses again instead of accepting a
        // cloned id on this machine.
        if source != IdentitySource::Existing {
            write_atomically(path, INSTANCE_ID_FILE, &format!("{instance_id}\n"))?;
        }
        if recorded.as_deref() != Some(live.as_str()) {
            write_atomically(path, MACHINE_ID_FILE, &format!("{live}\n"))?;
        }

        Ok(StateDir {
            path: path.to_owned(),
            instance_id,
            machine_id: live,
            source,
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn instance_id(&self) -> InstanceId {
        self.instance_id
    }

    /// The live machine id this state dir is bound to.
    pub fn machine_id(&self) -> &str {
        &self.machine_id
    }

    pub fn identity_source(&self) -> IdentitySource {
        self.source
    }
}

fn create_private_dir(path: &Path) -> Result<(), IdentityError> {
    let err = |source| IdentityError::CreateDir {
        path: path.to_owned(),
        source,
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(STATE_DIR_MODE)
        .create(path)
        .map_err(err)?;
    // `mode` above is filtered by the umask and does not apply to a dir that
    // already existed: set it explicitly.
    fs::set_permissions(path, fs::Permissions::from_mode(STATE_DIR_MODE)).map_err(err)
}

/// Takes the exclusive, non-blocking `flock` on `<dir>/lock` and records our
/// pid in it.
fn acquire_lock(dir: &Path) -> Result<File, IdentityError> {
    let path = dir.join(LOCK_FILE);
    let lock_err = |source: io::Error| IdentityError::Lock {
        path: path.clone(),
        source,
    };
    // Never truncate on open: the content is the current holder's pid, which
    // a refused starter reads to name it. Never through a symbolic link
    // either: the pid written below must land in this dir's own file, not in
    // one a link points at.
    let file = rustix::fs::open(
        &path,
        rustix::fs::OFlags::RDWR
            | rustix::fs::OFlags::CREATE
            | rustix::fs::OFlags::NOFOLLOW
            | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::from_raw_mode(LOCK_FILE_MODE),
    )
    .map(File::from)
    .map_err(|errno| lock_err(errno.into()))?;
    // Nor anything but a regular file (a FIFO or device in its place).
    let stat = rustix::fs::fstat(&file).map_err(|errno| lock_err(errno.into()))?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(lock_err(io::Error::other("not a regular file")));
    }
    // A daemon killed a moment ago can leave the lock held briefly by a
    // child it forked but that had not exec'd yet (the descriptor is
    // close-on-exec, not close-on-fork). When the recorded holder is dead,
    // wait for that to pass rather than refuse a restart.
    let mut waited = std::time::Duration::ZERO;
    loop {
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => break,
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let holder = read_lock_holder(&path);
                if holder_is_dead(holder) && waited < DEAD_HOLDER_WAIT {
                    std::thread::sleep(LOCK_RETRY);
                    waited += LOCK_RETRY;
                    continue;
                }
                return Err(IdentityError::InUse {
                    dir: dir.to_owned(),
                    holder,
                });
            }
            Err(errno) => return Err(lock_err(errno.into())),
        }
    }
    let pid = format!("{}\n", std::process::id());
    file.set_len(0)
        .and_then(|()| file.write_all_at(pid.as_bytes(), 0))
        .map_err(|source| IdentityError::Write { path, source })?;
    Ok(file)
}

/// How long a lock whose recorded holder is dead may stay held (by a
/// not-yet-exec'd child of that holder) before start-up gives up.
const DEAD_HOLDER_WAIT: std::time::Duration = std::time::Duration::from_secs(3);
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

fn holder_is_dead(holder: LockHolder) -> bool {
    let LockHolder::Pid(pid) = holder else {
        return false;
    };
    let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
}

fn read_lock_holder(path: &Path) -> LockHolder {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .map_or(LockHolder::Unknown, LockHolder::Pid)
}

/// The live machine id: 32 hex digits (systemd's format; D-Bus's is the same).
fn read_machine_id(path: &Path) -> Result<String, IdentityError> {
    let raw = fs::read_to_string(path).map_err(|source| IdentityError::MachineIdUnreadable {
        path: path.to_owned(),
        source,
    })?;
    let id = raw.trim();
    if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(IdentityError::BadMachineId {
            path: path.to_owned(),
            found: id.chars().take(64).collect(),
        });
    }
    Ok(id.to_ascii_lowercase())
}

fn read_optional(path: &Path) -> Result<Option<String>, IdentityError> {
    match fs::read(path) {
        // Invalid UTF-8 becomes replacement characters, which then fail to
        // parse as an id and are reported as corruption, not as an I/O error.
        Ok(bytes) => Ok(Some(String::from_utf8_lossy(&bytes).into_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(IdentityError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Replaces `<dir>/<name>` with `content`: temp file, fsync, rename, fsync dir.
fn write_atomically(dir: &Path, name: &str, content: &str) -> Result<(), IdentityError> {
    let target = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let err = |source| IdentityError::Write {
        path: target.clone(),
        source,
    };
    let result = (|| {
        // Not through a symbolic link left at the temp name.
        let mut f = File::from(rustix::fs::open(
            &tmp,
            rustix::fs::OFlags::WRONLY
                | rustix::fs::OFlags::CREATE
                | rustix::fs::OFlags::TRUNC
                | rustix::fs::OFlags::NOFOLLOW
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::from_raw_mode(0o644),
        )?);
        f.write_all(content.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, &target)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        // Best effort: the temp name is ours (pid-suffixed) and the dir locked.
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(err)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// A `lock` planted as a symbolic link is refused, and the file it
    /// points at keeps its content (no pid written through the link).
    #[test]
    fn a_lock_that_is_a_symlink_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("precious");
        std::fs::write(&target, "precious content\n").unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::os::unix::fs::symlink(&target, state.join(LOCK_FILE)).unwrap();
        let machine_id = dir.path().join("machine-id");
        std::fs::write(&machine_id, "0123456789abcdef0123456789abcdef\n").unwrap();

        let e = StateDir::open_with_machine_id(&state, &machine_id, false).unwrap_err();
        assert!(matches!(e, IdentityError::Lock { .. }), "{e}");
        assert!(e.to_string().contains("lock"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&target).unwrap(),
            "precious content\n"
        );
    }
}
