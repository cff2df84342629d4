//! The library half of `kici-agent-lite`: what a guest `/init` shares with
//! the agent (the MMDS bootstrap). The agent itself is the binary
//! (`src/main.rs`).

pub mod mmds;
