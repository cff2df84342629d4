//! Isolation with real traffic: VMs spawned through the
//! real backend (testkit `fc-sim` behind its `fake-jailer`, real TAPs on a
//! real bridge, kici-netpolicy's real nftables rules), each VM's guest side
//! a network namespace holding its IP and MAC whose frames cross the VM's
//! TAP (testkit `GuestNet`). Everything runs in namespaces the test creates:
//!
//! ```text
//!  guest ns (eth0 = VM ip/mac) ⇄ fc-sim's TAP kici-… ─┐
//!  guest ns …                  ⇄ TAP kici-…          ─┤ bridge 10.x.y.1/24   host ns (backend,
//!                                                      │                     nft, ip_forward, NAT)
//!  "world" ns: 203.0.113.2 (public), 10.9.0.2/.3 and ─── up0 203.0.113.1/24, 10.9.0.1/24,
//!   192.168.77.2 (RFC 1918), 169.254.170.2 and           192.168.77.1/24, 169.254.170.1/24,
//!   100.100.100.200 (metadata services)                  100.100.100.1/24
//! ```
//!
//! Every verdict is proven with a TCP handshake (or a UDP round trip) from
//! inside a guest namespace, with `bridge-nf-call-iptables` at 0 and at 1
//! (per network namespace on this kernel: the host namespace's value is set,
//! and goes with the namespace), and every blocked flow must raise the drop
//! counters of kici-scaler's own rules for that VM, so a drop elsewhere can
//! never be what makes a test pass.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kici_engine::{Backend, ResourceHandle};
use kici_model::AgentId;
use kici_netpolicy::{EgressTable, HostForwarding, RuleCounters, TableOptions};
use kici_store::ipam::MacAddress;
use kici_testkit::fc::GuestSetup;
use kici_testkit::guestnet::{GuestNet, GuestNetConfig};
use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use support::{random_agent, Binaries, Harness};

const INTERNET: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
const HOST_UPLINK: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 2);
const PRIVATE_OTHER: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 3);
const PRIVATE_192: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
const METADATA_LINK_LOCAL: Ipv4Addr = Ipv4Addr::new(169, 254, 170, 2);
const METADATA_CGNAT: Ipv4Addr = Ipv4Addr::new(100, 100, 100, 200);
const GATEWAY_PORT: u16 = 8700;
const OTHER_HOST_PORT: u16 = 2222;
const WEB: u16 = 80;
/// A flow that takes this long inside one machine was not coming.
const BLOCKED_AFTER: Duration = Duration::from_millis(1000);

fn run(argv: &[&str]) {
    let out = Command::new(argv[0]).args(&argv[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn output(argv: &[&str]) -> String {
    let out = Command::new(argv[0]).args(&argv[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `f` on a thread that entered network namespace `ns`; sockets made
/// there stay in it, and processes and threads started there start in it.
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// The host and "world" namespaces; deleted on drop (also after a panic).
struct Namespaces {
    host: String,
    world: String,
}

impl Namespaces {
    fn new() -> Self {
        let id: u32 = rand_u32();
        let ns = Self {
            host: format!("kfi{id:08x}h"),
            world: format!("kfi{id:08x}w"),
        };
        for n in [&ns.host, &ns.world] {
            run(&["ip", "netns", "add", n]);
            run(&["ip", "-n", n, "link", "set", "lo", "up"]);
        }
        let (h, w) = (ns.host.as_str(), ns.world.as_str());
        run(&[
            "ip", "-n", h, "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", w,
        ]);
        for addr in [
            "203.0.113.1/24",
            "10.9.0.1/24",
            "192.168.77.1/24",
            "169.254.170.1/24",
            "100.100.100.1/24",
        ] {
            run(&["ip", "-n", h, "addr", "add", addr, "dev", "up0"]);
        }
        for addr in [
            "203.0.113.2/24",
            "10.9.0.2/24",
            "10.9.0.3/24",
            "192.168.77.2/24",
            "169.254.170.2/24",
            "100.100.100.200/24",
        ] {
            run(&["ip", "-n", w, "addr", "add", addr, "dev", "eth0"]);
        }
        run(&["ip", "-n", h, "link", "set", "up0", "up"]);
        run(&["ip", "-n", w, "link", "set", "eth0", "up"]);
        run(&[
            "ip",
            "-n",
            w,
            "route",
            "add",
            "default",
            "via",
            "203.0.113.1",
        ]);
        ns
    }

    /// `net.bridge.bridge-nf-call-iptables` in the host namespace.
    fn set_bridge_nf(&self, on: bool) {
        run(&[
            "ip",
            "netns",
            "exec",
            &self.host,
            "sysctl",
            "-qw",
            &format!("net.bridge.bridge-nf-call-iptables={}", u8::from(on)),
        ]);
        let now = output(&[
            "ip",
            "netns",
            "exec",
            &self.host,
            "sysctl",
            "-n",
            "net.bridge.bridge-nf-call-iptables",
        ]);
        assert_eq!(now.trim(), if on { "1" } else { "0" });
    }

    fn listen_tcp(ns: &str, ip: Ipv4Addr, port: u16) -> TcpListener {
        in_netns(ns, move || {
            TcpListener::bind(SocketAddrV4::new(ip, port)).unwrap()
        })
    }

    fn udp_socket(ns: &str, ip: Ipv4Addr, port: u16) -> UdpSocket {
        in_netns(ns, move || {
            UdpSocket::bind(SocketAddrV4::new(ip, port)).unwrap()
        })
    }

    /// Runs the test body inside the host namespace, on a runtime whose
    /// threads (and so the backend's netlink sockets, TAP ioctls, jailer,
    /// `nft`) all live there.
    fn run_in_host<F>(&self, body: impl FnOnce() -> F + Send + 'static)
    where
        F: std::future::Future<Output = ()>,
    {
        in_netns(&self.host, move || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap()
                .block_on(body())
        })
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in [&self.host, &self.world] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    u32::from_le_bytes(b)
}

/// Whether a TCP handshake from guest namespace `ns` to `to:port` completes.
fn tcp_reaches(ns: &str, to: Ipv4Addr, port: u16) -> bool {
    let shown = ns.to_owned();
    in_netns(ns, move || {
        let target = SocketAddr::from(SocketAddrV4::new(to, port));
        match std::net::TcpStream::connect_timeout(&target, BLOCKED_AFTER) {
            Ok(_) => true,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => false,
            // ARP never answered (the guest's neighbour entry failed).
            Err(e) if e.kind() == std::io::ErrorKind::HostUnreachable => false,
            Err(e) => panic!("connect {shown} -> {target}: unexpected {e}"),
        }
    })
}

/// Whether a datagram from `ns` reaches `server` and its echo comes back.
fn udp_round_trip(ns: &str, server: &UdpSocket) -> bool {
    let target = server.local_addr().unwrap();
    let client = std::thread::spawn({
        let ns = ns.to_owned();
        move || {
            in_netns(&ns, move || {
                let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
                socket.set_read_timeout(Some(BLOCKED_AFTER)).unwrap();
                socket.send_to(b"kici?", target).unwrap();
                let mut buf = [0u8; 16];
                socket.recv_from(&mut buf).is_ok()
            })
        }
    });
    server.set_read_timeout(Some(BLOCKED_AFTER)).unwrap();
    let mut buf = [0u8; 16];
    let served = match server.recv_from(&mut buf) {
        Ok((n, peer)) => {
            server.send_to(&buf[..n], peer).unwrap();
            true
        }
        Err(_) => false,
    };
    let answered = client.join().unwrap();
    served && answered
}

/// TCP segments the namespace's stack received so far (`/proc/net/snmp`).
fn tcp_segments_received(ns: &str) -> u64 {
    let snmp = output(&["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"]);
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().unwrap(), tcp.next().unwrap());
    let at = names
        .split_whitespace()
        .position(|n| n == "InSegs")
        .unwrap();
    values.split_whitespace().nth(at).unwrap().parse().unwrap()
}

/// One spawned VM and its guest namespace.
struct Vm {
    agent: AgentId,
    handle: ResourceHandle,
    ip: Ipv4Addr,
    guest: GuestNet,
}

impl Vm {
    fn ns(&self) -> &str {
        self.guest.netns()
    }

    /// A command inside the guest namespace (the guest is root: it may).
    fn guest_cmd(&self, args: &[&str]) {
        let mut argv = vec!["ip", "netns", "exec", self.ns()];
        argv.extend_from_slice(args);
        run(&argv);
    }
}

/// The harness with kici-netpolicy's real rules for its bridge, host
/// forwarding provisioned, and the listeners every test may connect to.
struct Lab {
    h: Harness,
    table: EgressTable,
    _listeners: Vec<TcpListener>,
    vms: usize,
}

impl Lab {
    /// `label_sets`: extra label sets (see [`Harness::with`]); label set 0
    /// has the default policy.
    async fn start(ns: &Namespaces, label_sets: &str) -> Self {
        let h = Harness::with(label_sets, Binaries::Testkit(GuestSetup::default())).await;
        let table = EgressTable::ensure(
            h.instance,
            h.network.cidr,
            TableOptions {
                gateway_port: Some(GATEWAY_PORT),
                agent_bridge: Some(h.network.bridge_name.clone()),
                ..TableOptions::default()
            },
        )
        .await
        .unwrap();
        h.egress.forward_to(Arc::new(table.clone()));
        // The host side of item 8: forwarding on, NAT, forward accepts.
        let forwarding = HostForwarding {
            bridge: h.network.bridge_name.clone(),
            subnet: h.network.cidr,
            uplink: None,
            netns: None,
            command_timeout: Duration::from_secs(10),
        }
        .provision()
        .await
        .unwrap();
        assert!(forwarding.healthy(), "{forwarding:?}");
        let any = Ipv4Addr::UNSPECIFIED;
        let listeners = vec![
            Namespaces::listen_tcp(&ns.host, any, GATEWAY_PORT),
            Namespaces::listen_tcp(&ns.host, any, OTHER_HOST_PORT),
            Namespaces::listen_tcp(&ns.world, any, WEB),
        ];
        Self {
            h,
            table,
            _listeners: listeners,
            vms: 0,
        }
    }

    /// Spawns a VM of label set `index` and wires its guest namespace.
    async fn spawn(&mut self, index: usize) -> Vm {
        let agent = random_agent();
        let (spec, _reports) = self.h.spec_in(agent, index);
        let handle = self.h.backend.spawn(spec).await.unwrap();
        self.h.remember(&agent, &handle);
        let ip: Ipv4Addr = handle.extra["ip"].parse().unwrap();
        self.vms += 1;
        let link = self.h.root(&agent).join("run/testkit-guest.sock");
        let config = GuestNetConfig {
            netns: format!("{}g{}", self.h.network.bridge_name, self.vms),
            iface_id: "eth0".into(),
            mac: MacAddress::for_ip(ip).to_string(),
            ip,
            prefix_len: self.h.network.cidr.prefix_len(),
            gateway: Some(self.h.network.gateway),
            mmds_address: Ipv4Addr::new(169, 254, 169, 254),
        };
        let guest = tokio::task::spawn_blocking(move || GuestNet::attach(&link, &config))
            .await
            .unwrap()
            .unwrap();
        Vm {
            agent,
            handle,
            ip,
            guest,
        }
    }

    async fn dropped(&self, agents: &[&AgentId]) -> u64 {
        let mut sum = 0;
        for a in agents {
            let c: RuleCounters = self.table.counters(a).await.unwrap();
            sum += c.dropped_packets;
        }
        sum
    }

    /// Asserts the flow fails and that kici-scaler's rules of `agents`
    /// dropped something meanwhile.
    async fn assert_blocked(&self, agents: &[&AgentId], what: &str, flow: impl FnOnce() -> bool) {
        let before = self.dropped(agents).await;
        assert!(!flow(), "{what}: expected blocked, but it went through");
        let after = self.dropped(agents).await;
        assert!(
            after > before,
            "{what}: blocked, but not by kici-scaler's rules ({before} -> {after} drops)"
        );
    }

    async fn destroy(&self, vm: Vm) {
        let Vm {
            agent,
            handle,
            guest,
            ..
        } = vm;
        drop(guest);
        self.h
            .backend
            .destroy(&agent, Some(&handle), Duration::from_secs(1))
            .await
            .unwrap();
        self.h.assert_nothing_left(&agent).await;
    }

    /// No agent of this instance has a rule or chain left in our tables.
    fn assert_no_agent_rules(&self) {
        let json = output(&["nft", "-j", "list", "ruleset"]);
        let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
        let instance = self.h.instance.to_string();
        let chain_prefix = format!("ag-{instance}-");
        let subnet_tag = format!("kici-scaler:{instance}:subnet ");
        let leftovers: Vec<&serde_json::Value> = doc["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| {
                let chain = o
                    .get("chain")
                    .and_then(|c| c["name"].as_str())
                    .is_some_and(|n| n.starts_with(&chain_prefix));
                let rule = o
                    .get("rule")
                    .and_then(|r| r["comment"].as_str())
                    .is_some_and(|c| {
                        c.starts_with(&format!("kici-scaler:{instance}:"))
                            && !c.starts_with(&subnet_tag)
                    });
                chain || rule
            })
            .collect();
        assert!(leftovers.is_empty(), "left in the ruleset: {leftovers:?}");
    }
}

#[test]
fn serial_firecracker_isolation_default_policy_blocks_private_metadata_and_the_host() {
    let ns = Arc::new(Namespaces::new());
    let inner = ns.clone();
    ns.run_in_host(move || async move {
        let ns = inner;
        let world = ns.world.clone();
        let mut lab = Lab::start(&ns, "").await;
        let vm = lab.spawn(0).await;
        let private_dns = Namespaces::udp_socket(&world, PRIVATE, 5353);
        let public_udp = Namespaces::udp_socket(&world, INTERNET, 5353);
        let gateway = lab.h.network.gateway;
        let a = &vm.agent;
        for bridge_nf in [false, true] {
            ns.set_bridge_nf(bridge_nf);
            let ctx = format!("bridge-nf-call-iptables={}", u8::from(bridge_nf));
            let before = lab.table.counters(a).await.unwrap();
            assert!(tcp_reaches(vm.ns(), INTERNET, WEB), "{ctx}: public");
            assert!(udp_round_trip(vm.ns(), &public_udp), "{ctx}: public udp");
            assert!(
                tcp_reaches(vm.ns(), gateway, GATEWAY_PORT),
                "{ctx}: agent gateway"
            );
            let after = lab.table.counters(a).await.unwrap();
            assert!(
                after.accepted_packets > before.accepted_packets,
                "{ctx}: our accepts counted"
            );
            for (to, what) in [
                (PRIVATE, "RFC 1918 10/8"),
                (PRIVATE_192, "RFC 1918 192.168/16"),
                (METADATA_LINK_LOCAL, "link-local metadata 169.254.170.2"),
                (METADATA_CGNAT, "CGNAT metadata 100.100.100.200"),
            ] {
                lab.assert_blocked(&[a], &format!("{ctx}: {what}"), || {
                    tcp_reaches(vm.ns(), to, WEB)
                })
                .await;
            }
            lab.assert_blocked(&[a], &format!("{ctx}: RFC 1918 udp"), || {
                udp_round_trip(vm.ns(), &private_dns)
            })
            .await;
            lab.assert_blocked(&[a], &format!("{ctx}: host service on the gateway"), || {
                tcp_reaches(vm.ns(), gateway, OTHER_HOST_PORT)
            })
            .await;
            lab.assert_blocked(
                &[a],
                &format!("{ctx}: host service on its uplink address"),
                || tcp_reaches(vm.ns(), HOST_UPLINK, OTHER_HOST_PORT),
            )
            .await;
        }
        lab.destroy(vm).await;
        lab.assert_no_agent_rules();
    });
}

#[test]
fn serial_firecracker_isolation_allowlist_opens_one_destination_and_deny_all_everything_but_the_gateway(
) {
    let ns = Arc::new(Namespaces::new());
    let inner = ns.clone();
    ns.run_in_host(move || async move {
        let ns = inner;
        let label_sets = "      - labels: [linux, allow]\n        rootfsPath: @ROOTFS@\n        overlayDriveSizeMib: 16\n        networkPolicy:\n          allowlist: [10.9.0.2/32]\n      - labels: [linux, sealed]\n        rootfsPath: @ROOTFS@\n        overlayDriveSizeMib: 16\n        networkPolicy:\n          allowlist: [203.0.113.0/24]\n          denyAll: true\n";
        let mut lab = Lab::start(&ns, label_sets).await;
        let allowed = lab.spawn(1).await;
        let sealed = lab.spawn(2).await;
        let _private_web = Namespaces::listen_tcp(&ns.world, PRIVATE, 8080);
        let _private_other = Namespaces::listen_tcp(&ns.world, PRIVATE_OTHER, 8080);
        let gateway = lab.h.network.gateway;
        for bridge_nf in [false, true] {
            ns.set_bridge_nf(bridge_nf);
            let ctx = format!("bridge-nf-call-iptables={}", u8::from(bridge_nf));
            assert!(
                tcp_reaches(allowed.ns(), PRIVATE, 8080),
                "{ctx}: allowlisted 10.9.0.2/32"
            );
            assert!(tcp_reaches(allowed.ns(), INTERNET, WEB), "{ctx}: public");
            lab.assert_blocked(
                &[&allowed.agent],
                &format!("{ctx}: the rest of 10/8"),
                || tcp_reaches(allowed.ns(), PRIVATE_OTHER, 8080),
            )
            .await;
            lab.assert_blocked(
                &[&allowed.agent],
                &format!("{ctx}: the allowlist never opens the host"),
                || tcp_reaches(allowed.ns(), gateway, OTHER_HOST_PORT),
            )
            .await;

            assert!(
                tcp_reaches(sealed.ns(), gateway, GATEWAY_PORT),
                "{ctx}: denyAll keeps the agent gateway"
            );
            for (to, port, what) in [
                (INTERNET, WEB, "public, even allowlisted"),
                (PRIVATE, 8080, "private"),
                (gateway, OTHER_HOST_PORT, "host service"),
            ] {
                lab.assert_blocked(
                    &[&sealed.agent],
                    &format!("{ctx}: denyAll: {what}"),
                    || tcp_reaches(sealed.ns(), to, port),
                )
                .await;
            }
        }
        lab.destroy(allowed).await;
        lab.destroy(sealed).await;
        lab.assert_no_agent_rules();
    });
}

#[test]
fn serial_firecracker_isolation_vms_cannot_reach_each_other() {
    let ns = Arc::new(Namespaces::new());
    let inner = ns.clone();
    ns.run_in_host(move || async move {
        let ns = inner;
        // A's allowlist covers the whole VM subnet: it must still not open B.
        let label_sets = "      - labels: [linux, wide]\n        rootfsPath: @ROOTFS@\n        overlayDriveSizeMib: 16\n        networkPolicy:\n          allowlist: [10.0.0.0/8]\n";
        let mut lab = Lab::start(&ns, label_sets).await;
        let a = lab.spawn(1).await;
        let b = lab.spawn(0).await;
        let b_ns = b.ns().to_owned();
        let _b_web = Namespaces::listen_tcp(&b_ns, b.ip, WEB);
        let both = [&a.agent, &b.agent];
        let gateway = lab.h.network.gateway;
        for bridge_nf in [false, true] {
            ns.set_bridge_nf(bridge_nf);
            let ctx = format!("bridge-nf-call-iptables={}", u8::from(bridge_nf));
            // As a guest would: ARP for its neighbour first.
            lab.assert_blocked(&both, &format!("{ctx}: VM to VM"), || {
                tcp_reaches(a.ns(), b.ip, WEB)
            })
            .await;
        }
        // A root guest can skip ARP: B's MAC derives from its address.
        a.guest_cmd(&[
            "ip",
            "neigh",
            "replace",
            &b.ip.to_string(),
            "lladdr",
            &MacAddress::for_ip(b.ip).to_string(),
            "dev",
            "eth0",
            "nud",
            "permanent",
        ]);
        for bridge_nf in [false, true] {
            ns.set_bridge_nf(bridge_nf);
            let ctx = format!("bridge-nf-call-iptables={}", u8::from(bridge_nf));
            lab.assert_blocked(
                &both,
                &format!("{ctx}: VM to VM with a static neighbour entry"),
                || tcp_reaches(a.ns(), b.ip, WEB),
            )
            .await;
        }
        // Or route to B through the host (the allowlist covers B's address).
        a.guest_cmd(&["ip", "neigh", "del", &b.ip.to_string(), "dev", "eth0"]);
        a.guest_cmd(&[
            "ip",
            "route",
            "replace",
            &format!("{}/32", b.ip),
            "via",
            &gateway.to_string(),
            "dev",
            "eth0",
        ]);
        for bridge_nf in [false, true] {
            ns.set_bridge_nf(bridge_nf);
            let ctx = format!("bridge-nf-call-iptables={}", u8::from(bridge_nf));
            let received = tcp_segments_received(&b_ns);
            lab.assert_blocked(
                &[&a.agent],
                &format!("{ctx}: VM to VM routed through the host"),
                || tcp_reaches(a.ns(), b.ip, WEB),
            )
            .await;
            assert_eq!(
                tcp_segments_received(&b_ns),
                received,
                "{ctx}: not even A's SYN reached B"
            );
        }
        assert!(tcp_reaches(a.ns(), INTERNET, WEB), "A itself still works");
        lab.destroy(a).await;
        lab.destroy(b).await;
        lab.assert_no_agent_rules();
    });
}

#[test]
fn serial_firecracker_isolation_spoofed_sources_are_dropped() {
    let ns = Arc::new(Namespaces::new());
    let inner = ns.clone();
    ns.run_in_host(move || async move {
        let ns = inner;
        let mut lab = Lab::start(&ns, "").await;
        let a = lab.spawn(0).await;
        let b = lab.spawn(0).await;
        let gateway = lab.h.network.gateway;
        let prefix = lab.h.network.cidr.prefix_len();
        let unused = Ipv4Addr::from(u32::from(lab.h.network.cidr.network()) + 200);
        // The guest skips ARP for the gateway (it may: it is root), so the
        // spoofed IP packets themselves reach the bridge.
        let links: serde_json::Value = serde_json::from_str(&output(&[
            "ip",
            "-j",
            "link",
            "show",
            &lab.h.network.bridge_name,
        ]))
        .unwrap();
        let bridge_mac = links[0]["address"].as_str().unwrap().to_owned();
        // The guest (root) takes another address: an unused one of the
        // subnet, its neighbour's, one outside the subnet.
        for (fake, len, what) in [
            (unused, prefix, "an unused address of the subnet"),
            (b.ip, prefix, "the other VM's address"),
            (
                Ipv4Addr::new(203, 0, 113, 77),
                32,
                "an address outside the subnet",
            ),
        ] {
            a.guest_cmd(&["ip", "addr", "flush", "dev", "eth0"]);
            a.guest_cmd(&["ip", "addr", "add", &format!("{fake}/{len}"), "dev", "eth0"]);
            let _ = Command::new("ip")
                .args(["netns", "exec", a.ns(), "ip", "route", "add"])
                .arg(format!("{gateway}/32"))
                .args(["dev", "eth0"])
                .output();
            a.guest_cmd(&[
                "ip",
                "route",
                "replace",
                "default",
                "via",
                &gateway.to_string(),
                "dev",
                "eth0",
                "onlink",
            ]);
            a.guest_cmd(&[
                "ip",
                "neigh",
                "replace",
                &gateway.to_string(),
                "lladdr",
                &bridge_mac,
                "dev",
                "eth0",
                "nud",
                "permanent",
            ]);
            for bridge_nf in [false, true] {
                ns.set_bridge_nf(bridge_nf);
                let ctx = format!("bridge-nf-call-iptables={}: {what}", u8::from(bridge_nf));
                lab.assert_blocked(&[&a.agent], &format!("{ctx}: to the internet"), || {
                    tcp_reaches(a.ns(), INTERNET, WEB)
                })
                .await;
                lab.assert_blocked(&[&a.agent], &format!("{ctx}: to the agent gateway"), || {
                    tcp_reaches(a.ns(), gateway, GATEWAY_PORT)
                })
                .await;
            }
        }
        // Back to its own address, it works again (the drops were about the source).
        a.guest_cmd(&["ip", "addr", "flush", "dev", "eth0"]);
        a.guest_cmd(&[
            "ip",
            "addr",
            "add",
            &format!("{}/{prefix}", a.ip),
            "dev",
            "eth0",
        ]);
        a.guest_cmd(&[
            "ip",
            "route",
            "replace",
            "default",
            "via",
            &gateway.to_string(),
            "dev",
            "eth0",
        ]);
        assert!(tcp_reaches(a.ns(), INTERNET, WEB), "own address again");
        lab.destroy(a).await;
        lab.destroy(b).await;
        lab.assert_no_agent_rules();
    });
}

/// Rules go by handle on destroy (above, every test) and the sweep removes
/// the rules of an agent that died without its destroy (a daemon crash
/// between steps): the table is back to no agent rule at all.
#[test]
fn serial_firecracker_isolation_dead_vms_rules_are_swept() {
    let ns = Arc::new(Namespaces::new());
    let inner = ns.clone();
    ns.run_in_host(move || async move {
        let ns = inner;
        let mut lab = Lab::start(&ns, "").await;
        let live = lab.spawn(0).await;
        // Rules of a VM whose everything else is gone.
        let dead = random_agent();
        let egress = lab.table.clone();
        let ip = Ipv4Addr::from(u32::from(lab.h.network.cidr.network()) + 100);
        kici_netpolicy::EgressRules::install(
            &egress,
            &kici_netpolicy::EgressTarget {
                agent: dead,
                ip,
                mac: MacAddress::for_ip(ip).0,
                port: Some(kici_firecracker::names::tap_name(&dead)),
                bridge: lab.h.network.bridge_name.clone(),
                gateway: lab.h.network.gateway,
            },
            None,
        )
        .await
        .unwrap();
        let owned: HashSet<AgentId> = lab
            .table
            .owned()
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.agent)
            .collect();
        assert_eq!(owned, HashSet::from([live.agent, dead]));
        let report = lab.h.backend.sweep(&HashSet::from([live.agent])).await;
        assert_eq!(report.rules, 1, "{report:?}");
        assert!(report.errors.is_empty(), "{report:?}");
        let owned: Vec<AgentId> = lab
            .table
            .owned()
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.agent)
            .collect();
        assert_eq!(owned, [live.agent], "the live VM's rules stay");
        assert!(tcp_reaches(live.ns(), INTERNET, WEB), "and still work");
        lab.destroy(live).await;
        lab.assert_no_agent_rules();
        assert!(lab.table.owned().await.unwrap().is_empty());
    });
}
