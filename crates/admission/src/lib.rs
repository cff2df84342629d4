//! Atomic admission against count and resource caps, Reservation guards, and the cross-process machine-pool ledger.
