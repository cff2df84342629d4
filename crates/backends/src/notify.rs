//! Waiting for a file to change without polling: inotify behind tokio.
//!
//! The log tailer waits for agents' output files to grow; destroy waits for
//! a cgroup's `cgroup.events` to say it emptied (the kernel notifies that
//! file on every `populated` change). Callers still re-check on a slow
//! fallback tick, since inotify can be unavailable (limits) and a missed
//! event must only cost latency, never a hang.

use rustix::fs::inotify::{self, CreateFlags, WatchFlags};
use rustix::io::Errno;
use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;
use tokio::io::unix::AsyncFd;

pub struct FileWatch {
    fd: AsyncFd<OwnedFd>,
}

impl FileWatch {
    /// Watches each of `paths` for modification.
    pub fn new<'a>(paths: impl IntoIterator<Item = &'a Path>) -> io::Result<Self> {
        let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?;
        for path in paths {
            inotify::add_watch(&fd, path, WatchFlags::MODIFY)?;
        }
        Ok(Self { fd: register(fd)? })
    }

    /// Returns once some watched file changed since the last call (or at
    /// once if events are pending). Events are drained, not interpreted:
    /// the caller re-reads whatever it watches.
    pub async fn changed(&self) -> io::Result<()> {
        let mut guard = self.fd.readable().await?;
        let mut buf = [0u8; 4096];
        let drained = guard.try_io(|fd| loop {
            match rustix::io::read(fd.get_ref(), &mut buf) {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(Errno::AGAIN) => return Err(io::ErrorKind::WouldBlock.into()),
                Err(e) => return Err(e.into()),
            }
        });
        match drained {
            Ok(result) => result,
            // Drained until EAGAIN: readiness is cleared, the change seen.
            Err(_would_block) => Ok(()),
        }
    }
}

/// Registers an owned descriptor with tokio's reactor.
#[allow(unsafe_code)]
pub fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: `register` requires the descriptor to stay open and the same
    // for the `AsyncFd`'s whole life. An `OwnedFd` moved into it is closed
    // only when the `AsyncFd` drops, and `as_raw_fd` always returns it.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}
