//! The fleet's schema: its own migration set (`migrations/`, embedded), run
//! in one transaction under a transaction-level advisory lock so concurrent
//! starters apply each migration once, and recorded in
//! `fleet_schema_versions` (not sqlx's `_sqlx_migrations`, which kici-store
//! owns in the same database: two migrators on one table would each see the
//! other's versions as unknown).
//!
//! A database whose newest applied version is above this binary's newest
//! is refused ([`FleetError::SchemaTooNew`]): this binary would ignore what
//! it does not know. Migrations are additive (new tables, new nullable or
//! defaulted columns), so hosts still running the previous binary keep
//! working through a rolling upgrade; only a (re)start of an older binary
//! against a newer schema is refused.

use crate::error::FleetError;
use sqlx::{Executor, PgPool};

/// One embedded migration.
struct Migration {
    version: i64,
    description: &'static str,
    sql: &'static str,
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "fleet tables",
        sql: include_str!("../migrations/0001_fleet.sql"),
    },
    Migration {
        version: 2,
        description: "agent registration time",
        sql: include_str!("../migrations/0002_agent_registered.sql"),
    },
    Migration {
        version: 3,
        description: "request secrets",
        sql: include_str!("../migrations/0003_request_secret.sql"),
    },
    Migration {
        version: 4,
        description: "usage counters",
        sql: include_str!("../migrations/0004_usage_counters.sql"),
    },
    Migration {
        version: 5,
        description: "the entry path in one call",
        sql: include_str!("../migrations/0005_entry_in_one_call.sql"),
    },
];

/// The newest schema version this binary knows.
pub const SCHEMA_VERSION: i64 = 5;

/// Key of the transaction-level advisory lock migrations run under
/// ("kflt-mig" in ASCII; single-key locks live apart from kici-store's
/// two-key ones).
const MIGRATE_LOCK: i64 = 0x6b66_6c74_2d6d_6967;

/// Applies the missing migrations; returns the schema version now in the
/// database. Refuses a database newer than this binary.
pub async fn migrate(pool: &PgPool) -> Result<i64, FleetError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATE_LOCK)
        .execute(&mut *tx)
        .await?;
    // A string without arguments runs as a simple query (several
    // statements allowed), like the migration files below.
    (&mut *tx)
        .execute(
            "CREATE TABLE IF NOT EXISTS fleet_schema_versions ( \
                version BIGINT NOT NULL PRIMARY KEY, \
                description TEXT NOT NULL, \
                applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        )
        .await?;
    let current: Option<i64> = sqlx::query_scalar("SELECT max(version) FROM fleet_schema_versions")
        .fetch_one(&mut *tx)
        .await?;
    let current = current.unwrap_or(0);
    if current > SCHEMA_VERSION {
        return Err(FleetError::SchemaTooNew {
            database: current,
            binary: SCHEMA_VERSION,
        });
    }
    // A plain loop, not an iterator adapter: a closure held across the
    // awaits below would make this future not `Send` for every lifetime
    // (and so not spawnable).
    for m in MIGRATIONS {
        if m.version <= current {
            continue;
        }
        (&mut *tx)
            .execute(m.sql)
            .await
            .map_err(|e| FleetError::Migrate(format!("version {}: {e}", m.version)))?;
        sqlx::query("INSERT INTO fleet_schema_versions (version, description) VALUES ($1, $2)")
            .bind(m.version)
            .bind(m.description)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(current.max(SCHEMA_VERSION))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_increasing_and_end_at_schema_version() {
        let mut last = 0;
        for m in MIGRATIONS {
            assert!(m.version > last);
            last = m.version;
        }
        assert_eq!(last, SCHEMA_VERSION);
    }
}
