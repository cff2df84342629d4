//! The Firecracker [`Backend`]: agents as jailed microVMs.
//!
//! Spawn, in order (each step's side effect recorded in `Taken`, so a
//! failure anywhere releases exactly what was taken, the running VMM
//! included — upstream left it running; docs/deviations.md,
//! D-fc-spawn-cleanup):
//!
//! 1. the VM directory with its owner marker (first, so every TAP and lease
//!    of ours has a dated marker the sweep can age);
//! 2. an IP lease; 3. the TAP (tun ioctls, jailer uid/gid), attached to the
//!    bridge as an isolated port with the owner tag as ifalias, up;
//! 4. the egress rules; 5. the jail root (images hard-linked, log files),
//!    6. the sparse ext4 overlay;
//! 7. the jailer (`--new-pid-ns`: it exits at once, leaving
//!    `<exec name>.pid`); Firecracker's pid + start time recorded, a pidfd
//!    watched, logs followed;
//! 8. the API socket (bounded wait); 9. boot source, drives, interface,
//!    machine config, logger, metrics, serial, MMDS V2 config; 10. the MMDS
//!    document; 11. `InstanceStart`.
//!
//! Every API call is bounded by the scaler's `apiCall` deadline, the socket
//! wait, jailer and mkfs by their own timeouts.

use crate::api::{
    ActionType, ApiClient, ApiError, LogLevel, Logger, Metrics, MmdsConfig, MmdsVersion,
    SerialDevice, TokenBucket,
};
use crate::chroot::{self, ChrootError, JailFiles};
use crate::jailer::{JailerArgs, JailerCgroups};
use crate::logs::{TailFrom, VmWatch, WatchSpec, SERIAL_SOURCE, VMM_SOURCE};
use crate::names::{self, JailLayout, LayoutError, METRICS_FILE, SERIAL_LOG, VMM_LOG};
use crate::tap::{self, LinkError, Netlink};
use crate::vmconfig::{
    self, GuestNet, MachineSize, DEFAULT_OVERLAY_MIB, GUEST_IFACE, MMDS_ADDRESS,
};
use crate::{fp, mmds};
use async_trait::async_trait;
use kici_engine::backend::ReportSender;
use kici_engine::{
    Adoption, Backend, BackendError, BackendErrorKind, OwnedResource, ResourceHandle,
    ScalerProblems, SpawnSpec,
};
use kici_host::env::{agent_env, ForwardedEnv, ForwardedEnvError, SystemEnv};
use kici_host::logs::LogContext;
use kici_host::process::ProcessIdentity;
use kici_model::{
    AgentId, BackendSettings, FirecrackerNetwork, FirecrackerSettings, InstanceId, LabelSetBackend,
    ScalerEntry, ScalerType,
};
use kici_netpolicy::{EgressRules, EgressTarget, NetPolicyError};
use kici_store::ipam::{AllocError, IpAllocator, Ipv4Pool, MacAddress, PoolError};
use parking_lot::Mutex;
use rustix::process::{Pid, Signal};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// The file beside the owner marker recording Firecracker's
/// `pid:<pid>:<start time>`, so a later daemon (or a destroy without
/// handle) can tell it from a process that reused the pid.
pub const VMM_MARKER: &str = "vmm";
/// Handle `extra` keys.
pub const EXTRA_TAP: &str = "tap";
pub const EXTRA_VM_DIR: &str = "vm_dir";
pub const EXTRA_IP: &str = "ip";
pub const EXTRA_VMM: &str = "vmm";
/// The scaler's name (adoption forwards logs under it).
pub const EXTRA_SCALER: &str = "scaler";
/// ifalias of the bridge [`crate::HostNetwork`] creates.
pub const BRIDGE_TAG: &str = "kici-scaler:bridge";

/// Timeouts of the steps that wait on something outside this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Jailer start to its exit (under `--new-pid-ns`, near-instant).
    pub jailer: Duration,
    /// Jailer exit to a working API socket.
    pub socket: Duration,
    pub mkfs: Duration,
    /// SIGKILL to the process being gone.
    pub kill: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            jailer: Duration::from_secs(10),
            socket: Duration::from_secs(5),
            mkfs: Duration::from_secs(60),
            kill: Duration::from_secs(10),
        }
    }
}

/// Construction settings.
pub struct FirecrackerOptions {
    pub instance: InstanceId,
    /// The config's `firecracker` block (bridge, CIDR, gateway, netmask).
    pub network: FirecrackerNetwork,
    /// Leases (the store's transactional allocator).
    pub allocator: Arc<dyn IpAllocator>,
    /// Per-VM egress rules.
    pub egress: Arc<dyn EgressRules>,
    /// The daemon's environment; only `KICI_AGENT_ENV_*` is forwarded.
    pub forwarded_env: Vec<(String, String)>,
    /// Cgroup placement passed to the jailer, if any.
    pub cgroups: Option<JailerCgroups>,
    pub timeouts: Timeouts,
    /// Bound on serial console output (bytes per second, burst); `None`
    /// leaves it unlimited (the log file is still capped).
    pub serial_rate_limit: Option<TokenBucket>,
    /// Orphans younger than this are left alone (an in-flight spawn of
    /// another process sharing the host may own them).
    pub sweep_min_age: Duration,
}

impl FirecrackerOptions {
    pub const DEFAULT_SWEEP_MIN_AGE: Duration = Duration::from_secs(300);
    /// 1 MiB/s sustained, 4 MiB burst.
    pub const DEFAULT_SERIAL_RATE: TokenBucket = TokenBucket {
        size: 1024 * 1024,
        refill_time: 1000,
        one_time_burst: Some(4 * 1024 * 1024),
    };

    pub fn new(
        instance: InstanceId,
        network: FirecrackerNetwork,
        allocator: Arc<dyn IpAllocator>,
        egress: Arc<dyn EgressRules>,
        daemon_env: Vec<(String, String)>,
    ) -> Self {
        Self {
            instance,
            network,
            allocator,
            egress,
            forwarded_env: daemon_env,
            cgroups: None,
            timeouts: Timeouts::default(),
            serial_rate_limit: Some(Self::DEFAULT_SERIAL_RATE),
            sweep_min_age: Self::DEFAULT_SWEEP_MIN_AGE,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    ForwardedEnv(#[from] ForwardedEnvError),
    #[error("firecracker.cidr: {0}")]
    Pool(#[from] PoolError),
    #[error("firecracker.gateway {gateway} must be the first address of {cidr} ({expected}): the allocator never hands that one out")]
    Gateway {
        gateway: std::net::Ipv4Addr,
        cidr: ipnet::Ipv4Net,
        expected: std::net::Ipv4Addr,
    },
    #[error("firecracker.netmask {netmask} does not match {cidr}")]
    Netmask {
        netmask: std::net::Ipv4Addr,
        cidr: ipnet::Ipv4Net,
    },
}

/// Why a spawn failed (everything taken is released before it is returned).
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("scaler {0:?} is not a Firecracker scaler")]
    NotFirecracker(String),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Chroot(#[from] ChrootError),
    #[error("IP lease: {0}")]
    Lease(#[from] AllocError),
    #[error("TAP: {0}")]
    Link(#[from] LinkError),
    #[error("egress rules: {0}")]
    Egress(#[from] NetPolicyError),
    #[error("jailer {}: {detail}", path.display())]
    Jailer { path: PathBuf, detail: String },
    #[error("Firecracker API socket not ready within {0:?}: {1}")]
    Socket(Duration, String),
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("injected failure at {0}")]
    Injected(&'static str),
}

/// Why destroy could not remove everything (it still tried every step).
#[derive(Debug, thiserror::Error)]
pub enum DestroyError {
    #[error("Firecracker {0} survived SIGKILL")]
    Survived(ProcessIdentity),
    #[error("cannot signal Firecracker {0}: {1}")]
    Signal(ProcessIdentity, rustix::io::Errno),
    #[error("TAP: {0}")]
    Link(#[from] LinkError),
    #[error("egress rules: {0}")]
    Egress(#[from] NetPolicyError),
    #[error("IP lease: {0}")]
    Lease(#[from] AllocError),
    #[error(transparent)]
    Chroot(#[from] ChrootError),
    #[error("cgroup {}: {source}", path.display())]
    Cgroup {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("injected failure at {0}")]
    Injected(&'static str),
}

/// What the Firecracker backend reports to the engine, as the source of a
/// [`BackendError`] ([`FirecrackerError::kind`] gives its kind).
#[derive(Debug, thiserror::Error)]
pub enum FirecrackerError {
    #[error(transparent)]
    Spawn(#[from] SpawnError),
    #[error("the spawn task ended without a result")]
    SpawnTaskLost,
    #[error(transparent)]
    Destroy(#[from] DestroyError),
    #[error("{agent}: {source}")]
    ClearMmds {
        agent: AgentId,
        #[source]
        source: MmdsClearError,
    },
    /// The TAPs on the host could not be listed.
    #[error(transparent)]
    List(#[from] LinkError),
}

impl FirecrackerError {
    pub fn kind(&self) -> BackendErrorKind {
        match self {
            Self::Spawn(SpawnError::Injected(_))
            | Self::Destroy(DestroyError::Injected(_))
            | Self::ClearMmds {
                source: MmdsClearError::Injected(_),
                ..
            } => BackendErrorKind::Injected,
            Self::Spawn(_) | Self::SpawnTaskLost => BackendErrorKind::Provision,
            Self::Destroy(_) => BackendErrorKind::Destroy,
            Self::ClearMmds { .. } | Self::List(_) => BackendErrorKind::Unavailable,
        }
    }
}

impl From<FirecrackerError> for BackendError {
    fn from(e: FirecrackerError) -> Self {
        BackendError::new(e.kind(), e)
    }
}

/// Clearing MMDS after `config.ack` failed.
#[derive(Debug, thiserror::Error)]
pub enum MmdsClearError {
    #[error("agent {0} is not a VM this backend follows")]
    Unknown(AgentId),
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("MMDS still holds data after the clear: {0}")]
    NotCleared(String),
    #[error("injected failure at {0}")]
    Injected(&'static str),
}

/// Where a spawn's time went (host side: lease..overlay; the jailer,
/// socket and API phases include the VMM's own time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpawnTimings {
    pub vm_dir: Duration,
    pub lease: Duration,
    pub tap: Duration,
    pub rules: Duration,
    pub chroot: Duration,
    pub overlay: Duration,
    pub jailer: Duration,
    pub socket: Duration,
    pub api: Duration,
}

impl SpawnTimings {
    /// Our own host-side phases (no VMM involved).
    pub fn host(&self) -> Duration {
        self.vm_dir + self.lease + self.tap + self.rules + self.chroot + self.overlay
    }

    pub fn total(&self) -> Duration {
        self.host() + self.jailer + self.socket + self.api
    }
}

/// What a spawn has taken so far.
#[derive(Default)]
struct Taken {
    vm_dir: Option<JailLayout>,
    /// The TAP this spawn created (it is untagged until attached).
    tap: Option<String>,
    timings: SpawnTimings,
    vmm: Option<ProcessIdentity>,
    watch: Option<VmWatch>,
    api: Option<ApiClient>,
}

/// A VM this daemon follows.
struct Tracked {
    layout: JailLayout,
    identity: ProcessIdentity,
    watch: VmWatch,
    api: ApiClient,
}

pub(crate) struct Inner {
    pub(crate) instance: InstanceId,
    pub(crate) network: FirecrackerNetwork,
    pub(crate) pool: Ipv4Pool,
    pub(crate) allocator: Arc<dyn IpAllocator>,
    pub(crate) egress: Arc<dyn EgressRules>,
    forwarded: ForwardedEnv,
    cgroups: Option<JailerCgroups>,
    timeouts: Timeouts,
    serial_rate_limit: Option<TokenBucket>,
    pub(crate) sweep_min_age: Duration,
    tracked: Mutex<HashMap<AgentId, Tracked>>,
    /// Spawns under way: the sweep never touches them.
    pub(crate) in_flight: Mutex<HashSet<AgentId>>,
    /// Every jail layout seen (validate, spawn, adopt), for the sweep and
    /// for destroys without a handle.
    pub(crate) layouts: Mutex<Vec<JailLayout>>,
}

/// The Firecracker backend. Cheap to clone; must be used inside a tokio
/// runtime.
#[derive(Clone)]
pub struct FirecrackerBackend {
    pub(crate) inner: Arc<Inner>,
}

/// Removes the agent from the in-flight set however the spawn ends.
struct InFlight<'a>(&'a Inner, AgentId);
impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.lock().remove(&self.1);
    }
}

macro_rules! step {
    ($name:expr, $err:expr) => {
        fail::fail_point!($name, |_| Err($err($name)));
    };
}

impl Inner {
    /// Does this daemon follow `agent`'s VM?
    pub(crate) fn tracked_contains(&self, agent: &AgentId) -> bool {
        self.tracked.lock().contains_key(agent)
    }
}

impl FirecrackerBackend {
    pub fn new(options: FirecrackerOptions) -> Result<Self, SetupError> {
        let forwarded = ForwardedEnv::from_vars(options.forwarded_env)?;
        let pool = Ipv4Pool::new(options.network.cidr)?;
        if pool.gateway() != options.network.gateway {
            return Err(SetupError::Gateway {
                gateway: options.network.gateway,
                cidr: options.network.cidr,
                expected: pool.gateway(),
            });
        }
        if pool.netmask() != options.network.netmask {
            return Err(SetupError::Netmask {
                netmask: options.network.netmask,
                cidr: options.network.cidr,
            });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                instance: options.instance,
                network: options.network,
                pool,
                allocator: options.allocator,
                egress: options.egress,
                forwarded,
                cgroups: options.cgroups,
                timeouts: options.timeouts,
                serial_rate_limit: options.serial_rate_limit,
                sweep_min_age: options.sweep_min_age,
                tracked: Mutex::new(HashMap::new()),
                in_flight: Mutex::new(HashSet::new()),
                layouts: Mutex::new(Vec::new()),
            }),
        })
    }

    pub fn instance(&self) -> InstanceId {
        self.inner.instance
    }

    /// Agents whose VM this daemon follows.
    pub fn tracked(&self) -> Vec<AgentId> {
        self.inner.tracked.lock().keys().copied().collect()
    }

    /// The jail layout of a Firecracker scaler (registered for the sweep).
    pub fn layout_for(&self, settings: &FirecrackerSettings) -> Result<JailLayout, LayoutError> {
        let layout = JailLayout::resolve(&settings.chroot_base_dir, &settings.firecracker_path)?;
        self.register_layout(&layout);
        Ok(layout)
    }

    /// Makes the sweep and handle-less destroys look under `layout`.
    pub fn register_layout(&self, layout: &JailLayout) {
        let mut layouts = self.inner.layouts.lock();
        if !layouts.contains(layout) {
            layouts.push(layout.clone());
        }
    }

    /// After `config.ack`: empties the VM's MMDS store through the API and
    /// reads it back; returns only once the token and bootstrap are gone.
    pub async fn clear_mmds(
        &self,
        agent: &AgentId,
        timeout: Duration,
    ) -> Result<(), MmdsClearError> {
        let api = {
            let tracked = self.inner.tracked.lock();
            tracked.get(agent).map(|t| t.api.clone())
        };
        let api = match api {
            Some(api) => ApiClient::new(api.socket(), timeout),
            None => {
                let layout = self
                    .find_layout(agent)
                    .ok_or(MmdsClearError::Unknown(*agent))?;
                ApiClient::new(layout.api_socket(agent), timeout)
            }
        };
        api.put_mmds(&mmds::cleared()).await?;
        fail::fail_point!(fp::MMDS_CLEAR, |_| Err(MmdsClearError::Injected(
            fp::MMDS_CLEAR
        )));
        let now = api.get_mmds().await?;
        if now != mmds::cleared() {
            return Err(MmdsClearError::NotCleared(now.to_string()));
        }
        tracing::info!(agent_id = %agent, "MMDS cleared");
        Ok(())
    }

    /// The registered layout holding `agent`'s directory.
    pub(crate) fn find_layout(&self, agent: &AgentId) -> Option<JailLayout> {
        let layouts = self.inner.layouts.lock().clone();
        layouts.into_iter().find(|l| l.vm_dir(agent).exists())
    }

    async fn spawn_steps(
        &self,
        spec: &SpawnSpec,
        taken: &mut Taken,
    ) -> Result<ResourceHandle, SpawnError> {
        let inner = &self.inner;
        let agent = spec.agent;
        let (BackendSettings::Firecracker(settings), LabelSetBackend::Firecracker(label_set)) =
            (&spec.scaler.backend, &spec.label_set.backend)
        else {
            return Err(SpawnError::NotFirecracker(spec.scaler.name.to_string()));
        };
        let started = Instant::now();
        let mut lap = started;
        let api_timeout = spec.scaler.ext.deadlines.api_call;
        let layout = self.layout_for(settings)?;
        let tag = names::owner_tag(inner.instance, &agent);

        chroot::create_vm_dir(&layout, &agent, &tag)?;
        taken.vm_dir = Some(layout.clone());
        step!(fp::SPAWN_VM_DIR, SpawnError::Injected);
        taken.timings.vm_dir = lap.elapsed();
        lap = Instant::now();

        let lease = inner.allocator.allocate(&inner.pool, &agent).await?;
        step!(fp::SPAWN_LEASE, SpawnError::Injected);
        taken.timings.lease = lap.elapsed();
        lap = Instant::now();
        let mac = MacAddress::for_ip(lease.ip);

        let tap_name = names::tap_name(&agent);
        tap::create_tap(&tap_name, settings.uid, settings.gid)?;
        taken.tap = Some(tap_name.clone());
        step!(fp::SPAWN_TAP, SpawnError::Injected);
        let netlink = Netlink::connect()?;
        netlink
            .attach_tap(&tap_name, &inner.network.bridge_name, &tag)
            .await?;
        step!(fp::SPAWN_ATTACH, SpawnError::Injected);
        taken.timings.tap = lap.elapsed();
        lap = Instant::now();

        let vm = EgressTarget {
            agent,
            ip: lease.ip,
            mac: mac.0,
            // The TAP is bound as the agent's port: neither its address nor
            // its MAC can be forged through another port.
            port: Some(tap_name.clone()),
            bridge: inner.network.bridge_name.clone(),
            gateway: inner.network.gateway,
        };
        inner
            .egress
            .install(&vm, spec.label_set.network_policy.as_ref())
            .await?;
        step!(fp::SPAWN_RULES, SpawnError::Injected);
        taken.timings.rules = lap.elapsed();
        lap = Instant::now();

        let kernel = label_set
            .kernel_path
            .as_deref()
            .unwrap_or(&settings.kernel_path);
        let files = JailFiles {
            kernel,
            rootfs: &label_set.rootfs_path,
            overlay_mib: label_set
                .overlay_drive_size_mib
                .unwrap_or(DEFAULT_OVERLAY_MIB),
            uid: settings.uid,
            gid: settings.gid,
            mkfs_timeout: inner.timeouts.mkfs,
            min_free_bytes: chroot::MIN_FREE_BYTES,
        };
        chroot::prepare_root(&layout, &agent, &files)?;
        step!(fp::SPAWN_CHROOT, SpawnError::Injected);
        taken.timings.chroot = lap.elapsed();
        lap = Instant::now();
        chroot::create_overlay(&layout, &agent, &files).await?;
        step!(fp::SPAWN_OVERLAY, SpawnError::Injected);
        taken.timings.overlay = lap.elapsed();
        lap = Instant::now();

        let identity = self.run_jailer(settings, &layout, &agent, taken).await?;
        step!(fp::SPAWN_JAILER, SpawnError::Injected);
        taken.timings.jailer = lap.elapsed();
        lap = Instant::now();
        let pidfd = crate::pidfd::open(identity);
        let log = |source| LogContext {
            agent,
            scaler: spec.scaler.name.clone(),
            job: spec.job.clone(),
            source,
        };
        let watch = VmWatch::start(WatchSpec {
            agent,
            serial: log(SERIAL_SOURCE),
            vmm: log(VMM_SOURCE),
            serial_path: layout.in_root(&agent, SERIAL_LOG),
            vmm_path: layout.in_root(&agent, VMM_LOG),
            pidfd,
            reports: spec.reports.clone(),
            from: TailFrom::Start,
        });
        let exited = watch.state.clone();
        taken.watch = Some(watch);

        let api = ApiClient::new(layout.api_socket(&agent), api_timeout);
        taken.api = Some(api.clone());
        wait_for_socket(&api, inner.timeouts.socket, || {
            exited.exited.load(Ordering::SeqCst)
        })
        .await
        .map_err(|e| match e {
            SpawnError::Socket(limit, detail) => SpawnError::Socket(
                limit,
                format!(
                    "{detail}; serial console: {}",
                    serial_tail(&layout.in_root(&agent, SERIAL_LOG))
                ),
            ),
            other => other,
        })?;
        step!(fp::SPAWN_SOCKET, SpawnError::Injected);
        taken.timings.socket = lap.elapsed();
        lap = Instant::now();

        let net = GuestNet {
            ip: lease.ip,
            gateway: inner.network.gateway,
            netmask: inner.network.netmask,
        };
        let (size, rounding) = MachineSize::resolve(&spec.scaler, label_set, &spec.resources);
        if let Some(r) = rounding {
            tracing::info!(
                agent_id = %agent,
                limit_millicpu = r.requested_millicpu,
                limit_bytes = r.requested_bytes,
                vcpus = r.size.vcpus,
                mem_mib = r.size.mem_mib,
                "resource limits rounded to the VM's size (vCPUs up to 1 or an even count, memory down to whole MiB)"
            );
        }
        api.put_boot_source(&vmconfig::boot_source(&net)).await?;
        for drive in vmconfig::drives() {
            api.put_drive(&drive).await?;
        }
        api.put_network_interface(&vmconfig::network_interface(&tap_name, &mac.to_string()))
            .await?;
        api.put_machine_config(&size.api_body()).await?;
        api.put_logger(&Logger {
            log_path: format!("/{VMM_LOG}"),
            level: LogLevel::Warning,
            show_level: true,
            show_log_origin: false,
        })
        .await?;
        api.put_metrics(&Metrics {
            metrics_path: format!("/{METRICS_FILE}"),
        })
        .await?;
        if let Some(bucket) = inner.serial_rate_limit {
            api.put_serial(&SerialDevice {
                rate_limiter: Some(bucket),
            })
            .await?;
        }
        api.put_mmds_config(&MmdsConfig {
            version: MmdsVersion::V2,
            network_interfaces: vec![GUEST_IFACE.into()],
            ipv4_address: MMDS_ADDRESS.into(),
        })
        .await?;
        step!(fp::SPAWN_CONFIGURE, SpawnError::Injected);

        let env = agent_env(
            spec,
            ScalerType::Firecracker,
            &SystemEnv::default(),
            &inner.forwarded,
        );
        let document = mmds::build(&env, inner.network.gateway);
        api.put_mmds(&document.value).await?;
        step!(fp::SPAWN_MMDS, SpawnError::Injected);

        api.action(ActionType::InstanceStart).await?;
        step!(fp::SPAWN_START, SpawnError::Injected);
        taken.timings.api = lap.elapsed();

        tracing::info!(
            agent_id = %agent,
            ip = %lease.ip,
            tap = %tap_name,
            vcpus = size.vcpus,
            mem_mib = size.mem_mib,
            host_ms = taken.timings.host().as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "microVM started"
        );
        let mut extra = BTreeMap::new();
        extra.insert(EXTRA_TAP.into(), tap_name);
        extra.insert(EXTRA_IP.into(), lease.ip.to_string());
        extra.insert(
            EXTRA_VM_DIR.into(),
            layout.vm_dir(&agent).display().to_string(),
        );
        extra.insert(EXTRA_VMM.into(), identity.to_string());
        extra.insert(EXTRA_SCALER.into(), spec.scaler.name.to_string());
        Ok(ResourceHandle {
            id: agent.to_string(),
            extra,
        })
    }

    /// Runs the jailer to its (immediate) exit and identifies Firecracker.
    async fn run_jailer(
        &self,
        settings: &FirecrackerSettings,
        layout: &JailLayout,
        agent: &AgentId,
        taken: &mut Taken,
    ) -> Result<ProcessIdentity, SpawnError> {
        let jailer_err = |detail: String| SpawnError::Jailer {
            path: settings.jailer_path.clone(),
            detail,
        };
        let serial = chroot::open_serial(layout, agent)?;
        let stderr = serial.try_clone().map_err(|e| jailer_err(e.to_string()))?;
        let args = JailerArgs {
            agent,
            firecracker: &settings.firecracker_path,
            uid: settings.uid,
            gid: settings.gid,
            chroot_base: &settings.chroot_base_dir,
            cgroups: self.inner.cgroups.as_ref(),
        };
        let mut command = tokio::process::Command::new(&settings.jailer_path);
        command
            .args(args.argv())
            .env_clear()
            .stdin(std::process::Stdio::null())
            .stdout(serial)
            .stderr(stderr)
            // Out of the daemon's process group: a Ctrl-C meant for the
            // daemon must not reach the VMs.
            .process_group(0)
            .kill_on_drop(true);
        let mut child = command.spawn().map_err(|e| jailer_err(e.to_string()))?;
        let status = match tokio::time::timeout(self.inner.timeouts.jailer, child.wait()).await {
            Ok(status) => status.map_err(|e| jailer_err(e.to_string()))?,
            Err(_) => {
                let _ = child.kill().await;
                return Err(jailer_err(format!(
                    "did not exit within {:?}",
                    self.inner.timeouts.jailer
                )));
            }
        };
        let pid_file = layout.pid_file(agent);
        let pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .and_then(Pid::from_raw);
        if !status.success() {
            if let Some(identity) = pid.and_then(|p| ProcessIdentity::of(p).ok()) {
                taken.vmm = Some(identity);
            }
            return Err(jailer_err(format!(
                "{status}; serial console: {}",
                serial_tail(&layout.in_root(agent, SERIAL_LOG))
            )));
        }
        let pid = pid
            .ok_or_else(|| jailer_err(format!("exited without writing {}", pid_file.display())))?;
        let identity = ProcessIdentity::of(pid).map_err(|e| {
            jailer_err(format!(
                "Firecracker (pid {}) is already gone ({e}); serial console: {}",
                pid.as_raw_nonzero(),
                serial_tail(&layout.in_root(agent, SERIAL_LOG))
            ))
        })?;
        taken.vmm = Some(identity);
        let marker = layout.vm_dir(agent).join(VMM_MARKER);
        std::fs::write(&marker, identity.to_string()).map_err(|e| ChrootError::Io {
            what: "cannot write",
            path: marker,
            source: e,
        })?;
        Ok(identity)
    }

    /// Releases everything of `agent`, best effort per step, every step
    /// tried; the first error is returned.
    pub(crate) async fn teardown(
        &self,
        agent: &AgentId,
        parts: Teardown,
    ) -> Result<(), DestroyError> {
        let inner = &self.inner;
        let mut first: Option<DestroyError> = None;
        let mut note = |r: Result<(), DestroyError>| {
            if let Err(e) = r {
                tracing::warn!(agent_id = %agent, error = %e, "teardown step failed");
                first.get_or_insert(e);
            }
        };
        note(stop_vmm(agent, &parts, &inner.timeouts).await);
        if let Some(watch) = parts.watch {
            watch.finish().await;
        }
        note(fail_step(fp::DESTROY_STOP));
        note(inner.egress.remove(agent).await.map_err(Into::into));
        note(fail_step(fp::DESTROY_RULES));
        let tag = names::owner_tag(inner.instance, agent);
        // A spawn cut short between creating the TAP and attaching it (a
        // crash) leaves it untagged; the agent's VM directory, made before
        // the TAP and removed after it, still carries our marker then.
        let marked_ours = parts.layout.as_ref().is_some_and(|l| {
            std::fs::read_to_string(l.owner_marker(agent))
                .ok()
                .and_then(|t| names::parse_owner_tag(&t))
                == Some((inner.instance, *agent))
        });
        note(
            delete_own_tap(agent, &tag, parts.tap_created, marked_ours)
                .await
                .map_err(Into::into),
        );
        note(fail_step(fp::DESTROY_TAP));
        note(
            inner
                .allocator
                .release_agent(agent)
                .await
                .map(drop)
                .map_err(Into::into),
        );
        note(fail_step(fp::DESTROY_LEASE));
        if let (Some(cgroups), Some(layout)) = (&inner.cgroups, &parts.layout) {
            for dir in cgroups.vm_dirs(layout.exec_name(), agent) {
                if let Err(source) = remove_cgroup_dir(&dir) {
                    note(Err(DestroyError::Cgroup { path: dir, source }));
                }
            }
        }
        if let Some(layout) = &parts.layout {
            // The owner marker goes last: until then the sweep can age
            // whatever is left.
            note(chroot::remove_vm_dir(layout, agent).map_err(Into::into));
        }
        note(fail_step(fp::DESTROY_CHROOT));
        match first {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    async fn spawn_transaction(
        &self,
        spec: SpawnSpec,
    ) -> Result<(ResourceHandle, SpawnTimings), BackendError> {
        let agent = spec.agent;
        self.inner.in_flight.lock().insert(agent);
        let _in_flight = InFlight(&self.inner, agent);
        let mut taken = Taken::default();
        match self.spawn_steps(&spec, &mut taken).await {
            Ok(handle) => {
                let timings = taken.timings;
                if let (Some(layout), Some(identity), Some(watch), Some(api)) =
                    (taken.vm_dir, taken.vmm, taken.watch, taken.api)
                {
                    self.inner.tracked.lock().insert(
                        agent,
                        Tracked {
                            layout,
                            identity,
                            watch,
                            api,
                        },
                    );
                }
                Ok((handle, timings))
            }
            Err(error) => {
                tracing::warn!(agent_id = %agent, error = %error, "microVM spawn failed; releasing what it took");
                if let Some(watch) = &taken.watch {
                    watch.state.destroying.store(true, Ordering::SeqCst);
                }
                let identity = taken.vmm.or_else(|| {
                    taken.vm_dir.as_ref().and_then(|l| {
                        // The jailer may have started Firecracker before
                        // failing; only a process as young as the spawn can
                        // be it.
                        std::fs::read_to_string(l.pid_file(&agent))
                            .ok()
                            .and_then(|s| s.trim().parse::<i32>().ok())
                            .and_then(Pid::from_raw)
                            .and_then(|p| ProcessIdentity::of(p).ok())
                    })
                });
                let parts = Teardown {
                    layout: taken.vm_dir,
                    identity,
                    api: None,
                    watch: taken.watch,
                    grace: Duration::ZERO,
                    tap_created: taken.tap.is_some(),
                };
                if let Err(e) = self.teardown(&agent, parts).await {
                    tracing::error!(agent_id = %agent, error = %e, "releasing a failed spawn left something behind; the sweep will retry");
                }
                Err(FirecrackerError::Spawn(error).into())
            }
        }
    }

    /// [`Backend::spawn`], with where the time went. Runs on its own task:
    /// if the caller stops waiting (a deadline cancelled it), the spawn
    /// still ends in a consistent state — a failure is released as always,
    /// and a VM nobody waits for any more is destroyed.
    pub async fn spawn_timed(
        &self,
        spec: SpawnSpec,
    ) -> Result<(ResourceHandle, SpawnTimings), BackendError> {
        let backend = self.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let agent = spec.agent;
            let result = backend.spawn_transaction(spec).await;
            if let Err(Ok((handle, _))) = tx.send(result) {
                tracing::warn!(agent_id = %agent, "spawn finished after its caller gave up; destroying the VM");
                if let Err(e) = backend
                    .destroy_inner(&agent, Some(&handle), Duration::ZERO)
                    .await
                {
                    tracing::error!(agent_id = %agent, error = %e, "cannot destroy an abandoned VM; the sweep will");
                }
            }
        });
        rx.await
            .unwrap_or_else(|_| Err(FirecrackerError::SpawnTaskLost.into()))
    }

    async fn destroy_inner(
        &self,
        agent: &AgentId,
        handle: Option<&ResourceHandle>,
        grace: Duration,
    ) -> Result<(), DestroyError> {
        let tracked = self.inner.tracked.lock().remove(agent);
        let parts = match tracked {
            Some(t) => {
                t.watch.state.destroying.store(true, Ordering::SeqCst);
                Teardown {
                    layout: Some(t.layout),
                    identity: Some(t.identity),
                    api: Some(t.api),
                    watch: Some(t.watch),
                    grace,
                    tap_created: false,
                }
            }
            None => {
                let layout = handle
                    .and_then(|h| h.extra.get(EXTRA_VM_DIR))
                    .and_then(|d| layout_of_vm_dir(Path::new(d)))
                    .or_else(|| self.find_layout(agent));
                let identity = handle
                    .and_then(|h| h.extra.get(EXTRA_VMM))
                    .and_then(|v| v.parse().ok())
                    .or_else(|| layout.as_ref().and_then(|l| read_vmm_marker(l, agent)));
                let api = layout
                    .as_ref()
                    .map(|l| ApiClient::new(l.api_socket(agent), API_TIMEOUT_UNTRACKED));
                Teardown {
                    layout,
                    identity,
                    api,
                    watch: None,
                    grace,
                    tap_created: false,
                }
            }
        };
        self.teardown(agent, parts).await?;
        tracing::info!(agent_id = %agent, "microVM destroyed");
        Ok(())
    }
}

/// API deadline when the scaler's is not at hand (destroy without a
/// tracked VM): the graceful stop is best effort anyway.
const API_TIMEOUT_UNTRACKED: Duration = Duration::from_secs(5);

/// What a teardown works from.
pub(crate) struct Teardown {
    pub(crate) layout: Option<JailLayout>,
    pub(crate) identity: Option<ProcessIdentity>,
    pub(crate) api: Option<ApiClient>,
    pub(crate) watch: Option<VmWatch>,
    pub(crate) grace: Duration,
    /// The TAP was created by the spawn being rolled back (it may not carry
    /// its tag yet); otherwise only a TAP tagged as ours is deleted.
    pub(crate) tap_created: bool,
}

/// Deletes the agent's TAP if it is ours: tagged with our owner tag, or
/// untagged but just created by this spawn, or untagged, on no bridge
/// (attaching tags it) and named after an agent whose VM directory carries
/// our marker (`marked_ours`: a spawn that died before attaching it).
async fn delete_own_tap(
    agent: &AgentId,
    tag: &str,
    created_here: bool,
    marked_ours: bool,
) -> Result<(), LinkError> {
    let name = names::tap_name(agent);
    let netlink = Netlink::connect()?;
    let Some(link) = netlink.get(&name).await? else {
        return Ok(());
    };
    let ours = match link.alias.as_deref() {
        Some(alias) => alias == tag,
        None => created_here || (marked_ours && link.controller.is_none()),
    };
    if ours {
        netlink.delete(&name).await.map(drop)
    } else {
        tracing::warn!(agent_id = %agent, tap = %name, alias = ?link.alias, "not deleting a TAP that is not ours");
        Ok(())
    }
}

fn fail_step(name: &'static str) -> Result<(), DestroyError> {
    fail::fail_point!(name, |_| Err(DestroyError::Injected(name)));
    let _ = name;
    Ok(())
}

/// Removes a VM's (empty, the VMM being dead) cgroup directory. On a
/// cgroup filesystem `rmdir` is the only way and works once no process is
/// left; anywhere else (a test tree standing in for one) the directory
/// holds plain files and goes whole.
fn remove_cgroup_dir(dir: &Path) -> std::io::Result<()> {
    const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => {
            let on_cgroupfs = rustix::fs::statfs(dir).is_ok_and(|s| {
                let kind = s.f_type;
                kind == CGROUP_SUPER_MAGIC || kind == CGROUP2_SUPER_MAGIC
            });
            if on_cgroupfs {
                Err(e)
            } else {
                std::fs::remove_dir_all(dir)
            }
        }
    }
}

/// `<base>/<exec name>/<agent id>` → its layout.
pub(crate) fn layout_of_vm_dir(dir: &Path) -> Option<JailLayout> {
    let exec_dir = dir.parent()?;
    let exec_name = exec_dir.file_name()?.to_str()?.to_owned();
    JailLayout::new(exec_dir.parent()?, exec_name).ok()
}

pub(crate) fn read_vmm_marker(layout: &JailLayout, agent: &AgentId) -> Option<ProcessIdentity> {
    std::fs::read_to_string(layout.vm_dir(agent).join(VMM_MARKER))
        .ok()?
        .parse()
        .ok()
}

/// Ctrl-Alt-Del, up to `grace` for the guest to power off, then SIGKILL —
/// each signal only while the pid still names our Firecracker (start time).
async fn stop_vmm(
    agent: &AgentId,
    parts: &Teardown,
    timeouts: &Timeouts,
) -> Result<(), DestroyError> {
    let Some(identity) = parts.identity else {
        return Ok(());
    };
    let exited = |watch: Option<&VmWatch>| {
        watch.is_some_and(|w| w.state.exited.load(Ordering::SeqCst)) || !identity.is_running()
    };
    if exited(parts.watch.as_ref()) {
        return Ok(());
    }
    if !parts.grace.is_zero() {
        if let Some(api) = &parts.api {
            // x86 only; the guest may ignore it.
            match api.action(ActionType::SendCtrlAltDel).await {
                Ok(()) => {
                    let _ = wait_gone(identity, parts.watch.as_ref(), parts.grace).await;
                }
                Err(e) => tracing::debug!(agent_id = %agent, error = %e, "SendCtrlAltDel failed"),
            }
        }
    }
    if exited(parts.watch.as_ref()) {
        return Ok(());
    }
    // The start time still matches: the pid is ours to kill.
    match rustix::process::kill_process(identity.pid, Signal::KILL) {
        Ok(()) | Err(rustix::io::Errno::SRCH) => {}
        Err(e) => return Err(DestroyError::Signal(identity, e)),
    }
    if wait_gone(identity, parts.watch.as_ref(), timeouts.kill).await {
        Ok(())
    } else {
        Err(DestroyError::Survived(identity))
    }
}

/// Waits until the process is gone (pidfd via the watch, or polling).
async fn wait_gone(identity: ProcessIdentity, watch: Option<&VmWatch>, limit: Duration) -> bool {
    if let Some(watch) = watch {
        if watch.wait_exit(limit).await {
            return true;
        }
        return !identity.is_running();
    }
    let pidfd = crate::pidfd::open(identity).and_then(|fd| crate::pidfd::register(fd).ok());
    match pidfd {
        Some(fd) if identity.is_current() => {
            let _ = tokio::time::timeout(limit, fd.readable()).await;
            !identity.is_running()
        }
        _ => !identity.is_running(),
    }
}

/// Polls `GET /` until it answers, `limit` passes or the VMM exits.
async fn wait_for_socket(
    api: &ApiClient,
    limit: Duration,
    exited: impl Fn() -> bool,
) -> Result<(), SpawnError> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut last = String::from("no attempt");
    loop {
        match tokio::time::timeout_at(deadline, api.describe_instance()).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => {}
        }
        if exited() {
            return Err(SpawnError::Socket(
                limit,
                format!("Firecracker exited ({last})"),
            ));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(SpawnError::Socket(limit, last));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The last lines of the serial log, for error messages.
fn serial_tail(path: &Path) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let start = text.len().saturating_sub(2048);
    let tail = String::from_utf8_lossy(&text[start..]);
    let lines: Vec<&str> = tail.lines().rev().take(10).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

#[async_trait]
impl Backend for FirecrackerBackend {
    fn kind(&self) -> ScalerType {
        ScalerType::Firecracker
    }

    async fn validate(&self, scaler: &ScalerEntry) -> Result<(), ScalerProblems> {
        crate::validate::validate(self, scaler)
    }

    async fn agent_configured(&self, agent: &AgentId) -> Result<(), BackendError> {
        // The token and bootstrap env sit in the MMDS until now: gone, and
        // read back empty, before any job reaches the guest.
        // The runtime bounds the whole call by the scaler's API deadline;
        // this is the per-request bound inside it (30 s, the default
        // `apiCallTimeoutSeconds`).
        self.clear_mmds(agent, Duration::from_secs(30))
            .await
            .map_err(|source| {
                FirecrackerError::ClearMmds {
                    agent: *agent,
                    source,
                }
                .into()
            })
    }

    async fn spawn(&self, spec: SpawnSpec) -> Result<ResourceHandle, BackendError> {
        self.spawn_timed(spec).await.map(|(handle, _)| handle)
    }

    async fn destroy(
        &self,
        agent: &AgentId,
        handle: Option<&ResourceHandle>,
        grace: Duration,
    ) -> Result<(), BackendError> {
        self.destroy_inner(agent, handle, grace)
            .await
            .map_err(|e| FirecrackerError::Destroy(e).into())
    }

    async fn list_owned(&self) -> Result<Vec<OwnedResource>, BackendError> {
        self.owned()
            .await
            .map_err(|e| FirecrackerError::List(e).into())
    }

    async fn adopt(
        &self,
        agent: &AgentId,
        handle: &ResourceHandle,
        reports: ReportSender,
    ) -> Result<Adoption, BackendError> {
        let Some(layout) = handle
            .extra
            .get(EXTRA_VM_DIR)
            .and_then(|d| layout_of_vm_dir(Path::new(d)))
            .or_else(|| self.find_layout(agent))
        else {
            return Ok(Adoption::Gone);
        };
        self.register_layout(&layout);
        let identity = handle
            .extra
            .get(EXTRA_VMM)
            .and_then(|v| v.parse::<ProcessIdentity>().ok())
            .or_else(|| read_vmm_marker(&layout, agent));
        let Some(identity) = identity.filter(ProcessIdentity::is_running) else {
            return Ok(Adoption::Gone);
        };
        let pidfd = crate::pidfd::open(identity);
        // The pid could have been reused between the check and the pidfd.
        if pidfd.is_none() || !identity.is_running() {
            return Ok(Adoption::Gone);
        }
        let scaler = kici_model::ScalerName::new(
            handle
                .extra
                .get(EXTRA_SCALER)
                .map_or("unknown", String::as_str),
        );
        let log = |source| LogContext {
            agent: *agent,
            scaler: scaler.clone(),
            job: None,
            source,
        };
        let watch = VmWatch::start(WatchSpec {
            agent: *agent,
            serial: log(SERIAL_SOURCE),
            vmm: log(VMM_SOURCE),
            serial_path: layout.in_root(agent, SERIAL_LOG),
            vmm_path: layout.in_root(agent, VMM_LOG),
            pidfd,
            reports,
            // What the log holds was forwarded (and any boot failure in it
            // reported) by the daemon that spawned the VM.
            from: TailFrom::End,
        });
        let api = ApiClient::new(layout.api_socket(agent), API_TIMEOUT_UNTRACKED);
        self.inner.tracked.lock().insert(
            *agent,
            Tracked {
                layout,
                identity,
                watch,
                api,
            },
        );
        tracing::info!(agent_id = %agent, vmm = %identity, "microVM adopted");
        Ok(Adoption::Alive)
    }
}

impl FirecrackerBackend {
    /// Every VM directory and TAP carrying this instance's owner tag.
    async fn owned(&self) -> Result<Vec<OwnedResource>, LinkError> {
        let mut out: Vec<OwnedResource> = Vec::new();
        let mut seen = HashSet::new();
        let layouts = self.inner.layouts.lock().clone();
        for layout in &layouts {
            for (agent, created_at) in crate::sweep::owned_vm_dirs(layout, self.inner.instance) {
                seen.insert(agent);
                let mut extra = BTreeMap::new();
                extra.insert(
                    EXTRA_VM_DIR.into(),
                    layout.vm_dir(&agent).display().to_string(),
                );
                extra.insert(EXTRA_TAP.into(), names::tap_name(&agent));
                if let Some(identity) = read_vmm_marker(layout, &agent) {
                    extra.insert(EXTRA_VMM.into(), identity.to_string());
                }
                out.push(OwnedResource {
                    agent: Some(agent),
                    handle: ResourceHandle {
                        id: agent.to_string(),
                        extra,
                    },
                    created_at,
                });
            }
        }
        let netlink = Netlink::connect()?;
        for (agent, tap) in crate::sweep::owned_taps(
            &netlink.list().await?,
            self.inner.instance,
            &self.protected(),
        ) {
            if seen.contains(&agent) {
                continue;
            }
            let mut extra = BTreeMap::new();
            extra.insert(EXTRA_TAP.into(), tap);
            out.push(OwnedResource {
                agent: Some(agent),
                handle: ResourceHandle {
                    id: agent.to_string(),
                    extra,
                },
                // A TAP without its directory is past any spawn.
                created_at: SystemTime::UNIX_EPOCH,
            });
        }
        Ok(out)
    }

    /// Interface names the sweep never deletes.
    pub(crate) fn protected(&self) -> Vec<String> {
        let mut names: Vec<String> = names::PROTECTED_INTERFACES
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        names.push(self.inner.network.bridge_name.clone());
        names
    }
}
