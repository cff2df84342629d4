//! kici-scaler's daemon and command-line front end, as a library so that the
//! binary (`src/main.rs`) stays a thin shell and integration tests can reach
//! the same code.
//!
//! - [`identity`]: the state dir, its lock and the instance identity.

pub mod identity;
