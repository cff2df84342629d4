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
    /// `None` only while dropping.
    fd: Option<AsyncFd<OwnedFd>>,
}

impl Drop for FileWatch {
    /// Closing an inotify instance waits for an SRCU grace period in the
    /// kernel (`fsnotify_destroy_group`): 5–30 ms measured here. On a tokio
    /// worker that stalls every task queued behind it (the control API's
    /// requests among them), so the close happens on the blocking pool.
    fn drop(&mut self) {
        let Some(fd) = self.fd.take() else { return };
        // Deregisters from the reactor at once; only the close is deferred.
        let fd = fd.into_inner();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || drop(fd));
            }
            Err(_) => drop(fd),
        }
    }
}

impl FileWatch {
    /// Watches each of `paths` for modification.
    pub fn new<'a>(paths: impl IntoIterator<Item = &'a Path>) -> io::Result<Self> {
        let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?;
        for path in paths {
            inotify::add_watch(&fd, path, WatchFlags::MODIFY)?;
        }
        Ok(Self {
            fd: Some(register(fd)?),
        })
    }

    /// Returns once some watched file changed since the last call (or at
    /// once if events are pending). Events are drained, not interpreted:
    /// the caller re-reads whatever it watches.
    pub async fn changed(&self) -> io::Result<()> {
        let Some(fd) = &self.fd else {
            // Unreachable: `fd` is taken only by `drop`.
            return Ok(());
        };
        let mut guard = fd.readable().await?;
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// Is `fd` an inotify instance watching `dir`? (By inode, so a number
    /// reused by a test running alongside does not count.)
    fn watches(fd: i32, dir: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        let ino = format!("ino:{:x} ", std::fs::metadata(dir).unwrap().ino());
        std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).is_ok_and(|info| {
            info.lines()
                .any(|l| l.starts_with("inotify ") && l.contains(&ino))
        })
    }

    fn raw(watch: &FileWatch) -> i32 {
        watch.fd.as_ref().unwrap().as_raw_fd()
    }

    #[test]
    fn dropping_inside_a_runtime_closes_the_instance_off_the_worker() {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_io()
            .build()
            .unwrap();
        let fd = rt.block_on(async {
            let watch = FileWatch::new([dir.path()]).unwrap();
            let fd = raw(&watch);
            assert!(watches(fd, dir.path()));
            drop(watch);
            fd
        });
        // Shutting the runtime down waits for its blocking pool: the close
        // was handed there, not lost.
        drop(rt);
        assert!(
            !watches(fd, dir.path()),
            "the inotify instance was never closed"
        );
    }

    #[test]
    fn dropping_outside_a_runtime_closes_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let watch = rt.block_on(async { FileWatch::new([dir.path()]).unwrap() });
        let fd = raw(&watch);
        drop(rt);
        assert!(watches(fd, dir.path()));
        drop(watch);
        assert!(!watches(fd, dir.path()));
    }
}
