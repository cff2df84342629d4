//! What can go wrong in the fleet layer, sorted by what the caller does
//! about it: [`FleetError::Unavailable`] is retryable; [`FleetError::LeaseLost`]
//! and [`FleetError::LeaseLapsed`] mean "stop claiming and starting, rejoin";
//! [`FleetError::StaleEpoch`] and [`FleetError::NotClaimed`] mean "this work
//! is no longer ours, undo it"; [`FleetError::SchemaTooNew`] and
//! [`FleetError::PoolMismatch`] stop the daemon (or the pool) with a clear
//! message; [`FleetError::Conflict`] is a 409.

use std::fmt;

/// One pool whose definition differs from what the fleet's live hosts advertise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMismatch {
    /// The pool (scaler name).
    pub pool: String,
    /// The live hosts advertising the other definition (`instance id (hostname)`).
    pub hosts: Vec<String>,
    /// What differs, in words (label sets, fleet caps, or both, with values).
    pub difference: String,
}

impl fmt::Display for PoolMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pool `{}` is defined differently on live host(s) {}: {}",
            self.pool,
            self.hosts.join(", "),
            self.difference
        )
    }
}

fn join_mismatches(m: &[PoolMismatch]) -> String {
    m.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every failure of a fleet call.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The URL is not a PostgreSQL URL sqlx accepts.
    #[error("invalid fleet database URL: {0}")]
    InvalidUrl(String),
    /// The database cannot be reached right now (connection refused or
    /// lost, pool acquire timed out). The failed call changed nothing; retry.
    #[error("fleet database unavailable: {0}")]
    Unavailable(String),
    /// A row stayed locked by others past the statement's `lock_timeout`
    /// (a busy pool's claim gives up rather than wait). Nothing changed;
    /// retry.
    #[error("a fleet row is busy (lock timeout); retry")]
    LockTimeout,
    /// PostgreSQL broke a deadlock by rolling this transaction back
    /// (SQLSTATE 40P01). Nothing changed; retry.
    #[error("the fleet database rolled back a deadlocked transaction; retry")]
    Deadlock,
    /// The database was migrated by a newer kici-fleet than this binary:
    /// running would ignore columns and rules it does not know.
    #[error("the fleet schema in the database is version {database}, newer than this binary's {binary}: upgrade this binary (a binary older than the database's schema must not run)")]
    SchemaTooNew {
        /// The newest migration the database has applied.
        database: i64,
        /// The newest migration this binary knows.
        binary: i64,
    },
    /// Applying the embedded migrations failed.
    #[error("migrating the fleet schema failed: {0}")]
    Migrate(String),
    /// Joining with pool definitions that differ from the live hosts'.
    /// The pools are named; the host may join again without them.
    #[error("refused to join the fleet: {}", join_mismatches(.0))]
    PoolMismatch(Vec<PoolMismatch>),
    /// Joining with fleet-wide caps that differ from those the live hosts
    /// joined with.
    #[error("refused to join the fleet: global fleet caps differ from those of live host(s) {}: ours {ours}, theirs {theirs}", .hosts.join(", "))]
    GlobalCapsMismatch {
        /// The live hosts.
        hosts: Vec<String>,
        /// This host's caps, in words.
        ours: String,
        /// The fleet's recorded caps, in words.
        theirs: String,
    },
    /// The lease could not be renewed: the database has this host under
    /// another epoch or no longer `up` (the leader marked it lost, or it
    /// left). Stop claiming and starting; rejoin for a new epoch.
    #[error("host {instance} lost its lease (epoch {epoch}); it must rejoin the fleet")]
    LeaseLost {
        /// The host.
        instance: String,
        /// The epoch that is no longer current.
        epoch: i64,
    },
    /// This host's own monotonic clock says its lease may have lapsed (no
    /// successful renewal for lease − margin): nothing may be claimed or
    /// started until a renewal succeeds or the host rejoins.
    #[error("host {instance}'s lease is not known to be valid (epoch {epoch}): not claiming or starting")]
    LeaseLapsed {
        /// The host.
        instance: String,
        /// The epoch of the lapsed lease.
        epoch: i64,
    },
    /// A claim or start under an epoch that is not the host's current one.
    #[error("host {instance}: epoch {held} is stale (current {current:?}); refused")]
    StaleEpoch {
        /// The host.
        instance: String,
        /// The epoch the caller holds.
        held: i64,
        /// The database's current epoch for the host (None: host unknown or not up).
        current: Option<i64>,
    },
    /// The request is not (or no longer) claimed by this host under this
    /// epoch: another host may serve it. Whatever was started for it must go.
    #[error("request {job_id} is not claimed by this host under epoch {epoch}")]
    NotClaimed {
        /// The request's job id.
        job_id: String,
        /// The epoch of the caller's claim.
        epoch: i64,
    },
    /// A request with this job id exists in the fleet with a different body.
    #[error("job id {job_id} is already queued in the fleet with a different body")]
    Conflict {
        /// The job id.
        job_id: String,
    },
    /// A stored row does not decode (hand-edited, or a value out of range).
    #[error("invalid stored {table} row: {reason}")]
    Corrupt {
        /// The table.
        table: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Any other database error (a bug, a constraint, a permission).
    #[error("fleet database error: {0}")]
    Database(String),
}

impl FleetError {
    /// Whether a retry after the database comes back can succeed.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

impl From<sqlx::Error> for FleetError {
    fn from(e: sqlx::Error) -> Self {
        match e.as_database_error().and_then(|d| d.code()).as_deref() {
            Some("55P03") => return Self::LockTimeout,
            Some("40P01") => return Self::Deadlock,
            _ => {}
        }
        if is_unavailable(&e) {
            Self::Unavailable(e.to_string())
        } else {
            Self::Database(e.to_string())
        }
    }
}

impl FleetError {
    /// A `lock_timeout` ran out (SQLSTATE 55P03): the row was busy.
    pub(crate) fn is_lock_timeout(&self) -> bool {
        matches!(self, Self::LockTimeout)
    }

    /// The host's session (kici-store) failed: unavailable stays
    /// unavailable, anything else is a database error.
    pub(crate) fn from_store(e: kici_store::StoreError) -> Self {
        if e.is_unavailable() {
            Self::Unavailable(e.to_string())
        } else {
            Self::Database(e.to_string())
        }
    }
}

/// Connection-level trouble (the same sorting as kici-store's).
pub(crate) fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // SQLSTATE class 08 connection exception, 57P01..3 shutdown /
            // crash recovery / cannot connect now, 53300 too many connections.
            let code = code.as_ref();
            code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "53300")
        }),
        _ => false,
    }
}
