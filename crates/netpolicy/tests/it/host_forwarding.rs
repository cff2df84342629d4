//! Host forwarding (`ip_forward`, NAT, forward accepts, `DOCKER-USER`) for
//! an agent bridge, proven with real traffic in a lab of namespaces (see
//! `lab`): an agent behind the lab's bridge reaches the "internet"
//! namespace only once [`HostForwarding::provision`] ran, and the internet
//! side sees the host's address (masqueraded), never the agent's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::lab;

use kici_model::ids::{AgentId, InstanceId, ScalerType};
use kici_netpolicy::{
    AgentMatch, DockerUserState, EgressPolicy, EgressTable, HostForwarding, TableOptions, Uplink,
};
use lab::{Lab, HOST_PUBLIC, INTERNET};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

const WEB: u16 = 80;

fn forwarding(lab: &Lab, uplink: Option<&str>) -> HostForwarding {
    HostForwarding {
        bridge: "br0".into(),
        subnet: lab::SUBNET.parse().unwrap(),
        uplink: uplink.map(Into::into),
        netns: Some(lab.host.clone()),
        command_timeout: Duration::from_secs(10),
    }
}

fn host(lab: &Lab, argv: &[&str]) -> String {
    let mut full = vec!["ip", "netns", "exec", lab.host.as_str()];
    full.extend_from_slice(argv);
    lab::output(&full)
}

/// Connects from `ns` to `to:port` and returns the source address the
/// listener saw, or `None` when the handshake did not complete.
fn seen_source(ns: &str, listener: &std::net::TcpListener, to: Ipv4Addr) -> Option<Ipv4Addr> {
    let port = listener.local_addr().unwrap().port();
    if !lab::tcp_reaches(ns, None, to, port) {
        return None;
    }
    // The handshake completed: the connection waits in the accept queue.
    let (_, peer) = listener.accept().unwrap();
    match peer {
        SocketAddr::V4(v4) => Some(*v4.ip()),
        SocketAddr::V6(_) => None,
    }
}

fn our_rules_in_ruleset(lab: &Lab) -> usize {
    let json = host(lab, &["nft", "-j", "list", "ruleset"]);
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| {
            r["comment"]
                .as_str()
                .is_some_and(|c| c.starts_with("kici-scaler:host:br0"))
        })
        .count()
}

#[tokio::test]
async fn provision_enables_forwarding_and_masquerades_through_any_interface_without_a_default_route(
) {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let web = Lab::listen_tcp(&lab.internet, INTERNET, WEB);
    host(&lab, &["sysctl", "-qw", "net.ipv4.ip_forward=0"]);
    // Per-agent rules of a "running VM" that host provisioning must never touch.
    let table = EgressTable::ensure(
        InstanceId::random(),
        lab::SUBNET.parse().unwrap(),
        TableOptions {
            netns: Some(lab.host.clone()),
            ..TableOptions::default()
        },
    )
    .await
    .unwrap();
    let agent = AgentId::random(ScalerType::Firecracker);
    let installed = table
        .install(
            &agent,
            &AgentMatch {
                ip: a.ip,
                mac: a.mac,
                port: None,
            },
            &EgressPolicy::default(),
        )
        .await
        .unwrap();

    let f = forwarding(&lab, None);
    let before = f.check().await.unwrap();
    assert!(!before.healthy());
    assert_eq!(before.uplink, Uplink::AnyButBridge);
    let problems = before.problems(&f).join("\n");
    for needle in ["IP forwarding", "NAT missing", "forward accepts missing"] {
        assert!(problems.contains(needle), "{needle} not in {problems}");
    }
    assert_eq!(
        seen_source(&a.ns, &web, INTERNET),
        None,
        "no forwarding yet"
    );

    let status = f.provision().await.unwrap();
    assert!(status.healthy(), "{status:?}");
    assert_eq!(status.docker_user, DockerUserState::NoChain);
    assert!(status.problems(&f).is_empty());
    assert_eq!(
        host(&lab, &["sysctl", "-n", "net.ipv4.ip_forward"]).trim(),
        "1"
    );
    assert_eq!(
        seen_source(&a.ns, &web, INTERNET),
        Some(HOST_PUBLIC),
        "masqueraded to the host's address on the uplink"
    );

    // Idempotent: the same rules, the agent's untouched.
    let rules = our_rules_in_ruleset(&lab);
    assert_eq!(rules, 3);
    assert!(f.provision().await.unwrap().healthy());
    assert_eq!(our_rules_in_ruleset(&lab), rules);
    assert_eq!(table.remove(&agent).await.unwrap(), installed.rules);
    table
        .install(
            &agent,
            &AgentMatch {
                ip: a.ip,
                mac: a.mac,
                port: None,
            },
            &EgressPolicy::default(),
        )
        .await
        .unwrap();

    // Removing one piece is named, provisioning again restores it.
    let json = host(
        &lab,
        &[
            "nft",
            "-j",
            "list",
            "chain",
            "inet",
            "kici_scaler",
            kici_netpolicy::host::HOST_NAT_CHAIN,
        ],
    );
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    let handle = doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .find_map(|r| r["handle"].as_u64())
        .unwrap()
        .to_string();
    host(
        &lab,
        &[
            "nft",
            "delete",
            "rule",
            "inet",
            "kici_scaler",
            kici_netpolicy::host::HOST_NAT_CHAIN,
            "handle",
            &handle,
        ],
    );
    let broken = f.check().await.unwrap();
    assert!(!broken.nat && broken.forward_accepts && broken.ip_forward);
    assert!(broken.problems(&f)[0].starts_with("NAT missing"));
    assert!(f.provision().await.unwrap().healthy());

    // Teardown removes exactly ours: the agent's rules stay, and no chain of ours is left.
    let removed = f.teardown().await.unwrap();
    assert_eq!(removed, 3);
    assert_eq!(our_rules_in_ruleset(&lab), 0);
    let chains = host(&lab, &["nft", "list", "chains", "inet"]);
    assert!(
        !chains.contains(kici_netpolicy::host::HOST_NAT_CHAIN)
            && !chains.contains(kici_netpolicy::host::HOST_FORWARD_CHAIN),
        "{chains}"
    );
    assert_eq!(table.remove(&agent).await.unwrap(), installed.rules);
    assert_eq!(f.teardown().await.unwrap(), 0, "teardown is idempotent");
}

#[tokio::test]
async fn a_named_uplink_replaces_the_any_interface_rule() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let web = Lab::listen_tcp(&lab.internet, INTERNET, WEB);
    assert!(forwarding(&lab, None).provision().await.unwrap().healthy());
    let named = forwarding(&lab, Some("vnet"));
    assert!(!named.check().await.unwrap().nat, "the other uplink's rule");
    let status = named.provision().await.unwrap();
    assert!(status.healthy(), "{status:?}");
    assert_eq!(status.uplink, Uplink::Interface("vnet".into()));
    assert_eq!(our_rules_in_ruleset(&lab), 3, "replaced, not added");
    assert_eq!(seen_source(&a.ns, &web, INTERNET), Some(HOST_PUBLIC));
    // A default route in the host namespace: with no uplink named, its interface is used.
    host(
        &lab,
        &["ip", "route", "add", "default", "via", "203.0.113.2"],
    );
    assert_eq!(
        forwarding(&lab, None).resolve_uplink().await.unwrap(),
        Uplink::Interface("vnet".into())
    );
    assert_eq!(named.teardown().await.unwrap(), 3);
}

/// dockerd's FORWARD DROP stops the agents until our `DOCKER-USER` accepts
/// are in; a dockerd restart (which re-creates its jumps and keeps
/// `DOCKER-USER`'s rules) leaves verify healthy; a `DOCKER-USER` emptied
/// from scratch is reported and provisioning restores it.
#[tokio::test]
async fn docker_user_accepts_survive_a_dockerd_restart_and_are_verified() {
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let web = Lab::listen_tcp(&lab.internet, INTERNET, WEB);
    let dockerd_starts = |lab: &Lab| {
        // What dockerd does on start (docker 20.10): the chain (kept if it
        // exists), its trailing RETURN, the FORWARD jump moved to the top, DROP policy.
        let _ = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &lab.host,
                "iptables",
                "-w",
                "-N",
                "DOCKER-USER",
            ])
            .output();
        let has_return = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &lab.host,
                "iptables",
                "-w",
                "-C",
                "DOCKER-USER",
                "-j",
                "RETURN",
            ])
            .output()
            .unwrap()
            .status
            .success();
        if !has_return {
            host(
                lab,
                &["iptables", "-w", "-A", "DOCKER-USER", "-j", "RETURN"],
            );
        }
        let _ = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &lab.host,
                "iptables",
                "-w",
                "-D",
                "FORWARD",
                "-j",
                "DOCKER-USER",
            ])
            .output();
        host(
            lab,
            &["iptables", "-w", "-I", "FORWARD", "-j", "DOCKER-USER"],
        );
        host(lab, &["iptables", "-w", "-P", "FORWARD", "DROP"]);
    };
    dockerd_starts(&lab);
    let f = forwarding(&lab, None);
    let before = f.check().await.unwrap();
    assert_eq!(before.docker_user, DockerUserState::Missing);
    assert!(before
        .problems(&f)
        .iter()
        .any(|p| p.contains("DOCKER-USER")));

    assert!(f.provision().await.unwrap().healthy());
    assert_eq!(
        seen_source(&a.ns, &web, INTERNET),
        Some(HOST_PUBLIC),
        "through dockerd's DROP policy"
    );
    dockerd_starts(&lab);
    let after = f.check().await.unwrap();
    assert!(after.healthy(), "{after:?}");
    assert_eq!(seen_source(&a.ns, &web, INTERNET), Some(HOST_PUBLIC));

    // DOCKER-USER emptied and re-created (a host whose iptables was reset).
    host(&lab, &["iptables", "-w", "-F", "DOCKER-USER"]);
    dockerd_starts(&lab);
    let emptied = f.check().await.unwrap();
    assert_eq!(emptied.docker_user, DockerUserState::Missing);
    assert!(!emptied.healthy());
    assert_eq!(seen_source(&a.ns, &web, INTERNET), None, "dockerd drops");
    assert!(f.provision().await.unwrap().healthy());
    assert_eq!(seen_source(&a.ns, &web, INTERNET), Some(HOST_PUBLIC));

    assert_eq!(
        f.teardown().await.unwrap(),
        5,
        "3 nft rules + 2 DOCKER-USER accepts"
    );
    let listed = host(&lab, &["iptables", "-w", "-S", "DOCKER-USER"]);
    assert!(!listed.contains("kici-scaler"), "{listed}");
}
