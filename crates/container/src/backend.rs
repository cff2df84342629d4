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
//!
//! This module holds the backend's options, state and its [`Backend`]
//! implementation; the steps live in submodules: `spawn` (the steps above),
//! `pull` (images), `watch` (log stream and exit watch), `teardown`
//! (destroy and a failed spawn's clean-up), `adopt` (what is ours after a
//! restart), `host_check` ([`HostCheck`]) and `errors` ([`ContainerError`],
//! [`ContainerProblem`], [`StepError`]).

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

mod adopt;
mod errors;
mod host_check;
mod pull;
mod spawn;
mod teardown;
mod watch;

use errors::join_errors;
pub use errors::{ContainerError, ContainerProblem, StepError};
pub use host_check::HostCheck;

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
        self.owned_containers().await
    }

    async fn adopt(
        &self,
        agent: &AgentId,
        handle: &ResourceHandle,
        reports: ReportSender,
    ) -> Result<Adoption, BackendError> {
        self.adopt_container(agent, handle, reports).await
    }
}
