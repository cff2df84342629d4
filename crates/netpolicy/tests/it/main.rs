//! The integration tests of kici-netpolicy, one binary: each module below
//! used to be a test binary of its own, each linking the crate and its
//! dependencies again. Test names carry the module (`egress::…`); nextest
//! runs each test in a process of its own either way.

mod egress;
mod failpoints;
mod host_forwarding;
mod lab;
