//! Real nftables, real packets: every test builds its own namespaces (see
//! `lab`), installs kici-scaler's tables in the lab's host namespace and
//! proves each verdict with a TCP handshake or a UDP round trip. Each blocked
//! flow must raise the counters of kici-scaler's own rules, so a drop
//! elsewhere can never be what makes a test pass.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::lab;

use ipnet::IpNet;
use kici_model::ids::{AgentId, InstanceId, ScalerType};
use kici_netpolicy::{
    AgentMatch, DockerUserMode, DockerUserOutcome, EgressPolicy, EgressTable, RuleCounters,
    TableOptions,
};
use lab::{
    tcp_reaches, udp_round_trip, Agent, Lab, GATEWAY, HOST_PUBLIC, INTERNET, PRIVATE, RESOLVER,
};

const GATEWAY_PORT: u16 = 9000;
const OTHER_HOST_PORT: u16 = 2222;
const WEB: u16 = 80;

fn options(lab: &Lab) -> TableOptions {
    TableOptions {
        gateway_port: Some(GATEWAY_PORT),
        gateway_address: Some(GATEWAY),
        resolvers: vec![RESOLVER.into()],
        netns: Some(lab.host.clone()),
        ..TableOptions::default()
    }
}

async fn table(lab: &Lab, instance: InstanceId) -> EgressTable {
    EgressTable::ensure(instance, lab::SUBNET.parse().unwrap(), options(lab))
        .await
        .unwrap()
}

fn key(agent: &Agent) -> AgentMatch {
    AgentMatch {
        ip: agent.ip,
        mac: agent.mac,
        port: None,
    }
}

/// Listeners every test may connect to: the gateway port and another
/// service on the host, a web server on the "internet" and on a private host.
struct Services {
    _listeners: Vec<std::net::TcpListener>,
}

fn services(lab: &Lab) -> Services {
    let any = std::net::Ipv4Addr::UNSPECIFIED;
    Services {
        _listeners: vec![
            Lab::listen_tcp(&lab.host, any, GATEWAY_PORT),
            Lab::listen_tcp(&lab.host, any, OTHER_HOST_PORT),
            Lab::listen_tcp(&lab.internet, any, WEB),
        ],
    }
}

/// Asserts the flow is dropped and that `agent`'s own rules (or, for
/// `None`, the subnet's default drop) counted it.
async fn assert_blocked_by_us(
    table: &EgressTable,
    agent: Option<&AgentId>,
    flow: impl FnOnce() -> bool,
    what: &str,
) {
    let read = || async {
        match agent {
            Some(a) => table.counters(a).await.unwrap(),
            None => table.unmatched_counters().await.unwrap(),
        }
    };
    let before: RuleCounters = read().await;
    assert!(!flow(), "{what}: expected blocked, but it went through");
    let after = read().await;
    assert!(
        after.dropped_packets > before.dropped_packets,
        "{what}: blocked, but not by kici-scaler's rules ({before:?} -> {after:?})"
    );
}

#[tokio::test]
async fn default_policy_blocks_private_and_host_but_allows_gateway_port_and_public() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let _s = services(&lab);
    let t = table(&lab, InstanceId::random()).await;
    let id = AgentId::random(ScalerType::Container);
    t.install(&id, &key(&a), &EgressPolicy::from_config(None))
        .await
        .unwrap();

    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        let ctx = format!("bridge-nf-call-iptables={}", u8::from(bridge_nf));
        let before = t.counters(&id).await.unwrap();
        assert!(
            tcp_reaches(&a.ns, None, GATEWAY, GATEWAY_PORT),
            "{ctx}: gateway port"
        );
        assert!(
            tcp_reaches(&a.ns, None, INTERNET, WEB),
            "{ctx}: public destination"
        );
        let after = t.counters(&id).await.unwrap();
        assert!(
            after.accepted_packets > before.accepted_packets,
            "{ctx}: our accepts counted"
        );

        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, None, PRIVATE, WEB),
            &format!("{ctx}: RFC1918"),
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, None, GATEWAY, OTHER_HOST_PORT),
            &format!("{ctx}: host service on the gateway address"),
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, None, HOST_PUBLIC, OTHER_HOST_PORT),
            &format!("{ctx}: host service on its public address"),
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, None, HOST_PUBLIC, GATEWAY_PORT),
            &format!("{ctx}: the gateway port on another host address"),
        )
        .await;
    }
}

/// The host's own connection to a service on its gateway address has that
/// address, inside the agent subnet, as its source: it must not meet the
/// subnet's default drop (it arrives on `lo`, where no agent can send).
#[tokio::test]
async fn host_connections_to_its_gateway_address_are_not_the_subnets() {
    let lab = Lab::new();
    let _s = services(&lab);
    let t = table(&lab, InstanceId::random()).await;
    let before = t.unmatched_counters().await.unwrap().dropped_packets;
    for port in [GATEWAY_PORT, OTHER_HOST_PORT] {
        assert!(
            tcp_reaches(&lab.host, None, GATEWAY, port),
            "host -> its own gateway address, port {port}"
        );
        assert!(
            tcp_reaches(&lab.host, Some(GATEWAY), HOST_PUBLIC, port),
            "host -> its own public address from the gateway address, port {port}"
        );
    }
    assert_eq!(
        t.unmatched_counters().await.unwrap().dropped_packets,
        before
    );
}

#[tokio::test]
async fn agents_cannot_reach_each_other_with_bridge_nf_off_and_on() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let b = lab.agent(6);
    let _listener = Lab::listen_tcp(&b.ns, b.ip, WEB);
    let t = table(&lab, InstanceId::random()).await;
    let (ia, ib) = (
        AgentId::random(ScalerType::Firecracker),
        AgentId::random(ScalerType::Firecracker),
    );
    t.install(&ia, &key(&a), &EgressPolicy::default())
        .await
        .unwrap();
    t.install(&ib, &key(&b), &EgressPolicy::default())
        .await
        .unwrap();
    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        assert_blocked_by_us(
            &t,
            Some(&ia),
            || tcp_reaches(&a.ns, None, b.ip, WEB),
            &format!("agent to agent, bridge-nf={bridge_nf}"),
        )
        .await;
    }
}

#[tokio::test]
async fn allowlist_opens_a_more_specific_private_destination_only() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let _s = services(&lab);
    let _private_web = Lab::listen_tcp(&lab.internet, PRIVATE, 8080);
    let t = table(&lab, InstanceId::random()).await;
    let id = AgentId::random(ScalerType::Container);
    let policy = EgressPolicy::new(vec![IpNet::from(std::net::IpAddr::from(PRIVATE))], false);
    t.install(&id, &key(&a), &policy).await.unwrap();
    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        assert!(tcp_reaches(&a.ns, None, PRIVATE, 8080), "allowlisted /32");
        // The rest of 10/8 stays blocked (RESOLVER is 10.9.0.53, not allowlisted, port 80 not DNS).
        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, None, RESOLVER, WEB),
            "rest of 10/8",
        )
        .await;
    }
}

#[tokio::test]
async fn deny_all_blocks_everything_but_the_gateway_port() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let _s = services(&lab);
    let dns = Lab::udp_socket(&lab.internet, RESOLVER, 53);
    let t = table(&lab, InstanceId::random()).await;
    let id = AgentId::random(ScalerType::Container);
    let policy = EgressPolicy::new(vec!["203.0.113.0/24".parse().unwrap()], true);
    t.install(&id, &key(&a), &policy).await.unwrap();
    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        assert!(
            tcp_reaches(&a.ns, None, GATEWAY, GATEWAY_PORT),
            "gateway port"
        );
        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, None, INTERNET, WEB),
            "public (even allowlisted)",
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&id),
            || udp_round_trip(&a.ns, &dns),
            "DNS under denyAll",
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, None, GATEWAY, OTHER_HOST_PORT),
            "host service",
        )
        .await;
    }
}

#[tokio::test]
async fn private_resolver_gets_a_dns_exception() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let dns = Lab::udp_socket(&lab.internet, RESOLVER, 53);
    let _dns_tcp = Lab::listen_tcp(&lab.internet, RESOLVER, 53);
    let _other = Lab::udp_socket(&lab.internet, PRIVATE, 53);
    let t = table(&lab, InstanceId::random()).await;
    let id = AgentId::random(ScalerType::Container);
    t.install(&id, &key(&a), &EgressPolicy::default())
        .await
        .unwrap();
    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        assert!(udp_round_trip(&a.ns, &dns), "udp 53 to the resolver");
        assert!(
            tcp_reaches(&a.ns, None, RESOLVER, 53),
            "tcp 53 to the resolver"
        );
        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, None, PRIVATE, 53),
            "53 to a private non-resolver",
        )
        .await;
    }
}

#[tokio::test]
async fn spoofed_sources_drop() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let b = lab.agent(6);
    let stranger = lab.agent(7); // no rules installed
    let _s = services(&lab);
    let t = table(&lab, InstanceId::random()).await;
    let (ia, ib) = (
        AgentId::random(ScalerType::Container),
        AgentId::random(ScalerType::Container),
    );
    t.install(&ia, &key(&a), &EgressPolicy::default())
        .await
        .unwrap();
    t.install(&ib, &key(&b), &EgressPolicy::default())
        .await
        .unwrap();
    // A takes a second address; B takes A's address.
    lab::run(&[
        "ip",
        "-n",
        &a.ns,
        "addr",
        "add",
        "172.29.0.77/24",
        "dev",
        "eth0",
    ]);
    lab::run(&[
        "ip",
        "-n",
        &b.ns,
        "addr",
        "add",
        "172.29.0.5/32",
        "dev",
        "eth0",
    ]);
    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        assert!(tcp_reaches(&a.ns, Some(a.ip), INTERNET, WEB), "A as itself");
        assert_blocked_by_us(
            &t,
            Some(&ia),
            || tcp_reaches(&a.ns, Some("172.29.0.77".parse().unwrap()), INTERNET, WEB),
            "A's MAC, another address",
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&ia),
            || tcp_reaches(&b.ns, Some(a.ip), INTERNET, WEB),
            "A's address from B's MAC",
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&ia),
            || {
                tcp_reaches(
                    &a.ns,
                    Some("172.29.0.77".parse().unwrap()),
                    GATEWAY,
                    GATEWAY_PORT,
                )
            },
            "spoofed source to the host",
        )
        .await;
        assert_blocked_by_us(
            &t,
            None,
            || tcp_reaches(&stranger.ns, None, INTERNET, WEB),
            "unknown source in the subnet",
        )
        .await;
        assert_blocked_by_us(
            &t,
            None,
            || tcp_reaches(&stranger.ns, None, GATEWAY, GATEWAY_PORT),
            "unknown source to the gateway port",
        )
        .await;
    }
}

#[tokio::test]
async fn a_bound_port_speaks_only_as_its_agent() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let _s = services(&lab);
    let t = table(&lab, InstanceId::random()).await;
    let id = AgentId::random(ScalerType::Firecracker);
    let bound = AgentMatch {
        ip: a.ip,
        mac: a.mac,
        port: Some(a.port.clone()),
    };
    t.install(&id, &bound, &EgressPolicy::default())
        .await
        .unwrap();
    assert!(tcp_reaches(&a.ns, None, INTERNET, WEB), "as itself");
    // A guest with root changes MAC and address to something outside the subnet.
    lab::run(&[
        "ip",
        "-n",
        &a.ns,
        "link",
        "set",
        "eth0",
        "address",
        "06:00:ac:aa:bb:cc",
    ]);
    lab::run(&[
        "ip",
        "-n",
        &a.ns,
        "addr",
        "add",
        "198.51.100.9/24",
        "dev",
        "eth0",
    ]);
    lab::run(&[
        "ip",
        "-n",
        &lab.host,
        "route",
        "add",
        "198.51.100.0/24",
        "dev",
        "br0",
    ]);
    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        assert_blocked_by_us(
            &t,
            Some(&id),
            || tcp_reaches(&a.ns, Some("198.51.100.9".parse().unwrap()), INTERNET, WEB),
            "new MAC and address on the bound port",
        )
        .await;
    }
}

#[tokio::test]
async fn remove_deletes_every_tagged_rule_and_is_idempotent() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let _s = services(&lab);
    let t = table(&lab, InstanceId::random()).await;
    let id = AgentId::random(ScalerType::Firecracker);
    let bound = AgentMatch {
        ip: a.ip,
        mac: a.mac,
        port: Some(a.port.clone()),
    };
    let installed = t
        .install(&id, &bound, &EgressPolicy::default())
        .await
        .unwrap();
    // Re-installing replaces, never duplicates.
    let again = t
        .install(&id, &bound, &EgressPolicy::default())
        .await
        .unwrap();
    assert_eq!(installed.rules, again.rules);
    let owned = t.owned().await.unwrap();
    assert_eq!(owned.len(), 1);
    assert!(owned[0].rules > 0 && owned[0].rules < installed.rules);
    assert_eq!(owned[0].addresses, [a.ip]);

    assert_eq!(t.remove(&id).await.unwrap(), installed.rules);
    assert_eq!(t.remove(&id).await.unwrap(), 0);
    let listed = lab::output(&["ip", "netns", "exec", &lab.host, "nft", "list", "ruleset"]);
    assert!(
        !listed.contains(&id.to_string()),
        "rules or chains of {id} left:\n{listed}"
    );
    assert!(t.owned().await.unwrap().is_empty());
    // Gone means back to the default drop.
    assert_blocked_by_us(
        &t,
        None,
        || tcp_reaches(&a.ns, None, INTERNET, WEB),
        "removed agent",
    )
    .await;
}

#[tokio::test]
async fn sweep_removes_only_dead_agents_of_this_instance() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let b = lab.agent(6);
    let c = lab.agent(7);
    let _s = services(&lab);
    let (mine, other) = (InstanceId::random(), InstanceId::random());
    let t = table(&lab, mine).await;
    let t_other = table(&lab, other).await;
    let (live, dead, foreign) = (
        AgentId::random(ScalerType::Container),
        AgentId::random(ScalerType::Container),
        AgentId::random(ScalerType::Container),
    );
    // The dead agent had an allowlist opening 10/8; its address is then reused.
    let open = EgressPolicy::new(vec!["10.0.0.0/8".parse().unwrap()], false);
    t.install(&live, &key(&a), &EgressPolicy::default())
        .await
        .unwrap();
    t.install(&dead, &key(&b), &open).await.unwrap();
    t_other
        .install(&foreign, &key(&c), &EgressPolicy::default())
        .await
        .unwrap();
    let _private_web = Lab::listen_tcp(&lab.internet, PRIVATE, 8080);
    assert!(
        tcp_reaches(&b.ns, None, PRIVATE, 8080),
        "the dead agent's allowlist worked"
    );

    assert_eq!(t.sweep_stale(&[live]).await.unwrap(), [dead]);
    assert_eq!(t.sweep_stale(&[live]).await.unwrap(), []);
    let mine_left: Vec<_> = t
        .owned()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.agent)
        .collect();
    assert_eq!(mine_left, [live]);
    let theirs: Vec<_> = t_other
        .owned()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.agent)
        .collect();
    assert_eq!(
        theirs,
        [foreign],
        "another instance's agent survives our sweep"
    );
    // The reused address does not inherit the old allowlist.
    assert_blocked_by_us(
        &t,
        None,
        || tcp_reaches(&b.ns, None, PRIVATE, 8080),
        "reused address",
    )
    .await;
    let reused = AgentId::random(ScalerType::Container);
    t.install(&reused, &key(&b), &EgressPolicy::default())
        .await
        .unwrap();
    assert_blocked_by_us(
        &t,
        Some(&reused),
        || tcp_reaches(&b.ns, None, PRIVATE, 8080),
        "reused address, new agent",
    )
    .await;
}

#[tokio::test]
async fn ensure_is_idempotent_and_install_checks_its_inputs() {
    let lab = Lab::new();
    let instance = InstanceId::random();
    let t = table(&lab, instance).await;
    let _ = table(&lab, instance).await;
    let listed = lab::output(&["ip", "netns", "exec", &lab.host, "nft", "list", "ruleset"]);
    assert_eq!(
        listed.matches("kici-scaler:dispatch").count(),
        4,
        "{listed}"
    );
    assert_eq!(
        listed
            .matches(&format!("kici-scaler:{instance}:subnet"))
            .count(),
        3,
        "{listed}"
    );
    assert_eq!(t.docker_user(), DockerUserOutcome::NotRequested);

    let id = AgentId::random(ScalerType::Container);
    let outside = AgentMatch {
        ip: "10.1.1.1".parse().unwrap(),
        mac: [6, 0, 0xac, 1, 1, 1],
        port: None,
    };
    assert!(matches!(
        t.install(&id, &outside, &EgressPolicy::default()).await,
        Err(kici_netpolicy::NetPolicyError::AddressOutsideSubnet { .. })
    ));
    let bad_port = AgentMatch {
        ip: "172.29.0.9".parse().unwrap(),
        mac: [6, 0, 0xac, 29, 0, 9],
        port: Some("a b".into()),
    };
    assert!(matches!(
        t.install(&id, &bad_port, &EgressPolicy::default()).await,
        Err(kici_netpolicy::NetPolicyError::InvalidPortName(_))
    ));
    assert!(t.owned().await.unwrap().is_empty());
}

#[tokio::test]
async fn docker_user_accepts_are_idempotent_and_torn_down() {
    let lab = Lab::new();
    let ipt = |args: &[&str]| {
        let mut argv = vec!["ip", "netns", "exec", lab.host.as_str(), "iptables", "-w"];
        argv.extend_from_slice(args);
        std::process::Command::new(argv[0])
            .args(&argv[1..])
            .status()
            .unwrap()
            .success()
    };
    let instance = InstanceId::random();
    let opts = TableOptions {
        docker_user: DockerUserMode::AcceptSubnet,
        ..options(&lab)
    };
    let subnet = lab::SUBNET.parse().unwrap();
    // No dockerd in the namespace: nothing to do.
    let t = EgressTable::ensure(instance, subnet, opts.clone())
        .await
        .unwrap();
    assert_eq!(t.docker_user(), DockerUserOutcome::NoChain);
    // dockerd's chain (created the way dockerd does).
    assert!(ipt(&["-N", "DOCKER-USER"]));
    let t = EgressTable::ensure(instance, subnet, opts.clone())
        .await
        .unwrap();
    assert_eq!(t.docker_user(), DockerUserOutcome::Inserted);
    let t = EgressTable::ensure(instance, subnet, opts).await.unwrap();
    assert_eq!(t.docker_user(), DockerUserOutcome::AlreadyPresent);
    let rules = lab::output(&[
        "ip",
        "netns",
        "exec",
        &lab.host,
        "iptables",
        "-w",
        "-S",
        "DOCKER-USER",
    ]);
    assert_eq!(
        rules
            .matches(&format!("kici-scaler:{instance}:subnet"))
            .count(),
        2,
        "{rules}"
    );
    assert!(rules.contains("-s 172.29.0.0/24"), "{rules}");

    // teardown: 3 subnet drops + 2 DOCKER-USER accepts.
    assert_eq!(t.teardown().await.unwrap(), 5);
    let rules = lab::output(&[
        "ip",
        "netns",
        "exec",
        &lab.host,
        "iptables",
        "-w",
        "-S",
        "DOCKER-USER",
    ]);
    assert!(!rules.contains("kici-scaler"), "{rules}");
}

#[tokio::test]
async fn agent_bridge_option_drops_an_unknown_mac_outside_the_subnet() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let _s = services(&lab);
    let t = table(&lab, InstanceId::random()).await;
    let id = AgentId::random(ScalerType::Container);
    t.install(&id, &key(&a), &EgressPolicy::default())
        .await
        .unwrap();
    // The agent (no port binding) takes a new MAC and an address outside the subnet.
    lab::run(&[
        "ip",
        "-n",
        &a.ns,
        "link",
        "set",
        "eth0",
        "address",
        "06:00:ac:aa:bb:cc",
    ]);
    lab::run(&[
        "ip",
        "-n",
        &a.ns,
        "addr",
        "add",
        "198.51.100.9/24",
        "dev",
        "eth0",
    ]);
    lab::run(&[
        "ip",
        "-n",
        &lab.host,
        "route",
        "add",
        "198.51.100.0/24",
        "dev",
        "br0",
    ]);
    let spoofed = Some("198.51.100.9".parse().unwrap());
    assert!(
        tcp_reaches(&a.ns, spoofed, INTERNET, WEB),
        "without agent_bridge this gap is open (containers lack NET_ADMIN to use it)"
    );
    let opts = TableOptions {
        agent_bridge: Some("br0".into()),
        ..options(&lab)
    };
    let t = EgressTable::ensure(t.instance(), lab::SUBNET.parse().unwrap(), opts)
        .await
        .unwrap();
    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        assert_blocked_by_us(
            &t,
            None,
            || tcp_reaches(&a.ns, spoofed, INTERNET, WEB),
            "unknown MAC, foreign address",
        )
        .await;
        assert_blocked_by_us(
            &t,
            None,
            || tcp_reaches(&a.ns, spoofed, GATEWAY, GATEWAY_PORT),
            "unknown MAC to the host",
        )
        .await;
    }
    // The agent's own identity still works through the bridge.
    lab::run(&[
        "ip",
        "-n",
        &a.ns,
        "link",
        "set",
        "eth0",
        "address",
        &lab::mac_str(a.mac),
    ]);
    assert!(tcp_reaches(&a.ns, Some(a.ip), INTERNET, WEB));
    assert_eq!(
        t.teardown().await.unwrap(),
        5,
        "3 subnet drops + 2 bridge drops"
    );
}

#[tokio::test]
async fn a_reused_address_replaces_stale_rules_of_this_instance_only() {
    let mut lab = Lab::new();
    let b = lab.agent(6);
    let _private_web = Lab::listen_tcp(&lab.internet, PRIVATE, 8080);
    let (mine, other) = (InstanceId::random(), InstanceId::random());
    let t = table(&lab, mine).await;
    let t_other = table(&lab, other).await;
    let (old, new) = (
        AgentId::random(ScalerType::Container),
        AgentId::random(ScalerType::Container),
    );
    let open = EgressPolicy::new(vec!["10.0.0.0/8".parse().unwrap()], false);
    t.install(&old, &key(&b), &open).await.unwrap();
    assert!(tcp_reaches(&b.ns, None, PRIVATE, 8080));
    // No sweep in between (a missed destroy): installing on the same address
    // must not leave the old allowlist in front of the new policy.
    t.install(&new, &key(&b), &EgressPolicy::default())
        .await
        .unwrap();
    let owned: Vec<_> = t
        .owned()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.agent)
        .collect();
    assert_eq!(owned, [new]);
    assert_blocked_by_us(
        &t,
        Some(&new),
        || tcp_reaches(&b.ns, None, PRIVATE, 8080),
        "new agent on a reused address",
    )
    .await;
    // Another instance's address is not ours to take over.
    let theirs = AgentId::random(ScalerType::Container);
    match t_other
        .install(&theirs, &key(&b), &EgressPolicy::default())
        .await
    {
        Err(kici_netpolicy::NetPolicyError::AddressClaimed { ip, owner }) => {
            assert_eq!(ip, b.ip);
            assert_eq!(owner, kici_netpolicy::agent_comment(mine, &new));
        }
        other => panic!("expected AddressClaimed, got {other:?}"),
    }
    assert!(t_other.owned().await.unwrap().is_empty());
}

/// `hostAccess` opens exactly the host services it names (an address and
/// port, or a port on every host address) and replaces the DNS default; the
/// agent gateway's port stays open; `hostAccess: []` opens no host service.
#[tokio::test]
async fn host_access_opens_only_the_named_host_services() {
    const THIRD_PORT: u16 = 3333;
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let b = lab.agent(6);
    let _s = services(&lab);
    let any = std::net::Ipv4Addr::UNSPECIFIED;
    let _third = Lab::listen_tcp(&lab.host, any, THIRD_PORT);
    let dns = Lab::udp_socket(&lab.internet, RESOLVER, 53);
    let t = table(&lab, InstanceId::random()).await;
    let (ida, idb) = (
        AgentId::random(ScalerType::Container),
        AgentId::random(ScalerType::Container),
    );
    let entries = |list: &[&str]| {
        Some(
            list.iter()
                .map(|e| e.parse::<kici_model::config::HostAccess>().unwrap())
                .collect::<Vec<_>>(),
        )
    };
    let open = EgressPolicy::default().with_host_access(entries(&[
        &format!("{GATEWAY}:{OTHER_HOST_PORT}"),
        &format!("*:{THIRD_PORT}"),
    ]));
    let closed = EgressPolicy::default().with_host_access(entries(&[]));
    t.install(&ida, &key(&a), &open).await.unwrap();
    t.install(&idb, &key(&b), &closed).await.unwrap();
    for bridge_nf in [false, true] {
        lab.set_bridge_nf(bridge_nf);
        let ctx = format!("bridge-nf-call-iptables={}", u8::from(bridge_nf));
        for (ns, who) in [(&a.ns, "a"), (&b.ns, "b")] {
            assert!(
                tcp_reaches(ns, None, GATEWAY, GATEWAY_PORT),
                "{ctx}: {who}: the gateway port stays open"
            );
        }
        assert!(
            tcp_reaches(&a.ns, None, GATEWAY, OTHER_HOST_PORT),
            "{ctx}: the named address and port"
        );
        assert!(
            tcp_reaches(&a.ns, None, HOST_PUBLIC, THIRD_PORT),
            "{ctx}: a port named on every host address"
        );
        assert_blocked_by_us(
            &t,
            Some(&ida),
            || tcp_reaches(&a.ns, None, HOST_PUBLIC, OTHER_HOST_PORT),
            &format!("{ctx}: the named port on another host address"),
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&idb),
            || tcp_reaches(&b.ns, None, GATEWAY, OTHER_HOST_PORT),
            &format!("{ctx}: hostAccess [] opens nothing"),
        )
        .await;
        assert_blocked_by_us(
            &t,
            Some(&idb),
            || tcp_reaches(&b.ns, None, HOST_PUBLIC, THIRD_PORT),
            &format!("{ctx}: hostAccess [] opens nothing"),
        )
        .await;
        // Egress is unchanged: the internet's resolver is a forward flow.
        assert!(udp_round_trip(&a.ns, &dns), "{ctx}: public DNS");
    }
}
