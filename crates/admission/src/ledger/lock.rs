//! `flock` helpers: the pool lock every read-modify-write holds, the owner
//! lock an instance holds for its lifetime, and the liveness probe.
//!
//! `flock` locks belong to an open file description and vanish when the
//! holder dies, so there is no stale lock to break and no pid to trust.

use super::LedgerError;
use rustix::fs::{flock, FlockOperation};
use rustix::io::Errno;
use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

/// A held `flock`; released when dropped (the file is closed).
#[derive(Debug)]
pub(crate) struct HeldLock {
    _file: File,
}

/// Opens (creating) `path` and takes an exclusive `flock`, waiting at most
/// `timeout`.
pub(crate) fn lock_exclusive(path: &Path, timeout: Duration) -> Result<HeldLock, LedgerError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|source| match source.kind() {
            // Upstream KiCI's lock is a directory of the same name.
            io::ErrorKind::IsADirectory => LedgerError::ForeignLock {
                path: path.to_path_buf(),
            },
            _ => LedgerError::Io {
                op: "open lock file",
                path: path.to_path_buf(),
                source,
            },
        })?;
    let started = Instant::now();
    let mut backoff = Duration::from_micros(50);
    loop {
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(HeldLock { _file: file }),
            Err(Errno::WOULDBLOCK) | Err(Errno::INTR) => {}
            Err(e) => {
                return Err(LedgerError::Io {
                    op: "flock",
                    path: path.to_path_buf(),
                    source: e.into(),
                })
            }
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(LedgerError::LockTimeout {
                path: path.to_path_buf(),
                waited,
            });
        }
        // Holders keep the lock for one small read-modify-write, so a short
        // capped backoff keeps latency low without spinning.
        std::thread::sleep(backoff.min(timeout - waited));
        backoff = (backoff * 2).min(Duration::from_millis(5));
    }
}

/// Is the instance owning `owner_lock` alive (holding its lock)?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Liveness {
    Alive,
    Dead,
}

/// Probes an owner lock without disturbing a live owner: a shared try-lock
/// fails while the owner holds its exclusive lock. A missing file means the
/// instance never opened a ledger here (dead). Anything unexpected counts as
/// alive: keeping a row too long is safe, dropping a live one is not.
pub(crate) fn probe_owner(owner_lock: &Path) -> Liveness {
    let file = match File::open(owner_lock) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Liveness::Dead,
        Err(e) => {
            tracing::warn!(path = %owner_lock.display(), error = %e, "cannot probe ledger owner lock; treating the owner as alive");
            return Liveness::Alive;
        }
    };
    match flock(&file, FlockOperation::NonBlockingLockShared) {
        // Closing `file` releases the probe's lock at once.
        Ok(()) => Liveness::Dead,
        Err(Errno::WOULDBLOCK) => Liveness::Alive,
        Err(e) => {
            tracing::warn!(path = %owner_lock.display(), error = %e, "cannot probe ledger owner lock; treating the owner as alive");
            Liveness::Alive
        }
    }
}
