//! The integration tests of kici-routing, one binary: each module below used
//! to be a test binary of its own, each linking the crate and its
//! dependencies again. Test names carry the module (`conformance::…`);
//! nextest runs each test in a process of its own either way.
//!
//! `no_alloc` stays a binary of its own: it counts allocations through a
//! global allocator, which would count every other test's too.

// The helpers panic on bad test input, as the test modules do.
#[allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "../common/mod.rs"]
mod common;
mod conformance;
mod props;
mod routing;
