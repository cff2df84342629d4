//! The integration tests of kici-config, one binary: each module below used
//! to be a test binary of its own, each linking the crate and its
//! dependencies again. Test names carry the module (`anchors::…`); nextest
//! runs each test in a process of its own either way.

mod anchors;
mod checklist;
mod common;
mod conformance;
mod deviations;
mod diff;
mod files;
mod fixtures;
mod never_panics;
