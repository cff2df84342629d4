//! Container egress with real traffic: the real daemon
//! (`kici-scaler serve`) on the real dockerd spawns containers of the FROM
//! scratch test image (`scripts/build-test-image.sh`: the static
//! `kici-agent-lite` plus busybox) from label sets with different
//! `networkPolicy`, and from inside each container (`docker exec`, busybox
//! `nc` for TCP, `nslookup` for UDP) the test reaches for listeners it owns,
//! all on this machine:
//!
//! ```text
//!  container 172.29.x.y ── kici-scaler0 172.29.0.1 ── host (root netns): agent gateway
//!                                                     :PORT, a host service on 172.29.0.1
//!                                                     and on 10.a.b.1
//!  host veth kce…  10.a.b.1/24 ─────── "outside" netns kici-ce…: eth0 10.a.b.2 (RFC 1918),
//!  route 198.51.100.c/32 → kce…                       10.a.b.3 (RFC 1918, allowlisted),
//!                                                     198.51.100.c (public)
//! ```
//!
//! Every flow runs with `bridge-nf-call-iptables` at 0 and at 1 (dockerd's
//! bridge is in the root namespace, so that is the host's value: saved and
//! restored by [`BridgeNf`], and the tests are `serial_*`). Every allowed
//! flow must complete (a TCP banner read back, a DNS answer received);
//! every blocked flow must fail, never reach its listener, and raise the
//! drop counters of kici-scaler's own rules in that agent's chains
//! (`nft -j list ruleset`), so a drop elsewhere (dockerd's `enable_icc=false`
//! DROP, FORWARD policies) can never be what makes a test pass.
//!
//! Everything the tests make is named after a random tag and removed on
//! drop, failure included: the namespace and its veth, the image, the
//! daemon's containers and the instance's nftables and `DOCKER-USER` rules.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{agents_with_rules, remove_instance_rules, tool, wait_until, Daemon, Dir};
use kici_model::InstanceId;
use serde_json::Value;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const OWNER_LABEL: &str = "dev.kici.scaler.instance";
const AGENT_LABEL: &str = "dev.kici.scaler.agent";
/// The daemon's agent network (its defaults).
const SUBNET: &str = "172.29.0.0/16";
const BRIDGE: &str = "kici-scaler0";
const GATEWAY: Ipv4Addr = Ipv4Addr::new(172, 29, 0, 1);
/// Where the test's TCP services listen in the outside namespace (on the
/// host: a port the kernel picks).
const SERVICE_PORT: u16 = 8080;
/// What each container's job listens on (`nc -ll … -e /bin/cat`).
const CONTAINER_PORT: u16 = 8080;
/// A blocked flow's connect timeout (`nc -w`): inside one machine an
/// allowed handshake takes microseconds; the drop counters, not this
/// timeout, are what prove the block.
const BLOCKED_AFTER_SECS: u32 = 1;
/// An allowed flow's timeout: only a bound on a loaded machine.
const ALLOWED_WITHIN_SECS: u32 = 10;
const BRIDGE_NF: &str = "/proc/sys/net/bridge/bridge-nf-call-iptables";

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn run(argv: &[&str]) {
    let out = Command::new(argv[0]).args(&argv[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `net.bridge.bridge-nf-call-iptables` of the root namespace (dockerd's
/// bridge is there); the value found is restored on drop.
struct BridgeNf {
    original: String,
}

impl BridgeNf {
    fn save() -> Self {
        let original = std::fs::read_to_string(BRIDGE_NF)
            .unwrap_or_else(|e| panic!("{BRIDGE_NF}: {e} (br_netfilter is loaded by dockerd)"));
        Self {
            original: original.trim().to_owned(),
        }
    }

    fn set(&self, on: bool) {
        let value = if on { "1" } else { "0" };
        std::fs::write(BRIDGE_NF, value).unwrap();
        assert_eq!(std::fs::read_to_string(BRIDGE_NF).unwrap().trim(), value);
    }
}

impl Drop for BridgeNf {
    fn drop(&mut self) {
        let _ = std::fs::write(BRIDGE_NF, &self.original);
    }
}

/// Runs `f` on a thread that entered network namespace `ns` (`None`: this
/// one); sockets made there stay in it.
fn in_netns<T: Send + 'static>(ns: Option<&str>, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = ns.map(|ns| format!("/run/netns/{ns}"));
    std::thread::spawn(move || {
        if let Some(path) = path {
            let file = std::fs::File::open(&path).unwrap();
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        }
        f()
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Whether any route of this host other than the default one covers `ip`.
fn routed_here(ip: Ipv4Addr) -> bool {
    let routes: Value = serde_json::from_str(&tool(
        "ip",
        &["-j", "route", "show", "match", &ip.to_string()],
    ))
    .unwrap_or(Value::Null);
    routes
        .as_array()
        .is_some_and(|r| r.iter().any(|r| r["dst"] != "default"))
}

/// The "outside": a network namespace with RFC 1918 and public addresses,
/// reached from the host through a veth (routed, as a LAN and the internet
/// would be). Deleted on drop (the veth goes with it).
struct Outside {
    ns: String,
    veth: String,
    /// The host's address on the veth (a host service listens there).
    host: Ipv4Addr,
    /// A private address (blocked by default).
    private: Ipv4Addr,
    /// Another private address (the allowlisted one).
    allowlisted: Ipv4Addr,
    /// A public address (TEST-NET-2, routed to the namespace by a /32).
    public: Ipv4Addr,
    made: bool,
}

impl Outside {
    fn new() -> Self {
        let mut outside = None;
        for _ in 0..32 {
            let id: u32 = rand::random();
            let [_, c, b, a] = id.to_be_bytes();
            // 10.100.0.0–10.199.255.0: clear of the resolver, Podman, dockerd.
            let net = [10, 100 + a % 100, b, 0];
            let candidate = Outside {
                ns: format!("kici-ce{id:08x}"),
                veth: format!("kce{id:08x}"),
                host: Ipv4Addr::new(net[0], net[1], net[2], 1),
                private: Ipv4Addr::new(net[0], net[1], net[2], 2),
                allowlisted: Ipv4Addr::new(net[0], net[1], net[2], 3),
                public: Ipv4Addr::new(198, 51, 100, 1 + c % 254),
                made: false,
            };
            let taken = Path::new("/run/netns").join(&candidate.ns).exists()
                || Path::new("/sys/class/net").join(&candidate.veth).exists()
                || routed_here(candidate.private)
                || routed_here(candidate.public)
                || std::fs::read_to_string("/etc/resolv.conf")
                    .unwrap_or_default()
                    .contains(&format!("{}.{}.{}.", net[0], net[1], net[2]));
            if !taken {
                outside = Some(candidate);
                break;
            }
        }
        let mut o = outside.expect("no free address block for the outside namespace");
        run(&["ip", "netns", "add", &o.ns]);
        o.made = true;
        let ns = o.ns.clone();
        let n = ns.as_str();
        run(&["ip", "-n", n, "link", "set", "lo", "up"]);
        run(&[
            "ip", "link", "add", &o.veth, "type", "veth", "peer", "name", "eth0", "netns", n,
        ]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", o.host),
            "dev",
            &o.veth,
        ]);
        run(&["ip", "link", "set", &o.veth, "up"]);
        for (addr, len) in [(o.private, 24), (o.allowlisted, 24), (o.public, 32)] {
            run(&[
                "ip",
                "-n",
                n,
                "addr",
                "add",
                &format!("{addr}/{len}"),
                "dev",
                "eth0",
            ]);
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
            &o.host.to_string(),
        ]);
        run(&[
            "ip",
            "route",
            "add",
            &format!("{}/32", o.public),
            "dev",
            &o.veth,
        ]);
        o
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        if self.made {
            let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
            // Gone with its peer's namespace; this only covers a failure
            // between creating the pair and moving its peer.
            let _ = Command::new("ip")
                .args(["link", "del", &self.veth])
                .output();
        }
    }
}

/// A listener of the test's on a thread: TCP (writes a banner, closes) or
/// UDP port 53 (answers every query NXDOMAIN). Counts what reached it;
/// stopped on drop (a shutdown wakes its blocked accept/recv).
struct Service {
    addr: SocketAddrV4,
    hits: Arc<AtomicUsize>,
    stopper: std::os::fd::OwnedFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Service {
    fn tcp(ns: Option<&str>, ip: Ipv4Addr) -> Self {
        let port = if ns.is_some() { SERVICE_PORT } else { 0 };
        let listener = in_netns(ns, move || {
            TcpListener::bind(SocketAddrV4::new(ip, port)).unwrap()
        });
        let std::net::SocketAddr::V4(addr) = listener.local_addr().unwrap() else {
            unreachable!("bound to an IPv4 address")
        };
        let banner = banner(addr);
        let stopper = listener.try_clone().unwrap().into();
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { break };
                counted.fetch_add(1, Ordering::SeqCst);
                let _ = conn.write_all(banner.as_bytes());
            }
        });
        Self {
            addr,
            hits,
            stopper,
            thread: Some(thread),
        }
    }

    fn dns(ns: Option<&str>, ip: Ipv4Addr) -> Self {
        let addr = SocketAddrV4::new(ip, 53);
        let socket = in_netns(ns, move || UdpSocket::bind(addr).unwrap());
        let stopper = socket.try_clone().unwrap().into();
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, peer)) = socket.recv_from(&mut buf) {
                if n < 12 {
                    break; // the shutdown's empty read (or no DNS at all)
                }
                counted.fetch_add(1, Ordering::SeqCst);
                // The query as its own answer: QR set, RCODE NXDOMAIN.
                buf[2] |= 0x80;
                buf[3] = (buf[3] & 0xf0) | 3;
                let _ = socket.send_to(&buf[..n], peer);
            }
        });
        Self {
            addr,
            hits,
            stopper,
            thread: Some(thread),
        }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = rustix::net::shutdown(&self.stopper, rustix::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Packets through kici-scaler's rules in one agent's own chains (its
/// routed, host and bridged policy chains), from `nft -j list ruleset`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counted {
    dropped: u64,
    accepted: u64,
}

fn counters(instance: InstanceId, agent: &str) -> Counted {
    let doc: Value = serde_json::from_str(&tool("nft", &["-j", "list", "ruleset"])).unwrap();
    let tag = format!("kici-scaler:{instance}:{agent}");
    let own_chain = format!("ag-{instance}-{agent}");
    let mut sum = Counted::default();
    let mut chains = 0;
    for rule in doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| r["comment"] == tag.as_str())
        .filter(|r| {
            r["chain"]
                .as_str()
                .is_some_and(|c| c == own_chain || c == format!("{own_chain}-in"))
        })
    {
        chains += 1;
        let expr = rule["expr"].as_array().unwrap();
        let packets = expr
            .iter()
            .find_map(|s| s["counter"]["packets"].as_u64())
            .unwrap_or(0);
        if expr.iter().any(|s| s.get("drop").is_some()) {
            sum.dropped += packets;
        } else if expr.iter().any(|s| s.get("accept").is_some()) {
            sum.accepted += packets;
        }
    }
    assert!(chains > 0, "{agent} has no rules of its own in the ruleset");
    sum
}

/// The test image, and on drop the removal of everything the daemon's
/// instance left: containers, egress rules (the agents', the subnet's
/// drops, its `DOCKER-USER` accepts), the image.
struct World {
    image: String,
    instance: Option<InstanceId>,
}

impl World {
    fn new() -> Self {
        let image = format!("kici-scaler-test-agent:{:08x}", rand::random::<u32>());
        let out = Command::new(repo_file("scripts/build-test-image.sh"))
            .arg(&image)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "build-test-image.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        World {
            image,
            instance: None,
        }
    }

    /// One container scaler with a label set per `(label, networkPolicy
    /// YAML lines)`.
    fn dir(&self, label_sets: &[(&str, &str)]) -> Dir {
        let mut config = String::from(
            "version: 1\nscalers:\n  - name: egress\n    type: container\n    maxAgents: 4\n    runtime: docker\n    labelSets:\n",
        );
        for (label, policy) in label_sets {
            config.push_str(&format!(
                "      - labels: [linux, {label}]\n        image: \"{}\"\n        imagePullPolicy: IfNotPresent\n{policy}",
                self.image
            ));
        }
        Dir::with_config(&config)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(instance) = self.instance {
            for name in containers_of(instance) {
                let _ = tool("docker", &["rm", "-f", "-v", &name]);
            }
            remove_instance_rules(
                instance,
                SUBNET,
                BRIDGE,
                kici_netpolicy::DockerUserMode::AcceptSubnet,
            );
        }
        let _ = tool("docker", &["rmi", "-f", &self.image]);
    }
}

/// Names of the containers of `instance`, any state.
fn containers_of(instance: InstanceId) -> Vec<String> {
    tool(
        "docker",
        &[
            "ps",
            "-a",
            "--filter",
            &format!("label={OWNER_LABEL}={instance}"),
            "--format",
            "{{.Names}}",
        ],
    )
    .lines()
    .filter(|l| !l.is_empty())
    .map(str::to_owned)
    .collect()
}

/// The daemon of one test: its instance, the agent gateway's port.
struct Lab {
    d: Daemon,
    _dir: Dir,
    instance: InstanceId,
    gateway_port: u16,
}

impl Lab {
    fn start(world: &mut World, label_sets: &[(&str, &str)]) -> Self {
        let dir = world.dir(label_sets);
        let d = Daemon::start(&dir, &["--listen", "127.0.0.1:0"], &[]);
        let instance: InstanceId = dir.instance().parse().unwrap();
        world.instance = Some(instance);
        let gateway_port = d.gateway.rsplit_once(':').unwrap().1.parse().unwrap();
        Lab {
            d,
            _dir: dir,
            instance,
            gateway_port,
        }
    }

    /// A container of label set `label` whose job listens on
    /// [`CONTAINER_PORT`] (echoing what it gets), once that job runs.
    fn spawn(&self, label: &str) -> Container {
        let body = serde_json::json!({
            "labels": ["linux", label],
            "command": ["nc", "-ll", "-p", CONTAINER_PORT.to_string(), "-e", "/bin/cat"],
        })
        .to_string();
        let (status, answer) = self.d.http("POST", "/v1/jobs", Some(&body));
        assert_eq!(status, 202, "{answer}");
        let job: Value = serde_json::from_str(&answer).unwrap();
        let job = job["jobId"].as_str().unwrap().to_owned();
        let mut agent = String::new();
        wait_until(&format!("job {job} runs"), || {
            let (_, body) = self.d.http("GET", &format!("/v1/jobs/{job}"), None);
            let v: Value = serde_json::from_str(&body).unwrap_or_default();
            let state = v["state"].as_str().unwrap_or_default();
            assert!(
                !matches!(state, "succeeded" | "failed" | "cancelled"),
                "job {job} ended: {v}"
            );
            agent = v["agentId"].as_str().unwrap_or_default().to_owned();
            state == "running"
        });
        let names = tool(
            "docker",
            &[
                "ps",
                "--filter",
                &format!("label={AGENT_LABEL}={agent}"),
                "--format",
                "{{.Names}}",
            ],
        );
        let name = names.trim().to_owned();
        assert!(!name.is_empty() && !name.contains('\n'), "{agent}: {names}");
        let ip = tool(
            "docker",
            &[
                "inspect",
                "-f",
                "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                &name,
            ],
        )
        .trim()
        .parse()
        .unwrap();
        let c = Container {
            agent,
            name,
            ip,
            instance: self.instance,
            last: Default::default(),
        };
        // The job's listener is up (from inside: nothing of ours in between).
        wait_until(&format!("{} listens", c.name), || {
            c.exec(&[
                "sh",
                "-c",
                &format!("echo ping | nc -w 2 127.0.0.1 {CONTAINER_PORT}"),
            ])
            .contains("ping")
        });
        c
    }

    /// SIGTERM: the daemon destroys its agents; nothing of theirs is left.
    fn finish(self) {
        let Lab { d, instance, .. } = self;
        d.terminate();
        assert_eq!(containers_of(instance), Vec::<String>::new());
        assert!(agents_with_rules(instance).is_empty(), "agent rules left");
    }
}

/// One running agent container.
struct Container {
    agent: String,
    name: String,
    ip: Ipv4Addr,
    instance: InstanceId,
    /// What the last flow printed (for failure messages).
    last: std::cell::RefCell<String>,
}

impl Container {
    /// `docker exec` (no stdin): stdout and stderr together.
    fn exec(&self, args: &[&str]) -> String {
        let mut argv = vec!["exec", self.name.as_str()];
        argv.extend_from_slice(args);
        let out = tool("docker", &argv);
        *self.last.borrow_mut() = out.clone();
        out
    }

    /// A TCP connection to `to`; what came back (a banner, an echo, or
    /// busybox's reason for failing).
    fn tcp(&self, to: Ipv4Addr, port: u16, send: &str, secs: u32) -> String {
        self.exec(&[
            "sh",
            "-c",
            &format!("printf '{send}' | nc -w {secs} {to} {port}"),
        ])
    }

    /// A DNS query over UDP to `to`:53; whether its answer came back.
    fn dns(&self, to: Ipv4Addr, secs: u32) -> String {
        self.exec(&[
            "busybox",
            "nslookup",
            &format!("-timeout={secs}"),
            "-retry=1",
            "kici.test",
            &to.to_string(),
        ])
    }

    fn counters(&self) -> Counted {
        counters(self.instance, &self.agent)
    }

    /// Asserts the flow fails, reaches none of `services`, and that this
    /// agent's own rules dropped packets meanwhile.
    fn assert_blocked(&self, what: &str, services: &[&Service], flow: impl FnOnce() -> bool) {
        let before = self.counters();
        let hits: Vec<usize> = services.iter().map(|s| s.hits()).collect();
        assert!(
            !flow(),
            "{what}: expected blocked, but it went through: {}",
            self.last.borrow()
        );
        let after = self.counters();
        assert_eq!(
            services.iter().map(|s| s.hits()).collect::<Vec<_>>(),
            hits,
            "{what}: blocked, yet the listener saw it"
        );
        assert!(
            after.dropped > before.dropped,
            "{what}: blocked, but not by kici-scaler's rules ({} -> {} drops)",
            before.dropped,
            after.dropped
        );
        eprintln!(
            "{what}: blocked; {}'s drops {} -> {}",
            self.agent, before.dropped, after.dropped
        );
    }

    /// Asserts the flow completes and went through this agent's accepts.
    fn assert_allowed(&self, what: &str, flow: impl FnOnce() -> bool) {
        let before = self.counters();
        assert!(
            flow(),
            "{what}: expected to go through, but it did not: {}",
            self.last.borrow()
        );
        let after = self.counters();
        assert!(
            after.accepted > before.accepted,
            "{what}: went through, but not by kici-scaler's accepts ({} -> {})",
            before.accepted,
            after.accepted
        );
    }

    /// A TCP service of the test answers with its banner.
    fn reaches(&self, service: &Service, secs: u32) -> bool {
        let to = service.addr;
        self.tcp(*to.ip(), to.port(), "", secs)
            .contains(&banner(to))
    }

    /// A DNS service of the test answers (UDP both ways).
    fn reaches_dns(&self, service: &Service, secs: u32) -> bool {
        self.dns(*service.addr.ip(), secs).contains("NXDOMAIN")
    }

    /// An HTTP request to the agent gateway is answered (whatever the
    /// status). `nc -e` keeps the socket open until the answer came: fed
    /// from a pipe, `nc` half-closes once its input ends, and the gateway
    /// may hang up on that before answering. (busybox `wget` crashes in
    /// this image: static glibc without NSS.)
    fn reaches_gateway(&self, port: u16, secs: u32) -> bool {
        self.exec(&[
            "nc",
            "-w",
            &secs.to_string(),
            &GATEWAY.to_string(),
            &port.to_string(),
            "-e",
            "sh",
            "-c",
            "printf 'GET / HTTP/1.0\\r\\n\\r\\n'; cat >&2",
        ])
        .contains("HTTP/1.")
    }

    /// Another container's echo listener answers.
    fn reaches_container(&self, other: &Container, secs: u32) -> bool {
        self.tcp(other.ip, CONTAINER_PORT, "kici-ping\\n", secs)
            .contains("kici-ping")
    }
}

fn banner(addr: SocketAddrV4) -> String {
    format!("kici-egress-test {addr}\n")
}

/// The listeners of a lab: TCP services outside (both private addresses,
/// the public one) and on two host addresses, DNS on the outside ones.
struct Services {
    private: Service,
    allowlisted: Service,
    public: Service,
    host_gateway: Service,
    host_uplink: Service,
    dns_private: Service,
    dns_allowlisted: Service,
    dns_public: Service,
}

impl Services {
    fn start(o: &Outside) -> Self {
        let ns = Some(o.ns.as_str());
        Services {
            private: Service::tcp(ns, o.private),
            allowlisted: Service::tcp(ns, o.allowlisted),
            public: Service::tcp(ns, o.public),
            host_gateway: Service::tcp(None, GATEWAY),
            host_uplink: Service::tcp(None, o.host),
            dns_private: Service::dns(ns, o.private),
            dns_allowlisted: Service::dns(ns, o.allowlisted),
            dns_public: Service::dns(ns, o.public),
        }
    }
}

fn contexts() -> [(bool, String); 2] {
    [false, true].map(|on| (on, format!("bridge-nf-call-iptables={}", u8::from(on))))
}

/// The default policy: public destinations and the agent gateway open;
/// RFC 1918 addresses (TCP and UDP) and the host's own services closed.
#[test]
fn serial_container_egress_default_policy_blocks_private_addresses_and_the_host() {
    let outside = Outside::new();
    let bridge_nf = BridgeNf::save();
    let mut world = World::new();
    let lab = Lab::start(&mut world, &[("open", "")]);
    let s = Services::start(&outside);
    let c = lab.spawn("open");
    let (fast, slow) = (BLOCKED_AFTER_SECS, ALLOWED_WITHIN_SECS);
    for (on, ctx) in contexts() {
        bridge_nf.set(on);
        c.assert_allowed(&format!("{ctx}: public tcp"), || c.reaches(&s.public, slow));
        c.assert_allowed(&format!("{ctx}: public udp"), || {
            c.reaches_dns(&s.dns_public, slow)
        });
        c.assert_allowed(&format!("{ctx}: agent gateway"), || {
            c.reaches_gateway(lab.gateway_port, slow)
        });
        for (service, what) in [
            (&s.private, "RFC 1918 tcp"),
            (&s.allowlisted, "RFC 1918 tcp (another address)"),
            (&s.host_gateway, "host service on the gateway address"),
            (&s.host_uplink, "host service on another host address"),
        ] {
            c.assert_blocked(&format!("{ctx}: {what}"), &[service], || {
                c.reaches(service, fast)
            });
        }
        c.assert_blocked(&format!("{ctx}: RFC 1918 udp"), &[&s.dns_private], || {
            c.reaches_dns(&s.dns_private, fast)
        });
    }
    drop(s);
    lab.finish();
}

/// An allowlisted private address opens for that label set only (the rest
/// of RFC 1918 and the host stay closed); `denyAll` closes everything but
/// the agent gateway, allowlisted and public destinations included.
#[test]
fn serial_container_egress_allowlist_opens_one_address_and_deny_all_all_but_the_gateway() {
    let outside = Outside::new();
    let o = &outside;
    let bridge_nf = BridgeNf::save();
    let mut world = World::new();
    let allow = format!(
        "        networkPolicy:\n          allowlist: [{}/32]\n",
        o.allowlisted
    );
    let sealed = format!(
        "        networkPolicy:\n          allowlist: [{}/32, {}/32]\n          denyAll: true\n",
        o.allowlisted, o.public
    );
    let lab = Lab::start(&mut world, &[("allow", &allow), ("sealed", &sealed)]);
    let s = Services::start(o);
    let a = lab.spawn("allow");
    let z = lab.spawn("sealed");
    let (fast, slow) = (BLOCKED_AFTER_SECS, ALLOWED_WITHIN_SECS);
    for (on, ctx) in contexts() {
        bridge_nf.set(on);
        a.assert_allowed(&format!("{ctx}: allowlisted tcp"), || {
            a.reaches(&s.allowlisted, slow)
        });
        a.assert_allowed(&format!("{ctx}: allowlisted udp"), || {
            a.reaches_dns(&s.dns_allowlisted, slow)
        });
        a.assert_allowed(&format!("{ctx}: public tcp"), || a.reaches(&s.public, slow));
        for (service, what) in [
            (&s.private, "allowlist: the rest of RFC 1918, tcp"),
            (&s.host_gateway, "allowlist: host service"),
        ] {
            a.assert_blocked(&format!("{ctx}: {what}"), &[service], || {
                a.reaches(service, fast)
            });
        }
        a.assert_blocked(
            &format!("{ctx}: allowlist: the rest of RFC 1918, udp"),
            &[&s.dns_private],
            || a.reaches_dns(&s.dns_private, fast),
        );

        z.assert_allowed(&format!("{ctx}: denyAll: agent gateway"), || {
            z.reaches_gateway(lab.gateway_port, slow)
        });
        for (service, what) in [
            (&s.public, "public, allowlisted, tcp"),
            (&s.allowlisted, "private, allowlisted, tcp"),
            (&s.private, "private, tcp"),
            (&s.host_gateway, "host service on the gateway address"),
            (&s.host_uplink, "host service on another host address"),
        ] {
            z.assert_blocked(&format!("{ctx}: denyAll: {what}"), &[service], || {
                z.reaches(service, fast)
            });
        }
        for (service, what) in [
            (&s.dns_public, "public, allowlisted, udp"),
            (&s.dns_allowlisted, "private, allowlisted, udp"),
            (&s.dns_private, "private, udp"),
        ] {
            z.assert_blocked(&format!("{ctx}: denyAll: {what}"), &[service], || {
                z.reaches_dns(service, fast)
            });
        }
    }
    drop(s);
    lab.finish();
}

/// Containers never reach each other, also when one's allowlist covers the
/// whole agent subnet: both ways, bridged (bridge-nf 0: the bridge family
/// only) and through iptables (1: where dockerd's `enable_icc=false` drop
/// would also apply, but ours must come first).
#[test]
fn serial_container_egress_containers_cannot_reach_each_other() {
    let outside = Outside::new();
    let bridge_nf = BridgeNf::save();
    let mut world = World::new();
    let wide = "        networkPolicy:\n          allowlist: [172.16.0.0/12]\n";
    let lab = Lab::start(&mut world, &[("open", ""), ("wide", wide)]);
    let s = Services::start(&outside);
    let a = lab.spawn("wide");
    let b = lab.spawn("open");
    for (on, ctx) in contexts() {
        bridge_nf.set(on);
        // Each listener answers from the host (so the flows below have
        // somewhere to go), and A still reaches the outside.
        for c in [&a, &b] {
            let mut conn = std::net::TcpStream::connect((c.ip, CONTAINER_PORT)).unwrap();
            conn.write_all(b"kici-host\n").unwrap();
            conn.shutdown(std::net::Shutdown::Write).unwrap();
            let mut echo = String::new();
            std::io::Read::read_to_string(&mut conn, &mut echo).unwrap();
            assert_eq!(echo, "kici-host\n", "{ctx}: {}'s listener", c.name);
        }
        a.assert_allowed(&format!("{ctx}: A to the public address"), || {
            a.reaches(&s.public, ALLOWED_WITHIN_SECS)
        });
        a.assert_blocked(&format!("{ctx}: A (allowlist 172.16/12) to B"), &[], || {
            a.reaches_container(&b, BLOCKED_AFTER_SECS)
        });
        b.assert_blocked(&format!("{ctx}: B to A"), &[], || {
            b.reaches_container(&a, BLOCKED_AFTER_SECS)
        });
    }
    drop(s);
    lab.finish();
}
