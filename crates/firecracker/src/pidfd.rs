//! Firecracker's exit, seen through a pidfd registered with tokio.

use kici_host::process::ProcessIdentity;
use std::io;
use std::os::fd::OwnedFd;
use tokio::io::unix::AsyncFd;

/// A pidfd for `identity`, or `None` when the process is gone (or the
/// kernel predates pidfds).
pub fn open(identity: ProcessIdentity) -> Option<OwnedFd> {
    rustix::process::pidfd_open(identity.pid, rustix::process::PidfdFlags::empty()).ok()
}

/// Registers `fd` for readiness (a pidfd turns readable when its process
/// exits).
#[allow(unsafe_code)]
pub fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: `register_with_interest` requires the descriptor to stay open
    // and unchanged for the `AsyncFd`'s whole life. The `OwnedFd` is moved
    // into it and closed only when the `AsyncFd` drops.
    unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
}
