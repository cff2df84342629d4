//! The shared store: PostgreSQL, for several instances (hosts) at once.
//!
//! Connections: one pool, whose size ([`crate::StoreOptions::max_connections`])
//! is everything this store holds. One of its connections is the host's
//! [`PgSession`], which carries the session-level state: the identity lock
//! here, and whatever else of the host shares the database
//! ([`crate::StateStore::postgres`], e.g. a fleet's `LISTEN` and leadership).
//!
//! Identity: a session-level advisory lock keyed by the instance id, taken
//! at open on the session and held for the store's life, so two daemons
//! with one instance id (a cloned image) cannot both run against one
//! database. If the session is lost (server restart) the lock goes with it;
//! [`crate::StateStore::ping`] takes it again.
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
use crate::session::{AdvisoryKey, Locked, PgSession, SessionOptions};
use crate::{SharedPostgres, StoreKind, StoreOptions};
use ipnet::Ipv4Net;
use kici_model::InstanceId;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};
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
/// A pooled connection unused this long is closed: an idle host holds its
/// session and little else.
const IDLE_CONNECTION: Duration = Duration::from_secs(30);

/// [`crate::StateStore`] on PostgreSQL.
pub(crate) struct PgStore {
    owner: InstanceId,
    owner_text: String,
    pool: PgPool,
    connect: PgConnectOptions,
    /// The host's session, holding the identity lock.
    session: PgSession,
    /// The identity lock, as last taken (`None` once found lost).
    lock: tokio::sync::Mutex<Option<Locked>>,
    filled: tokio::sync::Mutex<HashSet<Ipv4Net>>,
    /// [`StoreOptions::address_scope`].
    address_scope: Option<crate::AddressScope>,
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
        // The session is one of the pool's connections: the pool's size
        // is everything this host holds (at least one more for queries).
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(2))
            .min_connections(0)
            .acquire_timeout(options.acquire_timeout)
            .idle_timeout(Some(IDLE_CONNECTION))
            .test_before_acquire(true)
            .connect_lazy_with(connect.clone());
        let session = PgSession::open(
            &pool,
            SessionOptions {
                channels: Vec::new(),
                keepalive: options.session_keepalive,
                idle_timeout: options.session_idle_timeout,
                call_timeout: options.acquire_timeout.max(Duration::from_secs(1)),
            },
        )
        .await?;
        let lock = match Self::take_lock(&session, owner).await {
            Ok(l) => l,
            Err(e) => {
                session.close().await;
                pool.close().await;
                return Err(e);
            }
        };
        let owner_text = owner.to_string();
        let prepared = async {
            // sqlx serialises concurrent migrators with its own advisory lock.
            crate::migrations::POSTGRES
                .run(&pool)
                .await
                .map_err(|e| StoreError::Migrate(e.to_string()))?;
            sqlx::query(crate::sql::PUT_INSTANCE)
                .bind(&owner_text)
                .bind(crate::sql::hostname())
                .bind(crate::UnixMillis::now().0)
                .execute(&pool)
                .await
                .map_err(classify)
        }
        .await;
        if let Err(e) = prepared {
            // The session's task would otherwise keep its connection (and
            // the identity lock) for as long as the process lives.
            session.close().await;
            pool.close().await;
            return Err(e);
        }
        Ok(Self {
            owner,
            owner_text,
            pool,
            connect,
            session,
            lock: tokio::sync::Mutex::new(Some(lock)),
            filled: tokio::sync::Mutex::new(HashSet::new()),
            address_scope: options.address_scope.clone(),
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

    /// Takes `owner`'s advisory lock on the session. A lock already held is
    /// waited for up to [`DEAD_SESSION_WAIT`] (its holder may have just
    /// died).
    async fn take_lock(session: &PgSession, owner: InstanceId) -> Result<Locked, StoreError> {
        let (ns, key) = Self::lock_keys(owner);
        // A daemon killed a moment ago holds the lock until PostgreSQL
        // notices its session is gone (its backend reads the closed socket):
        // that takes a moment, not a restart's worth of refusals. A live
        // holder still holds it after the wait.
        let mut waited = Duration::ZERO;
        loop {
            if let Some(locked) = session.try_lock(AdvisoryKey::Pair(ns, key)).await? {
                return Ok(locked);
            }
            if waited >= DEAD_SESSION_WAIT {
                return Err(StoreError::IdentityInUse { owner });
            }
            tokio::time::sleep(LOCK_RETRY).await;
            waited += LOCK_RETRY;
        }
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
        if lock.is_some_and(|l| self.session.holds(l)) {
            return Ok(());
        }
        if lock.take().is_some() {
            tracing::warn!(owner = %self.owner, "the database session holding the instance's advisory lock was lost; taking the lock again");
        }
        *lock = Some(Self::take_lock(&self.session, self.owner).await?);
        Ok(())
    }

    fn postgres_impl(&self) -> Option<SharedPostgres> {
        Some(SharedPostgres {
            pool: self.pool.clone(),
            session: self.session.clone(),
            connect: self.connect.clone(),
        })
    }

    async fn close_impl(&self) {
        // Ending the session releases the advisory lock (a broken one
        // already did); then every pooled connection can come back.
        self.session.close().await;
        self.pool.close().await;
    }
}

crate::sql::impl_state_store!(PgStore, StoreKind::Postgres);
