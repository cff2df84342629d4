//! Helpers for the crate's integration tests (`tests/common` includes this
//! file by path): the engine's shared spawn-spec builders.
#![allow(dead_code, unused_imports)]

pub use kici_engine::testing::{scaler_from_yaml, spawn_spec};
