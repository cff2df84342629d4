//! The library half of `kici-agent-lite`: the bootstrap sources a guest
//! `/init` or another program may share with the agent (the MMDS bootstrap,
//! claim redemption). The agent itself is the binary (`src/main.rs`).

pub mod claim;
pub mod mmds;
