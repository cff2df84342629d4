//! What can go wrong talking to the state store, sorted by what the caller
//! does about it: [`StoreError::Unavailable`] is retryable (503 to clients),
//! [`StoreError::IdentityInUse`] stops the daemon, the rest are bugs or
//! operator errors to report.

use crate::ipam::AllocError;
use kici_model::InstanceId;
use std::path::PathBuf;

/// Every failure of a [`crate::StateStore`] call or of [`crate::open`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The `--state` value is neither `sqlite:PATH` nor a PostgreSQL URL.
    #[error("invalid --state `{input}`: {reason} (expected sqlite:PATH, sqlite://PATH, postgres://… or postgresql://…)")]
    InvalidUrl {
        /// What was given.
        input: String,
        /// Why it was refused.
        reason: String,
    },
    /// The database cannot be reached right now (connection refused or
    /// lost, pool acquire timed out, SQLite busy past its timeout). Nothing
    /// was written by the failed call; retry later.
    #[error("state store unavailable: {0}")]
    Unavailable(String),
    /// Another live session already holds this instance id's advisory lock
    /// in the shared PostgreSQL: two daemons were started with one identity
    /// (a cloned state dir or image).
    #[error("instance id {owner} is already in use by another kici-scaler on this PostgreSQL (advisory lock held); two daemons must not share an instance id")]
    IdentityInUse {
        /// The contested instance id.
        owner: InstanceId,
    },
    /// An agent id already exists under another owner (ids are 32 random
    /// bits, checked for collisions only within one instance).
    #[error("agent id {agent} is already recorded by instance {other_owner}")]
    AgentIdTaken {
        /// The colliding agent id.
        agent: String,
        /// The instance that owns the existing row.
        other_owner: String,
    },
    /// The SQLite file's directory could not be created.
    #[error("cannot create the state directory {path}: {source}")]
    Io {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Applying the embedded migrations failed (or the database holds a
    /// newer schema than this binary knows).
    #[error("migrating the state store failed: {0}")]
    Migrate(String),
    /// A stored row does not decode into its record type (hand-edited or
    /// written by an incompatible version).
    #[error("invalid stored {table} row: {reason}")]
    Corrupt {
        /// The table the row is in.
        table: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A value does not fit its column (a u64 above i64::MAX).
    #[error("{field} = {value} does not fit a signed 64-bit column")]
    OutOfRange {
        /// Which field.
        field: &'static str,
        /// The value.
        value: u64,
    },
    /// Any other database error (a bug, a constraint, a permission).
    #[error("state store error: {0}")]
    Database(String),
}

impl StoreError {
    /// Whether a retry after the store comes back can succeed.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

/// Sorts a driver error: connection-level trouble is `Unavailable`,
/// everything else `Database`.
pub(crate) fn classify(e: sqlx::Error) -> StoreError {
    if is_unavailable(&e) {
        StoreError::Unavailable(e.to_string())
    } else {
        StoreError::Database(e.to_string())
    }
}

pub(crate) fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        // A connection that died mid-message (server shut down under it).
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => {
                let code = code.as_ref();
                // PostgreSQL SQLSTATE: class 08 connection exception, 57P01..3
                // shutdown / crash recovery / cannot connect now, 53300 too
                // many connections.
                code.starts_with("08")
                    || matches!(code, "57P01" | "57P02" | "57P03" | "53300")
                    // SQLite primary codes (extended codes keep them in the
                    // low byte): 5 BUSY, 6 LOCKED, past busy_timeout.
                    || code
                        .parse::<i32>()
                        .is_ok_and(|n| matches!(n & 0xff, 5 | 6))
            }
            None => false,
        },
        _ => false,
    }
}

pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|db| matches!(db.kind(), sqlx::error::ErrorKind::UniqueViolation))
}

impl From<StoreError> for AllocError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) => AllocError::Unavailable(m),
            other => AllocError::Store(other.to_string()),
        }
    }
}
