//! The Firecracker backend: agents as jailed microVMs.
