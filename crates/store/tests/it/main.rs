//! The integration tests of kici-store, one binary: each module below used to
//! be a test binary of its own, each linking the crate and its dependencies
//! again. Test names carry the module (`failpoints::…`); nextest runs each
//! test in a process of its own either way.

mod common;
mod failpoints;
mod outage;
mod postgres;
mod provision;
mod schema;
mod sqlite;
