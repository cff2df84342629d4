//! The integration tests of kici-engine, one binary: each module below used
//! to be a test binary of its own, each linking the crate and its
//! dependencies again. Test names carry the module (`engine::…`); nextest
//! runs each test in a process of its own either way.

mod capacity;
mod common;
mod engine;
mod model;
mod recovery;
mod refusals;
mod runtime;
mod spawn_throttle;
