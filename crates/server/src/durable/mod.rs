//! What survives the daemon: the engine's journal (agents and pending
//! requests) as store rows and back ([`state`]), standalone jobs and events
//! in the store ([`persist`]), and the reconciler that keeps the store and the
//! host in agreement ([`reconcile`]).

pub mod persist;
pub mod reconcile;
pub mod state;
