//! What an agent may reach, independent of nftables: the label set's
//! `networkPolicy` turned into an ordered list of destination verdicts.

use ipnet::{IpNet, Ipv4Net};
use kici_model::config::{HostAccess, NetworkPolicy};
use std::net::{IpAddr, Ipv4Addr};

/// Destinations blocked unless an allowlist entry at least as specific
/// covers them: RFC 1918, link-local and cloud metadata (169.254.169.254),
/// carrier-grade NAT (some clouds serve metadata there, e.g. 100.100.100.200),
/// "this network", loopback, IETF protocol assignments, benchmarking,
/// multicast and reserved space.
///
/// IPv6 needs no list: agents are IPv4-only, and every IPv6 packet from an
/// agent's MAC is dropped by its dispatch rules (so `fd00::/8` and
/// `fe80::/10` are blocked along with everything else IPv6).
pub fn default_blocked_v4() -> Vec<Ipv4Net> {
    const BLOCKED: [(Ipv4Addr, u8); 11] = [
        (Ipv4Addr::new(0, 0, 0, 0), 8),
        (Ipv4Addr::new(10, 0, 0, 0), 8),
        (Ipv4Addr::new(100, 64, 0, 0), 10),
        (Ipv4Addr::new(127, 0, 0, 0), 8),
        (Ipv4Addr::new(169, 254, 0, 0), 16),
        (Ipv4Addr::new(172, 16, 0, 0), 12),
        (Ipv4Addr::new(192, 0, 0, 0), 24),
        (Ipv4Addr::new(192, 168, 0, 0), 16),
        (Ipv4Addr::new(198, 18, 0, 0), 15),
        (Ipv4Addr::new(224, 0, 0, 0), 4),
        (Ipv4Addr::new(240, 0, 0, 0), 4),
    ];
    BLOCKED
        .iter()
        // Infallible: every prefix length above is <= 32.
        .filter_map(|&(addr, len)| Ipv4Net::new(addr, len).ok())
        .collect()
}

/// One agent's egress policy (the label set's `networkPolicy`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EgressPolicy {
    allowlist: Vec<IpNet>,
    deny_all: bool,
    host_access: Option<Vec<HostAccess>>,
}

impl EgressPolicy {
    pub fn new(allowlist: Vec<IpNet>, deny_all: bool) -> Self {
        Self {
            allowlist: allowlist.into_iter().map(|n| n.trunc()).collect(),
            deny_all,
            host_access: None,
        }
    }

    /// The host services the agent may reach (`networkPolicy.hostAccess`):
    /// `None` keeps the default (DNS to the host's resolvers unless
    /// `denyAll`); `Some` replaces it outright, `Some(vec![])` opening no
    /// host service. The agent gateway's port stays open either way: an
    /// agent that cannot reach it cannot register.
    pub fn with_host_access(mut self, host_access: Option<Vec<HostAccess>>) -> Self {
        self.host_access = host_access;
        self
    }

    /// `None` (the label set has no `networkPolicy`) is the default policy:
    /// public destinations allowed, [`default_blocked_v4`] blocked.
    pub fn from_config(config: Option<&NetworkPolicy>) -> Self {
        match config {
            None => Self::default(),
            Some(p) => {
                Self::new(p.allowlist.clone(), p.deny_all).with_host_access(p.host_access.clone())
            }
        }
    }

    /// The explicit `hostAccess`, if any.
    pub fn host_access(&self) -> Option<&[HostAccess]> {
        self.host_access.as_deref()
    }

    pub fn allowlist(&self) -> &[IpNet] {
        &self.allowlist
    }

    /// `denyAll`: nothing but the agent gateway port (the allowlist is
    /// ignored, DNS included: a resolver is an exfiltration channel).
    pub fn deny_all(&self) -> bool {
        self.deny_all
    }

    /// IPv4 allowlist entries; IPv6 entries have no effect because agents
    /// have no IPv6 egress at all.
    pub(crate) fn allowlist_v4(&self) -> impl Iterator<Item = Ipv4Net> + '_ {
        self.allowlist.iter().filter_map(|n| match n {
            IpNet::V4(v4) => Some(*v4),
            IpNet::V6(_) => None,
        })
    }
}

/// A verdict on a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Accept,
    Drop,
}

/// One line of an agent's destination policy, in evaluation order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PlannedRule {
    /// DNS (udp and tcp 53) to a private resolver.
    Dns { resolver: Ipv4Addr },
    /// tcp to the agent gateway port, on the gateway address when it is
    /// known (input hook only).
    GatewayPort {
        address: Option<Ipv4Addr>,
        port: u16,
    },
    /// Replies to flows someone else opened (input and inet forward only; the
    /// bridge family has no conntrack without `nf_conntrack_bridge`).
    Established,
    /// `ip daddr <net> accept|drop`.
    Destination { net: Ipv4Net, verdict: Verdict },
    /// One `hostAccess` entry: tcp and udp to `port` (any port when
    /// `None`) on `net` (any host address when `None`), accepted (input
    /// hook only).
    HostService {
        net: Option<Ipv4Net>,
        port: Option<u16>,
    },
    /// The chain's last word, so evaluation never falls through to the
    /// subnet's default drop.
    Final(Verdict),
}

/// Which hook a per-agent chain serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hook {
    /// Routed egress (`inet forward`).
    Forward,
    /// Bridged agent-to-anything frames (`bridge forward`).
    BridgeForward,
    /// Traffic to the host's own addresses (`inet input`).
    Input,
}

/// Whether `ip` is a private (non-public) address, i.e. covered by
/// [`default_blocked_v4`]: a resolver there needs a DNS exception.
pub(crate) fn is_blocked_by_default(ip: Ipv4Addr) -> bool {
    default_blocked_v4().iter().any(|n| n.contains(&ip))
}

/// The ordered rules of one agent chain.
///
/// Forward: the more specific of an allowlist entry and a default block wins
/// (ties go to the allowlist: it is the operator's explicit word), DNS to a
/// private resolver is allowed, the rest is accepted. Input (the host itself):
/// only the gateway port and DNS to a resolver; the allowlist does not open the
/// host. `denyAll` leaves only the gateway port. An explicit `hostAccess`
/// replaces the DNS default with its entries (the gateway port stays).
pub(crate) fn plan(
    policy: &EgressPolicy,
    hook: Hook,
    gateway: Option<(Option<Ipv4Addr>, u16)>,
    resolvers: &[IpAddr],
    protect_host: bool,
) -> Vec<PlannedRule> {
    let mut rules = Vec::new();
    let v4_resolvers = resolvers.iter().filter_map(|r| match r {
        IpAddr::V4(v4) => Some(*v4),
        IpAddr::V6(_) => None,
    });
    match hook {
        Hook::Input => {
            if !protect_host {
                rules.push(PlannedRule::Final(Verdict::Accept));
                return rules;
            }
            rules.push(PlannedRule::Established);
            if let Some((address, port)) = gateway {
                rules.push(PlannedRule::GatewayPort { address, port });
            }
            match policy.host_access() {
                Some(entries) => rules.extend(entries.iter().map(|e| PlannedRule::HostService {
                    net: e.addr,
                    port: e.port,
                })),
                None if !policy.deny_all => {
                    rules.extend(v4_resolvers.map(|resolver| PlannedRule::Dns { resolver }))
                }
                None => {}
            }
            rules.push(PlannedRule::Final(Verdict::Drop));
        }
        Hook::Forward | Hook::BridgeForward => {
            if hook == Hook::Forward {
                rules.push(PlannedRule::Established);
            }
            if policy.deny_all {
                rules.push(PlannedRule::Final(Verdict::Drop));
                return rules;
            }
            rules.extend(
                v4_resolvers
                    .filter(|r| is_blocked_by_default(*r))
                    .map(|resolver| PlannedRule::Dns { resolver }),
            );
            let mut destinations: Vec<(Ipv4Net, Verdict)> = policy
                .allowlist_v4()
                .map(|n| (n, Verdict::Accept))
                .chain(default_blocked_v4().into_iter().map(|n| (n, Verdict::Drop)))
                .collect();
            // Most specific first; on equal prefixes the accept (listed first) stays first.
            destinations.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
            let mut seen = std::collections::HashSet::new();
            rules.extend(
                destinations
                    .into_iter()
                    .filter(|(net, _)| seen.insert(*net))
                    .map(|(net, verdict)| PlannedRule::Destination { net, verdict }),
            );
            rules.push(PlannedRule::Final(Verdict::Accept));
        }
    }
    rules
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn host_access_replaces_the_dns_default_and_keeps_the_gateway_port() {
        let resolver: IpAddr = "10.255.255.53".parse().unwrap();
        let entry = |s: &str| s.parse::<HostAccess>().unwrap();
        let gateway = Some((Some(Ipv4Addr::new(172, 29, 0, 1)), 9000));
        let default = plan(
            &EgressPolicy::default(),
            Hook::Input,
            gateway,
            &[resolver],
            true,
        );
        assert!(default.iter().any(|r| matches!(r, PlannedRule::Dns { .. })));

        let named = EgressPolicy::default()
            .with_host_access(Some(vec![entry("172.29.0.1:5432"), entry("*:8080")]));
        let rules = plan(&named, Hook::Input, gateway, &[resolver], true);
        assert_eq!(
            rules,
            [
                PlannedRule::Established,
                PlannedRule::GatewayPort {
                    address: Some(Ipv4Addr::new(172, 29, 0, 1)),
                    port: 9000
                },
                PlannedRule::HostService {
                    net: Some(net("172.29.0.1/32")),
                    port: Some(5432)
                },
                PlannedRule::HostService {
                    net: None,
                    port: Some(8080)
                },
                PlannedRule::Final(Verdict::Drop),
            ]
        );
        // Even under denyAll the operator's named services open; none when
        // the list is empty.
        let none = EgressPolicy::new(vec![], true).with_host_access(Some(vec![]));
        assert_eq!(
            plan(&none, Hook::Input, gateway, &[resolver], true).len(),
            3,
            "established, gateway port, drop"
        );
        // The forward hooks do not look at it.
        assert_eq!(
            plan(&named, Hook::Forward, gateway, &[resolver], true),
            plan(
                &EgressPolicy::default(),
                Hook::Forward,
                gateway,
                &[resolver],
                true
            )
        );
    }

    #[test]
    fn more_specific_allow_beats_block_and_broad_allow_does_not() {
        let policy = EgressPolicy::new(
            vec!["10.1.2.0/24".parse().unwrap(), "0.0.0.0/0".parse().unwrap()],
            false,
        );
        let rules = plan(&policy, Hook::Forward, Some((None, 9000)), &[], true);
        let pos = |n: &str, v: Verdict| {
            rules
                .iter()
                .position(|r| {
                    *r == PlannedRule::Destination {
                        net: net(n),
                        verdict: v,
                    }
                })
                .unwrap()
        };
        assert!(pos("10.1.2.0/24", Verdict::Accept) < pos("10.0.0.0/8", Verdict::Drop));
        assert!(pos("169.254.0.0/16", Verdict::Drop) < pos("0.0.0.0/0", Verdict::Accept));
        assert_eq!(rules.last(), Some(&PlannedRule::Final(Verdict::Accept)));
        assert!(!rules
            .iter()
            .any(|r| matches!(r, PlannedRule::GatewayPort { .. })));
    }

    #[test]
    fn equal_prefix_goes_to_the_allowlist_and_is_listed_once() {
        let policy = EgressPolicy::new(vec!["10.0.0.0/8".parse().unwrap()], false);
        let rules = plan(&policy, Hook::BridgeForward, None, &[], true);
        let tens: Vec<_> = rules
            .iter()
            .filter(
                |r| matches!(r, PlannedRule::Destination { net: n, .. } if *n == net("10.0.0.0/8")),
            )
            .collect();
        assert_eq!(
            tens,
            [&PlannedRule::Destination {
                net: net("10.0.0.0/8"),
                verdict: Verdict::Accept
            }]
        );
        assert!(!rules.contains(&PlannedRule::Established));
    }

    #[test]
    fn deny_all_leaves_only_the_gateway_port() {
        let policy = EgressPolicy::new(vec!["203.0.113.0/24".parse().unwrap()], true);
        let resolvers = ["10.0.0.53".parse().unwrap()];
        let gw = Ipv4Addr::new(10, 9, 0, 1);
        assert_eq!(
            plan(
                &policy,
                Hook::Forward,
                Some((Some(gw), 9000)),
                &resolvers,
                true
            ),
            [PlannedRule::Established, PlannedRule::Final(Verdict::Drop)]
        );
        assert_eq!(
            plan(
                &policy,
                Hook::Input,
                Some((Some(gw), 9000)),
                &resolvers,
                true
            ),
            [
                PlannedRule::Established,
                PlannedRule::GatewayPort {
                    address: Some(gw),
                    port: 9000
                },
                PlannedRule::Final(Verdict::Drop)
            ]
        );
    }

    #[test]
    fn dns_exception_only_for_private_resolvers_in_forward() {
        let policy = EgressPolicy::default();
        let resolvers: Vec<IpAddr> = vec![
            "10.0.0.53".parse().unwrap(),
            "203.0.113.53".parse().unwrap(),
        ];
        let rules = plan(&policy, Hook::Forward, None, &resolvers, true);
        let dns: Vec<_> = rules
            .iter()
            .filter(|r| matches!(r, PlannedRule::Dns { .. }))
            .collect();
        assert_eq!(
            dns,
            [&PlannedRule::Dns {
                resolver: "10.0.0.53".parse().unwrap()
            }]
        );
        let input = plan(&policy, Hook::Input, None, &resolvers, true);
        assert_eq!(
            input
                .iter()
                .filter(|r| matches!(r, PlannedRule::Dns { .. }))
                .count(),
            2
        );
    }

    #[test]
    fn unprotected_host_accepts_input() {
        assert_eq!(
            plan(
                &EgressPolicy::default(),
                Hook::Input,
                Some((None, 1)),
                &[],
                false
            ),
            [PlannedRule::Final(Verdict::Accept)]
        );
    }

    #[test]
    fn from_config_normalises_and_defaults() {
        assert_eq!(EgressPolicy::from_config(None), EgressPolicy::default());
        let cfg = NetworkPolicy {
            allowlist: vec!["10.1.2.3/16".parse().unwrap()],
            deny_all: true,
            host_access: None,
        };
        let p = EgressPolicy::from_config(Some(&cfg));
        assert_eq!(p.allowlist(), &["10.1.0.0/16".parse::<IpNet>().unwrap()]);
        assert!(p.deny_all());
        assert!(is_blocked_by_default("169.254.169.254".parse().unwrap()));
        assert!(is_blocked_by_default("100.100.100.200".parse().unwrap()));
        assert!(!is_blocked_by_default("203.0.113.1".parse().unwrap()));
    }
}
