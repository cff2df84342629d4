//! The harness of the end-to-end tests: a fake jailer and Firecracker
//! stand-in (until crates/testkit's simulator is wired in), a real bridge
//! with a unique name, a unique instance id, an in-test allocator and a
//! recording egress seam. Everything is removed on drop, even after a
//! failed assertion.
#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use async_trait::async_trait;
use ipnet::Ipv4Net;
use kici_engine::{BackendReport, Mode, SpawnSpec};
use kici_firecracker::tap::Netlink;
use kici_firecracker::{FirecrackerBackend, FirecrackerOptions, HostNetwork};
use kici_model::{
    AgentId, EffectiveResources, FirecrackerNetwork, InstanceId, NetworkPolicy, ScalerEntry,
    ScalerType,
};
use kici_netpolicy::{EgressRules, EgressTarget, NetPolicyError};
use kici_store::ipam::{AllocError, IpAllocator, Ipv4Pool, Lease};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Leases in memory, unique per (network, ip), owned by one instance.
pub struct MemoryAllocator {
    pub owner: InstanceId,
    pub leases: Mutex<Vec<Lease>>,
}

#[async_trait]
impl IpAllocator for MemoryAllocator {
    async fn allocate(&self, pool: &Ipv4Pool, agent: &AgentId) -> Result<Lease, AllocError> {
        let mut leases = self.leases.lock();
        if let Some(l) = leases
            .iter()
            .find(|l| l.agent == *agent && l.network == pool.network())
        {
            return Ok(l.clone());
        }
        let ip = pool
            .assignable()
            .find(|ip| {
                !leases
                    .iter()
                    .any(|l| l.ip == *ip && l.network == pool.network())
            })
            .ok_or(AllocError::Exhausted {
                network: pool.network(),
                capacity: pool.capacity(),
            })?;
        let lease = Lease {
            network: pool.network(),
            ip,
            agent: *agent,
            owner: self.owner,
        };
        leases.push(lease.clone());
        Ok(lease)
    }

    async fn release_agent(&self, agent: &AgentId) -> Result<u64, AllocError> {
        let mut leases = self.leases.lock();
        let before = leases.len();
        leases.retain(|l| l.agent != *agent);
        Ok((before - leases.len()) as u64)
    }

    async fn release_ip(&self, network: Ipv4Net, ip: Ipv4Addr) -> Result<bool, AllocError> {
        let mut leases = self.leases.lock();
        let before = leases.len();
        leases.retain(|l| !(l.network == network && l.ip == ip));
        Ok(before != leases.len())
    }

    async fn leases(&self) -> Result<Vec<Lease>, AllocError> {
        Ok(self.leases.lock().clone())
    }
}

/// What a VM's rules were installed for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmMatch {
    pub ip: Ipv4Addr,
    pub mac: [u8; 6],
    pub tap: String,
}

/// Records which agents have rules installed, and passes every call on to
/// real rules once [`RecordingEgress::forward_to`] gave it some.
#[derive(Default)]
pub struct RecordingEgress {
    pub installed: Mutex<HashMap<AgentId, (VmMatch, Option<NetworkPolicy>)>>,
    pub removed: Mutex<Vec<AgentId>>,
    pub real: Mutex<Option<Arc<dyn EgressRules>>>,
}

impl RecordingEgress {
    /// From now on, every call also goes to `real` (its errors are returned).
    pub fn forward_to(&self, real: Arc<dyn EgressRules>) {
        *self.real.lock() = Some(real);
    }

    fn real(&self) -> Option<Arc<dyn EgressRules>> {
        self.real.lock().clone()
    }
}

#[async_trait]
impl EgressRules for RecordingEgress {
    async fn install(
        &self,
        target: &EgressTarget,
        policy: Option<&NetworkPolicy>,
    ) -> Result<(), NetPolicyError> {
        if let Some(real) = self.real() {
            real.install(target, policy).await?;
        }
        let vm = VmMatch {
            ip: target.ip,
            mac: target.mac,
            tap: target.port.clone().unwrap_or_default(),
        };
        self.installed
            .lock()
            .insert(target.agent, (vm, policy.cloned()));
        Ok(())
    }

    async fn remove(&self, agent: &AgentId) -> Result<(), NetPolicyError> {
        if let Some(real) = self.real() {
            real.remove(agent).await?;
        }
        self.installed.lock().remove(agent);
        self.removed.lock().push(*agent);
        Ok(())
    }

    async fn sweep_stale(&self, live: &[AgentId]) -> Result<Vec<AgentId>, NetPolicyError> {
        let real = match self.real() {
            Some(real) => Some(real.sweep_stale(live).await?),
            None => None,
        };
        let mut installed = self.installed.lock();
        let stale: Vec<AgentId> = installed
            .keys()
            .filter(|a| !live.contains(a))
            .copied()
            .collect();
        installed.retain(|a, _| live.contains(a));
        Ok(real.unwrap_or(stale))
    }
}

pub struct Harness {
    pub dir: tempfile::TempDir,
    pub instance: InstanceId,
    pub network: FirecrackerNetwork,
    pub allocator: Arc<MemoryAllocator>,
    pub egress: Arc<RecordingEgress>,
    pub backend: FirecrackerBackend,
    pub scaler: Arc<ScalerEntry>,
    pub pids: PathBuf,
    pub chroot_base: PathBuf,
}

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    u32::from_le_bytes(b)
}

pub fn random_agent() -> AgentId {
    AgentId::new(ScalerType::Firecracker, random_u32().to_le_bytes())
}

/// Which jailer and Firecracker the harness runs.
pub enum Binaries {
    /// The small stand-ins in `tests/support` (Python VMM, shell jailer).
    StandIn,
    /// crates/testkit's spec-enforcing `fc-sim` and its faithful
    /// `fake-jailer` (real chroot, PID namespace, uid drop).
    Testkit(kici_testkit::fc::GuestSetup),
    /// Real binaries and images (`KICI_SCALER_TEST_FIRECRACKER`).
    Real(RealFirecracker),
}

/// `KICI_SCALER_TEST_FIRECRACKER=firecracker=<path>,jailer=<path>,kernel=<path>,rootfs=<path>`.
#[derive(Debug, Clone)]
pub struct RealFirecracker {
    pub firecracker: PathBuf,
    pub jailer: PathBuf,
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
}

impl RealFirecracker {
    pub const ENV: &'static str = "KICI_SCALER_TEST_FIRECRACKER";

    pub fn from_env() -> Option<Self> {
        let spec = std::env::var(Self::ENV).ok()?;
        let mut map = HashMap::new();
        for part in spec.split(',') {
            let (k, v) = part.split_once('=')?;
            map.insert(k.trim().to_owned(), PathBuf::from(v.trim()));
        }
        Some(Self {
            firecracker: map.remove("firecracker")?,
            jailer: map.remove("jailer")?,
            kernel: map.remove("kernel")?,
            rootfs: map.remove("rootfs")?,
        })
    }
}

impl Harness {
    /// `label_set_yaml` is appended under the label set (indented 8); it may
    /// add label sets of its own (`      - labels: …`), `@ROOTFS@` standing
    /// for the rootfs image path.
    pub async fn new(label_set_yaml: &str) -> Self {
        Self::with(label_set_yaml, Binaries::StandIn).await
    }

    pub async fn with(label_set_yaml: &str, binaries: Binaries) -> Self {
        Self::with_cgroups(label_set_yaml, binaries, |_| None).await
    }

    /// `cgroups` gets the harness directory (the testkit jailer creates
    /// its cgroups under `<dir>/cgroup`).
    pub async fn with_cgroups(
        label_set_yaml: &str,
        binaries: Binaries,
        cgroups: impl FnOnce(&Path) -> Option<kici_firecracker::JailerCgroups>,
    ) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("kfc")
            .tempdir_in("/tmp")
            .unwrap();
        let instance: InstanceId = format!("{:08x}", random_u32()).parse().unwrap();
        let r = random_u32();
        let third = (r >> 8) as u8;
        let second = 200 + (r % 50) as u8;
        let network = FirecrackerNetwork {
            cidr: Ipv4Net::new(Ipv4Addr::new(10, second, third, 0), 24).unwrap(),
            bridge_name: format!("kfb{r:08x}"),
            gateway: Ipv4Addr::new(10, second, third, 1),
            netmask: Ipv4Addr::new(255, 255, 255, 0),
            table: "kici".into(),
            auto_provision_host: true,
        };
        HostNetwork { network: &network }.provision().await.unwrap();

        let bin = dir.path().join("bin");
        let pids = dir.path().join("pids");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&pids).unwrap();
        let kernel = dir.path().join("vmlinux");
        let rootfs = dir.path().join("rootfs.ext4");
        std::fs::write(&kernel, b"kernel image").unwrap();
        std::fs::write(&rootfs, b"rootfs image").unwrap();
        let (firecracker, jailer, kernel, rootfs) = match binaries {
            Binaries::StandIn => {
                let firecracker = bin.join("firecracker");
                std::fs::write(&firecracker, include_str!("fake_firecracker.py")).unwrap();
                let jailer = bin.join("jailer");
                std::fs::write(
                    &jailer,
                    include_str!("fake_jailer.sh").replace("@PIDS@", pids.to_str().unwrap()),
                )
                .unwrap();
                use std::os::unix::fs::PermissionsExt;
                for f in [&firecracker, &jailer] {
                    std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755)).unwrap();
                }
                (firecracker, jailer, kernel, rootfs)
            }
            Binaries::Real(real) => (real.firecracker, real.jailer, real.kernel, real.rootfs),
            Binaries::Testkit(guest) => {
                let paths = kici_testkit::fc::build_binaries().unwrap();
                let kit = paths.kit(&bin).unwrap();
                let mut guest = guest;
                if guest.agent.is_none() {
                    guest.agent = Some(paths.testkit_agent.clone());
                }
                kit.set_guest(&guest).unwrap();
                kit.set_cgroup_root(&dir.path().join("cgroup")).unwrap();
                (kit.firecracker.clone(), kit.jailer.clone(), kernel, rootfs)
            }
        };
        let chroot_base = dir.path().join("jail");
        let yaml = format!(
            r#"
version: 1
scalers:
  - name: test-fc
    type: firecracker
    maxAgents: 50
    firecrackerPath: {fc}
    jailerPath: {jailer}
    kernelPath: {kernel}
    chrootBaseDir: {base}
    uid: 10000
    gid: 10000
    labelSets:
      - labels: [linux, firecracker]
        rootfsPath: {rootfs}
        overlayDriveSizeMib: 16
{extra}
"#,
            fc = firecracker.display(),
            jailer = jailer.display(),
            kernel = kernel.display(),
            base = chroot_base.display(),
            rootfs = rootfs.display(),
            extra = label_set_yaml.replace("@ROOTFS@", &rootfs.display().to_string()),
        );
        let loaded = kici_config::load_documents(&[("scalers.yaml", &yaml)])
            .unwrap_or_else(|e| panic!("{e}"));
        let scaler = Arc::new(loaded.config.scaler("test-fc").unwrap().clone());

        let allocator = Arc::new(MemoryAllocator {
            owner: instance,
            leases: Mutex::new(Vec::new()),
        });
        let egress = Arc::new(RecordingEgress::default());
        let mut options = FirecrackerOptions::new(
            instance,
            network.clone(),
            allocator.clone(),
            egress.clone(),
            vec![(
                "KICI_AGENT_ENV_HTTP_PROXY".into(),
                "http://proxy:3128".into(),
            )],
        );
        options.sweep_min_age = std::time::Duration::from_secs(60);
        options.cgroups = cgroups(dir.path());
        let backend = FirecrackerBackend::new(options).unwrap();
        Self {
            dir,
            instance,
            network,
            allocator,
            egress,
            backend,
            scaler,
            pids,
            chroot_base,
        }
    }

    pub fn spec(&self, agent: AgentId) -> (SpawnSpec, mpsc::UnboundedReceiver<BackendReport>) {
        self.spec_in(agent, 0)
    }

    /// A spawn spec for label set `index` of the scaler.
    pub fn spec_in(
        &self,
        agent: AgentId,
        index: usize,
    ) -> (SpawnSpec, mpsc::UnboundedReceiver<BackendReport>) {
        let (reports, rx) = mpsc::unbounded_channel();
        let label_set = self.scaler.label_sets[index].clone();
        let mut agent_labels = label_set.raw_labels.clone();
        agent_labels.push("kici:agent:firecracker".into());
        agent_labels.push(format!("kici:scaler:{}", self.scaler.name));
        let spec = SpawnSpec {
            agent,
            scaler: self.scaler.clone(),
            label_set_index: index,
            label_set,
            agent_labels,
            resources: EffectiveResources::default(),
            job: None,
            run_id: None,
            mode: Mode::Standalone,
            warm: false,
            idle_timeout_ms: None,
            orchestrator_url: format!("ws://{}:7879/ws", self.network.gateway),
            token: Some(kici_model::Secret::new("kat_test_token")),
            reports,
        };
        (spec, rx)
    }

    pub fn layout(&self) -> kici_firecracker::names::JailLayout {
        kici_firecracker::names::JailLayout::new(&self.chroot_base, "firecracker".into()).unwrap()
    }

    pub fn vm_dir(&self, agent: &AgentId) -> PathBuf {
        self.chroot_base.join("firecracker").join(agent.to_string())
    }

    pub fn root(&self, agent: &AgentId) -> PathBuf {
        self.vm_dir(agent).join("root")
    }

    /// The API calls the stand-in received, as `METHOD path`.
    pub fn api_calls(&self, agent: &AgentId) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.root(agent).join("api-calls.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    pub fn serial(&self, agent: &AgentId) -> String {
        std::fs::read_to_string(self.root(agent).join("serial-console.log")).unwrap_or_default()
    }

    /// The pid the VMM of `agent` had (recorded by the stand-in jailer, or
    /// by [`Self::remember`] from a spawn's handle).
    pub fn vmm_pid(&self, agent: &AgentId) -> Option<i32> {
        std::fs::read_to_string(self.pids.join(agent.to_string()))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Records the VMM pid of a spawn's handle (`pid:<pid>:<start>`).
    pub fn remember(&self, agent: &AgentId, handle: &kici_engine::ResourceHandle) {
        if let Some(pid) = handle.extra.get("vmm").and_then(|v| v.split(':').nth(1)) {
            std::fs::write(self.pids.join(agent.to_string()), pid).unwrap();
        }
    }

    pub async fn link_exists(&self, name: &str) -> bool {
        Netlink::connect()
            .unwrap()
            .get(name)
            .await
            .unwrap()
            .is_some()
    }

    /// Asserts that nothing of `agent` is left on the host.
    pub async fn assert_nothing_left(&self, agent: &AgentId) {
        let tap = kici_firecracker::names::tap_name(agent);
        assert!(!self.link_exists(&tap).await, "TAP {tap} left");
        assert!(!self.vm_dir(agent).exists(), "VM dir left");
        assert!(
            !self
                .allocator
                .leases
                .lock()
                .iter()
                .any(|l| l.agent == *agent),
            "lease left"
        );
        assert!(
            !self.egress.installed.lock().contains_key(agent),
            "rules left"
        );
        if let Some(pid) = self.vmm_pid(agent) {
            assert!(!process_running(pid), "Firecracker {pid} still runs");
        }
    }
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

impl Drop for Harness {
    fn drop(&mut self) {
        // Kill whatever a failed test left running, delete our TAPs and the
        // bridge; the temp dir goes with `dir`.
        if let Ok(entries) = std::fs::read_dir(&self.pids) {
            for e in entries.flatten() {
                if let Some(pid) = std::fs::read_to_string(e.path())
                    .ok()
                    .and_then(|s| s.trim().parse::<i32>().ok())
                {
                    if process_running(pid) {
                        let _ = std::process::Command::new("kill")
                            .args(["-9", &pid.to_string()])
                            .status();
                    }
                }
            }
        }
        let tag = format!("kici-scaler:{}:", self.instance);
        if let Ok(out) = std::process::Command::new("ip")
            .args(["-o", "link", "show"])
            .output()
        {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if line.contains(&tag) {
                    if let Some(name) = line.split(':').nth(1) {
                        let name = name.trim().split('@').next().unwrap_or("");
                        let _ = std::process::Command::new("ip")
                            .args(["link", "del", name])
                            .status();
                    }
                }
            }
        }
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.network.bridge_name])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

pub fn exists(path: &Path) -> bool {
    path.exists()
}
