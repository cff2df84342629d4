//! Atomic admission against count and resource caps, [`Reservation`]
//! guards, and the cross-process machine-pool ledger.
//!
//! This crate owns capacity accounting: how many agents, milli-CPUs and
//! bytes each scaler, the whole daemon and each machine pool have reserved,
//! and the decision whether one more agent fits. It does not decide *which*
//! scaler serves a request (routing) nor *when* to retry a refused one (the
//! engine's pending queue, woken by [`Admission::subscribe_releases`]).
//!
//! - [`Admission::try_reserve`] checks every cap — `global-count`,
//!   `scaler-count`, `scaler-cpu`, `scaler-memory`, `global-cpu`,
//!   `global-memory`, `pool-cpu`, `pool-memory`, in that order, each as
//!   `used + held + requested > limit` — and reserves, in one critical
//!   section. A [`Refusal`], [`TooLarge`] or error leaves nothing reserved.
//! - A [`Reservation`] is released exactly once, when dropped.
//! - [`MachineLedger`] shares pool caps between processes on one host
//!   (`flock`-guarded version 2 JSON files, liveness by owner locks).

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod admission;
mod cap;
mod holds;
pub mod ledger;
mod signal;
mod sync;

pub use admission::{
    Admission, AdmissionError, AdmitError, Demand, Reservation, ScopeUsage, UsageSnapshot,
};
pub use cap::{Cap, CapUnit, Caps, Refusal, TooLarge};
pub use holds::Holds;
pub use ledger::{LedgerError, MachineLedger};
pub use signal::{ReleaseSignal, Released};
