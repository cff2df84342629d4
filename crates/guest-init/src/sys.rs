//! The system calls `/init` makes: mounts, the switch into the overlay
//! root, loopback, hostname, reaping and ending the VM.

use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::reboot::{reboot, RebootMode};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{chdir, pivot_root, Pid};

use crate::plan::{self, Mount};

/// A system call that failed.
#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("mount {fstype} {device} on {target}: {errno}")]
    Mount {
        fstype: String,
        device: String,
        target: String,
        errno: Errno,
    },
    #[error("{what} {path}: {err}")]
    Path {
        what: &'static str,
        path: String,
        err: String,
    },
    #[error("{what}: {errno}")]
    Call { what: &'static str, errno: Errno },
}

fn path_err(what: &'static str, path: &Path, err: impl std::fmt::Display) -> SysError {
    SysError::Path {
        what,
        path: path.display().to_string(),
        err: err.to_string(),
    }
}

/// Makes one planned mount (creating its mount point).
pub fn apply(m: &Mount) -> Result<(), SysError> {
    std::fs::create_dir_all(&m.target).map_err(|e| path_err("mkdir", &m.target, e))?;
    let mut flags = MsFlags::empty();
    flags.set(MsFlags::MS_NOSUID, m.options.nosuid);
    flags.set(MsFlags::MS_NODEV, m.options.nodev);
    flags.set(MsFlags::MS_NOEXEC, m.options.noexec);
    match mount(
        Some(m.source.as_str()),
        &m.target,
        Some(m.fstype.as_str()),
        flags,
        m.data.as_deref(),
    ) {
        Ok(()) => Ok(()),
        Err(Errno::EBUSY) if m.may_exist => Ok(()),
        Err(errno) => Err(SysError::Mount {
            fstype: m.fstype.clone(),
            device: m.source.clone(),
            target: m.target.display().to_string(),
            errno,
        }),
    }
}

/// Mounts the writable layer over the root and switches into it.
pub fn switch_to_overlay(backing: &Mount, root: &Mount) -> Result<(), SysError> {
    apply(backing)?;
    for dir in ["upper", "work"] {
        let p = Path::new(plan::OVERLAY_BACKING).join(dir);
        std::fs::create_dir_all(&p).map_err(|e| path_err("mkdir", &p, e))?;
    }
    apply(root)?;
    let new_root = Path::new(plan::NEW_ROOT);
    for api in plan::MOVED_INTO_NEW_ROOT {
        let target = new_root.join(api.trim_start_matches('/'));
        std::fs::create_dir_all(&target).map_err(|e| path_err("mkdir", &target, e))?;
        mount(
            Some(api),
            &target,
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(|errno| path_err("move mount", Path::new(api), errno))?;
    }
    chdir(new_root).map_err(|errno| SysError::Call {
        what: "chdir to the new root",
        errno,
    })?;
    // pivot_root(".", ".") stacks the old root on top of the new one;
    // detaching it leaves the new root alone (pivot_root(2), NOTES). The
    // overlay keeps its lower and upper layers referenced.
    pivot_root(".", ".").map_err(|errno| SysError::Call {
        what: "pivot_root",
        errno,
    })?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|errno| SysError::Call {
        what: "detach the old root",
        errno,
    })?;
    chdir("/").map_err(|errno| SysError::Call {
        what: "chdir /",
        errno,
    })?;
    Ok(())
}

/// Brings `lo` up (the kernel's `ip=` autoconfiguration normally has; a
/// guest booted without `ip=` has not).
#[allow(unsafe_code)]
pub fn loopback_up() -> Result<(), SysError> {
    use std::os::fd::AsRawFd;
    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|errno| SysError::Call {
        what: "socket",
        errno,
    })?;
    // SAFETY: `ifreq` is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // The request argument is `c_ulong` on glibc and `c_int` on musl: `as _`.
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write `ifr_flags` of the
    // `ifreq` we own, through a socket we own; the name is NUL-terminated.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) < 0 {
            return Err(SysError::Call {
                what: "SIOCGIFFLAGS lo",
                errno: Errno::last(),
            });
        }
        let up = libc::IFF_UP as libc::c_short;
        if req.ifr_ifru.ifru_flags & up == 0 {
            req.ifr_ifru.ifru_flags |= up;
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) < 0 {
                return Err(SysError::Call {
                    what: "SIOCSIFFLAGS lo",
                    errno: Errno::last(),
                });
            }
        }
    }
    Ok(())
}

pub fn set_hostname(name: &str) -> Result<(), SysError> {
    nix::unistd::sethostname(name).map_err(|errno| SysError::Call {
        what: "sethostname",
        errno,
    })
}

/// Reaps children until `pid` exits (PID 1 inherits every orphan); its
/// exit code, or 128 + signal.
pub fn wait_for(pid: Pid) -> i32 {
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(p, code)) if p == pid => return code,
            Ok(WaitStatus::Signaled(p, sig, _)) if p == pid => return 128 + sig as i32,
            Ok(_) | Err(Errno::EINTR) => {}
            // No child left at all: the agent is gone.
            Err(_) => return -1,
        }
    }
}

/// Ends every other process: SIGTERM, up to `grace` of reaping, SIGKILL,
/// reap.
pub fn terminate_all(grace: Duration) {
    // kill(-1) from PID 1 signals every process but itself.
    let _ = kill(Pid::from_raw(-1), Signal::SIGTERM);
    let until = Instant::now() + grace;
    while Instant::now() < until {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => std::thread::sleep(Duration::from_millis(20)),
            Ok(_) => {}
            Err(Errno::ECHILD) => return,
            Err(_) => break,
        }
    }
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    while let Ok(status) = waitpid(None, None) {
        if status == WaitStatus::StillAlive {
            break;
        }
    }
}

/// Syncs and ends the VM. Only returns if the kernel refused.
///
/// Firecracker's documented way for a guest to stop its VM is a reboot
/// with `reboot=k` on the kernel command line (the scaler's boot args
/// have it): the i8042 reset makes the VMM exit. `RB_POWER_OFF` would
/// only halt the vCPUs of a guest without ACPI power-off and leave the
/// VMM running. (Inside a PID namespace — the tests — the kernel turns
/// this call into SIGHUP for the namespace's init.)
pub fn end_vm() -> SysError {
    nix::unistd::sync();
    match reboot(RebootMode::RB_AUTOBOOT) {
        Err(errno) => SysError::Call {
            what: "reboot(RB_AUTOBOOT)",
            errno,
        },
        Ok(never) => match never {},
    }
}
