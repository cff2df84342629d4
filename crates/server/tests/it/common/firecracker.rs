//! The real daemon's Firecracker scaler run on crates/testkit: the
//! spec-enforcing `fc-sim` behind the faithful `fake-jailer` (real chroot,
//! new PID namespace, uid drop), whose simulated guest `/init` reads MMDS
//! V2; a bridge of the test's own made by `kici-scaler firecracker
//! provision`; the real SQLite store; and the guest side of a VM as a
//! network namespace on the VM's real TAP ([`GuestNet`]) running the real
//! static `kici-agent-lite --bootstrap mmds` — what `kici-guest-init` does
//! in a real guest (same MMDS V2 client, then the agent). Both the static
//! simulator and the static agent are built here when missing (in the
//! testkit's nested target directory, so the build never waits on the lock
//! of the `cargo test` running the caller).
//!
//! Why the agent is not the simulator's own guest agent
//! (`GuestSetup::agent`): the simulator runs that process in the host's
//! network namespace, so its traffic never crosses the VM's TAP, bridge
//! port and rules; its connection to the gateway address is host-local,
//! with the gateway itself (an address of the agents' subnet) as source,
//! which the instance's input-hook subnet drop discards. A real guest's
//! packets come through the TAP with the VM's address, and so do these.

use super::daemon::{
    agents_with_rules, remove_instance_rules, rows, tool, wait_until, Daemon, Dir,
};
use kici_model::InstanceId;
use kici_testkit::fc::{GuestSetup, Kit, SimClient, SimState, MUSL_TARGET};
use kici_testkit::guestnet::{GuestNet, GuestNetConfig};
use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

/// Firecracker failpoints whose daemon crash test is in
/// `firecracker_testkit_e2e.rs` (they are reached only once a real guest
/// agent acknowledged its configuration, which needs the testkit's guest).
pub const CRASHED_IN_TESTKIT_E2E: &[&str] = &["kici_firecracker::mmds::clear"];

/// MMDS after the daemon cleared it: the contract's keys are all gone.
pub fn cleared_mmds() -> serde_json::Value {
    serde_json::json!({"latest": {"meta-data": {}}})
}

/// The testkit's nested target directory (as `kici_testkit::fc` picks it).
fn static_target_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(kici_testkit::fc::TARGET_DIR_ENV) {
        return PathBuf::from(d);
    }
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"))
        .join("kici-testkit-static")
}

/// The static (musl) `kici-agent-lite` — what `scripts/build-agent-musl.sh`
/// builds, in a debug build — built once per test process.
pub fn static_agent() -> PathBuf {
    static AGENT: OnceLock<PathBuf> = OnceLock::new();
    AGENT
        .get_or_init(|| {
            let target = static_target_dir();
            let out = Command::new(env!("CARGO"))
                .args([
                    "build",
                    "--quiet",
                    "-p",
                    "kici-agent-lite",
                    "--bin",
                    "kici-agent-lite",
                    "--target",
                    MUSL_TARGET,
                ])
                .env("CARGO_TARGET_DIR", &target)
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .stdin(Stdio::null())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "cannot build the static kici-agent-lite: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let agent = target.join(MUSL_TARGET).join("debug/kici-agent-lite");
            assert!(agent.is_file(), "no {}", agent.display());
            agent
        })
        .clone()
}

/// One test's world: the testkit kit (jailer, simulator, guest agent), a
/// kernel and rootfs file, a provisioned bridge of its own, the agent
/// gateway on a port fixed for the world (a restarted daemon must listen
/// where its VMs' agents reconnect). On drop every VMM it started is
/// killed, the instance's rules table and the host setup torn down.
pub struct TestkitWorld {
    pub dir: Dir,
    pub kit: Kit,
    pub subnet: String,
    pub bridge: String,
    pub gateway: Ipv4Addr,
    pub gateway_port: u16,
}

impl TestkitWorld {
    /// A world whose bridge and forwarding `kici-scaler firecracker
    /// provision` made.
    pub fn new() -> Self {
        let world = Self::unprovisioned();
        let out = world.firecracker("provision");
        assert!(out.status.success(), "provision: {out:?}");
        world
    }

    /// A world whose host network nobody provisioned yet (its drop tears
    /// down whatever a daemon provisioned).
    pub fn unprovisioned() -> Self {
        let paths = kici_testkit::fc::build_binaries().unwrap();
        static_agent();
        let dir = Dir::with_config("");
        let kit = paths.kit(&dir.path("bin")).unwrap();
        // The simulated `/init` reads MMDS and then idles: the agent runs
        // in the guest namespace (see the module's doc).
        kit.set_guest(&GuestSetup::default()).unwrap();
        // Where the fake jailer would make cgroups (none are configured:
        // the daemon's scalers have no jailer cgroup settings).
        kit.set_cgroup_root(&dir.path("cgroup")).unwrap();
        std::fs::write(dir.path("vmlinux"), b"kernel image").unwrap();
        std::fs::write(dir.path("rootfs.ext4"), b"rootfs image").unwrap();
        let r = rand::random::<u32>();
        let (second, third) = (150 + (r % 40) as u8, (r >> 8) as u8);
        let subnet = format!("10.{second}.{third}.0/24");
        let gateway = Ipv4Addr::new(10, second, third, 1);
        let bridge = format!("kft{r:08x}");
        write_scalers(&dir, &subnet, &bridge, &kit.firecracker, &kit.jailer);
        TestkitWorld {
            dir,
            kit,
            subnet,
            bridge,
            gateway,
            gateway_port: free_port(),
        }
    }

    pub fn firecracker(&self, action: &str) -> std::process::Output {
        self.dir
            .command(&["firecracker", action, "--config"])
            .arg(self.dir.path("scalers.yaml"))
            .output()
            .unwrap()
    }

    /// `serve` arguments: the gateway on this world's port, then `args`.
    pub fn serve_args(&self, args: &[&str]) -> Vec<String> {
        let mut v = vec![
            "--gateway-listen".to_owned(),
            format!("127.0.0.1:{}", self.gateway_port),
        ];
        v.extend(args.iter().map(|a| (*a).to_owned()));
        v
    }

    /// Starts the daemon (see [`Self::serve_args`]) with `env`.
    pub fn start(
        &self,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Daemon, std::process::ExitStatus> {
        let args = self.serve_args(args);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Daemon::try_start(&self.dir, &args, env)
    }

    pub fn chroot_base(&self) -> PathBuf {
        self.dir.path("jail")
    }

    /// `<chroot base>/firecracker/<agent>`.
    pub fn vm_dir(&self, agent: &str) -> PathBuf {
        self.chroot_base().join("firecracker").join(agent)
    }

    /// The simulator of `agent`'s VM.
    pub fn sim(&self, agent: &str) -> SimClient {
        SimClient::new(self.kit.api_socket(&self.chroot_base(), agent))
    }

    /// Its introspection state.
    pub fn sim_state(&self, agent: &str) -> SimState {
        self.sim(agent)
            .state()
            .unwrap_or_else(|e| panic!("{agent}: simulator state: {e}"))
    }

    /// Waits until `agent`'s VM runs and its simulated `/init` read the
    /// MMDS bootstrap; the simulator's state then.
    pub fn wait_booted(&self, agent: &str) -> SimState {
        let sim = self.sim(agent);
        let mut last = None;
        wait_until(&format!("{agent}'s guest read its MMDS bootstrap"), || {
            last = sim.state().ok();
            last.as_ref().is_some_and(|st| {
                st.vm_state() == "Running" && st.guest_phase() == "idle-without-agent"
            })
        });
        last.unwrap()
    }

    /// `agent`'s guest: a network namespace on its real TAP (its MAC and
    /// address as the backend configured them, `st` being its simulator's
    /// state after boot), running nothing yet.
    pub fn guest_net(&self, agent: &str, st: &SimState) -> GuestNet {
        let iface = &st.0["network_interfaces"][0];
        let cmdline = st.0["boot_source"]["boot_args"].as_str().unwrap();
        // `ip=<client>::<gateway>:<netmask>::eth0:off`
        let ip = cmdline
            .split_whitespace()
            .find_map(|a| a.strip_prefix("ip="))
            .and_then(|v| v.split(':').next())
            .unwrap()
            .parse()
            .unwrap();
        GuestNet::attach(
            &self.kit.guest_link(&self.chroot_base(), agent),
            &GuestNetConfig {
                netns: format!("kici-e2e-{}", &agent[agent.len() - 8..]),
                iface_id: iface["iface_id"].as_str().unwrap().to_owned(),
                mac: iface["guest_mac"].as_str().unwrap().to_owned(),
                ip,
                prefix_len: 24,
                gateway: Some(self.gateway),
                mmds_address: "169.254.169.254".parse().unwrap(),
            },
        )
        .unwrap()
    }

    /// Boots `agent`'s guest side: its namespace, and in it the static
    /// `kici-agent-lite --bootstrap mmds` (its log in `<dir>/<agent>.log`).
    pub fn guest(&self, agent: &str) -> Guest {
        let st = self.wait_booted(agent);
        let net = self.guest_net(agent, &st);
        let log = self.dir.path(&format!("{agent}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let child = net
            .command(static_agent().to_str().unwrap())
            .args(["--bootstrap", "mmds"])
            // Nothing of the test's environment (the agent refuses unknown
            // KICI_* variables; a guest has none of the host's).
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Guest {
            agent: Some(child),
            net: Some(net),
            log,
        }
    }

    /// The pid of `agent`'s VMM (the jailer's pid file).
    pub fn vmm_pid(&self, agent: &str) -> Option<i32> {
        std::fs::read_to_string(
            kici_testkit::fc::jail_root(&self.chroot_base(), agent).join("firecracker.pid"),
        )
        .ok()?
        .trim()
        .parse()
        .ok()
    }

    /// VM directories under the chroot base.
    pub fn vm_dirs(&self) -> BTreeSet<String> {
        std::fs::read_dir(self.chroot_base().join("firecracker"))
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every directory under the jailer's cgroup root.
    pub fn cgroups(&self) -> Vec<PathBuf> {
        let mut found = Vec::new();
        let mut stack = vec![self.dir.path("cgroup")];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    found.push(e.path());
                    stack.push(e.path());
                }
            }
        }
        found
    }

    /// Asserts that nothing of the instance is left: no VM directory (chroot,
    /// overlay), VMM, TAP, rule, lease, agent row or jailer cgroup.
    pub fn assert_nothing_left(&self, context: &str, vmm_pids: &[i32]) {
        let instance: InstanceId = self.dir.instance().parse().unwrap();
        assert_eq!(self.vm_dirs(), BTreeSet::new(), "{context}: VM directories");
        for pid in vmm_pids {
            assert!(!process_running(*pid), "{context}: VMM {pid} still runs");
        }
        assert_eq!(
            agents_with_taps(instance),
            BTreeSet::new(),
            "{context}: TAPs"
        );
        assert_eq!(
            agents_with_rules(instance),
            BTreeSet::new(),
            "{context}: nftables rules"
        );
        let r = rows(&self.dir.sqlite_url(), &self.dir.instance());
        assert!(r.leases.is_empty(), "{context}: leases {:?}", r.leases);
        assert!(r.agents.is_empty(), "{context}: agent rows {:?}", r.agents);
        assert_eq!(self.cgroups(), Vec::<PathBuf>::new(), "{context}: cgroups");
    }
}

impl Default for TestkitWorld {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestkitWorld {
    fn drop(&mut self) {
        // A VMM is its PID namespace's init: killing it ends its guest agent.
        for agent in self.vm_dirs() {
            if let Some(pid) = self.vmm_pid(&agent) {
                let _ = tool("kill", &["-9", &pid.to_string()]);
            }
        }
        // TAPs persist: a failed test's daemon (killed) left its own.
        let instance = std::fs::read_to_string(self.dir.path("state/instance-id"));
        if let Some(instance) = instance
            .ok()
            .and_then(|i| i.trim().parse::<InstanceId>().ok())
        {
            let links: serde_json::Value =
                serde_json::from_str(&tool("ip", &["-j", "link", "show"])).unwrap_or_default();
            let tag = format!("kici-scaler:{instance}:");
            for link in links.as_array().into_iter().flatten() {
                if link["ifalias"]
                    .as_str()
                    .is_some_and(|a| a.starts_with(&tag))
                {
                    if let Some(name) = link["ifname"].as_str() {
                        let _ = tool("ip", &["link", "del", name]);
                    }
                }
            }
        }
        // A daemon leaves its instance's subnet rules for its successor;
        // no successor comes for a test's instance.
        if let Ok(instance) = std::fs::read_to_string(self.dir.path("state/instance-id")) {
            if let Ok(instance) = instance.trim().parse::<InstanceId>() {
                remove_instance_rules(
                    instance,
                    &self.subnet,
                    &self.bridge,
                    kici_netpolicy::DockerUserMode::Leave,
                );
            }
        }
        let _ = self.firecracker("teardown");
    }
}

/// A VM's guest side: its network namespace and the agent running there.
/// Dropping it stops the agent (a real agent dies with its VM) and deletes
/// the namespace.
pub struct Guest {
    agent: Option<Child>,
    pub net: Option<GuestNet>,
    pub log: PathBuf,
}

impl Guest {
    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the agent still runs.
    pub fn agent_running(&mut self) -> bool {
        self.agent
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// One HTTP/1.0 request from inside the namespace (a thread of ours
    /// moved into it); `(status, body)`, `(0, "")` when nothing answers.
    pub fn http(
        &self,
        addr: &str,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> (u16, String) {
        let netns = self.net.as_ref().unwrap().netns();
        let ns = std::fs::File::open(format!("/run/netns/{netns}")).unwrap();
        let (addr, method, path) = (addr.to_owned(), method.to_owned(), path.to_owned());
        // Firecracker's MMDS keeps a connection open unless told otherwise
        // (whatever the HTTP version).
        let headers: Vec<(String, String)> = headers
            .iter()
            .chain(&[("Connection", "close")])
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        std::thread::spawn(move || {
            use std::os::fd::AsFd;
            rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .unwrap();
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            super::daemon::http(&addr, &method, &path, &headers, None)
        })
        .join()
        .unwrap()
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut child) = self.agent.take() {
            // `ip netns exec` execs the agent: this is the agent's pid.
            let _ = child.kill();
            let _ = child.wait();
        }
        self.net.take();
    }
}

/// Packets counted by the gateway-port accept in `agent`'s input-hook
/// chain (`ag-<instance>-<agent>-in`): its traffic to the agent gateway
/// crossed kici-scaler's own rule for it.
pub fn gateway_port_hits(instance: InstanceId, agent: &str, port: u16) -> u64 {
    let chain = format!("ag-{instance}-{agent}-in");
    let ruleset: serde_json::Value =
        serde_json::from_str(&tool("nft", &["-j", "list", "ruleset"])).unwrap_or_default();
    ruleset["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item.get("rule"))
        .filter(|rule| rule["family"] == "inet" && rule["chain"] == chain.as_str())
        .filter_map(|rule| rule["expr"].as_array())
        .filter(|expr| {
            expr.iter().any(|e| {
                e["match"]["left"]["payload"]["field"] == "dport"
                    && e["match"]["right"] == u64::from(port)
            })
        })
        .flat_map(|expr| expr.iter().filter_map(|e| e["counter"]["packets"].as_u64()))
        .sum()
}

/// A port free on loopback now (the kernel's pick, released at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Alive and not a zombie.
pub fn process_running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace()
                .next()
                .map(|st| st != "Z" && st != "X")
        })
        .unwrap_or(false)
}

/// Agents of `instance` with a TAP (its ifalias is the owner tag
/// `kici-scaler:<instance>:<agent>`).
pub fn agents_with_taps(instance: InstanceId) -> BTreeSet<String> {
    let links: serde_json::Value =
        serde_json::from_str(&tool("ip", &["-j", "link", "show"])).unwrap_or_default();
    let tag = format!("kici-scaler:{instance}:");
    links
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["ifalias"].as_str()?.strip_prefix(&tag).map(str::to_owned))
        .collect()
}

/// After restart and reconcile: VM directories, TAPs, leases and rows are
/// exactly the live agents', each once; rules belong to live agents only.
pub fn assert_consistent(d: &mut Daemon, world: &TestkitWorld, context: &str) {
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    d.settle(context);
    let (_, body) = d.http("GET", "/v1/agents", None);
    let listed: Vec<String> = serde_json::from_str::<serde_json::Value>(&body).unwrap()["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["agentId"].as_str().unwrap().to_owned())
        .collect();
    let live: BTreeSet<String> = listed.iter().cloned().collect();
    assert_eq!(listed.len(), live.len(), "{context}: agents listed twice");
    assert_eq!(world.vm_dirs(), live, "{context}: VM directories");
    assert_eq!(agents_with_taps(instance), live, "{context}: TAPs");
    let r = rows(&world.dir.sqlite_url(), &world.dir.instance());
    let recorded: Vec<String> = r.agents.iter().map(|a| a.agent_id.to_string()).collect();
    assert_eq!(recorded.len(), live.len(), "{context}: one row per agent");
    assert_eq!(
        recorded.into_iter().collect::<BTreeSet<_>>(),
        live,
        "{context}: rows"
    );
    let leased: Vec<String> = r.leases.iter().map(|l| l.agent.to_string()).collect();
    assert_eq!(leased.len(), live.len(), "{context}: one lease per agent");
    assert_eq!(
        leased.into_iter().collect::<BTreeSet<_>>(),
        live,
        "{context}: leases"
    );
    let ruled = agents_with_rules(instance);
    assert!(
        ruled.is_subset(&live),
        "{context}: rules of agents that are gone: {:?}",
        ruled.difference(&live).collect::<Vec<_>>()
    );
}

/// `scalers.yaml` in `dir`: one Firecracker scaler on `subnet` and
/// `bridge`, with `dir`'s `vmlinux`, `rootfs.ext4` and `jail/`.
pub fn write_scalers(dir: &Dir, subnet: &str, bridge: &str, firecracker: &Path, jailer: &Path) {
    let yaml = format!(
        "version: 1
firecracker:
  cidr: {subnet}
  bridgeName: {bridge}
scalers:
  - name: vm
    type: firecracker
    maxAgents: 4
    firecrackerPath: {fc}
    jailerPath: {jailer}
    kernelPath: {kernel}
    chrootBaseDir: {base}
    uid: 10000
    gid: 10000
    labelSets:
      - labels: [linux, vm]
        rootfsPath: {rootfs}
        overlayDriveSizeMib: 16
",
        fc = firecracker.display(),
        jailer = jailer.display(),
        kernel = dir.path("vmlinux").display(),
        base = dir.path("jail").display(),
        rootfs = dir.path("rootfs.ext4").display(),
    );
    std::fs::write(dir.path("scalers.yaml"), yaml).unwrap();
}
