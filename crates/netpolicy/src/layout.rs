//! The layout of kici-scaler's tables: base chains, dispatch chains, the
//! per-agent chain names and the comments that say who owns a rule.

use crate::nftjson::{counter, mac_string, matches, meta, payload, statements, v4};
use crate::policy::{plan, Hook, PlannedRule, Verdict};
use crate::{AgentMatch, EgressPolicy, NetPolicyError, TableOptions};
use ipnet::Ipv4Net;
use kici_model::ids::{AgentId, InstanceId};
use nftables::expr::{Expression, MetaKey};
use nftables::stmt::{JumpTarget, Operator, Statement};
use nftables::types::{NfFamily, NfHook};
use std::net::Ipv4Addr;

pub(crate) const COMMENT_PREFIX: &str = "kici-scaler:";
pub(crate) const DISPATCH_COMMENT: &str = "kici-scaler:dispatch";
pub(crate) const CHAIN_PREFIX: &str = "ag-";
pub(crate) const INPUT_SUFFIX: &str = "-in";

pub(crate) fn subnet_comment(instance: InstanceId, subnet: Ipv4Net) -> String {
    format!("{COMMENT_PREFIX}{instance}:subnet {subnet}")
}

pub(crate) fn bridge_comment(instance: InstanceId, subnet: Ipv4Net, bridge: &str) -> String {
    format!("{COMMENT_PREFIX}{instance}:subnet {subnet} bridge {bridge}")
}

/// A base chain of ours and the regular chain it jumps to first.
pub(crate) struct BaseChain {
    pub name: &'static str,
    pub hook: NfHook,
    pub prio: i32,
    pub dispatch: &'static str,
    /// Whether the base chain ends with the subnet's default drop.
    pub subnet_drop: bool,
}

// Priority 0 is `filter` for inet, -200 is `filter` for bridge.
pub(crate) const INET_FORWARD: BaseChain = BaseChain {
    name: "forward",
    hook: NfHook::Forward,
    prio: 0,
    dispatch: "agents_forward",
    subnet_drop: true,
};
pub(crate) const INET_INPUT: BaseChain = BaseChain {
    name: "input",
    hook: NfHook::Input,
    prio: 0,
    dispatch: "agents_input",
    subnet_drop: true,
};
pub(crate) const BRIDGE_PREROUTING: BaseChain = BaseChain {
    name: "prerouting",
    hook: NfHook::Prerouting,
    prio: -200,
    dispatch: "agents_link",
    subnet_drop: false,
};
pub(crate) const BRIDGE_FORWARD: BaseChain = BaseChain {
    name: "forward",
    hook: NfHook::Forward,
    prio: -200,
    dispatch: "agents_forward",
    subnet_drop: true,
};
pub(crate) const INET_BASES: &[BaseChain] = &[INET_FORWARD, INET_INPUT];
pub(crate) const BRIDGE_BASES: &[BaseChain] = &[BRIDGE_PREROUTING, BRIDGE_FORWARD];

/// Linux interface names: 1 to 15 bytes, no '/', whitespace or NUL.
pub(crate) fn validate_port_name(name: &str) -> Result<(), NetPolicyError> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == 0 || b.is_ascii_whitespace() || b == b'*');
    if ok {
        Ok(())
    } else {
        Err(NetPolicyError::InvalidPortName(name.to_owned()))
    }
}

/// The per-agent chain name: `ag-<instance>-<agent id>` (the input-hook chain
/// adds `-in`). Unique across instances sharing the tables.
pub fn agent_chain_name(instance: InstanceId, agent: &AgentId) -> String {
    format!("ag-{instance}-{agent}")
}

/// The per-agent input-hook chain name.
pub(crate) fn agent_input_chain_name(instance: InstanceId, agent: &AgentId) -> String {
    format!("{}{INPUT_SUFFIX}", agent_chain_name(instance, agent))
}

/// The comment every rule of `agent` carries: `kici-scaler:<instance>:<agent id>`.
pub fn agent_comment(instance: InstanceId, agent: &AgentId) -> String {
    format!("{COMMENT_PREFIX}{instance}:{agent}")
}

/// The chains every agent has rules in besides its own.
pub(crate) fn dispatch_chains() -> Vec<(NfFamily, String)> {
    [
        (NfFamily::INet, INET_FORWARD.dispatch),
        (NfFamily::INet, INET_INPUT.dispatch),
        (NfFamily::Bridge, BRIDGE_FORWARD.dispatch),
        (NfFamily::Bridge, BRIDGE_PREROUTING.dispatch),
    ]
    .into_iter()
    .map(|(f, c)| (f, c.to_owned()))
    .collect()
}

/// Our base chains (where the dispatch jumps and the subnet drops live).
pub(crate) fn base_chains() -> Vec<(NfFamily, String)> {
    INET_BASES
        .iter()
        .map(|b| (NfFamily::INet, b.name.to_owned()))
        .chain(
            BRIDGE_BASES
                .iter()
                .map(|b| (NfFamily::Bridge, b.name.to_owned())),
        )
        .collect()
}

/// One agent's own chains.
pub(crate) fn agent_chains(instance: InstanceId, agent: &AgentId) -> Vec<(NfFamily, String)> {
    vec![
        (NfFamily::INet, agent_chain_name(instance, agent)),
        (NfFamily::INet, agent_input_chain_name(instance, agent)),
        (NfFamily::Bridge, agent_chain_name(instance, agent)),
    ]
}

/// One rule to add: family, chain, statements.
pub(crate) type PlannedNftRule = (NfFamily, String, Vec<Statement<'static>>);

/// Everything one agent gets, all tagged with [`agent_comment`]:
///
/// * its chains: inet `ag-…` (routed egress), inet `ag-…-in` (the host
///   itself), bridge `ag-…` (bridged frames), each ending in a verdict;
/// * dispatch in each of the three dispatch chains: `ip saddr . ether saddr`
///   jumps to its chain, its MAC with another address drops, its address from
///   another MAC drops;
/// * ARP binding in bridge prerouting (no one else claims its address, it
///   claims no other);
/// * with a port: the port speaks only as the agent, the agent only on its
///   port, and nothing reaches the agent from another bridge port (frames to
///   its MAC, ARP for its address): port isolation already keeps bridge
///   ports apart, this makes the attempt visible in the agent's counters and
///   holds where isolation is off;
/// * in its forward chains, the agents' own `subnet` drops before any
///   allowlist entry: an allowlist covering the subnet (`10.0.0.0/8`) must
///   not open other agents through the host's routing.
pub(crate) fn agent_rules(
    instance: InstanceId,
    agent: &AgentId,
    key: &AgentMatch,
    policy: &EgressPolicy,
    options: &TableOptions,
    subnet: Ipv4Net,
) -> (Vec<(NfFamily, String)>, Vec<PlannedNftRule>) {
    let forward_chain = agent_chain_name(instance, agent);
    let input_chain = agent_input_chain_name(instance, agent);
    let chains = agent_chains(instance, agent);
    let mut rules: Vec<PlannedNftRule> = Vec::new();
    for ((family, name), hook) in
        chains
            .iter()
            .zip([Hook::Forward, Hook::Input, Hook::BridgeForward])
    {
        let mut planned = plan(
            policy,
            hook,
            options
                .gateway_port
                .map(|port| (options.gateway_address, port)),
            &options.resolvers,
            options.protect_host,
        );
        if hook != Hook::Input {
            // Replies to flows someone else opened stay first; then no peer.
            let at = usize::from(planned.first() == Some(&PlannedRule::Established));
            planned.insert(
                at,
                PlannedRule::Destination {
                    net: subnet,
                    verdict: Verdict::Drop,
                },
            );
        }
        rules.extend(
            planned
                .iter()
                .flat_map(statements)
                .map(|expr| (*family, name.clone(), expr)),
        );
    }

    let ip = || v4(key.ip);
    let mac = || Expression::String(mac_string(key.mac).into());
    let drop = |mut expr: Vec<Statement<'static>>| {
        expr.extend([counter(), Statement::Drop(None)]);
        expr
    };
    for (family, dispatch_chain, target) in [
        (NfFamily::INet, INET_FORWARD.dispatch, &forward_chain),
        (NfFamily::INet, INET_INPUT.dispatch, &input_chain),
        (NfFamily::Bridge, BRIDGE_FORWARD.dispatch, &forward_chain),
    ] {
        let mut own_mac_other_ip = vec![matches(payload("ether", "saddr"), Operator::EQ, mac())];
        if family == NfFamily::Bridge {
            // ARP between bridge ports is how an allowlisted neighbour is reached.
            own_mac_other_ip.push(matches(
                payload("ether", "type"),
                Operator::NEQ,
                Expression::String("arp".into()),
            ));
        }
        for expr in [
            vec![
                matches(payload("ip", "saddr"), Operator::EQ, ip()),
                matches(payload("ether", "saddr"), Operator::EQ, mac()),
                Statement::Jump(JumpTarget {
                    target: target.clone().into(),
                }),
            ],
            drop(own_mac_other_ip),
            drop(vec![matches(payload("ip", "saddr"), Operator::EQ, ip())]),
        ] {
            rules.push((family, dispatch_chain.to_owned(), expr));
        }
    }

    let link = |expr| {
        (
            NfFamily::Bridge,
            BRIDGE_PREROUTING.dispatch.to_owned(),
            expr,
        )
    };
    // ARP binding, port or not (0.0.0.0 is an address probe, harmless).
    rules.push(link(drop(vec![
        matches(payload("arp", "saddr ip"), Operator::EQ, ip()),
        matches(payload("ether", "saddr"), Operator::NEQ, mac()),
    ])));
    rules.push(link(drop(vec![
        matches(payload("ether", "saddr"), Operator::EQ, mac()),
        matches(payload("arp", "saddr ip"), Operator::NEQ, ip()),
        matches(
            payload("arp", "saddr ip"),
            Operator::NEQ,
            v4(Ipv4Addr::UNSPECIFIED),
        ),
    ])));
    if let Some(port) = &key.port {
        let on_port = |op| {
            matches(
                meta(MetaKey::Iifname),
                op,
                Expression::String(port.clone().into()),
            )
        };
        let protocol = |p: &'static str| {
            matches(
                meta(MetaKey::Protocol),
                Operator::NEQ,
                Expression::String(p.into()),
            )
        };
        for expr in [
            // The port speaks only as the agent (IPv4 and ARP only)...
            vec![
                on_port(Operator::EQ),
                matches(payload("ether", "saddr"), Operator::NEQ, mac()),
            ],
            vec![
                on_port(Operator::EQ),
                matches(payload("ip", "saddr"), Operator::NEQ, ip()),
            ],
            vec![
                on_port(Operator::EQ),
                matches(payload("arp", "saddr ip"), Operator::NEQ, ip()),
            ],
            vec![on_port(Operator::EQ), protocol("ip"), protocol("arp")],
            // ...and the agent speaks only on its port.
            vec![
                on_port(Operator::NEQ),
                matches(payload("ether", "saddr"), Operator::EQ, mac()),
            ],
            vec![
                on_port(Operator::NEQ),
                matches(payload("ip", "saddr"), Operator::EQ, ip()),
            ],
            vec![
                on_port(Operator::NEQ),
                matches(payload("arp", "saddr ip"), Operator::EQ, ip()),
            ],
            // Nothing reaches the agent from another port (the host's own
            // frames leave through the bridge's output hook, not this one).
            vec![
                on_port(Operator::NEQ),
                matches(payload("ether", "daddr"), Operator::EQ, mac()),
            ],
            vec![
                on_port(Operator::NEQ),
                matches(payload("arp", "daddr ip"), Operator::EQ, ip()),
            ],
        ] {
            rules.push(link(drop(expr)));
        }
    }
    (chains, rules)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::nftjson::{dispatch_source, ListedRule};
    use kici_model::ids::ScalerType;

    fn key(port: Option<&str>) -> AgentMatch {
        AgentMatch {
            ip: Ipv4Addr::new(172, 29, 0, 5),
            mac: [6, 0, 0xac, 29, 0, 5],
            port: port.map(str::to_owned),
        }
    }

    #[test]
    fn names_and_comments_carry_instance_and_agent() {
        let instance: InstanceId = "0a1b2c3d".parse().unwrap();
        let agent: AgentId = "scaler-firecracker-deadbeef".parse().unwrap();
        assert_eq!(
            agent_chain_name(instance, &agent),
            "ag-0a1b2c3d-scaler-firecracker-deadbeef"
        );
        assert_eq!(
            agent_input_chain_name(instance, &agent),
            "ag-0a1b2c3d-scaler-firecracker-deadbeef-in"
        );
        assert_eq!(
            agent_comment(instance, &agent),
            "kici-scaler:0a1b2c3d:scaler-firecracker-deadbeef"
        );
    }

    #[test]
    fn a_port_adds_the_binding_rules_and_dispatch_names_the_source() {
        let instance = InstanceId::random();
        let agent = AgentId::random(ScalerType::Container);
        let opts = TableOptions::default();
        let policy = EgressPolicy::default();
        let subnet: Ipv4Net = "172.29.0.0/24".parse().unwrap();
        let (chains, plain) = agent_rules(instance, &agent, &key(None), &policy, &opts, subnet);
        let (_, bound) = agent_rules(
            instance,
            &agent,
            &key(Some("kici-deadbeef")),
            &policy,
            &opts,
            subnet,
        );
        assert_eq!(chains.len(), 3);
        assert_eq!(bound.len(), plain.len() + 9);
        let link = |rules: &[PlannedNftRule]| {
            rules
                .iter()
                .filter(|(_, c, _)| c == BRIDGE_PREROUTING.dispatch)
                .count()
        };
        assert_eq!((link(&plain), link(&bound)), (2, 11));
        // The agents' subnet drops in both forward chains, before the rest.
        let peer_drop = |family: NfFamily| {
            let own: Vec<_> = plain
                .iter()
                .filter(|(f, c, _)| *f == family && *c == chains[0].1)
                .collect();
            own.iter().position(|(_, _, expr)| {
                matches!(expr.last(), Some(Statement::Drop(_)))
                    && expr.contains(&matches(
                        payload("ip", "daddr"),
                        Operator::EQ,
                        crate::nftjson::v4net(subnet),
                    ))
            })
        };
        assert_eq!(peer_drop(NfFamily::INet), Some(1), "after established");
        assert_eq!(peer_drop(NfFamily::Bridge), Some(0));
        // Exactly three jumps (one per dispatch chain), each naming the agent's address.
        let jumps: Vec<_> = plain
            .iter()
            .map(|(family, chain, expr)| ListedRule {
                family: *family,
                chain: chain.clone(),
                handle: 1,
                comment: None,
                expr: expr.clone(),
            })
            .filter_map(|r| dispatch_source(&r))
            .collect();
        assert_eq!(jumps, [Ipv4Addr::new(172, 29, 0, 5); 3]);
        // Every agent chain ends with a verdict, never falling through to the default drop.
        for (family, name) in &chains {
            let last = plain
                .iter()
                .rfind(|(f, c, _)| f == family && c == name)
                .unwrap();
            assert!(matches!(
                last.2.last(),
                Some(Statement::Accept(_) | Statement::Drop(_))
            ));
        }
    }

    #[test]
    fn port_names_are_checked() {
        for ok in ["kici-deadbeef", "br0", "veth1234567890a"] {
            assert!(validate_port_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a/b", "sixteen-chars-xx", "..", "br*"] {
            assert!(validate_port_name(bad).is_err(), "{bad}");
        }
    }
}
