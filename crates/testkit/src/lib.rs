//! Test infrastructure for kici-scaler: a spec-enforcing Firecracker API
//! simulator and a fake jailer.
