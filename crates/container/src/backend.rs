//! The container [`Backend`]: one agent = one container.
//!
//! Spawn, in order, each step bounded (the Engine call by the scaler's
//! `api_call` deadline, the pull by `provisionTimeout`) and followed by a
//! failpoint (see [`crate::FAILPOINTS`]):
//!
//! 1. `lease`: an address of the agent network from the [`IpAllocator`];
//! 2. `pull`: the image per `imagePullPolicy`, credentials from `config.json`;
//! 3. `create`: `kici-<agent id>` with the body of [`crate::create`];
//! 4. `rules`: the agent's egress rules ([`EgressRules`]) — before start;
//! 5. `start`; then the log stream and the exit watch (`wait`).
//!
//! A spawn that fails at any step removes what it made: the container (if
//! it is ours by its labels), the rules, the lease. A spawn cut short from
//! outside (the engine's provision deadline) is cleaned by `destroy`, which
//! works by name from the agent id alone.
//!
//! Destroy: stop with the grace (the Engine kills after it), drain the
//! output, remove with volumes (upstream leaked them), remove the rules, release the lease —
//! also when the container already died or was removed behind our back.

use crate::auth;
use crate::create::{
    container_name, create_body, ContainerLabelSet, CreateContext, Ulimit, DEFAULT_PIDS_LIMIT,
    LABEL_AGENT, LABEL_INSTANCE, LABEL_SCALER,
};
use crate::logs;
use crate::network::{self, NetworkInfo, NetworkSettings};
use crate::reference::ImageReference;
use crate::runtime::{Connection, RuntimeKind, RuntimeTarget, TlsFiles};
use crate::states;
use async_trait::async_trait;
use bollard::errors::Error as DockerError;
use bollard::query_parameters::{
    CreateContainerOptions, CreateImageOptions, KillContainerOptions, ListContainersOptions,
    RemoveContainerOptions, StartContainerOptions, StopContainerOptions, WaitContainerOptions,
};
use futures_util::StreamExt;
use kici_engine::backend::ReportSender;
use kici_engine::{
    Adoption, Backend, BackendError, BackendErrorKind, BackendReport, OwnedResource, ProblemKind,
    ResourceHandle, ScalerProblem, ScalerProblems, SpawnSpec,
};
use kici_host::env::{agent_env, ForwardedEnv, ForwardedEnvError, SystemEnv};
use kici_host::logs::LogContext;
use kici_model::{
    AgentId, BackendSettings, ContainerSettings, ImagePullPolicy, InstanceId, LabelSetBackend,
    ScalerEntry, ScalerType, UlimitName, UlimitValue,
};
use kici_netpolicy::{EgressRules, EgressTarget, NoEgressRules};
use kici_store::{IpAllocator, Lease};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long destroy waits for the log stream to deliver the last lines
/// after the container stopped.
const LOG_DRAIN: Duration = Duration::from_secs(2);
/// Pause before the exit watch asks again after a broken connection.
const WATCH_RETRY: Duration = Duration::from_secs(1);
/// Connection attempts of the exit watch before it gives up and reports.
const WATCH_ATTEMPTS: u32 = 30;

/// Construction settings (the daemon fills them from its own config).
#[derive(Clone)]
pub struct ContainerOptions {
    /// Owner of every container, network lease and rule.
    pub instance: InstanceId,
    /// The agent network (`kici-scaler-net`, 172.29.0.0/16 by default).
    pub network: NetworkSettings,
    /// Addresses on the agent network.
    pub allocator: Arc<dyn IpAllocator>,
    /// Per-agent egress rules, installed before start.
    pub egress: Arc<dyn EgressRules>,
    /// The daemon's `KICI_AGENT_ENV_*` variables (other names are ignored,
    /// so the whole environment may be passed).
    pub forwarded_env: Vec<(String, String)>,
    /// `PidsLimit` of every agent container.
    pub pids_limit: i64,
    /// `HostConfig.Ulimits` of every agent container (Podman on these
    /// machines needs `nofile=20000:20000`, `nproc=4096:4096`: root cannot
    /// raise hard limits there).
    pub ulimits: Vec<Ulimit>,
    /// Docker's `config.json` with registry credentials; `None` = the
    /// default location ([`auth::default_config_path`]).
    pub registry_config: Option<PathBuf>,
    /// Client TLS material for `tcp://` hosts.
    pub tls: Option<TlsFiles>,
    /// The runtime socket as the *host* sees it, for `containerSocket`
    /// (differs from the daemon's path when kici-scaler itself runs in a
    /// container); `None` = the path the daemon connected to.
    pub socket_on_host: Option<PathBuf>,
}

impl ContainerOptions {
    /// Defaults: `kici-scaler-net` 172.29.0.0/16, no egress rules (the
    /// daemon sets [`Self::egress`]), the default pids limit, no ulimits.
    pub fn new(
        instance: InstanceId,
        allocator: Arc<dyn IpAllocator>,
        daemon_env: Vec<(String, String)>,
    ) -> Self {
        Self {
            instance,
            network: NetworkSettings::default(),
            allocator,
            egress: Arc::new(NoEgressRules),
            forwarded_env: daemon_env,
            pids_limit: DEFAULT_PIDS_LIMIT,
            ulimits: Vec::new(),
            registry_config: None,
            tls: None,
            socket_on_host: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ContainerSetupError {
    #[error(transparent)]
    ForwardedEnv(#[from] ForwardedEnvError),
    #[error("pidsLimit must be positive, got {0}")]
    PidsLimit(i64),
}

/// What the container backend reports to the engine, as the source of a
/// [`BackendError`] ([`ContainerError::kind`] gives its kind).
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error(transparent)]
    Spawn(StepError),
    /// The spawn failed and removing what it had made failed too (the
    /// reconciler retries that).
    #[error("{source} (cleanup incomplete: {})", join_errors(cleanup))]
    SpawnCleanupIncomplete {
        #[source]
        source: StepError,
        cleanup: Vec<StepError>,
    },
    #[error("{agent}: {}", join_errors(steps))]
    Destroy {
        agent: AgentId,
        steps: Vec<StepError>,
    },
    /// Listing, adopting or sweeping could not reach a runtime or the rules.
    #[error(transparent)]
    Unavailable(StepError),
    #[error("{agent}: container {container} has no scaler label")]
    NoScalerLabel { agent: AgentId, container: String },
}

impl ContainerError {
    pub fn kind(&self) -> BackendErrorKind {
        let injected = |e: &StepError| matches!(e, StepError::Failpoint(_));
        match self {
            Self::Spawn(e) | Self::SpawnCleanupIncomplete { source: e, .. } if injected(e) => {
                BackendErrorKind::Injected
            }
            Self::Destroy { steps, .. } if steps.iter().any(injected) => BackendErrorKind::Injected,
            Self::Unavailable(e) if injected(e) => BackendErrorKind::Injected,
            Self::Spawn(_) | Self::SpawnCleanupIncomplete { .. } => BackendErrorKind::Provision,
            Self::Destroy { .. } => BackendErrorKind::Destroy,
            Self::Unavailable(_) | Self::NoScalerLabel { .. } => BackendErrorKind::Unavailable,
        }
    }
}

impl From<ContainerError> for BackendError {
    fn from(e: ContainerError) -> Self {
        BackendError::new(e.kind(), e)
    }
}

/// Why a scaler entry cannot run on the container backend
/// ([`Backend::validate`], [`ContainerBackend::check_host`]).
#[derive(Debug, thiserror::Error)]
pub enum ContainerProblem {
    #[error("labelSets[{index}].image: {source}")]
    Image {
        index: usize,
        #[source]
        source: crate::reference::ReferenceError,
    },
    #[error("labelSets[{index}]: not a container label set")]
    NotContainerLabelSet { index: usize },
    #[error(
        "networkIsolation is on but the runtime {endpoint} is remote: egress rules \
         are installed on this host and would not apply there; set \
         networkIsolation: false for this scaler (and isolate that host yourself)"
    )]
    RemoteIsolation { endpoint: crate::runtime::Endpoint },
    /// The scaler's settings, the runtime or its network as found.
    #[error(transparent)]
    Runtime(StepError),
    #[error(
        "labelSets[{index}].resources: memory limit {bytes} bytes exceeds \
         the host's {host_bytes} bytes ({endpoint})"
    )]
    MemoryExceedsHost {
        index: usize,
        bytes: i64,
        host_bytes: i64,
        endpoint: crate::runtime::Endpoint,
    },
    #[error(
        "labelSets[{index}].resources: {cores} CPUs exceed the host's {host_cpus} ({endpoint})"
    )]
    CpusExceedHost {
        index: usize,
        cores: String,
        host_cpus: i64,
        endpoint: crate::runtime::Endpoint,
    },
    #[error("maxAgents {max_agents} exceeds the {capacity} addresses of {network} ({pool})")]
    PoolTooSmall {
        max_agents: u32,
        capacity: u32,
        network: String,
        pool: String,
    },
}

impl ContainerProblem {
    pub fn kind(&self) -> ProblemKind {
        match self {
            Self::Runtime(StepError::NotContainer(_) | StepError::Reference(_))
            | Self::Image { .. }
            | Self::NotContainerLabelSet { .. }
            | Self::RemoteIsolation { .. }
            | Self::PoolTooSmall { .. } => ProblemKind::Setting,
            Self::Runtime(_) | Self::MemoryExceedsHost { .. } | Self::CpusExceedHost { .. } => {
                ProblemKind::Host
            }
        }
    }
}

impl From<ContainerProblem> for ScalerProblem {
    fn from(p: ContainerProblem) -> Self {
        ScalerProblem::new(p.kind(), p)
    }
}

/// What a spawn or destroy step failed at.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("scaler {0:?} is not a container scaler")]
    NotContainer(String),
    #[error(transparent)]
    Reference(#[from] crate::reference::ReferenceError),
    #[error(transparent)]
    Connect(#[from] crate::runtime::ConnectError),
    #[error(transparent)]
    Network(#[from] network::NetworkError),
    #[error("no address for the agent on {network}: {source}")]
    Lease {
        network: String,
        source: kici_store::AllocError,
    },
    #[error(transparent)]
    Auth(#[from] auth::AuthError),
    #[error("image {image} is not present and imagePullPolicy is Never")]
    ImageAbsent { image: String },
    #[error("pull {image}: {reason}")]
    Pull { image: String, reason: String },
    #[error("{call} on {endpoint}: {reason}")]
    Api {
        call: String,
        endpoint: String,
        reason: String,
    },
    #[error("{call} on {endpoint}: no answer within {deadline:?}")]
    Timeout {
        call: String,
        endpoint: String,
        deadline: Duration,
    },
    #[error("egress rules: {0}")]
    Egress(#[from] kici_netpolicy::NetPolicyError),
    #[error("failpoint {0}")]
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    Failpoint(String),
    #[error("release lease: {0}")]
    Release(kici_store::AllocError),
}

/// A connected runtime with its checked agent network.
struct Runtime {
    conn: Connection,
    network: NetworkInfo,
}

impl Runtime {
    /// One Engine call, bounded by `deadline`, errors naming the call.
    async fn call<T, F>(&self, call: &str, deadline: Duration, fut: F) -> Result<T, StepError>
    where
        F: std::future::Future<Output = Result<T, DockerError>>,
    {
        match tokio::time::timeout(deadline, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(StepError::Api {
                call: call.to_owned(),
                endpoint: self.conn.endpoint.to_string(),
                reason: e.to_string(),
            }),
            Err(_) => Err(StepError::Timeout {
                call: call.to_owned(),
                endpoint: self.conn.endpoint.to_string(),
                deadline,
            }),
        }
    }

    /// Like [`Self::call`], but `Ok(None)` when the daemon answers 404 (or
    /// 304 "already stopped").
    async fn call_opt<T, F>(
        &self,
        call: &str,
        deadline: Duration,
        fut: F,
    ) -> Result<Option<T>, StepError>
    where
        F: std::future::Future<Output = Result<T, DockerError>>,
    {
        match tokio::time::timeout(deadline, fut).await {
            Ok(Ok(v)) => Ok(Some(v)),
            Ok(Err(DockerError::DockerResponseServerError {
                status_code: 404 | 304,
                ..
            })) => Ok(None),
            Ok(Err(e)) => Err(StepError::Api {
                call: call.to_owned(),
                endpoint: self.conn.endpoint.to_string(),
                reason: e.to_string(),
            }),
            Err(_) => Err(StepError::Timeout {
                call: call.to_owned(),
                endpoint: self.conn.endpoint.to_string(),
                deadline,
            }),
        }
    }
}

/// What this daemon follows of one running agent.
struct Tracked {
    runtime: Arc<Runtime>,
    /// Set by destroy: the exit is then expected and not reported.
    destroying: Arc<AtomicBool>,
    logs: Option<JoinHandle<()>>,
    watch: JoinHandle<()>,
}

struct Inner {
    options: ContainerOptions,
    forwarded: ForwardedEnv,
    /// Connected runtimes by what the scaler settings say; each is
    /// connected (and its network ensured) once.
    runtimes: tokio::sync::Mutex<HashMap<RuntimeTarget, Arc<Runtime>>>,
    tracked: parking_lot::Mutex<HashMap<AgentId, Tracked>>,
    /// One pull at a time per image reference (concurrent spawns of the same
    /// image wait for the first pull instead of pulling it N times).
    pulls: parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Held shared by a spawn from create until its rules are installed,
    /// exclusively by [`ContainerBackend::sweep_stale_rules`].
    rules_gate: tokio::sync::RwLock<()>,
}

/// The container [`Backend`]. Cheap to clone.
#[derive(Clone)]
pub struct ContainerBackend {
    inner: Arc<Inner>,
}

/// What [`ContainerBackend::check_host`] found for one scaler.
#[derive(Debug, Default)]
pub struct HostCheck {
    /// `unix:///var/run/docker.sock`, ...
    pub endpoint: Option<String>,
    pub runtime: Option<RuntimeKind>,
    pub version: Option<String>,
    pub api_version: Option<String>,
    /// `<id> (bridge <if>, gateway <ip>)` when the network is as expected.
    pub network: Option<String>,
    /// Everything that would make spawns fail.
    pub problems: Vec<ContainerProblem>,
}

impl HostCheck {
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// Each problem as a full sentence.
    pub fn messages(&self) -> Vec<String> {
        self.problems.iter().map(ToString::to_string).collect()
    }
}

fn failpoint(name: &'static str) -> Result<(), StepError> {
    // Without the `failpoints` feature the macro expands to nothing.
    let _ = name;
    fail::fail_point!(name, |_| Err(StepError::Failpoint(name.to_owned())));
    Ok(())
}

fn settings_of(scaler: &ScalerEntry) -> Result<&ContainerSettings, StepError> {
    match &scaler.backend {
        BackendSettings::Container(s) => Ok(s),
        _ => Err(StepError::NotContainer(scaler.name.to_string())),
    }
}

/// Engine-call bound where no scaler is at hand (destroy, sweeps).
fn default_api_deadline() -> Duration {
    kici_model::Deadlines::defaults_for(ScalerType::Container).api_call
}

fn describe_exit(code: i64, oom: bool) -> String {
    if oom {
        format!("killed: out of memory (OOMKilled, exit status {code})")
    } else {
        format!("exit status {code}")
    }
}

impl ContainerBackend {
    pub fn new(options: ContainerOptions) -> Result<Self, ContainerSetupError> {
        let forwarded = ForwardedEnv::from_vars(options.forwarded_env.clone())?;
        if options.pids_limit <= 0 {
            return Err(ContainerSetupError::PidsLimit(options.pids_limit));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                options,
                forwarded,
                runtimes: tokio::sync::Mutex::new(HashMap::new()),
                tracked: parking_lot::Mutex::new(HashMap::new()),
                pulls: parking_lot::Mutex::new(HashMap::new()),
                rules_gate: tokio::sync::RwLock::new(()),
            }),
        })
    }

    pub fn options(&self) -> &ContainerOptions {
        &self.inner.options
    }

    /// The runtime of `scaler`, connected and with its network ensured.
    async fn runtime_for(&self, scaler: &ScalerEntry) -> Result<Arc<Runtime>, StepError> {
        let settings = settings_of(scaler)?;
        let target = RuntimeTarget::of(settings, self.inner.options.tls.as_ref())?;
        self.runtime_at(target, scaler.ext.deadlines.api_call).await
    }

    async fn runtime_at(
        &self,
        target: RuntimeTarget,
        deadline: Duration,
    ) -> Result<Arc<Runtime>, StepError> {
        let options = &self.inner.options;
        let mut runtimes = self.inner.runtimes.lock().await;
        if let Some(rt) = runtimes.get(&target) {
            return Ok(rt.clone());
        }
        let conn = target.connect(options.tls.as_ref(), deadline).await?;
        let network = network::ensure(&conn, &options.network, deadline).await?;
        tracing::info!(
            endpoint = %conn.endpoint,
            runtime = %conn.kind,
            version = %conn.version,
            api = %conn.api_version,
            network = %network,
            "container runtime connected"
        );
        let rt = Arc::new(Runtime { conn, network });
        runtimes.insert(target, rt.clone());
        Ok(rt)
    }

    /// Every runtime connected so far (destroy and sweeps look there); when
    /// none is yet (no scaler validated), the auto-detected one. An error
    /// when nothing answers: "nothing found" must never be concluded from
    /// a runtime that is down.
    async fn connected(&self) -> Result<Vec<Arc<Runtime>>, StepError> {
        let mut all: Vec<Arc<Runtime>> = Vec::new();
        for rt in self.inner.runtimes.lock().await.values() {
            // Two targets (auto, explicit socket) may reach one endpoint.
            if !all.iter().any(|o| o.conn.endpoint == rt.conn.endpoint) {
                all.push(rt.clone());
            }
        }
        if all.is_empty() {
            all.push(
                self.runtime_at(RuntimeTarget::Probe(None), default_api_deadline())
                    .await?,
            );
        }
        Ok(all)
    }

    /// Serve start-up and `kici-scaler doctor`: the runtime answers, the
    /// network is as expected (created when missing), the label sets'
    /// images are well-formed and their limits fit the host.
    pub async fn check_host(&self, scaler: &ScalerEntry) -> HostCheck {
        let mut check = HostCheck::default();
        let settings = match settings_of(scaler) {
            Ok(s) => s,
            Err(e) => {
                check.problems.push(ContainerProblem::Runtime(e));
                return check;
            }
        };
        let mut images = Vec::new();
        for (i, set) in scaler.label_sets.iter().enumerate() {
            match &set.backend {
                LabelSetBackend::Container { image, .. } => match ImageReference::parse(image) {
                    Ok(r) => images.push(r),
                    Err(source) => check
                        .problems
                        .push(ContainerProblem::Image { index: i, source }),
                },
                _ => check
                    .problems
                    .push(ContainerProblem::NotContainerLabelSet { index: i }),
            }
        }
        match RuntimeTarget::of(settings, self.inner.options.tls.as_ref()) {
            Ok(RuntimeTarget::Fixed { endpoint, .. })
                if !endpoint.is_local() && settings.network_isolation =>
            {
                check
                    .problems
                    .push(ContainerProblem::RemoteIsolation { endpoint });
            }
            _ => {}
        }
        let rt = match self.runtime_for(scaler).await {
            Ok(rt) => rt,
            Err(e) => {
                check.problems.push(ContainerProblem::Runtime(e));
                return check;
            }
        };
        check.endpoint = Some(rt.conn.endpoint.to_string());
        check.runtime = Some(rt.conn.kind);
        check.version = Some(rt.conn.version.clone());
        check.api_version = Some(rt.conn.api_version.clone());
        check.network = Some(rt.network.to_string());
        let deadline = scaler.ext.deadlines.api_call;
        match rt.call("GET /info", deadline, rt.conn.docker.info()).await {
            Ok(info) => {
                let host_memory = info.mem_total.unwrap_or(0);
                let host_cpus = info.ncpu.unwrap_or(0);
                for (i, set) in scaler.label_sets.iter().enumerate() {
                    let Some(limits) = set.resources.as_ref().and_then(|r| r.mirrored().1) else {
                        continue;
                    };
                    if let Some(memory) = limits.memory {
                        let bytes = i64::try_from(memory.bytes()).unwrap_or(i64::MAX);
                        if host_memory > 0 && bytes > host_memory {
                            check.problems.push(ContainerProblem::MemoryExceedsHost {
                                index: i,
                                bytes,
                                host_bytes: host_memory,
                                endpoint: rt.conn.endpoint.clone(),
                            });
                        }
                    }
                    if let Some(cpus) = limits.cpus {
                        let millis = i64::try_from(cpus.millis()).unwrap_or(i64::MAX);
                        if host_cpus > 0 && millis > host_cpus * 1000 {
                            check.problems.push(ContainerProblem::CpusExceedHost {
                                index: i,
                                cores: cpus.as_cores().to_string(),
                                host_cpus,
                                endpoint: rt.conn.endpoint.clone(),
                            });
                        }
                    }
                }
            }
            Err(e) => check.problems.push(ContainerProblem::Runtime(e)),
        }
        let capacity = self.inner.options.network.pool.capacity();
        if scaler.max_agents > capacity {
            check.problems.push(ContainerProblem::PoolTooSmall {
                max_agents: scaler.max_agents,
                capacity,
                network: self.inner.options.network.name.clone(),
                pool: self.inner.options.network.pool.to_string(),
            });
        }
        check
    }

    /// Removes the egress rules of this instance's agents that have no
    /// container any more (a crash between remove and rule removal), so a
    /// reused address never inherits an old allowlist. Returns the agents
    /// whose rules were removed. A container that exists (running or not)
    /// keeps its rules; a runtime that does not answer fails the sweep
    /// (its containers cannot be told apart from dead ones).
    ///
    /// Spawns wait while it runs: a container created and given its rules
    /// between the listing and the sweep would otherwise lose them.
    pub async fn sweep_stale_rules(&self) -> Result<Vec<AgentId>, BackendError> {
        let _no_spawn_in_between = self.inner.rules_gate.write().await;
        let live: Vec<AgentId> = self
            .list_owned()
            .await?
            .into_iter()
            .filter_map(|o| o.agent)
            .collect();
        self.inner
            .options
            .egress
            .sweep_stale(&live)
            .await
            .map_err(|e| ContainerError::Unavailable(StepError::Egress(e)).into())
    }

    fn pull_lock(&self, image: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.inner
            .pulls
            .lock()
            .entry(image.to_owned())
            .or_default()
            .clone()
    }

    /// Makes the image present per `policy`.
    async fn ensure_image(
        &self,
        rt: &Runtime,
        image: &ImageReference,
        policy: ImagePullPolicy,
        api_deadline: Duration,
        pull_deadline: Instant,
    ) -> Result<(), StepError> {
        let docker = &rt.conn.docker;
        let present = || async {
            rt.call_opt(
                "GET /images/{name}/json",
                api_deadline,
                docker.inspect_image(image.as_str()),
            )
            .await
            .map(|found| found.is_some())
        };
        match policy {
            ImagePullPolicy::Never => {
                return if present().await? {
                    Ok(())
                } else {
                    Err(StepError::ImageAbsent {
                        image: image.to_string(),
                    })
                };
            }
            ImagePullPolicy::IfNotPresent => {
                if present().await? {
                    return Ok(());
                }
            }
            // A digest names immutable content: present is up to date.
            ImagePullPolicy::Always if image.is_digest_pinned() => {
                if present().await? {
                    return Ok(());
                }
            }
            ImagePullPolicy::Always => {}
        }
        let lock = self.pull_lock(image.as_str());
        let _one_pull = lock.lock().await;
        let config = self
            .inner
            .options
            .registry_config
            .clone()
            .or_else(auth::default_config_path);
        let credentials = match &config {
            Some(path) => auth::credentials_for(path, image.registry()).await?,
            None => None,
        };
        let options = CreateImageOptions {
            from_image: Some(image.repository()),
            tag: Some(image.pull_tag().to_owned()),
            ..Default::default()
        };
        let pull_error = |reason: String| StepError::Pull {
            image: image.to_string(),
            reason,
        };
        tracing::info!(image = %image, authenticated = credentials.is_some(), "pulling image");
        let mut stream = docker.create_image(Some(options), None, credentials);
        loop {
            match tokio::time::timeout_at(pull_deadline, stream.next()).await {
                Err(_) => {
                    return Err(pull_error(
                        "not finished within provisionTimeout".to_owned(),
                    ))
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(pull_error(e.to_string())),
                Ok(Some(Ok(info))) => {
                    if let Some(detail) = info.error_detail.and_then(|d| d.message) {
                        return Err(pull_error(detail));
                    }
                }
            }
        }
        Ok(())
    }

    async fn spawn_steps(
        &self,
        spec: &SpawnSpec,
        rt_slot: &mut Option<Arc<Runtime>>,
    ) -> Result<ResourceHandle, StepError> {
        let started = Instant::now();
        let options = &self.inner.options;
        let scaler = &spec.scaler;
        let settings = settings_of(scaler)?;
        let LabelSetBackend::Container {
            image,
            image_pull_policy,
            container_socket,
            volumes,
        } = &spec.label_set.backend
        else {
            return Err(StepError::NotContainer(scaler.name.to_string()));
        };
        let image = ImageReference::parse(image)?;
        let deadlines = scaler.ext.deadlines;
        let api = deadlines.api_call;
        let rt = self.runtime_for(scaler).await?;
        *rt_slot = Some(rt.clone());
        let agent = spec.agent;

        let lease: Lease = options
            .allocator
            .allocate(&options.network.pool, &agent)
            .await
            .map_err(|source| StepError::Lease {
                network: options.network.name.clone(),
                source,
            })?;
        failpoint("kici_container::spawn::lease")?;

        self.ensure_image(
            &rt,
            &image,
            *image_pull_policy,
            api,
            started + deadlines.provision,
        )
        .await?;
        failpoint("kici_container::spawn::pull")?;

        let env = agent_env(
            spec,
            ScalerType::Container,
            &SystemEnv::default(),
            &self.inner.forwarded,
        );
        let socket_on_host = match (&options.socket_on_host, &rt.conn.endpoint) {
            (Some(path), _) => Some(path.clone()),
            (None, crate::runtime::Endpoint::Unix(path)) => Some(path.clone()),
            (None, _) => None,
        };
        if *container_socket {
            match &socket_on_host {
                Some(path) => tracing::warn!(
                    agent_id = %agent,
                    scaler = scaler.name.as_str(),
                    socket = %path.display(),
                    "containerSocket: the agent and every job it runs get full control of the \
                     host's container runtime (root-equivalent on this host)"
                ),
                None => tracing::warn!(
                    agent_id = %agent,
                    scaler = scaler.name.as_str(),
                    "containerSocket ignored: the runtime is remote, there is no host socket to mount"
                ),
            }
        }
        let ulimits = scaler_ulimits(&options.ulimits, &scaler.ext.ulimits);
        let body = create_body(
            spec,
            &ContainerLabelSet {
                image: &image,
                container_socket: *container_socket,
                volumes,
                read_only_rootfs: spec.label_set.ext.read_only_rootfs,
            },
            &CreateContext {
                instance: options.instance,
                kind: rt.conn.kind,
                network: &options.network.name,
                ip: lease.ip,
                env: &env,
                extra_hosts: &settings.extra_hosts,
                pids_limit: options.pids_limit,
                ulimits: &ulimits,
                socket_on_host,
                stop_timeout: deadlines.destroy_grace,
            },
        );
        let name = container_name(&agent);
        // Until the rules are in: a rule sweep now would not see them
        // belong to a container.
        let rules_gate = self.inner.rules_gate.read().await;
        let created = rt
            .call(
                "POST /containers/create",
                api,
                rt.conn.docker.create_container(
                    Some(CreateContainerOptions {
                        name: Some(name.clone()),
                        ..Default::default()
                    }),
                    body,
                ),
            )
            .await?;
        for warning in &created.warnings {
            tracing::warn!(agent_id = %agent, warning = %warning, "container create warning");
        }
        failpoint("kici_container::spawn::create")?;

        if settings.network_isolation {
            options
                .egress
                .install(
                    &EgressTarget {
                        agent,
                        ip: lease.ip,
                        mac: agent_mac(lease.ip).0,
                        // A container's veth is created at start: not known yet.
                        port: None,
                        bridge: rt.network.bridge.clone(),
                        gateway: rt.network.gateway,
                    },
                    spec.label_set.network_policy.as_ref(),
                )
                .await?;
        }
        drop(rules_gate);
        failpoint("kici_container::spawn::rules")?;

        rt.call(
            "POST /containers/{id}/start",
            api,
            rt.conn
                .docker
                .start_container(&created.id, None::<StartContainerOptions>),
        )
        .await
        .map_err(|e| match e {
            // Podman asks for its own default rlimits, which root cannot
            // raise on hosts with lower hard limits.
            StepError::Api {
                call,
                endpoint,
                reason,
            } if reason.contains("rlimit") => StepError::Api {
                call,
                endpoint,
                reason: format!(
                    "{reason} (the runtime could not set the container's rlimits: configure \
                     ulimits within this host's hard limits, e.g. nofile=20000:20000 and \
                     nproc=4096:4096)"
                ),
            },
            other => other,
        })?;
        failpoint("kici_container::spawn::start")?;

        self.follow(&rt, spec.agent, &created.id, spec, spec.reports.clone(), 0);
        let mut extra = BTreeMap::from([
            ("name".to_owned(), name),
            ("endpoint".to_owned(), rt.conn.endpoint.to_string()),
            ("ip".to_owned(), lease.ip.to_string()),
            ("network".to_owned(), options.network.name.clone()),
        ]);
        extra.insert("runtime".to_owned(), rt.conn.kind.to_string());
        tracing::info!(
            agent_id = %agent,
            scaler = scaler.name.as_str(),
            job_id = spec.job.as_ref().map(|j| j.as_str()),
            container = %created.id,
            ip = %lease.ip,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "container agent started"
        );
        Ok(ResourceHandle {
            id: created.id,
            extra,
        })
    }

    /// Starts forwarding output and watching the exit of a running agent.
    fn follow(
        &self,
        rt: &Arc<Runtime>,
        agent: AgentId,
        container: &str,
        spec: &SpawnSpec,
        reports: ReportSender,
        logs_since: i32,
    ) {
        let ctx = LogContext {
            agent,
            scaler: spec.scaler.name.clone(),
            job: spec.job.clone(),
            source: rt.conn.kind.as_str(),
        };
        self.follow_with(rt, agent, container, ctx, reports, logs_since);
    }

    fn follow_with(
        &self,
        rt: &Arc<Runtime>,
        agent: AgentId,
        container: &str,
        ctx: LogContext,
        reports: ReportSender,
        logs_since: i32,
    ) {
        let tail = Arc::new(logs::Tail::default());
        let logs = logs::forward(
            rt.conn.docker.clone(),
            container.to_owned(),
            ctx,
            logs_since,
            tail.clone(),
        );
        let destroying = Arc::new(AtomicBool::new(false));
        let watch = tokio::spawn(watch_exit(
            rt.clone(),
            container.to_owned(),
            agent,
            reports,
            destroying.clone(),
            tail,
        ));
        let previous = self.inner.tracked.lock().insert(
            agent,
            Tracked {
                runtime: rt.clone(),
                destroying,
                logs: Some(logs),
                watch,
            },
        );
        if let Some(previous) = previous {
            previous.destroying.store(true, Ordering::SeqCst);
            previous.watch.abort();
            if let Some(logs) = previous.logs {
                logs.abort();
            }
        }
    }

    /// Removes everything of `agent`: the container on each of `runtimes`
    /// (only if it carries our instance label), the rules, the lease.
    async fn teardown(
        &self,
        agent: AgentId,
        container: Option<&str>,
        runtimes: &[Arc<Runtime>],
        logs: Option<JoinHandle<()>>,
        grace: Duration,
        api: Duration,
    ) -> Result<(), Vec<StepError>> {
        let mut errors = Vec::new();
        let name = container_name(&agent);
        let mut logs = logs;
        for rt in runtimes {
            let docker = &rt.conn.docker;
            // By id when we have it (a renamed container is still ours), by
            // name otherwise; only ours by label is touched.
            let mut target = container.map(str::to_owned);
            let inspected = match rt
                .call_opt(
                    "GET /containers/{id}/json",
                    api,
                    states::inspect_container(docker, target.as_deref().unwrap_or(&name)),
                )
                .await
            {
                Ok(Some(c)) => Some(c),
                Ok(None) if target.is_some() => {
                    target = None;
                    match rt
                        .call_opt(
                            "GET /containers/{id}/json",
                            api,
                            states::inspect_container(docker, &name),
                        )
                        .await
                    {
                        Ok(c) => c,
                        Err(e) => {
                            errors.push(e);
                            continue;
                        }
                    }
                }
                Ok(None) => None,
                Err(e @ StepError::Api { .. }) if container.is_some() => {
                    // The id is our own create's: ours without its labels.
                    // An answer that cannot be read must not leave the
                    // container behind; a forced removal kills it if it runs.
                    let id = container.unwrap_or(&name);
                    tracing::warn!(
                        agent_id = %agent,
                        container = %id,
                        error = %e,
                        "cannot read the container's state; removing it by id"
                    );
                    if let Err(removal) = remove_forced(rt, id, api).await {
                        errors.push(e);
                        errors.push(removal);
                    }
                    continue;
                }
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            let Some(inspected) = inspected else {
                continue;
            };
            let labels = inspected
                .config
                .as_ref()
                .and_then(|c| c.labels.clone())
                .unwrap_or_default();
            let ours = labels.get(LABEL_INSTANCE).map(String::as_str)
                == Some(self.inner.options.instance.to_string().as_str())
                && labels.get(LABEL_AGENT).map(String::as_str) == Some(agent.to_string().as_str());
            if !ours {
                tracing::warn!(
                    agent_id = %agent,
                    container = %name,
                    endpoint = %rt.conn.endpoint,
                    "a container with this agent's name is not ours (owner labels differ); left alone"
                );
                continue;
            }
            let id = inspected.id.clone().unwrap_or(name.clone());
            let running = inspected
                .state
                .as_ref()
                .and_then(|s| s.running)
                .unwrap_or(false);
            if running {
                let t = i32::try_from(grace.as_secs()).unwrap_or(i32::MAX);
                let stopped = rt
                    .call_opt(
                        "POST /containers/{id}/stop",
                        api + grace,
                        docker.stop_container(
                            &id,
                            Some(StopContainerOptions {
                                t: Some(t),
                                signal: None,
                            }),
                        ),
                    )
                    .await;
                if let Err(e) = stopped {
                    tracing::warn!(agent_id = %agent, error = %e, "stop failed; killing");
                    let killed = rt
                        .call_opt(
                            "POST /containers/{id}/kill",
                            api,
                            docker.kill_container(
                                &id,
                                Some(KillContainerOptions {
                                    signal: "SIGKILL".to_owned(),
                                }),
                            ),
                        )
                        .await;
                    if let Err(e) = killed {
                        // 409 "is not running": it stopped in between.
                        if !e.to_string().contains("409") {
                            tracing::warn!(agent_id = %agent, error = %e, "kill failed");
                        }
                    }
                }
            }
            if let Err(e) = failpoint("kici_container::destroy::stop") {
                errors.push(e);
                return Err(errors);
            }
            // The container stopped: its log stream ends after the last line.
            if let Some(task) = logs.take() {
                let abort = task.abort_handle();
                if tokio::time::timeout(LOG_DRAIN, task).await.is_err() {
                    abort.abort();
                }
            }
            if let Err(e) = remove_forced(rt, &id, api).await {
                errors.push(e);
            }
            if let Err(e) = failpoint("kici_container::destroy::remove") {
                errors.push(e);
                return Err(errors);
            }
        }
        if let Some(task) = logs {
            task.abort();
        }
        if !errors.is_empty() {
            // Rules and lease stay until the container is surely gone: a
            // live container must never run without its rules.
            return Err(errors);
        }
        let options = &self.inner.options;
        if let Err(e) = options.egress.remove(&agent).await {
            errors.push(e.into());
            return Err(errors);
        }
        if let Err(e) = failpoint("kici_container::destroy::rules") {
            errors.push(e);
            return Err(errors);
        }
        if let Err(e) = options.allocator.release_agent(&agent).await {
            errors.push(StepError::Release(e));
            return Err(errors);
        }
        if let Err(e) = failpoint("kici_container::destroy::lease") {
            errors.push(e);
            return Err(errors);
        }
        Ok(())
    }

    /// Runtimes to look for `agent` in: the one its handle names, else every
    /// connected one, else the default probe.
    async fn runtimes_for_destroy(
        &self,
        handle: Option<&ResourceHandle>,
    ) -> Result<Vec<Arc<Runtime>>, StepError> {
        let connected = self.connected().await?;
        if let Some(endpoint) = handle.and_then(|h| h.extra.get("endpoint")) {
            let named: Vec<_> = connected
                .iter()
                .filter(|rt| rt.conn.endpoint.to_string() == *endpoint)
                .cloned()
                .collect();
            if !named.is_empty() {
                return Ok(named);
            }
        }
        Ok(connected)
    }
}

/// `DELETE /containers/{id}?force=true&v=true` (anonymous volumes too: see
/// docs/deviations.md, D-container-cleanup);
/// gone already or being removed (a concurrent destroy) counts as done.
async fn remove_forced(rt: &Runtime, id: &str, api: Duration) -> Result<(), StepError> {
    let removed = rt
        .call_opt(
            "DELETE /containers/{id}",
            api,
            rt.conn.docker.remove_container(
                id,
                Some(RemoveContainerOptions {
                    force: true,
                    v: true,
                    link: false,
                }),
            ),
        )
        .await;
    match removed {
        Ok(_) => Ok(()),
        Err(StepError::Api { reason, .. }) if reason.contains("409") => Ok(()),
        Err(e) => Err(e),
    }
}

/// The ulimits of a scaler's agents: the daemon's defaults, each name the
/// scaler's `x-kici-scaler.ulimits` sets replaced by the scaler's value.
pub fn scaler_ulimits(
    daemon: &[Ulimit],
    scaler: &BTreeMap<UlimitName, UlimitValue>,
) -> Vec<Ulimit> {
    let mut out: Vec<Ulimit> = daemon
        .iter()
        .filter(|u| !scaler.keys().any(|n| n.as_str() == u.name))
        .cloned()
        .collect();
    out.extend(scaler.iter().map(|(name, value)| Ulimit {
        name: name.as_str().to_owned(),
        // UlimitValue keeps both at most i64::MAX.
        soft: i64::try_from(value.soft()).unwrap_or(i64::MAX),
        hard: i64::try_from(value.hard()).unwrap_or(i64::MAX),
    }));
    out
}

/// The agent's MAC: `02:42` + the four octets of its address. Docker's
/// bridge driver before API 1.44 derives exactly this (and ignores a MAC it
/// is given); newer Docker and Podman are given it on the endpoint. Locally
/// administered, unicast.
pub fn agent_mac(ip: std::net::Ipv4Addr) -> kici_store::MacAddress {
    let [a, b, c, d] = ip.octets();
    kici_store::MacAddress([0x02, 0x42, a, b, c, d])
}

/// Waits for the container to stop and reports how it ended, unless
/// destroy caused it.
async fn watch_exit(
    rt: Arc<Runtime>,
    container: String,
    agent: AgentId,
    reports: ReportSender,
    destroying: Arc<AtomicBool>,
    tail: Arc<logs::Tail>,
) {
    let docker = &rt.conn.docker;
    let mut failures = 0;
    let detail = loop {
        let mut stream = docker.wait_container(
            &container,
            Some(WaitContainerOptions {
                condition: "not-running".to_owned(),
            }),
        );
        let code = match stream.next().await {
            Some(Ok(answer)) => Some(answer.status_code),
            Some(Err(DockerError::DockerContainerWaitError { code, .. })) => Some(code),
            Some(Err(DockerError::DockerResponseServerError {
                status_code: 404, ..
            })) => break "container removed".to_owned(),
            // bollard's own header timeout on a very long wait: ask again.
            Some(Err(DockerError::RequestTimeoutError)) => continue,
            Some(Err(e)) => {
                failures += 1;
                if failures >= WATCH_ATTEMPTS {
                    break format!("lost track of the container: {e}");
                }
                tokio::time::sleep(WATCH_RETRY).await;
                continue;
            }
            None => {
                failures += 1;
                if failures >= WATCH_ATTEMPTS {
                    break "lost track of the container: wait stream ended".to_owned();
                }
                tokio::time::sleep(WATCH_RETRY).await;
                continue;
            }
        };
        let inspected = states::inspect_container(docker, &container).await.ok();
        let state = inspected.and_then(|c| c.state);
        let oom = state.as_ref().and_then(|s| s.oom_killed).unwrap_or(false);
        let code = state
            .as_ref()
            .and_then(|s| s.exit_code)
            .or(code)
            .unwrap_or(-1);
        break describe_exit(code, oom);
    };
    tracing::info!(agent_id = %agent, container = %container, detail = %detail, "container agent exited");
    if !destroying.load(Ordering::SeqCst) {
        // Why it ended is usually in what it said last.
        let output = tail.text(LOG_DRAIN).await;
        let detail = if output.is_empty() {
            detail
        } else {
            format!("{detail}\n--- captured output ---\n{output}")
        };
        // The engine may be gone (shutdown): nothing to tell then.
        let _ = reports.send(BackendReport::Exited { agent, detail });
    }
}

fn join_errors<E: Display>(errors: &[E]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

#[async_trait]
impl Backend for ContainerBackend {
    fn kind(&self) -> ScalerType {
        ScalerType::Container
    }

    async fn validate(&self, scaler: &ScalerEntry) -> Result<(), ScalerProblems> {
        let check = self.check_host(scaler).await;
        ScalerProblems::check(check.problems.into_iter().map(Into::into).collect())
    }

    async fn spawn(&self, spec: SpawnSpec) -> Result<ResourceHandle, BackendError> {
        let agent = spec.agent;
        let mut rt = None;
        match self.spawn_steps(&spec, &mut rt).await {
            Ok(handle) => Ok(handle),
            Err(e) => {
                tracing::warn!(agent_id = %agent, error = %e, "container spawn failed; removing what it created");
                if let (Some(failed), StepError::Api { reason, .. }) = (&rt, &e) {
                    if reason.contains("network") && reason.contains("not found") {
                        // The agent network was removed behind our back:
                        // the next spawn reconnects and re-creates it.
                        self.inner
                            .runtimes
                            .lock()
                            .await
                            .retain(|_, r| !Arc::ptr_eq(r, failed));
                    }
                }
                let runtimes: Vec<_> = rt.into_iter().collect();
                let api = spec.scaler.ext.deadlines.api_call;
                if let Err(errors) = self
                    .teardown(agent, None, &runtimes, None, Duration::ZERO, api)
                    .await
                {
                    tracing::error!(
                        agent_id = %agent,
                        errors = %join_errors(&errors),
                        "cleanup after a failed spawn incomplete; the reconciler retries"
                    );
                    return Err(ContainerError::SpawnCleanupIncomplete {
                        source: e,
                        cleanup: errors,
                    }
                    .into());
                }
                Err(ContainerError::Spawn(e).into())
            }
        }
    }

    async fn destroy(
        &self,
        agent: &AgentId,
        handle: Option<&ResourceHandle>,
        grace: Duration,
    ) -> Result<(), BackendError> {
        let tracked = self.inner.tracked.lock().remove(agent);
        let (runtimes, logs) = match tracked {
            Some(t) => {
                t.destroying.store(true, Ordering::SeqCst);
                (vec![t.runtime.clone()], t.logs)
            }
            None => (
                self.runtimes_for_destroy(handle)
                    .await
                    .map_err(|e| ContainerError::Destroy {
                        agent: *agent,
                        steps: vec![e],
                    })?,
                None,
            ),
        };
        let api = default_api_deadline();
        let container = handle.map(|h| h.id.as_str()).filter(|id| !id.is_empty());
        self.teardown(*agent, container, &runtimes, logs, grace, api)
            .await
            .map_err(|steps| ContainerError::Destroy {
                agent: *agent,
                steps,
            })?;
        tracing::info!(agent_id = %agent, "container agent destroyed");
        Ok(())
    }

    async fn list_owned(&self) -> Result<Vec<OwnedResource>, BackendError> {
        let instance = self.inner.options.instance.to_string();
        let filters = HashMap::from([(
            "label".to_owned(),
            vec![format!("{LABEL_INSTANCE}={instance}")],
        )]);
        let mut owned = Vec::new();
        let api = default_api_deadline();
        let runtimes = self
            .connected()
            .await
            .map_err(ContainerError::Unavailable)?;
        for rt in runtimes {
            let list = rt
                .call(
                    "GET /containers/json",
                    api,
                    states::list_containers(
                        &rt.conn.docker,
                        ListContainersOptions {
                            all: true,
                            filters: Some(filters.clone()),
                            ..Default::default()
                        },
                    ),
                )
                .await
                .map_err(ContainerError::Unavailable)?;
            for c in list {
                let labels = c.labels.clone().unwrap_or_default();
                // The filter is the daemon's; check again, it is cheap.
                if labels.get(LABEL_INSTANCE) != Some(&instance) {
                    continue;
                }
                let agent = labels.get(LABEL_AGENT).and_then(|a| a.parse().ok());
                let mut extra =
                    BTreeMap::from([("endpoint".to_owned(), rt.conn.endpoint.to_string())]);
                if let Some(name) = c.names.as_ref().and_then(|n| n.first()) {
                    extra.insert("name".to_owned(), name.trim_start_matches('/').to_owned());
                }
                if let Some(scaler) = labels.get(LABEL_SCALER) {
                    extra.insert("scaler".to_owned(), scaler.clone());
                }
                if let Some(state) = &c.state {
                    extra.insert("state".to_owned(), state.to_string());
                }
                let created_at = c
                    .created
                    .and_then(|s| u64::try_from(s).ok())
                    .map_or(SystemTime::UNIX_EPOCH, |s| {
                        SystemTime::UNIX_EPOCH + Duration::from_secs(s)
                    });
                owned.push(OwnedResource {
                    agent,
                    handle: ResourceHandle {
                        id: c.id.clone().unwrap_or_default(),
                        extra,
                    },
                    created_at,
                });
            }
        }
        Ok(owned)
    }

    async fn adopt(
        &self,
        agent: &AgentId,
        handle: &ResourceHandle,
        reports: ReportSender,
    ) -> Result<Adoption, BackendError> {
        let api = default_api_deadline();
        let name = container_name(agent);
        let target = if handle.id.is_empty() {
            name.as_str()
        } else {
            handle.id.as_str()
        };
        let runtimes = self
            .runtimes_for_destroy(Some(handle))
            .await
            .map_err(ContainerError::Unavailable)?;
        for rt in runtimes {
            let found = rt
                .call_opt(
                    "GET /containers/{id}/json",
                    api,
                    states::inspect_container(&rt.conn.docker, target),
                )
                .await
                .map_err(ContainerError::Unavailable)?;
            let Some(c) = found else { continue };
            let labels = c
                .config
                .as_ref()
                .and_then(|cfg| cfg.labels.clone())
                .unwrap_or_default();
            let ours = labels.get(LABEL_INSTANCE) == Some(&self.inner.options.instance.to_string())
                && labels.get(LABEL_AGENT) == Some(&agent.to_string());
            let running = c.state.as_ref().and_then(|s| s.running).unwrap_or(false);
            if !ours || !running {
                return Ok(Adoption::Gone);
            }
            let id = c.id.clone().unwrap_or_else(|| target.to_owned());
            let scaler = labels
                .get(LABEL_SCALER)
                .map(|s| kici_model::ScalerName::new(s))
                .ok_or_else(|| ContainerError::NoScalerLabel {
                    agent: *agent,
                    container: id.clone(),
                })?;
            let job = labels
                .get(crate::create::LABEL_JOB)
                .and_then(|j| j.parse().ok());
            // Output before the restart was forwarded by the previous daemon.
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| i32::try_from(d.as_secs()).unwrap_or(i32::MAX));
            self.follow_with(
                &rt,
                *agent,
                &id,
                LogContext {
                    agent: *agent,
                    scaler,
                    job,
                    source: rt.conn.kind.as_str(),
                },
                reports,
                now,
            );
            tracing::info!(agent_id = %agent, container = %id, "container agent adopted");
            return Ok(Adoption::Alive);
        }
        Ok(Adoption::Gone)
    }
}
