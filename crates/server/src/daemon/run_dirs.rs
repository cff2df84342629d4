//! Where `kici-scaler run` keeps its state dirs, and which of the dirs found
//! there can be trusted.
//!
//! A run dir holds an instance id, a lock file and a configuration snapshot
//! that the sweep of dead runs ([`crate::daemon::dead_runs`]) acts on with
//! this process's privileges: it destroys whatever that instance id owns
//! and writes its pid into the lock. A run dir must therefore be ours
//! beyond doubt, so run dirs live in a parent only their owner can write,
//! never directly in a shared temp dir:
//!
//! - `$XDG_RUNTIME_DIR/kici-scaler/` when `XDG_RUNTIME_DIR` is set to an
//!   absolute path (the runtime dir must be owned by us and not
//!   group/other-writable);
//! - otherwise `/run/kici-scaler-runs/` for root (not `/run/kici-scaler/`:
//!   that is the service's runtime directory, which systemd removes with
//!   everything in it whenever the service stops);
//! - otherwise `kici-scaler-<uid>/` in the temp dir (`$TMPDIR`, else
//!   `/tmp`): created 0700, and refused when it already exists but is not
//!   ours (someone else made it first).
//!
//! The parent is created 0700 when missing and verified before use: not a
//! symbolic link, owned by the effective uid, no group or other write
//! permission; so is the dir it sits in (owned by us or root; writable by
//! others only with the sticky bit, so nobody can rename our entry). Every
//! check works on descriptors — a dir is opened `O_NOFOLLOW|O_DIRECTORY`
//! and judged by `fstat`, what is inside relative to it, `O_NOFOLLOW` — so
//! a symbolic link is never followed and what is judged is what is used.

use rustix::fs::{FileType, Mode, OFlags};
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The prefix of `run`'s state dirs inside the parent.
pub const RUN_DIR_PREFIX: &str = "kici-scaler-run-";
/// Root's parent when `XDG_RUNTIME_DIR` is not set.
pub const SYSTEM_PARENT: &str = "/run/kici-scaler-runs";
/// The parent's name inside `$XDG_RUNTIME_DIR`.
const XDG_PARENT_NAME: &str = "kici-scaler";
/// The parent's mode when this process creates it.
const PARENT_MODE: u32 = 0o700;

/// A path that cannot be trusted, and why. Each message names the path.
#[derive(Debug, thiserror::Error)]
pub enum Untrusted {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: io::Error },

    #[error("cannot create {path}: {source}")]
    Create { path: PathBuf, source: io::Error },

    #[error("{path} is a symbolic link; expected a real {expected}")]
    Symlink {
        path: PathBuf,
        expected: &'static str,
    },

    #[error("{path} is not a {expected}")]
    WrongType {
        path: PathBuf,
        expected: &'static str,
    },

    #[error("{path} is owned by uid {owner}; expected {expected}")]
    Owner {
        path: PathBuf,
        owner: u32,
        expected: String,
    },

    #[error("{path} has mode {mode:04o}; expected {expected}")]
    Mode {
        path: PathBuf,
        mode: u32,
        expected: &'static str,
    },

    #[error("{path} has {links} hard links; expected 1")]
    Links { path: PathBuf, links: u64 },
}

/// What a directory must be to be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirRule {
    /// A run dir: owned by us, no group or other permission at all (0700).
    Private,
    /// The parent of run dirs (and a runtime dir): owned by us, no group or
    /// other write permission.
    Owned,
    /// What the parent sits in: owned by us or root; group- or
    /// other-writable only with the sticky bit (a shared temp dir), so that
    /// nobody else can rename or replace our entry in it.
    Base,
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Opens `path` (relative to `at`, or as given when `at` is `None`) as a
/// directory without following a symbolic link, and checks it by `fstat`
/// against `rule`.
pub fn open_dir(
    at: Option<BorrowedFd<'_>>,
    path: &Path,
    rule: DirRule,
) -> Result<OwnedFd, Untrusted> {
    open_dir_shown(at, path, path, rule)
}

/// [`open_dir`] for `name` inside the open dir `dir` (shown as `dir_path`).
pub fn open_dir_in(
    dir: BorrowedFd<'_>,
    dir_path: &Path,
    name: &str,
    rule: DirRule,
) -> Result<OwnedFd, Untrusted> {
    open_dir_shown(Some(dir), Path::new(name), &dir_path.join(name), rule)
}

/// [`open_dir`], with `shown` as the path named in errors (the full path
/// when `path` is relative to `at`).
fn open_dir_shown(
    at: Option<BorrowedFd<'_>>,
    path: &Path,
    shown: &Path,
    rule: DirRule,
) -> Result<OwnedFd, Untrusted> {
    let at = at.unwrap_or(rustix::fs::CWD);
    let fd = rustix::fs::openat(
        at,
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| open_error(at, path, shown, errno, "directory"))?;
    check_dir(&fd, shown, rule)?;
    Ok(fd)
}

/// Checks an open directory against `rule`.
pub fn check_dir(fd: impl AsFd, path: &Path, rule: DirRule) -> Result<(), Untrusted> {
    let stat = rustix::fs::fstat(fd).map_err(|errno| Untrusted::Open {
        path: path.to_owned(),
        source: errno.into(),
    })?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
        return Err(Untrusted::WrongType {
            path: path.to_owned(),
            expected: "directory",
        });
    }
    let me = euid();
    let owner = stat.st_uid;
    let owner_ok = match rule {
        DirRule::Private | DirRule::Owned => owner == me,
        DirRule::Base => owner == me || owner == 0,
    };
    if !owner_ok {
        return Err(Untrusted::Owner {
            path: path.to_owned(),
            owner,
            expected: match rule {
                DirRule::Base if me != 0 => format!("uid {me} (this process) or root"),
                _ => format!("uid {me} (this process)"),
            },
        });
    }
    let mode = Mode::from_raw_mode(stat.st_mode).bits() & 0o7777;
    let (mode_ok, expected) = match rule {
        DirRule::Private => (mode & 0o077 == 0, "no group or other permission (0700)"),
        DirRule::Owned => (mode & 0o022 == 0, "no group or other write permission"),
        DirRule::Base => (
            mode & 0o022 == 0 || mode & 0o1000 != 0,
            "no group or other write permission unless sticky",
        ),
    };
    if !mode_ok {
        return Err(Untrusted::Mode {
            path: path.to_owned(),
            mode,
            expected,
        });
    }
    Ok(())
}

/// Opens `name` inside the directory `dir` (shown as `dir_path`) read-only
/// without following a symbolic link, and checks it is a regular file of
/// ours with one link. `None` when there is no such file.
pub fn open_file(
    dir: impl AsFd,
    dir_path: &Path,
    name: &str,
) -> Result<Option<OwnedFd>, Untrusted> {
    let shown = dir_path.join(name);
    // O_NONBLOCK: a FIFO in its place must not hang the check.
    let fd = match rustix::fs::openat(
        dir.as_fd(),
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(errno) => {
            return Err(open_error(
                dir.as_fd(),
                Path::new(name),
                &shown,
                errno,
                "file",
            ))
        }
    };
    check_file(&fd, &shown)?;
    Ok(Some(fd))
}

/// Checks an open file: a regular file owned by us with one link (a hard
/// link to someone else's file is refused even when we may write it).
pub fn check_file(fd: impl AsFd, path: &Path) -> Result<(), Untrusted> {
    let stat = rustix::fs::fstat(fd).map_err(|errno| Untrusted::Open {
        path: path.to_owned(),
        source: errno.into(),
    })?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(Untrusted::WrongType {
            path: path.to_owned(),
            expected: "regular file",
        });
    }
    let me = euid();
    if stat.st_uid != me {
        return Err(Untrusted::Owner {
            path: path.to_owned(),
            owner: stat.st_uid,
            expected: format!("uid {me} (this process)"),
        });
    }
    if stat.st_nlink != 1 {
        return Err(Untrusted::Links {
            path: path.to_owned(),
            links: stat.st_nlink,
        });
    }
    Ok(())
}

/// An `open` refused: a symbolic link in the way is named as such.
fn open_error(
    at: BorrowedFd<'_>,
    path: &Path,
    shown: &Path,
    errno: rustix::io::Errno,
    expected: &'static str,
) -> Untrusted {
    let is_link = rustix::fs::statat(at, path, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|s| FileType::from_raw_mode(s.st_mode) == FileType::Symlink);
    if is_link {
        Untrusted::Symlink {
            path: shown.to_owned(),
            expected,
        }
    } else {
        Untrusted::Open {
            path: shown.to_owned(),
            source: errno.into(),
        }
    }
}

/// Where run dirs of this user live: the parent dir and what it sits in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The dir the parent sits in.
    pub base: PathBuf,
    /// How the base is judged.
    pub base_rule: DirRule,
    /// The parent's name inside `base`.
    pub name: OsString,
}

impl Location {
    /// The parent of run dirs.
    pub fn parent(&self) -> PathBuf {
        self.base.join(&self.name)
    }

    /// Where this process's `run` keeps its state dir (see the module docs).
    pub fn current() -> Location {
        Self::choose(
            std::env::var_os("XDG_RUNTIME_DIR"),
            euid(),
            std::env::temp_dir(),
        )
    }

    /// Every place a `run` of this user may have left a state dir, the
    /// current one first: with `XDG_RUNTIME_DIR` set, also where a `run`
    /// without it (a service, `sudo`, cron) keeps them.
    pub fn all() -> Vec<Location> {
        let current = Self::current();
        let other = Self::without_runtime_dir(euid(), std::env::temp_dir());
        if other == current {
            vec![current]
        } else {
            vec![current, other]
        }
    }

    fn choose(xdg: Option<OsString>, euid: u32, temp: PathBuf) -> Location {
        // The XDG base dir spec: a relative (or empty) path is invalid and
        // ignored.
        match xdg.map(PathBuf::from) {
            Some(runtime) if runtime.is_absolute() => Location {
                base: runtime,
                base_rule: DirRule::Owned,
                name: XDG_PARENT_NAME.into(),
            },
            _ => Self::without_runtime_dir(euid, temp),
        }
    }

    fn without_runtime_dir(euid: u32, temp: PathBuf) -> Location {
        if euid == 0 {
            let system = Path::new(SYSTEM_PARENT);
            Location {
                // Both are constants with a parent and a name.
                base: system.parent().unwrap_or(Path::new("/")).to_owned(),
                base_rule: DirRule::Base,
                name: system.file_name().unwrap_or_default().to_owned(),
            }
        } else {
            Location {
                base: temp,
                base_rule: DirRule::Base,
                name: format!("kici-scaler-{euid}").into(),
            }
        }
    }

    /// Opens the parent, creating it (0700) when missing, and verifies it
    /// and its base.
    pub fn prepare(&self) -> Result<Parent, Untrusted> {
        let base = open_dir(None, &self.base, self.base_rule)?;
        match rustix::fs::mkdirat(
            &base,
            self.name.as_os_str(),
            Mode::from_raw_mode(PARENT_MODE),
        ) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(errno) => {
                return Err(Untrusted::Create {
                    path: self.parent(),
                    source: errno.into(),
                })
            }
        }
        self.open_parent(&base)
    }

    /// Opens and verifies the parent if it exists (`None` if it does not).
    pub fn existing(&self) -> Result<Option<Parent>, Untrusted> {
        let base = match open_dir(None, &self.base, self.base_rule) {
            Ok(base) => base,
            Err(Untrusted::Open { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        match self.open_parent(&base) {
            Ok(parent) => Ok(Some(parent)),
            Err(Untrusted::Open { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn open_parent(&self, base: &OwnedFd) -> Result<Parent, Untrusted> {
        let path = self.parent();
        let fd = open_dir_shown(
            Some(base.as_fd()),
            Path::new(&self.name),
            &path,
            DirRule::Owned,
        )?;
        Ok(Parent { path, fd })
    }
}

/// A verified parent of run dirs, held open.
#[derive(Debug)]
pub struct Parent {
    pub path: PathBuf,
    fd: OwnedFd,
}

impl Parent {
    /// Opens the run dir `name` inside and verifies it ([`DirRule::Private`]).
    pub fn open_run_dir(&self, name: &str) -> Result<OwnedFd, Untrusted> {
        open_dir_in(self.fd.as_fd(), &self.path, name, DirRule::Private)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir(mode: u32) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        d
    }

    /// Changes the owner of `path` (without following a link) to `uid`:
    /// only root may, so a test needing it says so and is skipped.
    fn chown(path: &Path, uid: u32) -> bool {
        if euid() != 0 {
            eprintln!("not root: cannot give {} another owner", path.display());
            return false;
        }
        std::os::unix::fs::lchown(path, Some(uid), None).unwrap();
        true
    }

    #[test]
    fn a_private_dir_of_ours_is_trusted() {
        let d = dir(0o700);
        open_dir(None, d.path(), DirRule::Private).unwrap();
        open_dir(None, d.path(), DirRule::Owned).unwrap();
    }

    #[test]
    fn a_run_dir_with_mode_0755_is_refused() {
        let d = dir(0o755);
        let e = open_dir(None, d.path(), DirRule::Private).unwrap_err();
        assert!(matches!(e, Untrusted::Mode { mode: 0o755, .. }), "{e}");
        assert!(
            e.to_string().contains(&d.path().display().to_string()),
            "{e}"
        );
        // A parent may be readable by others, not writable.
        open_dir(None, d.path(), DirRule::Owned).unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o775)).unwrap();
        let e = open_dir(None, d.path(), DirRule::Owned).unwrap_err();
        assert!(matches!(e, Untrusted::Mode { mode: 0o775, .. }), "{e}");
    }

    #[test]
    fn a_shared_base_needs_the_sticky_bit() {
        let d = dir(0o777);
        let e = open_dir(None, d.path(), DirRule::Base).unwrap_err();
        assert!(matches!(e, Untrusted::Mode { .. }), "{e}");
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        open_dir(None, d.path(), DirRule::Base).unwrap();
    }

    #[test]
    fn a_dir_of_another_owner_is_refused() {
        let d = dir(0o700);
        if !chown(d.path(), 65534) {
            return;
        }
        for rule in [DirRule::Private, DirRule::Owned, DirRule::Base] {
            let e = open_dir(None, d.path(), rule).unwrap_err();
            assert!(
                matches!(e, Untrusted::Owner { owner: 65534, .. }),
                "{rule:?}: {e}"
            );
        }
    }

    #[test]
    fn a_symlink_to_a_dir_of_ours_is_refused() {
        let d = dir(0o700);
        std::fs::create_dir(d.path().join("real")).unwrap();
        std::fs::set_permissions(
            d.path().join("real"),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        std::os::unix::fs::symlink(d.path().join("real"), d.path().join("link")).unwrap();
        let e = open_dir(None, &d.path().join("link"), DirRule::Private).unwrap_err();
        assert!(matches!(e, Untrusted::Symlink { .. }), "{e}");
        assert!(e.to_string().contains("link"), "{e}");
    }

    #[test]
    fn files_inside_must_be_regular_single_linked_and_ours() {
        let d = dir(0o700);
        let fd = open_dir(None, d.path(), DirRule::Private).unwrap();
        assert!(open_file(&fd, d.path(), "missing").unwrap().is_none());

        std::fs::write(d.path().join("ok"), "x").unwrap();
        assert!(open_file(&fd, d.path(), "ok").unwrap().is_some());

        std::fs::write(d.path().join("target"), "x").unwrap();
        std::os::unix::fs::symlink(d.path().join("target"), d.path().join("link")).unwrap();
        let e = open_file(&fd, d.path(), "link").unwrap_err();
        assert!(matches!(e, Untrusted::Symlink { .. }), "{e}");

        std::fs::hard_link(d.path().join("target"), d.path().join("hard")).unwrap();
        let e = open_file(&fd, d.path(), "hard").unwrap_err();
        assert!(matches!(e, Untrusted::Links { links: 2, .. }), "{e}");

        std::fs::create_dir(d.path().join("sub")).unwrap();
        let e = open_file(&fd, d.path(), "sub").unwrap_err();
        assert!(matches!(e, Untrusted::WrongType { .. }), "{e}");

        std::fs::write(d.path().join("theirs"), "x").unwrap();
        if chown(&d.path().join("theirs"), 65534) {
            let e = open_file(&fd, d.path(), "theirs").unwrap_err();
            assert!(matches!(e, Untrusted::Owner { owner: 65534, .. }), "{e}");
        }
    }

    #[test]
    fn the_location_follows_the_runtime_dir_then_the_user() {
        let tmp = PathBuf::from("/tmp");
        let xdg = Location::choose(Some("/run/user/1000".into()), 1000, tmp.clone());
        assert_eq!(xdg.parent(), Path::new("/run/user/1000/kici-scaler"));
        assert_eq!(xdg.base_rule, DirRule::Owned);
        // Relative or empty: ignored, as the XDG base dir spec says.
        for bad in ["", "run/user/1000"] {
            let l = Location::choose(Some(bad.into()), 1000, tmp.clone());
            assert_eq!(l.parent(), Path::new("/tmp/kici-scaler-1000"), "{bad:?}");
        }
        assert_eq!(
            Location::choose(None, 0, tmp.clone()).parent(),
            Path::new(SYSTEM_PARENT)
        );
        assert_eq!(
            Location::choose(None, 1000, tmp).parent(),
            Path::new("/tmp/kici-scaler-1000")
        );
    }

    #[test]
    fn prepare_creates_a_private_parent_and_refuses_a_foreign_one() {
        let base = dir(0o1777);
        let loc = Location {
            base: base.path().to_owned(),
            base_rule: DirRule::Base,
            name: "parent".into(),
        };
        assert!(loc.existing().unwrap().is_none());
        let parent = loc.prepare().unwrap();
        let mode = std::fs::metadata(&parent.path)
            .unwrap()
            .permissions()
            .mode()
            & 0o7777;
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        assert!(loc.existing().unwrap().is_some());
        // Made by someone else first: refused, naming it.
        if chown(&parent.path, 65534) {
            let e = loc.prepare().unwrap_err();
            assert!(matches!(e, Untrusted::Owner { .. }), "{e}");
            assert!(
                e.to_string().contains(&parent.path.display().to_string()),
                "{e}"
            );
        }
        // A symlink in its place: refused.
        std::fs::remove_dir(&parent.path).unwrap();
        let elsewhere = dir(0o700);
        std::os::unix::fs::symlink(elsewhere.path(), &parent.path).unwrap();
        let e = loc.prepare().unwrap_err();
        assert!(matches!(e, Untrusted::Symlink { .. }), "{e}");
    }
}
