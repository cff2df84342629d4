//! Guest addresses: which IPv4 addresses of a network an agent may get, the
//! MAC derived from one, and the [`IpAllocator`] contract every store
//! implements.
//!
//! The allocator hands out each `(network, ip)` to at most one agent at a
//! time, across every instance sharing the store: the uniqueness is a
//! database constraint, not a check in this process.

use async_trait::async_trait;
use ipnet::Ipv4Net;
use kici_model::{AgentId, InstanceId};
use std::fmt;
use std::net::Ipv4Addr;

/// A network agents get addresses from: the network address, the gateway
/// (the first host address, given to the bridge) and the broadcast address
/// are never handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Pool {
    network: Ipv4Net,
}

/// Why a CIDR cannot be an address pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("`{input}` is not an IPv4 CIDR (expected a.b.c.d/n)")]
    /// Not `a.b.c.d/n` IPv4 notation.
    Syntax {
        /// What was given.
        input: String,
    },
    #[error("`{input}` has host bits set; the network is {network}")]
    /// Bits set below the prefix (`10.0.0.1/24`): ambiguous, refused.
    HostBits {
        /// What was given.
        input: String,
        /// The network it probably meant.
        network: Ipv4Net,
    },
    #[error("`{input}` is too small: a /{prefix} leaves no address for agents once network, gateway and broadcast are excluded (use /29 or shorter)")]
    /// Longer than /29: no address left for agents.
    TooSmall {
        /// What was given.
        input: String,
        /// Its prefix length.
        prefix: u8,
    },
}

impl Ipv4Pool {
    /// A pool of `network` (host bits clear, /29 or shorter).
    pub fn new(network: Ipv4Net) -> Result<Self, PoolError> {
        if network.network() != network.addr() {
            return Err(PoolError::HostBits {
                input: network.to_string(),
                network: network.trunc(),
            });
        }
        // network + gateway + broadcast excluded: a /30 would leave one
        // address, a /31 or /32 none; /29 is the smallest useful pool.
        if network.prefix_len() > 29 {
            return Err(PoolError::TooSmall {
                input: network.to_string(),
                prefix: network.prefix_len(),
            });
        }
        Ok(Self { network })
    }

    /// The network, as configured.
    pub fn network(&self) -> Ipv4Net {
        self.network
    }

    /// The first host address: the bridge's, never an agent's.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network.network()) + 1)
    }

    /// The netmask (for guest boot arguments).
    pub fn netmask(&self) -> Ipv4Addr {
        self.network.netmask()
    }

    /// Every address an agent may get, lowest first.
    pub fn assignable(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        let first = u32::from(self.network.network()) + 2;
        let last = u32::from(self.network.broadcast()) - 1;
        (first..=last).map(Ipv4Addr::from)
    }

    /// How many addresses [`Self::assignable`] yields.
    pub fn capacity(&self) -> u32 {
        u32::from(self.network.broadcast()) - u32::from(self.network.network()) - 2
    }

    /// Whether `ip` is one of [`Self::assignable`].
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let n = u32::from(ip);
        n >= u32::from(self.network.network()) + 2 && n < u32::from(self.network.broadcast())
    }
}

impl std::str::FromStr for Ipv4Pool {
    type Err = PoolError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let network: Ipv4Net = s.trim().parse().map_err(|_| PoolError::Syntax {
            input: s.to_owned(),
        })?;
        Self::new(network).map_err(|e| match e {
            PoolError::HostBits { network, .. } => PoolError::HostBits {
                input: s.to_owned(),
                network,
            },
            PoolError::TooSmall { prefix, .. } => PoolError::TooSmall {
                input: s.to_owned(),
                prefix,
            },
            other => other,
        })
    }
}

impl fmt::Display for Ipv4Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.network.fmt(f)
    }
}

/// A locally administered unicast MAC: `06:00:AC` then the address's last
/// three octets.
///
/// `0x06` has the locally-administered bit set and the multicast bit clear,
/// so it never collides with a vendor MAC; `00:AC` keeps it readable as ours.
/// Three octets of the address make it unique within any /8, which covers
/// every pool the config accepts, and derivable from the lease alone (no
/// column of its own, nothing to get out of sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddress(pub [u8; 6]);

impl MacAddress {
    /// The MAC of the guest holding `ip`.
    pub fn for_ip(ip: Ipv4Addr) -> Self {
        let [_, b, c, d] = ip.octets();
        Self([0x06, 0x00, 0xac, b, c, d])
    }
}

impl fmt::Display for MacAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// One address held by one agent of one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The pool's network.
    pub network: Ipv4Net,
    /// The leased address.
    pub ip: Ipv4Addr,
    /// The agent holding it.
    pub agent: AgentId,
    /// The instance that leased it.
    pub owner: InstanceId,
}

impl Lease {
    /// The guest MAC derived from the address.
    pub fn mac(&self) -> MacAddress {
        MacAddress::for_ip(self.ip)
    }
}

/// Why an [`IpAllocator`] call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("no free address in {network}: all {capacity} are leased")]
    /// Every assignable address of the pool is leased (by any instance).
    Exhausted {
        /// The pool's network.
        network: Ipv4Net,
        /// How many addresses it has.
        capacity: u32,
    },
    #[error("state store unavailable: {0}")]
    /// The store cannot be reached; nothing changed, retry later.
    Unavailable(String),
    /// Any other failure (a bug, a corrupt row, a pool too large to
    /// pre-fill).
    #[error("state store error: {0}")]
    Store(String),
}

/// Transactional address leases, shared by every instance using the store.
#[async_trait]
pub trait IpAllocator: Send + Sync {
    /// Leases a free address of `pool` to `agent` (owned by this store's
    /// instance). An agent that already holds one in `pool` gets the same
    /// one back, so a retried spawn does not leak.
    async fn allocate(&self, pool: &Ipv4Pool, agent: &AgentId) -> Result<Lease, AllocError>;

    /// Frees every address `agent` holds; returns how many.
    async fn release_agent(&self, agent: &AgentId) -> Result<u64, AllocError>;

    /// Frees one address if this instance holds it; returns whether it did.
    async fn release_ip(&self, network: Ipv4Net, ip: Ipv4Addr) -> Result<bool, AllocError>;

    /// This instance's leases (for the sweep).
    async fn leases(&self) -> Result<Vec<Lease>, AllocError>;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pool_excludes_network_gateway_and_broadcast() {
        let pool: Ipv4Pool = "10.0.0.0/29".parse().unwrap();
        let ips: Vec<_> = pool.assignable().collect();
        assert_eq!(pool.gateway(), Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(ips.first(), Some(&Ipv4Addr::new(10, 0, 0, 2)));
        assert_eq!(ips.last(), Some(&Ipv4Addr::new(10, 0, 0, 6)));
        assert_eq!(ips.len() as u32, pool.capacity());
        assert_eq!(pool.capacity(), 5);
        assert!(!pool.contains(Ipv4Addr::new(10, 0, 0, 7)));
        assert!(!pool.contains(Ipv4Addr::new(10, 0, 0, 1)));
        assert!(pool.contains(Ipv4Addr::new(10, 0, 0, 2)));
    }

    #[test]
    fn bad_pools_say_why() {
        assert!(matches!(
            "10.0.0.1/24".parse::<Ipv4Pool>(),
            Err(PoolError::HostBits { .. })
        ));
        assert!(matches!(
            "10.0.0.0/30".parse::<Ipv4Pool>(),
            Err(PoolError::TooSmall { prefix: 30, .. })
        ));
        assert!(matches!(
            "10.0.0/24".parse::<Ipv4Pool>(),
            Err(PoolError::Syntax { .. })
        ));
        assert!(matches!(
            "::1/64".parse::<Ipv4Pool>(),
            Err(PoolError::Syntax { .. })
        ));
    }

    #[test]
    fn mac_is_local_unicast_and_ends_with_the_address() {
        let mac = MacAddress::for_ip(Ipv4Addr::new(172, 29, 3, 4));
        assert_eq!(mac.to_string(), "06:00:ac:1d:03:04");
        assert_eq!(mac.0[0] & 0x01, 0, "unicast");
        assert_eq!(mac.0[0] & 0x02, 0x02, "locally administered");
    }
}
