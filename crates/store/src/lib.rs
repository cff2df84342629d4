//! Durable state of kici-scaler: agents, pending requests, standalone jobs,
//! IP leases, token hashes and events, in embedded SQLite (the default) or a shared
//! PostgreSQL, behind one trait, [`StateStore`].
//!
//! Every row carries its owner, the [`InstanceId`] of the daemon that wrote
//! it; a store handle is bound to one owner at [`open`] and only ever reads,
//! changes or deletes that owner's rows (IP pools are the one shared thing:
//! several instances draw from one network, see [`ipam`]).
//!
//! Queries are checked at run time (no `sqlx::query!`), so a clean clone
//! builds without a database. Each database has its own migration folder
//! (`migrations/sqlite`, `migrations/postgres`), embedded in the binary and
//! applied by [`open`]; a test migrates both and compares the schemas.
//!
//! The daemon backs the engine's journal (`kici_engine::Journal`) with this
//! store and reads it back on start-up to take its agents back (see
//! docs/deviations.md, D-owner-scoped-state; for the IP allocator,
//! D-ip-allocation).
//!
//! ```
//! use kici_store::{open, StoreKind, StoreOptions, StoreUrl, UnixMillis};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let url: StoreUrl = format!("sqlite:{}/state.db", dir.path().display()).parse()?;
//! let owner = "0a1b2c3d".parse()?; // the instance id of this daemon
//! let store = open(&url, owner, StoreOptions::default()).await?; // migrated
//! assert_eq!(store.kind(), StoreKind::Sqlite);
//! assert!(store.agents().await?.is_empty());
//!
//! // The event stream: strictly increasing sequence numbers, JSON bodies.
//! store.append_event(1, UnixMillis::now(), r#"{"type":"reloaded"}"#).await?;
//! store.append_event(2, UnixMillis::now(), r#"{"type":"reloaded"}"#).await?;
//! assert_eq!(store.last_event_seq().await?, Some(2));
//! let after_first = store.events_after(1, 100).await?;
//! assert_eq!(after_first.len(), 1);
//! assert_eq!(after_first[0].seq, 2);
//! store.close().await;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod error;
pub mod ipam;
mod postgres;
pub mod record;
pub mod session;
mod sql;
mod sqlite;
pub mod url;

pub use error::StoreError;
pub use ipam::{AllocError, IpAllocator, Ipv4Pool, Lease, MacAddress, PoolError};
pub use record::{
    AgentRecord, ClaimRedemption, ClaimRow, EventRecord, JobRecord, OutboxRecord, PendingRecord,
    ResourceNames, UnixMillis,
};
pub use session::{AdvisoryKey, Locked, Notice, PgSession, SessionOptions};
pub use url::{AddressScope, AddressScopeError, StoreOptions, StoreUrl};

use async_trait::async_trait;
use kici_model::{AgentId, InstanceId, JobId};
use std::sync::Arc;

/// Every failpoint of this crate (feature `failpoints`), each placed right
/// after its step's side effect is committed:
/// - `kici_store::ip::claimed`: a lease is committed, the caller not told.
/// - `kici_store::ip::released`: leases are freed, the caller not told.
pub const FAILPOINTS: &[&str] = &["kici_store::ip::claimed", "kici_store::ip::released"];

/// Which database a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreKind {
    /// Embedded SQLite file.
    Sqlite,
    /// Shared PostgreSQL.
    Postgres,
}

/// The durable state of one instance (its owner). All methods are scoped to
/// [`StateStore::owner`]; a call that fails with
/// [`StoreError::Unavailable`] changed nothing and can be retried.
///
/// Every write is committed before the call returns (SQLite: WAL with
/// `synchronous=NORMAL`, durable across a daemon crash, see the `sqlite`
/// module; PostgreSQL: as its `synchronous_commit` says).
#[async_trait]
pub trait StateStore: IpAllocator {
    /// The instance whose rows this handle reads and writes.
    fn owner(&self) -> InstanceId;

    /// Which database this is.
    fn kind(&self) -> StoreKind;

    /// Round trip to the database that also refreshes this instance's
    /// `instances.heartbeat_at` (one small write). On PostgreSQL it also re-takes the
    /// instance's advisory lock if the connection holding it was lost (a
    /// server restart): call it periodically. Fails with
    /// [`StoreError::IdentityInUse`] if another session took the lock
    /// meanwhile.
    async fn ping(&self) -> Result<(), StoreError>;

    /// On PostgreSQL, the store's pool and the host's session, for the
    /// parts of the host that work in the same database (a fleet): sharing
    /// them keeps the host's connections within
    /// [`StoreOptions::max_connections`]. `None` on SQLite.
    fn postgres(&self) -> Option<SharedPostgres>;

    /// One read-only round trip on the connections writes use: whether the
    /// store answers now (bounded by the pool's acquire timeout). Writes
    /// nothing — unlike [`StateStore::ping`], it is cheap enough to ask
    /// before every request that must not start without a store.
    async fn reachable(&self) -> Result<(), StoreError>;

    /// Inserts or fully replaces an agent's record (`updated_at` as given).
    /// Fails with [`StoreError::AgentIdTaken`] if another instance recorded
    /// the same id.
    async fn put_agent(&self, agent: &AgentRecord) -> Result<(), StoreError>;

    /// One of this owner's agents, if recorded.
    async fn agent(&self, id: &AgentId) -> Result<Option<AgentRecord>, StoreError>;

    /// Every agent this owner recorded, ordered by creation time.
    async fn agents(&self) -> Result<Vec<AgentRecord>, StoreError>;

    /// Forgets an agent; returns whether it was recorded.
    async fn delete_agent(&self, id: &AgentId) -> Result<bool, StoreError>;

    /// Inserts or replaces the pending request of `pending.job_id`.
    async fn put_pending(&self, pending: &PendingRecord) -> Result<(), StoreError>;

    /// Forgets a pending request; returns whether it was recorded.
    async fn delete_pending(&self, job: &JobId) -> Result<bool, StoreError>;

    /// This owner's pending requests, oldest first.
    async fn pending(&self) -> Result<Vec<PendingRecord>, StoreError>;

    /// Inserts or fully replaces the record of standalone job
    /// `job.job_id`.
    async fn put_job(&self, job: &JobRecord) -> Result<(), StoreError>;

    /// Forgets a standalone job; returns whether it was recorded.
    async fn delete_job(&self, job: &JobId) -> Result<bool, StoreError>;

    /// This owner's standalone jobs, oldest first.
    async fn jobs(&self) -> Result<Vec<JobRecord>, StoreError>;

    /// Records event `seq` (must be new for this owner; a duplicate is a
    /// [`StoreError::Database`] error).
    async fn append_event(&self, seq: u64, at: UnixMillis, body: &str) -> Result<(), StoreError>;

    /// Records several events in one transaction (all or none; each `seq`
    /// must be new for this owner). An empty slice writes nothing.
    async fn append_events(&self, events: &[EventRecord]) -> Result<(), StoreError>;

    /// Up to `limit` events with a sequence number above `seq`, in order.
    async fn events_after(&self, seq: u64, limit: u32) -> Result<Vec<EventRecord>, StoreError>;

    /// The highest recorded sequence number (to continue numbering after a
    /// restart), if any event is recorded.
    async fn last_event_seq(&self) -> Result<Option<u64>, StoreError>;

    /// Deletes all but the newest `keep` events; returns how many went.
    async fn trim_events(&self, keep: u64) -> Result<u64, StoreError>;

    /// Records an issued claim. A second row with the same hash is a
    /// [`StoreError::Database`] error (a generated code never repeats).
    async fn insert_claim(&self, claim: &ClaimRow) -> Result<(), StoreError>;

    /// Decides and consumes a claim in one conditional write: of any number
    /// of concurrent calls for one hash — on any instance sharing the store
    /// — at most one is [`ClaimRedemption::Granted`]. A claim is found by
    /// its hash alone, whichever instance issued it.
    async fn redeem_claim(
        &self,
        code_hash: &[u8; 32],
        now: UnixMillis,
    ) -> Result<ClaimRedemption, StoreError>;

    /// Deletes this owner's claims of `agent`; returns how many.
    async fn invalidate_claims(&self, agent: &AgentId) -> Result<u64, StoreError>;

    /// Deletes this owner's claims that expired before `horizon`.
    async fn purge_claims(&self, horizon: UnixMillis) -> Result<u64, StoreError>;

    /// Records a provisioner event unless one with its request id is
    /// already recorded (a redelivery keeps the first record).
    async fn put_outbox(&self, event: &OutboxRecord) -> Result<(), StoreError>;

    /// Marks an event confirmed; returns whether it was recorded.
    async fn mark_outbox_delivered(
        &self,
        request_id: &str,
        at: UnixMillis,
    ) -> Result<bool, StoreError>;

    /// Forgets every event of `agent` (its scale-down was confirmed).
    async fn delete_outbox_agent(&self, agent: &AgentId) -> Result<u64, StoreError>;

    /// This owner's recorded events, oldest first.
    async fn outbox(&self) -> Result<Vec<OutboxRecord>, StoreError>;

    /// Closes the pools (and on PostgreSQL releases the advisory lock) once
    /// in-flight calls finish; later calls fail with `Unavailable`.
    async fn close(&self);
}

/// A PostgreSQL store's connections, shared with the rest of the host
/// ([`StateStore::postgres`]).
#[derive(Debug, Clone)]
pub struct SharedPostgres {
    /// The host's pool (its size is all the host holds, session included).
    pub pool: sqlx::PgPool,
    /// The host's session (one of the pool's connections).
    pub session: PgSession,
    /// How the pool connects (for tools that need a connection of their own).
    pub connect: sqlx::postgres::PgConnectOptions,
}

/// Opens (creating if needed) the store at `url` for `owner`, applies the
/// migrations and records the instance.
///
/// SQLite: creates the file and its directory; never falls back to another
/// location. PostgreSQL: takes a session advisory lock keyed by `owner`,
/// held on the host's session for the store's life, and fails with
/// [`StoreError::IdentityInUse`] if another session holds it.
pub async fn open(
    url: &StoreUrl,
    owner: InstanceId,
    options: StoreOptions,
) -> Result<Arc<dyn StateStore>, StoreError> {
    Ok(match url {
        StoreUrl::Sqlite(path) => Arc::new(sqlite::SqliteStore::open(path, owner, &options).await?),
        StoreUrl::Postgres(u) => Arc::new(postgres::PgStore::open(u, owner, &options).await?),
    })
}

/// The embedded migrations of each database, for tools and tests that need
/// the schema without a store (e.g. the schema comparison).
pub mod migrations {
    /// `migrations/sqlite`.
    pub static SQLITE: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");
    /// `migrations/postgres`.
    pub static POSTGRES: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");
}
