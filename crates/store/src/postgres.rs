//! The shared store: PostgreSQL, for several instances (hosts) at once.
//!
//! Identity: a session-level advisory lock keyed by the instance id, taken
//! at open on a dedicated connection outside the pool and held for the
//! store's life, so two daemons with one instance id (a cloned image) cannot
//! both run against one database. If that connection is lost (server
//! restart) the lock goes with it; [`crate::StateStore::ping`] takes it
//! again.
//!
//! IP claims use `FOR UPDATE SKIP LOCKED` on the pre-filled pool: concurrent
//! allocators (in this or other instances) each lock a different free row
//! instead of queueing on the same lowest one, and a row another transaction
//! claimed meanwhile is re-checked after the lock and skipped.
//!
//! Outages: the pool's acquire timeout bounds every call; a broken pooled
//! connection is dropped (`test_before_acquire`) and replaced on demand, so
//! service resumes without a restart when the server returns.

use crate::error::{classify, StoreError};
use crate::{StoreKind, StoreOptions};
use ipnet::Ipv4Net;
use kici_model::InstanceId;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Postgres, Transaction};
use std::collections::HashSet;
use std::str::FromStr;
use std::time::Duration;

/// First key of the two-key advisory lock: "kici" in ASCII, so our locks
/// are recognisable in `pg_locks` and do not collide with other users of
/// single-key advisory locks.
const LOCK_NAMESPACE: i32 = 0x6b69_6369;
/// How long an instance lock held by a session that may have just died is
/// waited for before the instance is reported in use.
const DEAD_SESSION_WAIT: Duration = Duration::from_secs(3);
const LOCK_RETRY: Duration = Duration::from_millis(50);

/// [`crate::StateStore`] on PostgreSQL.
pub(crate) struct PgStore {
    owner: InstanceId,
    owner_text: String,
    pool: PgPool,
    connect: PgConnectOptions,
    /// The connection holding the advisory lock (`None` once lost).
    lock: tokio::sync::Mutex<Option<PgConnection>>,
    filled: tokio::sync::Mutex<HashSet<Ipv4Net>>,
    /// [`StoreOptions::address_scope`].
    address_scope: Option<crate::AddressScope>,
    /// Bounds (re)connecting the lock connection, like pool acquires.
    connect_timeout: Duration,
}

impl PgStore {
    /// The IP claim, one statement, one round trip: the
    /// agent's existing lease in the network (rewritten unchanged, which
    /// makes the call idempotent) or else the lowest free address.
    /// The free row is locked `FOR UPDATE SKIP LOCKED` (re-checked after
    /// the lock, skipped if another claim holds it); COALESCE evaluates the
    /// second sub-select (an init plan) only when the first found nothing,
    /// so no free row is locked for an agent that already has one.
    const CLAIM_IP: &'static str = "UPDATE ip_leases SET agent_id = $2, owner = $3, leased_at = COALESCE(leased_at, $4) \
        WHERE network = $1 AND ip = COALESCE( \
            (SELECT ip FROM ip_leases WHERE network = $1 AND agent_id = $2 AND owner = $3), \
            (SELECT ip FROM ip_leases WHERE network = $1 AND agent_id IS NULL ORDER BY ip LIMIT 1 FOR UPDATE SKIP LOCKED)) \
        RETURNING ip";

    pub(crate) async fn open(
        url: &str,
        owner: InstanceId,
        options: &StoreOptions,
    ) -> Result<Self, StoreError> {
        let connect = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::InvalidUrl {
                input: crate::StoreUrl::Postgres(url.to_owned()).to_string(),
                reason: e.to_string(),
            })?
            .application_name(&format!("kici-scaler {owner}"));
        let lock = Self::take_lock(&connect, owner, options.acquire_timeout).await?;
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .test_before_acquire(true)
            .connect_lazy_with(connect.clone());
        // sqlx serialises concurrent migrators with its own advisory lock.
        crate::migrations::POSTGRES
            .run(&pool)
            .await
            .map_err(|e| StoreError::Migrate(e.to_string()))?;
        let owner_text = owner.to_string();
        sqlx::query(crate::sql::PUT_INSTANCE)
            .bind(&owner_text)
            .bind(crate::sql::hostname())
            .bind(crate::UnixMillis::now().0)
            .execute(&pool)
            .await
            .map_err(classify)?;
        Ok(Self {
            owner,
            owner_text,
            pool,
            connect,
            lock: tokio::sync::Mutex::new(Some(lock)),
            filled: tokio::sync::Mutex::new(HashSet::new()),
            address_scope: options.address_scope.clone(),
            connect_timeout: options.acquire_timeout,
        })
    }

    /// The two advisory-lock keys of `owner`: namespace, then the id's 32
    /// bits reinterpreted as a signed int4.
    fn lock_keys(owner: InstanceId) -> (i32, i32) {
        let bits = owner
            .to_string()
            .chars()
            .fold(0u32, |acc, c| (acc << 4) | c.to_digit(16).unwrap_or(0));
        (LOCK_NAMESPACE, i32::from_ne_bytes(bits.to_ne_bytes()))
    }

    /// The session holding `owner`'s advisory lock for the store's life. A
    /// lock already held is waited for up to [`DEAD_SESSION_WAIT`] (its
    /// holder may have just died).
    async fn take_lock(
        connect: &PgConnectOptions,
        owner: InstanceId,
        timeout: Duration,
    ) -> Result<PgConnection, StoreError> {
        let mut conn = tokio::time::timeout(timeout, connect.connect())
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!("connecting to PostgreSQL took over {timeout:?}"))
            })?
            .map_err(classify)?;
        let (ns, key) = Self::lock_keys(owner);
        // A daemon killed a moment ago holds the lock until PostgreSQL
        // notices its session is gone (its backend reads the closed socket):
        // that takes a moment, not a restart's worth of refusals. A live
        // holder still holds it after the wait.
        let mut waited = Duration::ZERO;
        let got = loop {
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
                .bind(ns)
                .bind(key)
                .fetch_one(&mut conn)
                .await
                .map_err(classify)?;
            if got || waited >= DEAD_SESSION_WAIT {
                break got;
            }
            tokio::time::sleep(LOCK_RETRY).await;
            waited += LOCK_RETRY;
        };
        if !got {
            // Best effort: the session ends either way.
            let _ = conn.close().await;
            return Err(StoreError::IdentityInUse { owner });
        }
        Ok(conn)
    }

    fn reader(&self) -> &PgPool {
        &self.pool
    }

    fn writer(&self) -> &PgPool {
        &self.pool
    }

    async fn begin_write(&self) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        self.pool.begin().await
    }

    async fn ping_impl(&self) -> Result<(), StoreError> {
        sqlx::query(crate::sql::HEARTBEAT)
            .bind(&self.owner_text)
            .bind(crate::UnixMillis::now().0)
            .execute(&self.pool)
            .await
            .map_err(classify)?;
        let mut lock = self.lock.lock().await;
        if let Some(conn) = lock.as_mut() {
            if conn.ping().await.is_ok() {
                return Ok(());
            }
            tracing::warn!(owner = %self.owner, "lost the connection holding the instance's advisory lock; taking it again");
            *lock = None;
        }
        *lock = Some(Self::take_lock(&self.connect, self.owner, self.connect_timeout).await?);
        Ok(())
    }

    async fn close_impl(&self) {
        self.pool.close().await;
        if let Some(conn) = self.lock.lock().await.take() {
            // Ending the session releases the advisory lock; if the
            // connection is already broken the server released it.
            let _ = conn.close().await;
        }
    }
}

crate::sql::impl_state_store!(PgStore, StoreKind::Postgres);
