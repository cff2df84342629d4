//! The integration tests of kici-testkit, one binary: each module below used
//! to be a test binary of its own, each linking the crate and its
//! dependencies again. Test names carry the module (`firecracker_jailer::…`);
//! nextest runs each test in a process of its own either way.

mod firecracker_jailer;
mod firecracker_sim;
mod support;
