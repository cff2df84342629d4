//! The fleet: many kici-scaler hosts sharing one PostgreSQL act as one
//! scaler (membership with fenced leases, one queue, fleet caps, a leader).

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
pub use placement::{should_claim, HostLoad, Placement};
pub use queue::{Claim, Enqueued, NewRequest, Queue, RequestKind, RequestState, Waker};
pub use schema::SCHEMA_VERSION;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// The one NOTIFY channel of every fleet in a database; the payload names
/// the fleet and the pool (channel names are identifiers of at most 63
/// bytes, fleet names are free text).
pub(crate) const CHANNEL: &str = "kici_fleet";

/// Connection settings of a [`Fleet`] handle.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// Pooled connections (claims, renewals, enqueues). The leader's
    /// session and each [`Waker`]'s listener are extra, dedicated ones.
    pub max_connections: u32,
    /// Bound on waiting for a pooled connection (and on connecting the
    /// dedicated ones): past it a call fails with [`FleetError::Unavailable`].
    pub acquire_timeout: Duration,
}

impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            max_connections: 8,
            acquire_timeout: Duration::from_secs(3),
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
    connect: PgConnectOptions,
    acquire_timeout: Duration,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").field("name", &self.name).finish()
    }
}

impl Fleet {
    /// Connects to `url`, applies the fleet migrations (refusing a schema
    /// newer than this binary, [`FleetError::SchemaTooNew`]) and returns a
    /// handle on fleet `name` (one database can hold several fleets).
    pub async fn connect(url: &str, name: &str, options: FleetOptions) -> Result<Self, FleetError> {
        let connect = PgConnectOptions::from_str(url)
            .map_err(|e| FleetError::InvalidUrl(e.to_string()))?
            .application_name(&format!("kici-fleet {name}"));
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .test_before_acquire(true)
            .connect_lazy_with(connect.clone());
        schema::migrate(&pool).await?;
        Ok(Self {
            name: name.into(),
            pool,
            connect,
            acquire_timeout: options.acquire_timeout,
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
    pub async fn waker(&self, pools: &[String]) -> Result<Waker, FleetError> {
        Waker::listen(self, pools).await
    }

    /// Closes the pooled connections.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    pub(crate) fn connect_options(&self) -> &PgConnectOptions {
        &self.connect
    }

    pub(crate) fn acquire_timeout(&self) -> Duration {
        self.acquire_timeout
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
