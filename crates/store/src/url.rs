//! Where the state lives: the parsed `--state` flag and the connection
//! options both stores share.

use crate::error::StoreError;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// The parsed `--state` value.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `sqlite:PATH` or `sqlite://PATH`: an embedded database file, created
    /// (with its directory) if missing.
    Sqlite(PathBuf),
    /// `postgres://…` or `postgresql://…`, passed to the driver as is.
    Postgres(String),
}

impl StoreUrl {
    /// The default store inside a state dir: `<state-dir>/state.db`.
    pub fn default_in(state_dir: &std::path::Path) -> Self {
        Self::Sqlite(state_dir.join("state.db"))
    }
}

impl FromStr for StoreUrl {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| StoreError::InvalidUrl {
            input: redact(s),
            reason: reason.to_owned(),
        };
        if let Some(rest) = s.strip_prefix("sqlite:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            // A query string (`?mode=…`) would be taken as part of the file
            // name; refuse it instead of creating an oddly named file.
            if path.is_empty() {
                return Err(bad("no database path after sqlite:"));
            }
            if path == ":memory:" || path.contains('?') {
                return Err(bad(
                    "durable state needs a file path (no :memory:, no ?options)",
                ));
            }
            return Ok(Self::Sqlite(PathBuf::from(path)));
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            let rest = s.split_once("://").map(|(_, r)| r).unwrap_or_default();
            if rest.is_empty() || rest.starts_with('/') && !rest.contains("host=") {
                return Err(bad("no host in the PostgreSQL URL"));
            }
            return Ok(Self::Postgres(s.to_owned()));
        }
        Err(bad("unknown scheme"))
    }
}

/// `postgres://user:secret@host` → `postgres://user:***@host`, for errors
/// and logs.
fn redact(s: &str) -> String {
    let Some((scheme, rest)) = s.split_once("://") else {
        return s.to_owned();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
            None => s.to_owned(),
        },
        None => s.to_owned(),
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sqlite(p) => write!(f, "sqlite:{}", p.display()),
            Self::Postgres(u) => f.write_str(&redact(u)),
        }
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreUrl({self})")
    }
}

/// Connection tuning shared by both stores.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// How long a call waits for a pooled connection (including connecting)
    /// before failing with [`StoreError::Unavailable`]. Bounds how long a
    /// scale request hangs while PostgreSQL is down. Default 1 s.
    pub acquire_timeout: Duration,
    /// Pool size. PostgreSQL: every connection the store holds, the
    /// host's session (identity lock, `LISTEN`) included, so at least 2;
    /// idle ones beyond the session are closed after 30 s. SQLite: readers
    /// (there is always exactly one writer). Default 4.
    pub max_connections: u32,
    /// PostgreSQL: how often the session sends a query when idle.
    pub session_keepalive: Duration,
    /// PostgreSQL: the server ends the session after this long without a
    /// query (`idle_session_timeout`), releasing its locks, so that a host
    /// cut off from the database loses them on the server's side in bounded
    /// time. `None`: the server's setting.
    pub session_idle_timeout: Option<Duration>,
    /// SQLite only: how long a statement waits for the file lock held by
    /// another process before failing with `Unavailable`. Default 5 s.
    pub sqlite_busy_timeout: Duration,
    /// What guest address pools are keyed by besides their network:
    /// stores with different scopes lease the same network's addresses
    /// independently. A machine's bridge (and the guests behind it) is its
    /// own, so the daemon passes its machine id: ten hosts on the default
    /// network each get all of its addresses, while two daemons on one
    /// machine still share one pool. `None` (the default): one pool per
    /// network for every store of the database.
    pub address_scope: Option<AddressScope>,
}

/// A scope of guest address pools (see [`StoreOptions::address_scope`]):
/// 1 to 64 ASCII letters, digits, `-`, `_` or `.`, so that it can never be
/// mistaken for part of the network it qualifies.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AddressScope(String);

/// A string that cannot be an [`AddressScope`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` cannot scope address pools: expected 1 to 64 ASCII letters, digits, `-`, `_` or `.`"
)]
pub struct AddressScopeError(pub String);

impl AddressScope {
    /// The scope as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for AddressScope {
    type Err = AddressScopeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = (1..=64).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(AddressScopeError(s.to_owned()))
        }
    }
}

impl std::fmt::Display for AddressScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            acquire_timeout: Duration::from_secs(1),
            max_connections: 4,
            session_keepalive: Duration::from_secs(1),
            session_idle_timeout: None,
            sqlite_busy_timeout: Duration::from_secs(5),
            address_scope: None,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_the_three_forms_and_refuses_the_rest() {
        assert_eq!(
            "sqlite:/var/lib/k/state.db".parse::<StoreUrl>().unwrap(),
            StoreUrl::Sqlite("/var/lib/k/state.db".into())
        );
        assert_eq!(
            "sqlite:///var/lib/k/state.db".parse::<StoreUrl>().unwrap(),
            StoreUrl::Sqlite("/var/lib/k/state.db".into())
        );
        assert_eq!(
            "sqlite:rel/state.db".parse::<StoreUrl>().unwrap(),
            StoreUrl::Sqlite("rel/state.db".into())
        );
        assert!(matches!(
            "postgresql://u:p@h:5432/db".parse::<StoreUrl>().unwrap(),
            StoreUrl::Postgres(_)
        ));
        for bad in [
            "",
            "sqlite:",
            "sqlite::memory:",
            "sqlite:x.db?mode=ro",
            "mysql://h/db",
            "/var/lib/state.db",
            "postgres://",
        ] {
            let e = bad.parse::<StoreUrl>().unwrap_err();
            assert!(matches!(e, StoreError::InvalidUrl { .. }), "{bad}: {e}");
        }
    }

    #[test]
    fn display_hides_the_password() {
        let u: StoreUrl = "postgres://kici:hunter2@db:5432/k".parse().unwrap();
        assert_eq!(u.to_string(), "postgres://kici:***@db:5432/k");
        let e = "postgres:/kici:hunter2@db"
            .parse::<StoreUrl>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown scheme"), "{e}");
        assert!(!format!("{u:?}").contains("hunter2"));
    }
}
