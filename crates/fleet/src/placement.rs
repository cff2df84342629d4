//! Placement: whether this host should claim now, given every live host's
//! load in the pool. A pure function; the daemon asks it before each claim
//! attempt, with loads from [`crate::Queue::pool_loads`].
//!
//! - **spread**: claim only while this host is among the least loaded of
//!   the hosts that still have room. Claims made one at a time under this
//!   rule keep hosts of equal capacity within one agent of each other (a
//!   host claims only at the minimum m, leaving every host in [m, m + 1]).
//! - **pack**: claim only if this host is the one to fill: the most loaded
//!   host that still has room (ties: lowest instance id). One host fills to
//!   its capacity before the next gets anything (the cheap-cloud case:
//!   fewer machines awake).
//!
//! A request entering through a host that serves its pool is served there
//! under a looser rule ([`should_enter`]): the entry saves a queue write,
//! a wake-up of every host of the pool and a claim.
//!
//! Both leave at least one eligible host while any host
//! has room, so the queue never stalls on placement alone. Loads are read
//! before the claim, not inside it, so two hosts claiming at the same
//! instant may both act on the same picture: placement is a balance, not a
//! cap (caps are enforced in the claim transaction).

use kici_model::InstanceId;

/// The placement policy (`--fleet-placement`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Keep hosts evenly loaded (the default).
    #[default]
    Spread,
    /// Fill one host before the next.
    Pack,
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "spread" => Ok(Self::Spread),
            "pack" => Ok(Self::Pack),
            other => Err(format!(
                "unknown placement `{other}` (expected spread or pack)"
            )),
        }
    }
}

/// One live host's load in a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostLoad {
    /// The host.
    pub host: InstanceId,
    /// Its claimed requests and live agents in the pool.
    pub agents: u32,
    /// Its own capacity in the pool (None: unbounded).
    pub capacity: Option<u32>,
}

impl HostLoad {
    /// Whether it can take one more.
    pub fn has_room(&self) -> bool {
        self.capacity.is_none_or(|c| self.agents < c)
    }
}

/// Whether `me` should claim now under `policy`, given `hosts` (which should
/// include `me`; if it does not, `me` is treated as empty with unbounded
/// room, so a host missing from a stale picture is not starved).
pub fn should_claim(policy: Placement, me: InstanceId, hosts: &[HostLoad]) -> bool {
    let mine = hosts
        .iter()
        .find(|h| h.host == me)
        .copied()
        .unwrap_or(HostLoad {
            host: me,
            agents: 0,
            capacity: None,
        });
    if !mine.has_room() {
        return false;
    }
    let with_room = hosts.iter().filter(|h| h.has_room() && h.host != me);
    match policy {
        Placement::Spread => with_room
            .map(|h| h.agents)
            .min()
            .is_none_or(|m| mine.agents <= m),
        Placement::Pack => with_room
            .map(|h| (h.agents, std::cmp::Reverse(h.host)))
            .max()
            .is_none_or(|best| (mine.agents, std::cmp::Reverse(me)) > best),
    }
}

/// How many agents more than the least loaded host an entry host may hold
/// and still serve a request itself under `spread`.
pub const ENTRY_SLACK: u32 = 1;

/// Whether the host a request entered through should serve it itself
/// rather than queue it for the placement's pick. Serving at entry costs one
/// transaction; queueing costs the queue's write, a wake-up of every host
/// of the pool and a claim. So under `spread` the entry host serves while
/// it holds at most [`ENTRY_SLACK`] agents more than the least loaded host
/// with room (hosts stay within `ENTRY_SLACK + 1` of each other); `pack`
/// keeps its rule.
pub fn should_enter(policy: Placement, me: InstanceId, hosts: &[HostLoad]) -> bool {
    match policy {
        Placement::Pack => should_claim(policy, me, hosts),
        Placement::Spread => {
            let mine = hosts.iter().find(|h| h.host == me).copied();
            if mine.is_some_and(|m| !m.has_room()) {
                return false;
            }
            let mine = mine.map_or(0, |m| m.agents);
            hosts
                .iter()
                .filter(|h| h.has_room() && h.host != me)
                .map(|h| h.agents)
                .min()
                .is_none_or(|least| mine <= least.saturating_add(ENTRY_SLACK))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id(n: u8) -> InstanceId {
        format!("000000{n:02x}").parse().unwrap()
    }

    fn hosts(caps: &[Option<u32>]) -> Vec<HostLoad> {
        caps.iter()
            .enumerate()
            .map(|(i, c)| HostLoad {
                host: id(u8::try_from(i).unwrap()),
                agents: 0,
                capacity: *c,
            })
            .collect()
    }

    fn eligible(policy: Placement, hs: &[HostLoad]) -> Vec<usize> {
        (0..hs.len())
            .filter(|&i| should_claim(policy, hs[i].host, hs))
            .collect()
    }

    #[test]
    fn spread_and_pack_on_a_small_example() {
        let mut hs = hosts(&[Some(3), Some(3)]);
        hs[0].agents = 1;
        assert_eq!(eligible(Placement::Spread, &hs), vec![1]);
        assert_eq!(eligible(Placement::Pack, &hs), vec![0]);
        hs[0].agents = 3; // full
        assert_eq!(eligible(Placement::Pack, &hs), vec![1]);
        hs[1].agents = 3;
        assert!(eligible(Placement::Spread, &hs).is_empty());
        assert!(eligible(Placement::Pack, &hs).is_empty());
    }

    proptest! {
        /// Entries through hosts drawn at random, each served at its entry
        /// host when `should_enter` says so and by a claiming host
        /// otherwise: hosts of equal capacity stay within `ENTRY_SLACK + 1`
        /// of each other, and an entry host with room and at the minimum
        /// always serves.
        #[test]
        fn entry_slack_keeps_hosts_within_its_bound(
            n in 1usize..6,
            entries in proptest::collection::vec(any::<prop::sample::Index>(), 1..300),
        ) {
            let mut hs = hosts(&vec![None; n]);
            for entry in entries {
                let e = entry.index(n);
                let least = hs.iter().map(|h| h.agents).min().unwrap();
                let served_here = should_enter(Placement::Spread, hs[e].host, &hs);
                if hs[e].agents == least {
                    prop_assert!(served_here);
                }
                let i = if served_here { e } else { eligible(Placement::Spread, &hs)[0] };
                hs[i].agents += 1;
                let gap = hs.iter().map(|h| h.agents).max().unwrap()
                    - hs.iter().map(|h| h.agents).min().unwrap();
                prop_assert!(gap <= ENTRY_SLACK + 1, "{:?}", hs);
            }
        }
    }

    #[test]
    fn entry_under_pack_follows_the_claim_rule() {
        let mut hs = hosts(&[Some(3), Some(3)]);
        hs[0].agents = 1;
        assert!(should_enter(Placement::Pack, hs[0].host, &hs));
        assert!(!should_enter(Placement::Pack, hs[1].host, &hs));
        // Spread: one more than the least still serves at entry; two not.
        assert!(should_enter(Placement::Spread, hs[0].host, &hs));
        hs[0].agents = 2;
        assert!(!should_enter(Placement::Spread, hs[0].host, &hs));
        hs[0].agents = 3; // full
        assert!(!should_enter(Placement::Spread, hs[0].host, &hs));
    }

    #[test]
    fn a_host_missing_from_the_picture_may_claim() {
        assert!(should_claim(Placement::Spread, id(9), &hosts(&[Some(2)])));
        assert!("pack".parse::<Placement>().is_ok());
        assert!("even".parse::<Placement>().is_err());
    }

    proptest! {
        /// Claims one at a time by any eligible host (the pick drawn at
        /// random) and agents ending at random: a claim never widens the
        /// gap between equal hosts past one, and someone is always eligible
        /// while any host has room.
        #[test]
        fn spread_keeps_equal_hosts_within_one(
            n in 1usize..6,
            cap in proptest::option::of(1u32..8),
            steps in proptest::collection::vec((any::<bool>(), any::<prop::sample::Index>()), 1..200),
        ) {
            let mut hs = hosts(&vec![cap; n]);
            for (claim, pick) in steps {
                let el = eligible(Placement::Spread, &hs);
                let any_room = hs.iter().any(HostLoad::has_room);
                prop_assert_eq!(!el.is_empty(), any_room);
                if claim {
                    if el.is_empty() { continue; }
                    let gap = |hs: &[HostLoad]| {
                        hs.iter().map(|h| h.agents).max().unwrap()
                            - hs.iter().map(|h| h.agents).min().unwrap()
                    };
                    let before = gap(&hs);
                    let i = el[pick.index(el.len())];
                    hs[i].agents += 1;
                    // Ends can unbalance hosts; a claim never widens the
                    // gap past one (so from balanced it stays balanced).
                    prop_assert!(gap(&hs) <= before.max(1), "claim widened the gap: {:?}", hs);
                } else {
                    // An agent ends on a loaded host; then rebalancing claims
                    // go to the lightest.
                    let loaded: Vec<usize> = (0..n).filter(|&i| hs[i].agents > 0).collect();
                    if loaded.is_empty() { continue; }
                    let i = loaded[pick.index(loaded.len())];
                    hs[i].agents -= 1;
                }
            }
        }

        /// From empty hosts with claims only: always within one.
        #[test]
        fn spread_claims_only_stay_within_one(
            n in 1usize..8,
            picks in proptest::collection::vec(any::<prop::sample::Index>(), 1..100),
        ) {
            let mut hs = hosts(&vec![None; n]);
            for pick in picks {
                let el = eligible(Placement::Spread, &hs);
                prop_assert!(!el.is_empty());
                let i = el[pick.index(el.len())];
                hs[i].agents += 1;
                let max = hs.iter().map(|h| h.agents).max().unwrap();
                let min = hs.iter().map(|h| h.agents).min().unwrap();
                prop_assert!(max - min <= 1, "{:?}", hs);
            }
        }

        /// Pack: exactly one host eligible while any has room, and at most
        /// one host is partly filled at any time (claims only).
        #[test]
        fn pack_fills_one_host_before_the_next(
            caps in proptest::collection::vec(1u32..6, 1..6),
            claims in 0usize..40,
        ) {
            let mut hs = hosts(&caps.iter().map(|c| Some(*c)).collect::<Vec<_>>());
            for _ in 0..claims {
                let el = eligible(Placement::Pack, &hs);
                let any_room = hs.iter().any(HostLoad::has_room);
                prop_assert_eq!(el.len(), usize::from(any_room));
                let Some(&i) = el.first() else { break };
                hs[i].agents += 1;
                let partial = hs.iter().filter(|h| h.agents > 0 && h.has_room()).count();
                prop_assert!(partial <= 1, "{:?}", hs);
            }
        }
    }
}
