//! kici-scaler's daemon and command-line front end, as a library so that the
//! binary (`src/main.rs`) stays a thin shell and integration tests can reach
//! the same code.
//!
//! - [`cli`]: argument parsing, the one-shot commands, exit codes, logging.
//! - [`identity`]: the state dir, its lock and the instance identity.

pub mod cli;
pub mod identity;
