//! The coordination layer of a kici-scaler **fleet**: many hosts (daemons)
//! sharing one PostgreSQL database act as one scaler — one queue,
//! fleet-wide caps, leases with fencing epochs, a leader doing the chores,
//! failover without losing or duplicating a request. Everything goes
//! through the database (row locks, advisory locks, `LISTEN/NOTIFY`); there
//! is no protocol between hosts.
//!
//! # What it owns
//!
//! - [`Membership`]: a host's row, its lease (timed on the database's
//!   clock) and epoch (incremented at every join), renewal, the local fence
//!   [`LeaseGuard`] (monotonic clock), handover and leave, and the check
//!   that a pool means the same on every live host ([`FleetError::PoolMismatch`]).
//! - [`Queue`]: enqueue with fleet-wide dedupe by job id, claim under the
//!   fleet caps, start (bind an agent), release, complete, requeue, adopt
//!   (take an agent back after a rejoin); the
//!   [`Waker`] (`LISTEN` with a ≤ 1 s fallback poll).
//! - [`Leader`]: election by a session advisory lock on a dedicated
//!   connection, and the chores (declare expired hosts lost, return their
//!   unstarted claims, mark their agents lost, purge old rows).
//! - [`should_claim`]: placement (`spread` | `pack`), a pure function.
//! - [`schema`]: its own migrations under a lock; a database newer than the
//!   binary is refused ([`FleetError::SchemaTooNew`]).
//!
//! It does not route, admit locally, start agents or serve HTTP: the daemon
//! does, calling this crate at the points listed in `docs/fleet.md`.
//!
//! # Tables (all prefixed `fleet_`, keyed by fleet name first)
//!
//! | table | one row per | holds |
//! |---|---|---|
//! | `fleet_schema_versions` | applied migration | version, description |
//! | `fleet_fleets` | fleet | global caps; the row claims lock when a global cap is set; the last leader |
//! | `fleet_hosts` | host (instance id) | hostname, URL, version, state (`up`, `leaving`, `left`, `lost`), epoch, lease length and expiry, caps, free capacity |
//! | `fleet_host_pools` | host × pool | the host's definition of the pool and its fingerprint, its own capacity there |
//! | `fleet_pools` | pool | the agreed definition and fingerprint, the pool's fleet caps; the row every claim in the pool locks |
//! | `fleet_requests` | request (job id) | kind, pool, body, answer, resources, `seq` (arrival order), state (`queued`, `claimed`, `started`, `lost`, `finished`), claiming host, claim epoch, `claim_seq`, agent id |
//! | `fleet_agents` | agent started for a claim | host, epoch, pool, job id, resources, state (`live`, `gone`, `lost`) |
//!
//! Times are unix milliseconds on the database's clock (`fleet_now_ms()`).
//!
//! # Invariants, and why they hold
//!
//! - **Caps are never exceeded.** Usage of a pool = its claimed requests +
//!   its live agents; starting moves one unit from the first to the second
//!   in one transaction. Only a claim increases usage, and a claim locks the
//!   pool row (and the fleet row when a global cap is set) `FOR UPDATE`
//!   *before* reading the usage and commits the increase before releasing
//!   it. Two claims that could add to one sum queue on one row, and the
//!   second's usage query (a later statement under READ COMMITTED) sees the
//!   first one's claim. Releases only decrease usage, so they need no lock.
//! - **A request never has two claims.** Claiming is an `UPDATE` from
//!   `queued` on a row locked `FOR UPDATE SKIP LOCKED`; a row someone else
//!   claimed is no longer `queued` when re-checked. A claim returns to the
//!   queue only when it is provably void: released or handed back by its
//!   host, or its host is no longer `up` under the claim's epoch.
//! - **Work from a lapsed lease cannot start.** [`Queue::start`] binds an
//!   agent only if the request is still claimed by this host under this
//!   epoch and the host row — share-locked for the transaction, so the
//!   leader's "declare lost" waits for it — is `up` under that epoch with an
//!   unexpired lease. The local [`LeaseGuard`] closes even earlier (last
//!   renewal's send time + lease − margin), so a partitioned host stops
//!   before the database could hand its work to another.
//! - **FIFO within a pool.** Claims in a pool are serialised by the pool
//!   row and take the lowest `seq`; a returned claim keeps its `seq`.
//!
//! # Example
//!
//! ```no_run
//! use kici_fleet::{Caps, Fleet, FleetOptions, HostSpec, PoolDefinition, Placement};
//! # async fn daemon() -> Result<(), kici_fleet::FleetError> {
//! let fleet = Fleet::connect("postgres://db/kici", "default", FleetOptions::default()).await?;
//! let me = "0a1b2c3d".parse().expect("an instance id");
//! let mut spec = HostSpec::new(me, "host-a", env!("CARGO_PKG_VERSION"));
//! spec.pools.push(PoolDefinition {
//!     name: "fc-small".into(),
//!     label_sets: serde_json::json!([{"labels": ["linux", "x64"]}]),
//!     fleet_caps: Caps { max_agents: Some(20), ..Caps::default() },
//!     host_max_agents: Some(8),
//! });
//! let membership = fleet.join(spec).await?;
//! let queue = fleet.queue();
//! let pools = vec!["fc-small".to_owned()];
//! let mut waker = fleet.waker(&pools);
//! loop {
//!     let loads = queue.pool_loads("fc-small").await?;
//!     if kici_fleet::should_claim(Placement::Spread, me, &loads) {
//!         if let Some(claim) = queue.claim(membership.guard(), &pools).await? {
//!             queue.start(membership.guard(), &claim, "agent-id").await?;
//!             // … create the agent; when it is done:
//!             queue.complete(membership.instance(), &claim.job_id, "succeeded").await?;
//!             continue;
//!         }
//!     }
//!     waker.wait().await;
//! }
//! # }
//! ```

#![warn(missing_docs)]

pub mod error;
pub mod leader;
pub mod membership;
pub mod placement;
pub mod queue;
pub mod schema;

pub use error::{FleetError, PoolMismatch};
pub use leader::{ChoreReport, Leader, LostAgent, LostHost};
pub use membership::{Caps, HostSpec, HostStatus, LeaseGuard, Membership, PoolDefinition};
pub use placement::{should_claim, should_enter, HostLoad, Placement, ENTRY_SLACK};
pub use queue::{
    Adopted, Claim, Enqueued, Entered, Held, NewRequest, Owner, Queue, RequestKind, RequestState,
    RequestView, Waker,
};
pub use schema::SCHEMA_VERSION;

/// The outcome of a request whose host was lost while it held it, and
/// which is not served again: a standalone job whose agent had registered
/// at once, any other after the chores' retention.
pub const HOST_LOST: &str = "host lost";

/// The outcome of a request that waited in the queue past its time
/// ([`Leader::expire_queued`]).
pub const EXPIRED: &str = "expired";

use kici_store::{PgSession, SessionOptions, SharedPostgres};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// The one NOTIFY channel of every fleet in a database; the payload names
/// the fleet and the pool (channel names are identifiers of at most 63
/// bytes, fleet names are free text).
pub const CHANNEL: &str = "kici_fleet";

/// Connection settings of a [`Fleet`] handle made by [`Fleet::connect`].
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// Every connection the handle holds: its session (leadership,
    /// `LISTEN`) and the pooled ones (claims, renewals, enqueues). At
    /// least 2.
    pub max_connections: u32,
    /// Bound on waiting for a pooled connection: past it a call fails with
    /// [`FleetError::Unavailable`].
    pub acquire_timeout: Duration,
    /// The server ends the session after this long without a query, so a
    /// leader cut off from the database loses leadership in bounded time
    /// (see [`kici_store::SessionOptions::idle_timeout`]). Set it to the
    /// lease.
    pub session_idle_timeout: Option<Duration>,
}

impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(3),
            session_idle_timeout: None,
        }
    }
}

/// One fleet in one PostgreSQL database: the connection pool, the fleet's
/// name, and the entry points to membership, the queue and leadership.
/// Cheap to clone (an `Arc` and a pool handle).
#[derive(Clone)]
pub struct Fleet {
    name: Arc<str>,
    pool: PgPool,
    session: PgSession,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").field("name", &self.name).finish()
    }
}

impl Fleet {
    /// Connects to `url` with a pool and a session of its own, applies the
    /// fleet migrations (refusing a schema newer than this binary,
    /// [`FleetError::SchemaTooNew`]) and returns a handle on fleet `name`
    /// (one database can hold several fleets). A daemon whose state store
    /// is in the same database uses [`Fleet::on`] instead, so that the
    /// host's connections are one budget.
    pub async fn connect(url: &str, name: &str, options: FleetOptions) -> Result<Self, FleetError> {
        let connect = PgConnectOptions::from_str(url)
            .map_err(|e| FleetError::InvalidUrl(e.to_string()))?
            .application_name(&format!("kici-fleet {name}"));
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(2))
            .acquire_timeout(options.acquire_timeout)
            .test_before_acquire(true)
            .connect_lazy_with(connect.clone());
        let session = PgSession::open(
            &pool,
            SessionOptions {
                idle_timeout: options.session_idle_timeout,
                call_timeout: options.acquire_timeout,
                ..SessionOptions::default()
            },
        )
        .await
        .map_err(FleetError::from_store)?;
        let fleet = Self::on(
            SharedPostgres {
                pool: pool.clone(),
                session: session.clone(),
                connect,
            },
            name,
        )
        .await;
        if fleet.is_err() {
            session.close().await;
            pool.close().await;
        }
        fleet
    }

    /// A handle on fleet `name` over the host's existing pool and session
    /// (a PostgreSQL state store's, [`kici_store::StateStore::postgres`]):
    /// the fleet holds no connection of its own. Applies the migrations and
    /// has the session `LISTEN` on [`CHANNEL`].
    pub async fn on(shared: SharedPostgres, name: &str) -> Result<Self, FleetError> {
        schema::migrate(&shared.pool).await?;
        shared
            .session
            .listen(CHANNEL)
            .await
            .map_err(FleetError::from_store)?;
        Ok(Self {
            name: name.into(),
            pool: shared.pool,
            session: shared.session,
        })
    }

    /// The fleet's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The connection pool (for status queries the daemon makes itself).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The shared request queue of this fleet.
    pub fn queue(&self) -> Queue {
        Queue::new(self.clone())
    }

    /// Joins the fleet as `spec.instance_id` and takes a lease under a new
    /// epoch (see [`Membership::join`]).
    pub async fn join(&self, spec: HostSpec) -> Result<Membership, FleetError> {
        Membership::join(self.clone(), spec).await
    }

    /// A leadership candidate for this host (not yet leading; call
    /// [`Leader::try_lead`]).
    pub fn leader(&self, instance_id: kici_model::InstanceId) -> Leader {
        Leader::new(self.clone(), instance_id)
    }

    /// A listener woken by arrivals and releases in `pools` (see [`Waker`]).
    pub fn waker(&self, pools: &[String]) -> Waker {
        Waker::listen(self, pools)
    }

    /// The host's session (leadership, `LISTEN`).
    pub fn session(&self) -> &PgSession {
        &self.session
    }

    /// Ends the session and closes the pooled connections (of a handle made
    /// by [`Fleet::connect`]; one made [`Fleet::on`] a store's connections
    /// is closed with the store).
    pub async fn close(&self) {
        self.session.close().await;
        self.pool.close().await;
    }
}

/// Sends a NOTIFY for `pool` of `fleet` inside `conn`'s transaction (so it
/// is delivered at commit, never for a change that rolled back).
pub(crate) async fn notify(
    conn: &mut sqlx::PgConnection,
    fleet: &str,
    pool: &str,
) -> Result<(), sqlx::Error> {
    // Serialising two strings cannot fail.
    let payload = serde_json::to_string(&[fleet, pool]).unwrap_or_default();
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(payload)
        .execute(conn)
        .await?;
    Ok(())
}

/// A value from a BIGINT column that must be non-negative and fit `u32`/`u64`.
pub(crate) fn non_negative(table: &'static str, field: &str, v: i64) -> Result<u64, FleetError> {
    u64::try_from(v).map_err(|_| FleetError::Corrupt {
        table,
        reason: format!("{field} = {v} is negative"),
    })
}

/// A u64 for a BIGINT column (values above i64::MAX are clamped: caps and
/// resources that large mean "unbounded" in practice).
pub(crate) fn to_db(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
