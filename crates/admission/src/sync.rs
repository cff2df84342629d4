//! Synchronisation primitives, swapped for loom's under `--cfg loom` so the
//! model checker can explore every interleaving of admission's critical
//! sections. Everything in this crate that admission shares between threads
//! comes from here; the ledger's file locks are outside the model.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicU64, Ordering},
    Arc, Condvar, Mutex, MutexGuard,
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc, Condvar, Mutex, MutexGuard,
};

/// Locks `mutex`, ignoring poisoning: every critical section in this crate
/// leaves its data consistent before anything that could panic, so a panic
/// elsewhere while the lock was held cannot have left half an update.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Gives other threads a chance to run (the mutant's gap between check and
/// reserve; loom needs its own to explore the switch).
#[cfg(feature = "check-then-act-mutant")]
pub(crate) fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}
