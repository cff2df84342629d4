//! The integration tests of kici-admission, one binary: each module below
//! used to be a test binary of its own, each linking the crate and its
//! dependencies again. Test names carry the module (`admission::…`); nextest
//! runs each test in a process of its own either way.
//!
//! The loom models (`loom`) compile only under `--cfg loom`, everything else
//! only without it: `RUSTFLAGS="--cfg loom" cargo test -p kici-admission
//! --test it --release loom::` runs the models alone.

mod admission;
#[path = "../common/mod.rs"]
mod common;
mod ledger;
mod loom;
mod processes;
mod stress;
