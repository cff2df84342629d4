//! The machine-pool ledger: named resource pools shared by several
//! kici-scaler processes on one host.
//!
//! This module owns the on-disk format (`<dir>/<pool>.json`, version 2), the
//! locking protocol and the liveness rule. Each reservation into a pool is a
//! row naming its instance and agent; every read-modify-write happens under
//! an exclusive `flock` on `<dir>/<pool>.lock`, so the summed requests of all
//! processes never exceed the pool's cap.
//!
//! Liveness is a lock, not a pid: an instance is alive while it holds `flock`
//! on `<dir>/owners/<instance>.lock`, which [`MachineLedger::open`] takes and
//! keeps. A dead instance's rows are kept — its agents may still run, and it
//! reconciles them itself ([`MachineLedger::reconcile_own`]) when it restarts
//! — unless their `expiresAtMs` (reservation time + the scaler's
//! `maxLifetime`) has passed; then any process reaps them.
//!
//! Upstream KiCI's version 1 files and lock directories are refused loudly:
//! the two formats cannot share a directory safely.

mod dir;
mod lock;

pub use dir::{resolve_dir, LEDGER_DIR_ENV, SYSTEM_LEDGER_DIR};

use crate::cap::{Cap, Refusal};
use kici_model::{AgentId, InstanceId, ResourceCap, Resources};
use lock::{lock_exclusive, probe_owner, HeldLock, Liveness};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The format this module reads and writes.
pub const FORMAT_VERSION: u64 = 2;

const OWNERS_DIR: &str = "owners";

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("no usable machine-pool ledger directory (set {LEDGER_DIR_ENV}); tried: {}", tried.join("; "))]
    NoUsableDir { tried: Vec<String> },
    #[error("machine-pool ledger directory {} is not usable: {source}", path.display())]
    Dir { path: PathBuf, source: io::Error },
    #[error("machine pool name {0:?} cannot name a ledger file: expected [A-Za-z0-9._-]+ not starting with '.'")]
    InvalidPoolName(String),
    #[error("ledger instance {instance} is already open: another process (or handle) holds its owner lock {}", path.display())]
    InstanceInUse { instance: InstanceId, path: PathBuf },
    #[error("timed out after {waited:?} waiting for the ledger lock {}", path.display())]
    LockTimeout { path: PathBuf, waited: Duration },
    #[error("{} is a directory, upstream KiCI's ledger lock: another KiCI process uses this ledger directory; point kici-scaler at a different one ({LEDGER_DIR_ENV})", path.display())]
    ForeignLock { path: PathBuf },
    #[error("{} is a version 1 ledger written by upstream KiCI: another KiCI process uses this ledger directory; point kici-scaler at a different one ({LEDGER_DIR_ENV})", path.display())]
    ForeignVersion1 { path: PathBuf },
    #[error("{}: unsupported ledger version {version} (this kici-scaler reads version {FORMAT_VERSION})", path.display())]
    UnsupportedVersion { path: PathBuf, version: String },
    #[error("{}: corrupt ledger file (left untouched): {source}", path.display())]
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("machine pool {pool:?} is not registered with this ledger (not in the current configuration)")]
    NotRegistered { pool: String },
    #[error("machine pool {pool:?}: the cap in {} is {file} but this configuration says {configured}; every process sharing the ledger must configure the same cap (align the configurations, or remove the file while no process holds reservations in it)", path.display())]
    CapMismatch {
        pool: String,
        path: PathBuf,
        file: PoolCap,
        configured: PoolCap,
    },
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// A pool's cap as the file records it; `None` = uncapped dimension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolCap {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cpu_millis: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_bytes: Option<u64>,
}

impl From<ResourceCap> for PoolCap {
    fn from(c: ResourceCap) -> Self {
        Self {
            max_cpu_millis: c.max_cpu.map(|c| c.millis()),
            max_memory_bytes: c.max_memory.map(|m| m.bytes()),
        }
    }
}

impl fmt::Display for PoolCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cpu = self
            .max_cpu_millis
            .map_or("uncapped".to_owned(), |m| format!("{m}m"));
        let mem = self.max_memory_bytes.map_or("uncapped".to_owned(), |b| {
            kici_model::MemoryBytes::from_bytes(b).to_string()
        });
        write!(f, "{{maxCpu: {cpu}, maxMemory: {mem}}}")
    }
}

/// One reservation in a pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LedgerRow {
    #[serde(with = "as_string")]
    pub instance: InstanceId,
    #[serde(with = "as_string")]
    pub agent: AgentId,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub reserved_at_ms: u64,
    /// `reservedAtMs` + the scaler's `maxLifetime`: after this, a dead
    /// owner's row is reaped by anyone.
    pub expires_at_ms: u64,
}

/// A row removed from a pool (reaped or reconciled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedRow {
    pub pool: String,
    pub row: LedgerRow,
}

/// The rows of one pool, summed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolUsage {
    /// The cap the file records (`None` when the file does not exist yet).
    pub cap: Option<PoolCap>,
    pub rows: Vec<LedgerRow>,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
}

/// The answer of [`MachineLedger::try_reserve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    Reserved,
    /// `pool-cpu` or `pool-memory`; `used` sums every live process's rows.
    Refused(Refusal),
}

/// What [`MachineLedger::maintain`] did.
#[derive(Debug, Default)]
pub struct MaintenanceReport {
    /// Expired rows of dead instances.
    pub reaped: Vec<DroppedRow>,
    /// Pools whose maintenance failed (retried next time).
    pub errors: Vec<(String, LedgerError)>,
}

/// Milliseconds since the Unix epoch. Injectable so tests can move time.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> u64 + Send + Sync>);

impl Clock {
    pub fn system() -> Self {
        Self(Arc::new(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        }))
    }

    pub fn from_fn(f: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    pub fn now_ms(&self) -> u64 {
        (self.0)()
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Clock")
    }
}

#[derive(Debug, Clone)]
pub struct LedgerOptions {
    /// Longest wait for a pool lock (holders keep it for one small
    /// read-modify-write; a long wait means a stopped process).
    pub lock_timeout: Duration,
    /// Longest wait for our own owner lock at open. Liveness probes hold it
    /// for microseconds; a live owner holds it forever.
    pub owner_lock_timeout: Duration,
    pub clock: Clock,
}

impl Default for LedgerOptions {
    fn default() -> Self {
        Self {
            lock_timeout: Duration::from_secs(10),
            owner_lock_timeout: Duration::from_secs(1),
            clock: Clock::system(),
        }
    }
}

/// A handle on the ledger directory for one instance. Clones share the
/// handle; the owner lock is released when the last clone drops.
#[derive(Debug, Clone)]
pub struct MachineLedger {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    instance: InstanceId,
    options: LedgerOptions,
    _owner_lock: HeldLock,
    /// Pools of the current configuration and their caps.
    registered: Mutex<HashMap<String, PoolCap>>,
    /// Releases that failed (lock timeout, I/O): applied by the next write
    /// of that pool and by [`MachineLedger::maintain`].
    pending_releases: Mutex<HashMap<String, HashSet<AgentId>>>,
}

/// How a read-modify-write treats the file's cap.
#[derive(Clone, Copy)]
enum Access {
    /// Reserving: the file's cap must equal ours; a missing file is created
    /// with it.
    Registered(PoolCap),
    /// Releasing, reporting: any version-2 file; a missing one stays missing.
    Existing,
}

fn lock_mutex<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded maps are updated with single insert/remove calls: no
    // half-done state can survive a panic.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Pool names become file names.
pub fn validate_pool_name(pool: &str) -> Result<(), LedgerError> {
    let ok = !pool.is_empty()
        && !pool.starts_with('.')
        && pool
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(LedgerError::InvalidPoolName(pool.to_owned()))
    }
}

impl MachineLedger {
    /// Opens the ledger for `instance` in `dir` (resolved as
    /// [`resolve_dir`] does) and takes the instance's owner lock for the
    /// handle's lifetime. Fails with [`LedgerError::InstanceInUse`] when that
    /// instance is open elsewhere.
    pub fn open(dir: Option<&Path>, instance: InstanceId) -> Result<Self, LedgerError> {
        Self::open_with(dir, instance, LedgerOptions::default())
    }

    pub fn open_with(
        dir: Option<&Path>,
        instance: InstanceId,
        options: LedgerOptions,
    ) -> Result<Self, LedgerError> {
        let dir = resolve_dir(dir)?;
        let owners = dir.join(OWNERS_DIR);
        fs::create_dir_all(&owners).map_err(|source| LedgerError::Dir {
            path: owners.clone(),
            source,
        })?;
        let path = owner_lock_path(&dir, instance);
        let owner = lock_exclusive(&path, options.owner_lock_timeout).map_err(|e| match e {
            LedgerError::LockTimeout { path, .. } => LedgerError::InstanceInUse { instance, path },
            other => other,
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                dir,
                instance,
                options,
                _owner_lock: owner,
                registered: Mutex::new(HashMap::new()),
                pending_releases: Mutex::new(HashMap::new()),
            }),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    pub fn instance(&self) -> InstanceId {
        self.inner.instance
    }

    /// Makes `pools` the registered set (all or nothing): every existing file
    /// must be version 2 with the same cap; then missing files are created,
    /// so a process configured with a different cap is refused at its start
    /// rather than at its first reservation. Pools left out become
    /// unregistered (their rows can still be released).
    pub fn register_pools<'a>(
        &self,
        pools: impl IntoIterator<Item = (&'a str, PoolCap)>,
    ) -> Result<(), LedgerError> {
        let pools: HashMap<String, PoolCap> =
            pools.into_iter().map(|(n, c)| (n.to_owned(), c)).collect();
        for (name, cap) in &pools {
            validate_pool_name(name)?;
            self.check_file(name, *cap)?;
        }
        for (name, cap) in &pools {
            self.modify(name, Access::Registered(*cap), |_| ())?;
        }
        *lock_mutex(&self.inner.registered) = pools;
        Ok(())
    }

    /// The registered cap of `pool`.
    pub fn registered_cap(&self, pool: &str) -> Option<PoolCap> {
        lock_mutex(&self.inner.registered).get(pool).copied()
    }

    /// Reserves `requests` for `agent` in `pool` if, after reaping expired
    /// rows of dead instances, `used + held + requested` fits the cap on
    /// both dimensions. A stale row of ours for the same agent is replaced.
    pub fn try_reserve(
        &self,
        pool: &str,
        agent: AgentId,
        requests: Resources,
        held: Resources,
        max_lifetime: Duration,
    ) -> Result<ReserveOutcome, LedgerError> {
        let cap = self
            .registered_cap(pool)
            .ok_or_else(|| LedgerError::NotRegistered {
                pool: pool.to_owned(),
            })?;
        let own = self.inner.instance;
        let now = self.inner.options.clock.now_ms();
        self.modify(pool, Access::Registered(cap), |rows| {
            rows.retain(|r| !(r.instance == own && r.agent == agent));
            self.reap(rows, now);
            let (cpu, mem) = sums(rows);
            let checks = [
                (
                    Cap::PoolCpu,
                    cap.max_cpu_millis,
                    cpu,
                    held.cpu.millis(),
                    requests.cpu.millis(),
                ),
                (
                    Cap::PoolMemory,
                    cap.max_memory_bytes,
                    mem,
                    held.memory.bytes(),
                    requests.memory.bytes(),
                ),
            ];
            for (which, limit, used, held, requested) in checks {
                let Some(limit) = limit else { continue };
                if u128::from(used) + u128::from(held) + u128::from(requested) > u128::from(limit) {
                    return ReserveOutcome::Refused(Refusal {
                        cap: which,
                        requested,
                        used,
                        held,
                        limit,
                    });
                }
            }
            rows.push(self.row(agent, requests, now, max_lifetime));
            ReserveOutcome::Reserved
        })
    }

    /// Records a reservation for an agent that already exists (recovery
    /// after a restart) without checking the cap: the agent runs whether or
    /// not it fits. An existing row of ours for it is kept as is.
    pub fn adopt(
        &self,
        pool: &str,
        agent: AgentId,
        requests: Resources,
        max_lifetime: Duration,
    ) -> Result<(), LedgerError> {
        let cap = self
            .registered_cap(pool)
            .ok_or_else(|| LedgerError::NotRegistered {
                pool: pool.to_owned(),
            })?;
        let own = self.inner.instance;
        let now = self.inner.options.clock.now_ms();
        self.modify(pool, Access::Registered(cap), |rows| {
            if !rows.iter().any(|r| r.instance == own && r.agent == agent) {
                rows.push(self.row(agent, requests, now, max_lifetime));
            }
        })
    }

    /// Removes this instance's row for `agent` (never another instance's).
    /// Returns whether a row was removed. On failure the release is queued
    /// and applied by the pool's next write or by [`Self::maintain`].
    pub fn release(&self, pool: &str, agent: AgentId) -> Result<bool, LedgerError> {
        let own = self.inner.instance;
        let result = self.modify(pool, Access::Existing, |rows| {
            let before = rows.len();
            rows.retain(|r| !(r.instance == own && r.agent == agent));
            rows.len() != before
        });
        if result.is_err() {
            lock_mutex(&self.inner.pending_releases)
                .entry(pool.to_owned())
                .or_default()
                .insert(agent);
        }
        result
    }

    /// The live rows of `pool` (expired rows of dead instances are reaped).
    pub fn usage(&self, pool: &str) -> Result<PoolUsage, LedgerError> {
        let now = self.inner.options.clock.now_ms();
        let mut cap = None;
        let rows = self.modify_with_cap(pool, Access::Existing, |rows, file_cap| {
            self.reap(rows, now);
            cap = file_cap;
            rows.clone()
        })?;
        let (cpu_millis, memory_bytes) = sums(&rows);
        Ok(PoolUsage {
            cap,
            rows,
            cpu_millis,
            memory_bytes,
        })
    }

    /// Reaps expired rows of dead instances in `pool`.
    pub fn reap_expired(&self, pool: &str) -> Result<Vec<DroppedRow>, LedgerError> {
        let now = self.inner.options.clock.now_ms();
        let reaped = self.modify(pool, Access::Existing, |rows| self.reap(rows, now))?;
        Ok(reaped
            .into_iter()
            .map(|row| DroppedRow {
                pool: pool.to_owned(),
                row,
            })
            .collect())
    }

    /// Periodic upkeep: retries queued releases and reaps expired rows of
    /// dead instances in every registered pool (and every pool with a
    /// queued release).
    pub fn maintain(&self) -> MaintenanceReport {
        let mut pools: Vec<String> = lock_mutex(&self.inner.registered).keys().cloned().collect();
        pools.extend(lock_mutex(&self.inner.pending_releases).keys().cloned());
        pools.sort();
        pools.dedup();
        let mut report = MaintenanceReport::default();
        for pool in pools {
            match self.reap_expired(&pool) {
                Ok(mut reaped) => report.reaped.append(&mut reaped),
                Err(e) => report.errors.push((pool, e)),
            }
        }
        report
    }

    /// After a restart: removes this instance's rows whose agent is not in
    /// `keep` from every pool file in the directory, and returns them. Files
    /// of pools this process does not use and cannot read (another format)
    /// are skipped with a warning; errors on registered pools are returned.
    pub fn reconcile_own(&self, keep: &HashSet<AgentId>) -> Result<Vec<DroppedRow>, LedgerError> {
        let own = self.inner.instance;
        let mut dropped = Vec::new();
        for pool in self.pool_files()? {
            let result = self.modify(&pool, Access::Existing, |rows| {
                let mut gone = Vec::new();
                rows.retain(|r| {
                    let drop_it = r.instance == own && !keep.contains(&r.agent);
                    if drop_it {
                        gone.push(r.clone());
                    }
                    !drop_it
                });
                gone
            });
            match result {
                Ok(gone) => dropped.extend(gone.into_iter().map(|row| DroppedRow {
                    pool: pool.clone(),
                    row,
                })),
                Err(e) if self.registered_cap(&pool).is_none() => {
                    tracing::warn!(pool = %pool, error = %e, "skipping a ledger file this process does not use");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(dropped)
    }

    /// Shutdown: removes every row of this instance.
    pub fn release_all_own(&self) -> Result<Vec<DroppedRow>, LedgerError> {
        self.reconcile_own(&HashSet::new())
    }

    /// The pools that have a file in the directory.
    fn pool_files(&self) -> Result<Vec<String>, LedgerError> {
        let io_err = |source| LedgerError::Io {
            op: "list ledger directory",
            path: self.inner.dir.clone(),
            source,
        };
        let mut pools = Vec::new();
        for entry in fs::read_dir(&self.inner.dir).map_err(io_err)? {
            let entry = entry.map_err(io_err)?;
            let name = entry.file_name();
            let Some(pool) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            if validate_pool_name(pool).is_ok() {
                pools.push(pool.to_owned());
            }
        }
        pools.sort();
        Ok(pools)
    }

    fn row(&self, agent: AgentId, r: Resources, now: u64, max_lifetime: Duration) -> LedgerRow {
        let lifetime = u64::try_from(max_lifetime.as_millis()).unwrap_or(u64::MAX);
        LedgerRow {
            instance: self.inner.instance,
            agent,
            cpu_millis: r.cpu.millis(),
            memory_bytes: r.memory.bytes(),
            reserved_at_ms: now,
            expires_at_ms: now.saturating_add(lifetime),
        }
    }

    /// Removes rows that are expired AND whose instance is dead; returns
    /// them. Only expired rows are probed, so live owners are rarely touched.
    fn reap(&self, rows: &mut Vec<LedgerRow>, now: u64) -> Vec<LedgerRow> {
        let own = self.inner.instance;
        let mut liveness: BTreeMap<InstanceId, Liveness> = BTreeMap::new();
        let mut reaped = Vec::new();
        rows.retain(|r| {
            if r.instance == own || r.expires_at_ms > now {
                return true;
            }
            let alive = *liveness
                .entry(r.instance)
                .or_insert_with(|| probe_owner(&owner_lock_path(&self.inner.dir, r.instance)));
            if alive == Liveness::Dead {
                reaped.push(r.clone());
                return false;
            }
            true
        });
        reaped
    }

    /// Reads a pool file (if any) without the pool lock and checks version
    /// and cap: the all-or-nothing validation pass of registration.
    fn check_file(&self, pool: &str, cap: PoolCap) -> Result<(), LedgerError> {
        let path = self.pool_path(pool);
        if let Some(file) = read_pool_file(&path)? {
            if file.cap != cap {
                return Err(cap_mismatch(pool, path, file.cap, cap));
            }
        }
        Ok(())
    }

    fn modify<R>(
        &self,
        pool: &str,
        access: Access,
        f: impl FnOnce(&mut Vec<LedgerRow>) -> R,
    ) -> Result<R, LedgerError> {
        self.modify_with_cap(pool, access, |rows, _| f(rows))
    }

    /// One read-modify-write of a pool under its lock: read, validate,
    /// apply queued releases, run `f`, write back if anything changed (or to
    /// create a registered pool's file).
    fn modify_with_cap<R>(
        &self,
        pool: &str,
        access: Access,
        f: impl FnOnce(&mut Vec<LedgerRow>, Option<PoolCap>) -> R,
    ) -> Result<R, LedgerError> {
        validate_pool_name(pool)?;
        let _lock = lock_exclusive(
            &self.inner.dir.join(format!("{pool}.lock")),
            self.inner.options.lock_timeout,
        )?;
        let path = self.pool_path(pool);
        let existing = read_pool_file(&path)?;
        let pending = lock_mutex(&self.inner.pending_releases)
            .get(pool)
            .cloned()
            .unwrap_or_default();
        let result = match (existing, access) {
            (Some(file), Access::Registered(cap)) if file.cap != cap => {
                return Err(cap_mismatch(pool, path, file.cap, cap));
            }
            // No file, no rows: queued releases have nothing left to remove.
            (None, Access::Existing) => f(&mut Vec::new(), None),
            (existing, access) => {
                let exists = existing.is_some();
                let mut file = existing.unwrap_or_else(|| match access {
                    Access::Registered(cap) => PoolFile::new(cap),
                    Access::Existing => PoolFile::new(PoolCap::default()),
                });
                let original = file.reservations.clone();
                let own = self.inner.instance;
                if !pending.is_empty() {
                    file.reservations
                        .retain(|r| !(r.instance == own && pending.contains(&r.agent)));
                }
                let result = f(&mut file.reservations, Some(file.cap));
                if !exists || file.reservations != original {
                    self.write_pool_file(pool, &path, &file)?;
                }
                result
            }
        };
        if !pending.is_empty() {
            let mut queued = lock_mutex(&self.inner.pending_releases);
            if let Some(set) = queued.get_mut(pool) {
                set.retain(|a| !pending.contains(a));
                if set.is_empty() {
                    queued.remove(pool);
                }
            }
        }
        Ok(result)
    }

    fn pool_path(&self, pool: &str) -> PathBuf {
        self.inner.dir.join(format!("{pool}.json"))
    }

    /// Temp file + fsync + rename: readers see the old or the new file,
    /// never a torn one, even after a power loss (the fsync before the
    /// rename). The directory is not fsynced: losing the rename only brings
    /// back the previous rows, which reconciliation and expiry handle.
    fn write_pool_file(&self, pool: &str, path: &Path, file: &PoolFile) -> Result<(), LedgerError> {
        let tmp = self.inner.dir.join(format!("{pool}.json.tmp"));
        let io_err = |op, source| LedgerError::Io {
            op,
            path: tmp.clone(),
            source,
        };
        let mut bytes = serde_json::to_vec_pretty(file)
            .map_err(|e| io_err("encode ledger file", io::Error::other(e)))?;
        bytes.push(b'\n');
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            // The temp dir candidate is world-writable: never write through a
            // planted symlink.
            .custom_flags(nofollow())
            .open(&tmp)
            .map_err(|e| io_err("create", e))?;
        out.write_all(&bytes).map_err(|e| io_err("write", e))?;
        out.sync_all().map_err(|e| io_err("fsync", e))?;
        drop(out);
        fs::rename(&tmp, path).map_err(|source| LedgerError::Io {
            op: "rename into place",
            path: path.to_path_buf(),
            source,
        })
    }
}

fn nofollow() -> i32 {
    // O_NOFOLLOW is a small positive flag on every Linux architecture.
    i32::try_from(rustix::fs::OFlags::NOFOLLOW.bits()).unwrap_or(0)
}

fn owner_lock_path(dir: &Path, instance: InstanceId) -> PathBuf {
    dir.join(OWNERS_DIR).join(format!("{instance}.lock"))
}

fn cap_mismatch(pool: &str, path: PathBuf, file: PoolCap, configured: PoolCap) -> LedgerError {
    LedgerError::CapMismatch {
        pool: pool.to_owned(),
        path,
        file,
        configured,
    }
}

fn sums(rows: &[LedgerRow]) -> (u64, u64) {
    rows.iter().fold((0u64, 0u64), |(c, m), r| {
        (
            c.saturating_add(r.cpu_millis),
            m.saturating_add(r.memory_bytes),
        )
    })
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolFile {
    version: u64,
    cap: PoolCap,
    reservations: Vec<LedgerRow>,
}

impl PoolFile {
    fn new(cap: PoolCap) -> Self {
        Self {
            version: FORMAT_VERSION,
            cap,
            reservations: Vec::new(),
        }
    }
}

/// Reads and validates a pool file; `None` when it does not exist.
fn read_pool_file(path: &Path) -> Result<Option<PoolFile>, LedgerError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(LedgerError::Io {
                op: "read",
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let corrupt = |source| LedgerError::Corrupt {
        path: path.to_path_buf(),
        source,
    };
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(corrupt)?;
    match value.get("version") {
        Some(v) if *v == FORMAT_VERSION => serde_json::from_value(value).map(Some).map_err(corrupt),
        Some(v) if *v == 1u64 => Err(LedgerError::ForeignVersion1 {
            path: path.to_path_buf(),
        }),
        other => Err(LedgerError::UnsupportedVersion {
            path: path.to_path_buf(),
            version: other.map_or("(missing)".to_owned(), ToString::to_string),
        }),
    }
}

/// Ids are stored as their canonical strings and parsed back strictly.
mod as_string {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    use std::fmt::Display;
    use std::str::FromStr;

    pub fn serialize<T: Display, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: FromStr,
        T::Err: Display,
        D: Deserializer<'de>,
    {
        let s = String::deserialize(d)?;
        s.parse().map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_names_are_file_safe() {
        for ok in ["gpu", "host-1.pool_A", "a"] {
            assert!(validate_pool_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b", "../x", ".hidden", "..", "a b", "ü"] {
            assert!(
                matches!(
                    validate_pool_name(bad),
                    Err(LedgerError::InvalidPoolName(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn file_format_is_version_2_camel_case() {
        let row = LedgerRow {
            instance: "0a1b2c3d".parse().unwrap(),
            agent: "scaler-container-deadbeef".parse().unwrap(),
            cpu_millis: 1500,
            memory_bytes: 1 << 30,
            reserved_at_ms: 10,
            expires_at_ms: 20,
        };
        let file = PoolFile {
            version: 2,
            cap: PoolCap {
                max_cpu_millis: Some(4000),
                max_memory_bytes: None,
            },
            reservations: vec![row],
        };
        let json: serde_json::Value = serde_json::to_value(&file).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "version": 2,
                "cap": {"maxCpuMillis": 4000},
                "reservations": [{
                    "instance": "0a1b2c3d",
                    "agent": "scaler-container-deadbeef",
                    "cpuMillis": 1500,
                    "memoryBytes": 1073741824,
                    "reservedAtMs": 10,
                    "expiresAtMs": 20
                }]
            })
        );
        let back: PoolFile = serde_json::from_value(json).unwrap();
        assert_eq!(back, file);
    }
}
