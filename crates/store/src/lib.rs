//! Durable state of kici-scaler: agents, pending requests, IP leases, token
//! hashes and events, in embedded SQLite or PostgreSQL, all owner-scoped.

pub mod ipam;

pub use ipam::{AllocError, IpAllocator, Ipv4Pool, Lease, MacAddress, PoolError};
