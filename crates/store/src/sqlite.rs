//! The embedded store: one SQLite file in WAL mode.
//!
//! Durability: WAL with `synchronous=NORMAL`. A commit is in the WAL file
//! (the OS page cache) before the call returns, so it survives a crash or
//! `kill -9` of the daemon, which is what recovery has to survive; only a
//! power loss or kernel crash can roll back the last commits (never corrupt
//! the file), and that also ends every process, container, VM, TAP and
//! cgroup those rows describe: the sweep finds what is left on disk (chroot
//! dirs) by its owner marker. `FULL` would add one fsync per commit (4-5 ms
//! on this project's VMs), making every agent transition and IP claim wait
//! on the disk for no recoverable state. The WAL is fsynced at checkpoints.
//!
//! Concurrency: exactly one writer connection (a pool of one), so writes
//! queue in this process instead of contending for SQLite's file lock, and
//! a read pool. The IP claim is one `UPDATE … RETURNING` statement and the
//! pool fill a `BEGIN IMMEDIATE` transaction: either way the write lock is
//! taken before the first read, so what was read is the latest commit and
//! no other writer (another process on the same file) can slip in between
//! the read and the write; SQLite has no row locks, and needs none with one
//! writer at a time. `busy_timeout` bounds the wait for another process's
//! lock.

use crate::error::{classify, StoreError};
use crate::{StoreKind, StoreOptions};
use ipnet::Ipv4Net;
use kici_model::InstanceId;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Sqlite, Transaction};
use std::collections::HashSet;
use std::path::Path;

/// [`crate::StateStore`] on an SQLite file.
pub(crate) struct SqliteStore {
    owner: InstanceId,
    owner_text: String,
    writer: SqlitePool,
    reader: SqlitePool,
    filled: tokio::sync::Mutex<HashSet<Ipv4Net>>,
    /// [`StoreOptions::address_scope`].
    address_scope: Option<crate::AddressScope>,
}

/// Makes the database file (and a missing parent dir) readable by its owner
/// only, before SQLite opens it: the store holds job command lines and
/// agents' records. SQLite creates `-wal` and `-shm` with the database
/// file's mode, so creating the file 0600 first covers all three; an
/// existing file (and its `-wal`/`-shm`) left readable by others is
/// tightened to 0600.
fn create_private(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| StoreError::Io { path, source }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io(dir))?;
        }
    }
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(path)(e)),
    }
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let mut shm = path.as_os_str().to_owned();
    shm.push("-shm");
    for file in [path.to_owned(), wal.into(), shm.into()] {
        let Ok(meta) = std::fs::metadata(&file) else {
            continue;
        };
        if meta.permissions().mode() & 0o077 != 0 {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))
                .map_err(io(&file))?;
        }
    }
    Ok(())
}

impl SqliteStore {
    /// The IP claim, one statement, one round trip: the
    /// agent's existing lease in the network (rewritten unchanged, which
    /// makes the call idempotent) or else the lowest free address.
    /// A write statement in autocommit takes SQLite's write lock before it
    /// reads, so the address it picks cannot be taken in between.
    const CLAIM_IP: &'static str = "UPDATE ip_leases SET agent_id = $2, owner = $3, leased_at = COALESCE(leased_at, $4) \
        WHERE network = $1 AND ip = COALESCE( \
            (SELECT ip FROM ip_leases WHERE network = $1 AND agent_id = $2 AND owner = $3), \
            (SELECT ip FROM ip_leases WHERE network = $1 AND agent_id IS NULL ORDER BY ip LIMIT 1)) \
        RETURNING ip";

    pub(crate) async fn open(
        path: &Path,
        owner: InstanceId,
        options: &StoreOptions,
    ) -> Result<Self, StoreError> {
        create_private(path)?;
        let connect = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(options.sqlite_busy_timeout)
            .foreign_keys(true);
        // Waiting for the one writer is queueing behind local commits, not
        // an outage: allow it the busy timeout.
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(options.acquire_timeout.max(options.sqlite_busy_timeout))
            .connect_with(connect.clone())
            .await
            .map_err(classify)?;
        crate::migrations::SQLITE
            .run(&writer)
            .await
            .map_err(|e| StoreError::Migrate(e.to_string()))?;
        let reader = SqlitePoolOptions::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .connect_with(connect.read_only(true))
            .await
            .map_err(classify)?;
        let owner_text = owner.to_string();
        sqlx::query(crate::sql::PUT_INSTANCE)
            .bind(&owner_text)
            .bind(crate::sql::hostname())
            .bind(crate::UnixMillis::now().0)
            .execute(&writer)
            .await
            .map_err(classify)?;
        Ok(Self {
            owner,
            owner_text,
            writer,
            reader,
            filled: tokio::sync::Mutex::new(HashSet::new()),
            address_scope: options.address_scope.clone(),
        })
    }

    fn reader(&self) -> &SqlitePool {
        &self.reader
    }

    fn writer(&self) -> &SqlitePool {
        &self.writer
    }

    async fn begin_write(&self) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
        self.writer.begin_with("BEGIN IMMEDIATE").await
    }

    async fn ping_impl(&self) -> Result<(), StoreError> {
        sqlx::query(crate::sql::HEARTBEAT)
            .bind(&self.owner_text)
            .bind(crate::UnixMillis::now().0)
            .execute(&self.writer)
            .await
            .map_err(classify)?;
        Ok(())
    }

    fn postgres_impl(&self) -> Option<crate::SharedPostgres> {
        None
    }

    async fn close_impl(&self) {
        self.reader.close().await;
        self.writer.close().await;
    }
}

crate::sql::impl_state_store!(SqliteStore, StoreKind::Sqlite);
