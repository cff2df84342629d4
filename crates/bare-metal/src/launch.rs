//! Starting an agent process straight inside its tracking cgroup.
//!
//! Moving a running task into a cgroup (writing `cgroup.procs`) takes the
//! cgroup threadgroup rwsem for writing, which waits for an RCU grace
//! period: ~11–14 ms per spawn on this project's hosts (cgroup2 mounted
//! without `favordynmods`), most of the bare-metal spawn latency.
//! `clone3(CLONE_INTO_CGROUP)` (Linux ≥ 5.7) creates the child in the
//! target cgroup instead — no migration, no grace period. This module owns
//! that fork/exec: the child makes only raw, async-signal-safe system calls
//! (new session, v1 limit cgroups, the agent's user, stdio, working
//! directory, signal state, `execve`) and reports a failed `execve` through a close-on-exec pipe, as
//! `std::process::Command` does. `CLONE_PIDFD` hands back a pidfd naming the
//! child from its first instant.
//!
//! When the kernel refuses `clone3` or `CLONE_INTO_CGROUP` (ENOSYS, EINVAL,
//! E2BIG, or EPERM from a seccomp filter), [`Refused`] tells the caller to
//! fall back to `Command` + `pre_exec` writing `cgroup.procs`.

#![allow(unsafe_code)]

use crate::bare_metal::user::Switch;
use rustix::fd::{AsRawFd, FromRawFd, OwnedFd};
use rustix::process::Pid;
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU8, Ordering};

/// `struct clone_args` up to `cgroup` (`CLONE_ARGS_SIZE_VER2`, Linux 5.7).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

const CLONE_PIDFD: u64 = 0x1000;
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// Whether `clone3(CLONE_INTO_CGROUP)` worked here: unknown until the first
/// spawn, then remembered (a refusal is logged once, not per spawn).
static SUPPORT: AtomicU8 = AtomicU8::new(UNKNOWN);
const UNKNOWN: u8 = 0;
const SUPPORTED: u8 = 1;
const REFUSED: u8 = 2;

/// `Some(true)` once a spawn went through `clone3(CLONE_INTO_CGROUP)`,
/// `Some(false)` once the kernel refused it (spawns then use the fallback).
pub fn clone_into_cgroup_supported() -> Option<bool> {
    match SUPPORT.load(Ordering::Relaxed) {
        SUPPORTED => Some(true),
        REFUSED => Some(false),
        _ => None,
    }
}

/// Should the next spawn try `clone3` at all?
pub fn worth_trying() -> bool {
    SUPPORT.load(Ordering::Relaxed) != REFUSED
}

/// Remembers a refusal; logs it the first time only.
pub fn record_refusal(refused: &Refused) {
    if SUPPORT.swap(REFUSED, Ordering::Relaxed) != REFUSED {
        tracing::warn!(
            error = %refused.0,
            "clone3(CLONE_INTO_CGROUP) refused by the kernel (needs Linux 5.7+): bare-metal \
             agents enter their cgroup by writing cgroup.procs, ~10 ms slower per spawn"
        );
    }
}

/// What the child needs, all prepared before the clone (the child must not
/// allocate: another thread may hold the allocator's lock at clone time).
pub struct Launch<'a> {
    pub binary: &'a Path,
    pub env: &'a [(String, String)],
    pub stdout: &'a File,
    pub stderr: &'a File,
    pub work: &'a Path,
    /// The tracking cgroup directory the child is created in.
    pub cgroup: &'a OwnedFd,
    /// `cgroup.procs` of v1 limit cgroups: the child writes itself there.
    pub v1_procs: &'a [OwnedFd],
    /// The user the child becomes after entering its cgroups, before exec.
    pub switch: Option<&'a Switch>,
}

/// The kernel refused `clone3(CLONE_INTO_CGROUP)`: use the fallback.
#[derive(Debug)]
pub struct Refused(pub io::Error);

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("the kernel refused clone3(CLONE_INTO_CGROUP): {}", .0.0)]
    Refused(Refused),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// A child started by [`launch`]; unreaped until [`ClonedChild::wait`] or
/// [`ClonedChild::try_wait`] saw its exit, so its pid stays its own.
#[derive(Debug)]
pub struct ClonedChild {
    pid: Pid,
    pidfd: OwnedFd,
}

impl ClonedChild {
    pub fn pid(&self) -> Pid {
        self.pid
    }

    pub fn pidfd(&self) -> &OwnedFd {
        &self.pidfd
    }

    pub fn kill(&self) -> io::Result<()> {
        rustix::process::pidfd_send_signal(&self.pidfd, rustix::process::Signal::KILL)
            .map_err(io::Error::from)
    }

    /// Blocks until the child exits, and reaps it.
    pub fn wait(&self) -> io::Result<ExitStatus> {
        loop {
            match self.wait_with(0)? {
                Some(status) => return Ok(status),
                None => continue,
            }
        }
    }

    /// Reaps the child if it exited.
    pub fn try_wait(&self) -> io::Result<Option<ExitStatus>> {
        self.wait_with(libc::WNOHANG)
    }

    fn wait_with(&self, options: libc::c_int) -> io::Result<Option<ExitStatus>> {
        let mut status: libc::c_int = 0;
        loop {
            // SAFETY: waitpid writes one int through the valid pointer.
            let r = unsafe { libc::waitpid(self.pid.as_raw_nonzero().get(), &mut status, options) };
            match r {
                0 => return Ok(None),
                r if r > 0 => return Ok(Some(ExitStatus::from_raw(status))),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
    }
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a NUL byte in the agent's path or environment",
        )
    })
}

/// Forks the agent into `launch.cgroup` and execs it. Returns once the
/// child exec'd (or reports why it could not).
pub fn launch(launch: &Launch<'_>) -> Result<ClonedChild, LaunchError> {
    let binary = if launch.binary.is_absolute() {
        launch.binary.to_owned()
    } else {
        // As `validate` read it: relative to the daemon's directory (the
        // child changes directory before it execs).
        std::env::current_dir()?.join(launch.binary)
    };
    let path = cstring(binary.as_os_str().as_bytes())?;
    let argv0 = cstring(launch.binary.as_os_str().as_bytes())?;
    let argv: [*const libc::c_char; 2] = [argv0.as_ptr(), std::ptr::null()];
    let env: Vec<CString> = launch
        .env
        .iter()
        .map(|(k, v)| {
            let mut kv = Vec::with_capacity(k.len() + v.len() + 1);
            kv.extend_from_slice(OsStr::new(k).as_bytes());
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            cstring(&kv)
        })
        .collect::<io::Result<_>>()?;
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());

    let devnull = File::open("/dev/null")?;
    let work = File::open(launch.work)?;
    let (err_read, err_write) =
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(io::Error::from)?;

    let child_fds = ChildFds {
        stdin: devnull.as_raw_fd(),
        stdout: launch.stdout.as_raw_fd(),
        stderr: launch.stderr.as_raw_fd(),
        work: work.as_raw_fd(),
        v1_procs_start: launch.v1_procs.as_ptr(),
        v1_procs_len: launch.v1_procs.len(),
        switch: launch
            .switch
            .map_or(std::ptr::null(), |s| s as *const Switch),
        err: err_write.as_raw_fd(),
    };

    let mut pidfd: libc::c_int = -1;
    let mut args = CloneArgs {
        flags: CLONE_PIDFD | CLONE_INTO_CGROUP,
        pidfd: std::ptr::addr_of_mut!(pidfd) as u64,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: launch.cgroup.as_raw_fd() as u64,
        ..CloneArgs::default()
    };
    // SAFETY: clone3 without CLONE_VM and without a stack is a fork: the
    // child runs on a copy-on-write copy of this thread's stack and memory.
    // `args` and `pidfd` outlive the call. In the child (r == 0) only
    // `child_exec` runs, which never returns and makes only
    // async-signal-safe calls on data prepared above.
    let r = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            std::ptr::addr_of_mut!(args),
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if r == 0 {
        // SAFETY: in the freshly cloned child; see `child_exec`.
        unsafe { child_exec(&child_fds, path.as_ptr(), argv.as_ptr(), envp.as_ptr()) }
    }
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOSYS | libc::EINVAL | libc::E2BIG | libc::EPERM) => {
                LaunchError::Refused(Refused(e))
            }
            _ => LaunchError::Io(e),
        });
    }
    // SAFETY: CLONE_PIDFD stored a new descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let pid = i32::try_from(r)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| io::Error::other("clone3 returned an invalid pid"))?;
    let child = ClonedChild { pid, pidfd };
    drop(err_write);
    // EOF: the child exec'd (the pipe closed on exec). Four bytes: errno.
    let mut errno = [0u8; 4];
    let mut read = 0;
    while read < errno.len() {
        match rustix::io::read(&err_read, &mut errno[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::from(e).into());
            }
        }
    }
    if read == 0 {
        SUPPORT.store(SUPPORTED, Ordering::Relaxed);
        return Ok(child);
    }
    let _ = child.wait();
    Err(if read == errno.len() {
        io::Error::from_raw_os_error(i32::from_ne_bytes(errno))
    } else {
        io::Error::other("the agent's child failed before exec without saying why")
    }
    .into())
}

/// Raw descriptors for the child (it must not touch owned wrappers' drops).
struct ChildFds {
    stdin: libc::c_int,
    stdout: libc::c_int,
    stderr: libc::c_int,
    work: libc::c_int,
    v1_procs_start: *const OwnedFd,
    v1_procs_len: usize,
    /// Null: the child keeps the daemon's user.
    switch: *const Switch,
    err: libc::c_int,
}

/// The child between clone and exec. Never returns.
///
/// # Safety
///
/// Only in the child of [`launch`]'s clone3, with pointers into memory that
/// `launch` prepared before the clone (the child's copy of it).
unsafe fn child_exec(
    fds: &ChildFds,
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> ! {
    // SAFETY (whole body): each call is an async-signal-safe libc wrapper
    // around one system call, on descriptors and C strings that stay valid
    // in this copy of the address space; nothing allocates, locks or
    // unwinds. Failures write errno to the close-on-exec pipe and `_exit`.
    unsafe {
        let fail_with = |fds: &ChildFds, errno: i32| -> ! {
            let bytes = errno.to_ne_bytes();
            libc::write(fds.err, bytes.as_ptr().cast(), bytes.len());
            libc::_exit(127)
        };
        let fail = |fds: &ChildFds| -> ! { fail_with(fds, *libc::__errno_location()) };
        if libc::setsid() < 0 {
            fail(fds);
        }
        let v1 = std::slice::from_raw_parts(fds.v1_procs_start, fds.v1_procs_len);
        for procs in v1 {
            if libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                fail(fds);
            }
        }
        // In its cgroups (which only the daemon's user may write), the
        // child gives up that user for good.
        if let Some(switch) = fds.switch.as_ref() {
            if let Err(e) = switch.apply() {
                fail_with(fds, e.raw_os_error());
            }
        }
        for (from, to) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
            if from == to {
                // dup2 onto itself keeps close-on-exec: clear it.
                if libc::fcntl(from, libc::F_SETFD, 0) < 0 {
                    fail(fds);
                }
            } else if libc::dup2(from, to) < 0 {
                fail(fds);
            }
        }
        if libc::fchdir(fds.work) < 0 {
            fail(fds);
        }
        // What `Command` does too: the Rust runtime ignores SIGPIPE, and an
        // ignored disposition would survive the exec; the mask is inherited.
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        if libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) < 0 {
            fail(fds);
        }
        if libc::signal(libc::SIGPIPE, libc::SIG_DFL) == libc::SIG_ERR {
            fail(fds);
        }
        libc::execve(path, argv, envp);
        fail(fds)
    }
}
