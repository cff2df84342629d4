//! The integration tests of kici-protocol, one binary: each module below used
//! to be a test binary of its own, each linking the crate and its
//! dependencies again. Test names carry the module (`bootstrap::…`); nextest
//! runs each test in a process of its own either way.

mod bootstrap;
mod messages;
mod roundtrip;
