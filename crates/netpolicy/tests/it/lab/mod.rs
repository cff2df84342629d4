//! A throwaway network lab per test: network namespaces connected by veth
//! pairs and a bridge, so nothing in the root namespace is ever touched.
//!
//! ```text
//!   agent ns (eth0 172.29.0.x, MAC for_ip) ── va<n> ─┐
//!                                                   br0 172.29.0.1/24   host ns (our nft tables)
//!   internet ns (eth0 203.0.113.2, 10.9.0.2, ────── vnet 203.0.113.1/24, 10.9.0.1/24
//!                10.9.0.53)
//! ```
//!
//! Every namespace is deleted on drop (also when the test panics).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket};
use std::process::Command;
use std::time::Duration;

pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(172, 29, 0, 1);
pub const HOST_PUBLIC: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
pub const INTERNET: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 2);
pub const RESOLVER: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 53);
pub const SUBNET: &str = "172.29.0.0/24";
/// How long a flow may take before it counts as dropped. Every path is
/// inside one machine: a reply that takes this long was not coming.
pub const BLOCKED_AFTER: Duration = Duration::from_millis(1000);

pub fn run(argv: &[&str]) {
    let out = Command::new(argv[0]).args(&argv[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn output(argv: &[&str]) -> String {
    let out = Command::new(argv[0]).args(&argv[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn mac_for(ip: Ipv4Addr) -> [u8; 6] {
    let [_, b, c, d] = ip.octets();
    [0x06, 0x00, 0xac, b, c, d]
}

pub fn mac_str(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Runs `f` on a thread that entered network namespace `ns`; sockets made
/// there stay in that namespace wherever they are used later.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
    .join()
    .unwrap()
}

pub struct Agent {
    pub ns: String,
    pub ip: Ipv4Addr,
    pub mac: [u8; 6],
    /// The host-side veth on br0 (stands in for a TAP).
    pub port: String,
}

pub struct Lab {
    pub host: String,
    pub internet: String,
    namespaces: Vec<String>,
    agents: usize,
}

impl Lab {
    pub fn new() -> Self {
        let id: u32 = rand::random();
        let host = format!("kici-np-{id:08x}-h");
        let internet = format!("kici-np-{id:08x}-n");
        let mut lab = Self {
            host: host.clone(),
            internet: internet.clone(),
            namespaces: Vec::new(),
            agents: 0,
        };
        for ns in [&host, &internet] {
            run(&["ip", "netns", "add", ns]);
            lab.namespaces.push(ns.clone());
            run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        let h = host.as_str();
        run(&["ip", "-n", h, "link", "add", "br0", "type", "bridge"]);
        run(&["ip", "-n", h, "addr", "add", "172.29.0.1/24", "dev", "br0"]);
        run(&["ip", "-n", h, "link", "set", "br0", "up"]);
        run(&[
            "ip",
            "netns",
            "exec",
            h,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
        ]);
        run(&[
            "ip", "-n", h, "link", "add", "vnet", "type", "veth", "peer", "name", "eth0", "netns",
            &internet,
        ]);
        run(&[
            "ip",
            "-n",
            h,
            "addr",
            "add",
            "203.0.113.1/24",
            "dev",
            "vnet",
        ]);
        run(&["ip", "-n", h, "addr", "add", "10.9.0.1/24", "dev", "vnet"]);
        run(&["ip", "-n", h, "link", "set", "vnet", "up"]);
        let n = internet.as_str();
        for addr in ["203.0.113.2/24", "10.9.0.2/24", "10.9.0.53/24"] {
            run(&["ip", "-n", n, "addr", "add", addr, "dev", "eth0"]);
        }
        run(&["ip", "-n", n, "link", "set", "eth0", "up"]);
        run(&[
            "ip",
            "-n",
            n,
            "route",
            "add",
            "default",
            "via",
            "203.0.113.1",
        ]);
        lab
    }

    /// `bridge-nf-call-iptables` in the host namespace (per namespace here).
    pub fn set_bridge_nf(&self, on: bool) {
        let value = if on { "1" } else { "0" };
        run(&[
            "ip",
            "netns",
            "exec",
            &self.host,
            "sysctl",
            "-qw",
            &format!("net.bridge.bridge-nf-call-iptables={value}"),
        ]);
    }

    /// A namespace acting as an agent at `172.29.0.<last>` with the MAC the
    /// allocator would give it, plugged into br0.
    pub fn agent(&mut self, last: u8) -> Agent {
        self.agents += 1;
        let ns = format!("{}-a{}", self.host.trim_end_matches("-h"), self.agents);
        let port = format!("va{}", self.agents);
        let ip = Ipv4Addr::new(172, 29, 0, last);
        let mac = mac_for(ip);
        run(&["ip", "netns", "add", &ns]);
        self.namespaces.push(ns.clone());
        let h = self.host.as_str();
        run(&[
            "ip", "-n", h, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
            &ns,
        ]);
        run(&["ip", "-n", h, "link", "set", &port, "master", "br0", "up"]);
        run(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        run(&[
            "ip",
            "-n",
            &ns,
            "link",
            "set",
            "eth0",
            "address",
            &mac_str(mac),
        ]);
        run(&[
            "ip",
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{ip}/24"),
            "dev",
            "eth0",
        ]);
        run(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
        run(&[
            "ip",
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            "172.29.0.1",
        ]);
        Agent { ns, ip, mac, port }
    }

    pub fn listen_tcp(ns: &str, ip: Ipv4Addr, port: u16) -> TcpListener {
        in_netns(ns, move || {
            TcpListener::bind(SocketAddrV4::new(ip, port)).unwrap()
        })
    }

    pub fn udp_socket(ns: &str, ip: Ipv4Addr, port: u16) -> UdpSocket {
        in_netns(ns, move || {
            UdpSocket::bind(SocketAddrV4::new(ip, port)).unwrap()
        })
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Whether a TCP connection from `ns` (optionally from source `from`) to
/// `to` completes its handshake within [`BLOCKED_AFTER`].
pub fn tcp_reaches(ns: &str, from: Option<Ipv4Addr>, to: Ipv4Addr, port: u16) -> bool {
    let shown = ns.to_owned();
    in_netns(ns, move || {
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        if let Some(from) = from {
            socket
                .bind(&SocketAddr::from(SocketAddrV4::new(from, 0)).into())
                .unwrap();
        }
        let target = SocketAddr::from(SocketAddrV4::new(to, port));
        match socket.connect_timeout(&target.into(), BLOCKED_AFTER) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => false,
            Err(e) => panic!("connect {shown} -> {target}: unexpected {e}"),
        }
    })
}

/// Whether a UDP datagram from `ns` reaches `server` and its echo comes back.
pub fn udp_round_trip(ns: &str, server: &UdpSocket) -> bool {
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
